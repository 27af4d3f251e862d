"""Parallel corpora for English -> German translation: load, generate, clean and split.

Corpora:

* ``dates``: a deterministic generated corpus of English dates and number words with their German
  renderings (Babel/CLDR and num2words). Day/month order swaps and German units-before-tens make its
  alignments interesting, and a small model learns it to near-perfect quality in minutes on a CPU.
* ``ding``: the English-German example sentences of the Ding dictionary (Debian ``trans-de-en``).
* any TSV file (``source<TAB>target`` per line) or a pair of aligned text files.

Everything here is plain text in and out: no pickles. Babel and num2words are imported only when the
dates corpus is generated, so importing this module is cheap.
"""

from __future__ import annotations

import datetime
import hashlib
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from common.errors import NmtError

__all__ = [
    "DING_PATH",
    "CorpusError",
    "Pair",
    "Splits",
    "clean",
    "generate_dates_corpus",
    "load_corpus",
    "load_ding",
    "load_parallel_files",
    "load_tsv",
    "parse_ding",
    "split",
    "with_term_slots",
    "write_tsv",
]

DING_PATH = Path("/usr/share/trans/de-en")
DATES_SIZE = 30000  # pairs of the generated corpus, unless asked otherwise
MAX_WORDS = 60  # longest side kept by clean()

CORPUS_FORMS = (
    "'dates' (generated English->German dates and numbers), "
    "'ding' (Ding dictionary example sentences, from the Debian package trans-de-en), "
    "PATH.tsv (one 'source<TAB>target' pair per line), "
    "or SRC_PATH,TGT_PATH (two line-aligned text files)"
)


@dataclass(frozen=True)
class Pair:
    """One sentence pair: ``source`` is English, ``target`` is German."""

    source: str
    target: str


@dataclass(frozen=True)
class Splits:
    """A corpus split into training, validation and test pairs."""

    train: list[Pair]
    valid: list[Pair]
    test: list[Pair]


class CorpusError(NmtError):
    """A corpus is missing, malformed or empty."""


# --------------------------------------------------------------------------------------------------
# The generated dates-and-numbers corpus

# CLDR date formats (en_US source, de_DE target) and how often each is drawn. All four translate
# deterministically: "Tuesday, April 25, 2045" -> "Dienstag, 25. April 2045", "April 25, 2045" ->
# "25. April 2045", "Apr 25, 2045" -> "25.04.2045", "4/25/45" -> "25.04.45".
_DATE_FORMATS: tuple[tuple[str, float], ...] = (
    ("full", 0.45),
    ("long", 0.30),
    ("medium", 0.15),
    ("short", 0.10),
)
_FIRST_DAY = datetime.date(1900, 1, 1).toordinal()
_LAST_DAY = datetime.date(2099, 12, 31).toordinal()
_MAX_REDRAWS = 20


def _random_number(rng: random.Random) -> int:
    """A number in 0..9999, biased towards small numbers so that 0..999 are all well covered."""
    bucket = rng.random()
    if bucket < 0.25:
        return rng.randint(0, 99)
    if bucket < 0.60:
        return rng.randint(100, 999)
    return rng.randint(1000, 9999)


