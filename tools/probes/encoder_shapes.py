"""Encoder calls at shapes ONNX Runtime has not run before, against shapes it has, and against buckets.

    python benchmarks/encoder_shapes.py --size SMALL
    python benchmarks/encoder_shapes.py --size SMALL --precision fp16 --provider cuda   # on a GPU

A continuous decode encodes each admission's sentences in one call, and the call's shape [sentences, longest
source] is seldom one the encoder has run before. On the H200 (eighteenth session, issue 31) the server's
admissions of ~8 sentences took ~2.6 ms in ONNX Runtime, where the bare engine's calls of ~35 took 1.4 ms; that
was left unexplained. This times the encoder's call as an admission makes it (the version's ``encode``: on CUDA
the state stays on the device) over ``--shapes`` random shapes (1-16 sentences of 6-60 tokens), three calls per
shape, one after the other:

* ``new``: the shape's first call;
* ``again``: the same sentences at once after;
* ``bucket``: the same sentences padded to a bucket (rows to the next power of two, tokens to the next multiple
  of 16), every bucket run before: what rounding shapes up would cost instead.

One random-weight Marian model of ``--size`` (``engine_throughput.py``'s) exported in ``--precision``. Prints
each way's median microseconds a call and per real source token, and the ratios new/again and bucket/again.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' shared modules
from bench_common import host  # noqa: E402
from engine_throughput import SIZES, export_project, marian_model  # noqa: E402

ROW_BUCKETS = (1, 2, 4, 8, 16)
TOKEN_BUCKET = 16


def bucket(rows: int, tokens: int) -> tuple[int, int]:
    """The bucket of a call of ``rows`` sentences of at most ``tokens`` tokens."""
    return next(r for r in ROW_BUCKETS if r >= rows), -(-tokens // TOKEN_BUCKET) * TOKEN_BUCKET


def padded(src: np.ndarray, shape: tuple[int, int], pad_id: int, eos_id: int) -> np.ndarray:
    """``src`` in a [rows, tokens] array of ``shape``: its rows, then rows holding only EOS, padded."""
    out = np.full(shape, pad_id, dtype=np.int64)
    out[: src.shape[0], : src.shape[1]] = src
    out[src.shape[0]:, 0] = eos_id
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="SMALL")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shapes", type=int, default=120, help="random shapes, each called three ways")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from server.engine.engine import Engine

    rng = np.random.default_rng(args.seed)
    pairs = sorted({(int(r), int(t)) for r in range(1, 17) for t in range(6, 61)}, key=lambda _: rng.random())
    if args.shapes > len(pairs):
        parser.error(f"--shapes: at most {len(pairs)}")
    with tempfile.TemporaryDirectory() as tmp:
        version, _ = export_project(marian_model(args.size), Path(tmp), None, args.precision)
        engine = Engine.load(version, provider=args.provider, intra_op_threads=args.threads)
        model, pad_id, eos_id = engine.model, engine.pad_id, engine.eos_id
        vocab = int(engine.manifest.dimensions["vocab_size"])

        def call(src: np.ndarray) -> float:
            start = time.perf_counter()
            model.encode(src)
            return (time.perf_counter() - start) * 1e6

        def sentences(rows: int, tokens: int) -> np.ndarray:
            src = rng.integers(2, vocab - 1, (rows, tokens)).astype(np.int64)  # Marian's layout: pad last
            src[:, -1] = eos_id
            return src

        used = set()
        for rows in ROW_BUCKETS:  # every bucket run before it is timed (twice: the first may allocate)
            for tokens in range(TOKEN_BUCKET, 61 + TOKEN_BUCKET, TOKEN_BUCKET):
                for _ in range(2):
                    call(sentences(rows, tokens))
                used.add((rows, tokens))
        shapes = [pair for pair in pairs if pair not in used][: args.shapes]
        times: dict[str, list[float]] = {"new": [], "again": [], "bucket": []}
        tokens_called = []
        for rows, tokens in shapes:
            src = sentences(rows, tokens)
            times["new"].append(call(src))
            times["again"].append(call(src))
            times["bucket"].append(call(padded(src, bucket(rows, tokens), pad_id, eos_id)))
            tokens_called.append(rows * tokens)
        print(f"# {host()}; {args.size} {args.precision} encoder on {engine.provider}, {len(shapes)} shapes "
              f"(1-16 sentences of 6-60 tokens), three calls each (medians)")
        print("| way | us a call | us per source token | against again |")
        print("|---|---|---|---|")
        again = times["again"]
        for way, values in times.items():
            per_token = statistics.median(v / n for v, n in zip(values, tokens_called, strict=True))
            ratio = statistics.median(v / a for v, a in zip(values, again, strict=True))
            print(f"| {way} | {statistics.median(values):,.0f} | {per_token:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
