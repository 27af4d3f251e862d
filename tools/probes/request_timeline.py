"""Where a lone caller's request spends its time: one request at a time through ``nmt serve``, stamped at each
hand-off between the client, gRPC, the handler, the scheduler, the worker thread and the engine.

    python benchmarks/request_timeline.py --model-repository models --model demo-transformer

This script starts the server itself (one process, static batching, a loopback port) with a few of its
functions wrapped to take a stamp (``time.perf_counter_ns``, the monotonic clock both processes read) where a
request enters the handler, reaches the scheduler, starts its batch, enters and leaves the engine on the worker
thread, is back on the event loop, and leaves the handler. A blocking client stamps the send and the answer.
The table gives each segment's median over the requests (after ``--warmup``) for three servers in turn:

* the model;
* ``--engine null`` (each sentence comes back at once as its own tokens);
* the null engine streaming ``--traffic-mb`` MiB through memory in each batch, as a model's weights do:
  what the CPU's caches cost the serving code between two runs of a model.

Beside them, the round trip of a bare ``grpc.aio`` servicer that answers at once (the floor of any Python gRPC
server here). Issue 31 asks for a 1-caller p50 within 1.2x the bare engine; this says where the rest goes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' shared modules

from bench_common import (  # noqa: E402
    free_port,
    host,  # noqa: E402
    sentences,
    wait_serving,
)

STAMPS = ["handler_in", "enqueue", "execute", "engine_in", "engine_out", "back_on_loop", "handler_out"]
SEGMENTS = [  # (label, from, to)
    ("client -> handler (gRPC in, interceptor)", "send", "handler_in"),
    ("handler -> scheduler (validation, tokenizing)", "handler_in", "enqueue"),
    ("scheduler -> batch starts (batcher task wakes)", "enqueue", "execute"),
    ("batch -> worker thread (executor hand-off)", "execute", "engine_in"),
    ("engine (worker thread)", "engine_in", "engine_out"),
    ("worker thread -> event loop", "engine_out", "back_on_loop"),
    ("results -> response (detokenizing, response)", "back_on_loop", "handler_out"),
    ("handler -> client (interceptor, gRPC out)", "handler_out", "answer"),
]


def traced_server(trace: str, arguments: list[str]) -> None:
    """Run ``nmt <arguments>`` with the request path stamped; SIGUSR1 writes the stamps to ``trace`` and exits.
    ``NMT_TIMELINE_TRAFFIC_MB`` makes the null engine stream that many MiB through memory per batch."""
    import numpy as np

    import server.core.null_engine as null_engine
    import server.core.scheduler as scheduler
    import server.engine.engine as engine
    import server.frontend.servicer as servicer
    from nmt.cli import main

    stamps: list[tuple[int, str]] = []
    traffic = np.ones(int(float(os.environ.get("NMT_TIMELINE_TRAFFIC_MB", "0")) * (1 << 18)), dtype=np.float32)

    def stamp(label: str) -> None:
        stamps.append((time.perf_counter_ns(), label))

    def around(owner: type, name: str, before: str, after: str) -> None:  # a coroutine function
        function = getattr(owner, name)

        async def wrapper(*args: object) -> object:
            stamp(before)
            try:
                return await function(*args)
            finally:
                stamp(after)
        setattr(owner, name, wrapper)

    def at_start(owner: type, name: str, label: str) -> None:  # a coroutine function or a plain one
        function = getattr(owner, name)

        if asyncio.iscoroutinefunction(function):
            async def wrapper(*args: object) -> object:
                stamp(label)
                return await function(*args)
        else:
            def wrapper(*args: object, **kwargs: object) -> object:
                stamp(label)
                return function(*args, **kwargs)
        setattr(owner, name, wrapper)

    def engine_call(owner: type) -> None:  # search_batch, on the worker thread
        function = owner.search_batch

        def wrapper(self: object, requests: object) -> object:
            stamp("engine_in")
            if traffic.size and owner is null_engine.NullEngine:
                np.add(traffic, 1.0, out=traffic)  # reads and writes every byte, as a model's run streams its weights
            try:
                return function(self, requests)
            finally:
                stamp("engine_out")
        owner.search_batch = wrapper

    around(servicer.TranslatorService, "_translate", "handler_in", "handler_out")
    at_start(scheduler.ModelScheduler, "enqueue", "enqueue")
    at_start(scheduler.ModelScheduler, "_execute", "execute")
    at_start(scheduler.ModelScheduler, "_record", "back_on_loop")
    engine_call(engine.Engine)
    engine_call(null_engine.NullEngine)

    def write(*_: object) -> None:
        Path(trace).write_text("".join(f"{t} {name}\n" for t, name in stamps))
        os._exit(0)

    signal.signal(signal.SIGUSR1, write)
    sys.exit(main(arguments))


def measure(repository: str, model: str, flags: list[str], texts: list[str], beam: int, warmup: int,
            traffic_mb: float) -> dict[str, list[float]]:
    """Each segment's durations (us) over the requests after ``warmup``, from a traced server with ``flags``."""
    import grpc

    from server.protos import pb2, pb2_grpc

    trace = Path(f"/tmp/request-timeline-{os.getpid()}.txt")
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, NMT_LOG_LEVEL="WARNING", NMT_TIMELINE_TRAFFIC_MB=str(traffic_mb))
    process = subprocess.Popen(
        [sys.executable, __file__, "--traced-server", str(trace), "--", "serve", "--model-repository", repository,
         "--listen", address, "--metrics-listen", f"127.0.0.1:{free_port()}", "--http-listen", "",
         "--batching", "static", "--frontends", "0", *flags], env=env, stdout=subprocess.DEVNULL)
    calls = []
    try:
        wait_serving(address, process, timeout=60)
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.TranslatorStub(channel)
            for text in texts:
                sent = time.perf_counter_ns()
                stub.Translate(pb2.TranslateRequest(texts=[text], model=model,
                                                    options=pb2.DecodingOptions(beam_size=beam)), timeout=60)
                calls.append((sent, time.perf_counter_ns()))
        process.send_signal(signal.SIGUSR1)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    stamps = sorted((int(t), name) for t, name in (line.split() for line in trace.read_text().splitlines()))
    trace.unlink()
    segments: dict[str, list[float]] = {label: [] for label, _, _ in SEGMENTS}
    segments["total"] = []
    at = 0
    for sent, answer in calls:
        while at < len(stamps) and stamps[at][0] < sent:
            at += 1
        times = {"send": sent, "answer": answer}
        while at < len(stamps) and stamps[at][0] <= answer:
            times.setdefault(stamps[at][1], stamps[at][0])
            at += 1
        if len(times) < len(STAMPS) + 2:
            raise SystemExit(f"a request missed stamps ({sorted(times)}): is the server one process, static?")
        for label, start, end in SEGMENTS:
            segments[label].append((times[end] - times[start]) / 1e3)
        segments["total"].append((answer - sent) / 1e3)
    return {label: values[warmup:] for label, values in segments.items()}


