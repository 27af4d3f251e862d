"""Scale-out benchmark: throughput and latency through the nginx gRPC proxy with 1, 2 and 3 replicas.

    python benchmarks/proxy.py --model-repository models --model demo-transformer

Starts three ``nmt serve`` replicas (one ONNX Runtime thread each, no spinning) and, per configuration, a
real nginx running ``deploy/nginx/translator.conf`` over the first N of them. Configurations, interleaved
``--rounds`` times (medians reported): one replica direct (no proxy), nginx over 1, 2 and 3 replicas, and
gRPC's client-side ``round_robin`` over 3. Each sends ``--requests`` one-sentence requests from
``--callers`` concurrent asyncio callers on one channel. The proxy's added latency is measured apart, at
one caller (no queueing), alternating direct and proxied calls to the same replica.

On a machine with fewer cores than replicas the replicas share the cores, so more replicas cannot add
throughput; what this shows is the proxy's cost and whether it spreads the calls evenly.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages
from benchmarks.server_load import sentences
from clients.channel import channel_target, service_config
from common.errors import NmtError
from deploy.nginx import standalone_config
from loadtests.cli import free_port, wait_serving
from server.protos import SERVICE_NAME


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def served(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "grpc_server_handled_total" and s.labels.get("grpc_service") == SERVICE_NAME
               and s.labels.get("grpc_method") == "Translate")


async def load(target: str, model: str, texts: list[str], callers: int, balanced: bool) -> dict[str, float]:
    """``texts`` as one-sentence requests from ``callers`` concurrent callers: sentences/s and p50 (ms)."""
    import grpc

    from server.protos import pb2, pb2_grpc

    queue, latencies = list(texts), []
    options = [("grpc.service_config", service_config(health_check=False))] if balanced else []

    async def caller(stub) -> None:
        while queue:
            request = pb2.TranslateRequest(texts=[queue.pop()], model=model)
            t0 = time.perf_counter()
            await stub.Translate(request, timeout=120)
            latencies.append(time.perf_counter() - t0)

    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(caller(stub) for _ in range(callers)))
        seconds = time.perf_counter() - start
    return {"rate": len(texts) / seconds, "p50": float(np.percentile(latencies, 50)) * 1000}


def added_latency(direct: str, proxied: str, model: str, texts: list[str]) -> tuple[float, float]:
    """Median single-call latency (ms) direct and through the proxy, calls alternating."""
    import grpc

    from server.protos import pb2, pb2_grpc

    times: dict[str, list[float]] = {direct: [], proxied: []}
    channels = {address: grpc.insecure_channel(address) for address in times}
    stubs = {address: pb2_grpc.TranslatorStub(channel) for address, channel in channels.items()}
    for i, text in enumerate(texts):
        for address in ((direct, proxied) if i % 2 else (proxied, direct)):
            t0 = time.perf_counter()
            stubs[address].Translate(pb2.TranslateRequest(texts=[text], model=model), timeout=60)
            if i >= 8:  # warm-up: connections, first batches
                times[address].append(time.perf_counter() - t0)
    for channel in channels.values():
        channel.close()
    return statistics.median(times[direct]) * 1000, statistics.median(times[proxied]) * 1000


class Proxy:
    """nginx with the repository's config over ``upstreams``, on a free loopback port."""

    def __init__(self, nginx: str, upstreams: list[str], workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o777)  # workers run as nobody under root
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = workdir / "nginx.conf"
        config.write_text(standalone_config(upstreams, self.port, workdir))
        self.process = subprocess.Popen([nginx, "-c", str(config), "-e", str(workdir / "error.log")])
        time.sleep(0.5)
        if self.process.poll() is not None:
            raise NmtError(f"nginx did not start: {(workdir / 'error.log').read_text()}")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--requests", type=int, default=768, help="requests per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-calls", type=int, default=200, help="single calls per side for the added p50")
    args = parser.parse_args()
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.access(nginx, os.X_OK):
        raise SystemExit("nginx is not installed (apt-get install -y nginx-light)")
    source = Path(args.model_repository) / args.model
    if not source.is_dir():
        raise SystemExit(f"{source} is not a model directory (nmt serve --demo builds the demo models)")

    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "models"
        shutil.copytree(source, repository / args.model)
        replicas = []
        for _ in range(3):
            address, metrics = f"127.0.0.1:{free_port()}", free_port()
            process = subprocess.Popen(
                [sys.executable, "-m", "nmt", "serve", "--model-repository", str(repository), "--listen", address,
                 "--metrics-listen", f"127.0.0.1:{metrics}", "--http-listen", "", "--reload-interval", "0",
                 "--provider", "cpu",
                 "--intra-op-threads", "1", "--no-ort-spinning"], env=dict(os.environ, NMT_LOG_LEVEL="WARNING"))
            replicas.append((process, address, metrics))
        try:
            for process, address, _ in replicas:
                wait_serving(address, process)
            run(args, nginx, Path(tmp), replicas)
        finally:
            for process, _, _ in replicas:
                process.terminate()
                process.wait(30)


def run(args: argparse.Namespace, nginx: str, tmp: Path, replicas: list) -> None:
    addresses = [address for _, address, _ in replicas]
    texts = sentences(args.requests, seed=1)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; model {args.model}; {args.callers} callers, "
          f"{args.requests} one-sentence requests per configuration, {args.rounds} rounds (medians)")
    configs = {"direct, 1 replica": (addresses[0], 0, False)}
    configs.update({f"nginx, {n} replica{'s' * (n > 1)}": ("", n, False) for n in (1, 2, 3)})
    configs["client round_robin, 3 replicas"] = (channel_target(addresses), 0, True)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    shares: dict[str, list[float]] = {}
    asyncio.run(load(addresses[0], args.model, texts[:64], args.callers, False))  # warm-up
    for round_ in range(args.rounds):
        for name, (target, upstreams, balanced) in configs.items():
            proxy = Proxy(nginx, addresses[:upstreams], tmp / f"nginx-{round_}-{upstreams}") if upstreams else None
            before = [served(m) for _, _, m in replicas]
            try:
                results[name].append(asyncio.run(load(proxy.address if proxy else target, args.model, texts,
                                                      args.callers, balanced)))
            finally:
                if proxy:
                    proxy.close()
            shares[name] = [served(m) - b for (_, _, m), b in zip(replicas, before, strict=True)]
    print("\n| configuration | sentences/s | p50 ms | calls per replica (last round) |\n|---|---|---|---|")
    base = statistics.median(r["rate"] for r in results["direct, 1 replica"])
    for name, runs in results.items():
        rate = statistics.median(r["rate"] for r in runs)
        p50 = statistics.median(r["p50"] for r in runs)
        print(f"| {name} | {rate:.1f} ({rate / base:.2f}x direct) | {p50:.1f} | "
              f"{' / '.join(f'{s:.0f}' for s in shares[name])} |")
    proxy = Proxy(nginx, addresses[:1], tmp / "nginx-latency")
    try:
        direct, proxied = added_latency(addresses[0], proxy.address, args.model,
                                        sentences(args.latency_calls + 8, seed=2))
    finally:
        proxy.close()
    print(f"\nOne caller, one replica, calls alternating: p50 direct {direct:.2f} ms, through nginx {proxied:.2f} ms "
          f"(+{proxied - direct:.2f} ms, {proxied / direct:.2f}x)")


if __name__ == "__main__":
    main()
