"""Server benchmark: the bare engine vs the gRPC server under 1, 8, 32 and 128 concurrent callers.

    python benchmarks/server_load.py --model-repository models --model demo-transformer

The same model and the same sentences go (a) straight to ``Engine.translate_batch`` in batches as
large as the number of callers (ideal batching, no server) and (b) through ``nmt serve`` started as a
subprocess on a loopback port, driven by that many concurrent asyncio callers each sending one
sentence per request. Prints sentences/s, target tokens/s and p50/p95/p99 latency for both, and the
ratios the targets are stated in: server/engine throughput at 128 callers (target >= 0.9) and server
p50 at 1 caller over the engine's single-sentence latency (target <= 1.2). That last ratio is
measured pairwise: each sentence goes once to the engine and once through the server (a blocking
client), alternately, so drift in the machine's speed hits both sides alike.

Where the time goes, per request: CPU seconds of the server process (from /proc) and of the load
generator (this process, idle engine), and the server's mean batch size (from its /metrics). The
same load against a bare ``grpc.aio`` servicer that answers at once (``--echo-server``, started as a
subprocess) gives the floor any Python gRPC server pays per request on this machine.

The server's cost per request is roughly fixed (gRPC, protobuf, asyncio), so the ratios depend on
how much compute a sentence needs. ``--marian SMALL`` (or BASE) serves a random-weight Marian model
of that size instead (built as in ``engine_throughput.py``, EOS suppressed: every output runs to the
length limit, 52 tokens for the 20-token sources used then):

    python benchmarks/server_load.py --marian SMALL --requests 256

**Serving-layer capacity** (``--capacity``): the serving layer alone (``nmt serve --engine null``) as one
process and split into an engine core and front-ends, beside the ``grpc.aio`` echo floor; see
``server_capacity.py``, which this mode runs:

    python benchmarks/server_load.py --capacity --model-repository models --model demo-transformer
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages

from bench_common import (  # noqa: E402
    batch_totals,
    free_port,
    percentiles,
    process_cpu_seconds,
    sentences,
    start_server,
    tree_cpu_seconds,
)


def serve_echo(port: int) -> None:
    """Serve a ``Translator`` that answers at once: what gRPC alone costs per request."""
    import grpc

    from server.protos import pb2, pb2_grpc

    class EchoTranslator(pb2_grpc.TranslatorServicer):
        async def Translate(self, request, context):  # noqa: N802 - gRPC method name
            response = pb2.TranslateResponse(model=request.model)
            response.translations.add().hypotheses.add(text=request.texts[0],
                                                       subword_tokens=request.texts[0].split())
            return response

    async def serve() -> None:
        server = grpc.aio.server()
        pb2_grpc.add_TranslatorServicer_to_server(EchoTranslator(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_floor(texts: list[str], callers: int) -> dict[str, float]:
    """Requests/s and CPU ms per request of client and server against :func:`serve_echo`'s servicer."""
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port)])
    try:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        asyncio.run(bench_server(f"127.0.0.1:{port}", "", texts[:callers], callers, 1))  # warm up
        client0, server0 = time.process_time(), process_cpu_seconds(process.pid)
        result = asyncio.run(bench_server(f"127.0.0.1:{port}", "", texts, callers, 1))
        client1, server1 = time.process_time(), process_cpu_seconds(process.pid)
    finally:
        process.kill()
        process.wait()
    result["client_cpu_ms"] = (client1 - client0) / len(texts) * 1000
    result["server_cpu_ms"] = (server1 - server0) / len(texts) * 1000
    return result


def placeholder_sentences(vocab: int) -> Callable[[int, int], list[str]]:
    """Texts of 20 placeholder pieces ("t17 t403 ...") for the ``--marian`` models."""
    def make(count: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(f"t{rng.randint(2, vocab - 2)}" for _ in range(20)) for _ in range(count)]

    return make


def marian_repository(args: argparse.Namespace, work: Path) -> Callable[[int, int], list[str]]:
    """``--marian SIZE``: a random-weight Marian model of that size exported in ``--precision`` into
    ``work/models`` (``args.model_repository`` and ``args.model`` now name it); returns what makes its texts."""
    from engine_throughput import SIZES, export_project, marian_model

    export_project(marian_model(args.marian), work, None, args.precision)  # work/models/bench-fp32/1
    args.model_repository, args.model = str(work / "models"), f"bench-{args.precision}"
    return placeholder_sentences(SIZES[args.marian]["vocab"])


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


