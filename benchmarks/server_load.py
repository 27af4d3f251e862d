"""Server benchmark: the bare engine vs the gRPC server under 1, 8, 32 and 128 concurrent callers.

    python benchmarks/server_load.py --repository models --model demo-transformer

The same model and the same sentences go (a) straight to ``Engine.translate_batch`` in batches as
large as the number of callers (ideal batching, no server) and (b) through ``nmt serve`` started as a
subprocess on a loopback port, driven by that many concurrent asyncio callers each sending one
sentence per request. Prints sentences/s, target tokens/s and p50/p95/p99 latency for both, and the
ratios the targets are stated in: server/engine throughput at 128 callers (target >= 0.9) and server
p50 at 1 caller over the engine's single-sentence latency (target <= 1.2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def sentences(count: int, seed: int = 0) -> list[str]:
    """Dates and numbers like the demo corpus (English side), rendered without Babel."""
    rng = random.Random(seed)
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
              "October", "November", "December"]
    return [f"{rng.choice(days)}, {rng.choice(months)} {rng.randint(1, 28)}, {rng.randint(1900, 2099)}"
            for _ in range(count)]


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repository: str, threads: int, max_wait_ms: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = dict(os.environ, NMT_LOG_LEVEL="WARNING")
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt", "serve", "--model-repository", repository, "--listen", address,
         "--metrics-listen", "", "--intra-op-threads", str(threads), "--max-batch-sentences", "128",
         "--queue-size", "4096", "--max-wait-ms", str(max_wait_ms)],
        env=env, stdout=subprocess.DEVNULL,
    )
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + 60
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return process, address
            except grpc.RpcError:
                if time.monotonic() > deadline or process.poll() is not None:
                    process.kill()
                    raise SystemExit("the server did not become healthy") from None
                time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--callers", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--requests", type=int, default=256, help="sentences per concurrency level")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (both sides)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's batching wait")
    args = parser.parse_args()

    from server.engine import Engine

    versions = sorted(Path(args.repository, args.model).glob("*/manifest.json"))
    if not versions:
        raise SystemExit(f"no {args.model} in {args.repository}: run `nmt serve --demo` first")
    engine = Engine.load(versions[-1].parent, provider="cpu", intra_op_threads=args.threads)
    process, address = start_server(args.repository, args.threads, args.max_wait_ms)
    rows = []
    try:
        for callers in args.callers:
            texts = sentences(max(args.requests, callers), seed=callers)
            bench_engine(engine, texts[:callers], callers, args.beam)  # warm up
            asyncio.run(bench_server(address, args.model, texts[:callers], callers, args.beam))
            bare = bench_engine(engine, texts, callers, args.beam)
            served = asyncio.run(bench_server(address, args.model, texts, callers, args.beam))
            rows.append((callers, bare, served))
            print(f"callers {callers}: engine {bare['sentences_s']:.1f} sent/s, server {served['sentences_s']:.1f} "
                  f"sent/s", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=30)

    single = statistics.median(bench_engine(engine, sentences(32, seed=99), 1, args.beam)["latencies"])
    print()
    print(f"model {args.model}, beam {args.beam}, {args.threads} threads, {args.requests} sentences per level, "
          f"server max wait {args.max_wait_ms} ms")
    print("| callers | engine sent/s | server sent/s | ratio | server tok/s | engine p50/p95/p99 ms "
          "| server p50/p95/p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for callers, bare, served in rows:
        e, s = percentiles(bare["latencies"]), percentiles(served["latencies"])
        print(f"| {callers} | {bare['sentences_s']:.1f} | {served['sentences_s']:.1f} | "
              f"{served['sentences_s'] / bare['sentences_s']:.2f} | {served['tokens_s']:.0f} | "
              f"{e[0]:.1f} / {e[1]:.1f} / {e[2]:.1f} | {s[0]:.1f} / {s[1]:.1f} / {s[2]:.1f} |")
    one = next((s for c, _, s in rows if c == 1), None)
    if one is not None:
        print(f"\nengine single-sentence latency {single * 1000:.1f} ms; server p50 at 1 caller "
              f"{percentiles(one['latencies'])[0]:.1f} ms: {percentiles(one['latencies'])[0] / (single * 1000):.2f}x")


if __name__ == "__main__":
    main()
