"""Verification of a written model version: the serving engine against the PyTorch reference.

The version is loaded exactly as ``nmt serve`` loads it (:class:`server.engine.engine.Engine`), so the check
covers the graphs, the in-graph top-k, the manifest's I/O description and the engine's batched search:

* teacher-forced steps over held-out targets (the whole batch at once, so padding is exercised)
  compare every log-probability (``decoder.onnx``, read through its top-k with k = vocabulary) and the
  attention (``decoder_attention.onnx``) with PyTorch's at every real position;
* ``decoder_forced.onnx`` (where the version has it) runs the same teacher-forced targets in one call:
  its per-position log-probabilities, last distribution, attention and K/V cache (as the step decoder
  receives it: the in-place buffers' first positions, each row's position at the pass's length) are
  compared with PyTorch's step-wise ones at every position (padding included: both feed the same padded
  rows), and one step of the step decoder resumed from that cache with PyTorch's next step;
* with the in-place KV cache (rows may decode at different positions), the same targets once more with
  row ``i`` starting ``i % 3`` steps late, so one step mixes positions; every row's log-probabilities
  are compared with PyTorch's at its own position (within the same tolerance);
* greedy and beam search run one sentence at a time through the engine and the reference search
  (:mod:`training.search`) and must produce the same tokens.

Log-probabilities are compared relative to their magnitude beyond 1 (:func:`log_prob_diff`:
``|onnx - torch| / max(1, |torch|)``): near the top of the distribution, where the search chooses, that
is the absolute difference; far down it allows float32's own rounding. A confident model puts most of a
large vocabulary at log-probabilities of -1,000 and below, where one float32 step is already 1e-4, so an
absolute tolerance refused correct exports of it. Attention and the cache are compared absolutely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from export.options import LOGIT_TOLERANCE
from nmt.model_format.layout import FORCED_GRAPH
from server.engine.engine import Engine
from server.types import DecodingOptions, ScoredSequence, SentenceRequest
from training.models.interface import Seq2SeqModel
from training.search import translate_ids


@dataclass
class ParityReport:
    max_logit_diff: float
    max_attention_diff: float
    max_attention_row_error: float  # max |row sum - 1| of decoder_attention's output
    greedy_match: tuple[int, int]
    beam4_match: tuple[int, int]
    sentences: int
    teacher_forced_steps: int
    mismatches: list[str] = field(default_factory=list)
    max_forced_diff: float | None = None  # decoder_forced vs PyTorch (log-probs, attention, K/V); None: no such graph

    def ok(self, tolerance: float = LOGIT_TOLERANCE) -> bool:
        return (
            self.max_logit_diff <= tolerance
            and (self.max_forced_diff is None or self.max_forced_diff <= tolerance)
            and self.max_attention_diff <= tolerance
            and self.greedy_match[0] == self.greedy_match[1]
            and self.beam4_match[0] == self.beam4_match[1]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_logit_diff": float(f"{self.max_logit_diff:.3g}"),
            "max_attention_diff": float(f"{self.max_attention_diff:.3g}"),
            "max_attention_row_error": float(f"{self.max_attention_row_error:.3g}"),
            "greedy_match": f"{self.greedy_match[0]}/{self.greedy_match[1]}",
            "beam4_match": f"{self.beam4_match[0]}/{self.beam4_match[1]}",
            "sentences": self.sentences,
            "teacher_forced_steps": self.teacher_forced_steps,
            "tolerance": LOGIT_TOLERANCE,
        } | ({} if self.max_forced_diff is None else {"max_forced_diff": float(f"{self.max_forced_diff:.3g}")})


def engine_translate_ids(
    engine: Engine,
    source_ids: Sequence[int],
    *,
    beam_size: int = 1,
    num_hypotheses: int = 1,
    max_length: int = 256,
    length_penalty: float = 1.0,
    need_attention: bool = False,
) -> list[ScoredSequence]:
    """The serving engine's twin of :func:`training.search.translate_ids`: one source sentence (ids
    ending with EOS) -> its hypotheses as token ids (EOS included), scores and attention."""
    options = DecodingOptions(beam_size=beam_size, num_hypotheses=num_hypotheses, max_length=max_length,
                              length_penalty=length_penalty, return_attention=need_attention)
    ids = list(source_ids)
    [result] = engine.search([SentenceRequest(ids[:-1] if ids[-1:] == [engine.eos_id] else ids, options)])
    return result.hypotheses


def engine_step_log_probs(engine: Engine, tokens: np.ndarray, static: dict[str, Any], state: dict[str, Any],
                          need_attention: bool, positions: np.ndarray | None = None,
                          ) -> tuple[np.ndarray, np.ndarray | None, dict[str, Any]]:
    """One decoding step through the engine's step model, with the whole distribution rebuilt from its
    top-k (k = vocabulary): (log-probabilities [R, V], attention [R, S] or None, next state)."""
    vocab = engine.manifest.vocab_size
    out = engine.model.step(tokens, static, state, need_attention, vocab, positions=positions)
    log_probs = np.full((len(tokens), vocab), -np.inf, dtype=np.float32)
    np.put_along_axis(log_probs, out.top_ids, out.top_log_probs, axis=1)
    return log_probs, out.attention, out.state


@torch.no_grad()
def check_parity(
    model: Seq2SeqModel,
    engine: Engine,
    sources: Sequence[list[int]],
    targets: Sequence[list[int]],
    *,
    beam_size: int = 4,
    max_target_steps: int = 64,
) -> ParityReport:
    """Compare the serving engine with PyTorch on ``sources`` (ids ending with EOS); see the module docstring."""
    model.eval()
    cfg = model.config
    src = pad_rows(sources, cfg.pad_id)
    tgt_in = [[cfg.decoder_start_id] + list(target)[: max_target_steps - 1] for target in targets]
    lengths = np.array([len(row) for row in tgt_in])
    tgt = pad_rows(tgt_in, cfg.pad_id)
    tgt_next = pad_rows([(list(target) + [cfg.eos_id])[: len(row)]
                         for target, row in zip(targets, tgt_in, strict=True)], cfg.pad_id)
    torch_scores, torch_attention = [], []
    torch_state = model.init_state(model.encode(torch.from_numpy(src)))
    encoded = engine.model.encode(src)
    static = {name: encoded[name] for name in engine.model.static_names}
    state = {name: encoded[name] for name in engine.model.state_names}
    max_logit = max_attention = max_row_error = 0.0
    steps = 0
    reference: list[np.ndarray] = []  # PyTorch's log-probabilities [B, V] at each target position
    for t in range(tgt.shape[1]):
        rows = lengths > t
        tokens = np.ascontiguousarray(tgt[:, t])
        logits, attention, torch_state = model.decode_step(torch.from_numpy(tokens), torch_state, need_attention=True)
        log_probs = logits.float().log_softmax(-1).numpy()
        torch_scores.append(np.take_along_axis(log_probs, tgt_next[:, t : t + 1], 1)[:, 0])
        torch_attention.append(attention.numpy())
        reference.append(log_probs)
        onnx_log_probs, _, next_state = engine_step_log_probs(engine, tokens, static, state, need_attention=False)
        _, onnx_attention, _ = engine_step_log_probs(engine, tokens, static, state, need_attention=True)
        state = next_state
        max_logit = max(max_logit, float(log_prob_diff(onnx_log_probs, log_probs)[rows].max()))
        max_attention = max(max_attention, float(np.abs(onnx_attention - attention.numpy())[rows].max()))
        max_row_error = max(max_row_error, float(np.abs(onnx_attention[rows].sum(-1) - 1).max()))
        steps += int(rows.sum())
    forced_diff = None
    if FORCED_GRAPH in engine.model.sessions:
        forced_diff = forced_pass_diff(engine, model, encoded, tgt, tgt_next, lengths, torch_state,
                                       (np.stack(torch_scores, 1), reference[-1], np.stack(torch_attention, 1)))
    if engine.model.positions:  # the in-place cache (a recurrent state cannot repeat a step: it advances)
        max_logit = max(max_logit, staggered_log_prob_diff(engine, src, tgt, lengths, reference))

    greedy = beam = 0
    mismatches: list[str] = []
    for index, source in enumerate(sources):
        for size in (1, beam_size):
            reference = translate_ids(model, list(source), beam_size=size)[0].tokens
            candidate = engine_translate_ids(engine, source, beam_size=size)[0].tokens
            if reference == candidate:
                greedy += size == 1
                beam += size != 1
            else:
                mismatches.append(f"sentence {index}, beam {size}: torch {reference} vs onnx {candidate}")
    return ParityReport(
        max_logit_diff=max_logit, max_attention_diff=max_attention, max_attention_row_error=max_row_error,
        greedy_match=(greedy, len(sources)), beam4_match=(beam, len(sources)), sentences=len(sources),
        teacher_forced_steps=steps, mismatches=mismatches, max_forced_diff=forced_diff,
    )


def forced_pass_diff(engine: Engine, model: Seq2SeqModel, encoded: dict[str, Any], tgt: np.ndarray,
                     tgt_next: np.ndarray, lengths: np.ndarray, torch_state: dict[str, Any],
                     expected: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
    """Max difference (log-probabilities by :func:`log_prob_diff`, the rest absolute) of ``decoder_forced`` over
    the teacher-forced batch from PyTorch's step-wise
    ``expected`` (target log-probabilities [B, T], last distribution [B, V], attention [B, T, S]) and
    ``torch_state`` (the K/V after the T positions; PyTorch's state advances one step more here), as the
    engine hands the pass's cache to the step decoder (:meth:`OnnxStepModel.state_from_forced`: the
    buffers' first T positions, each row's position T); then one step of the step decoder resumed from
    that state against PyTorch's next step, on the rows whose targets fill the T positions."""
    static = {name: encoded[name] for name in engine.model.static_names}
    initial = {name: encoded[name] for name in engine.model.state_names}
    step_model, length = engine.model, tgt.shape[1]
    out = step_model.force(tgt, tgt_next, static, initial, need_attention=True)
    scores, last, attention = expected
    diffs = [log_prob_diff(out.target_log_probs, scores).max(), log_prob_diff(out.last_log_probs, last).max(),
             np.abs(out.attention - attention).max()]
    for entry in step_model.state:
        value = np.asarray(out.state[entry.input], dtype=np.float32)
        if entry.capacity_axis is not None:
            value = value[(slice(None),) * entry.capacity_axis + (slice(0, length),)]
        torch_name = "self_" + entry.input.removeprefix("past_").replace("_", ".")
        diffs.append(np.abs(value - torch_state[torch_name].numpy()).max())
    if step_model.positions:
        if not (out.state[step_model.positions] == length).all():
            return float("inf")
        tokens = np.ascontiguousarray(tgt_next[:, -1])
        log_probs, _, _ = engine_step_log_probs(engine, tokens, static, out.state, need_attention=False)
        logits, _, _ = model.decode_step(torch.from_numpy(tokens), torch_state, need_attention=False)
        rows = lengths == length
        diffs.append(log_prob_diff(log_probs, logits.float().log_softmax(-1).numpy())[rows].max())
    return float(max(diffs))


