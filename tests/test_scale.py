"""Scaling out, with real processes on loopback: three ``nmt serve`` replicas behind a real nginx configured
by ``deploy/nginx/translator.conf`` and ``translator-http.conf`` (the compose stack's gRPC and HTTP/JSON
balancers, with the replicas' loopback addresses in place of ``translator``), and the same replicas balanced
by the client (gRPC ``round_robin``). Through nginx, gRPC and HTTP calls must reach every replica.

Each test sends a bounded run of concurrent translations; halfway it reads every replica's ``/metrics``
(each must have served a share, none above half) and sends SIGTERM to one replica. Not one call may fail:
the draining replica finishes what it holds, and what it refuses (UNAVAILABLE) the client retries on
another replica. The client's channel sees the replica turn NOT_SERVING and stops picking it; nginx
(open source) cannot see health, so there the replica is first taken out of the upstream (``nginx -s
reload``, the procedure of ``docs/operations.md``), as an orchestrator does before it stops a replica.
nginx is the Debian package (``.ci/run`` installs it when missing); without it the proxy test skips.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from clients.channel import channel_target, service_config
from clients.client import TranslatorClient
from clients.messages import TranslationError
from common.errors import NmtError
from deploy.nginx import standalone_config
from loadtests.cli import free_port, wait_serving
from server.metrics import HTTP_LABEL_PREFIX
from server.protos import SERVICE_NAME
from tests.conftest import SERVED_MODEL
from tests.test_server import TEXTS

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
REPLICAS = 3
CALLERS = 16
CALLS = 200  # before replica 0 gets SIGTERM, and again after it has exited
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed: apt-get install -y nginx-light "
                                                       "(.ci/run does it when run as root)")


@dataclass
class Replica:
    process: subprocess.Popen
    address: str
    metrics_port: int
    http_address: str

    def samples(self) -> list[Sample]:
        """This replica's own ``/metrics``."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    def served(self) -> float:
        """Translate calls this replica has completed over gRPC."""
        return sum(sample.value for sample in self.samples() if sample.name == "grpc_server_handled_total"
                   and sample.labels.get("grpc_service") == SERVICE_NAME
                   and sample.labels.get("grpc_method") == "Translate")

    def served_http(self) -> float:
        """Translate calls this replica has answered over HTTP (``POST /v1/translate``)."""
        return sum(sample.value for sample in self.samples() if sample.name == "nmt_requests_total"
                   and sample.labels.get("method") == HTTP_LABEL_PREFIX + "Translate")


@pytest.fixture(scope="module")
def scale_repository(model_version_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scale-models")
    shutil.copytree(model_version_dir, root / SERVED_MODEL / "1")
    return root


def launch(repository: Path, *flags: str) -> Replica:
    """One ``nmt serve`` on free loopback ports with ``flags``, starting."""
    address, metrics_port, http_address = f"127.0.0.1:{free_port()}", free_port(), f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt", "serve", "--model-repository", str(repository), "--listen", address,
         "--metrics-listen", f"127.0.0.1:{metrics_port}", "--http-listen", http_address, "--reload-interval", "0",
         "--provider", "cpu",
         "--intra-op-threads", "1", "--grace-seconds", "10", *flags],
        env=dict(os.environ, NMT_LOG_LEVEL="WARNING"))
    return Replica(process, address, metrics_port, http_address)


def serving(replica: Replica, repository: Path, *flags: str) -> Replica:
    """``replica`` once it serves. A port found free can be taken (as another connection's local port) before the
    server binds it: a replica that exited is launched again on other ports, twice at most."""
    for _ in range(2):
        try:
            wait_serving(replica.address, replica.process)
            return replica
        except NmtError:
            if replica.process.poll() is None:  # alive but not serving: not a lost port
                raise
            replica = launch(repository, *flags)
    wait_serving(replica.address, replica.process)
    return replica


@pytest.fixture
def replicas(scale_repository: Path) -> Iterator[list[Replica]]:
    started = [launch(scale_repository) for _ in range(REPLICAS)]
    try:
        for index, replica in enumerate(started):
            started[index] = serving(replica, scale_repository)
        yield started
    finally:
        for replica in started:
            if replica.process.poll() is None:
                replica.process.kill()
            replica.process.wait(30)


