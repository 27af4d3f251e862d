"""Static vs continuous batching (``--batching``) under a mix of short and long sentences.

    python benchmarks/batching.py --model-repository models --model demo-bahdanau

Two ``nmt serve`` subprocesses on the same model, one ``--batching static``, one ``--batching
continuous``, are driven alternately with the same requests (``--repeats`` times per cell, the order
flipping every time; medians over the repeats, so a busy neighbour on a shared host hits both): one
sentence per request, a mix of short date sentences and long ones (``--long-share`` of them:
``--long-dates`` dates joined by "and", whose translations are several times longer).

* Closed loop: ``--callers`` concurrent callers, each sending its next request when the previous returns.
* Open loop: Poisson arrivals at ``--rates`` requests/s (default: 0.5, 0.9 and 1.2 x the static
  server's closed-loop throughput at the largest number of callers), latency from each request's
  scheduled send time (so a server that falls behind pays for it).

Per cell: sentences/s, p50/p95/p99 latency, p50/p95 latency of the short sentences (long ones are in
flight nearly all the time), and the server's mean decoder rows: for continuous batching the mean of
``nmt_running_rows`` sampled every 50 ms while the cell runs, for static batching the mean batch size
(sentences x beam) from ``nmt_batch_size_sentences``; and how busy the server's inference worker was (its
``nmt_inference_duration_seconds``, encoder calls, joins and runs of steps, over the cell's time) with its encoder
calls a second (static: batches; continuous: admissions; on a device the encoder calls run beside
the steps, so it passes 100 %) and what one took, and (continuous) what joining an admission's rows to the running
decode took on the worker after its encoder call (stage ``join``). A worker busy nearly all the time bounds the
server by its compute and what surrounds each step; one often idle, by the serving layer's turnaround. Last, the
share of the continuous decode's steps whose hypotheses the host's general selection chose
(``nmt_decode_steps_total``): each ends a run of plain steps (a device holds ended rows to keep it low).
Then the ratios continuous / static the targets are stated in, and the single-caller p50 of both servers over
the bare engine's p50 on the same sentences (one at a time, alternating).

``--emulate-device STEP_MS ENCODER_MS`` runs both servers and the bare engine on an emulated device whose
decoder step takes at least STEP_MS and encoder call at least ENCODER_MS, at any row count
(:mod:`emulated_device.sitecustomize`): the regime of a GPU, where a step of a few hundred rows costs what a
step of one does, which a CPU cannot show. The work still runs on the CPU, so the floor must exceed what
the CPU's own largest step costs for the steps to be flat:

    python benchmarks/batching.py --model demo-transformer --callers 32 128 --rates --max-batch-rows 512 \
        --emulate-device 10 3

``--marian SMALL`` (or BASE) serves a random-weight Marian model of that size instead (exported as in
``engine_throughput.py``, EOS suppressed: every output runs to the length limit; short sentences of 20
placeholder pieces, long ones ``--long-dates`` of them), e.g. on a GPU (``--provider cuda``, both servers and
the bare engine; ``--serve-args`` passes more ``nmt serve`` flags to both servers):

    python benchmarks/batching.py --marian SMALL --precision fp16 --provider cuda --callers 32 128 --rates \
        --max-batch-rows 512 --frontends 2

Last, the ceiling: the bare engine in this process under the most callers, each sending its next sentence
the moment the last returns (:func:`bare_closed_loop`): static batches of that many sentences against one
running decode of that many, with the decoding steps, the decoder's time per step and per row-step and
the encoder's calls. Where a step's cost grows with its rows (a CPU with no parallel slack), fewer steps
with more rows each gain nothing, and neither can the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling benchmark modules

from bench_common import (  # noqa: E402
    host,  # noqa: E402
    sentences,
    start_server,
)
from core_profile import CoreProfile  # noqa: E402
from server_load import marian_repository  # noqa: E402

from server.policy import BY_DEVICE  # noqa: E402

MODES = ("static", "continuous")


def workload(count: int, seed: int, long_share: float, long_dates: int,
             make_texts: Callable[[int, int], list[str]] = sentences, joiner: str = " and ") -> list[tuple[str, bool]]:
    """``count`` (text, is_long) pairs: date sentences (or ``make_texts``'), ``long_share`` of them
    ``long_dates`` sentences joined by ``joiner``."""
    rng = random.Random(seed)
    dates = make_texts(count * long_dates, seed)
    texts = []
    for i in range(count):
        is_long = rng.random() < long_share
        texts.append((joiner.join(dates[i * long_dates: (i + 1) * long_dates]) if is_long else dates[i], is_long))
    return texts


async def closed_loop(address: str, model: str, texts: list[tuple[str, bool]], callers: int,
                      beam: int) -> dict:
    """``callers`` concurrent callers sending ``texts`` one per request."""
    import grpc

    from server.protos import pb2, pb2_grpc

    queue = list(reversed(texts))
    records: list[tuple[float, bool]] = []

    async def caller(stub) -> None:
        while queue:
            text, is_long = queue.pop()
            request = pb2.TranslateRequest(texts=[text], model=model, options=pb2.DecodingOptions(beam_size=beam))
            start = time.perf_counter()
            await stub.Translate(request, timeout=300)
            records.append((time.perf_counter() - start, is_long))

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(caller(stub) for _ in range(callers)))
        seconds = time.perf_counter() - start
    return {"sentences_s": len(texts) / seconds, "records": records}


async def open_loop(address: str, model: str, texts: list[tuple[str, bool]], rate: float, beam: int,
                    seed: int) -> dict:
    """Requests sent at Poisson arrival times of ``rate`` per second, whatever the answers."""
    import grpc

    from server.protos import pb2, pb2_grpc

    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(1.0 / rate, len(texts)))
    records: list[tuple[float, bool]] = []

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        start = time.perf_counter()

        async def send(offset: float, text: str, is_long: bool) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            request = pb2.TranslateRequest(texts=[text], model=model, options=pb2.DecodingOptions(beam_size=beam))
            await stub.Translate(request, timeout=300)
            records.append((time.perf_counter() - (start + offset), is_long))

        await asyncio.gather(*(send(o, t, is_long) for o, (t, is_long) in zip(offsets, texts, strict=True)))
        seconds = time.perf_counter() - start
    return {"sentences_s": len(texts) / seconds, "records": records}


def scrape(metrics: str) -> dict[str, float]:
    """Every sample of the server's /metrics: name{labels} -> value summed over the labels, and by stage or
    selection as ``name{stage=...}`` where a sample has one (``nmt_inference_duration_seconds``,
    ``nmt_decode_steps_total``)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            keys = [sample.name] + [f"{sample.name}{{{label}={sample.labels[label]}}}"
                                    for label in ("stage", "selection") if label in sample.labels]
            for key in keys:
                values[key] = values.get(key, 0.0) + sample.value
    return values


class RowSampler:
    """The server's ``nmt_running_rows``, sampled every 50 ms on a thread while a cell runs."""

    def __init__(self, metrics: str) -> None:
        self.metrics, self.samples, self._stop = metrics, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(scrape(self.metrics).get("nmt_running_rows", 0.0))

    def __enter__(self) -> RowSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(server: tuple, mode: str, model: str, texts: list, beam: int, callers: int | None,
            rate: float | None, seed: int) -> dict:
    """One cell on one server: the load, then latency percentiles and mean rows."""
    _, address, metrics = server
    before = scrape(metrics)
    with RowSampler(metrics) as sampler:
        if rate is None:
            result = asyncio.run(closed_loop(address, model, texts, callers, beam))
        else:
            result = asyncio.run(open_loop(address, model, texts, rate, beam, seed))
    after = scrape(metrics)
    if mode == "continuous":
        rows = statistics.fmean(sampler.samples) if sampler.samples else 0.0
    else:
        sentences_batched = after["nmt_batch_size_sentences_sum"] - before["nmt_batch_size_sentences_sum"]
        batches = after["nmt_batch_size_sentences_count"] - before["nmt_batch_size_sentences_count"]
        rows = beam * sentences_batched / max(batches, 1)
    wall = len(texts) / result["sentences_s"]
    busy = (after["nmt_inference_duration_seconds_sum"] - before.get("nmt_inference_duration_seconds_sum", 0.0))
    encodes = after["nmt_batch_size_sentences_count"] - before.get("nmt_batch_size_sentences_count", 0.0)
    encode = "nmt_inference_duration_seconds_{}{{stage=encode}}"
    calls = after[encode.format("count")] - before.get(encode.format("count"), 0.0)
    encode_ms = 1000 * (after[encode.format("sum")] - before.get(encode.format("sum"), 0.0)) / max(calls, 1)
    join = "nmt_inference_duration_seconds_sum{stage=join}"
    join_ms = 1000 * (after.get(join, 0.0) - before.get(join, 0.0)) / max(calls, 1)
    key = "nmt_decode_steps_total{{selection={}}}"
    steps = {selection: after.get(key.format(selection), 0.0) - before.get(key.format(selection), 0.0)
             for selection in ("plain", "general")}
    latencies = np.array([seconds for seconds, _ in result["records"]]) * 1000
    short = np.array([seconds for seconds, is_long in result["records"] if not is_long]) * 1000
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
    s50, s95 = np.percentile(short, [50, 95])
    return {"sentences_s": result["sentences_s"], "p50": p50, "p95": p95, "p99": p99, "short_p50": s50,
            "short_p95": s95, "rows": rows, "busy": busy / wall, "encodes_s": encodes / wall, "encode_ms": encode_ms,
            "join_ms": join_ms, "general": steps["general"] / max(sum(steps.values()), 1)}


def bare_engine_p50(repository: str, model: str, texts: list, beam: int, threads: int,
                    servers: dict[str, tuple], provider: str = "cpu") -> dict[str, float]:
    """p50 of one sentence at a time: the bare engine, then each server, alternating per sentence."""
    import grpc

    from server.engine.engine import Engine
    from server.protos import pb2, pb2_grpc
    from server.types import DecodingOptions, SentenceRequest

    version = sorted(Path(repository, model).glob("*/manifest.json"))[-1].parent
    engine = Engine.load(version, provider=provider, intra_op_threads=threads)
    options = DecodingOptions(beam_size=beam)
    times: dict[str, list[float]] = {"engine": [], **{mode: [] for mode in servers}}
    channels = {mode: grpc.insecure_channel(address) for mode, (_, address, _) in servers.items()}
    stubs = {mode: pb2_grpc.TranslatorStub(channel) for mode, channel in channels.items()}
    for text, _ in texts:
        start = time.perf_counter()
        engine.translate_batch([SentenceRequest(engine.tokenize(text), options)])
        times["engine"].append(time.perf_counter() - start)
        for mode, stub in stubs.items():
            start = time.perf_counter()
            stub.Translate(pb2.TranslateRequest(texts=[text], model=model,
                                                options=pb2.DecodingOptions(beam_size=beam)), timeout=60)
            times[mode].append(time.perf_counter() - start)
    for channel in channels.values():
        channel.close()
    return {name: float(np.median(values)) * 1000 for name, values in times.items()}


def bare_closed_loop(repository: str, model: str, texts: list, beam: int, callers: int, max_rows: int,
                     threads: int, repeats: int, provider: str = "cpu") -> dict[str, dict[str, float]]:
    """The bare engine in this process under ``callers`` callers that never wait: static batching decodes
    the sentences ``callers`` at a time, each batch to its end (the ideal static batch); continuous
    batching keeps ``callers`` sentences in one running decode of at most ``max_rows`` rows, admitting the
    next sentence as soon as one leaves. No gRPC and no queue, so this is the most either server can do on
    this engine. Per mode (medians over ``repeats``, alternating): sentences/s, decoding steps, decoder ms
    per step, mean rows per step and encoder calls and ms, all detokenized as the servers do."""
    from collections import deque

    from server.engine.decode import RunningDecode
    from server.engine.engine import Engine
    from server.engine.host_runs import GreedySteps
    from server.types import DecodingOptions, SentenceRequest

    version = sorted(Path(repository, model).glob("*/manifest.json"))[-1].parent
    engine = Engine.load(version, provider=provider, intra_op_threads=threads)
    requests = [SentenceRequest(engine.tokenize(text), DecodingOptions(beam_size=beam), text=text)
                for text, _ in texts]
    counts: dict[str, float] = dict(steps=0, step_s=0.0, rows=0, encodes=0, encode_s=0.0)
    step, encode, plain_step = engine.model.step, engine.model.encode, GreedySteps.run

    def timed_step(tokens, *args, **kwargs):
        start = time.perf_counter()
        out = step(tokens, *args, **kwargs)
        counts["steps"] += 1
        counts["step_s"] += time.perf_counter() - start
        counts["rows"] += len(tokens)
        return out

    def timed_plain_step(run):  # a plain greedy step (GreedySteps.run) does not go through model.step
        start = time.perf_counter()
        plain_step(run)
        counts["steps"] += 1
        counts["step_s"] += time.perf_counter() - start
        counts["rows"] += run.rows

    def timed_encode(src):
        start = time.perf_counter()
        out = encode(src)
        counts["encodes"] += 1
        counts["encode_s"] += time.perf_counter() - start
        return out

    def static() -> None:
        for i in range(0, len(requests), callers):
            engine.translate_batch(requests[i: i + callers])

    def continuous() -> None:
        decode = RunningDecode(engine.model, start_id=engine.start_id, eos_id=engine.eos_id)
        waiting, in_flight = deque(range(len(requests))), 0
        while waiting or decode.rows:
            ready, rows = [], decode.reserved_rows
            while waiting and in_flight + len(ready) < callers and rows + beam <= max_rows:
                ready.append(waiting.popleft())
                rows += beam
            if ready:
                encoded, sentences, _ = engine.encode([requests[i] for i in ready])
                decode.admit(encoded, sentences, ready)
                in_flight += len(ready)
            for i, result in decode.step():
                engine.to_translation(requests[i], result)
                in_flight -= 1

    runs: dict[str, list[dict[str, float]]] = {"static": [], "continuous": []}
    engine.model.step, engine.model.encode, GreedySteps.run = timed_step, timed_encode, timed_plain_step
    try:
        static(), continuous()  # warm up
        for repeat in range(repeats):
            for mode, run in (("static", static), ("continuous", continuous))[:: 1 if repeat % 2 == 0 else -1]:
                counts.update(dict.fromkeys(counts, 0))
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
                runs[mode].append({"sentences_s": len(requests) / seconds, "steps": counts["steps"],
                                   "step_ms": 1000 * counts["step_s"] / counts["steps"],
                                   "rows": counts["rows"] / counts["steps"], "encodes": counts["encodes"],
                                   "encode_ms": 1000 * counts["encode_s"], "total_ms": 1000 * seconds})
    finally:
        del engine.model.step, engine.model.encode  # the class's methods again
        GreedySteps.run = plain_step
    return {mode: {key: float(np.median([r[key] for r in values])) for key in values[0]}
            for mode, values in runs.items()}


def row(label: str, cells: dict[str, dict]) -> str:
    s, c = cells["static"], cells["continuous"]
    return (f"| {label} | {s['sentences_s']:.1f} / {c['sentences_s']:.1f} ({c['sentences_s'] / s['sentences_s']:.2f}x) "
            f"| {s['p50']:.0f} / {c['p50']:.0f} | {s['p95']:.0f} / {c['p95']:.0f} ({c['p95'] / s['p95']:.2f}x) "
            f"| {s['p99']:.0f} / {c['p99']:.0f} | {s['short_p50']:.0f} / {c['short_p50']:.0f} "
            f"| {s['short_p95']:.0f} / {c['short_p95']:.0f} ({c['short_p95'] / s['short_p95']:.2f}x) "
            f"| {s['rows']:.1f} / {c['rows']:.1f} | {s['busy']:.0%} / {c['busy']:.0%} "
            f"| {s['encodes_s']:.0f} / {c['encodes_s']:.0f} | {s['encode_ms']:.2f} / {c['encode_ms']:.2f} "
            f"| {c['join_ms']:.2f} | {c['general']:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-bahdanau")
    parser.add_argument("--callers", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rates", nargs="*", type=float, help="open-loop requests/s (default: from static's "
                        "closed-loop throughput at the most callers, x 0.5, 0.9, 1.2; --rates alone: none)")
    parser.add_argument("--requests", type=int, default=120, help="requests per cell and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each cell on each server (medians)")
    parser.add_argument("--long-share", type=float, default=0.25)
    parser.add_argument("--long-dates", type=int, default=4, help="dates in a long sentence")
    parser.add_argument("--beam-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads of each server")
    parser.add_argument("--single", type=int, default=40, help="sentences of the single-caller comparison (0: none)")
    parser.add_argument("--max-batch-rows", type=int, help="the continuous server's --max-batch-rows (default: its "
                        "default)")
    parser.add_argument("--emulate-device", nargs=2, type=float, metavar=("STEP_MS", "ENCODER_MS"),
                        help="servers and bare engine on an emulated device whose decoder step takes at least STEP_MS "
                        "and encoder call at least ENCODER_MS at any row count, as a GPU's (emulated_device/)")
    parser.add_argument("--max-wait-ms", type=float, help="both servers' --max-wait-ms (default: theirs)")
    parser.add_argument("--frontends", type=int, default=0, help="both servers' --frontends")
    parser.add_argument("--profile-core", metavar="PREFIX",
                        help="sample each server's engine core with py-spy during its first run of each closed-loop "
                             "cell: PREFIX-<mode>-<callers>.txt (collapsed stacks), the busiest frames printed "
                             "(benchmarks/core_profile.py)")
    parser.add_argument("--serve-args", default="", help="more `nmt serve` flags for both servers, e.g. "
                        "\"--decode-tokens 262144 --batch-work 65536\"")
    parser.add_argument("--marian", choices=["SMALL", "BASE"],
                        help="serve a random-weight Marian model of this size instead of --model (placeholder "
                        "sentences of 20 pieces, a long one --long-dates of them; every output runs to the length "
                        "limit)")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                        help="--marian: the precision the model is exported in (fp16 for GPUs)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu",
                        help="where the servers and the bare engine run")
    args = parser.parse_args()
    if args.emulate_device:
        from emulated_device.sitecustomize import activate

        activate(*args.emulate_device)
    with tempfile.TemporaryDirectory() as work:
        if args.marian:
            run(args, marian_repository(args, Path(work)), " ")
        else:
            run(args, sentences, " and ")


def run(args: argparse.Namespace, make_texts: Callable[[int, int], list[str]], joiner: str) -> None:
    """Every cell on both servers, the single-caller comparison and the bare engine's ceiling; then the tables."""

    def texts_of(count: int, seed: int) -> list[tuple[str, bool]]:
        return workload(count, seed, args.long_share, args.long_dates, make_texts, joiner)

    flags = ["--intra-op-threads", str(args.threads), "--queue-size", "4096", "--max-batch-sentences", "128",
             "--provider", args.provider, "--frontends", str(args.frontends)]
    if args.max_wait_ms is not None:
        flags += ["--max-wait-ms", str(args.max_wait_ms)]
    if args.max_batch_rows:
        flags += ["--max-batch-rows", str(args.max_batch_rows)]
    flags += shlex.split(args.serve_args)
    servers = {mode: start_server(args.model_repository, [*flags, "--batching", mode]) for mode in MODES}
    results: list[tuple[str, dict[str, dict]]] = []
    try:
        for mode in MODES:  # warm up
            measure(servers[mode], mode, args.model, texts_of(32, 99),
                    args.beam_size, 8, None, 0)
        cell = 0

        def run_cell(label: str, callers: int | None, rate: float | None) -> dict[str, dict]:
            nonlocal cell
            texts = texts_of(args.requests, cell)
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for repeat in range(args.repeats):
                for mode in (MODES if (cell + repeat) % 2 == 0 else MODES[::-1]):
                    profile = (CoreProfile(servers[mode][0].pid, Path(f"{args.profile_core}-{mode}-{callers}.txt"))
                               if args.profile_core and rate is None and repeat == 0 else contextlib.nullcontext())
                    with profile:
                        runs[mode].append(measure(servers[mode], mode, args.model, texts, args.beam_size, callers,
                                                  rate, cell))
            cells = {mode: {key: float(np.median([r[key] for r in runs[mode]])) for key in runs[mode][0]}
                     for mode in MODES}
            cell += 1
            results.append((label, cells))
            print(row(label, cells), flush=True)
            return cells

        for callers in args.callers:
            closed = run_cell(f"{callers} callers", callers, None)
        rates = args.rates if args.rates is not None else [
            round(closed["static"]["sentences_s"] * f, 1) for f in (0.5, 0.9, 1.2)]
        for rate in rates:
            run_cell(f"Poisson {rate:g}/s", None, rate)
        single = bare_engine_p50(args.model_repository, args.model, texts_of(args.single, 1000), args.beam_size,
                                 args.threads, servers, args.provider) if args.single else None
    finally:
        for process, _, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
    callers = max(args.callers)
    bare_rows = args.max_batch_rows or BY_DEVICE["max_batch_rows"][args.provider]  # the servers' own cap
    bare = bare_closed_loop(args.model_repository, args.model, texts_of(args.requests, 2000), args.beam_size,
                            callers, bare_rows, args.threads, args.repeats, args.provider)

    print(f"\nhost: {host()}")
    if args.emulate_device:
        print(f"emulated device: a decoder step takes at least {args.emulate_device[0]:g} ms and an encoder call "
              f"{args.emulate_device[1]:g} ms at any row count (benchmarks/emulated_device)")
    print(f"model {args.model} ({args.provider}), beam {args.beam_size}, {args.threads} threads per server, "
          f"{args.frontends} front-ends{', ' + args.serve_args if args.serve_args else ''}, {args.requests} requests "
          f"x {args.repeats} repeats per cell (medians), {args.long_share:.0%} long ({args.long_dates} dates), "
          "static / continuous in each cell")
    print("| load | sentences/s (ratio) | p50 ms | p95 ms (ratio) | p99 ms | short p50 ms | short p95 ms (ratio) "
          "| mean rows | worker busy | encoder calls/s | ms an encoder call | continuous: ms a join "
          "| continuous: general steps |")
    print("|---" * 13 + "|")
    for label, cells in results:
        print(row(label, cells))
    worst = min(min(c["continuous"]["sentences_s"] / c["static"]["sentences_s"],
                    c["static"]["p95"] / c["continuous"]["p95"]) for _, c in results)
    print(f"\nworst cell, continuous over static (throughput, or static p95 over continuous p95): {worst:.2f}x")
    if single is not None:
        print(f"single caller p50 ({args.single} sentences, alternating): engine {single['engine']:.1f} ms, static "
              f"{single['static']:.1f} ms ({single['static'] / single['engine']:.2f}x), continuous "
              f"{single['continuous']:.1f} ms ({single['continuous'] / single['engine']:.2f}x)")
    print(f"\nbare engine, {callers} callers that never wait ({args.requests} sentences, "
          f"continuous up to {bare_rows} rows; medians of {args.repeats}):")
    print("| mode | sentences/s | decoding steps | decoder ms per step | mean rows | ms per row-step | "
          "encoder calls / ms | total ms |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, b in bare.items():
        print(f"| {mode} | {b['sentences_s']:.0f} | {b['steps']:.0f} | {b['step_ms']:.2f} | {b['rows']:.1f} | "
              f"{b['step_ms'] / b['rows']:.3f} | {b['encodes']:.0f} / {b['encode_ms']:.0f} | {b['total_ms']:.0f} |")
    print(f"continuous / static on the bare engine: "
          f"{bare['continuous']['sentences_s'] / bare['static']['sentences_s']:.2f}x (the most the servers' ratio "
          f"can be with {callers} callers)")
    served = max(dict(results)[f"{callers} callers"][mode]["sentences_s"] for mode in MODES)
    ideal = max(b["sentences_s"] for b in bare.values())
    print(f"the better server over the better bare mode at {callers} callers: {served / ideal:.2f}x")


if __name__ == "__main__":
    main()