def echo_round_trip(texts: list[str], warmup: int) -> float:
    """Median round trip (us) of a ``grpc.aio`` servicer that answers at once (``server_load.py --echo-server``)."""
    import grpc

    from server.protos import pb2, pb2_grpc

    port = free_port()
    server_load = Path(__file__).resolve().parents[2] / "benchmarks" / "server_load.py"
    process = subprocess.Popen([sys.executable, str(server_load), "--echo-server", str(port)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = pb2_grpc.TranslatorStub(channel)
            times = []
            for text in texts:
                sent = time.perf_counter_ns()
                stub.Translate(pb2.TranslateRequest(texts=[text], model="echo"), timeout=60)
                times.append((time.perf_counter_ns() - sent) / 1e3)
    finally:
        process.terminate()
        process.wait()
    return statistics.median(times[warmup:])


def bare_engine(repository: str, model: str, texts: list[str], beam: int, warmup: int) -> float:
    """Median time (us) of the same sentences through ``Engine.translate_batch`` one at a time, in this process
    with the server's default settings: what issue 31's 1.2x compares with."""
    from common.model_format.layout import discover_versions
    from server.engine.engine import Engine
    from server.types import DecodingOptions, SentenceRequest

    engine = Engine.load(discover_versions(repository)[model][-1][1], provider="cpu")  # the newest, as served
    options = DecodingOptions(beam_size=beam, num_hypotheses=1)
    times = []
    for text in texts:
        start = time.perf_counter_ns()
        engine.translate_batch([SentenceRequest(engine.tokenize(text), options)])
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--beam-size", "--beam", dest="beam_size", type=int, default=1)
    parser.add_argument("--requests", type=int, default=500, help="requests per server, warm-up included")
    parser.add_argument("--warmup", type=int, default=100, help="first requests left out of the medians")
    parser.add_argument("--traffic-mb", type=float, default=32.0,
                        help="MiB the third server's null engine streams through memory per batch")
    parser.add_argument("--traced-server", metavar="TRACE", help=argparse.SUPPRESS)  # internal: the server
    args, rest = parser.parse_known_args()
    if args.traced_server:
        traced_server(args.traced_server, [a for a in rest if a != "--"])
        return
    if args.requests <= args.warmup:
        parser.error("--requests must exceed --warmup")
    texts = sentences(args.requests)
    servers = {"model": ([], 0.0), "null engine": (["--engine", "null"], 0.0),
               f"null engine + {args.traffic_mb:g} MiB": (["--engine", "null"], args.traffic_mb)}
    results = {}
    for name, (flags, traffic) in servers.items():
        print(f"{name}: {args.requests} requests, one at a time", file=sys.stderr)
        results[name] = measure(args.model_repository, args.model, flags, texts, args.beam_size, args.warmup,
                                traffic)
    echo = echo_round_trip(texts, args.warmup)
    bare = bare_engine(args.model_repository, args.model, texts, args.beam_size, args.warmup)
    print(f"\nhost: {host()}; model {args.model}, one sentence a request, one caller, "
          f"beam {args.beam_size}, {args.requests - args.warmup} requests a server (medians, us)\n")
    print("| segment | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for label in [label for label, _, _ in SEGMENTS] + ["total"]:
        cells = [f"{statistics.median(segments[label]):,.0f}" for segments in results.values()]
        print(f"| {label} | " + " | ".join(cells) + " |")
    overhead = [statistics.median([t - e for t, e in zip(s["total"], s["engine (worker thread)"], strict=True)])
                for s in results.values()]
    print("| total less the engine | " + " | ".join(f"{o:,.0f}" for o in overhead) + " |")
    total = statistics.median(results["model"]["total"])
    print(f"\ngrpc.aio echo servicer (answers at once), round trip: {echo:,.0f} us")
    print(f"bare engine (Engine.translate_batch, one sentence a call, this process): {bare:,.0f} us; the model's "
          f"server / bare engine: {total / bare:.2f}x")


if __name__ == "__main__":
    main()
