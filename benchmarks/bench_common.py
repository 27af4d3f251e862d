"""What the benchmarks share: the host's description, percentiles, demo-like sentences, a server started on
free loopback ports, and the CPU and batch counters they read from a running server."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages

from common.errors import NmtError  # noqa: E402
from loadtests.cli import free_port, wait_serving  # noqa: E402

__all__ = ["free_port", "wait_serving"]


def host() -> str:
    """CPU model and the widest vector instruction set it offers (from /proc/cpuinfo)."""
    model, flags = "unknown CPU", set()
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                        ("avx", "AVX")) if flag in flags), "SSE")
    extras = [flag for flag in ("avx512_vnni", "avx512_bf16", "avx_vnni") if flag in flags]
    return f"{model}, {os.cpu_count()} cores, {isa}" + (f" ({', '.join(extras)})" if extras else "")


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


def start_server(repository: str, flags: list[str]) -> tuple[subprocess.Popen, str, str]:
    """``nmt serve`` with ``flags`` on free loopback ports, once healthy: (process, address, metrics address).
    Without the translation cache unless ``flags`` ask for it: the benchmarks repeat their sentences to measure
    decoding (benchmarks/cache.py measures the cache)."""
    address, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = dict(os.environ, NMT_LOG_LEVEL="WARNING")
    process = subprocess.Popen(
        [sys.executable, "-m", "nmt", "serve", "--model-repository", repository, "--listen", address,
         "--metrics-listen", metrics, "--http-listen", "", "--cache-mb", "0", *flags],
        env=env, stdout=subprocess.DEVNULL,
    )
    try:
        wait_serving(address, process, timeout=60)
    except NmtError:
        process.kill()
        raise
    return process, address, metrics
