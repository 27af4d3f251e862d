"""Verification of a written model version: the serving engine against the PyTorch reference.

PyTorch's side is computed first (:func:`torch_reference`), so that the export frees the model before it
loads a version. The version is loaded exactly as ``nmt serve`` loads it (:class:`server.engine.engine.Engine`),
so the check (:func:`check_parity`) covers the graphs, the in-graph top-k, the manifest's I/O description and
the engine's batched search:

* teacher-forced steps over held-out targets (the whole batch at once, so padding is exercised)
  compare every log-probability (``decoder.onnx``, read through its top-k with k = vocabulary) and the
  attention (``decoder_attention.onnx``) with PyTorch's at every real position;
* ``decoder_forced.onnx`` (where the version has it) runs the same teacher-forced targets, all positions of
  a chunk of rows in one call:
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

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from common.model_format.layout import FORCED_GRAPH
from export.options import LOGIT_TOLERANCE
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


DISTRIBUTIONS_FILE, ARRAYS_FILE, LISTS_FILE = "distributions.f32", "reference.npz", "reference.json"  # save()
STATE_PREFIX = "state."  # the K/V arrays' names in ARRAYS_FILE


@dataclass
class TorchReference:
    """PyTorch's side of :func:`check_parity`, computed once by :func:`torch_reference` so that the model can be
    freed before any version is loaded (the export never holds both: each is the size of the checkpoint) and
    checked against the fp32 and the reduced-precision version alike.

    The log-probabilities of every teacher-forced position (``[T, B, V]`` float32) wait in an unnamed
    temporary file, not in memory: 20 sentences of 64 positions over a 58k vocabulary are 300 MB."""

    sources: list[list[int]]  # ids ending with EOS
    src: np.ndarray  # int64 [B, S] the same, padded
    tgt: np.ndarray  # int64 [B, T] the decoder's inputs (the decoder start, then the target), padded
    tgt_next: np.ndarray  # int64 [B, T] the token each position predicts
    lengths: np.ndarray  # [B] each row's real positions
    scores: np.ndarray  # [B, T] the log-probability of ``tgt_next`` at each position
    attention: np.ndarray  # [B, T, S] the alignment attention at each position
    state: dict[str, np.ndarray]  # the self-attention K/V after the T positions ("self_key.0"...; none: an RNN)
    next_log_probs: np.ndarray  # [B, V] one step more, fed ``tgt_next[:, -1]``
    searches: dict[int, list[list[int]]]  # beam size -> each sentence's best hypothesis (tokens)
    distributions: BinaryIO  # float32 [T, B, V]: every position's log-probabilities (see above)
    vocab: int

    def log_probs(self, positions: np.ndarray) -> np.ndarray:
        """[B, V]: row ``i``'s log-probabilities at its position ``positions[i]``."""
        rows, row_bytes = len(positions), self.vocab * 4
        if (positions == positions[0]).all():  # one position: one contiguous read
            raw = os.pread(self.distributions.fileno(), rows * row_bytes, int(positions[0]) * rows * row_bytes)
        else:
            raw = b"".join(os.pread(self.distributions.fileno(), row_bytes, (int(p) * rows + i) * row_bytes)
                           for i, p in enumerate(positions))
        return np.frombuffer(raw, dtype=np.float32).reshape(rows, self.vocab)

    def save(self, directory: str | Path) -> None:
        """Keep this reference in ``directory`` for :meth:`load` (another process checks parity): its arrays and
        its token lists beside the distributions, which :func:`torch_reference` spilled there."""
        directory = Path(directory)
        np.savez(directory / ARRAYS_FILE, src=self.src, tgt=self.tgt, tgt_next=self.tgt_next, lengths=self.lengths,
                 scores=self.scores, attention=self.attention, next_log_probs=self.next_log_probs,
                 **{STATE_PREFIX + name: value for name, value in self.state.items()})
        lists = {"sources": self.sources, "vocab": self.vocab,
                 "searches": {str(size): hypotheses for size, hypotheses in self.searches.items()}}
        (directory / LISTS_FILE).write_text(json.dumps(lists))

    @classmethod
    def load(cls, directory: str | Path) -> TorchReference:
        """The reference :meth:`save` kept in ``directory``."""
        directory = Path(directory)
        lists = json.loads((directory / LISTS_FILE).read_text())
        with np.load(directory / ARRAYS_FILE) as arrays:
            values = {name: arrays[name] for name in arrays.files}
        state = {name.removeprefix(STATE_PREFIX): values.pop(name) for name in list(values)
                 if name.startswith(STATE_PREFIX)}
        return cls(sources=lists["sources"], state=state, vocab=lists["vocab"],
                   searches={int(size): hypotheses for size, hypotheses in lists["searches"].items()},
                   distributions=(directory / DISTRIBUTIONS_FILE).open("rb"), **values)

    def close(self) -> None:
        self.distributions.close()

    def __enter__(self) -> TorchReference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@torch.no_grad()
