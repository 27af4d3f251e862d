"""Tests for training.data (corpora) and the ``nmt data`` command."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from common.errors import NmtError
from training.data import (
    CorpusError,
    Pair,
    Splits,
    clean,
    generate_dates_corpus,
    load_corpus,
    load_ding,
    load_parallel_files,
    load_tsv,
    parse_ding,
    split,
    with_term_slots,
    write_tsv,
)

FIXTURES = Path(__file__).parent / "fixtures"
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
MONATE = "Januar|Februar|März|April|Mai|Juni|Juli|August|September|Oktober|November|Dezember"


@pytest.fixture(scope="module")
def dates() -> list[Pair]:
    return generate_dates_corpus(size=1000, seed=0)


# ---------------------------------------------------------------------------------------------- dates


def test_dates_deterministic_in_seed(dates: list[Pair]) -> None:
    assert len(dates) == 1000
    assert generate_dates_corpus(size=1000, seed=0) == dates
    assert generate_dates_corpus(size=1000, seed=1) != dates
    assert len(set(dates)) == len(dates)


def test_dates_does_not_touch_global_random_state() -> None:
    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_dates_corpus(size=50, seed=5)
    assert random.random() == expected


def test_dates_full_date_swaps_day_and_month(dates: list[Pair]) -> None:
    english = re.compile(
        rf"^(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), ({MONTHS}) (\d+), (\d{{4}})$"
    )
    german = re.compile(
        rf"^(Montag|Dienstag|Mittwoch|Donnerstag|Freitag|Samstag|Sonntag), (\d+)\. ({MONATE}) (\d{{4}})$"
    )
    full = [(english.match(p.source), german.match(p.target)) for p in dates]
    full = [(en, de) for en, de in full if en and de]
    assert len(full) > 100
    for en, de in full:
        assert en.group(3) == de.group(2)  # the day moves in front of the month
        assert en.group(4) == de.group(4)
        assert MONTHS.split("|").index(en.group(2)) == MONATE.split("|").index(de.group(3))
    assert any(re.fullmatch(rf"({MONTHS}) \d+, \d{{4}}", p.source) for p in dates)  # the "long" format too


def test_dates_numbers_put_units_before_tens(dates: list[Pair]) -> None:
    assert Pair("ninety-seven", "siebenundneunzig") in generate_dates_corpus(size=4000, seed=0)
    units_first = [p for p in dates if re.fullmatch(r"[a-z]+-[a-z]+", p.source) and "und" in p.target]
    assert len(units_first) > 20
    numbers = [p for p in dates if not re.search(r"\d", p.source)]
    assert 0.3 < len(numbers) / len(dates) < 0.7  # roughly half dates, half numbers


def test_dates_sources_have_one_target() -> None:
    corpus = generate_dates_corpus(size=5000, seed=3)
    assert len({p.source for p in corpus}) == len(corpus)


def test_term_slots_replace_one_german_name_of_the_share_asked(dates: list[Pair]) -> None:
    """A made-up word takes the place of one German month or weekday name; the English side, the numbers and
    every other character stay; share 0 changes nothing and the draws are the seed's."""
    named = [p for p in dates if re.search(rf"\b({MONATE}|Montag|Dienstag|Mittwoch|Donnerstag|Freitag|Samstag|"
                                            r"Sonntag)\b", p.target)]
    slotted = with_term_slots(dates, 0.5, seed=3)
    assert with_term_slots(dates, 0.0) == dates and with_term_slots(dates, 0.5, seed=3) == slotted
    changed = [(a, b) for a, b in zip(dates, slotted, strict=True) if a != b]
    assert 0.4 * len(named) < len(changed) < 0.6 * len(named)
    for before, after in changed:
        assert after.source == before.source
        old, new = before.target.split(), after.target.split()
        [(name, word)] = [(o, n) for o, n in zip(old, new, strict=True) if o != n]
        assert re.fullmatch(r"[A-ZÄÖÜ][a-zäöüß]+,?", word) and name.rstrip(",") in before.target
        assert word.endswith(",") == name.endswith(",")
    with pytest.raises(CorpusError, match="between 0 and 1"):
        with_term_slots(dates, 1.5)


# ----------------------------------------------------------------------------------------------- ding