def paired_single_latency(engine, address: str, model: str, texts: list[str], beam: int) -> tuple[float, float]:
    """Median single-sentence latency (seconds) of the engine and of the server, sentences alternating."""
    import grpc

    from server.protos import pb2, pb2_grpc
    from server.types import DecodingOptions, SentenceRequest

    options = DecodingOptions(beam_size=beam, num_hypotheses=1)
    bare, served = [], []
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.TranslatorStub(channel)
        for text in texts:
            t0 = time.perf_counter()
            engine.translate_batch([SentenceRequest(engine.tokenize(text), options)])
            t1 = time.perf_counter()
            stub.Translate(pb2.TranslateRequest(texts=[text], model=model,
                                                options=pb2.DecodingOptions(beam_size=beam)), timeout=60)
            t2 = time.perf_counter()
            bare.append(t1 - t0)
            served.append(t2 - t1)
    return float(np.median(bare)), float(np.median(served))


def measure_server(process: subprocess.Popen, address: str, metrics: str, model: str, texts: list[str],
                   callers: int, beam: int) -> dict[str, float]:
    """:func:`bench_server` plus CPU per request on both sides and the server's mean batch size."""
    def server_cpu() -> float:  # every process of the server (the supervisor, core and front-ends of --frontends)
        return sum(tree_cpu_seconds(process.pid).values())

    client0, server0, (sent0, batches0) = time.process_time(), server_cpu(), batch_totals(metrics)
    result = asyncio.run(bench_server(address, model, texts, callers, beam))
    client1, server1, (sent1, batches1) = time.process_time(), server_cpu(), batch_totals(metrics)
    result["client_cpu_ms"] = (client1 - client0) / len(texts) * 1000
    result["server_cpu_ms"] = (server1 - server0) / len(texts) * 1000
    result["mean_batch"] = (sent1 - sent0) / max(batches1 - batches0, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--callers", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--requests", type=int,
                        help="sentences per concurrency level (default 1024); --capacity: per configuration and "
                        "round (default 2000)")
    parser.add_argument("--beam-size", "--beam", dest="beam_size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (both sides)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's batching wait")
    parser.add_argument("--ort-spinning", action=argparse.BooleanOptionalAction, default=True,
                        help="ONNX Runtime threads busy-wait within a run (both sides; the server's default)")
    parser.add_argument("--marian", choices=["SMALL", "BASE"],
                        help="serve a random-weight Marian model of this size instead of --model")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                        help="--marian: the precision the model is exported in (fp16 for GPUs)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu",
                        help="where the bare engine and the server run (both sides)")
    parser.add_argument("--capacity", action="store_true",
                        help="serving-layer capacity: --engine null as one process and with --frontends, and the "
                        "grpc.aio echo floor (see above)")
    parser.add_argument("--frontends", nargs="+", type=int,
                        help="--capacity: the --frontends settings to compare (default 0 1 2); else: the server's "
                             "--frontends (one value, default 0)")
    parser.add_argument("--batching", choices=["static", "continuous"], default="static",
                        help="the server's --batching (not --capacity: the null engine batches statically)")
    parser.add_argument("--max-batch-rows", type=int, default=0,
                        help="the server's --max-batch-rows (continuous batching; 0: by device)")
    parser.add_argument("--clients", type=int, default=2, help="--capacity: load-generator processes")
    parser.add_argument("--client-threads", type=int, default=8,
                        help="--capacity: threads (blocking calls, a channel each) per load-generator process")
    parser.add_argument("--rounds", type=int, default=3, help="--capacity: times the configurations alternate")
    parser.add_argument("--emulate-device", nargs=2, type=float, metavar=("STEP_MS", "ENCODER_MS"),
                        help="the server and the bare engine on an emulated device whose decoder step takes at least "
                        "STEP_MS and encoder call at least ENCODER_MS at any row count, as a GPU's "
                        "(emulated_device/; CPU provider)")
    parser.add_argument("--echo-server", type=int, metavar="PORT", help=argparse.SUPPRESS)  # internal
    parser.add_argument("--load-worker", metavar="ADDRESS", help=argparse.SUPPRESS)  # internal
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # internal, --load-worker
    args = parser.parse_args()
    if args.echo_server:
        serve_echo(args.echo_server)
        return
    if args.load_worker or args.capacity:
        from server_capacity import capacity, load_worker

        if args.load_worker:
            load_worker(args.load_worker, args.model, args.requests, args.client_threads, args.seed)
        else:
            capacity(args)
        return
    args.requests = args.requests or 1024
    if args.emulate_device:
        from emulated_device.sitecustomize import activate

        activate(*args.emulate_device)
    with tempfile.TemporaryDirectory() as work:
        run(args, marian_repository(args, Path(work)) if args.marian else sentences)


