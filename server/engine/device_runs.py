"""The device's plain runs: beam search's selection as a graph on the device (:class:`DeviceBeamRun`), whose step's
best tokens never come to the host, and arg-max steps in blocks (:class:`DeviceGreedyRun`).

:class:`server.engine.device_step_model.DeviceStepModel` keeps the encoder outputs and the KV cache on the
device; without this module its beam steps still brought each row's best tokens to the host, chose the
hypotheses there (:func:`server.engine.beam_select.select_beam`) and sent the chosen rows back for the cache's
``Gather``: a round trip and some hundred host operations per step, growing with the rows. Here one small
graph (:func:`selection_graph`, built at load with the decoder's providers) takes the step graph's top-k
outputs where they are and computes, for every sentence of the decode at once:

* the ``2 x beam`` best continuations of its rows, ranked by summed log-probability (``TopK``, ties to the
  lower index, as the host's stable sort), walked in order: EOS finishes, the rest live until the beam is
  full (a ``CumSum`` of the live ones);
* the next step's token ids, each new row's origin (the cache's ``Gather`` reads them on the device), summed
  scores, and the token history with its per-token scores, rows following their origins;
* its finished hypotheses: a table of its quota's best (length-normalised score, tokens, token scores,
  length), merged with those finishing now by one more ``TopK`` (earlier ones first among equals, as the
  host's stable sort of the appended list);
* whether it is done (:func:`server.engine.beam_select.sentence_done`'s rule).

The host reads only the ``done`` flags, one byte a sentence (:attr:`DeviceBeamRun.bytes_read` counts what
crosses): a step in which no sentence is done is *quiet* and stays on the device. The first step that is not
quiet comes back as a :class:`server.engine.step_model.StepOutput` with the books (history, totals, finished
hypotheses) as they were before it, and the general selection takes it, as after the plain steps
(:meth:`server.engine.decode.RunningDecode._device_beam`); so the results are the general search's. Scores
are summed in float64 as there. Not in the graph (the host path keeps them): decoding controls, target prefixes
within their forced steps, attention, streaming, a row's last step (only EOS may follow), decodes mixing beam
sizes, and the beam-1 sentences of the lean arg-max path.


Arg-max steps on the device in blocks, whose step graph runs can be captured as CUDA graphs (``--cuda-graphs``).

:class:`server.engine.host_runs.GreedySteps` binds host arrays (the token ids and positions in, each row's best
token and its log-probability out), which ONNX Runtime copies at each run: a captured graph would not. Here every
input and output is a device buffer of the run's own (:mod:`server.engine.cuda_graphs`: a run made for a shape
bucket, the decode's static inputs and cache copied in, kept for the next run of its bucket), and the steps go in
**blocks** of up to :data:`BLOCK_STEPS`:

* the host writes the block's first token ids and every step's positions in one copy;
* it launches the block's steps back to back, each step's best tokens landing in the slot the next step reads as
  its input, so no step waits for the host (each step has bindings of its own, its slots, and so a graph id of its
  own);
* it reads the block's tokens and scores in one copy after the last step, and then step by step.

Where a step of a block is not quiet (some row chose EOS) or the decode must stop, the run stands after the last
step read (:meth:`DeviceGreedyRun.read`): the block's later steps are undone by that alone, since the cache entries
they wrote lie past every row's position, where attention never reads and the next steps write again. Rows past
the decode's (a bucket's padding) copy its first row and are never read. The interface is :class:`GreedySteps`'s,
so :meth:`server.engine.decode.RunningDecode._plain_greedy` runs either.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from common.model_format.manifest import TOP_K_OUTPUTS
from server.engine.cuda_graphs import KeptRun, Slot
from server.engine.host_runs import moved_on
from server.types import ScoredSequence

_NEG_INF = float("-inf")


_I64, _F64 = TensorProto.INT64, TensorProto.DOUBLE


# the selection graph's inputs and outputs: (element type (None: the step's scores'), shape); R rows in, R' out,
# n sentences, K best tokens a row, L history positions, Q finished hypotheses kept at most. What a run does not
# change comes in made on the host: each sentence's quota as a mask of its slots (``kept``) and the index of its
# last (``worst``), its first row (``first_rows``: j x beam), the history's column numbers (``columns``) and
# whether it is one of the decode's (``live``: a run padded to its bucket has others, which are never done)
_INPUTS = {"top_ids": (_I64, ["R", "K"]), "top_log_probs": (None, ["R", "K"]), "totals": (_F64, ["R"]),
           "history": (_I64, ["R", "L"]), "history_scores": (_F64, ["R", "L"]), "steps": (_I64, ["n"]),
           "positions": (_I64, ["R"]), "penalties": (_F64, ["n"]), "kept": (TensorProto.BOOL, ["n", "Q"]),
           "worst": (_I64, ["n", 1]), "first_rows": (_I64, ["n", 1]), "columns": (_I64, ["L"]),
           "fin_scores": (_F64, ["n", "Q"]),
           "fin_tokens": (_I64, ["n", "Q", "L"]), "fin_token_scores": (_F64, ["n", "Q", "L"]),
           "fin_lengths": (_I64, ["n", "Q"]), "live": (TensorProto.BOOL, ["n"])}


_OUTPUTS = {"next_ids": (_I64, ["R'"]), "origins": (_I64, ["R'"]), "next_totals": (_F64, ["R'"]),
            "next_history": (_I64, ["R'", "L"]), "next_history_scores": (_F64, ["R'", "L"]),
            "next_steps": (_I64, ["n"]), "next_positions": (_I64, ["R'"]), "next_fin_scores": (_F64, ["n", "Q"]),
            "next_fin_tokens": (_I64, ["n", "Q", "L"]), "next_fin_token_scores": (_F64, ["n", "Q", "L"]),
            "next_fin_lengths": (_I64, ["n", "Q"]), "done": (TensorProto.BOOL, ["n"])}


SELECTION_INPUTS, SELECTION_OUTPUTS = list(_INPUTS), list(_OUTPUTS)


class _Graph:
    """A graph under construction: :meth:`op` adds a node and names its outputs."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None, **attributes: Any) -> Any:
        names = [name] if name else [f"{op_type.lower()}_{self._count}_{i}" for i in range(outputs)]
        self._count += 1
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attributes))
        return names[0] if outputs == 1 else names

    def const(self, value: Any, dtype: Any) -> str:
        name = f"const_{len(self.initializers)}"
        array = np.asarray(value, dtype=dtype)
        self.initializers.append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(array.dtype), array.shape,
                                                    array.ravel().tolist()))
        return name