def generate_dates_corpus(size: int = DATES_SIZE, seed: int = 0, stops: float = 0.0) -> list[Pair]:
    """Generate ``size`` distinct English->German pairs of dates and number words, deterministic in ``seed``.

    Half the pairs (as far as there are enough distinct numbers) are dates between 1900 and 2099
    rendered by Babel in one of the CLDR formats full/long/medium/short (en_US -> de_DE), the share ``stops`` of
    those written in words ending with a full stop on both sides, as a sentence of a paragraph does; the other
    half are numbers 0..9999 written out by num2words, three in four as cardinals ("ninety-seven" ->
    "siebenundneunzig"), one in four as ordinals ("twenty-first" -> "einundzwanzigste"), drawn with a
    bias towards small numbers so that 0..999 are well covered. Duplicate draws are redrawn.
    """
    if size < 0:
        raise CorpusError(f"corpus size must be >= 0, got {size}")
    if not 0.0 <= stops <= 1.0:
        raise CorpusError(f"the share of dates ending with a full stop must be between 0 and 1, got {stops}")
    from babel.dates import format_date
    from num2words import num2words

    rng = random.Random(seed)
    ends = random.Random(seed + 1)  # a stream of its own: which dates end a sentence, the draws unchanged
    formats = [name for name, _ in _DATE_FORMATS]
    weights = [weight for _, weight in _DATE_FORMATS]

    def draw_date() -> Pair:
        day = datetime.date.fromordinal(rng.randint(_FIRST_DAY, _LAST_DAY))
        fmt = rng.choices(formats, weights)[0]
        if fmt == "medium" and day.month == 5:
            fmt = "long"  # "May 25, 2045" is both medium and long in English: keep one German rendering
        stop = "." if ends.random() < stops and fmt != "short" else ""  # not after "2/12/91"
        return Pair(format_date(day, format=fmt, locale="en_US") + stop,
                    format_date(day, format=fmt, locale="de_DE") + stop)

    def draw_number() -> Pair:
        number = _random_number(rng)
        kind = "ordinal" if rng.random() < 0.25 else "cardinal"
        return Pair(num2words(number, lang="en", to=kind), num2words(number, lang="de", to=kind))

    pairs: list[Pair] = []
    seen: set[Pair] = set()
    attempts = 0
    max_attempts = 30 * size + 1000  # bounds the loop should a kind run out of distinct pairs
    while len(pairs) < size and attempts < max_attempts:
        draw = draw_date if rng.random() < 0.5 else draw_number
        for _ in range(_MAX_REDRAWS):
            attempts += 1
            pair = draw()
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
                break
    return pairs


_ONSETS = ("", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "w", "z", "br", "dr", "fl", "gr",
           "kl", "pf", "sch", "schw", "sp", "st", "tr")
_NUCLEI = ("a", "e", "i", "o", "u", "ä", "ö", "ü", "au", "ei", "ie", "eu")
_CODAS = ("", "", "n", "r", "l", "s", "m", "ch", "nd", "rt", "ng", "st", "ff")


def made_up_word(rng: random.Random) -> str:
    """A capitalised German-looking word of two or three syllables that no corpus holds ("Staurlend")."""
    word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(rng.randint(2, 3)))
    return word[0].upper() + word[1:]


def with_term_slots(pairs: Sequence[Pair], share: float, seed: int = 0) -> list[Pair]:
    """``pairs`` with the German month or weekday name of the share ``share`` of the dates that have one
    replaced by a made-up word, the English side unchanged.

    A model that has only ever seen the month its source names gives a glossary's term there several nats per
    piece and then loses its way (writes the year again, or ends). Trained on such slots, it learns that a name's
    place may hold a word it would not have chosen and goes on with the date after it, which is what a term of
    the constrained search asks of it (docs/glossaries.md). Training pairs only: held-out pairs keep their names.
    """
    if not 0.0 <= share <= 1.0:
        raise CorpusError(f"the share of dates with a made-up name must be between 0 and 1, got {share}")
    if share == 0.0:
        return list(pairs)
    from babel.dates import get_day_names, get_month_names

    names = [*get_month_names("wide", locale="de_DE").values(), *get_day_names("wide", locale="de_DE").values()]
    pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, names)) + r")\b")
    rng = random.Random(seed)
    result = []
    for pair in pairs:
        found = list(pattern.finditer(pair.target))
        if found and rng.random() < share:
            name = rng.choice(found)
            pair = Pair(pair.source, pair.target[:name.start()] + made_up_word(rng) + pair.target[name.end():])
        result.append(pair)
    return result


# --------------------------------------------------------------------------------------------------
# The Ding dictionary (Debian trans-de-en)

