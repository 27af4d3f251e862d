"""Server benchmark: the bare engine vs the gRPC server under 1, 8, 32 and 128 concurrent callers.

    python benchmarks/server_load.py --model-repository models --model demo-transformer

The same model and the same sentences go (a) straight to ``Engine.translate_batch`` in batches as
large as the number of callers (ideal batching, no server) and (b) through ``nmt serve`` started as a
subprocess on a loopback port, driven by that many concurrent asyncio callers each sending one
sentence per request. Prints sentences/s, target tokens/s and p50/p95/p99 latency for both, and the
ratios the targets are stated in: server/engine throughput at 128 callers (target >= 0.9) and server
p50 at 1 caller over the engine's single-sentence latency (target <= 1.2). That last ratio is
measured pairwise: each sentence goes once to the engine and once through the server (a blocking
client), alternately, so drift in the machine's speed hits both sides alike.

Where the time goes, per request: CPU seconds of the server process (from /proc) and of the load
generator (this process, idle engine), and the server's mean batch size (from its /metrics). The
same load against a bare ``grpc.aio`` servicer that answers at once (``--echo-server``, started as a
subprocess) gives the floor any Python gRPC server pays per request on this machine.

The server's cost per request is roughly fixed (gRPC, protobuf, asyncio), so the ratios depend on
how much compute a sentence needs. ``--marian SMALL`` (or BASE) serves a random-weight Marian model
of that size instead (built as in ``engine_throughput.py``, EOS suppressed: every output runs to the
length limit, 52 tokens for the 20-token sources used then):

    python benchmarks/server_load.py --marian SMALL --requests 256

**Serving-layer capacity** (``--capacity``): how many one-sentence ``Translate`` requests a second the
serving layer alone can answer, and the CPU it spends on each, with ``nmt serve --engine null`` (no
model: each sentence comes back at once as its own tokens) as one process (``--frontends 0``) and split
into an engine core and 1 or 2 front-ends (``--frontends 1``, ``--frontends 2``), beside the bare
``grpc.aio`` echo servicer as the floor:

    python benchmarks/server_load.py --capacity --model-repository models --model demo-transformer

Every configuration gets the same load from ``--clients`` load-generator processes (this script with
an internal flag), each running ``--client-threads`` threads with a synchronous gRPC channel (its own
TCP connection, so SO_REUSEPORT spreads them over the front-ends) and blocking calls: a closed loop
with clients x threads requests in flight. Server CPU is summed over the whole process tree of the
server (the ``nmt serve`` supervisor, the engine core, every front-end; /proc utime + stime, and the
children's reaped times), snapshot right before and right after the load; the load generator's CPU
(all its processes) is printed beside it. Configurations alternate ``--rounds`` times, medians.

Where the limit is on a 2-core machine: the load generator shares the two cores with the server (it
costs ~0.3 ms per request, about what the echo servicer itself costs), and so does anything else
running (the "other jobs" column: the machine's busy CPU during the load, from /proc/stat, less the
server's and the load generator's, in cores). The one-process server is bound by its one event loop:
sentences/s x its CPU ms per request comes to ~1,000 ms a second, one core, with the load generator on
the other. The split servers run out of machine first: core, front-ends and load generator together
fill both cores before any one process fills one, and the split's extra CPU per request (the IPC
hop on both sides) then makes them slower here than one process. So on 2 cores compare the CPU per
request; the throughput front-ends buy needs cores of their own and a load generator elsewhere, and is
about 1,000 / (a process's ms per request) for its busiest process: the core, or each front-end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages

from loadtests.cli import free_port, wait_serving  # noqa: E402
from nmt.errors import NmtError  # noqa: E402


def sentences(count: int, seed: int = 0) -> list[str]:
    """Dates and numbers like the demo corpus (English side), rendered without Babel."""
    rng = random.Random(seed)
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
              "October", "November", "December"]
    return [f"{rng.choice(days)}, {rng.choice(months)} {rng.randint(1, 28)}, {rng.randint(1900, 2099)}"
            for _ in range(count)]


def serve_echo(port: int) -> None:
    """Serve a ``Translator`` that answers at once: what gRPC alone costs per request."""
    import grpc

    from server.protos import pb2, pb2_grpc

    class EchoTranslator(pb2_grpc.TranslatorServicer):
        async def Translate(self, request, context):  # noqa: N802 - gRPC method name
            response = pb2.TranslateResponse(model=request.model)
            response.translations.add().hypotheses.add(text=request.texts[0],
                                                       subword_tokens=request.texts[0].split())
            return response

    async def serve() -> None:
        server = grpc.aio.server()
        pb2_grpc.add_TranslatorServicer_to_server(EchoTranslator(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_floor(texts: list[str], callers: int) -> dict[str, float]:
    """Requests/s and CPU ms per request of client and server against :func:`serve_echo`'s servicer."""
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port)])
    try:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        asyncio.run(bench_server(f"127.0.0.1:{port}", "", texts[:callers], callers, 1))  # warm up
        client0, server0 = time.process_time(), process_cpu_seconds(process.pid)
        result = asyncio.run(bench_server(f"127.0.0.1:{port}", "", texts, callers, 1))
        client1, server1 = time.process_time(), process_cpu_seconds(process.pid)
    finally:
        process.kill()
        process.wait()
    result["client_cpu_ms"] = (client1 - client0) / len(texts) * 1000
    result["server_cpu_ms"] = (server1 - server0) / len(texts) * 1000
    return result


