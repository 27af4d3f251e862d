"""Shared fixtures: tiny trained models of both architectures, as training runs and exported versions,
and the small Hugging Face Marian model of :mod:`tests.marian` (imported, served, converted for CTranslate2).

The models train for a few seconds on English number words whose German side is reversed (so
alignments are not the diagonal); the session exports each once into a temporary model repository.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F
from filelock import FileLock

from common.model_format.tokenizer import PAD_ID, train_tokenizer
from export.options import ExportOptions
from export.pipeline import export_model
from nmt.cli import main as nmt_main
from server.config import ServerConfig
from tests.harness import ServerHarness
from tests.marian import MODEL, build_marian_dir
from training.config import TrainConfig
from training.models.checkpoint import build_model, save_checkpoint
from training.presets import PRESETS
from training.train import collate, encode_pairs, train

EN = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
DE = ["eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn"]
TINY = {
    "transformer": dict(d_model=32, heads=4, ffn_dim=64, encoder_layers=2, decoder_layers=2, dropout=0.1),
    "bahdanau": dict(embed_dim=16, encoder_hidden=16, decoder_hidden=32, attention_dim=16, dropout=0.1),
}
PARITY_SENTENCES = 8
SERVED_MODEL = "tiny"  # the model name of the server tests' repository


def number_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """English number words -> German, German in reverse order (so alignments are not the diagonal)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 6))]
        pairs.append((" ".join(EN[w] for w in words), " ".join(DE[w] for w in reversed(words))))
    return pairs


def make_run(directory, arch: str, steps: int = 150):
    """A training run directory like ``nmt train`` writes, from a model trained for a few seconds."""
    train, test = number_pairs(80, seed=0), number_pairs(12, seed=1)
    tokenizer = train_tokenizer([text for pair in train for text in pair], vocab_size=60)
    torch.manual_seed(0)
    model = build_model(arch, vocab_size=tokenizer.vocab_size, **TINY[arch])

    class P:  # training.train.encode_pairs takes objects with .source/.target
        def __init__(self, source, target):
            self.source, self.target = source, target

    src, tgt_in, tgt_out = collate(encode_pairs(tokenizer, [P(s, t) for s, t in train]))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(directory)
    save_checkpoint(directory / "best.pt", model, step=steps, valid_bleu=50.0)
    (directory / "test.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in test), encoding="utf-8")
    summary = {"arch": arch, "corpus": "numbers", "steps": steps, "best_valid_bleu": 50.0, "test_bleu": 40.0}
    (directory / "summary.json").write_text(json.dumps(summary))
    return directory


DEFAULTS = ServerConfig()
HELD = "NMT_TESTS_HELD_ADDRESSES"  # the addresses the run holds, for its workers (they inherit the environment)
_held: list[socket.socket] = []


def pytest_configure(config: pytest.Config) -> None:
    """The server's default addresses (gRPC 50051, metrics 9400, HTTP 8080) held for the whole run, as a
    developer's ``nmt serve --demo`` beside the suite holds them: any test server or process that binds one
    fails instead of passing here and failing there. Held by the process that runs the session (with
    pytest-xdist, the controller, for as long as any worker runs); an address already taken (by such a
    server) stays so, and is not this run's to check: that server may stop before the run does."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    for address in (DEFAULTS.listen, DEFAULTS.metrics_listen, DEFAULTS.http_listen):
        host, _, port = address.rpartition(":")
        sock = socket.socket()
        try:
            sock.bind((host, int(port)))
            sock.listen(1)  # listening, so that a bind with SO_REUSEADDR (aiohttp's default) fails too
        except OSError:
            sock.close()
            continue
        _held.append(sock)
    os.environ[HELD] = " ".join(f"{host}:{port}" for host, port in (sock.getsockname() for sock in _held))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _held:
        _held.pop().close()


@pytest.fixture(scope="session")
def default_ports_taken() -> list[str]:
    """The server's default addresses this run holds (``tests/test_ports.py`` checks that each is taken while
    the suite runs)."""
    return os.environ.get(HELD, "").split()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps are much slower with more threads on a shared host
    yield
    torch.set_num_threads(previous)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Train the session's larger models (dates, Marian) on every core, then go back to one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


Built = TypeVar("Built", Path, dict[str, Path])


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Built]) -> Built:
    """``build(directory)`` once per test run. Alone, in a directory of this session; under pytest-xdist, by the
    first worker that asks, in a directory of the run that every worker shares, while the others wait on a file
    lock and then read what it built: a model is trained and exported once however many workers use it.
    ``build`` returns the paths it made (a path, or paths by name), which is all that crosses between workers."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(factory.mktemp(name))
    shared = factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    made = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not made.exists():
            directory = shared / name
            shutil.rmtree(directory, ignore_errors=True)  # a worker's failed build, which the next one repeats
            directory.mkdir()
            result = build(directory)
            made.write_text(json.dumps(str(result) if isinstance(result, Path)
                                       else {k: str(v) for k, v in result.items()}))
    paths = json.loads(made.read_text())
    return Path(paths) if isinstance(paths, str) else {k: Path(v) for k, v in paths.items()}  # type: ignore[return-value]


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    return built_once(tmp_path_factory, "runs", lambda root: {arch: make_run(root / arch, arch) for arch in TINY})