@dataclass
class Nginx:
    address: str
    config: Path
    port: int
    http_port: int
    workdir: Path

    def write_config(self, replicas: list[Replica]) -> None:
        """Both balancers over ``replicas``: gRPC on :attr:`port`, HTTP on :attr:`http_port`."""
        self.config.write_text(standalone_config([r.address for r in replicas], self.port, self.workdir,
                                                 http_upstreams=[r.http_address for r in replicas],
                                                 http_port=self.http_port), encoding="utf-8")

    def route_around(self, replicas: list[Replica], leaving: Replica) -> None:
        """Route to ``replicas`` only: rewrite the upstream, reload gracefully (old workers finish the calls
        they hold) and wait until ``leaving`` gets no more calls."""
        self.write_config(replicas)
        subprocess.run([NGINX, "-c", str(self.config), "-e", str(self.workdir / "error.log"), "-s", "reload"],
                       check=True, timeout=30)
        served, deadline = leaving.served(), time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.5)
            served, before = leaving.served(), served
            if served == before:
                return


@pytest.fixture
def nginx(replicas: list[Replica], tmp_path: Path) -> Iterator[Nginx]:
    if NGINX is None:
        pytest.skip("nginx is not installed: apt-get install -y nginx-light (.ci/run does it when run as root)")
    tmp_path.chmod(0o777)  # nginx's workers run as nobody when the test runs as root
    port, http_port = free_port(), free_port()
    proxy = Nginx(f"127.0.0.1:{port}", tmp_path / "nginx.conf", port, http_port, tmp_path)
    proxy.write_config(replicas)
    check = subprocess.run([NGINX, "-t", "-q", "-c", str(proxy.config), "-e", str(tmp_path / "error.log")],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    process = subprocess.Popen([NGINX, "-c", str(proxy.config), "-e", str(tmp_path / "error.log")])
    try:
        deadline = time.monotonic() + 20
        for listening in (port, http_port):
            while True:
                try:
                    socket.create_connection(("127.0.0.1", listening), timeout=1).close()
                    break
                except OSError:
                    assert process.poll() is None and time.monotonic() < deadline, \
                        (tmp_path / "error.log").read_text()
                    time.sleep(0.1)
        yield proxy
    finally:
        process.terminate()
        process.wait(30)


def run_with_one_replica_stopped(client: TranslatorClient, replicas: list[Replica],
                                 before_stop: Callable[[], None] = lambda: None) -> tuple[list[float], list[str]]:
    """Translations from :data:`CALLERS` threads: :data:`CALLS` of them, then the callers pause, each replica's
    served count is read once no call is in flight (read while calls go on, the replica read last would count
    more), ``before_stop`` runs and replica 0 gets SIGTERM; the callers go on until replica 0 has exited and
    :data:`CALLS` more are done. Returns those counts and the failures (``"CODE: message"``)."""
    lock, done, in_flight, failures, shares = threading.Lock(), [0], [0], [], []
    halfway, resume, finished = threading.Event(), threading.Event(), threading.Event()

    def caller(seed: int) -> None:
        i = seed
        while not finished.is_set():
            while True:  # the check and the count under one lock: no call starts unseen by the pause
                with lock:
                    if not halfway.is_set() or resume.is_set():
                        in_flight[0] += 1
                        break
                resume.wait()
            try:
                [result] = client.translate(TEXTS[i % len(TEXTS)], model=SERVED_MODEL)
                assert result.best.text
            except TranslationError as error:
                failures.append(f"{error} (after {error.attempts} attempts)")
            i += CALLERS
            with lock:
                in_flight[0] -= 1
                done[0] += 1
                if done[0] == CALLS:
                    halfway.set()

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(CALLERS)]
    for thread in threads:
        thread.start()
    try:
        assert halfway.wait(120)
        deadline = time.monotonic() + 60
        while in_flight[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        shares.extend(replica.served() for replica in replicas)
        resume.set()
        before_stop()
        replicas[0].process.send_signal(signal.SIGTERM)
        assert replicas[0].process.wait(30) == 0  # drained and exited cleanly
        target = done[0] + CALLS
        while done[0] < target and all(t.is_alive() for t in threads):
            time.sleep(0.05)
    finally:
        finished.set()
        resume.set()
        for thread in threads:
            thread.join(60)
    return shares, failures


def check_balance(shares: list[float]) -> None:
    total = sum(shares)
    assert total >= CALLS - CALLERS, shares
    assert all(0 < share <= total / 2 for share in shares), f"served per replica: {shares}"


def translate_over_http(port: int, text: str) -> str:
    """``POST /v1/translate`` on 127.0.0.1:``port``: the best translation."""
    body = json.dumps({"texts": [text], "model": SERVED_MODEL}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/translate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["translations"][0]["hypotheses"][0]["text"]


@needs_nginx
def test_nginx_sends_grpc_and_http_calls_to_every_replica(replicas: list[Replica], nginx: Nginx) -> None:
    calls = 2 * REPLICAS
    with TranslatorClient(nginx.address, timeout=30) as client:
        assert all(client.translate(TEXTS[i % len(TEXTS)], model=SERVED_MODEL)[0].best.text for i in range(calls))
    assert all(translate_over_http(nginx.http_port, TEXTS[i % len(TEXTS)]) for i in range(calls))
    served = [(replica.served(), replica.served_http()) for replica in replicas]
    assert sum(map(sum, served)) == 2 * calls and all(grpc_calls > 0 and http_calls > 0
                                                      for grpc_calls, http_calls in served), \
        f"(gRPC, HTTP) Translate calls per replica: {served}"


@needs_nginx
def test_nginx_balances_every_call_and_a_stopped_replica_loses_none(replicas: list[Replica], nginx: Nginx) -> None:
    with TranslatorClient(nginx.address, timeout=30) as client:
        shares, failures = run_with_one_replica_stopped(client, replicas,
                                                         lambda: nginx.route_around(replicas[1:], replicas[0]))
        assert not failures, failures
        check_balance(shares)
        assert client.translate("one two", model=SERVED_MODEL)[0].best.text  # the other two still serve


def test_client_round_robin_balances_and_a_stopped_replica_loses_none(replicas: list[Replica]) -> None:
    addresses = [r.address for r in replicas]
    with TranslatorClient(addresses, timeout=30) as client:
        shares, failures = run_with_one_replica_stopped(client, replicas)
        assert not failures, failures
        check_balance(shares)


def test_targets_and_service_config() -> None:
    assert channel_target("127.0.0.1:5") == "127.0.0.1:5"
    assert channel_target("dns:///translator.nmt.svc:50051") == "dns:///translator.nmt.svc:50051"
    assert channel_target("127.0.0.1:5, localhost:6") == "ipv4:127.0.0.1:5,127.0.0.1:6"
    assert channel_target(["[::1]:5", "::1:6"]) == "ipv6:[::1]:5,[::1]:6"
    with pytest.raises(ValueError, match="host:port"):
        channel_target("127.0.0.1:5,nowhere")
    assert '"round_robin"' in service_config(health_check=False)
    assert SERVICE_NAME in service_config(health_check=True)
    assert TranslatorClient("127.0.0.1:5,127.0.0.1:6").target == "ipv4:127.0.0.1:5,127.0.0.1:6"


def test_the_null_engine_serves_each_sentence_its_own_words(scale_repository: Path) -> None:
    """``--engine null`` (what ``nmt bench server --engine null`` measures the serving layer with): the whole
    request path, no model; each sentence comes back as its own source pieces, detokenized."""
    replica = serving(launch(scale_repository, "--engine", "null"), scale_repository, "--engine", "null")
    try:
        with TranslatorClient(replica.address, timeout=30) as client:
            results = client.translate(list(TEXTS[:3]), model=SERVED_MODEL)
        assert [r.best.text for r in results] == list(TEXTS[:3])
        assert [r.best.tokens for r in results] == [text.split() for text in TEXTS[:3]]
    finally:
        replica.process.terminate()
        assert replica.process.wait(30) == 0
