"""Serving-layer capacity, ``python benchmarks/server_load.py --capacity`` (``nmt bench server --capacity``).

How many one-sentence ``Translate`` requests a second the
serving layer alone can answer, and the CPU it spends on each, with ``nmt serve --engine null`` (no
model: each sentence comes back at once as its own tokens) as one process (``--frontends 0``) and split
into an engine core and 1 or 2 front-ends (``--frontends 1``, ``--frontends 2``), beside the bare
``grpc.aio`` echo servicer as the floor:

    python benchmarks/server_load.py --capacity --model-repository models --model demo-transformer

Every configuration gets the same load from ``--clients`` load-generator processes (``server_load.py`` with
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
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_common import batch_totals, free_port, percentiles, sentences, start_server, tree_cpu_seconds

SERVER_LOAD = Path(__file__).resolve().with_name("server_load.py")  # the command line: its internal flags run
# the load workers (--load-worker) and the echo servicer (--echo-server)


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
    workers = [subprocess.Popen([sys.executable, str(SERVER_LOAD), "--load-worker", address, "--model", model,
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
                process = subprocess.Popen([sys.executable, str(SERVER_LOAD), "--echo-server", str(port)])
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
