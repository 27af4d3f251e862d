"""HTTP/JSON vs gRPC on the same server: throughput and p50 latency at 1 and 32 concurrent callers.

    nmt bench http --model-repository models --model demo-transformer

One ``nmt serve`` (a subprocess on loopback ports) answers both faces from the same scheduler. For each
number of callers the same sentences go through ``Translate`` over gRPC (``grpc.aio``) and through
``POST /v1/translate`` (aiohttp client, keep-alive connections), one sentence per request, each caller
sending its next request when the previous one returns; the two faces alternate ``--repeats`` times
(the order flips every repeat) and the table shows medians, and the median and range of the per-repeat
HTTP / gRPC ratio. Target: HTTP >= 0.8x gRPC throughput. Not a test: the figures depend on
the host (printed) and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np
from bench_common import host, sentences, start_server

from loadtests.cli import free_port


async def drive(send: Callable[[str], Awaitable[None]], texts: list[str], callers: int) -> dict[str, float]:
    """``callers`` concurrent callers sending ``texts`` one per request: sentences/s and p50 latency (ms)."""
    queue = list(texts)
    latencies: list[float] = []

    async def caller() -> None:
        while queue:
            text = queue.pop()
            t0 = time.perf_counter()
            await send(text)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    seconds = time.perf_counter() - start
    return {"sentences_s": len(texts) / seconds, "p50_ms": float(np.percentile(latencies, 50) * 1000)}


async def bench(grpc_address: str, http_port: int, model: str, beam: int, callers: list[int], requests: int,
                repeats: int) -> list[tuple[int, dict[str, list[dict[str, float]]]]]:
    import aiohttp
    import grpc

    from server.protos import pb2, pb2_grpc

    options = {"beamSize": beam}
    url = f"http://127.0.0.1:{http_port}/v1/translate"
    rows = []
    async with grpc.aio.insecure_channel(grpc_address) as channel, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(callers))
    ) as session:
        stub = pb2_grpc.TranslatorStub(channel)

        async def via_grpc(text: str) -> None:
            request = pb2.TranslateRequest(texts=[text], model=model, options=pb2.DecodingOptions(beam_size=beam))
            response = await stub.Translate(request, timeout=60)
            assert response.translations[0].hypotheses[0].text

        async def via_http(text: str) -> None:
            async with session.post(url, json={"texts": [text], "model": model, "options": options}) as response:
                body = await response.json()
                assert response.status == 200 and body["translations"][0]["hypotheses"][0]["text"], body

        faces = {"gRPC": via_grpc, "HTTP/JSON": via_http}
        for count in callers:
            texts = sentences(max(requests, count), seed=count)
            for send in faces.values():  # warm up both faces (connections, batch sizes)
                await drive(send, texts[: 2 * count], count)
            results: dict[str, list[dict[str, float]]] = {face: [] for face in faces}
            for repeat in range(repeats):
                order = list(faces) if repeat % 2 == 0 else list(reversed(faces))
                for face in order:
                    results[face].append(await drive(faces[face], texts, count))
            rows.append((count, results))
            print(f"callers {count}: " + ", ".join(
                f"{face} {statistics.median(r['sentences_s'] for r in runs):.1f} sent/s"
                for face, runs in results.items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--callers", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--requests", type=int, default=512, help="sentences per face, concurrency level and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="alternations of the two faces (medians shown)")
    parser.add_argument("--beam-size", "--beam", dest="beam_size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads of the server")
    args = parser.parse_args()

    http_port = free_port()
    process, address, _ = start_server(args.model_repository, [
        "--intra-op-threads", str(args.threads), "--max-batch-sentences", "128", "--queue-size", "4096",
        "--http-listen", f"127.0.0.1:{http_port}"])
    try:
        rows = asyncio.run(bench(address, http_port, args.model, args.beam_size, args.callers, args.requests,
                                 args.repeats))
    finally:
        process.terminate()
        process.wait(timeout=30)

    print()
    print(f"host: {host()}")
    print(f"model {args.model}, beam {args.beam_size}, {args.threads} threads, {args.requests} sentences per face "
          f"and level, {args.repeats} repeats (medians), client and server on the same host")
    print("| callers | gRPC sent/s | HTTP/JSON sent/s | HTTP / gRPC (per repeat) | gRPC p50 ms | HTTP/JSON p50 ms |")
    print("|---|---|---|---|---|---|")
    for count, results in rows:
        g = {key: statistics.median(r[key] for r in results["gRPC"]) for key in ("sentences_s", "p50_ms")}
        h = {key: statistics.median(r[key] for r in results["HTTP/JSON"]) for key in ("sentences_s", "p50_ms")}
        # each repeat ran the two faces back to back: their ratio is what drift in the host's speed spares
        ratios = sorted(b["sentences_s"] / a["sentences_s"] for a, b in zip(results["gRPC"], results["HTTP/JSON"],
                                                                              strict=True))
        print(f"| {count} | {g['sentences_s']:.1f} | {h['sentences_s']:.1f} | **{statistics.median(ratios):.2f}** "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {g['p50_ms']:.2f} | {h['p50_ms']:.2f} |")


if __name__ == "__main__":
    main()
