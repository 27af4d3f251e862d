"""Streaming benchmark: ``TranslateStreaming``'s time to the first word and the gap between words, beside
``Translate``'s latency for the same sentences, and how early beam search's stable prefix is sent.

    python benchmarks/streaming.py --model-repository models --model demo-transformer
    python benchmarks/streaming.py --streams 1 8 --beams 4 --requests 64

One ``nmt serve`` subprocess (loopback, free ports). For each number of concurrent callers (``--streams``)
and beam size, the same sentences (dates like the demo corpus, one per request) go through
``TranslateStreaming`` and through ``Translate``, each caller sending its next request when the last one
ended; the two methods alternate run by run (``--repeats``, medians over them) so a busy neighbour hits both.

Per cell: the streams' time to the first message that carries text ("first word") and between consecutive
such messages ("word gap"), p50 and p95 over every request; the time to the last message ("stream end")
against ``Translate``'s latency; and the share of each translation's words sent before the last message
(the median over requests): with greedy decoding every word but the last (it closes when the sentence
ends), with beam search only the words all beams agreed on before the search ended.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling benchmark modules

from bench_common import (  # noqa: E402
    host,  # noqa: E402
    sentences,
    start_server,
)


async def closed_loop(address: str, texts: list[str], callers: int, one: Callable) -> None:
    """``callers`` callers on one channel, each calling ``await one(stub, text)`` for its next text until
    none is left."""
    import grpc

    from server.protos import pb2_grpc

    queue = list(reversed(texts))

    async def caller(stub) -> None:
        while queue:
            await one(stub, queue.pop())

    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.gather(*(caller(pb2_grpc.TranslatorStub(channel)) for _ in range(callers)))


def request(text: str, model: str, beam: int) -> Any:
    from server.protos import pb2

    return pb2.TranslateRequest(texts=[text], model=model, options=pb2.DecodingOptions(beam_size=beam))


async def streamed(address: str, model: str, texts: list[str], callers: int, beam: int) -> list[dict]:
    """Each text through TranslateStreaming, ``callers`` at a time: per request its word timings (seconds)."""
    records = []

    async def one(stub, text: str) -> None:
        start, times, early_words, words = time.perf_counter(), [], 0, 0
        async for delta in stub.TranslateStreaming(request(text, model, beam), timeout=120):
            now = time.perf_counter()
            if delta.text:
                times.append(now - start)
            if not delta.HasField("final"):
                early_words += len(delta.text.split())
            else:
                words = len(delta.final.translations[0].hypotheses[0].text.split())
        records.append({"first": times[0] if times else now - start, "gaps": list(np.diff(times)),
                        "end": now - start, "early_share": early_words / max(words, 1)})

    await closed_loop(address, texts, callers, one)
    return records


async def unary(address: str, model: str, texts: list[str], callers: int, beam: int) -> list[float]:
    """Each text through Translate, ``callers`` at a time: per request its latency (seconds)."""
    latencies = []

    async def one(stub, text: str) -> None:
        start = time.perf_counter()
        await stub.Translate(request(text, model, beam), timeout=120)
        latencies.append(time.perf_counter() - start)

    await closed_loop(address, texts, callers, one)
    return latencies


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32], help="concurrent callers")
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--requests", type=int, default=96, help="sentences per cell and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each method per cell (medians)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads of the server")
    args = parser.parse_args()

    process, address, _ = start_server(args.model_repository, ["--intra-op-threads", str(args.threads),
                                                               "--queue-size", "4096"])
    rows = []
    try:
        asyncio.run(unary(address, args.model, sentences(16, 99), 4, 1))  # warm up
        for beam in args.beams:
            for callers in args.streams:
                texts = sentences(max(args.requests, callers), callers)
                runs: dict[str, list] = {"stream": [], "unary": []}
                for repeat in range(args.repeats):
                    for method in (("stream", "unary") if repeat % 2 == 0 else ("unary", "stream")):
                        if method == "stream":
                            runs["stream"].append(asyncio.run(streamed(address, args.model, texts, callers, beam)))
                        else:
                            runs["unary"].append(asyncio.run(unary(address, args.model, texts, callers, beam)))

                def median_of(metric, streams=runs["stream"]) -> float:
                    return statistics.median(metric(run) for run in streams)

                cell = {
                    "beam": beam, "callers": callers,
                    "first50": median_of(lambda r: ms([x["first"] for x in r], 50)),
                    "first95": median_of(lambda r: ms([x["first"] for x in r], 95)),
                    "gap50": median_of(lambda r: ms([g for x in r for g in x["gaps"]], 50)),
                    "gap95": median_of(lambda r: ms([g for x in r for g in x["gaps"]], 95)),
                    "end50": median_of(lambda r: ms([x["end"] for x in r], 50)),
                    "unary50": statistics.median(ms(run, 50) for run in runs["unary"]),
                    "unary95": statistics.median(ms(run, 95) for run in runs["unary"]),
                    "early": median_of(lambda r: statistics.median(x["early_share"] for x in r)),
                }
                rows.append(cell)
                print(f"beam {beam}, {callers} streams: first word p50 {cell['first50']:.1f} ms, Translate p50 "
                      f"{cell['unary50']:.1f} ms, words sent early {cell['early']:.0%}", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=30)

    print(f"\nhost: {host()}")
    print(f"model {args.model}, {args.threads} threads, {args.requests} sentences per cell x {args.repeats} repeats "
          "(medians of the runs' percentiles)")
    print("| beam | streams | first word p50 / p95 ms | word gap p50 / p95 ms | stream end p50 ms | Translate p50 / "
          "p95 ms | first word / Translate p50 | words sent before the end |")
    print("|---|---|---|---|---|---|---|---|")
    for c in rows:
        print(f"| {c['beam']} | {c['callers']} | {c['first50']:.1f} / {c['first95']:.1f} | {c['gap50']:.1f} / "
              f"{c['gap95']:.1f} | {c['end50']:.1f} | {c['unary50']:.1f} / {c['unary95']:.1f} | "
              f"{c['first50'] / c['unary50']:.2f} | {c['early']:.0%} |")


if __name__ == "__main__":
    main()
