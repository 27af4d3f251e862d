"""Training loop: corpus -> tokenizer -> model -> best checkpoint, with validation BLEU and curves.

A run directory holds ``spm.model`` (tokenizer), ``best.pt`` (best validation BLEU), ``last.pt``
(model + optimizer, for ``resume``), ``history.json``, ``curves.png`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from common.errors import NmtError
from common.model_format.layout import (
    BEST_CHECKPOINT,
    CURVES_FILE,
    HISTORY_FILE,
    LAST_CHECKPOINT,
    RUN_FILES,
    SUMMARY_FILE,
    TEST_SPLIT_FILE,
)
from common.model_format.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, train_tokenizer
from training.config import ARCHITECTURES, TrainConfig
from training.data import Pair, clean, load_corpus, split, with_term_slots, write_tsv
from training.models.checkpoint import build_model, load_checkpoint, save_checkpoint
from training.models.interface import Seq2SeqModel
from training.search import greedy_batch, max_target_length


@dataclass
class TrainResult:
    out: Path
    best_valid_bleu: float
    test_bleu: float
    steps: int
    seconds: float


def encode_pairs(tokenizer: Tokenizer, pairs: Sequence[Pair]) -> list[tuple[list[int], list[int]]]:
    sources = tokenizer.encode_batch([p.source for p in pairs])
    targets = tokenizer.encode_batch([p.target for p in pairs])
    return [(s + [EOS_ID], t) for s, t in zip(sources, targets, strict=True)]


def make_batches(
    examples: Sequence[tuple[list[int], list[int]]], max_tokens: int, rng: random.Random
) -> list[list[int]]:
    """Group example indices into batches of similar length whose padded size fits ``max_tokens``."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), len(examples[i][1]), rng.random()))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        length = max(len(examples[i][0]), len(examples[i][1]) + 1)
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def pad(rows: Sequence[list[int]]) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long)


