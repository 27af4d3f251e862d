"""``nmt train``: train a Transformer or Bahdanau translator on a corpus."""

from __future__ import annotations

import argparse
from typing import Any

from nmt.errors import NmtError
from training.presets import PRESETS

# flag -> (architecture it applies to, model config field)
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
    p = subparsers.add_parser(
        "train",
        help="train a translation model",
        description="Train a Transformer or Bahdanau (BiGRU + additive attention) translator. The run "
        "directory receives spm.model, best.pt, last.pt, history.json, curves.png and summary.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named recipe (training/presets.py); "
                   "other flags override its values")
    p.add_argument("--arch", choices=["transformer", "bahdanau"], help="model family (required without --preset)")
    p.add_argument("--corpus", help="dates | ding | FILE.tsv | SRC.txt,TGT.txt (required without --preset)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--size", type=int, default=30000, help="pairs to generate for the dates corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, help="SentencePiece vocabulary, an upper bound (default 8000)")
    model = p.add_argument_group("model dimensions (defaults: the architecture's config)")
    model.add_argument("--d-model", type=int, help="transformer width")
    model.add_argument("--layers", type=int, help="transformer encoder and decoder layers")
    model.add_argument("--heads", type=int, help="transformer attention heads")
    model.add_argument("--ffn-dim", type=int, help="transformer feed-forward width")
    model.add_argument("--embed-dim", type=int, help="bahdanau embedding size")
    model.add_argument("--hidden", type=int, help="bahdanau encoder GRU size per direction (decoder: twice)")
    model.add_argument("--score", choices=["additive", "general", "dot"], help="bahdanau attention score")
    model.add_argument("--dropout", type=float)
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--batch-tokens", type=int, help="padded tokens per batch (default 4096)")
    opt.add_argument("--lr", type=float, help="peak (transformer) or constant (bahdanau) learning rate")
    opt.add_argument("--warmup", type=int, help="transformer warmup steps (default 1000)")
    opt.add_argument("--label-smoothing", type=float, default=0.1)
    opt.add_argument("--steps", type=int, help="maximum optimisation steps (default 100000)")
    opt.add_argument("--max-minutes", type=float, help="stop after this much training time")
    opt.add_argument("--valid-every", type=int, help="steps between validations (default 500)")
    opt.add_argument("--patience", type=int, help="stop after N validations without improvement")
    opt.add_argument("--target-bleu", type=float, help="stop once validation BLEU reaches this")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from last.pt")
    p.add_argument("--force", action="store_true", help="overwrite a run already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
        from training.train import TrainConfig, train
    except ImportError as error:
        raise NmtError(f"training needs the train extra ({error}); run: pip install -e '.[train]'") from error

    settings: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    given = {
        "arch": args.arch, "corpus": args.corpus, "vocab_size": args.vocab_size, "batch_tokens": args.batch_tokens,
        "lr": args.lr, "warmup_steps": args.warmup, "max_steps": args.steps, "max_minutes": args.max_minutes,
        "valid_every": args.valid_every, "patience": args.patience, "target_bleu": args.target_bleu,
    }
    settings.update({key: value for key, value in given.items() if value is not None})
    if "arch" not in settings or "corpus" not in settings:
        raise NmtError("give --arch and --corpus, or a --preset")
    settings["model"] = {**settings.get("model", {}), **model_overrides(args, settings["arch"])}
    cfg = TrainConfig(
        **settings, out=args.out, corpus_size=args.size, seed=args.seed, label_smoothing=args.label_smoothing,
        resume=args.resume, force=args.force, progress=not args.no_progress,
    )
    train(cfg)
    return 0