def placeholder_sentences(vocab: int) -> Callable[[int, int], list[str]]:
    """Texts of 20 placeholder pieces ("t17 t403 ...") for the ``--marian`` models."""
    def make(count: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(f"t{rng.randint(2, vocab - 2)}" for _ in range(20)) for _ in range(count)]

    return make


def percentiles(latencies: list[float]) -> tuple[float, float, float]:
    p50, p95, p99 = np.percentile(np.array(latencies) * 1000, [50, 95, 99])
    return float(p50), float(p95), float(p99)


def bench_engine(engine, texts: list[str], callers: int, beam: int) -> dict[str, float]:
    from server.types import DecodingOptions, SentenceRequest

    options = DecodingOptions(beam_size=beam, num_hypotheses=1)
    requests = [SentenceRequest(engine.tokenize(text), options) for text in texts]
    latencies, tokens = [], 0
    start = time.perf_counter()
    for i in range(0, len(requests), callers):
        t0 = time.perf_counter()
        result = engine.translate_batch(requests[i : i + callers])
        latencies += [time.perf_counter() - t0] * len(result.translations)
        tokens += result.generated_tokens
    seconds = time.perf_counter() - start
    return {"sentences_s": len(texts) / seconds, "tokens_s": tokens / seconds, "latencies": latencies}


async def bench_server(address: str, model: str, texts: list[str], callers: int, beam: int) -> dict[str, float]:
    import grpc

    from server.protos import pb2, pb2_grpc

    queue = list(enumerate(texts))
    latencies: list[float] = []
    tokens = 0

    async def caller(stub) -> None:
        nonlocal tokens
        while queue:
            _, text = queue.pop()
            request = pb2.TranslateRequest(texts=[text], model=model, options=pb2.DecodingOptions(beam_size=beam))
            t0 = time.perf_counter()
            response = await stub.Translate(request, timeout=60)
            latencies.append(time.perf_counter() - t0)
            tokens += len(response.translations[0].hypotheses[0].subword_tokens) + 1

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(caller(stub) for _ in range(callers)))
        seconds = time.perf_counter() - start
    return {"sentences_s": len(texts) / seconds, "tokens_s": tokens / seconds, "latencies": latencies}


