"""Glossary benchmark: what hard terminology constraints cost in speed, and what they do to quality.

    nmt bench glossary --version-dir models/demo-transformer/1
    python benchmarks/glossary.py --version-dir models/demo-bahdanau/1 --sentences 64 --repeats 3

In this process, on the engine (``Engine.search``, static batches of ``--batch`` sentences), with the server's
own glossary matching (:mod:`server.frontend.glossary`) and beam widening:

(0) **the example** of docs/glossaries.md: ``Tuesday, April 25, 2045`` with ``April -> Ostermond``, greedy and
    beam 4: the output and the source pieces the term's pieces attend to most.
(a) **speed**: dates of the full format ("Tuesday, April 25, 2045") with 0, 1, 2 and 3 terms each (the month,
    then the weekday, then the year, each with its reference translation as target), beam 4 (a sentence with
    terms searches ``max(4, 2 x terms + 1)``), against the same sentences without a glossary. Sides alternate
    ``--repeats`` times; the table gives the median sentences/s and the median ratio (target >= 0.6 at 2 terms).
(a2) **where two terms' time goes**: the same dates decoded five ways, each stepping closer to two terms per
    sentence (a wider beam, the attention graph that places the terms, the terms without placement, the terms),
    with the milliseconds spent inside the step graphs' ONNX Runtime runs and outside them (the search's
    selection and books): which part of the cost is the model's work and which the search's.
(b) **quality**: BLEU on the dates test split (beam 4), without a glossary and with one made of the month
    names the references use (English month -> German month, only where the reference has one), and how many
    required terms the outputs hold.
(c) with ``--random-sizes SMALL BASE``: the same speed table on random-weight Transformers of
    ``engine_throughput.py``'s shapes (20 source tokens, 24 output tokens each, EOS never chosen, terms of
    two random pieces placed on random source spans): what the search's own work costs beside a larger model
    step. The dates models' steps are a fraction of a millisecond, so (a) shows the selection at its worst.

The CPU model and instruction set are printed above the tables.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's packages, run as a script

from bench_common import host  # noqa: E402
from runtime_worker import SessionClock  # noqa: E402

from server.alignment import merge_to_words  # noqa: E402
from server.controls import Controls  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.frontend.glossary import Glossary, TermCodec, constrained_beam  # noqa: E402
from server.frontend.translate import source_span  # noqa: E402
from server.types import DecodingOptions, GlossaryEntry, SentenceRequest  # noqa: E402

MONTHS = dict(zip(["January", "February", "March", "April", "May", "June", "July", "August", "September",
                   "October", "November", "December"],
                  ["Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August", "September", "Oktober",
                   "November", "Dezember"], strict=True))
DAYS = dict(zip(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
                ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag", "Samstag", "Sonntag"], strict=True))
BEAM = 4


def requests(engine: Engine, texts: list[str], glossary: Glossary | None, max_beam: int = 8, beam: int = BEAM,
             attention: bool = False) -> list[SentenceRequest]:
    """Each text as the server submits it: with its glossary terms as constraints and the widened beam."""
    options = DecodingOptions(beam_size=beam, max_length=64, return_attention=attention,
                              length_penalty=engine.default_options().length_penalty)  # the model's, as served
    codec = TermCodec(glossary, engine.tokenizer.encode_target, engine.tokenizer.unk_id,
                      max_beam) if glossary else None
    out = []
    for text in texts:
        ids = engine.tokenize(text)
        each = options
        if codec is not None:
            found, constraints = codec.constraints(text, "text")
            if constraints:
                spans = tuple(source_span(engine.tokenize, text, o.start, o.end, 0, len(ids)) for o in found)
                each = replace(options, beam_size=constrained_beam(beam, len(constraints), max_beam),
                               controls=Controls(constraints=constraints, constraint_sources=spans))
        out.append(SentenceRequest(ids, each, text=text))
    return out


def decode(engine: Engine, batch: list[SentenceRequest], size: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(batch), size):
        tokens += [r.hypotheses[0].tokens for r in engine.search(batch[i:i + size])]
    return time.perf_counter() - start, tokens


def full_dates(count: int) -> list[tuple[str, str, str, str]]:
    """(text, month, weekday, year) of ``count`` dates in the full format."""
    rng = random.Random(5)
    out = []
    for _ in range(count):
        day, month = rng.choice(list(DAYS)), rng.choice(list(MONTHS))
        year = str(rng.randint(1900, 2099))
        out.append((f"{day}, {month} {rng.randint(1, 28)}, {year}", month, day, year))
    return out


def demo_sentence(engine: Engine) -> None:
    """The documentation's example: ``Tuesday, April 25, 2045`` with ``April -> Ostermond``, greedy and beam 4,
    and the source word the server's word alignment puts against the term (:func:`server.alignment.merge_to_words`)."""
    text, glossary = "Tuesday, April 25, 2045", Glossary([GlossaryEntry("April", "Ostermond")])
    source_pieces = engine.tokenizer.pieces(engine.tokenize(text))
    print(f"(0) the example: {text!r} with April -> Ostermond")
    print("| beam asked | output | score | aligned to Ostermond |")
    print("|---|---|---|---|")
    for beam in (1, BEAM):
        [result] = engine.search(requests(engine, [text], glossary, beam=beam, attention=True))
        best = result.hypotheses[0]
        output = engine.tokenizer.decode(best.tokens[:-1])
        attention = merge_to_words(best.attention, source_pieces, engine.tokenizer.pieces(best.tokens[:-1]),
                                   text.split(), output.split())
        aligned = [attention.source_words[a.source_index] for a in attention.alignments
                   if attention.target_words[a.target_index] == "Ostermond"]
        print(f"| {beam} | {output} | {best.score:.3f} | {', '.join(aligned) or '-'} |")
    print()