def torch_reference(model: Seq2SeqModel, sources: Sequence[list[int]], targets: Sequence[list[int]], *,
                    beam_size: int = 4, max_target_steps: int = 64, directory: str | Path | None = None,
                    ) -> TorchReference:
    """PyTorch's outputs on ``sources`` (ids ending with EOS) and ``targets`` that :func:`check_parity` compares
    a version with; the spilled distributions go to ``directory``'s :data:`DISTRIBUTIONS_FILE` (without one:
    to an unnamed file in the system's temporary directory)."""
    model.eval()
    cfg = model.config
    src = pad_rows(sources, cfg.pad_id)
    tgt_in = [[cfg.decoder_start_id] + list(target)[: max_target_steps - 1] for target in targets]
    tgt = pad_rows(tgt_in, cfg.pad_id)
    tgt_next = pad_rows([(list(target) + [cfg.eos_id])[: len(row)]
                         for target, row in zip(targets, tgt_in, strict=True)], cfg.pad_id)
    distributions = (Path(directory, DISTRIBUTIONS_FILE).open("w+b") if directory is not None  # noqa: SIM115
                     else tempfile.TemporaryFile())  # noqa: SIM115 - both closed by TorchReference.close
    scores, attentions = [], []
    state = model.init_state(model.encode(torch.from_numpy(src)))
    for t in range(tgt.shape[1]):
        logits, attention, state = model.decode_step(torch.from_numpy(tgt[:, t]), state, need_attention=True)
        log_probs = logits.float().log_softmax(-1).numpy()
        scores.append(np.take_along_axis(log_probs, tgt_next[:, t : t + 1], 1)[:, 0])
        attentions.append(attention.numpy())
        distributions.write(np.ascontiguousarray(log_probs, dtype=np.float32).tobytes())
    distributions.flush()
    kv = {name: value.numpy().copy() for name, value in state.items() if name.startswith("self_")}
    logits, _, _ = model.decode_step(torch.from_numpy(tgt_next[:, -1]), state, need_attention=False)
    searches = {size: [translate_ids(model, list(source), beam_size=size)[0].tokens for source in sources]
                for size in (1, beam_size)}
    return TorchReference(sources=[list(source) for source in sources], src=src, tgt=tgt, tgt_next=tgt_next,
                          lengths=np.array([len(row) for row in tgt_in]), scores=np.stack(scores, 1),
                          attention=np.stack(attentions, 1), state=kv,
                          next_log_probs=logits.float().log_softmax(-1).numpy(), searches=searches,
                          distributions=distributions, vocab=cfg.vocab_size)


def check_parity(reference: TorchReference, engine: Engine) -> ParityReport:
    """Compare the serving engine with PyTorch's ``reference`` (see the module docstring)."""
    src, tgt, lengths = reference.src, reference.tgt, reference.lengths
    encoded = engine.model.encode(src)
    static = {name: encoded[name] for name in engine.model.static_names}
    state = {name: encoded[name] for name in engine.model.state_names}
    max_logit = max_attention = max_row_error = 0.0
    steps = 0
    for t in range(tgt.shape[1]):
        rows = lengths > t
        tokens = np.ascontiguousarray(tgt[:, t])
        expected = reference.log_probs(np.full(len(tgt), t))
        onnx_log_probs, _, next_state = engine_step_log_probs(engine, tokens, static, state, need_attention=False)
        _, onnx_attention, _ = engine_step_log_probs(engine, tokens, static, state, need_attention=True)
        state = next_state
        max_logit = max(max_logit, float(log_prob_diff(onnx_log_probs, expected)[rows].max()))
        max_attention = max(max_attention, float(np.abs(onnx_attention - reference.attention[:, t])[rows].max()))
        max_row_error = max(max_row_error, float(np.abs(onnx_attention[rows].sum(-1) - 1).max()))
        steps += int(rows.sum())
    forced_diff = forced_pass_diff(engine, reference, encoded) if FORCED_GRAPH in engine.model.sessions else None
    if engine.model.positions:  # the in-place cache (a recurrent state cannot repeat a step: it advances)
        max_logit = max(max_logit, staggered_log_prob_diff(engine, reference))

    matches = dict.fromkeys(reference.searches, 0)
    mismatches: list[str] = []
    for index, source in enumerate(reference.sources):
        for size, expected_tokens in reference.searches.items():
            candidate = engine_translate_ids(engine, source, beam_size=size)[0].tokens
            if candidate == expected_tokens[index]:
                matches[size] += 1
            else:
                mismatches.append(f"sentence {index}, beam {size}: torch {expected_tokens[index]} vs onnx {candidate}")
    greedy_size, beam_size = min(matches), max(matches)
    return ParityReport(
        max_logit_diff=max_logit, max_attention_diff=max_attention, max_attention_row_error=max_row_error,
        greedy_match=(matches[greedy_size], len(src)), beam4_match=(matches[beam_size], len(src)),
        sentences=len(src), teacher_forced_steps=steps, mismatches=mismatches, max_forced_diff=forced_diff,
    )


