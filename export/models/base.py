"""The interface every translation model implements, the config registry and checkpoint I/O.

Decoding (reference search, ONNX export, the serving engine) only talks to this interface:
``encode`` once, then ``decode_step`` one target token at a time with an incremental state that
``reorder_state`` rearranges when beams are pruned. States are flat ``dict[str, Tensor]`` whose
tensors all have the batch (or beam) on dimension 0, so reordering is generic.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nmt.errors import NmtError

EncoderOutput = dict[str, Tensor]
DecoderState = dict[str, Tensor]

# arch name -> (config class, model class); filled by the model modules on import.
REGISTRY: dict[str, tuple[type, type[Seq2SeqModel]]] = {}


def register(arch: str, config_cls: type):
    """Class decorator adding a model class and its config dataclass to the registry."""

    def wrap(model_cls: type[Seq2SeqModel]) -> type[Seq2SeqModel]:
        REGISTRY[arch] = (config_cls, model_cls)
        model_cls.arch = arch
        return model_cls

    return wrap


class Seq2SeqModel(nn.Module, ABC):
    """Encoder-decoder with incremental decoding.

    Shapes: ``B`` batch, ``S`` source length, ``T`` target length, ``V`` vocabulary.
    """

    arch: str
    config: Any

    @abstractmethod
    def encode(self, src: Tensor) -> EncoderOutput:
        """``src`` [B, S] int64 (padded with pad id) -> encoder output tensors (batch first)."""

    @abstractmethod
    def init_state(self, enc: EncoderOutput) -> DecoderState:
        """Decoder state before the first step (precomputes everything that depends on the source only)."""

    @abstractmethod
    def decode_step(
        self, tokens: Tensor, state: DecoderState, need_attention: bool = False
    ) -> tuple[Tensor, Tensor | None, DecoderState]:
        """One step: previous tokens [B] -> (logits [B, V], cross-attention [B, S] or None, new state)."""

    @abstractmethod
    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced decoding: ``src`` [B, S], ``tgt_in`` [B, T] -> logits [B, T, V]."""

    @staticmethod
    def reorder_state(state: DecoderState, index: Tensor) -> DecoderState:
        """Select/duplicate rows of every state tensor (beam pruning, batch shrinking)."""
        return {name: value.index_select(0, index) for name, value in state.items()}


def build_model(arch: str, **config: Any) -> Seq2SeqModel:
    """Instantiate a registered architecture from keyword config values."""
    import export.models.bahdanau  # noqa: F401  (registers)
    import export.models.transformer  # noqa: F401  (registers)

    if arch not in REGISTRY:
        raise NmtError(f"unknown architecture {arch!r}; choose one of: {', '.join(sorted(REGISTRY))}")
    config_cls, model_cls = REGISTRY[arch]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(config) - known
    if unknown:
        raise NmtError(f"unknown {arch} config fields: {', '.join(sorted(unknown))}")
    return model_cls(config_cls(**config))


def save_checkpoint(path: str | Path, model: Seq2SeqModel, **extra: Any) -> None:
    """Save config (as plain dict) + weights + JSON-like extras; loadable with ``weights_only=True``."""
    payload = {"arch": model.arch, "config": dataclasses.asdict(model.config), "model": model.state_dict()}
    payload.update(extra)
    tmp = Path(path).with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def load_checkpoint(path: str | Path) -> tuple[Seq2SeqModel, dict[str, Any]]:
    """Rebuild a model from a checkpoint; returns the model (eval mode) and the whole payload."""
    path = Path(path)
    if not path.is_file():
        raise NmtError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupted or not a checkpoint
        raise NmtError(f"cannot read checkpoint {path}: {error}") from error
    if not isinstance(payload, dict) or not {"arch", "config", "model"} <= payload.keys():
        raise NmtError(f"{path} is not an nmt checkpoint (needs arch, config and model entries)")
    model = build_model(payload["arch"], **payload["config"])
    model.load_state_dict(payload["model"])
    model.eval()
    return model, payload