DING_SAMPLE_PAIRS = [
    Pair("The word 'côte' has no acute on the 'e'.", "Das Wort „côte“ hat keinen Akut auf dem „e“."),
    Pair("April weather rain and sunshine both together.", "April, April, der macht was er will."),
    Pair("Honesty does not pay.", "Der Ehrliche ist immer der Dumme."),
    Pair("Honesty is the best policy.", "Ehrlich währt am längsten."),
    Pair("Happy birthday to you!", "Herzlichen Glückwunsch zum Geburtstag!"),
    Pair("Happy belated birthday!", "Nachträglich alles Gute zum Geburtstag!"),
    Pair("They are both celebrating their birthdays today.", "Beide feiern heute Geburtstag."),
    Pair("That won't be an obstacle!", "Daran soll's nicht scheitern."),
    Pair("Don't let it be an obstacle.", "Lass dich dadurch nicht abhalten."),
    Pair("My memory failed me.", "Mein Gedächtnis hat mich im Stich gelassen."),
    Pair("Words failed her.", "Sie fand keine Worte."),
    Pair(
        "In the face of the danger, his courage failed him.", "Im Angesicht der Gefahr verließ ihn sein Mut."
    ),
    Pair("At what time of day?", "Um welche Uhrzeit?"),
    Pair("What time is it?", "Wie spät ist es?"),
    Pair("Could you tell me the time, please?", "Haben Sie die genaue Uhrzeit?"),
]


def test_load_ding_sample_exact_pairs() -> None:
    assert load_ding(FIXTURES / "ding_sample.txt") == DING_SAMPLE_PAIRS


def test_parse_ding_rules() -> None:
    lines = [
        "# Comment :: This is a comment line.",
        "Das ist gut. | Das ist schlecht. :: That is good.",  # piece counts differ
        "Er kommt [ugs.] heute. :: He is coming {v} today.",  # annotations stripped
        "Sie kommt/geht jetzt. :: She comes now.",  # '/' alternatives rejected
        "Das wundert mich (nicht) sehr. :: It surprises me (not) much.",  # optional words removed
        "etw. tun :: to do sth.",  # not sentences
        "Gut gemacht! :: Well done!",  # fewer than three words
        "Ich mache etw. gern. :: I like doing sth. a lot.",  # placeholders rejected
    ]
    assert parse_ding(lines) == [
        Pair("He is coming today.", "Er kommt heute."),
        Pair("It surprises me much.", "Das wundert mich sehr."),
    ]


def test_load_ding_missing_file_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="apt-get install trans-de-en"):
        load_ding(tmp_path / "de-en")
    assert issubclass(CorpusError, NmtError)


# ------------------------------------------------------------------------------------- user corpora


def test_load_tsv(tmp_path: Path) -> None:
    path = tmp_path / "corpus.tsv"
    path.write_text("Hello.\tHallo.\n\n  \nGood night.\tGute Nacht.\r\n", encoding="utf-8")
    assert load_tsv(path) == [Pair("Hello.", "Hallo."), Pair("Good night.", "Gute Nacht.")]
    assert load_corpus(str(path)) == load_tsv(path)