def selection_graph(beam: int, eos_id: int, start_id: int, score_type: int, width: int) -> bytes:
    """The serialized selection graph for sentences of beam ``beam`` (see the module docstring); the step's
    log-probabilities arrive as ``score_type`` (``TensorProto.FLOAT`` or ``FLOAT16``), and a row's candidates
    are its ``width`` best tokens (``min(2 x beam, K)``).

    Shapes: ``n`` sentences holding ``beam`` rows each (``R = n x beam``: every sentence has expanded), ``K >= 2``
    best tokens a row, history capacity ``L``, ``Q`` finished hypotheses kept at most. No value computed from a
    shape is used as data on the device (only as a shape, a count or an axis' length, which CUDA kernels read on
    the host): a captured CUDA graph would replay a host copy of it from memory that may since hold other
    things."""
    g = _Graph()
    c = 2 * beam
    zero, one, two, minus_one = (g.const([v], np.int64) for v in (0, 1, 2, -1))
    beam_c, width_c = g.const([beam], np.int64), g.const([c], np.int64)
    neg_inf, eos, start = g.const(_NEG_INF, np.float64), g.const(eos_id, np.int64), g.const(start_id, np.int64)

    # the candidates: each sentence's rows' first 2 x beam tokens, summed onto the row's total
    n = g.op("Gather", g.op("Shape", "steps"), zero)  # [1]
    ids = g.op("Slice", "top_ids", zero, width_c, one)  # [R, P], P = min(2 beam, K)
    scores = g.op("Cast", g.op("Slice", "top_log_probs", zero, width_c, one), to=TensorProto.DOUBLE)
    by_sentence = g.op("Concat", n, minus_one, axis=0)
    per_row = g.const([width], np.int64)  # P
    summed = g.op("Add", g.op("Reshape", "totals", g.op("Concat", n, beam_c, one, axis=0)),
                  g.op("Reshape", scores, g.op("Concat", n, beam_c, minus_one, axis=0)))  # [n, beam, P]
    candidates = g.op("Reshape", summed, by_sentence)  # [n, width x P]: at least 2 x beam (width is beam)
    block_ids, block_scores = g.op("Reshape", ids, by_sentence), g.op("Reshape", scores, by_sentence)
    best, order = g.op("TopK", candidates, width_c, outputs=2, axis=1, largest=1, sorted=1)  # [n, C]
    token = g.op("GatherElements", block_ids, order, axis=1)
    token_score = g.op("GatherElements", block_scores, order, axis=1)
    origin = g.op("Add", g.op("Div", order, per_row), "first_rows")  # [n, C] rows of the decode

    # the walk: EOS finishes, the others live until the beam is full
    valid = g.op("Greater", best, neg_inf)
    is_eos = g.op("And", g.op("Equal", token, eos), valid)
    live = g.op("And", g.op("Not", is_eos), valid)
    before = g.op("CumSum", g.op("Cast", live, to=TensorProto.INT64), one, exclusive=1)
    in_beam = g.op("Less", before, beam_c)
    keep, finish = g.op("And", live, in_beam), g.op("And", is_eos, in_beam)
    slot = g.op("Where", keep, before, beam_c)  # a kept candidate's slot is its rank among the live ones
    slots = g.op("Range", g.const(0, np.int64), g.const(beam, np.int64), g.const(1, np.int64))
    matches = g.op("Cast", g.op("Equal", g.op("Unsqueeze", slot, two), slots), to=TensorProto.FLOAT)  # [n, C, b]
    alive = g.op("Greater", g.op("ReduceMax", matches, one, keepdims=0), g.const(0.0, np.float32))  # [n, b]
    chosen = g.op("ArgMax", matches, axis=1, keepdims=0)  # [n, b]; 0 where no candidate lives
    first = g.op("Slice", origin, zero, one, one)
    new_origin = g.op("Reshape", g.op("Where", alive, g.op("GatherElements", origin, chosen, axis=1), first),
                      minus_one, name="origins")
    g.op("Reshape", g.op("Where", alive, g.op("GatherElements", token, chosen, axis=1), start), minus_one,
         name="next_ids")
    new_totals = g.op("Where", alive, g.op("GatherElements", best, chosen, axis=1), neg_inf)  # [n, b]
    g.op("Reshape", new_totals, minus_one, name="next_totals")
    new_token_scores = g.op("GatherElements", token_score, chosen, axis=1)

    # histories: rows follow their origins, this step's token at each row's step
    columns = "columns"  # [L]
    row_steps = g.op("Reshape", g.op("Expand", g.op("Unsqueeze", "steps", one), g.op("Concat", n, beam_c, axis=0)),
                     g.const([-1, 1], np.int64))  # [n b, 1]
    at_step = g.op("Equal", columns, row_steps)  # [n b, L]
    g.op("Where", at_step, g.op("Reshape", "next_ids", g.const([-1, 1], np.int64)),
         g.op("Gather", "history", new_origin), name="next_history")
    g.op("Where", at_step, g.op("Reshape", new_token_scores, g.const([-1, 1], np.int64)),
         g.op("Gather", "history_scores", new_origin), name="next_history_scores")
    g.op("Add", "steps", one, name="next_steps")
    g.op("Add", g.op("Gather", "positions", new_origin), one, name="next_positions")

    # finished hypotheses: this step's, merged into each sentence's table of its best
    lengths = g.op("Add", "steps", one)  # [n]
    divisor = g.op("Pow", g.op("Cast", lengths, to=TensorProto.DOUBLE), "penalties")  # [n]: length ** penalty
    new_finished = g.op("Where", finish, g.op("Div", best, g.op("Unsqueeze", divisor, one)), neg_inf)  # [n, C]
    quota = g.op("Gather", g.op("Shape", "fin_scores"), one)
    merged, picked = g.op("TopK", g.op("Concat", "fin_scores", new_finished, axis=1), quota, outputs=2, axis=1,
                          largest=1, sorted=1)  # [n, Q]
    fin_scores = g.op("Where", "kept", merged, neg_inf, name="next_fin_scores")  # a sentence keeps its own quota
    at_eos = g.op("Equal", columns, g.op("Unsqueeze", g.op("Unsqueeze", "steps", one), two))  # [n, 1, L]
    tokens_now = g.op("Where", at_eos, eos, g.op("Gather", "history", origin))  # [n, C, L]
    scores_now = g.op("Where", at_eos, g.op("Unsqueeze", token_score, two), g.op("Gather", "history_scores", origin))
    table_shape = g.op("Concat", n, quota, g.op("Shape", columns), axis=0)
    rows_picked = g.op("Expand", g.op("Unsqueeze", picked, two), table_shape)
    g.op("GatherElements", g.op("Concat", "fin_tokens", tokens_now, axis=1), rows_picked, axis=1,
         name="next_fin_tokens")
    g.op("GatherElements", g.op("Concat", "fin_token_scores", scores_now, axis=1), rows_picked, axis=1,
         name="next_fin_token_scores")
    lengths_now = g.op("Expand", g.op("Unsqueeze", lengths, one), g.op("Concat", n, width_c, axis=0))
    g.op("GatherElements", g.op("Concat", "fin_lengths", lengths_now, axis=1), picked, axis=1,
         name="next_fin_lengths")

    # done: nothing lives, or the quota is full (its last slot holds a hypothesis: the table is sorted) and the
    # best live hypothesis, ending now, is no better than the worst kept
    best_live = g.op("Squeeze", g.op("Slice", new_totals, zero, one, one), one)  # [n]
    worst = g.op("Squeeze", g.op("GatherElements", fin_scores, "worst", axis=1), one)  # [n]
    no_better = g.op("LessOrEqual", g.op("Div", best_live, divisor), worst)
    ended = g.op("Or", g.op("Equal", best_live, neg_inf), g.op("And", g.op("Greater", worst, neg_inf), no_better))
    g.op("And", "live", ended, name="done")

    graph = helper.make_graph(g.nodes, f"beam{beam}_selection",
                              [helper.make_tensor_value_info(name, score_type if elem is None else elem, shape)
                               for name, (elem, shape) in _INPUTS.items()],
                              [helper.make_tensor_value_info(name, elem, shape)
                               for name, (elem, shape) in _OUTPUTS.items()],
                              g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    return model.SerializeToString()


@dataclass
class DeviceBooks:
    """The search's books as the host keeps them (:class:`server.engine.decode.RunningDecode`), for the rows
    of ``n`` sentences of one beam: what a device run starts from and hands back."""

    tokens: np.ndarray  # int64 [R] each row's last token
    totals: np.ndarray  # float64 [R]
    history: np.ndarray  # int64 [R, L]
    history_scores: np.ndarray  # float64 [R, L]
    steps: np.ndarray  # int64 [n] each sentence's step
    finished: list[list[ScoredSequence]]  # each sentence's finished hypotheses, best first


# the selection's state between steps: its input -> the output that replaces it
_CARRIED = {name: f"next_{name}" for name in ("totals", "history", "history_scores", "steps", "positions",
                                              "fin_scores", "fin_tokens", "fin_token_scores", "fin_lengths")}


@dataclass(frozen=True)
class RunShapes:
    """What a :class:`DeviceBeamRun`'s buffers are made for, and the key it is kept under for reuse
    (:class:`server.engine.cuda_graphs.RunPool`): the selection's constants, the top-k width and quota as they
    are, the sentences (and so the rows), the history's length and the state's and static inputs' shapes, in their
    buckets where runs are kept (:func:`server.engine.cuda_graphs.bucket`)."""

    beam: int
    eos_id: int
    start_id: int
    k: int  # the step graph's top-k input
    width: int  # best tokens a row (the top-k width)
    rows: int  # sentences x beam
    sentences: int
    length: int  # history positions
    quota: int  # finished hypotheses a sentence keeps, at most
    static: tuple[tuple[str, tuple[int, ...], str], ...]  # (input, shape, OrtValue element type)
    state: tuple[tuple[str, tuple[int, ...], str], ...]  # the decoder state on the device, likewise
    positions: bool  # the step graph takes positions


class DeviceBeamRun(KeptRun):
    """Beam steps whose selection stays on the device (see the module docstring), every buffer the run's own,
    allocated once and bound once, so that a run can be kept and started again
    (:meth:`server.engine.device_step_model.DeviceStepModel.beam_run`) and its session runs captured as CUDA
    graphs (:mod:`server.engine.cuda_graphs`: ``options`` name each parity's graph). Two sets of buffers (the
    books, the token ids, the positions and the decoder state) take turns, a step reading one set and leaving the
    next step's in the other, so the three runs of a step (:meth:`step`: the step graph, the selection, the
    state's ``Gather``) bind nothing anew. :meth:`start` copies a decode's books, static inputs and state in
    (padded to the run's shapes); :meth:`state` and :meth:`output` copy the state out."""

    def __init__(self, model: Any, shapes: RunShapes, sessions: tuple[ort.InferenceSession, ...],
                 options: list[ort.RunOptions | None], graph_ids: tuple[int, ...] = (),
                 borrowed: tuple[dict[str, Any], dict[str, Any]] | None = None) -> None:
        super().__init__(model, shapes, sessions, options, graph_ids)  # the step graph, selection and Gather
        self.bytes_read = 0  # bytes brought from the device to the host since start()
        self.parity = 0  # which set of buffers the next step reads
        self.positions: np.ndarray | None = None  # int64 [R] on the host at the start (None: the model takes none)
        self.advanced = 0  # quiet steps taken
        self.length = 0  # the decode's history length (the run's may be longer)
        self.sentences = self.rows = 0  # the decode's sentences and rows (the run's may be more)
        rows, n, length, q = shapes.rows, shapes.sentences, shapes.length, shapes.quota
        shapes_of = {"totals": ((rows,), np.float64), "history": ((rows, length), np.int64),
                     "history_scores": ((rows, length), np.float64), "steps": ((n,), np.int64),
                     "fin_scores": ((n, q), np.float64), "fin_tokens": ((n, q, length), np.int64),
                     "fin_token_scores": ((n, q, length), np.float64), "fin_lengths": ((n, q), np.int64),
                     "input_ids": ((rows,), np.int64), "positions": ((rows,), np.int64)}
        self.sets = [{name: self._alloc(*spec) for name, spec in shapes_of.items()} for _ in (0, 1)]
        names = [name for name, _, _ in shapes.state]

        def allocated(specs: tuple[tuple[str, tuple[int, ...], str], ...]) -> dict[str, ort.OrtValue]:
            return {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in specs}

        # a run that is not kept reads the decode's static inputs and state where they are (``borrowed``), and
        # hands its state back as it is
        self.borrowed = borrowed is not None
        self.static = borrowed[0] if borrowed else allocated(shapes.static)
        self.states = [{name: borrowed[1][name] for name in names} if borrowed else allocated(shapes.state),
                       allocated(shapes.state)]
        self.fixed = {"penalties": self._alloc((n,), np.float64), "kept": self._alloc((n, q), np.bool_),
                      "live": self._alloc((n,), np.bool_),
                      "worst": self._alloc((n, 1), np.int64), "first_rows": self._alloc((n, 1), np.int64),
                      "columns": self._alloc((length,), np.int64), "origins": self._alloc((rows,), np.int64)}
        self.fixed["first_rows"].update_inplace(np.arange(n, dtype=np.int64)[:, None] * (rows // n))
        self.fixed["columns"].update_inplace(np.arange(length, dtype=np.int64))
        score_dtype = model.score_dtype
        self.top = {"top_ids": self._alloc((rows, shapes.width), np.int64),
                    "top_log_probs": self._alloc((rows, shapes.width), score_dtype),
                    "eos_log_prob": self._alloc((rows,), score_dtype)}
        self.done_flags = self._alloc((n,), np.bool_)  # the one output the host reads, n bytes a step
        self.done = np.zeros(n, dtype=bool)  # as last read
        # a state entry that is not an in-place buffer is written by the step to a buffer of its own
        written = {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in shapes.state
                   if name not in model.buffers}
        self._bindings: list[tuple[ort.IOBinding, ort.IOBinding, ort.IOBinding, dict[str, Any]]] = []
        for p in (0, 1):
            now, after = self.sets[p], self.sets[1 - p]
            step_state = {name: written.get(name, self.states[p][name]) for name in names}
            step = model.step_binding(sessions[0], now["input_ids"], now["positions"] if shapes.positions else None,
                                      self.static, self.states[p], shapes.k, self.top, step_state)
            select = sessions[1].io_binding()
            for name in ("top_ids", "top_log_probs"):
                select.bind_ortvalue_input(name, self.top[name])
            for name in _CARRIED:
                select.bind_ortvalue_input(name, now[name])
                select.bind_ortvalue_output(_CARRIED[name], after[name])
            for name in ("penalties", "kept", "worst", "first_rows", "columns", "live"):
                select.bind_ortvalue_input(name, self.fixed[name])
            select.bind_ortvalue_output("next_ids", after["input_ids"])
            select.bind_ortvalue_output("origins", self.fixed["origins"])
            select.bind_ortvalue_output("done", self.done_flags)
            gather = model.gather_binding(sessions[2], [step_state[name] for name in names], self.fixed["origins"],
                                          [self.states[1 - p][name] for name in names])
            self._bindings.append((step, select, gather, step_state))

    def start(self, books: DeviceBooks, penalties: list[float], quotas: list[int], static: dict[str, Any],
              state: dict[str, Any], positions: np.ndarray | None) -> None:
        """Begin a run from a decode's ``books``, its sentences' length ``penalties`` and ``quotas``, its
        ``static`` inputs and its ``state`` (copied into the run's buffers, padded to its shapes: sentences past
        the decode's copy its first one's rows and are never done) at ``positions`` (int64 [R]; None: the model
        takes none)."""
        rows, n, length, q = self.shapes.rows, self.shapes.sentences, self.shapes.length, self.shapes.quota
        self.sentences, self.rows = len(books.steps), len(books.tokens)
        self.length, self.positions = books.history.shape[1], positions
        self.parity, self.advanced, self.bytes_read = 0, 0, 0
        beam = self.rows // self.sentences
        # each of the run's sentences and rows: the decode's, then copies of its first sentence's
        sentence_of = np.concatenate([np.arange(self.sentences), np.zeros(n - self.sentences, dtype=np.int64)])
        row_of = np.concatenate([np.arange(self.rows), np.tile(np.arange(beam), n - self.sentences)])
        history = np.zeros((rows, length), dtype=np.int64)
        history_scores = np.zeros((rows, length))
        history[:, : self.length] = books.history[row_of]
        history_scores[:, : self.length] = books.history_scores[row_of]
        fin_scores = np.full((n, q), _NEG_INF)
        fin_tokens = np.zeros((n, q, length), dtype=np.int64)
        fin_token_scores = np.zeros((n, q, length))
        fin_lengths = np.zeros((n, q), dtype=np.int64)
        for j, hypotheses in enumerate(books.finished[i] for i in sentence_of):
            for i, h in enumerate(hypotheses):
                fin_scores[j, i], fin_lengths[j, i] = h.score, len(h.tokens)
                fin_tokens[j, i, : len(h.tokens)], fin_token_scores[j, i, : len(h.tokens)] = h.tokens, h.token_scores
        quota = np.asarray(quotas, dtype=np.int64)[sentence_of, None]
        arrays = {"totals": books.totals[row_of], "history": history, "history_scores": history_scores,
                  "steps": books.steps[sentence_of], "fin_scores": fin_scores, "fin_tokens": fin_tokens,
                  "fin_token_scores": fin_token_scores, "fin_lengths": fin_lengths, "input_ids": books.tokens[row_of],
                  "positions": positions[row_of] if positions is not None else np.zeros(rows, dtype=np.int64)}
        for name, array in arrays.items():
            _fill(self.sets[0][name], array)
        _fill(self.fixed["penalties"], np.asarray(penalties, dtype=np.float64)[sentence_of])
        _fill(self.fixed["kept"], np.arange(q) < quota)
        _fill(self.fixed["worst"], quota - 1)
        _fill(self.fixed["live"], np.arange(n) < self.sentences)
        self._bindings[0][1].synchronize_inputs()  # the host's copies landed before the first step reads them
        if not self.borrowed:
            names = list(self.states[0])
            self.model.padded_copies([static[name] for name in self.static], row_of, list(self.static.values()))
            self.model.padded_copies([state[name] for name in names], row_of, [self.states[0][name] for name in names])

    def step(self) -> bool:
        """Run the step graph and the selection on the current set of buffers; returns whether some sentence
        is done (the host reads ``n`` bytes). Then :meth:`advance` (a quiet step) or :meth:`output` (not)."""
        step, select, _, _ = self._bindings[self.parity]
        self._run(0, step, self.parity)
        self._run(1, select, self.parity)
        select.synchronize_outputs()  # a replayed graph's work done before the flags are copied
        self.done = self.read(self.done_flags)[: self.sentences]
        return bool(self.done.any())

    def advance(self) -> None:
        """Take the step's selection: the state's rows follow their origins into the other set, which the next
        step reads."""
        self._run(2, self._bindings[self.parity][2], self.parity)
        self.parity = 1 - self.parity
        self.advanced += 1

    def output(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The last step's best tokens, their log-probabilities and EOS's (brought to the host) and the decoder
        state after it (copied out of the run), its rows not yet reordered (a step that was not quiet, for the
        host's selection)."""
        state = self._copied(self._bindings[self.parity][3])
        if self.positions is not None:
            state[self.model.positions] = self.positions + self.advanced + 1
        rows = self.rows
        return (self.read(self.top["top_ids"])[:rows], self.read(self.top["top_log_probs"])[:rows],
                self.read(self.top["eos_log_prob"])[:rows], state)

    def state(self) -> dict[str, Any]:
        """The decoder state the next step reads, copied out of the run."""
        state = self._copied(self.states[self.parity])
        if self.positions is not None:
            state[self.model.positions] = self.positions + self.advanced
        return state

    def books(self) -> DeviceBooks:
        """The books the next step reads, brought to the host (the end of a run), for the decode's sentences and
        rows at its history length."""
        v, length, n, rows = self.sets[self.parity], self.length, self.sentences, self.rows
        fin_scores, fin_lengths = self.read(v["fin_scores"])[:n], self.read(v["fin_lengths"])[:n]
        fin_tokens, fin_token_scores = self.read(v["fin_tokens"])[:n], self.read(v["fin_token_scores"])[:n]
        finished = [[ScoredSequence(tokens=fin_tokens[j, i, :size].tolist(), score=float(fin_scores[j, i]),
                                    token_scores=fin_token_scores[j, i, :size].tolist())
                     for i, size in enumerate(fin_lengths[j].tolist()) if fin_scores[j, i] != _NEG_INF]
                    for j in range(len(fin_scores))]
        history, history_scores = self.read(v["history"]), self.read(v["history_scores"])
        return DeviceBooks(self.read(v["input_ids"])[:rows], self.read(v["totals"])[:rows],
                     history[:rows, :length].copy(), history_scores[:rows, :length].copy(), self.read(v["steps"])[:n],
                     finished)

    def read(self, value: ort.OrtValue) -> np.ndarray:
        """``value`` on the host, an array of its own (a CPU ``OrtValue``'s ``numpy()`` is a view of the run's
        buffer, which the next step writes); the bytes are counted (:attr:`bytes_read`)."""
        array = value.numpy()
        self.bytes_read += array.nbytes
        return array.copy() if self.device == "cpu" else array

    def _copied(self, values: dict[str, ort.OrtValue]) -> dict[str, Any]:
        """Copies of ``values``' rows of the decode, that it can keep (a kept run's buffers stay with the run; a
        run that is not kept hands them over)."""
        if self.borrowed:
            return dict(values)
        return dict(zip(values, self.model.padded_copies(list(values.values()), np.arange(self.rows)), strict=True))


def _fill(value: ort.OrtValue, array: np.ndarray) -> None:
    """Copy ``array`` into the buffer ``value`` (of its shape; converted to its element type)."""
    value.update_inplace(np.ascontiguousarray(array, dtype=numpy_type(value.data_type())))


def numpy_type(element_type: str) -> Any:
    """The NumPy type of an ``OrtValue`` element type ("tensor(float)", ...)."""
    return helper.tensor_dtype_to_np_dtype(ELEMENT_TYPES[element_type])


# an OrtValue's element type -> ONNX's
ELEMENT_TYPES = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16,
                 "tensor(double)": TensorProto.DOUBLE, "tensor(int64)": TensorProto.INT64,
                 "tensor(int32)": TensorProto.INT32, "tensor(bool)": TensorProto.BOOL}


BLOCK_STEPS = 8  # arg-max steps launched together before the host reads their tokens


@dataclass(frozen=True)
class GreedyShapes:
    """What a :class:`DeviceGreedyRun`'s buffers are made for, and the key it is kept under: its rows and the static
    inputs' and cache's shapes, in their buckets (:func:`server.engine.cuda_graphs.bucket`)."""

    rows: int
    static: tuple[tuple[str, tuple[int, ...], str], ...]  # (input, shape, OrtValue element type)
    state: tuple[tuple[str, tuple[int, ...], str], ...]  # the cache's in-place buffers, likewise


class DeviceGreedyRun(KeptRun):
    """Arg-max steps over buffers of the run's own, bound once (see the module docstring): :meth:`start`, then
    :meth:`run_block` and :meth:`read` each of its steps (or the first few, where the decode stops inside
    a block), then :meth:`state`; ``options`` name each block step's graph (None: no graph-enabled session)."""

    def __init__(self, model: Any, shapes: GreedyShapes, session: ort.InferenceSession,
                 options: list[ort.RunOptions] | None, graph_ids: tuple[int, ...] = ()) -> None:
        for option in options or []:  # the host waits for the block's last step only (synchronize_outputs)
            option.add_run_config_entry("disable_synchronize_execution_providers", "1")
        super().__init__(model, shapes, (session,), options or [None] * BLOCK_STEPS, graph_ids)
        self.rows = 0  # the decode's rows (the run's may be more)
        rows, block = shapes.rows, BLOCK_STEPS
        self.static = {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in shapes.static}
        self.buffers = {name: self._alloc(shape, numpy_type(kind)) for name, shape, kind in shapes.state}
        # the host's one copy in per block: slot 0 the first step's token ids, slots 1..block each step's best ids
        # (the next step's input), slots block+1.. each step's positions
        self._feeds = self._alloc((2 * block + 1, rows), np.int64)
        self._host_feeds = np.zeros((2 * block + 1, rows), dtype=np.int64)
        score_dtype = model.score_dtype
        self._scores = self._alloc((block, rows), score_dtype)  # each step's best log-probability, a slot a step
        self._eos = self._alloc((block, rows), score_dtype)  # and EOS's
        ids, scores, eos = TOP_K_OUTPUTS
        slot = partial(Slot, device_id=self.device_id)
        self._bindings = [
            model.step_binding(session, slot(self._feeds, t, (rows,)), slot(self._feeds, block + 1 + t, (rows,)),
                               self.static, self.buffers, 1,
                               {ids: slot(self._feeds, t + 1, (rows, 1)), scores: slot(self._scores, t, (rows, 1)),
                                eos: slot(self._eos, t, (rows,))}, self.buffers)
            for t in range(block)]
        self._row_of = np.zeros(rows, dtype=np.int64)  # each of the run's rows: the decode's row it copies
        self._next = np.zeros((0, rows), dtype=np.int64)  # each step's positions (of the run's rows)
        self._done = 0  # steps read (a block's steps left unread are not taken)
        self._block = np.zeros((0, rows), dtype=np.int64), np.zeros((0, rows))  # the last block's ids and scores
        self._at = 0  # the step read last, within its block
        self.ids = self.scores = np.zeros(0)

    def start(self, tokens: np.ndarray, positions: np.ndarray, static: dict[str, Any], state: dict[str, Any],
              steps: int, ceilings: np.ndarray | None = None) -> None:
        """Continue from ``tokens`` at ``positions`` (int64 [R]) with the decode's ``static`` inputs and ``state``
        (copied in, padded to the run's shapes) for up to ``steps`` steps, no row's position past its
        ``ceilings`` entry."""
        self.rows = len(tokens)
        self._row_of = np.concatenate([np.arange(self.rows), np.zeros(self.shapes.rows - self.rows, dtype=np.int64)])
        self.ids, self.scores = tokens.astype(np.int64, copy=True), np.zeros(self.rows, dtype=np.float32)
        self._next = moved_on(positions[self._row_of], steps, None if ceilings is None else ceilings[self._row_of])
        self._done = 0
        names = list(self.buffers)
        self.model.padded_copies([static[name] for name in self.static], self._row_of, list(self.static.values()))
        self.model.padded_copies([state[name] for name in names], self._row_of, list(self.buffers.values()))

    def run_block(self, steps: int) -> int:
        """Up to ``steps`` steps (at most :data:`BLOCK_STEPS`, none past the ``steps`` given to :meth:`start`),
        launched back to back and read in one copy after the last; how many ran. :meth:`read` then gives each."""
        count = min(steps, BLOCK_STEPS, len(self._next) - 1 - self._done)
        feeds, block = self._host_feeds, BLOCK_STEPS
        feeds[0] = self.ids[self._row_of]
        feeds[block + 1: block + 1 + count] = self._next[self._done: self._done + count]
        self._feeds.update_inplace(feeds)
        first = self._bindings[0]
        first.synchronize_inputs()  # the host's copy landed before the first step (or its replay) reads it
        for t in range(count):
            self._run(0, self._bindings[t], t)
        self._bindings[count - 1].synchronize_outputs()
        self._block = (self._feeds.numpy()[1: count + 1, : self.rows].copy(),  # (a CPU buffer's numpy() is a view)
                       self._scores.numpy()[:count, : self.rows].astype(np.float32))
        return count

    def read(self, step: int) -> tuple[list[int], list[float]]:
        """Step ``step`` of the last block, read in order: each row's token and its log-probability. The run then
        stands after that step: the next block starts there, whatever of this block is left unread."""
        ids, scores = self._block
        self._at = step
        self._done += 1
        self.ids, self.scores = ids[step], scores[step]
        return self.ids.tolist(), self.scores.tolist()

    @property
    def eos_log_prob(self) -> np.ndarray:
        """EOS's log-probability in each row at the step read last."""
        return self._eos.numpy()[self._at, : self.rows].astype(np.float32)

    def state(self) -> dict[str, Any]:
        """The decoder state after the steps taken (the cache copied out, each row's position moved on)."""
        copies = self.model.padded_copies(list(self.buffers.values()), np.arange(self.rows))
        positions = self._next[self._done, : self.rows].copy()
        return {**dict(zip(self.buffers, copies, strict=True)), self.model.positions: positions}