FORCED_CHUNK_BYTES = 8 << 20  # the forced pass runs over as many rows as keep its [rows, T, V] output this small


def forced_pass_diff(engine: Engine, reference: TorchReference, encoded: dict[str, Any]) -> float:
    """Max difference (log-probabilities by :func:`log_prob_diff`, the rest absolute) of ``decoder_forced`` over
    the teacher-forced targets from PyTorch's step-wise ``reference``, in chunks of rows (padding included
    where the rows' lengths differ), and of the cache as the engine hands it to the step decoder
    (:meth:`OnnxStepModel.state_from_forced`: the buffers' first T positions, each row's position T); then
    one step of the step decoder resumed from that state against PyTorch's next step, on the rows whose
    targets fill the T positions."""
    step_model, (batch, length) = engine.model, reference.tgt.shape
    last = reference.log_probs(np.full(batch, length - 1))
    chunk = max(1, FORCED_CHUNK_BYTES // (length * reference.vocab * 4))
    diffs = []
    for start in range(0, batch, chunk):
        rows = slice(start, start + chunk)
        static = {name: encoded[name][rows] for name in step_model.static_names}
        initial = {name: encoded[name][rows] for name in step_model.state_names}
        out = step_model.force(reference.tgt[rows], reference.tgt_next[rows], static, initial, need_attention=True)
        diffs += [log_prob_diff(out.target_log_probs, reference.scores[rows]).max(),
                  log_prob_diff(out.last_log_probs, last[rows]).max(),
                  np.abs(out.attention - reference.attention[rows]).max()]
        for entry in step_model.state:
            value = np.asarray(out.state[entry.input], dtype=np.float32)
            if entry.capacity_axis is not None:
                value = value[(slice(None),) * entry.capacity_axis + (slice(0, length),)]
            torch_name = "self_" + entry.input.removeprefix("past_").replace("_", ".")
            diffs.append(np.abs(value - reference.state[torch_name][rows]).max())
        if step_model.positions:
            if not (out.state[step_model.positions] == length).all():
                return float("inf")
            tokens = np.ascontiguousarray(reference.tgt_next[rows, -1])
            log_probs, _, _ = engine_step_log_probs(engine, tokens, static, out.state, need_attention=False)
            full = reference.lengths[rows] == length
            if full.any():
                diffs.append(log_prob_diff(log_probs, reference.next_log_probs[rows])[full].max())
    return float(max(diffs))


def log_prob_diff(candidate: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Elementwise ``|candidate - reference| / max(1, |reference|)`` of log-probabilities (module docstring)."""
    return np.abs(candidate - reference) / np.maximum(1.0, np.abs(reference))


def staggered_log_prob_diff(engine: Engine, reference: TorchReference) -> float:
    """Max :func:`log_prob_diff` from PyTorch's ``reference`` when row ``i`` of the teacher-forced batch
    starts ``i % 3`` steps late: until it starts, and after its last target, a row repeats an input
    (same token, same position), which rewrites the same cache entry."""
    src, tgt, lengths = reference.src, reference.tgt, reference.lengths
    encoded = engine.model.encode(src)
    static = {name: encoded[name] for name in engine.model.static_names}
    state = {name: encoded[name] for name in engine.model.state_names}
    delays = np.arange(len(src)) % 3
    worst = 0.0
    for t in range(tgt.shape[1] + int(delays.max())):
        positions = np.clip(t - delays, 0, tgt.shape[1] - 1)
        tokens = np.ascontiguousarray(tgt[np.arange(len(src)), positions])
        log_probs, _, state = engine_step_log_probs(engine, tokens, static, state, False, positions=positions)
        rows = positions < lengths
        worst = max(worst, float(log_prob_diff(log_probs, reference.log_probs(positions))[rows].max()))
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
