"""``nmt train`` end to end on a tiny TSV corpus, tokenizer round trips, batching."""

import json
import random

import pytest

from common.model_format.tokenizer import Tokenizer, train_tokenizer
from nmt.cli import main
from training.config import TrainConfig
from training.train import learning_rate, make_batches

PAIRS = [(f"number {n}", f"Nummer {n}") for n in range(40)] + [(f"day {n} of May", f"{n}. Mai") for n in range(1, 29)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "tiny.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS))
    return path


def test_tokenizer_round_trips_and_saves(tmp_path):
    texts = [s for pair in PAIRS for s in pair]
    tokenizer = train_tokenizer(texts, vocab_size=80)
    for text in ["number 17", "Nummer 17", "day 3 of May", "3. Mai"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.encode("Nummer 12") == tokenizer.encode("Nummer 12")
    assert loaded.model_proto == tokenizer.model_proto


def test_batches_respect_the_token_budget():
    rng = random.Random(0)
    examples = [([1] * rng.randint(1, 30), [1] * rng.randint(1, 30)) for _ in range(500)]
    batches = make_batches(examples, 256, rng)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for batch in batches:
        longest = max(max(len(examples[i][0]), len(examples[i][1]) + 1) for i in batch)
        assert longest * len(batch) <= 256 or len(batch) == 1


def test_train_cli_end_to_end(tmp_path, corpus):
    out = tmp_path / "run"
    args = ["train", "--arch", "transformer", "--corpus", str(corpus), "--out", str(out), "--vocab-size", "80",
            "--d-model", "32", "--layers", "1", "--heads", "2", "--ffn-dim", "64", "--steps", "6",
            "--valid-every", "3", "--batch-tokens", "400", "--no-progress"]
    assert main(args) == 0
    for name in ["best.pt", "last.pt", "spm.model", "history.json", "curves.png", "summary.json", "test.tsv"]:
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["arch"] == "transformer"
    assert json.loads((out / "history.json").read_text())["valid_step"] == [3, 6]

    assert main(args) == 2  # refuses to overwrite a run
    assert main([*args[:-3], "--steps", "9", "--resume", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 9
    assert main([*args, "--force"]) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--arch", "bahdanau", "--corpus", "/no/such/file.tsv"], "corpus not found"),
        (["--arch", "transformer", "--corpus", "dates", "--hidden", "8"], "applies to bahdanau"),
        (["--corpus", "dates"], "give --arch and --corpus"),
    ],
)
def test_train_cli_errors_are_clear(tmp_path, capsys, extra, message):
    assert main(["train", "--out", str(tmp_path / "r"), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_train_cli_rejects_unknown_arch(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--arch", "lstm", "--corpus", "dates", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "invalid choice: 'lstm'" in capsys.readouterr().err


def test_empty_and_mismatched_corpora(tmp_path, capsys):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    assert main(["train", "--arch", "bahdanau", "--corpus", str(empty), "--out", str(tmp_path / "a")]) == 2
    assert "empty" in capsys.readouterr().err
    (tmp_path / "s.txt").write_text("a\nb\n")
    (tmp_path / "t.txt").write_text("x\n")
    spec = f"{tmp_path / 's.txt'},{tmp_path / 't.txt'}"
    assert main(["train", "--arch", "bahdanau", "--corpus", spec, "--out", str(tmp_path / "b")]) == 2
    assert "2 lines" in capsys.readouterr().err


def test_a_run_the_time_cap_stops_says_so(tmp_path, corpus, capsys):
    args = ["train", "--arch", "transformer", "--corpus", str(corpus), "--out", str(tmp_path / "run"),
            "--vocab-size", "80", "--d-model", "32", "--layers", "1", "--heads", "2", "--ffn-dim", "64",
            "--steps", "1000", "--max-minutes", "0.0001", "--valid-every", "500", "--batch-tokens", "400",
            "--no-progress"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"] == "time cap" and summary["steps"] < 1000
    assert f"stopped by --max-minutes 0.0001 at step {summary['steps']} of 1000" in capsys.readouterr().out
    assert main([*args[:-3], "--max-minutes", "10", "--steps", "4", "--force", "--no-progress"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped_by"] == "step budget"


@pytest.mark.parametrize("arch", ["transformer", "bahdanau"])
def test_the_cosine_schedule_warms_up_then_decays_to_zero_at_the_last_step(arch):
    cfg = TrainConfig(arch=arch, corpus="dates", out="unused", lr=2e-3, warmup_steps=100, max_steps=500,
                      lr_schedule="cosine")
    assert learning_rate(cfg, 50) == pytest.approx(1e-3)
    assert learning_rate(cfg, 100) == pytest.approx(2e-3)
    assert learning_rate(cfg, 300) == pytest.approx(1e-3)  # half way down
    assert learning_rate(cfg, 500) == pytest.approx(0.0, abs=1e-12)
    rates = [learning_rate(cfg, step) for step in range(100, 501)]
    assert rates == sorted(rates, reverse=True)


def test_the_default_schedules_are_unchanged():
    transformer = TrainConfig(arch="transformer", corpus="dates", out="unused", lr=1e-3, warmup_steps=100)
    assert learning_rate(transformer, 100) == pytest.approx(1e-3)
    assert learning_rate(transformer, 400) == pytest.approx(5e-4)
    bahdanau = TrainConfig(arch="bahdanau", corpus="dates", out="unused", lr=1e-3)
    assert learning_rate(bahdanau, 1) == learning_rate(bahdanau, 10_000) == 1e-3
