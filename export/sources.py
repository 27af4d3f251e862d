"""The export's sources, read into :class:`ExportInputs` by the loader of their format
(:data:`SOURCE_LOADERS`): a training run's checkpoint (``weights_only=True``) with the tokenizer beside
it, or a Hugging Face Marian directory (:mod:`export.huggingface`). Also the held-out sentences the
parity check decodes and the run's training record."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import NmtError
from common.model_format.layout import BEST_CHECKPOINT, SUMMARY_FILE, TEST_SPLIT_FILE, TOKENIZER_FILE
from common.model_format.tokenizer import AnyTokenizer, Tokenizer
from export.hf_multilingual import FAMILIES, load_multilingual
from export.huggingface import load_marian, read_config
from export.options import ExportOptions, source_format
from training.data import load_tsv
from training.models.checkpoint import load_checkpoint
from training.models.interface import Seq2SeqModel


@dataclass
class ExportInputs:
    """What the export reads from its source: the PyTorch model, its tokenizer and what the run recorded."""

    checkpoint: Path
    run_dir: Path
    model: Seq2SeqModel | None  # None once released (release_model)
    payload: dict[str, Any]
    tokenizer: AnyTokenizer
    summary: dict[str, Any]
    pairs: list[tuple[str, str]]  # held-out (source, target) texts; empty if the run has no test.tsv
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # the source's serving defaults
    origin: dict[str, Any] = dataclasses.field(default_factory=dict)  # an imported model's provenance
    source_state: dict[str, torch.Tensor] | None = None  # an imported model's tensors under its files' names
    # (the model holds the same tensors): what the check against the library it came from loads
    arch: str = dataclasses.field(init=False)
    config: Any = dataclasses.field(init=False)  # the model's configuration (kept when the model is released)

    def __post_init__(self) -> None:
        self.arch, self.config = self.model.arch, self.model.config

    def release_model(self) -> None:
        """Free the PyTorch model's weights: the export's later stages read only the graphs (and the reference
        computed from the model), so the model and a loaded version are never in memory together.

        Dropping the model is not enough: the exporter's libraries keep references to some of a traced
        module's parameters (onnxscript's fusion rules are module-level objects that keep values of the last
        graph they matched), so each parameter and buffer is given an empty tensor in place of its values."""
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype)
        self.model = self.source_state = None
        gc.collect()
        return_freed_memory()


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): tracing and graph edits leave
    the heap fragmented (after tracing, about a third of the model's size stays counted in the process's
    memory without this)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """A run directory or a checkpoint file -> (checkpoint file, directory holding spm.model)."""
    path = Path(path)
    if path.is_dir():
        checkpoint = path / BEST_CHECKPOINT
        if not checkpoint.is_file():
            raise NmtError(f"{path} holds no {BEST_CHECKPOINT}; pass a training run directory or a checkpoint file")
        return checkpoint, path
    if not path.exists():
        raise NmtError(f"checkpoint not found: {path}")
    return path, path.parent


def load_inputs(options: ExportOptions) -> ExportInputs:
    """The source, read by the loader of its format."""
    return SOURCE_LOADERS[source_format(options)](options)


def _load_huggingface(options: ExportOptions) -> ExportInputs:
    """A Hugging Face directory: Marian (OPUS-MT), or M2M-100/NLLB-200 or mBART-50 (:mod:`export.hf_multilingual`),
    by its ``model_type``."""
    directory = Path(options.checkpoint)
    if not directory.is_dir():
        raise NmtError(f"Hugging Face model directory not found: {directory}")
    many = read_config(directory).get("model_type") in FAMILIES
    marian = load_multilingual(directory) if many else load_marian(directory)
    if options.reduced_precision:
        raise NmtError(f"{options.reduced_precision} export scores held-out BLEU, which a Hugging Face directory "
                       "does not carry; export it in fp32")
    return ExportInputs(directory / "config.json", directory, marian.model, {}, marian.tokenizer, {}, [],
                        defaults=marian.defaults, origin=marian.origin, source_state=marian.state)


def _load_checkpoint(options: ExportOptions) -> ExportInputs:
    checkpoint, run_dir = resolve_checkpoint(options.checkpoint)
    spm_path = run_dir / TOKENIZER_FILE
    if not spm_path.is_file():
        raise NmtError(f"tokenizer not found: {spm_path} (the run directory's {TOKENIZER_FILE} must sit beside "
                       f"the checkpoint)")
    model, payload = load_checkpoint(checkpoint)
    try:
        tokenizer = Tokenizer.load(run_dir)
    except Exception as error:
        raise NmtError(f"cannot load tokenizer {spm_path}: {error}") from error
    cfg = model.config
    if tokenizer.vocab_size != cfg.vocab_size:
        raise NmtError(f"tokenizer {spm_path} has {tokenizer.vocab_size} pieces but the model expects "
                       f"{cfg.vocab_size}: they come from different runs")
    summary: dict[str, Any] = {}
    if (run_dir / SUMMARY_FILE).is_file():
        try:
            summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        except json.JSONDecodeError as error:
            raise NmtError(f"cannot read {run_dir / SUMMARY_FILE}: {error}") from error
    pairs: list[tuple[str, str]] = []
    if (run_dir / TEST_SPLIT_FILE).is_file():
        pairs = [(p.source, p.target) for p in load_tsv(run_dir / TEST_SPLIT_FILE)]
    if options.reduced_precision and not pairs:
        raise NmtError(f"{options.reduced_precision} export scores held-out BLEU and needs "
                       f"{run_dir / TEST_SPLIT_FILE}")
    return ExportInputs(checkpoint, run_dir, model, payload, tokenizer, summary, pairs)


SOURCE_LOADERS = {"checkpoint": _load_checkpoint, "huggingface": _load_huggingface}  # keys: ExportOptions --from


def parity_pairs(inputs: ExportInputs, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out sentences as ids (sources end with EOS); random id strings if the run has no test.tsv."""
    cfg = inputs.config
    if inputs.pairs:
        chosen = inputs.pairs[:count]
        sources = [ids + [cfg.eos_id] for ids in inputs.tokenizer.encode_batch([s for s, _ in chosen])]
        targets = inputs.tokenizer.encode_batch([t for _, t in chosen])
        return sources, targets
    generator = torch.Generator().manual_seed(0)
    special = {cfg.pad_id, cfg.bos_id, cfg.eos_id, inputs.tokenizer.unk_id, *inputs.origin.get("suppressed_ids", []),
               *inputs.origin.get("languages", {}).values()}
    ordinary = torch.tensor([i for i in range(cfg.vocab_size) if i not in special])
    sources, targets = [], []
    for _ in range(count):
        length = int(torch.randint(3, 12, (1,), generator=generator))
        picks = ordinary[torch.randint(len(ordinary), (2, length), generator=generator)]
        sources.append(picks[0].tolist() + [cfg.eos_id])
        targets.append(picks[1].tolist())
    return sources, targets


def training_info(inputs: ExportInputs) -> dict[str, Any]:
    """What the manifest records of the run that trained the model."""
    summary, payload = inputs.summary, inputs.payload
    train_config = summary.get("train_config") or payload.get("train_config") or {}
    return {
        "corpus": summary.get("corpus", train_config.get("corpus")),
        "valid_bleu": summary.get("best_valid_bleu", payload.get("valid_bleu")),
        "test_bleu": summary.get("test_bleu"),
        "steps": summary.get("steps", payload.get("step")),
        "checkpoint_step": payload.get("step"),
    }
