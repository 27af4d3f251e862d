"""Architectures by name, building a model from its config, and checkpoint I/O.

A checkpoint holds the architecture name, its config as a plain dict and the weights (plus JSON-like
extras such as the training step), so it loads with ``torch.load(weights_only=True)`` and the model
is rebuilt from the config alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from common.errors import NmtError
from training.models.bahdanau import Bahdanau, BahdanauConfig
from training.models.interface import Seq2SeqModel
from training.models.transformer import Transformer, TransformerConfig

# architecture name -> (config dataclass, model class)
ARCHITECTURES: dict[str, tuple[type, type[Seq2SeqModel]]] = {
    Transformer.arch: (TransformerConfig, Transformer),
    Bahdanau.arch: (BahdanauConfig, Bahdanau),
}


def build_model(arch: str, **config: Any) -> Seq2SeqModel:
    """Instantiate an architecture from keyword config values."""
    if arch not in ARCHITECTURES:
        raise NmtError(f"unknown architecture {arch!r}; choose one of: {', '.join(sorted(ARCHITECTURES))}")
    config_cls, model_cls = ARCHITECTURES[arch]
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
