"""Head-of-line benchmark: one-sentence requests with a 1 s deadline sent while a large request decodes.

    python benchmarks/head_of_line.py --model-repository models --model demo-transformer

For each ``--batch-work`` setting (default: the server's default and an unbounded one, which decodes
the whole large request as one batch as the server did before batches were bounded), ``nmt serve``
is started, a large request is sent (64 long texts, beam 8, 2 hypotheses, length penalty 10,
attention: within the default work and response budgets), and while it runs, one-sentence greedy requests with a 1 s
deadline follow one another. Prints, per setting: how many small requests met their deadline (the
others get DEADLINE_EXCEEDED, most at admission), the p50 and max latency of those that met it, and
how long the large request took (what splitting it costs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling benchmark modules

from bench_common import (  # noqa: E402
    host,  # noqa: E402
    sentences,
    start_server,
)

UNBOUNDED = 10**9


def measure(repository: str, model: str, batch_work: int, texts: list[str], small: int,
            batching: str = "static") -> dict:
    """One server with ``batch_work`` and ``batching``: the large request, and ``small`` one-sentence requests
    behind it."""
    import grpc

    from server.protos import pb2, pb2_grpc

    process, address, _ = start_server(repository, ["--batch-work", str(batch_work), "--batching", batching])
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.TranslatorStub(channel)
            stub.Translate(pb2.TranslateRequest(texts=texts[:4], model=model), timeout=30)  # warm
            large = pb2.TranslateRequest(texts=[" and ".join(texts[i : i + 4]) for i in range(64)], model=model,
                                         options=pb2.DecodingOptions(beam_size=8, num_hypotheses=2,
                                                                     length_penalty=10, return_attention=True))
            large_seconds: list[float] = []

            def send_large() -> None:
                start = time.perf_counter()
                stub.Translate(large, timeout=300)
                large_seconds.append(time.perf_counter() - start)

            thread = threading.Thread(target=send_large)
            thread.start()
            time.sleep(0.2)  # the large request is decoding
            latencies, met = [], 0
            for text in texts[100 : 100 + small]:
                start = time.perf_counter()
                try:
                    stub.Translate(pb2.TranslateRequest(texts=[text], model=model), timeout=1.0)
                except grpc.RpcError as error:  # refused at admission, or expired while queued or decoding
                    if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    continue
                met += 1
                latencies.append(time.perf_counter() - start)
            thread.join()
    finally:
        process.terminate()
        process.wait(30)
    return {"met": met, "small": small, "large_s": large_seconds[0],
            "p50_ms": f"{statistics.median(latencies) * 1000:.0f}" if latencies else "-",
            "max_ms": f"{max(latencies) * 1000:.0f}" if latencies else "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--batch-work", type=int, nargs="+", default=[16384, UNBOUNDED])
    parser.add_argument("--small", type=int, default=10, help="one-sentence requests behind the large one")
    parser.add_argument("--batching", nargs="+", choices=["static", "continuous"], default=["static"],
                        help="the server's --batching (continuous ignores --batch-work: the large request's "
                        "sentences and the small ones share the running decode)")
    args = parser.parse_args()
    texts = sentences(400)
    print(f"host: {host()}")
    print(f"{'batching':>10} {'batch work':>10} {'met 1 s':>8} {'p50 ms':>7} {'max ms':>7} {'large request s':>16}")
    for batching in args.batching:
        for batch_work in args.batch_work if batching == "static" else args.batch_work[:1]:
            r = measure(args.model_repository, args.model, batch_work, texts, args.small, batching)
            label = "unbounded" if batch_work >= UNBOUNDED else str(batch_work)
            print(f"{batching:>10} {label:>10} {r['met']:>4}/{r['small']:<3} {r['p50_ms']:>7} {r['max_ms']:>7} "
                  f"{r['large_s']:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