def paired_single_latency(engine, address: str, model: str, texts: list[str], beam: int) -> tuple[float, float]:
    """Median single-sentence latency (seconds) of the engine and of the server, sentences alternating."""
    import grpc

    from server.protos import pb2, pb2_grpc
    from server.types import DecodingOptions, SentenceRequest

    options = DecodingOptions(beam_size=beam, num_hypotheses=1)
    bare, served = [], []
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        for text in texts:
            t0 = time.perf_counter()
            engine.translate_batch([SentenceRequest(engine.tokenize(text), options)])
            t1 = time.perf_counter()
            stub.Translate(pb2.TranslateRequest(texts=[text], model=model,
                                                options=pb2.DecodingOptions(beam_size=beam)), timeout=60)
            t2 = time.perf_counter()
            bare.append(t1 - t0)
            served.append(t2 - t1)
    return float(np.median(bare)), float(np.median(served))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid`` and every descendant, by pid: utime + stime + the reaped children's cutime + cstime.

    Summed over the tree, the difference of two snapshots is exact even if a process exits in between
    (its time moves to its parent's cutime) or starts in between (it is counted whole).
    """
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        stats[int(path.parent.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(path.parent.name))
    tick = os.sysconf("SC_CLK_TCK")
    tree, todo = {}, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            tree[current] = sum(int(stats[current][i]) for i in (11, 12, 13, 14)) / tick
            todo += children.get(current, [])
    return tree


def host_busy_seconds() -> float:
    """CPU seconds all cores of this machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def process_role(pid: int, root: int) -> str:
    """What a process of an ``nmt serve`` tree is: supervisor (or the one process), core, front-end."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    if b"server.core.process" in argv:
        return "core"
    if b"server.frontend.process" in argv:
        return "front-end"
    return "parent" if pid == root else "other"


def batch_totals(metrics_address: str) -> tuple[float, float]:
    """(sentences batched, batches run) so far, from the server's ``nmt_batch_size_sentences``."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "nmt_batch_size_sentences":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


def measure_server(process: subprocess.Popen, address: str, metrics: str, model: str, texts: list[str],
                   callers: int, beam: int) -> dict[str, float]:
    """:func:`bench_server` plus CPU per request on both sides and the server's mean batch size."""
    def server_cpu() -> float:  # every process of the server (the supervisor, core and front-ends of --frontends)
        return sum(tree_cpu_seconds(process.pid).values())

    client0, server0, (sent0, batches0) = time.process_time(), server_cpu(), batch_totals(metrics)
    result = asyncio.run(bench_server(address, model, texts, callers, beam))
    client1, server1, (sent1, batches1) = time.process_time(), server_cpu(), batch_totals(metrics)
    result["client_cpu_ms"] = (client1 - client0) / len(texts) * 1000
    result["server_cpu_ms"] = (server1 - server0) / len(texts) * 1000
    result["mean_batch"] = (sent1 - sent0) / max(batches1 - batches0, 1)
    return result


def start_server(repository: str, flags: list[str]) -> tuple[subprocess.Popen, str, str]:
    """``nmt serve`` with ``flags`` on free loopback ports, once healthy: (process, address, metrics address)."""
    address, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict(os.environ, NMT_LOG_LEVEL="WARNING")
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt", "serve", "--model-repository", repository, "--listen", address,
         "--metrics-listen", metrics, "--http-listen", "", *flags],
        env=env, stdout=subprocess.DEVNULL,
    )
    try:
        wait_serving(address, process, timeout=60)
    except NmtError:
        process.kill()
        raise
    return process, address, metrics


