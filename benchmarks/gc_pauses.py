"""The cyclic garbage collector's pauses in the server, with start-up's objects frozen (``--gc-freeze``, the
default) and without (``--no-gc-freeze``).

    python benchmarks/gc_pauses.py --model-repository <repository> [--requests 3000] [--callers 16]

Two figures, each side by side in one run:

* **One full collection**: the model repository opened in this process as ``nmt serve`` opens it (the server's
  modules imported, every version loaded), then ``gc.collect()`` timed five times; then
  :func:`server.collector.freeze` and the same again. A full collection stops every thread of the process.
* **Under load**: two ``nmt serve`` processes on loopback, one each way, ``--rounds`` alternating rounds of
  ``--requests`` single-sentence requests from ``--callers`` concurrent callers; per round the collections each
  server made (``nmt_gc_pause_seconds`` scraped before and after), their summed pause, and the callers' latency
  percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import (  # noqa: E402
    host,  # noqa: E402
    percentiles,
    sentences,
    start_server,
)
from server_load import bench_server  # noqa: E402

from server import collector  # noqa: E402


def full_collection_ms(repeats: int = 5) -> float:
    """Median milliseconds of one ``gc.collect()`` in this process."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def one_full_collection(repository: str) -> None:
    """A full collection's pause in a process that has loaded the repository, before and after freezing."""
    from server.config import ServerConfig
    from server.core.process import open_repository
    from server.frontend.app import TranslationServer
    from server.metrics import ServerMetrics

    async def opened() -> object:
        config = ServerConfig(model_repository=repository, listen="127.0.0.1:0", metrics_listen="", http_listen="")
        TranslationServer(config)  # the front-end's modules, as one process imports them
        return await open_repository(config, ServerMetrics())

    loaded = asyncio.run(opened())
    tracked, before = len(gc.get_objects()), full_collection_ms()
    frozen = collector.freeze()
    after = full_collection_ms()
    print(f"one full collection (model versions loaded: {len(list(loaded))}): {before:.2f} ms over {tracked:,} tracked "
          f"objects; after freezing {frozen:,}: {after:.3f} ms over {len(gc.get_objects()):,}")
    gc.unfreeze()


def pauses(metrics: str) -> dict[str, tuple[float, float]]:
    """``nmt_gc_pause_seconds`` of a server: generation -> (collections, seconds)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "nmt_gc_pause_seconds":
            for sample in family.samples:
                entry = found.setdefault(sample.labels["generation"], [0.0, 0.0])
                if sample.name.endswith("_count"):
                    entry[0] += sample.value
                elif sample.name.endswith("_sum"):
                    entry[1] += sample.value
    return {generation: (count, seconds) for generation, (count, seconds) in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model-repository", required=True)
    parser.add_argument("--model", default="", help="the model to translate with (default: the server's)")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--frontends", type=int, default=0)
    args = parser.parse_args()
    print(host())
    one_full_collection(args.model_repository)
    flags = ["--frontends", str(args.frontends)] + (["--default-model", args.model] if args.model else [])
    servers = {freeze: start_server(args.model_repository, [*flags, "--gc-freeze" if freeze else "--no-gc-freeze"])
               for freeze in (True, False)}
    texts = sentences(args.requests, 1)
    print(f"\nunder load: {args.requests} single-sentence requests a round, {args.callers} callers, "
          f"{'one process' if not args.frontends else f'{args.frontends} front-ends'}")
    print("| round | server | collections (gen 0 / 1 / 2) | gen 2 pause, ms a collection | paused ms a 1,000 "
          "requests | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for _, address, _ in servers.values():
            asyncio.run(bench_server(address, args.model, texts[:200], args.callers, 1))  # warm-up
        time.sleep(2 * collector.FLUSH_SECONDS)
        for round_ in range(args.rounds):
            for freeze in (True, False) if round_ % 2 == 0 else (False, True):
                _, address, metrics = servers[freeze]
                before = pauses(metrics)
                result = asyncio.run(bench_server(address, args.model, texts, args.callers, 1))
                time.sleep(2 * collector.FLUSH_SECONDS)  # the server writes the pauses it measured this often
                after = pauses(metrics)
                counts = {g: after[g][0] - before[g][0] for g in after}
                seconds = {g: after[g][1] - before[g][1] for g in after}
                p50, _, p99 = percentiles(result["latencies"])  # ms
                gen2 = seconds["2"] / counts["2"] * 1000 if counts["2"] else 0.0
                print(f"| {round_ + 1} | {'--gc-freeze' if freeze else '--no-gc-freeze'} | "
                      f"{' / '.join(f'{counts[g]:.0f}' for g in '012')} | {gen2:.2f} | "
                      f"{sum(seconds.values()) * 1000 / args.requests * 1000:.1f} | {p50:.2f} | {p99:.2f} | "
                      f" {max(result['latencies']) * 1000:.2f} |", flush=True)
    finally:
        for process, _, _ in servers.values():
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    main()
