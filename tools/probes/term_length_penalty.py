"""A model's length penalty against a glossary term it has never seen: BLEU, and where the term lands.

    python tools/probes/term_length_penalty.py models/demo-bahdanau/1
    python tools/probes/term_length_penalty.py models/demo-transformer/1 --penalties 1 0.6

For each length penalty, greedy and beam 4: BLEU on the dates test split (no glossary), and the outputs of three
dates with ``April -> Ostermond``. A term the model has never seen costs about the same wherever it stands, and
a score divided by ``length ** penalty`` lets longer hypotheses spread that cost; this shows at which penalties a
model keeps the term where the source word is, and what the penalty does to its ordinary translations.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import glossary as bench  # noqa: E402
import sacrebleu  # noqa: E402

from server.engine.engine import Engine  # noqa: E402
from server.frontend.glossary import Glossary  # noqa: E402
from server.types import GlossaryEntry, SentenceRequest  # noqa: E402
from training.data import generate_dates_corpus, split  # noqa: E402

EXAMPLES = ["Tuesday, April 25, 2045", "Monday, April 3, 1995", "April 7, 2001"]


def with_penalty(requests: list[SentenceRequest], penalty: float) -> list[SentenceRequest]:
    return [replace(r, options=replace(r.options, length_penalty=penalty)) for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version_dir", help="a dates model version directory")
    parser.add_argument("--penalties", type=float, nargs="+", default=[1.0, 0.6, 0.2, 0.0])
    args = parser.parse_args()
    engine = Engine.load(args.version_dir, provider="cpu")
    test = split(generate_dates_corpus()).test
    texts, references = [p.source for p in test], [p.target for p in test]
    glossary = Glossary([GlossaryEntry("April", "Ostermond")])
    print("| length penalty | beam | BLEU | " + " | ".join(EXAMPLES) + " |")
    print("|---|---|---|" + "---|" * len(EXAMPLES))
    for penalty in args.penalties:
        for beam in (1, bench.BEAM):
            _, outputs = bench.decode(engine, with_penalty(bench.requests(engine, texts, None, beam=beam), penalty), 32)
            bleu = sacrebleu.corpus_bleu([engine.tokenizer.decode(o[:-1]) for o in outputs], [references]).score
            _, examples = bench.decode(
                engine, with_penalty(bench.requests(engine, EXAMPLES, glossary, beam=beam), penalty), 8)
            cells = " | ".join(engine.tokenizer.decode(o[:-1]) for o in examples)
            print(f"| {penalty:g} | {beam} | {bleu:.2f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