def load_worker(address: str, model: str, count: int, threads: int, seed: int) -> None:
    """One load-generator process (``--load-worker``): warm up, say ``ready``, wait for ``go`` on stdin, send
    ``count`` one-sentence requests from ``threads`` threads (a channel each), print the result as JSON."""
    import grpc

    from server.protos import pb2, pb2_grpc

    texts = sentences(count, seed)
    lock, latencies, errors = threading.Lock(), [], []

    def requests(stub, todo: list[str], record: bool) -> None:
        while True:
            with lock:
                if not todo:
                    return
                text = todo.pop()
            t0 = time.perf_counter()
            try:
                stub.Translate(pb2.TranslateRequest(texts=[text], model=model), timeout=60)
            except grpc.RpcError as error:
                if record:
                    errors.append(f"{error.code().name}: {error.details()}")
                continue
            if record:
                latencies.append(time.perf_counter() - t0)

    def run_all(stubs, todo: list[str], record: bool) -> None:
        workers = [threading.Thread(target=requests, args=(stub, todo, record)) for stub in stubs]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    # A local subchannel pool: each channel its own connection (the global pool would share one).
    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(threads)]
    stubs = [pb2_grpc.TranslatorStub(channel) for channel in channels]
    run_all(stubs, sentences(20 * threads, seed + 1000), False)  # warm up: connections, first calls
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0, t0 = time.process_time(), time.perf_counter()
    run_all(stubs, list(texts), True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for channel in channels:
        channel.close()
    print(json.dumps({"seconds": seconds, "cpu": cpu, "latencies": latencies, "errors": errors}), flush=True)


def drive(address: str, model: str, total: int, clients: int, threads: int, server_pid: int,
          seed: int) -> dict:
    """``total`` requests from ``clients`` load-worker processes against the server whose tree is ``server_pid``."""
    per = [total // clients + (i < total % clients) for i in range(clients)]
    workers = [subprocess.Popen([sys.executable, __file__, "--load-worker", address, "--model", model,
                                 "--requests", str(n), "--client-threads", str(threads), "--seed", str(seed + i)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for i, n in enumerate(per)]
    try:
        for worker in workers:
            if worker.stdout.readline().strip() != "ready":
                raise SystemExit(f"a load worker against {address} failed to start (exit {worker.wait()})")
        before, host_before = tree_cpu_seconds(server_pid), host_busy_seconds()
        start = time.perf_counter()
        for worker in workers:
            worker.stdin.write("go\n")
            worker.stdin.flush()
        results = [json.loads(worker.stdout.readline()) for worker in workers]
        seconds = time.perf_counter() - start
        after, host_after = tree_cpu_seconds(server_pid), host_busy_seconds()
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    roles: dict[str, float] = {}
    frontends = sorted(pid for pid in after if process_role(pid, server_pid) == "front-end")
    for pid, cpu in after.items():
        role = process_role(pid, server_pid)
        if role == "front-end":
            role = f"front-end {frontends.index(pid) + 1}"
        roles[role] = roles.get(role, 0.0) + cpu - before.get(pid, 0.0)
    for pid, cpu in before.items():  # exited meanwhile: its time is in its parent's cutime now
        if pid not in after:
            roles["gone"] = roles.get("gone", 0.0) - cpu
    latencies = [x for r in results for x in r["latencies"]]
    errors = [e for r in results for e in r["errors"]]
    server, client = sum(roles.values()), sum(r["cpu"] for r in results)
    return {"sentences_s": len(latencies) / seconds, "latencies": latencies, "errors": errors,
            "server_cpu_ms": server / total * 1000, "client_cpu_ms": client / total * 1000,
            "roles_ms": {role: cpu / total * 1000 for role, cpu in roles.items()}, "processes": len(after),
            "others_cores": max(host_after - host_before - server - client, 0.0) / seconds}


def capacity(args: argparse.Namespace) -> None:
    """``--capacity``: the null-engine server as one process and split, and the echo floor, under one load."""
    from engine_throughput import host

    if not sorted(Path(args.model_repository, args.model).glob("*/manifest.json")):
        raise SystemExit(f"no {args.model} in {args.model_repository}: run `nmt serve --demo` first")
    requests = args.requests or 2000
    configurations = [("grpc.aio echo (floor)", None)] + [
        (f"--frontends {n}" + (" (one process)" if n == 0 else ""), n) for n in args.frontends or [0, 1, 2]]
    servers = {}
    try:
        for name, frontends in configurations:
            if frontends is None:
                port = free_port()
                process = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port)])
                servers[name] = (process, f"127.0.0.1:{port}", None)
                wait_serving_echo(servers[name][1])
            else:
                servers[name] = start_server(args.model_repository, [
                    "--engine", "null", "--frontends", str(frontends), "--default-model", args.model])
        runs: dict[str, list[dict]] = {name: [] for name, _ in configurations}
        for round_ in range(args.rounds):
            order = configurations[round_ % len(configurations):] + configurations[:round_ % len(configurations)]
            for name, _ in order:
                process, address, metrics = servers[name]
                batches0 = batch_totals(metrics) if metrics else None
                result = drive(address, args.model, requests, args.clients, args.client_threads, process.pid,
                               seed=round_ * 100)
                if metrics:
                    sent, batches = (b - a for a, b in zip(batches0, batch_totals(metrics), strict=True))
                    result["mean_batch"] = sent / max(batches, 1)
                runs[name].append(result)
                print(f"round {round_ + 1} {name}: {result['sentences_s']:.1f} sent/s, server CPU "
                      f"{result['server_cpu_ms']:.2f} ms/req, load generator {result['client_cpu_ms']:.2f} ms/req"
                      + (f", {len(result['errors'])} errors (first: {result['errors'][0]})" if result["errors"]
                         else ""), flush=True)
    finally:
        for process, _, _ in servers.values():
            process.terminate()
        for process, _, _ in servers.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    print()
    flags = set()
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        flags = next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), flags)
    print(f"{host()}; avx2 {'yes' if 'avx2' in flags else 'no'}, avx512f {'yes' if 'avx512f' in flags else 'no'}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"model {args.model} (tokenizer only: --engine null), {requests} one-sentence Translate requests per "
          f"configuration and round, {args.clients} load-generator processes x {args.client_threads} threads "
          f"(blocking calls, {args.clients * args.client_threads} in flight), {args.rounds} round(s), medians; "
          f"server defaults otherwise")
    print("| server | processes | sentences/s | server CPU ms/req | by process, ms/req | load generator CPU ms/req "
          "| p50 ms | p99 ms | batch | other jobs, cores | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, _ in configurations:
        results = runs[name]
        p50, _, p99 = percentiles([x for r in results for x in r["latencies"]] or [0.0])
        keys = sorted({role for r in results for role in r["roles_ms"]},
                      key=lambda role: (["parent", "core"] + [role]).index(role))
        roles = {role: statistics.median(r["roles_ms"].get(role, 0.0) for r in results) for role in keys}
        split = ", ".join(f"{role} {ms:.2f}" for role, ms in roles.items() if abs(ms) >= 0.005) or "-"
        batch = f"{statistics.median(r['mean_batch'] for r in results):.1f}" if "mean_batch" in results[0] else "-"
        print(f"| {name} | {results[0]['processes']} | {statistics.median(r['sentences_s'] for r in results):,.1f} | "
              f"{statistics.median(r['server_cpu_ms'] for r in results):.2f} | {split} | "
              f"{statistics.median(r['client_cpu_ms'] for r in results):.2f} | {p50:.2f} | {p99:.2f} | {batch} | "
              f"{statistics.median(r['others_cores'] for r in results):.2f} | "
              f"{sum(len(r['errors']) for r in results)} |")
    for name, _ in configurations:
        errors = [e for r in runs[name] for e in r["errors"]]
        if errors:
            print(f"{name}: {len(errors)} failed requests, first: {errors[0]}")


def wait_serving_echo(address: str) -> None:
    import grpc

    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--callers", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--requests", type=int,
                        help="sentences per concurrency level (default 1024); --capacity: per configuration and "
                        "round (default 2000)")
    parser.add_argument("--beam-size", "--beam", dest="beam_size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (both sides)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's batching wait")
    parser.add_argument("--ort-spinning", action=argparse.BooleanOptionalAction, default=True,
                        help="ONNX Runtime threads busy-wait within a run (both sides; the server's default)")
    parser.add_argument("--marian", choices=["SMALL", "BASE"],
                        help="serve a random-weight Marian model of this size instead of --model")
    parser.add_argument("--capacity", action="store_true",
                        help="serving-layer capacity: --engine null as one process and with --frontends, and the "
                        "grpc.aio echo floor (see above)")
    parser.add_argument("--frontends", nargs="+", type=int,
                        help="--capacity: the --frontends settings to compare (default 0 1 2); else: the server's "
                             "--frontends (one value, default 0)")
    parser.add_argument("--batching", choices=["static", "continuous"], default="static",
                        help="the server's --batching (not --capacity: the null engine batches statically)")
    parser.add_argument("--clients", type=int, default=2, help="--capacity: load-generator processes")
    parser.add_argument("--client-threads", type=int, default=8,
                        help="--capacity: threads (blocking calls, a channel each) per load-generator process")
    parser.add_argument("--rounds", type=int, default=3, help="--capacity: times the configurations alternate")
    parser.add_argument("--echo-server", type=int, metavar="PORT", help=argparse.SUPPRESS)  # internal
    parser.add_argument("--load-worker", metavar="ADDRESS", help=argparse.SUPPRESS)  # internal
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # internal, --load-worker
    args = parser.parse_args()
    if args.echo_server:
        serve_echo(args.echo_server)
        return
    if args.load_worker:
        load_worker(args.load_worker, args.model, args.requests, args.client_threads, args.seed)
        return
    if args.capacity:
        capacity(args)
        return
    args.requests = args.requests or 1024
    with tempfile.TemporaryDirectory() as work:
        if args.marian:
            from engine_throughput import SIZES, export_project, marian_model

            export_project(marian_model(args.marian), Path(work), None)  # -> work/models/bench-fp32/1
            args.model_repository, args.model = str(Path(work, "models")), "bench-fp32"
            make_texts = placeholder_sentences(SIZES[args.marian]["vocab"])
        else:
            make_texts = sentences
        run(args, make_texts)


