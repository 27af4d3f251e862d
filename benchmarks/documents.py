"""Documents benchmark: a text of many sentences in one request against the same sentences as texts of their own,
and what reading, segmenting and putting a document back together cost per sentence.

    nmt bench documents --model-repository models
    python benchmarks/documents.py --model-repository models --sentences 50 --repeats 5

(a) **throughput**, through ``nmt serve`` on free loopback ports (default batching for the host): one request
    holding one text of ``--sentences`` demo-like dates separated by ". " against one request of the same
    sentences as that many texts; plain text and the same sentences as HTML paragraphs with an inline element
    in each; greedy and beam 4. The sides alternate ``--repeats`` times; the table gives the median sentences/s
    of each and the median (min-max) of the per-repeat ratio document / texts (target >= 0.9).
(b) **cost per sentence**, in this process without a model (the stand-in translation copies each sentence's
    words in reverse order, so every element moves): reading (parsing and sentence segmentation) and putting
    the document back (tag transfer and assembly), in microseconds per sentence, for plain text and HTML.

The CPU model and instruction set are printed above the tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's packages, run as a script

from bench_common import host, sentences, start_server  # noqa: E402

from clients.client import TranslatorClient  # noqa: E402
from server.frontend.documents.model import TextFormat  # noqa: E402
from server.frontend.documents.segmenter import Splitting  # noqa: E402
from server.frontend.documents.translate import Reading, assemble, plan_text  # noqa: E402
from server.types import Attention, Hypothesis, Translation, WordAlignment  # noqa: E402


def html_paragraphs(texts: list[str]) -> str:
    """Each sentence a paragraph whose first word is bold."""
    return "\n".join(f"<p><b>{t.split(' ', 1)[0]}</b> {t.split(' ', 1)[1]}.</p>" for t in texts)


def throughput(client: TranslatorClient, model: str, texts: list[str], beam: int, repeats: int,
               markup: bool) -> tuple[float, float, list[float]]:
    """Median sentences/s of the document and of the separate texts, and each repeat's ratio."""
    document = html_paragraphs(texts) if markup else ". ".join(texts) + "."
    alone = [f"<p><b>{t.split(' ', 1)[0]}</b> {t.split(' ', 1)[1]}.</p>" for t in texts] if markup else [
        f"{t}." for t in texts]
    text_format = "html" if markup else "text"

    def as_document() -> float:
        start = time.perf_counter()
        [result] = client.translate([document], model=model, beam_size=beam, text_format=text_format)
        assert len(result.segments) == len(texts), len(result.segments)
        return time.perf_counter() - start

    def as_texts() -> float:
        start = time.perf_counter()
        results = client.translate(alone, model=model, beam_size=beam, text_format=text_format)
        assert len(results) == len(texts)
        return time.perf_counter() - start

    as_document(), as_texts()  # warm-up
    documents, separate = [], []
    for repeat in range(repeats):
        order = (as_document, as_texts) if repeat % 2 == 0 else (as_texts, as_document)
        seconds = {side: side() for side in order}
        documents.append(seconds[as_document])
        separate.append(seconds[as_texts])
    rate = len(texts) / statistics.median(documents), len(texts) / statistics.median(separate)
    return rate[0], rate[1], [s / d for d, s in zip(documents, separate, strict=True)]


def reversed_words(source: str) -> Translation:
    words = source.split()
    target = [w.upper() for w in reversed(words)]
    aligned = list(range(len(words)))[::-1]
    attention = Attention(words, target, np.zeros((len(target), len(words))),
                          [WordAlignment(j, i) for i, j in enumerate(aligned)], np.zeros((1, 1)))
    return Translation(words, words, [Hypothesis(" ".join(target), [], target, [], -0.5, [], attention)])


def costs(texts: list[str], rounds: int) -> dict[str, tuple[float, float]]:
    """Per format: (reading, putting back) in microseconds per sentence, the medians of ``rounds``."""
    result = {}
    for name, text, text_format in (("plain text", ". ".join(texts) + ".", TextFormat.PLAIN),
                                    ("HTML", html_paragraphs(texts), TextFormat.HTML)):
        reading = Reading(text_format, Splitting.SENTENCES, "en")
        read, back = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            plan = plan_text(text, reading, lambda sentence: True)
            middle = time.perf_counter()
            translations = [reversed_words(s.text) for s in plan.flat]
            before = time.perf_counter()
            assemble(plan, translations, words=False)
            end = time.perf_counter()
            assert len(plan.flat) == len(texts)
            read.append(middle - start)
            back.append(end - before)
        result[name] = (statistics.median(read) / len(texts) * 1e6, statistics.median(back) / len(texts) * 1e6)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default="models")
    parser.add_argument("--model", default="demo-transformer")
    parser.add_argument("--sentences", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=50, help="rounds of the in-process cost measurement")
    parser.add_argument("--serve-flags", default="", help="extra nmt serve flags, space-separated")
    args = parser.parse_args()

    texts = sentences(args.sentences, seed=7)
    print(f"host: {host()}")
    print(f"\n(b) cost per sentence, {args.sentences} sentences, medians of {args.rounds} rounds, no model")
    print("| format | reading (parse + segment), µs/sentence | putting back (tag transfer + assembly), µs/sentence |")
    print("|---|---:|---:|")
    for name, (read, back) in costs(texts, args.rounds).items():
        print(f"| {name} | {read:.0f} | {back:.0f} |")

    process, address, _ = start_server(args.model_repository, args.serve_flags.split())
    try:
        with TranslatorClient(address, timeout=300) as client:
            print(f"\n(a) {args.sentences} sentences as one text vs as {args.sentences} texts, one request each, "
                  f"{args.model}, medians of {args.repeats} alternating repeats")
            print("| input | beam | one text, sentences/s | separate texts, sentences/s | ratio median (min-max) |")
            print("|---|---:|---:|---:|---|")
            for markup in (False, True):
                for beam in (1, 4):
                    document, separate, ratios = throughput(client, args.model, texts, beam, args.repeats, markup)
                    print(f"| {'HTML' if markup else 'plain text'} | {beam} | {document:.1f} | {separate:.1f} | "
                          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