def speed(engine: Engine, count: int, repeats: int, batch: int) -> None:
    dates = full_dates(count)
    texts = [d[0] for d in dates]
    print(f"(a) speed: {count} full-format dates, beam {BEAM}, batches of {batch}, {repeats} alternating repeats")
    print("| terms per sentence | beam searched | sentences/s without | with | ratio | terms held |")
    print("|---|---|---|---|---|---|")
    plain = requests(engine, texts, None)
    for terms in range(4):
        entries = []
        for _, month, day, year in dates:
            chosen = [(month, MONTHS[month]), (day, DAYS[day]), (year, year)][:terms]
            entries += [GlossaryEntry(s, t) for s, t in chosen]
        glossary = Glossary(list({e.source: e for e in entries}.values())) if entries else None
        constrained = requests(engine, texts, glossary)
        cells, outputs = alternate(engine, plain, constrained, repeats, batch)
        held = sum(all(t in engine.tokenizer.decode(o[:-1]) for t in [MONTHS[m], DAYS[d], y][:terms])
                   for o, (_, m, d, y) in zip(outputs, dates, strict=True))
        print(f"| {terms} | {constrained[0].options.beam_size} | {cells} | {held}/{count} |")


def alternate(engine: Engine, plain: list[SentenceRequest], constrained: list[SentenceRequest], repeats: int,
              batch: int) -> tuple[str, list[list[int]]]:
    """Both sides decoded ``repeats`` times in turn: the table's cells (median sentences/s without, with, and
    the median ratio) and the constrained side's last outputs."""
    without, with_terms, ratios = [], [], []
    for _ in range(repeats):
        a, _ = decode(engine, plain, batch)
        b, outputs = decode(engine, constrained, batch)
        without.append(len(plain) / a)
        with_terms.append(len(plain) / b)
        ratios.append(a / b)
    return (f"{statistics.median(without):.1f} | {statistics.median(with_terms):.1f} | "
            f"{statistics.median(ratios):.2f}"), outputs


def anatomy(engine: Engine, count: int, repeats: int, batch: int) -> None:
    """Table (a2): the decode of ``count`` dates with two terms each, and of the same dates without terms but one
    more of the terms' settings at a time, split into the time inside the step graphs and the rest."""
    dates = full_dates(count)
    texts = [d[0] for d in dates]
    entries = {GlossaryEntry(month, MONTHS[month]) for _, month, _, _ in dates}
    entries |= {GlossaryEntry(day, DAYS[day]) for _, _, day, _ in dates}
    constrained = requests(engine, texts, Glossary(sorted(entries, key=lambda e: e.source)))
    beam = constrained[0].options.beam_size
    unplaced = [replace(r, options=replace(r.options, controls=replace(r.options.controls, constraint_sources=())))
                for r in constrained]
    cases = [(f"no terms, beam {BEAM}", requests(engine, texts, None)),
             (f"no terms, beam {beam}", requests(engine, texts, None, beam=beam)),
             (f"no terms, beam {beam}, the attention graph", requests(engine, texts, None, beam=beam, attention=True)),
             ("two terms without placement (no attention; the whole distribution each step)", unplaced),
             ("two terms", constrained)]
    clock = SessionClock(engine.model.sessions)
    cells: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in cases}
    for _ in range(repeats):
        for name, batch_requests in cases:
            clock.reset()
            seconds, _ = decode(engine, batch_requests, batch)
            cells[name].append((seconds, clock.seconds["encoder"], clock.seconds["decoder"]))
    print(f"\n(a2) where two terms' time goes: {count} dates, batches of {batch}, medians of {repeats} "
          "alternating runs (ms)")
    print("| decode | in all | the encoder | the step graphs | the rest: search, books, tokens |")
    print("|---|---|---|---|---|")
    for name, runs in cells.items():
        total, encoder, steps = (statistics.median(run[i] for run in runs) * 1000 for i in range(3))
        print(f"| {name} | {total:.1f} | {encoder:.1f} | {steps:.1f} | {total - encoder - steps:.1f} |")


