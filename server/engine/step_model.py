"""The search's view of a model (:class:`StepModel`), its per-sentence settings and its results.

The search itself is :mod:`server.engine.decode`: a running decode that sentences join and leave between
steps (:func:`server.engine.decode.beam_search` is the static batch, every sentence admitted at step 0). The
model is reached only through :class:`StepModel`; the search never knows whether it drives a
Transformer or an RNN. A forced target prefix adds nothing to a hypothesis' score, which counts the
tokens the search chose (as CTranslate2), though its length does count them; given tokens can also run as
one forced pass (:mod:`server.engine.forced`) and the search resume after them (:class:`Resume`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from common.model_format.decoding import max_target_length
from server.completion import WordPieces
from server.controls import Controls
from server.types import StableReport

NEG_INF = -np.inf


@dataclass
class ForcedOutput:
    """One forced pass over ``T`` positions of ``R`` rows."""

    target_log_probs: np.ndarray  # float [R, T]: log-probability of each position's given next token
    last_log_probs: np.ndarray  # float [R, V]: the distribution after the last position
    attention: np.ndarray | None  # float32 [R, T, S] alignment attention, when asked for
    state: dict[str, Any]  # the decoder state after the T positions (the step decoder's state inputs)


@dataclass
class StepOutput:
    """One decoding step of ``R`` rows, as the search reads it: the best few tokens of each row, not
    the whole distribution (exported decoders compute them in the graph with ``TopK``)."""

    top_ids: np.ndarray  # int64 [R, k]: each row's k most likely next tokens, best first (ties: lower id)
    top_log_probs: np.ndarray  # float [R, k]: their log-probabilities
    eos_log_prob: np.ndarray  # float [R]: log-probability of EOS (for rows out of room)
    attention: np.ndarray | None  # float32 [R, S] cross-attention, when asked for
    state: dict[str, Any]  # next recurrent state [R, ...], kept where the model keeps it
    log_probs: np.ndarray | None = None  # float [R, V]: the whole distribution, when asked for (``full``)
    logits: np.ndarray | None = None  # float [R, V]: the softmax's input, when asked for (``logits``)


@dataclass(frozen=True)
class Capabilities:
    """What a step model can do, as it declares it: the decode and the scheduler choose their paths from these and
    never probe a model for methods or attributes."""

    per_row_positions: bool = False  # one step decodes rows at different positions: sentences join a running decode
    greedy_steps: bool = False  # ``greedy_steps()``: plain arg-max runs (the in-place cache)
    beam_steps: bool = False  # ``beam_steps()``: plain beam runs over host arrays
    device_beam: bool = False  # ``beam_run()``: beam search's selection on the device
    on_device: bool = False  # the state lives on a device, whose step costs about the same at any row count
    kept_runs: bool = False  # runs kept for CUDA graphs: ``capture`` and ``pool`` (server.engine.cuda_graphs)


class StepModel(Protocol):
    """What beam search needs from a model.

    Shapes: ``R`` live rows (sentences x their live beams), ``S`` source length, ``V`` vocabulary.
    The ``static`` and ``state`` tensors are whatever the model keeps them as (NumPy arrays, or
    buffers on a GPU): the search only hands them back and picks rows through :meth:`select_rows`.
    """

    static_names: list[str]  # encoder outputs fed unchanged every step, [N, ...] per sentence
    state_names: list[str]  # recurrent state, [R, ...] per row
    static_src_axes: dict[str, int]  # static input -> its source-length axis (cut when the widest sources leave)
    capabilities: Capabilities

    def step(
        self, tokens: np.ndarray, static: dict[str, Any], state: dict[str, Any], need_attention: bool, k: int,
        full: bool = False, positions: np.ndarray | None = None, logits: bool = False,
    ) -> StepOutput:
        """``tokens`` int64 [R] (previous token of each row), ``static`` tensors [R, ...], ``state``
        tensors [R, ...], ``k`` >= 1 -> the ``min(k, V)`` best tokens of each row and their
        log-probabilities, the EOS log-probability, attention [R, S] (or None), the next state,
        with ``full`` the whole [R, V] distribution and with ``logits`` the [R, V] logits it is the
        log-softmax of (for the decoding controls). ``positions`` int64
        [R]: each row's own target position (tokens it has decoded), passed only to a model whose
        ``capabilities.per_row_positions`` is true; None: all rows are at the same step."""

    def select_rows(self, tensors: dict[str, Any], rows: np.ndarray, in_place: bool = False) -> dict[str, Any]:
        """Rows ``rows`` (int64 [R']) of every [R, ...] tensor, in that order: finished sentences
        leave the batch and beams follow the rows they extend. ``in_place``: the tensors are the
        caller's alone (this model's own results, held by nobody else), so their rows may move within
        their memory; the caller keeps the result, not ``tensors``. :func:`take_rows` for NumPy arrays."""

    def concat_rows(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        """The rows of ``first`` followed by those of ``second`` (sentences joining a running decode); a
        non-row axis on which they differ (source length, cache capacity) is zero-padded first, and zero
        must mean padding there (a source mask's 0). :func:`concat_rows` for NumPy arrays. Needed only by
        a model whose ``capabilities.per_row_positions`` is true (one that can decode rows at different steps)."""

    def force(self, inputs: np.ndarray, targets: np.ndarray, static: dict[str, Any], state: dict[str, Any],
              need_attention: bool) -> Any:
        """Given tokens in one pass (:class:`ForcedOutput`): ``inputs`` int64 [R, T] fed at
        positions 0..T-1 from ``state`` (the initial one), ``targets`` int64 [R, T] the tokens whose
        log-probabilities each position reports; the resulting state is the step decoder's (for the
        in-place cache: its buffers and each row's position T)."""

    def release(self) -> None:
        """The decode this thread ran has ended: let go of anything kept of it between steps (bound
        buffers, runs), so that its memory goes back before the next decode allocates its own."""


def take_rows(tensors: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """:meth:`StepModel.select_rows` for models that keep their tensors as NumPy arrays (a copy, in place
    or not)."""
    return {name: value[rows] for name, value in tensors.items()}


def concat_rows(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:meth:`StepModel.concat_rows` for models that keep their tensors as NumPy arrays."""
    joined = {}
    for name, a in first.items():
        b = second[name]
        width = np.maximum(a.shape[1:], b.shape[1:])
        joined[name] = np.concatenate([_pad_to(a, width), _pad_to(b, width)])
    return joined


def _pad_to(array: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """``array`` zero-padded at the end of every non-row axis to ``shape`` (rows excluded)."""
    if tuple(array.shape[1:]) == tuple(shape):
        return array
    return np.pad(array, [(0, 0), *((0, int(want) - have) for have, want in zip(array.shape[1:], shape, strict=True))])


@dataclass(frozen=True)
class Alternatives:
    """A sentence's ``return_alternatives``: its most likely next words after the forced prefix, each
    continued to a whole translation (:mod:`server.engine.forced`)."""

    count: int  # the most words returned
    words: WordPieces  # the model's pieces: which start a word, how each is spelt


@dataclass
class BeamSentence:
    """Per-sentence search settings."""

    source_length: int  # source tokens including EOS
    num_hypotheses: int = 1
    max_length: int = 256
    length_penalty: float = 1.0
    is_cancelled: Callable[[], bool] | None = None
    controls: Controls = field(default_factory=Controls)
    patience: float = 1.0  # beam search keeps round(beam x patience) finished hypotheses before it stops
    beam_size: int = 1
    need_attention: bool = False  # keep the cross-attention of its hypotheses
    alternatives: Alternatives | None = None  # the next words after the forced prefix, instead of the n best
    on_stable: StableReport | None = None  # the stable prefix, when it grew

    def limit(self) -> int:
        """Longest output (EOS included): :func:`max_target_length`, and room for a forced prefix and the
        partial word it ends with."""
        c = self.controls
        typed = len(c.forced) + (c.completion.steps() if c.completion is not None else 0)
        return max(max_target_length(self.source_length, self.max_length), typed + 1)


@dataclass
class Resume:
    """Where the search starts when a forced pass (:mod:`server.engine.forced`) has already decided each
    sentence's first ``T`` tokens: step ``T``, whose model output the pass may have computed too."""

    tokens: np.ndarray  # int64 [N, T], T >= 1
    token_scores: np.ndarray  # float [N, T]
    attention: np.ndarray | None  # float32 [N, T, S] (when the search needs attention)
    state: dict[str, Any]  # the model state after positions 0..T-1 (the start token and tokens[:, :-1])
    first: StepOutput | None = None  # step T already run by the forced pass (``log_probs`` whole, ``state``
    # after it); None: the search runs it, feeding tokens[:, -1] to ``state``
