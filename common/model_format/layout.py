"""File names of a training run and of a model version, and version discovery in a model repository.

A training run directory (``nmt train --out RUN``) holds :data:`TOKENIZER_FILE`, :data:`BEST_CHECKPOINT`,
:data:`LAST_CHECKPOINT`, :data:`HISTORY_FILE`, :data:`CURVES_FILE`, :data:`SUMMARY_FILE` and the held-out
split :data:`TEST_SPLIT_FILE`. A model repository is laid out like Triton's:
``<repository>/<name>/<version>/`` with :data:`MANIFEST_FILE` (written last), the graphs of
:data:`GRAPH_FILES`, their weights in :data:`WEIGHTS_FILE` (:mod:`common.model_format.weights`) and
:data:`TOKENIZER_FILE`.
"""

from __future__ import annotations

from pathlib import Path

from common.errors import NmtError

# a model version
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "spm.model"
MARIAN_SOURCE_SPM, MARIAN_TARGET_SPM, MARIAN_VOCAB = "source.spm", "target.spm", "vocab.json"  # Marian's tokenizer
HF_TOKENIZER_FILE = "tokenizer.json"  # a Hugging Face tokenizers model (NLLB-200, mBART-50)
MARIAN_CONFIG = "config.json"  # what makes a directory a Hugging Face model
GRAPH_FILES = {"encoder": "encoder.onnx", "decoder": "decoder.onnx", "decoder_attention": "decoder_attention.onnx"}
FORCED_GRAPH = "decoder_forced"  # optional role: the decoder over given target positions in one call
OPTIONAL_GRAPH_FILES = {FORCED_GRAPH: "decoder_forced.onnx"}  # versions exported before it lack it
WEIGHTS_FILE = "weights.bin"  # every graph's weights, each stored once (versions exported before: none)

# a training run
BEST_CHECKPOINT = "best.pt"
LAST_CHECKPOINT = "last.pt"
HISTORY_FILE = "history.json"
CURVES_FILE = "curves.png"
SUMMARY_FILE = "summary.json"
TEST_SPLIT_FILE = "test.tsv"
RUN_FILES = (BEST_CHECKPOINT, LAST_CHECKPOINT, TOKENIZER_FILE, HISTORY_FILE)  # their presence means "a run is here"


def version_key(version: str) -> tuple[int, int, str]:
    """Sort key of version names: integers first, numerically (``2`` < ``10``); then any other by name."""
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


def is_version_dir(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST_FILE).is_file()


def discover_versions(repository: str | Path) -> dict[str, list[tuple[str, Path]]]:
    """``{name: [(version, directory), ...oldest to newest]}`` for every version directory holding a manifest
    (names starting with a dot are skipped: work in progress, such as an export's temporary directory)."""
    root = Path(repository)
    if not root.is_dir():
        raise NmtError(f"model repository {root} is not a directory")
    found: dict[str, list[tuple[str, Path]]] = {}
    for name_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = [(d.name, d) for d in name_dir.iterdir() if not d.name.startswith(".") and is_version_dir(d)]
        if versions:
            found[name_dir.name] = sorted(versions, key=lambda item: version_key(item[0]))
    return found


def has_models(repository: str | Path) -> bool:
    """Whether ``repository`` holds at least one model version."""
    return any(Path(repository).glob(f"*/*/{MANIFEST_FILE}"))


def next_version(model_dir: Path) -> str:
    """One more than the largest integer version directory (1 for a new model)."""
    if not model_dir.is_dir():
        return "1"
    numbers = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return str(max(numbers, default=0) + 1)