@pytest.mark.parametrize("bad_line", ["no tab here", "one\ttwo\tthree"])
def test_load_tsv_bad_line_names_file_and_line(tmp_path: Path, bad_line: str) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text(f"Hello.\tHallo.\n{bad_line}\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"bad\.tsv: line 2\b"):
        load_tsv(path)


def test_load_parallel_files(tmp_path: Path) -> None:
    source, target = tmp_path / "train.en", tmp_path / "train.de"
    source.write_text("Hello.\nGood night.\n", encoding="utf-8")
    target.write_text("Hallo.\nGute Nacht.\n", encoding="utf-8")
    expected = [Pair("Hello.", "Hallo."), Pair("Good night.", "Gute Nacht.")]
    assert load_parallel_files(source, target) == expected
    assert load_corpus(f"{source},{target}") == expected


def test_load_parallel_files_mismatched_counts(tmp_path: Path) -> None:
    source, target = tmp_path / "a.en", tmp_path / "a.de"
    source.write_text("one\ntwo\nthree\n", encoding="utf-8")
    target.write_text("eins\nzwei\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"3 lines.*2 lines"):
        load_parallel_files(source, target)


def test_load_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="corpus not found"):
        load_corpus(str(tmp_path / "missing.tsv"))
    with pytest.raises(CorpusError, match="corpus not found"):
        load_corpus(f"{tmp_path / 'a.en'},{tmp_path / 'a.de'}")
    with pytest.raises(CorpusError, match="accepted"):
        load_corpus("no-such-corpus")
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(CorpusError, match="is empty"):
        load_corpus(str(empty))


def test_load_corpus_dates() -> None:
    assert load_corpus("dates", size=50, seed=2) == generate_dates_corpus(50, 2)


# ------------------------------------------------------------------------------------- clean, split


def test_clean_normalizes_filters_and_deduplicates() -> None:
    pairs = [
        Pair("  Hello   world. ", "Hallo\t Welt."),
        Pair("Hello world.", "Hallo Welt."),  # duplicate once normalized
        Pair("Hello world.", "Servus Welt."),  # same source, other target: kept
        Pair("", "Leer."),
        Pair("Empty.", "   "),
        Pair("A " * 61 + "end.", "Ein Satz."),  # too many words
        Pair("Yes, that is exactly what I meant to say yesterday.", "Ja."),  # ratio
        Pair("Good night.", "Gute Nacht."),
    ]
    assert clean(pairs) == [
        Pair("Hello world.", "Hallo Welt."),
        Pair("Hello world.", "Servus Welt."),
        Pair("Good night.", "Gute Nacht."),
    ]
    assert clean([Pair("Hi.", "Hallo.")], min_words=2) == []


def test_clean_keeps_number_words() -> None:
    pair = Pair("nine thousand, nine hundred and ninety-nine", "neuntausendneunhundertneunundneunzig")
    assert clean([pair]) == [pair]


def _corpus(count: int, prefix: str = "sentence") -> list[Pair]:
    return [Pair(f"{prefix} number {i}.", f"Satz Nummer {i}.") for i in range(count)]


def _membership(splits: Splits) -> dict[str, str]:
    return {
        pair.source: name
        for name, subset in (("train", splits.train), ("valid", splits.valid), ("test", splits.test))
        for pair in subset
    }


def test_split_disjoint_and_deterministic() -> None:
    pairs = _corpus(3000) + [Pair("sentence number 7.", "Ein anderer Satz.")]
    splits = split(pairs, valid_fraction=0.1, test_fraction=0.1)
    sources = [{p.source for p in subset} for subset in (splits.train, splits.valid, splits.test)]
    assert not (sources[0] & sources[1] or sources[0] & sources[2] or sources[1] & sources[2])
    assert sum(len(s) for s in (splits.train, splits.valid, splits.test)) == len(pairs)
    assert 200 < len(splits.valid) < 400 and 200 < len(splits.test) < 400
    assert split(pairs, valid_fraction=0.1, test_fraction=0.1) == splits
    subsets = {"train": splits.train, "valid": splits.valid, "test": splits.test}
    homes = [name for name, subset in subsets.items() for p in subset if p.source == "sentence number 7."]
    assert len(homes) == 2 and len(set(homes)) == 1  # pairs sharing a source share a split


def test_split_is_stable_under_shuffling_and_additions() -> None:
    pairs = _corpus(2000)
    reference = _membership(split(pairs, valid_fraction=0.1, test_fraction=0.1))
    shuffled = pairs[:]
    random.Random(0).shuffle(shuffled)
    assert _membership(split(shuffled, valid_fraction=0.1, test_fraction=0.1)) == reference
    grown = _membership(split(shuffled + _corpus(1000, "other"), valid_fraction=0.1, test_fraction=0.1))
    assert {source: grown[source] for source in reference} == reference


def test_split_caps_drop_overflow_instead_of_training_on_it() -> None:
    pairs = _corpus(2000)
    uncapped = split(pairs, valid_fraction=0.1, test_fraction=0.1)
    capped = split(pairs, valid_fraction=0.1, test_fraction=0.1, max_valid=50, max_test=30)
    assert len(capped.valid) == 50 and len(capped.test) == 30
    assert capped.train == uncapped.train
    assert {p.source for p in capped.test} <= {p.source for p in uncapped.test}


def test_write_tsv_round_trip(tmp_path: Path) -> None:
    pairs = [Pair("Hello.", "Hallo."), Pair("Good night.", "Gute Nacht.")]
    path = tmp_path / "sub" / "out.tsv"
    write_tsv(pairs, path)
    assert load_tsv(path) == pairs
    with pytest.raises(CorpusError):
        write_tsv([Pair("a\tb", "c")], tmp_path / "bad.tsv")


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def cli_main(monkeypatch: pytest.MonkeyPatch):
    """``nmt.cli.main`` with only the ``data`` subcommand registered (the others are not under test)."""
    import nmt.cli

    monkeypatch.setattr(nmt.cli, "SUBCOMMANDS", {"data": "training.data_cli"})
    return nmt.cli.main


def test_cli_data_dates(cli_main, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["data", "dates", "--size", "200", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "200 pairs loaded" in out and "train" in out and out.count("  en: ") == 2


def test_cli_data_writes_splits_and_refuses_overwrite(cli_main, tmp_path: Path, capsys) -> None:
    args = ["data", "dates", "--size", "300", "--samples", "0", "--out", str(tmp_path)]
    assert cli_main(args) == 0
    written = sum(len(load_tsv(tmp_path / name)) for name in ("train.tsv", "valid.tsv", "test.tsv"))
    assert written == 300
    assert cli_main(args) == 2
    assert "--force" in capsys.readouterr().err
    assert cli_main([*args, "--force"]) == 0


def test_cli_data_missing_corpus(cli_main, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.tsv"
    assert cli_main(["data", str(missing)]) == 2
    captured = capsys.readouterr()
    assert f"corpus not found: {missing}" in captured.err
    assert "Traceback" not in captured.err


def test_cli_module_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, training.data_cli; print(any(m in sys.modules for m in ('babel', 'num2words', 'torch')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert result.stdout.strip() == "False"