@pytest.fixture(scope="session")
def tiny_repository(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def export_tiny(runs: dict[str, Path], repository: Path) -> dict[str, Path]:
    """Both architectures exported: Transformer through the API, Bahdanau through ``nmt export``."""
    result = export_model(ExportOptions(stage_processes=False,
                                        checkpoint=str(runs["transformer"]), name="tiny-transformer",
                                        model_repository=str(repository), parity_sentences=PARITY_SENTENCES,
                                        progress=False))
    assert result.version_dir == repository / "tiny-transformer" / "1"
    status = nmt_main(["export", "--no-stage-processes", str(runs["bahdanau"]), "--name", "tiny-bahdanau",
                       "--model-repository", str(repository), "--parity-sentences", str(PARITY_SENTENCES),
                       "--no-progress"])
    assert status == 0
    return {"transformer": result.version_dir, "bahdanau": repository / "tiny-bahdanau" / "1"}


@pytest.fixture(scope="session")
def tiny_models(tiny_runs, tiny_repository, tmp_path_factory):
    """Both architectures exported once per run, copied into this session's ``tiny_repository`` (tests export
    more versions there, and serve it: another worker's repository is not this one's)."""
    built = built_once(tmp_path_factory, "tiny-models", lambda root: export_tiny(tiny_runs, root))
    for version_dir in built.values():
        shutil.copytree(version_dir.parent, tiny_repository / version_dir.parent.name)
    return {arch: tiny_repository / version_dir.parent.name / "1" for arch, version_dir in built.items()}


@pytest.fixture(scope="session")
def fp16_models(tiny_runs, tmp_path_factory) -> dict[str, Path]:
    """Both architectures exported with ``nmt export --precision fp16`` once per session (into a repository of
    their own: an fp16 version beside the fp32 ones would be the one later tests' servers load)."""
    def build(repository: Path) -> dict[str, Path]:
        for arch, run in tiny_runs.items():
            assert nmt_main(["export", "--no-stage-processes",
                             str(run), "--name", f"tiny-{arch}-fp16", "--model-repository", str(repository),
                             "--precision", "fp16", "--parity-sentences", str(PARITY_SENTENCES), "--bleu-sentences",
                             "12", "--no-progress"]) == 0
        return {arch: repository / f"tiny-{arch}-fp16" / "1" for arch in tiny_runs}

    return built_once(tmp_path_factory, "fp16", build)


@pytest.fixture(scope="session")
def model_version_dir(tiny_models: dict[str, Path]) -> Path:
    """The session's tiny Transformer, trained and exported once."""
    return Path(tiny_models["transformer"])


@pytest.fixture(scope="session")
def repository(model_version_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<repo>/tiny/{1,2,10}``: three copies of the exported version (10 is the newest: numeric order)."""
    root = tmp_path_factory.mktemp("repository")
    for version in ("1", "2", "10"):
        shutil.copytree(model_version_dir, root / SERVED_MODEL / version)
    return root


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Marian directory of :mod:`tests.marian`, trained once per session (about 30 s)."""
    def build(root: Path) -> Path:
        with torch_threads(os.cpu_count() or 1):
            return build_marian_dir(root / "opus-mt-en-de-dates")

    return built_once(tmp_path_factory, "marian", build)


@pytest.fixture(scope="session")
def marian_repository(marian_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Marian directory imported into a model repository through ``nmt export`` (detected from config.json)."""
    def build(repository: Path) -> Path:
        assert nmt_main(["export", "--no-stage-processes",
                         str(marian_dir), "--name", MODEL, "--model-repository", str(repository),
                         "--no-progress"]) == 0
        return repository

    return built_once(tmp_path_factory, "hf-models", build)


@pytest.fixture(scope="module")
def marian_server(marian_repository: Path) -> Iterator[ServerHarness]:
    """The imported Marian model served over gRPC (one server per test module)."""
    config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", http_listen="",
                          model_repository=str(marian_repository),
                          provider="cpu", intra_op_threads=1, grace_seconds=1).validate()
    harness = ServerHarness(config)
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def ct2_dir(marian_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Marian directory converted for CTranslate2 (``TransformersConverter``)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    def build(root: Path) -> Path:
        ctranslate2.converters.TransformersConverter(str(marian_dir)).convert(str(root / "model"), force=True)
        return root / "model"

    return built_once(tmp_path_factory, "ct2", build)


# the Bahdanau counterpart of the ``dates-transformer-small`` preset: ~98 BLEU in ~35 s on one core
DATES_BAHDANAU_SMALL = {
    "arch": "bahdanau", "corpus": "dates", "corpus_size": 3000, "vocab_size": 400, "batch_tokens": 2000,
    "model": {"embed_dim": 32, "encoder_hidden": 64, "decoder_hidden": 128, "attention_dim": 64, "dropout": 0.0},
    "lr": 3e-3, "valid_every": 300, "valid_size": 100, "max_steps": 300,
}


@pytest.fixture(scope="session")
def dates_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small models of both architectures trained on the generated dates corpus (``dates-transformer-small``
    and :data:`DATES_BAHDANAU_SMALL`), trained and exported once per session (about a minute each): the
    version directories, by architecture, in a repository of models named ``dates-<arch>``."""
    def build(root: Path) -> dict[str, Path]:
        versions = {}
        for arch, settings in (("transformer", PRESETS["dates-transformer-small"]),
                               ("bahdanau", DATES_BAHDANAU_SMALL)):
            run = root / "runs" / arch
            with torch_threads(os.cpu_count() or 1):
                train(TrainConfig(**settings, out=str(run), progress=False), log=lambda line: None)
            result = export_model(ExportOptions(stage_processes=False, checkpoint=str(run), name=f"dates-{arch}",
                                                model_repository=str(root / "models"), parity_sentences=4,
                                                progress=False))  # in-process: the stages' processes have tests
            versions[arch] = result.version_dir
        return versions

    return built_once(tmp_path_factory, "dates", build)