def collate(examples: Sequence[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor, Tensor]:
    """-> src [B, S] (ends with EOS), decoder input [B, T] (starts with BOS), target [B, T] (ends with EOS)."""
    src = pad([s for s, _ in examples])
    tgt_in = pad([[BOS_ID] + t for _, t in examples])
    tgt_out = pad([t + [EOS_ID] for _, t in examples])
    return src, tgt_in, tgt_out


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def translate_greedy(model: Seq2SeqModel, tokenizer: Tokenizer, sources: Sequence[str], batch: int = 64) -> list[str]:
    """Batched greedy translation (validation and test scoring)."""
    outputs: list[str] = [""] * len(sources)
    encoded = [ids + [EOS_ID] for ids in tokenizer.encode_batch(list(sources))]
    order = sorted(range(len(sources)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        src = pad([encoded[i] for i in chunk])
        for i, ids in zip(chunk, greedy_batch(model, src, max_target_length(src.shape[1])), strict=True):
            outputs[i] = tokenizer.decode(ids)
    return outputs


def evaluate(model: Seq2SeqModel, tokenizer: Tokenizer, pairs: Sequence[Pair]) -> float:
    hypotheses = translate_greedy(model, tokenizer, [p.source for p in pairs])
    return bleu(hypotheses, [p.target for p in pairs])


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """The rate at ``step`` (from 1). ``inverse_sqrt``: the Transformer warms up linearly, then decays as the
    inverse square root; Bahdanau keeps a constant Adam rate. ``cosine`` (either architecture): linear warmup,
    then half a cosine down to zero at ``max_steps``, so the last steps settle the model that is kept."""
    peak = cfg.lr or (7e-4 if cfg.arch == "transformer" else 1e-3)
    step = max(step, 1)
    if cfg.lr_schedule == "cosine":
        if step <= cfg.warmup_steps:
            return peak * step / cfg.warmup_steps
        done = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
        return peak * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
    if cfg.arch != "transformer":
        return peak
    return peak * min(step / cfg.warmup_steps, math.sqrt(cfg.warmup_steps / step))


def prepare_run_dir(cfg: TrainConfig) -> Path:
    out = Path(cfg.out)
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if cfg.resume:
        if not (out / LAST_CHECKPOINT).exists():
            raise NmtError(f"cannot resume: {out / LAST_CHECKPOINT} does not exist")
    elif existing and not cfg.force:
        raise NmtError(f"{out} already holds a run ({', '.join(existing)}); use --force to overwrite or --resume")
    out.mkdir(parents=True, exist_ok=True)
    return out


def load_splits(cfg: TrainConfig) -> tuple[list[Pair], list[Pair], list[Pair]]:
    pairs = clean(load_corpus(cfg.corpus, size=cfg.corpus_size, seed=cfg.seed, stops=cfg.sentence_stops))
    splits = split(pairs)
    if not splits.train:
        raise NmtError(f"corpus {cfg.corpus!r} has no training pairs after cleaning")
    valid = splits.valid[: cfg.valid_size] or splits.train[: cfg.valid_size]
    test = splits.test or valid
    return with_term_slots(splits.train, cfg.term_slots, cfg.seed), valid, test


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Train one model as configured; returns where it went and how good it is."""
    if cfg.arch not in ARCHITECTURES:
        raise NmtError(f"unknown architecture {cfg.arch!r}; choose {' or '.join(ARCHITECTURES)}")
    out = prepare_run_dir(cfg)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    train_pairs, valid_pairs, test_pairs = load_splits(cfg)
    log(f"corpus {cfg.corpus}: {len(train_pairs)} train / {len(valid_pairs)} valid / {len(test_pairs)} test pairs")
    write_tsv(test_pairs, out / TEST_SPLIT_FILE)

    if cfg.resume:
        tokenizer = Tokenizer.load(out)
        last = torch.load(out / LAST_CHECKPOINT, map_location="cpu", weights_only=True)
        model = build_model(last["arch"], **last["config"])
        model.load_state_dict(last["model"])
    else:
        texts = [p.source for p in train_pairs] + [p.target for p in train_pairs]
        tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size)
        tokenizer.save(out)
        model = build_model(cfg.arch, vocab_size=tokenizer.vocab_size, **cfg.model)
        last = None
    examples = encode_pairs(tokenizer, train_pairs)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate(cfg, 1), betas=(0.9, 0.98), eps=1e-9)
    history: dict[str, list] = {"step": [], "loss": [], "valid_step": [], "valid_bleu": []}
    step, best_bleu, stale = 0, -1.0, 0
    if last is not None:
        optimizer.load_state_dict(last["optimizer"])
        step, best_bleu = int(last["step"]), float(last["best_valid_bleu"])
        history = json.loads((out / HISTORY_FILE).read_text())
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{cfg.arch}: {n_params / 1e6:.2f}M parameters, vocabulary {tokenizer.vocab_size}")

    train_config = dataclasses.asdict(cfg)
    start = time.monotonic()
    deadline = start + cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    # a run limited only by time has no meaningful step total: show the count, rate and minutes left instead
    time_only = cfg.max_minutes is not None and cfg.max_steps == TrainConfig.max_steps
    bar = tqdm(total=None if time_only else cfg.max_steps, initial=step, disable=not cfg.progress,
               unit="step", dynamic_ncols=True, desc=f"{cfg.arch} on {cfg.corpus}")
    window_tokens, window_start, running_loss = 0, time.monotonic(), None
    stop, stopped_by = False, "step budget"
    while not stop:
        for batch in make_batches(examples, cfg.batch_tokens, rng):
            model.train()
            src, tgt_in, tgt_out = collate([examples[i] for i in batch])
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(cfg, step + 1)
            logits = model(src, tgt_in)
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                tgt_out.reshape(-1),
                ignore_index=PAD_ID,
                label_smoothing=cfg.label_smoothing,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            optimizer.step()
            step += 1
            value = loss.item()
            running_loss = value if running_loss is None else 0.95 * running_loss + 0.05 * value
            window_tokens += int((tgt_out != PAD_ID).sum()) + int((src != PAD_ID).sum())
            history["step"].append(step)
            history["loss"].append(round(value, 4))
            bar.update(1)
            out_of_time = time.monotonic() >= deadline
            last_step = step >= cfg.max_steps or out_of_time
            if step % cfg.valid_every == 0 or last_step:
                valid_bleu = evaluate(model, tokenizer, valid_pairs)
                history["valid_step"].append(step)
                history["valid_bleu"].append(round(valid_bleu, 2))
                if valid_bleu > best_bleu:
                    best_bleu, stale = valid_bleu, 0
                    save_checkpoint(out / BEST_CHECKPOINT, model, step=step, valid_bleu=valid_bleu,
                                    train_config=train_config)
                else:
                    stale += 1
                save_checkpoint(
                    out / LAST_CHECKPOINT, model, step=step, best_valid_bleu=best_bleu,
                    optimizer=optimizer.state_dict(), train_config=train_config,
                )
                (out / HISTORY_FILE).write_text(json.dumps(history))
                reached = cfg.target_bleu is not None and valid_bleu >= cfg.target_bleu
                patience_over = cfg.patience is not None and stale >= cfg.patience
                last_step = last_step or reached or patience_over
                if reached or patience_over or (out_of_time and step < cfg.max_steps):
                    stopped_by = "target BLEU" if reached else "patience" if patience_over else "time cap"
            seconds = max(time.monotonic() - window_start, 1e-9)
            postfix = {"loss": f"{running_loss:.3f}", "tok_s": f"{window_tokens / seconds:,.0f}",
                       "bleu": f"{max(best_bleu, 0.0):.1f}"}
            if time_only:  # otherwise the bar's own estimate (steps left / rate) says it
                postfix["min_left"] = f"{max(0.0, deadline - time.monotonic()) / 60:.1f}"
            bar.set_postfix(postfix, refresh=False)
            if step % 50 == 0:
                window_tokens, window_start = 0, time.monotonic()
            if last_step:
                stop = True
                break
    bar.close()
    seconds = time.monotonic() - start
    if stopped_by == "time cap" and not time_only:
        log(f"warning: stopped by --max-minutes {cfg.max_minutes:g} at step {step} of {cfg.max_steps} (this machine "
            f"trains slower than the preset assumes); the best checkpoint so far is used: valid BLEU {best_bleu:.2f}")

    best_model, payload = load_checkpoint(out / BEST_CHECKPOINT)
    test_bleu = evaluate(best_model, tokenizer, test_pairs)
    summary = {
        "arch": cfg.arch, "corpus": cfg.corpus, "steps": step, "stopped_by": stopped_by,
        "train_seconds": round(seconds, 1),
        "best_step": payload["step"], "best_valid_bleu": round(best_bleu, 2), "test_bleu": round(test_bleu, 2),
        "train_pairs": len(train_pairs), "valid_pairs": len(valid_pairs), "test_pairs": len(test_pairs),
        "parameters": n_params, "vocab_size": tokenizer.vocab_size, "train_config": train_config,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    plot_curves(history, out / CURVES_FILE, title=f"{cfg.arch} on {cfg.corpus}")
    log(f"done: {step} steps in {seconds:.0f}s, best valid BLEU {best_bleu:.2f}, test BLEU {test_bleu:.2f} -> {out}")
    return TrainResult(out=out, best_valid_bleu=best_bleu, test_bleu=test_bleu, steps=step, seconds=seconds)


def plot_curves(history: dict[str, list], path: Path, title: str) -> None:
    """Training loss (smoothed) and validation BLEU against steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, loss_axis = plt.subplots(figsize=(8, 4.5))
    steps, losses = history["step"], history["loss"]
    if losses:
        window = max(1, len(losses) // 100)
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                  for i in range(len(losses))]
        loss_axis.plot(steps, smooth, color="tab:blue", label="training loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss (label-smoothed cross-entropy)", color="tab:blue")
    bleu_axis = loss_axis.twinx()
    bleu_axis.plot(history["valid_step"], history["valid_bleu"], "o-", color="tab:orange", label="valid BLEU")
    bleu_axis.set_ylabel("validation BLEU", color="tab:orange")
    bleu_axis.set_ylim(0, 100)
    loss_axis.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