def quality(engine: Engine, limit: int, batch: int) -> None:
    import sacrebleu

    from training.data import generate_dates_corpus, split

    test = split(generate_dates_corpus()).test[:limit]

    def months_of(pair) -> list[tuple[str, str]]:  # the month names both sides spell out
        words = pair.source.replace(",", " ").split()
        return [(s, t) for s, t in MONTHS.items() if s in words and t in pair.target.split()]

    entries = {GlossaryEntry(s, t) for pair in test for s, t in months_of(pair)}
    glossary = Glossary(sorted(entries, key=lambda e: e.source))
    references = [p.target for p in test]
    texts = [p.source for p in test]
    rows = []
    for name, g in (("without", None), ("month-name glossary", glossary)):
        seconds, outputs = decode(engine, requests(engine, texts, g), batch)
        hypotheses = [engine.tokenizer.decode(o[:-1]) for o in outputs]
        bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
        needed = [(h, t) for h, p in zip(hypotheses, test, strict=True) for _, t in months_of(p)] if g else []
        rows.append((name, bleu, len(texts) / seconds, sum(t in h for h, t in needed), len(needed)))
    print(f"\n(b) quality: the dates test split ({len(test)} pairs), beam {BEAM}; the glossary has "
          f"{len(glossary.entries)} month names")
    print("| glossary | BLEU | sentences/s | terms held |")
    print("|---|---|---|---|")
    for name, bleu, rate, held, needed in rows:
        print(f"| {name} | {bleu:.1f} | {rate:.1f} | {f'{held}/{needed}' if needed else '-'} |")


def random_speed(size: str, count: int, repeats: int, batch: int, threads: int) -> None:
    """(c): ``size``'s random-weight Transformer, token-id terms (see the module docstring)."""
    import tempfile

    import engine_throughput as bench
    import numpy as np

    with tempfile.TemporaryDirectory() as work:
        version, _ = bench.export_project(bench.marian_model(size), Path(work), None)
        engine = Engine.load(version, provider="cpu", intra_op_threads=threads)
        vocabulary = bench.SIZES[size]["vocab"]
        rng = np.random.default_rng(3)
        sources = bench.sources(count, vocabulary)
        options = DecodingOptions(beam_size=BEAM, max_length=bench.OUTPUT_TOKENS)
        plain = [SentenceRequest(ids, options) for ids in sources]
        print(f"\n(c) {size} random weights: {count} sentences of {bench.SOURCE_TOKENS} tokens, "
              f"{bench.OUTPUT_TOKENS} output tokens, beam {BEAM}, batches of {batch}, {repeats} alternating repeats")
        print("| terms per sentence | beam searched | sentences/s without | with | ratio |")
        print("|---|---|---|---|---|")
        for terms in range(4):
            constrained = []
            for ids in sources:
                runs = tuple(tuple(int(t) for t in rng.integers(2, vocabulary - 1, 2)) for _ in range(terms))
                starts = rng.integers(0, len(ids) - 2, terms)
                spans = tuple((int(a), int(a) + 2) for a in starts)
                constrained.append(SentenceRequest(ids, replace(
                    options, beam_size=constrained_beam(BEAM, terms, 8) if terms else BEAM,
                    controls=Controls(constraints=runs, constraint_sources=spans))))
            cells, _ = alternate(engine, plain, constrained, repeats, batch)
            print(f"| {terms} | {constrained[0].options.beam_size} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version-dir", required=True,
                        help="a model version directory (e.g. models/demo-transformer/1)")
    parser.add_argument("--sentences", type=int, default=64, help="sentences of the speed table")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="sentences per engine batch")
    parser.add_argument("--test-limit", type=int, default=1000, help="test pairs of the quality table")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    parser.add_argument("--random-sizes", nargs="*", default=[], choices=["SMALL", "BASE"],
                        help="also the speed table on random-weight Transformers of these shapes (needs torch)")
    args = parser.parse_args()
    print(f"host: {host()}")
    engine = Engine.load(args.version_dir, provider="cpu", intra_op_threads=args.threads)
    print(f"model: {args.version_dir}\n")
    demo_sentence(engine)
    speed(engine, args.sentences, args.repeats, args.batch)
    quality(engine, args.test_limit, args.batch)
    anatomy(engine, args.sentences, args.repeats, args.batch)  # last: its clock stays on the sessions
    for size in args.random_sizes:
        random_speed(size, args.sentences, args.repeats, args.batch, args.threads)


if __name__ == "__main__":
    main()