_ANNOTATION = re.compile(r"\s*(?:\{[^{}]*\}|\[[^\[\]]*\]|<[^<>]*>)")  # {f}, [coll.], <Aalmolch>
_OPTIONAL = re.compile(r"\s*\([^()]*\)")  # optional words: "Das wundert mich (nicht)."
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([.,!?:;…])")
_SENTENCE_END = re.compile(r"[.!?][\"'“”‘’]?$")
_PLACEHOLDER = re.compile(r"\b(?:sth|sb|etw|jdn|jdm|jds|jd)\.", re.IGNORECASE)
_REJECT_CHARS = frozenset("{}[]()<>/;|~=+")
_MIN_DING_WORDS = 3


def _strip_annotations(text: str) -> str:
    """Remove dictionary annotations and optional parenthesised words; normalize spacing and apostrophes."""
    previous = None
    while previous != text:  # innermost first, so nested "(and vigour [Br.])" goes too
        previous = text
        text = _ANNOTATION.sub("", text)
        text = _OPTIONAL.sub("", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    return " ".join(text.split()).replace("\u2019", "'")


def _is_sentence(text: str) -> bool:
    """Whether a cleaned Ding piece is a full sentence fit for training."""
    return (
        len(text.split()) >= _MIN_DING_WORDS
        and (text[0].isupper() or text[0].isdigit())
        and _SENTENCE_END.search(text) is not None
        and not _REJECT_CHARS.intersection(text)
        and _PLACEHOLDER.search(text) is None
    )


def _first_sentence(piece: str) -> str | None:
    """The first of a piece's ``;``-separated synonyms that is a clean full sentence, if any."""
    for alternative in piece.split("; "):
        text = _strip_annotations(alternative)
        if text and _is_sentence(text):
            return text
    return None


def parse_ding(lines: Iterable[str]) -> list[Pair]:
    """Extract full-sentence pairs from lines of the Ding dictionary (``German :: English``).

    Rules: ``#`` comment lines and lines without exactly one `` :: `` are skipped. Each side is split on
    `` | ``; pieces align by position, and a line whose sides have different piece counts is skipped.
    Within a piece, ``;`` separates synonyms: the first synonym on each side that passes the sentence
    test is used. Before the test, annotations (``{f}``, ``[coll.]``, ``<...>``) and parenthesised
    optional words are removed and typographic apostrophes become ``'``. A sentence has at least three
    words, starts with an uppercase letter or a digit, ends with ``.``, ``!`` or ``?`` (optionally
    followed by a closing quote), and contains no leftover brackets, ``/`` alternatives or placeholders
    such as ``sth.``/``etw.``. Source is English, target German; duplicates are kept (see ``clean``).
    """
    pairs: list[Pair] = []
    for line in lines:
        line = line.rstrip("\r\n")
        if not line or line.startswith("#"):
            continue
        sides = line.split(" :: ")
        if len(sides) != 2:
            continue
        german_pieces = sides[0].split(" | ")
        english_pieces = sides[1].split(" | ")
        if len(german_pieces) != len(english_pieces):
            continue
        for german_piece, english_piece in zip(german_pieces, english_pieces, strict=True):
            german = _first_sentence(german_piece)
            if german is None:
                continue
            english = _first_sentence(english_piece)
            if english is not None:
                pairs.append(Pair(english, german))
    return pairs


def load_ding(path: str | Path = DING_PATH) -> list[Pair]:
    """Load the sentence pairs of the Ding dictionary file (UTF-8), see ``parse_ding``."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(
            f"Ding dictionary not found at {path}; install it with `apt-get install trans-de-en`"
        )
    with _open_text(path) as handle:
        return parse_ding(_decoded_lines(handle, path))


# --------------------------------------------------------------------------------------------------
# User corpora


def _open_text(path: Path) -> TextIO:
    try:
        return path.open(encoding="utf-8-sig")
    except OSError as error:
        raise CorpusError(f"cannot read corpus file {path}: {error.strerror or error}") from error


def _decoded_lines(handle: Iterable[str], path: Path) -> Iterator[str]:
    """Yield lines without their line ending, turning a decoding failure into a CorpusError."""
    lines_read = 0
    try:
        for line in handle:
            lines_read += 1
            yield line.rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise CorpusError(f"{path}: line {lines_read + 1} is not valid UTF-8 ({error.reason})") from error


def _require_file(path: Path) -> None:
    if not path.exists():
        raise CorpusError(f"corpus not found: {path}")
    if not path.is_file():
        raise CorpusError(f"corpus path is not a file: {path}")


def load_tsv(path: str | Path) -> list[Pair]:
    """Load ``source<TAB>target`` lines (UTF-8); blank lines are skipped, others need exactly one tab."""
    path = Path(path)
    _require_file(path)
    pairs: list[Pair] = []
    with _open_text(path) as handle:
        for number, line in enumerate(_decoded_lines(handle, path), 1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise CorpusError(
                    f"{path}: line {number}: expected 'source<TAB>target' (exactly one tab), "
                    f"found {len(fields) - 1} tabs"
                )
            pairs.append(Pair(fields[0], fields[1]))
    return pairs


def load_parallel_files(source_path: str | Path, target_path: str | Path) -> list[Pair]:
    """Load two line-aligned UTF-8 text files (English source, German target) as pairs."""
    source_path, target_path = Path(source_path), Path(target_path)
    _require_file(source_path)
    _require_file(target_path)
    with _open_text(source_path) as handle:
        sources = list(_decoded_lines(handle, source_path))
    with _open_text(target_path) as handle:
        targets = list(_decoded_lines(handle, target_path))
    if len(sources) != len(targets):
        raise CorpusError(
            f"parallel files differ in length: {source_path} has {len(sources)} lines, "
            f"{target_path} has {len(targets)} lines"
        )
    return [Pair(source, target) for source, target in zip(sources, targets, strict=True)]


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or "\\" in spec or "," in spec or Path(spec).suffix != "" or spec.startswith("~")


def load_corpus(spec: str, *, size: int = DATES_SIZE, seed: int = 0, stops: float = 0.0) -> list[Pair]:
    """Load a corpus by name or path: ``dates``, ``ding``, ``PATH.tsv`` or ``SRC_PATH,TGT_PATH``.

    ``size``, ``seed`` and ``stops`` apply to the generated ``dates`` corpus only. Raises CorpusError for a missing
    path, an unknown name or an empty corpus.
    """
    spec = spec.strip()
    if spec == "dates":
        pairs = generate_dates_corpus(size, seed, stops)
    elif spec == "ding":
        pairs = load_ding()
    else:
        path = Path(spec).expanduser()
        if path.exists():
            if path.is_dir():
                raise CorpusError(f"corpus path is a directory, not a file: {path}; accepted: {CORPUS_FORMS}")
            pairs = load_tsv(path)
        elif "," in spec:
            parts = [part.strip() for part in spec.split(",")]
            if len(parts) != 2 or not all(parts):
                raise CorpusError(f"expected SRC_PATH,TGT_PATH, got {spec!r}; accepted: {CORPUS_FORMS}")
            pairs = load_parallel_files(Path(parts[0]).expanduser(), Path(parts[1]).expanduser())
        elif _looks_like_path(spec):
            raise CorpusError(f"corpus not found: {spec}")
        else:
            raise CorpusError(f"unknown corpus {spec!r}; accepted: {CORPUS_FORMS}")
    if not pairs:
        raise CorpusError(f"corpus {spec!r} is empty")
    return pairs


# --------------------------------------------------------------------------------------------------
# Cleaning and splitting


def clean(
    pairs: Iterable[Pair], *, min_words: int = 1, max_words: int = MAX_WORDS, max_ratio: float = 3.0
) -> list[Pair]:
    """Normalize whitespace, filter by length and length ratio, and drop exact duplicate pairs (first kept).

    A pair is dropped when either side is empty, either side has fewer than ``min_words`` or more than
    ``max_words`` whitespace-separated words, or the longer side has more than ``max_ratio`` times the
    characters of the shorter one. The ratio is measured in characters, not words, because German
    compounds make word counts incomparable ("nine hundred and ninety-nine" is one German word).
    Order is preserved.
    """
    kept: list[Pair] = []
    seen: set[Pair] = set()
    for pair in pairs:
        source_words = pair.source.split()
        target_words = pair.target.split()
        if not source_words or not target_words:
            continue
        if not all(min_words <= len(words) <= max_words for words in (source_words, target_words)):
            continue
        normalized = Pair(" ".join(source_words), " ".join(target_words))
        shorter, longer = sorted((len(normalized.source), len(normalized.target)))
        if longer > max_ratio * shorter:
            continue
        if normalized in seen:
            continue
        seen.add(normalized)
        kept.append(normalized)
    return kept


def _unit_hash(text: str) -> float:
    """A stable value in [0, 1) for ``text`` (BLAKE2b of its UTF-8 bytes; not Python's salted ``hash``)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split(
    pairs: Sequence[Pair],
    *,
    valid_fraction: float = 0.02,
    test_fraction: float = 0.02,
    max_valid: int = 500,
    max_test: int = 1000,
) -> Splits:
    """Split pairs into train/valid/test by a stable hash of the source sentence.

    Each source sentence maps to ``u`` in [0, 1) by BLAKE2b: ``u < test_fraction`` goes to test,
    ``u < test_fraction + valid_fraction`` to valid, the rest to train. All pairs sharing a source land
    in the same split, and a sentence's split never depends on the order or the rest of the corpus.
    Caps: when more than ``max_valid`` (``max_test``) distinct sources fall into valid (test), only those
    with the smallest hash values are kept; the overflow is dropped, not moved to train, so a held-out
    sentence can never become training data as the corpus grows. Input order is kept within each split.
    """
    for name, fraction in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= fraction <= 1.0:
            raise CorpusError(f"{name} must be in [0, 1], got {fraction}")
    if valid_fraction + test_fraction > 1.0:
        raise CorpusError("valid_fraction + test_fraction must not exceed 1")
    if max_valid < 0 or max_test < 0:
        raise CorpusError("max_valid and max_test must be >= 0")

    hashes = {pair.source: _unit_hash(pair.source) for pair in pairs}

    def capped(lower: float, upper: float, cap: int) -> set[str]:
        chosen = sorted((u, source) for source, u in hashes.items() if lower <= u < upper)
        return {source for _, source in chosen[:cap]}

    test_sources = capped(0.0, test_fraction, max_test)
    valid_sources = capped(test_fraction, test_fraction + valid_fraction, max_valid)
    held_out_limit = test_fraction + valid_fraction
    train: list[Pair] = []
    valid: list[Pair] = []
    test: list[Pair] = []
    for pair in pairs:
        if pair.source in test_sources:
            test.append(pair)
        elif pair.source in valid_sources:
            valid.append(pair)
        elif hashes[pair.source] >= held_out_limit:
            train.append(pair)
    return Splits(train=train, valid=valid, test=test)


def write_tsv(pairs: Iterable[Pair], path: str | Path) -> None:
    """Write pairs as ``source<TAB>target`` lines (UTF-8), creating parent directories."""
    path = Path(path)
    lines = []
    for pair in pairs:
        for text in (pair.source, pair.target):
            if "\t" in text or "\n" in text or "\r" in text:
                raise CorpusError(f"cannot write {path}: a sentence contains a tab or newline: {text!r}")
        lines.append(f"{pair.source}\t{pair.target}\n")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8", newline="\n") as handle:
            handle.writelines(lines)
    except OSError as error:
        raise CorpusError(f"cannot write {path}: {error.strerror or error}") from error