def run(args: argparse.Namespace, make_texts: Callable[[int, int], list[str]]) -> None:
    """Both benchmarks for every number of callers, then the tables."""
    from server.engine.engine import Engine

    versions = sorted(Path(args.model_repository, args.model).glob("*/manifest.json"))
    if not versions:
        raise SystemExit(f"no {args.model} in {args.model_repository}: run `nmt serve --demo` first")
    if args.frontends and len(args.frontends) > 1:
        raise SystemExit("--frontends takes one value here (several only with --capacity)")
    frontends = args.frontends[0] if args.frontends else 0
    engine = Engine.load(versions[-1].parent, provider="cpu", intra_op_threads=args.threads,
                         spinning=args.ort_spinning)
    process, address, metrics = start_server(args.model_repository, [
        "--intra-op-threads", str(args.threads), "--max-batch-sentences", "128", "--queue-size", "4096",
        "--max-wait-ms", str(args.max_wait_ms), "--ort-spinning" if args.ort_spinning else "--no-ort-spinning",
        "--frontends", str(frontends), "--batching", args.batching])
    rows = []
    try:
        for callers in args.callers:
            texts = make_texts(max(args.requests, callers), callers)
            bench_engine(engine, texts[:callers], callers, args.beam_size)  # warm up
            asyncio.run(bench_server(address, args.model, texts[:callers], callers, args.beam_size))
            bare = bench_engine(engine, texts, callers, args.beam_size)
            served = measure_server(process, address, metrics, args.model, texts, callers, args.beam_size)
            rows.append((callers, bare, served))
            print(f"callers {callers}: engine {bare['sentences_s']:.1f} sent/s, server {served['sentences_s']:.1f} "
                  f"sent/s", flush=True)
        single = paired_single_latency(engine, address, args.model, make_texts(args.requests, 99), args.beam_size)
    finally:
        process.terminate()
        process.wait(timeout=30)

    print()
    print(f"model {args.model}, beam {args.beam_size}, {args.threads} threads, {args.requests} sentences per level, "
          f"server max wait {args.max_wait_ms} ms, ORT spinning {'on' if args.ort_spinning else 'off'}, "
          f"{args.batching} batching, {frontends} front-ends")
    print("| callers | engine sent/s | server sent/s | ratio | server tok/s | engine p50/p95/p99 ms "
          "| server p50/p95/p99 ms | server batch | server CPU ms/req | client CPU ms/req |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for callers, bare, served in rows:
        e, s = percentiles(bare["latencies"]), percentiles(served["latencies"])
        print(f"| {callers} | {bare['sentences_s']:.1f} | {served['sentences_s']:.1f} | "
              f"{served['sentences_s'] / bare['sentences_s']:.2f} | {served['tokens_s']:.0f} | "
              f"{e[0]:.1f} / {e[1]:.1f} / {e[2]:.1f} | {s[0]:.1f} / {s[1]:.1f} / {s[2]:.1f} | "
              f"{served['mean_batch']:.1f} | {served['server_cpu_ms']:.2f} | {served['client_cpu_ms']:.2f} |")
    print("\ngRPC alone (a servicer that answers at once, same load generator):")
    for callers in (1, 128):
        floor = grpc_floor(make_texts(max(args.requests, callers), callers), callers)
        p50 = percentiles(floor["latencies"])[0]
        print(f"  {callers} callers: {floor['sentences_s']:,.0f} requests/s, p50 {p50:.2f} ms, server CPU "
              f"{floor['server_cpu_ms']:.2f} ms/req, client CPU {floor['client_cpu_ms']:.2f} ms/req")
    engine_p50, server_p50 = single[0] * 1000, single[1] * 1000
    print(f"\nsingle sentence, engine and server alternating ({args.requests} sentences): engine p50 "
          f"{engine_p50:.2f} ms, server p50 {server_p50:.2f} ms: {server_p50 / engine_p50:.2f}x")


if __name__ == "__main__":
    main()
