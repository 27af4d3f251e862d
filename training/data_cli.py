"""``nmt data``: build or inspect a corpus (load, clean, split, show samples, write TSV splits).

Only the standard library and :mod:`training.data` (which imports Babel and num2words only when it
generates) are imported at module level, so ``nmt --help`` stays fast.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from common.model_format.layout import TEST_SPLIT_FILE
from training.data import DATES_SIZE, MAX_WORDS, CorpusError, clean, load_corpus, split, write_tsv

DESCRIPTION = """\
Load a corpus, clean it (whitespace, length and ratio filters, exact duplicates), split it into
train/valid/test by a stable hash of the source sentence, and print statistics and sample pairs.
With --out, write train.tsv, valid.tsv and test.tsv (source<TAB>target, UTF-8).

CORPUS is one of:
  dates               generated English->German dates and number words (Babel/CLDR, num2words);
                      --size and --seed apply
  ding                example sentences of the Ding dictionary, /usr/share/trans/de-en
                      (install with: apt-get install trans-de-en)
  PATH.tsv            a file with one 'source<TAB>target' pair per line (English<TAB>German)
  SRC_PATH,TGT_PATH   two line-aligned text files, English and German
"""

SPLIT_FILES = ("train.tsv", "valid.tsv", TEST_SPLIT_FILE)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``data`` subcommand."""
    parser = subparsers.add_parser(
        "data",
        help="build or inspect a corpus",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "corpus", metavar="CORPUS", help="dates, ding, PATH.tsv or SRC_PATH,TGT_PATH (see above)"
    )
    parser.add_argument(
        "--size", type=int, default=DATES_SIZE, help=f"pairs to generate for 'dates' (default: {DATES_SIZE})"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for 'dates' and for the samples (default: 0)"
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="write train.tsv, valid.tsv and test.tsv here"
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing split files in --out")
    parser.add_argument(
        "--samples", type=int, default=5, metavar="K", help="random pairs to print (default: 5)"
    )
    parser.add_argument("--max-words", type=int, default=MAX_WORDS,
                        help=f"drop pairs longer than this (default: {MAX_WORDS})")
    parser.set_defaults(func=run)
    return parser


def _average_words(texts: list[str]) -> float:
    return sum(len(text.split()) for text in texts) / len(texts) if texts else 0.0


def run(args: argparse.Namespace) -> int:
    """Load, clean and split the corpus; print statistics and samples; optionally write the splits."""
    if args.size <= 0:
        raise CorpusError(f"--size must be positive, got {args.size}")
    if args.samples < 0:
        raise CorpusError(f"--samples must be >= 0, got {args.samples}")
    if args.out is not None and not args.force:
        existing = [str(args.out / name) for name in SPLIT_FILES if (args.out / name).exists()]
        if existing:
            raise CorpusError(f"refusing to overwrite {', '.join(existing)} (use --force)")

    raw = load_corpus(args.corpus, size=args.size, seed=args.seed)
    pairs = clean(raw, max_words=args.max_words)
    if not pairs:
        raise CorpusError(f"corpus {args.corpus!r} has no pairs left after cleaning")
    splits = split(pairs)
    held_out = len(splits.train) + len(splits.valid) + len(splits.test)

    out = sys.stdout
    print(f"corpus {args.corpus}: {len(raw)} pairs loaded, {len(pairs)} after cleaning", file=out)
    if held_out < len(pairs):
        print(f"  {len(pairs) - held_out} held-out pairs beyond the valid/test caps are unused", file=out)
    print(f"  {'split':<6} {'pairs':>7} {'avg src words':>14} {'avg tgt words':>14}", file=out)
    for name, subset in (("train", splits.train), ("valid", splits.valid), ("test", splits.test)):
        source_avg = _average_words([pair.source for pair in subset])
        target_avg = _average_words([pair.target for pair in subset])
        print(f"  {name:<6} {len(subset):>7} {source_avg:>14.2f} {target_avg:>14.2f}", file=out)

    if args.samples:
        rng = random.Random(args.seed)
        print(f"samples ({min(args.samples, len(pairs))}):", file=out)
        for pair in rng.sample(pairs, min(args.samples, len(pairs))):
            print(f"  en: {pair.source}\n  de: {pair.target}", file=out)

    if args.out is not None:
        for name, subset in zip(SPLIT_FILES, (splits.train, splits.valid, splits.test), strict=True):
            write_tsv(subset, args.out / name)
        print(f"wrote {', '.join(str(args.out / name) for name in SPLIT_FILES)}", file=out)
    return 0