def run(args: argparse.Namespace, make_texts: Callable[[int, int], list[str]]) -> None:
    """Both benchmarks for every number of callers, then the tables."""
    from server.engine.engine import Engine

    versions = sorted(Path(args.model_repository, args.model).glob("*/manifest.json"))
    if not versions:
        raise SystemExit(f"no {args.model} in {args.model_repository}: run `nmt serve --demo` first")
    if args.frontends and len(args.frontends) > 1:
        raise SystemExit("--frontends takes one value here (several only with --capacity)")
    frontends = args.frontends[0] if args.frontends else 0
    engine = Engine.load(versions[-1].parent, provider=args.provider, intra_op_threads=args.threads,
                         spinning=args.ort_spinning)
    process, address, metrics = start_server(args.model_repository, [
        "--intra-op-threads", str(args.threads), "--max-batch-sentences", "128", "--queue-size", "4096",
        "--max-wait-ms", str(args.max_wait_ms), "--ort-spinning" if args.ort_spinning else "--no-ort-spinning",
        "--frontends", str(frontends), "--batching", args.batching, "--provider", args.provider,
        "--max-batch-rows", str(args.max_batch_rows)])
    rows = []
    try:
        for callers in args.callers:
            texts = make_texts(max(args.requests, callers), callers)
            bench_engine(engine, texts[:callers], callers, args.beam_size)  # warm up
            asyncio.run(bench_server(address, args.model, texts[:callers], callers, args.beam_size))
            bare = bench_engine(engine, texts, callers, args.beam_size)
            served = measure_server(process, address, metrics, args.model, texts, callers, args.beam_size)
            rows.append((callers, bare, served))
            print(f"callers {callers}: engine {bare['sentences_s']:.1f} sent/s, server {served['sentences_s']:.1f} "
                  f"sent/s", flush=True)
        single = paired_single_latency(engine, address, args.model, make_texts(args.requests, 99), args.beam_size)
    finally:
        process.terminate()
        process.wait(timeout=30)

    print()
    print(f"model {args.model}, beam {args.beam_size}, {args.threads} threads, {args.requests} sentences per level, "
          f"server max wait {args.max_wait_ms} ms, ORT spinning {'on' if args.ort_spinning else 'off'}, "
          f"{args.batching} batching, {frontends} front-ends"
          + (f", emulated device: steps >= {args.emulate_device[0]:g} ms, encoder calls >= {args.emulate_device[1]:g} "
             "ms" if args.emulate_device else ""))
    print("| callers | engine sent/s | server sent/s | ratio | server tok/s | engine p50/p95/p99 ms "
          "| server p50/p95/p99 ms | server batch | server CPU ms/req | client CPU ms/req |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for callers, bare, served in rows:
        e, s = percentiles(bare["latencies"]), percentiles(served["latencies"])
        print(f"| {callers} | {bare['sentences_s']:.1f} | {served['sentences_s']:.1f} | "
              f"{served['sentences_s'] / bare['sentences_s']:.2f} | {served['tokens_s']:.0f} | "
              f"{e[0]:.1f} / {e[1]:.1f} / {e[2]:.1f} | {s[0]:.1f} / {s[1]:.1f} / {s[2]:.1f} | "
              f"{served['mean_batch']:.1f} | {served['server_cpu_ms']:.2f} | {served['client_cpu_ms']:.2f} |")
    print("\ngRPC alone (a servicer that answers at once, same load generator):")
    for callers in (1, 128):
        floor = grpc_floor(make_texts(max(args.requests, callers), callers), callers)
        p50 = percentiles(floor["latencies"])[0]
        print(f"  {callers} callers: {floor['sentences_s']:,.0f} requests/s, p50 {p50:.2f} ms, server CPU "
              f"{floor['server_cpu_ms']:.2f} ms/req, client CPU {floor['client_cpu_ms']:.2f} ms/req")
    engine_p50, server_p50 = single[0] * 1000, single[1] * 1000
    print(f"\nsingle sentence, engine and server alternating ({args.requests} sentences): engine p50 "
          f"{engine_p50:.2f} ms, server p50 {server_p50:.2f} ms: {server_p50 / engine_p50:.2f}x")


if __name__ == "__main__":
    main()
