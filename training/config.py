"""The configuration of a training run: one dataclass whose fields document themselves and generate the
``nmt train`` flags (:mod:`common.options`). No torch here, so ``nmt train --help`` is fast."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.options import option
from training.data import DATES_SIZE

ARCHITECTURES = ("transformer", "bahdanau")
LR_SCHEDULES = ("inverse_sqrt", "cosine")


@dataclass
class TrainConfig:
    """Everything a run needs; saved as ``train_config`` inside checkpoints and in ``summary.json``."""

    arch: str = option(help="model family (required without --preset)", choices=ARCHITECTURES)
    corpus: str = option(help="dates | ding | FILE.tsv | SRC.txt,TGT.txt (required without --preset)")
    out: str = option(help="run directory", required=True)
    corpus_size: int = option(DATES_SIZE, "pairs to generate for the dates corpus", flag="--size")
    sentence_stops: float = option(0.0, "share of the dates corpus' dates in words that end with a full stop on "
                                   "both sides: a model that translates paragraphs sentence by sentence must have "
                                   "seen sentence ends (the demo presets: 0.25)")
    term_slots: float = option(0.0, "share of the training dates whose German month or weekday name is replaced by "
                               "a made-up word: a model that has seen such slots goes on with the date after a "
                               "glossary's term it would not have chosen (the dates presets: 0.1)")
    seed: int = option(0, "random seed (corpus generation, initialisation, batch order)")
    vocab_size: int = option(8000, "SentencePiece vocabulary, an upper bound")
    model: dict[str, Any] = field(default_factory=dict)  # architecture config overrides (the model flags)
    batch_tokens: int = option(4096, "padded tokens per batch", group="optimisation")
    lr: float | None = option(None, "peak (transformer) or constant (bahdanau) learning rate (default: 7e-4 for "
                              "the transformer, 1e-3 for bahdanau)", group="optimisation")
    warmup_steps: int = option(1000, "warmup steps (the transformer's, and either architecture's under cosine)",
                               flag="--warmup", group="optimisation")
    lr_schedule: str = option("inverse_sqrt", "inverse_sqrt: warmup then inverse square root decay (transformer), "
                              "constant (bahdanau); cosine: warmup then a cosine decay to zero at --steps",
                              choices=LR_SCHEDULES, group="optimisation")
    label_smoothing: float = option(0.1, "label smoothing of the cross-entropy", group="optimisation")
    clip_norm: float = option(1.0, "gradient norm clipping", group="optimisation")
    max_steps: int = option(100_000, "maximum optimisation steps", flag="--steps", group="optimisation")
    max_minutes: float | None = option(None, "stop after this much training time", group="optimisation")
    valid_every: int = option(500, "steps between validations", group="optimisation")
    valid_size: int = option(500, "validation sentences scored with BLEU", group="optimisation")
    patience: int | None = option(None, "stop after N validations without improvement", group="optimisation")
    target_bleu: float | None = option(None, "stop once validation BLEU reaches this", group="optimisation")
    resume: bool = option(False, "continue the run in --out from its last checkpoint")
    force: bool = option(False, "overwrite a run already in --out")
    progress: bool = option(True, "show a progress bar")
