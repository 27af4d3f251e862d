"""Translation cache benchmark: a replay of repeated strings with the cache off, in this process and on Redis.

    nmt bench cache --model-repository models
    python benchmarks/cache.py --model-repository models --requests 10000 --distinct 1000 --callers 8

(a) **replay**, through ``nmt serve`` on free loopback ports: ``--requests`` one-sentence requests drawn from
    ``--distinct`` demo-like dates with Zipf's law (the k-th most frequent string has weight 1/k^``--zipf``), sent
    by ``--callers`` concurrent gRPC callers; the cache off (``--cache-mb 0``), in the serving process (the
    default), and on a Redis alone (``--cache-mb 0 --cache-redis``: what a replica gets from the shared layer
    when its own has not seen a string). Sentences/s, the callers' p50 latency and the hit rate
    (``nmt_cache_lookups_total``).
(b) **a hit's latency in the server**, in this process: the Translate handler called through the interceptor
    (authentication, metrics, logs, validation, tokenizing, the cache, detokenizing and the response message: all
    but the transport), for strings already cached, against the same handler decoding them with the cache off;
    median and p99 of ``--rounds`` passes over 200 strings.

Redis is Debian's ``redis-server`` started on a free port (the Redis rows are left out where it is not
installed). The CPU model is printed above the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's packages, run as a script

from bench_common import free_port, host, percentiles, start_server  # noqa: E402

from server.config import ServerConfig  # noqa: E402
from server.core.process import open_repository  # noqa: E402
from server.frontend.app import TranslationServer  # noqa: E402
from server.frontend.http_face import HttpContext  # noqa: E402
from server.protos import SERVICE_NAME, pb2, pb2_grpc  # noqa: E402

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def distinct_dates(count: int) -> list[str]:
    """``count`` different demo-like dates."""
    every = list(itertools.product(range(1900, 2100), MONTHS, range(1, 29)))
    picked = np.random.default_rng(3).choice(len(every), size=count, replace=False)
    return [f"{DAYS[(every[i][0] + every[i][2]) % 7]}, {every[i][1]} {every[i][2]}, {every[i][0]}" for i in picked]


def zipf_replay(texts: list[str], requests: int, exponent: float) -> list[str]:
    weights = 1.0 / np.arange(1, len(texts) + 1) ** exponent
    draws = np.random.default_rng(11).choice(len(texts), size=requests, p=weights / weights.sum())
    return [texts[i] for i in draws]


def cache_lookups(metrics_address: str) -> tuple[float, float]:
    """(hits, misses) over both layers so far."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    hits = misses = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nmt_cache_lookups_total":
                if sample.labels["result"] == "hit":
                    hits += sample.value
                else:
                    misses += sample.value
    return hits, misses


def replay(address: str, model: str, sequence: list[str], callers: int) -> tuple[float, list[float]]:
    """Sentences/s over the whole replay and every request's latency."""
    latencies: list[float] = []
    lock = threading.Lock()
    items = iter(enumerate(sequence))

    def caller() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.TranslatorStub(channel)
            while True:
                with lock:
                    item = next(items, None)
                if item is None:
                    return
                start = time.perf_counter()
                stub.Translate(pb2.TranslateRequest(texts=[item[1]], model=model), timeout=120)
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(sequence) / (time.perf_counter() - start), latencies


async def handler_latencies(repository: str, model: str, texts: list[str], rounds: int, **cache: object) -> list[float]:
    """Seconds of each Translate handler call (through the interceptor) after a first pass filled the cache."""
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="", model_repository=repository,
                          reload_interval=0, **cache).validate()
    server = TranslationServer(config, opener=open_repository)
    await server.start()
    try:
        behavior = server.interceptor.http_behavior(f"/{SERVICE_NAME}/Translate", server.servicer.Translate)

        async def one(text: str) -> float:
            start = time.perf_counter()
            await behavior(pb2.TranslateRequest(texts=[text], model=model), HttpContext({}, None))
            return time.perf_counter() - start

        for text in texts:
            await one(text)
        return [await one(text) for _ in range(rounds) for text in texts]
    finally:
        await server.shutdown(0)


class Redis:
    def __init__(self) -> None:
        self.port = free_port()
        self.directory = tempfile.mkdtemp(prefix="bench-redis-")
        self.process = subprocess.Popen([shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", self.directory],
                                        stdout=subprocess.DEVNULL)
        time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--distinct", type=int, default=1000)
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the strings' frequencies")
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="passes of (b) over its 200 strings")
    args = parser.parse_args()

    texts = distinct_dates(args.distinct)
    sequence = zipf_replay(texts, args.requests, args.zipf)
    redis = Redis() if shutil.which("redis-server") else None
    print(f"host: {host()}")
    print(f"\n(a) {args.requests} requests over {args.distinct} strings (Zipf {args.zipf}; "
          f"{len(set(sequence))} distinct in the replay), {args.callers} callers, {args.model}")
    print("| cache | sentences/s | p50 ms | p99 ms | hit rate |")
    print("|---|---:|---:|---:|---:|")
    modes = {"off": ["--cache-mb", "0"], "in-process (default)": ["--cache-mb", "256"]}
    if redis is not None:
        modes["Redis alone"] = ["--cache-mb", "0", "--cache-redis", redis.url]
    try:
        for name, flags in modes.items():
            process, address, metrics = start_server(args.model_repository, flags)
            try:
                rate, latencies = replay(address, args.model, sequence, args.callers)
                hits, misses = cache_lookups(metrics)
                p50, _, p99 = percentiles(latencies)
                share = f"{hits / (hits + misses):.1%}" if hits + misses else "-"
                print(f"| {name} | {rate:,.0f} | {p50:.2f} | {p99:.2f} | {share} |")
            finally:
                process.terminate()
                process.wait(30)

        probe = texts[:200]
        print(f"\n(b) the Translate handler in this process, {len(probe)} strings x {args.rounds} passes (ms)")
        print("| handler | p50 | p99 |")
        print("|---|---:|---:|")
        cases = {"decoding (cache off)": {"cache_mb": 0}, "in-process hit": {"cache_mb": 256}}
        if redis is not None:
            cases["Redis hit (no in-process layer)"] = {"cache_mb": 0, "cache_redis": redis.url}
        for name, cache in cases.items():
            seconds = asyncio.run(handler_latencies(args.model_repository, args.model, probe, args.rounds, **cache))
            p50, _, p99 = percentiles(seconds)
            print(f"| {name} | {p50:.3f} | {p99:.3f} |")
    finally:
        if redis is not None:
            redis.close()


if __name__ == "__main__":
    main()
