"""Soak benchmark: a steady load below saturation for a long time, watching memory, descriptors and latency.

    python benchmarks/soak.py --model-repository models --model demo-transformer --minutes 30

1. Starts ``nmt serve`` with its default settings as a subprocess on a loopback port.
2. **Saturation**: ``--callers`` closed-loop callers send the request mix below for ``--probe-seconds``;
   the completed requests per second are the saturation rate.
3. **Soak**: an open loop (Poisson arrivals) at ``--load`` x the saturation rate for ``--minutes``,
   the same mix, each request with a ``--deadline``. Every minute it prints the server process's
   resident memory and open file descriptors (from /proc), p50 and p99 latency, and the requests
   that succeeded, were refused as expected, or failed.

The mix (weights): one short sentence greedy (50); beam 4 with 2 hypotheses and attention, the
alignment UI's request (25); 8 sentences in one request (15); a long sentence with beam 4 (5);
an oversized request, 64 long texts with beam 8, 8 hypotheses and attention, which the work and
response budgets refuse with INVALID_ARGUMENT before any compute (5).

Targets: the resident memory after ``--warmup-minutes`` stays within +-10 % of its first
post-warm-up sample, and no accepted request fails (anything but OK, and INVALID_ARGUMENT for the
oversized requests, counts as a failure). Exits non-zero when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling benchmark modules

from bench_common import (  # noqa: E402
    host,  # noqa: E402
    sentences,
    start_server,
)

MIX = {"short greedy": 50, "beam 4 + attention": 25, "8 texts": 15, "long beam 4": 5, "oversized": 5}
RSS_TOLERANCE = 0.10


@dataclass
class Minute:
    """What one minute of the soak saw."""

    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    outcomes: Counter = field(default_factory=Counter)  # "ok", "refused" (expected), "failed: CODE"


def make_request(kind: str, texts: list[str], rng: random.Random):
    """One request of ``kind`` (a key of :data:`MIX`)."""
    from server.protos import pb2

    def pick(n: int) -> list[str]:
        return [rng.choice(texts) for _ in range(n)]

    if kind == "short greedy":
        return pb2.TranslateRequest(texts=pick(1))
    if kind == "beam 4 + attention":
        return pb2.TranslateRequest(texts=pick(1), options=pb2.DecodingOptions(
            beam_size=4, num_hypotheses=2, return_attention=True, return_scores=True))
    if kind == "8 texts":
        return pb2.TranslateRequest(texts=pick(8))
    if kind == "long beam 4":
        return pb2.TranslateRequest(texts=[" and ".join(pick(4))], options=pb2.DecodingOptions(beam_size=4))
    return pb2.TranslateRequest(texts=[" and ".join(pick(6)) for _ in range(64)], options=pb2.DecodingOptions(
        beam_size=8, num_hypotheses=8, max_length=512, length_penalty=10, return_attention=True))


async def send(stub, kind: str, request, deadline: float) -> tuple[str, float]:
    """Send one request; (outcome, seconds)."""
    import grpc

    start = time.perf_counter()
    try:
        await stub.Translate(request, timeout=deadline)
        outcome = "ok"
    except grpc.aio.AioRpcError as error:
        expected = kind == "oversized" and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        outcome = "refused" if expected else f"failed: {error.code().name}"
    return outcome, time.perf_counter() - start


async def saturation(address: str, texts: list[str], callers: int, seconds: float, deadline: float) -> float:
    """Completed requests per second of ``callers`` closed-loop callers sending the mix."""
    import grpc

    from server.protos import pb2_grpc

    kinds, weights = list(MIX), list(MIX.values())
    done = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        stop = time.monotonic() + seconds

        async def caller(seed: int) -> None:
            nonlocal done
            rng = random.Random(seed)
            while time.monotonic() < stop:
                kind = rng.choices(kinds, weights)[0]
                outcome, _ = await send(stub, kind, make_request(kind, texts, rng), deadline)
                done += outcome != "refused"

        start = time.monotonic()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        return done / (time.monotonic() - start)


def process_sample(pid: int) -> tuple[float, int]:
    """(resident memory in MiB, open file descriptors) of process ``pid``."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def soak(address: str, pid: int, texts: list[str], rate: float, minutes: float, deadline: float,
               seed: int = 1) -> list[dict]:
    """The open-loop soak; returns one row per minute (and prints it)."""
    import grpc

    from server.protos import pb2_grpc

    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    rows: list[dict] = []
    current = Minute()
    pending: set[asyncio.Task] = set()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb2_grpc.TranslatorStub(channel)

        async def one(kind: str, request) -> None:
            outcome, seconds = await send(stub, kind, request, deadline)
            minute = current  # the minute the request ended in
            minute.outcomes[outcome] += 1
            if outcome == "ok":
                minute.latencies.append(seconds)

        start = time.monotonic()
        next_arrival, next_sample = start, start + 60
        end = start + minutes * 60
        print(f"{'minute':>6} {'RSS MiB':>8} {'fds':>4} {'p50 ms':>7} {'p99 ms':>7} {'ok':>6} {'refused':>7} "
              f"{'failed':>6}  in flight", flush=True)
        while True:
            now = time.monotonic()
            if now >= next_sample:
                rss, fds = process_sample(pid)
                failed = sum(n for outcome, n in current.outcomes.items() if outcome.startswith("failed"))
                row = {"minute": len(rows) + 1, "rss_mib": round(rss, 1), "fds": fds,
                       "p50_ms": round(percentile(current.latencies, 0.50) * 1000, 1),
                       "p99_ms": round(percentile(current.latencies, 0.99) * 1000, 1),
                       "ok": current.outcomes["ok"], "refused": current.outcomes["refused"], "failed": failed,
                       "failures": {k: v for k, v in current.outcomes.items() if k.startswith("failed")}}
                rows.append(row)
                print(f"{row['minute']:>6} {rss:>8.1f} {fds:>4} {row['p50_ms']:>7} {row['p99_ms']:>7} "
                      f"{row['ok']:>6} {row['refused']:>7} {failed:>6}  {len(pending)}", flush=True)
                current = Minute()
                next_sample += 60
            if now >= end:
                break
            if now >= next_arrival:
                kind = rng.choices(kinds, weights)[0]
                task = asyncio.create_task(one(kind, make_request(kind, texts, rng)))
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_arrival += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(next_arrival, next_sample, end) - time.monotonic()))
        if pending:
            await asyncio.gather(*pending)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer", help="(the server serves every model it finds)")
    parser.add_argument("--minutes", type=float, default=30.0, help="soak duration")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="minutes left out of the RSS target")
    parser.add_argument("--load", type=float, default=0.7, help="soak rate as a fraction of the saturation rate")
    parser.add_argument("--callers", type=int, default=32, help="closed-loop callers of the saturation probe")
    parser.add_argument("--probe-seconds", type=float, default=30.0)
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds, every request")
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = parser.parse_args()
    if not any(Path(args.model_repository, args.model).glob("*/manifest.json")):
        raise SystemExit(f"no {args.model} in {args.model_repository}: run `nmt serve --demo` first")

    print(f"host: {host()}")
    print(f"mix: {MIX}; deadline {args.deadline} s; server: `nmt serve` defaults", flush=True)
    texts = sentences(2000)
    process, address, _metrics = start_server(args.model_repository, [])
    try:
        saturated = asyncio.run(saturation(address, texts, args.callers, args.probe_seconds, args.deadline))
        rate = args.load * saturated
        print(f"saturation: {saturated:.1f} requests/s with {args.callers} callers; soak at {args.load:.0%}: "
              f"{rate:.1f} requests/s for {args.minutes:g} minutes", flush=True)
        rows = asyncio.run(soak(address, process.pid, texts, rate, args.minutes, args.deadline))
    finally:
        process.terminate()
        process.wait(30)

    steady = [r for r in rows if r["minute"] > args.warmup_minutes] or rows
    base = steady[0]["rss_mib"]
    drift = max(abs(r["rss_mib"] - base) / base for r in steady)
    failed = sum(r["failed"] for r in rows)
    total = sum(r["ok"] + r["refused"] + r["failed"] for r in rows)
    summary = {
        "host": host(), "saturation_rps": round(saturated, 2), "soak_rps": round(rate, 2), "minutes": args.minutes,
        "requests": total, "ok": sum(r["ok"] for r in rows), "refused": sum(r["refused"] for r in rows),
        "failed": failed, "rss_first_mib": base, "rss_max_drift": round(drift, 4),
        "fds": [min(r["fds"] for r in steady), max(r["fds"] for r in steady)],
        "p99_ms_median_minute": statistics.median(r["p99_ms"] for r in steady),
    }
    rss_ok, failures_ok = drift <= RSS_TOLERANCE, failed == 0
    print(f"RSS after warm-up: {base:.1f} MiB, largest drift {drift:.1%} (target <= {RSS_TOLERANCE:.0%}): "
          f"{'met' if rss_ok else 'MISSED'}")
    print(f"requests: {total} ({summary['ok']} ok, {summary['refused']} refused as expected, {failed} failed; "
          f"target 0 failed): {'met' if failures_ok else 'MISSED'}")
    print(f"open fds {summary['fds'][0]}-{summary['fds'][1]}; median per-minute p99 "
          f"{summary['p99_ms_median_minute']:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "minutes": rows}, indent=2))
    sys.exit(0 if rss_ok and failures_ok else 1)


if __name__ == "__main__":
    main()
