"""``nmt train``: train a Transformer or Bahdanau translator on a corpus.

The flags come from :class:`training.config.TrainConfig` (standard library only); torch loads when the
command runs. A ``--preset`` supplies values that the flags given on the command line override.
"""

from __future__ import annotations

import argparse
from typing import Any

from common.errors import NmtError
from common.options import add_arguments, values_from_args
from training.config import TrainConfig
from training.presets import PRESETS

# model dimension flag -> (architecture it applies to, model config field)
MODEL_FLAGS: dict[str, tuple[str, str]] = {
    "d_model": ("transformer", "d_model"),
    "layers": ("transformer", "encoder_layers"),
    "heads": ("transformer", "heads"),
    "ffn_dim": ("transformer", "ffn_dim"),
    "embed_dim": ("bahdanau", "embed_dim"),
    "hidden": ("bahdanau", "encoder_hidden"),
    "score": ("bahdanau", "score"),
    "dropout": ("*", "dropout"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``train`` subcommand."""
    p = subparsers.add_parser(
        "train",
        help="train a translation model",
        description="Train a Transformer or Bahdanau (BiGRU + additive attention) translator. The run "
        "directory receives spm.model, best.pt, last.pt, history.json, curves.png, summary.json and test.tsv.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named recipe (training/presets.py); "
                   "other flags override its values")
    add_arguments(TrainConfig, p, only_given=True)
    model = p.add_argument_group("model dimensions (defaults: the architecture's config)")
    model.add_argument("--d-model", type=int, help="transformer width")
    model.add_argument("--layers", type=int, help="transformer encoder and decoder layers")
    model.add_argument("--heads", type=int, help="transformer attention heads")
    model.add_argument("--ffn-dim", type=int, help="transformer feed-forward width")
    model.add_argument("--embed-dim", type=int, help="bahdanau embedding size")
    model.add_argument("--hidden", type=int, help="bahdanau encoder GRU size per direction (decoder: twice)")
    model.add_argument("--score", choices=["additive", "general", "dot"], help="bahdanau attention score")
    model.add_argument("--dropout", type=float, help="dropout rate")
    p.set_defaults(func=run)


def model_overrides(args: argparse.Namespace, target_arch: str) -> dict[str, Any]:
    """Collect the model dimension flags that were given; each must apply to ``target_arch``."""
    overrides: dict[str, Any] = {}
    for flag, (arch, field) in MODEL_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if arch not in ("*", target_arch):
            raise NmtError(f"--{flag.replace('_', '-')} applies to {arch} models only")
        overrides[field] = value
    if "encoder_layers" in overrides:
        overrides["decoder_layers"] = overrides["encoder_layers"]
    if "encoder_hidden" in overrides:
        overrides["decoder_hidden"] = 2 * overrides["encoder_hidden"]
    return overrides


def run(args: argparse.Namespace) -> int:
    try:
        from training.train import train
    except ImportError as error:
        raise NmtError(f"training needs the train extra ({error}); run: pip install -e '.[train]'") from error

    settings: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    settings.update(values_from_args(TrainConfig, args))
    if "arch" not in settings or "corpus" not in settings:
        raise NmtError("give --arch and --corpus, or a --preset")
    settings["model"] = {**settings.get("model", {}), **model_overrides(args, settings["arch"])}
    train(TrainConfig(**settings))
    return 0
