"""``nmt loadtest``: Locust, headless, against a translator, with SLO gates that set the exit status.

With no ``--address`` it starts ``nmt serve`` itself on a loopback port over ``--model-repository``
(the demo models by default) and stops it afterwards, so it works on a fresh clone after
``nmt serve --demo``. Reports go to ``--results``: Locust's CSV files (``locust_stats.csv``, the
per-second ``locust_stats_history.csv``, failures) and ``report.html``, plus ``summary.md``.
Distributed runs use the same command: ``--master --expect-workers N`` on one machine (it evaluates
the SLOs) and ``--worker --master-host HOST`` on the others.

The model is ``--model``, ``demo-transformer`` by default, and the texts default to that model's demo run's
held-out split (``<demo-runs>/<model>/test.tsv``): the model and the texts of the README's reference run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from common.errors import NmtError

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
DEFAULT_MODEL = "demo-transformer"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "loadtest", help="load-test a translator with Locust (headless), with SLO gates",
        description=__doc__.split("\n\n")[0] + " Defaults of the gates: no failures, p95 <= 1000 ms and "
        "p99 <= 2000 ms in every scenario.")
    # Each help states its default once, itself (no ArgumentDefaultsHelpFormatter: it would append
    # "(default: )" to the options whose empty default means something said in words).
    parser.add_argument("--address", default="", help="translator host:port, several (comma-separated: "
                        "client-side round_robin per call) or dns:///name:port (default: start one on loopback)")
    parser.add_argument("--model-repository", default="models",
                        help="served when no --address is given (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model to translate with (default: %(default)s; "
                        "'' for the server's default model, with --texts)")
    parser.add_argument("--texts", default="", help="source texts: a held-out split (TSV, first column) or "
                        "one text per line (default: <demo-runs>/<model>/test.tsv, the model's demo run's "
                        "held-out split)")
    parser.add_argument("--demo-runs", default="runs",
                        help="where `nmt serve --demo` keeps its training runs (default: %(default)s)")
    parser.add_argument("--users", type=int, default=8,
                        help="simulated callers (ramp: the last step) (default: %(default)s)")
    parser.add_argument("--spawn-rate", type=float, default=4.0, help="users started per second (default: %(default)s)")
    parser.add_argument("--run-time", default="30s", help="duration, e.g. 20s, 5m (default: %(default)s)")
    parser.add_argument("--load-shape", choices=["steady", "ramp"], default="steady",
                        help="steady: --users throughout; ramp: --step-users more every --step-seconds "
                        "(finds the saturation point) (default: %(default)s)")
    parser.add_argument("--step-users", type=int, default=4, help="ramp: users added per step (default: %(default)s)")
    parser.add_argument("--step-seconds", type=float, default=10.0,
                        help="ramp: seconds per step (default: %(default)s)")
    parser.add_argument("--results", default="", help="report directory (default: loadtest-results/<time>)")
    parser.add_argument("--max-failure-ratio", type=float, default=0.0,
                        help="SLO: failed / all requests (default: %(default)s)")
    parser.add_argument("--slo-p95-ms", type=float, default=1000.0,
                        help="SLO: p95 latency of every scenario (default: %(default)s)")
    parser.add_argument("--slo-p99-ms", type=float, default=2000.0,
                        help="SLO: p99 latency of every scenario (default: %(default)s)")
    parser.add_argument("--slo-scenario", action="append", default=[], metavar="NAME:p95=MS,p99=MS,failures=R",
                        help="objectives of one scenario instead of the above (repeatable), e.g. "
                             "'many texts:p95=2000,p99=4000'")
    parser.add_argument("--master", action="store_true", help="distributed: run as the Locust master")
    parser.add_argument("--expect-workers", type=int, default=1,
                        help="distributed: workers the master waits for (default: %(default)s)")
    parser.add_argument("--worker", action="store_true", help="distributed: run as a Locust worker")
    parser.add_argument("--master-host", default="127.0.0.1",
                        help="distributed: the master's address (default: %(default)s)")
    parser.add_argument("--master-port", type=int, default=5557,
                        help="distributed: the master's port (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadtests.slo import Slo, ramp_steps, read_stats, saturation, summary_table, violations

    texts = resolve_texts(args)
    results = Path(args.results or Path("loadtest-results") / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"))
    if not args.worker:
        results.mkdir(parents=True, exist_ok=True)
    slo = Slo(args.max_failure_ratio, args.slo_p95_ms, args.slo_p99_ms)
    try:
        overrides = dict(slo.with_override(text) for text in args.slo_scenario)
    except ValueError as error:
        raise NmtError(str(error)) from None
    with translator(args) as address:
        command = locust_command(args, address, texts, results)
        print(f"nmt loadtest: {args.load_shape} load, {args.users} users for {args.run_time} against {address}, "
              f"model {args.model or '(the server default)'}; reports in {results}", flush=True)
        status = subprocess.run(command, cwd=Path(__file__).resolve().parent.parent).returncode
    if args.worker:
        return status
    if status != 0:
        raise NmtError(f"locust exited with status {status}")
    stats = read_stats(results / "locust")
    lines = [summary_table(stats)]
    if args.load_shape == "ramp":
        best, past = saturation(ramp_steps(results / "locust"), slo)
        if best is not None:
            lines.append(f"\nSaturation: {best.rps:.1f} requests/s at {best.users} users (p95 {best.p95_ms:.0f} ms)"
                         + (f"; at {past.users} users p95 {past.p95_ms:.0f} ms, {past.failures_per_s:.1f} failures/s"
                            if past else "; the SLO held at every step"))
    missed = violations(stats, slo, overrides)
    lines.append("\nSLO: " + ("met" if not missed else "MISSED: " + "; ".join(missed)))
    summary = "\n".join(lines)
    (results / "summary.md").write_text(summary + "\n", encoding="utf-8")
    print(summary)
    return 1 if missed else 0


def resolve_texts(args: argparse.Namespace) -> str:
    if args.texts:
        return str(Path(args.texts).resolve())
    if not args.model:
        raise NmtError("no texts: with --model '' (the server's default model) pass --texts FILE")
    default = Path(args.demo_runs) / args.model / "test.tsv"
    if default.is_file():
        return str(default.resolve())
    raise NmtError(f"no texts: pass --texts FILE (a held-out split, e.g. a training run's test.tsv or "
                   f"`nmt data` output); {default} does not exist")


def locust_command(args: argparse.Namespace, address: str, texts: str, results: Path) -> list[str]:
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--texts", texts,
               "--model", args.model, "--load-shape", args.load_shape, "--step-users", str(args.step_users),
               "--step-seconds", str(args.step_seconds)]
    if args.worker:  # the master sends the host, the users and the shape
        return command + ["--worker", "--master-host", args.master_host, "--master-port", str(args.master_port)]
    command += ["--host", address, "--users", str(args.users), "--spawn-rate", str(args.spawn_rate),
                "--run-time", args.run_time, "--csv", str(results / "locust"), "--csv-full-history",
                "--html", str(results / "report.html"), "--exit-code-on-error", "0", "--only-summary"]
    if args.master:
        command += ["--master", "--expect-workers", str(args.expect_workers), "--master-bind-port",
                    str(args.master_port)]
    return command


@contextlib.contextmanager
def translator(args: argparse.Namespace) -> Iterator[str]:
    """The address to load: ``--address``, or a server started here on loopback (stopped afterwards)."""
    if args.address or args.worker:
        yield args.address
        return
    repository = Path(args.model_repository)
    if not any(repository.glob("*/*/manifest.json")):
        raise NmtError(f"no model in {repository}: build the demo models with `nmt serve --demo`, or pass "
                       "--model-repository or --address")
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen([sys.executable, "-m", "nmt", "serve", "--model-repository", str(repository),
                                "--listen", address, "--metrics-listen", "", "--http-listen", "",
                                "--reload-interval", "0", "--cache-mb", "0"],  # the load is decoded, not cached
                               env=dict(os.environ, NMT_LOG_LEVEL="WARNING"))
    try:
        wait_serving(address, process)
        yield address
    finally:
        process.terminate()
        process.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Block until the server at ``address`` reports SERVING (or fail when it exits or times out)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            with contextlib.suppress(grpc.RpcError):
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            if process.poll() is not None or time.monotonic() > deadline:
                raise NmtError(f"the translator started for the load test did not become healthy on {address}")
            time.sleep(0.2)