def log_prob_diff(candidate: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Elementwise ``|candidate - reference| / max(1, |reference|)`` of log-probabilities (module docstring)."""
    return np.abs(candidate - reference) / np.maximum(1.0, np.abs(reference))


def staggered_log_prob_diff(engine: Engine, src: np.ndarray, tgt: np.ndarray, lengths: np.ndarray,
                            reference: list[np.ndarray]) -> float:
    """Max :func:`log_prob_diff` from PyTorch's ``reference`` when row ``i`` of the teacher-forced batch
    starts ``i % 3`` steps late: until it starts, and after its last target, a row repeats an input
    (same token, same position), which rewrites the same cache entry."""
    encoded = engine.model.encode(src)
    static = {name: encoded[name] for name in engine.model.static_names}
    state = {name: encoded[name] for name in engine.model.state_names}
    delays = np.arange(len(src)) % 3
    worst = 0.0
    for t in range(tgt.shape[1] + int(delays.max())):
        positions = np.clip(t - delays, 0, tgt.shape[1] - 1)
        tokens = np.ascontiguousarray(tgt[np.arange(len(src)), positions])
        log_probs, _, state = engine_step_log_probs(engine, tokens, static, state, False, positions=positions)
        expected = np.stack([reference[p][i] for i, p in enumerate(positions)])
        rows = positions < lengths
        worst = max(worst, float(log_prob_diff(log_probs, expected)[rows].max()))
    return worst


def greedy_texts(engine: Engine, texts: Sequence[str], batch_size: int = 32) -> list[str]:
    """Greedy translations of ``texts`` by the serving engine, in batches of similar length."""
    outputs = [""] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    options = DecodingOptions(beam_size=1)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        for i, translation in zip(chunk, engine.translate([texts[i] for i in chunk], options), strict=True):
            outputs[i] = translation.hypotheses[0].text if translation.hypotheses else ""
    return outputs


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
    width = max(len(row) for row in rows)
    array = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array
