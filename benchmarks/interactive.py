"""Interactive-decoding benchmark: completing a sentence from a target prefix, and Score vs Translate.

    python benchmarks/interactive.py --model-repository models --pairs runs/demo-transformer/test.tsv
    nmt bench interactive --model-repository /work/main/models --pairs /work/main/runs/demo-transformer/test.tsv

On each model (default: demo-transformer and demo-bahdanau) and held-out pairs of its corpus, through the
serving engine (no server), one ONNX Runtime session per graph with ``--threads`` threads:

(a) **prefix**: each sentence decoded alone (batch 1, as an editor asks), once from scratch and once given
    the first half of its reference translation's pieces as a target prefix (the prefix runs as one forced
    pass, then the search continues); greedy and beam 4. The figure is the wall time of all sentences;
    the ratio is prefix / scratch (target <= 0.6).
(b) **score**: the reference translations scored (Score: one forced pass per batch, no search) vs the
    sources translated greedily, batch 1 and 32; sentences/s and the ratio Score / Translate (target >= 3).

For a Transformer the rows also give the engine without its ``decoder_forced.onnx`` (the step-wise forcing
of versions exported before it) as ``step-wise``. The sides of each row alternate, ``--repeats`` times;
the table gives medians, and the ratios are the median (min-max) of each repeat's back-to-back ratio. The
CPU model and instruction set, and the batch-1 cost of each model call, are printed above it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's packages, run as a script

from bench_common import host  # noqa: E402

from common.model_format.layout import FORCED_GRAPH  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.types import DecodingOptions, SentenceRequest, TargetPrefix  # noqa: E402


def load_pairs(path: Path, count: int, engine: Engine, min_pieces: int) -> list[tuple[str, str]]:
    """The first ``count`` (source, target) lines of a held-out TSV whose target has at least ``min_pieces``
    pieces (a sentence worth completing: the dates corpus also holds one-word numbers)."""
    pairs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        source, _, target = line.partition("\t")
        if source and target and len(engine.tokenizer.encode_target(target)) >= min_pieces:
            pairs.append((source, target))
    return pairs[:count]


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def alternate(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each side per repeat, the sides run in turn (order rotating) ``repeats`` times after a warm-up."""
    names = list(sides)
    for name in names:
        sides[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            times[name].append(timed(sides[name]))
    return times


def ratio(over: list[float], under: list[float]) -> str:
    """Median (min-max) of the per-repeat ratios ``over / under`` (back-to-back runs: steadier on a busy host)."""
    ratios = [a / b for a, b in zip(over, under, strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def stepwise(engine: Engine) -> Engine:
    """The engine as it runs a version without ``decoder_forced.onnx`` (the same sessions otherwise)."""
    clone = copy.copy(engine)
    clone.model = copy.copy(engine.model)
    clone.model.sessions = {role: s for role, s in engine.model.sessions.items() if role != FORCED_GRAPH}
    return clone


def call_costs(engine: Engine, pairs: list[tuple[str, str]], repeats: int) -> str:
    """Median ms of the calls one batch-1 sentence is made of: the encoder, a greedy decoder step and the
    forced pass over half its reference (what the prefix ratio is built from)."""
    import numpy as np

    model = engine.model
    source, target = pairs[0]
    src = np.array([[*engine.tokenize(source), engine.eos_id]], dtype=np.int64)
    encoded = model.encode(src)
    static = {name: encoded[name] for name in model.static_names}
    state = {name: encoded[name] for name in model.state_names}
    half = engine.tokenizer.encode_target(target)
    half = np.array([[engine.start_id, *half[: len(half) // 2]]], dtype=np.int64)
    calls = {"encoder": lambda: model.encode(src),
             "decoder step": lambda: model.step(np.array([engine.start_id]), static, state, False, 1),
             f"forced pass over {half.shape[1]} positions": lambda: model.force(half, half, static, state, False)}
    times = {name: statistics.median(timed(call) for _ in range(20 * repeats)) for name, call in calls.items()}
    return "; ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in times.items())


def paths(engine: Engine) -> dict[str, Engine]:
    """The engine, and for a version with ``decoder_forced.onnx`` the engine without it, by label."""
    return {"forced pass": engine} | ({"step-wise": stepwise(engine)} if FORCED_GRAPH in engine.model.sessions else {})


def targets(pairs: list[tuple[str, str]]) -> list[str]:
    return [target for _, target in pairs]


def prefix_rows(name: str, engine: Engine, pairs: list[tuple[str, str]], repeats: int) -> list[str]:
    """(a): batch 1, from scratch vs half the reference as prefix; greedy and beam 4."""
    rows = []
    sources = [engine.tokenize(source) for source, _ in pairs]
    halves = [TargetPrefix(tuple(ids[: len(ids) // 2])) for ids in map(engine.tokenizer.encode_target, targets(pairs))]
    engines = paths(engine)
    for beam in (1, 4):
        options = DecodingOptions(beam_size=beam)

        def scratch(e: Engine = engine, options: DecodingOptions = options) -> None:
            for ids in sources:
                e.translate_batch([SentenceRequest(ids, options)])

        sides: dict[str, Callable[[], object]] = {"scratch": scratch}
        for label, e in engines.items():
            def given(e: Engine = e, options: DecodingOptions = options) -> None:
                for ids, half in zip(sources, halves, strict=True):
                    e.translate_batch([SentenceRequest(ids, options, target_prefix=half)])
            sides[label] = given
        times = alternate(sides, repeats)
        scratch_ms = statistics.median(times["scratch"]) * 1e3 / len(pairs)
        for label in engines:
            rows.append(f"| {name} | {beam} | {label} | {scratch_ms:.2f} | "
                        f"{statistics.median(times[label]) * 1e3 / len(pairs):.2f} | "
                        f"{ratio(times[label], times['scratch'])} |")
    return rows


def score_rows(name: str, engine: Engine, pairs: list[tuple[str, str]], repeats: int) -> list[str]:
    """(b): Score of the references vs greedy Translate of the sources, batch 1 and 32, sentences/s."""
    rows = []
    greedy = DecodingOptions(beam_size=1)
    sources = [engine.tokenize(source) for source, _ in pairs]
    given = [TargetPrefix((*engine.target_prefix(t, whole=True).ids, engine.eos_id)) for t in targets(pairs)]
    engines = paths(engine)
    for batch in (1, 32):
        chunks = [range(i, min(i + batch, len(pairs))) for i in range(0, len(pairs), batch)]

        def translate(chunks: list[range] = chunks) -> None:
            for chunk in chunks:
                engine.translate_batch([SentenceRequest(sources[i], greedy) for i in chunk])

        sides: dict[str, Callable[[], object]] = {"translate": translate}
        for label, e in engines.items():
            def score(e: Engine = e, chunks: list[range] = chunks) -> None:
                for chunk in chunks:
                    e.translate_batch([SentenceRequest(sources[i], greedy, target_prefix=given[i]) for i in chunk])
            sides[label] = score
        times = alternate(sides, repeats)
        for label in engines:
            rows.append(f"| {name} | {batch} | {label} | {len(pairs) / statistics.median(times['translate']):.0f} | "
                        f"{len(pairs) / statistics.median(times[label]):.0f} | "
                        f"{ratio(times['translate'], times[label])} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models", help="where the models are (default: models)")
    parser.add_argument("--models", nargs="+", default=["demo-transformer", "demo-bahdanau"])
    parser.add_argument("--version", default="1", help="the version of each model (default: 1)")
    parser.add_argument("--pairs", type=Path, default=Path("runs/demo-transformer/test.tsv"),
                        help="held-out source<TAB>target lines of the models' corpus")
    parser.add_argument("--sentences", type=int, default=64, help="pairs used (default: 64)")
    parser.add_argument("--min-pieces", type=int, default=8,
                        help="only pairs whose reference has at least this many pieces (default: 8)")
    parser.add_argument("--repeats", type=int, default=5, help="alternations of the sides (default: 5)")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (default: 1)")
    args = parser.parse_args(argv)

    print(f"CPU: {host()}; {args.threads} intra-op thread(s); up to {args.sentences} held-out pairs of "
          f"{args.pairs} with references of >= {args.min_pieces} pieces; medians of {args.repeats} alternations")
    prefix, score = [], []
    for name in args.models:
        engine = Engine.load(Path(args.model_repository) / name / args.version, provider="cpu",
                             intra_op_threads=args.threads)
        pairs = load_pairs(args.pairs, args.sentences, engine, args.min_pieces)
        pieces = sum(len(engine.tokenizer.encode_target(t)) for t in targets(pairs)) / len(pairs)
        print(f"{name}: {len(pairs)} pairs, {pieces:.1f} reference pieces on average; batch-1 calls: "
              f"{call_costs(engine, pairs, args.repeats)}")
        prefix += prefix_rows(name, engine, pairs, args.repeats)
        score += score_rows(name, engine, pairs, args.repeats)
    print("\n(a) completing a sentence given half its reference as prefix, batch 1 (ms per sentence)\n")
    print("| model | beam | prefix path | from scratch | with prefix | prefix / scratch, median (range) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(prefix))
    print("\n(b) Score of the reference vs greedy Translate of the source (sentences/s)\n")
    print("| model | batch | Score path | Translate greedy | Score | Score / Translate, median (range) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(score))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
