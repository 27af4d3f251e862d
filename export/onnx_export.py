"""``nmt export``: a training run -> a verified ONNX model version in the model repository.

Pipeline (each stage is a step of the progress bar):

1. **validate** the inputs before writing anything: the checkpoint (loaded with ``weights_only=True``),
   the tokenizer beside it, the target directory (refused if it exists, unless ``force``);
2. **export** the architecture's graphs (:data:`EXPORTERS`, filled by :mod:`export.onnx_transformer`
   and :mod:`export.onnx_bahdanau`): ``encoder.onnx``, ``decoder.onnx`` (one step) and
   ``decoder_attention.onnx`` (the same step plus ``attention``); the I/O contract is described in
   :mod:`server.manifest`. Projections that read the same input are packed into one MatMul
   (:func:`pack_parallel_matmuls`);
3. **verify** with ONNX Runtime against PyTorch on held-out sentences: teacher-forced step log-probs
   and attention within :data:`LOGIT_TOLERANCE`, identical greedy and beam-4 hypotheses
   (:class:`OrtModel` plugs into the reference :func:`export.search.beam_search`);
4. optionally **quantize** (dynamic int8) and score held-out BLEU of fp32 vs int8;
5. **write** everything into a hidden temporary directory next to the target and rename it into place,
   so a failed export leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import io
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper
from torch import Tensor, nn
from tqdm import tqdm

from export.models import Seq2SeqModel, load_checkpoint
from export.search import Hypothesis, StepFn, beam_search, max_target_length, translate_ids
from nmt.errors import NmtError
from server.manifest import (
    MANIFEST_FILENAME,
    TOP_K_INPUT,
    TOP_K_OUTPUTS,
    Manifest,
    StateTensor,
    sha256_file,
    write_manifest,
)
from server.tokenizer import MODEL_FILENAME, UNK_ID, Tokenizer

GRAPH_FILES = {"encoder": "encoder.onnx", "decoder": "decoder.onnx", "decoder_attention": "decoder_attention.onnx"}
LOGIT_TOLERANCE = 1e-4  # fp32 parity: max |log-prob difference| and max |attention difference|
MAX_IR_VERSION = 10  # what onnxruntime >= 1.20 reads; onnx 1.23 would write a newer one for edited graphs
OPSETS = range(18, 23)  # opset 23 turns SDPA into ONNX Attention, which ORT's CPU kernel rejects with our masks
FUSED_STANDARD_OPS = {"LayerNormalization", "GRU", "LSTM", "RNN", "Attention", "RMSNormalization"}
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------------
# Architecture exporters


@dataclass
class GraphSet:
    """What an architecture exporter produces: three graphs and their I/O description."""

    encoder: onnx.ModelProto
    decoder: onnx.ModelProto
    decoder_attention: onnx.ModelProto
    decoder_static: list[str]
    decoder_state: list[StateTensor]
    static_src_axes: dict[str, int]
    attention_total: int  # attention blocks that have a fused ONNX Runtime lowering (all must be fused)
    attention_fused: int

    def graphs(self) -> dict[str, onnx.ModelProto]:
        return {"encoder": self.encoder, "decoder": self.decoder, "decoder_attention": self.decoder_attention}


GraphExporter = Callable[[Seq2SeqModel, int], GraphSet]
EXPORTERS: dict[str, GraphExporter] = {}


def register_exporter(arch: str) -> Callable[[GraphExporter], GraphExporter]:
    """Decorator adding an architecture's graph exporter to :data:`EXPORTERS`."""

    def wrap(function: GraphExporter) -> GraphExporter:
        EXPORTERS[arch] = function
        return function

    return wrap


def graph_exporter(arch: str) -> GraphExporter:
    import export.onnx_bahdanau  # noqa: F401  (registers)
    import export.onnx_transformer  # noqa: F401  (registers)

    if arch not in EXPORTERS:
        raise NmtError(f"no ONNX exporter for architecture {arch!r}; known: {', '.join(sorted(EXPORTERS))}")
    return EXPORTERS[arch]


def example_source(config: Any) -> Tensor:
    """Export example ``src`` [3, 7]: one row padded after an early EOS, so padding is traced; its sizes
    differ from every static dimension so the exporter cannot confuse dynamic axes with them."""
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, max(config.vocab_size, 5), (3, 7), generator=generator)
    src[:, -1] = config.eos_id
    src[1, 4:] = config.pad_id
    src[1, 3] = config.eos_id
    return src


def untied_copy(model: Seq2SeqModel, projection: str, embedding: str) -> Seq2SeqModel:
    """A deep copy whose output projection owns its weight (numerically identical).

    A projection tied to the embedding becomes one initializer read by both a Gather and a transposed
    MatMul/Gemm; dynamic int8 quantization then rewrites the shared tensor and breaks the Gather.
    """
    clone = copy.deepcopy(model).eval()
    layer = getattr(clone, projection)
    if layer.weight is getattr(clone, embedding).weight:
        layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
    return clone


# --------------------------------------------------------------------------------------------------
# torch -> ONNX and graph surgery helpers (used by the architecture modules)


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """Silence the exporter's progress prints, warnings and log lines; yields what it printed."""
    buffer = io.StringIO()
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            warnings.simplefilter("ignore")
            yield buffer
    finally:
        logging.disable(disabled)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch with ``count`` intra-op threads (tiny decoding steps are far slower with more on a busy host)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def torch_to_onnx(
    module: nn.Module,
    args: tuple[Any, ...],
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: tuple[Any, ...],
    opset: int,
    fuse: bool = False,
    what: str = "graph",
) -> onnx.ModelProto:
    """``torch.onnx.export(dynamo=True)``, then (``fuse``) ONNX Runtime fusions via onnxscript's
    ``optimize_for_ort`` (attention -> ``com.microsoft.MultiHeadAttention``, residual + LayerNorm ->
    ``SkipLayerNormalization``)."""
    import onnx_ir as ir

    module.eval()
    with _quiet() as printed, torch.no_grad():
        try:
            program = torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, input_names=list(input_names),
                output_names=list(output_names), dynamic_shapes=dynamic_shapes, optimize=True, verbose=False,
            )
            model = program.model
            if fuse:
                from onnxscript.rewriter.ort_fusions import optimize_for_ort

                model, _ = optimize_for_ort(model)
        except Exception as error:  # the exporter raises many types; all mean "this graph did not export"
            tail = printed.getvalue().strip().splitlines()[-5:]
            raise NmtError(f"exporting the {what} failed: {type(error).__name__}: {str(error)[:2000]}"
                           + ("\n" + "\n".join(tail) if tail else "")) from error
    proto = ir.serde.serialize_model(model)
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    return proto


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {output: node for node in graph.node for output in node.output if output}


def prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop nodes, initializers and value infos that no graph output depends on (in place)."""
    graph = model.graph
    needed = {output.name for output in graph.output}
    keep: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(output in needed for output in node.output):
            keep.append(node)
            needed.update(name for name in node.input if name)
            for attribute in node.attribute:  # subgraphs (If/Loop) read outer names implicitly
                if attribute.type == onnx.AttributeProto.GRAPH:
                    needed.update(_subgraph_inputs(attribute.g))
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    initializers = [init for init in graph.initializer if init.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    infos = [info for info in graph.value_info if info.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return model


def _subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    names = {name for node in graph.node for name in node.input}
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names |= _subgraph_inputs(attribute.g)
    return names


def remove_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """A copy of ``model`` without graph output ``name`` (and whatever only it needed)."""
    clone = onnx.ModelProto()
    clone.CopyFrom(model)
    outputs = [output for output in clone.graph.output if output.name != name]
    del clone.graph.output[:]
    clone.graph.output.extend(outputs)
    return prune(clone)


def cancel_transposes(model: onnx.ModelProto) -> int:
    """Bypass ``Transpose(Transpose(x, p), q)`` pairs that compose to the identity; returns how many."""
    graph = model.graph
    made = producers(graph)
    rename: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "Transpose" or not node.input:
            continue
        inner = made.get(node.input[0])
        if inner is None or inner.op_type != "Transpose":
            continue
        outer_perm, inner_perm = perm(node), perm(inner)
        if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
            continue
        if [inner_perm[axis] for axis in outer_perm] == list(range(len(outer_perm))):
            rename[node.output[0]] = inner.input[0]
    if rename:
        graph_outputs = {output.name for output in graph.output}
        rename = {old: new for old, new in rename.items() if old not in graph_outputs}
        for node in graph.node:
            for position, name in enumerate(node.input):
                if name in rename:
                    node.input[position] = rename[name]
        prune(model)
    return len(rename)


def pack_parallel_matmuls(model: onnx.ModelProto) -> int:
    """Merge the projections that read the same input into one (in place): ``MatMul(x, W_i) [+ b_i]``
    for i = 1..n with constant 2-D ``W_i`` becomes ``Split(MatMul(x, [W_1 ... W_n]) [+ [b_1 ... b_n]])``,
    whose pieces keep the original output names. Attention's query/key/value projections and the
    cross-attention key/value projections of every decoder layer are such groups: one wide product
    uses both cores where the narrow ones leave one idle, and costs one kernel launch instead of n.
    Returns the number of MatMuls removed."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {output.name for output in graph.output}

    def bias_of(matmul: onnx.NodeProto) -> tuple[onnx.NodeProto, str] | None:
        """The ``Add(matmul, b)`` with constant 1-D ``b`` that alone reads this MatMul's output, and ``b``."""
        users = consumers.get(matmul.output[0], [])
        if len(users) != 1 or users[0].op_type != "Add" or matmul.output[0] in graph_outputs:
            return None
        add = users[0]
        bias = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
        return (add, bias) if bias in initializers and len(initializers[bias].dims) == 1 else None

    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if (node.op_type == "MatMul" and node.input[1] in initializers
                and len(initializers[node.input[1]].dims) == 2):
            groups.setdefault(node.input[0], []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(first member) -> the nodes taking its place
    removed: set[int] = set()
    merged = 0
    for index, (source, members) in enumerate(groups.items()):
        biases = [bias_of(member) for member in members]
        if len(members) < 2 or any(biases) != all(biases):
            continue
        name = f"packed_{index}"
        weights = [onnx.numpy_helper.to_array(initializers[member.input[1]]) for member in members]
        graph.initializer.extend([
            onnx.numpy_helper.from_array(np.concatenate(weights, axis=1), f"{name}_weight"),
            onnx.numpy_helper.from_array(np.array([w.shape[1] for w in weights], dtype=np.int64), f"{name}_split"),
        ])
        nodes = [helper.make_node("MatMul", [source, f"{name}_weight"], [f"{name}_product"], name=name)]
        ends = members
        if all(biases):
            adds = [add for add, _ in biases]
            packed_bias = np.concatenate([onnx.numpy_helper.to_array(initializers[b]) for _, b in biases])
            graph.initializer.append(onnx.numpy_helper.from_array(packed_bias, f"{name}_bias"))
            nodes.append(helper.make_node("Add", [f"{name}_product", f"{name}_bias"], [f"{name}_biased"],
                                          name=f"{name}_add"))
            removed.update(id(add) for add in adds)
            ends = adds
        nodes.append(helper.make_node("Split", [nodes[-1].output[0], f"{name}_split"],
                                      [end.output[0] for end in ends], axis=-1, name=f"{name}_split"))
        replaced[id(members[0])] = nodes
        removed.update(id(member) for member in members)
        merged += len(members) - 1
    if not merged:
        return 0
    # the packed nodes take the first member's place: every member and consumer comes after it
    order: list[onnx.NodeProto] = []
    for node in graph.node:
        order.extend(replaced.get(id(node), []))
        if id(node) not in removed:
            order.append(node)
    del graph.node[:]
    graph.node.extend(order)
    prune(model)
    return merged


def perm(node: onnx.NodeProto) -> list[int] | None:
    for attribute in node.attribute:
        if attribute.name == "perm":
            return list(attribute.ints)
    return None


def set_io_shapes(model: onnx.ModelProto, shapes: dict[str, Sequence[int | str]]) -> None:
    """Overwrite the declared shapes of graph inputs/outputs (the exporter sometimes records the
    example's sizes for dynamic axes) and drop intermediate shape annotations."""
    for value in [*model.graph.input, *model.graph.output]:
        if value.name not in shapes:
            continue
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for size in shapes[value.name]:
            dim = dims.add()
            if isinstance(size, str):
                dim.dim_param = size
            else:
                dim.dim_value = size
    del model.graph.value_info[:]


def add_top_k(model: onnx.ModelProto, eos_id: int) -> None:
    """Give a decoder step graph the outputs the serving search reads instead of the whole
    distribution (in place): ``top_ids`` / ``top_log_probs`` [batch, top_k], the ``top_k`` best tokens
    of each row (``TopK``: best first, ties to the lower id, like arg-max), and ``eos_log_prob`` [batch]
    for rows that must end. ``top_k`` is an int64 [1] input defaulting to 1; ``log_probs`` stays an output
    (the parity checks read it) but is no longer copied out of ONNX Runtime at every step."""
    graph = model.graph
    ids, top_scores, eos_scores = TOP_K_OUTPUTS
    graph.input.append(helper.make_tensor_value_info(TOP_K_INPUT, TensorProto.INT64, [1]))
    graph.initializer.extend([
        onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), TOP_K_INPUT),  # the default
        onnx.numpy_helper.from_array(np.array(eos_id, dtype=np.int64), "eos_id"),
    ])
    graph.node.extend([
        helper.make_node("TopK", ["log_probs", TOP_K_INPUT], [top_scores, ids], axis=-1, largest=1, sorted=1),
        helper.make_node("Gather", ["log_probs", "eos_id"], [eos_scores], axis=1),
    ])
    graph.output.extend([
        helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "top_k"]),
        helper.make_tensor_value_info(top_scores, TensorProto.FLOAT, ["batch", "top_k"]),
        helper.make_tensor_value_info(eos_scores, TensorProto.FLOAT, ["batch"]),
    ])


def count_ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


def fused_op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Counts of the fused operators in a graph: every ``com.microsoft`` op plus standard fused ops."""
    counts: Counter[str] = Counter()
    for node in model.graph.node:
        if node.domain == "com.microsoft":
            counts[f"com.microsoft.{node.op_type}"] += 1
        elif node.op_type in FUSED_STANDARD_OPS:
            counts[node.op_type] += 1
    return dict(sorted(counts.items()))


# --------------------------------------------------------------------------------------------------
# Running the graphs with ONNX Runtime (verification; the serving engine has its own numpy runner)


def session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


class OrtModel:
    """An exported model version run by ONNX Runtime behind the reference search's step contract.

    State dicts hold torch tensors (converted from/to numpy around each ``session.run``) so
    :func:`export.search.beam_search` can reorder them with ``Seq2SeqModel.reorder_state``.
    """

    def __init__(
        self,
        files: dict[str, Path],
        decoder_static: Sequence[str],
        decoder_state: Sequence[StateTensor],
        *,
        start_id: int,
        eos_id: int,
        pad_id: int,
        threads: int = 1,
    ) -> None:
        options = session_options(threads)
        providers = ["CPUExecutionProvider"]
        self.sessions = {role: ort.InferenceSession(str(path), options, providers=providers)
                         for role, path in files.items()}
        self.decoder_static = list(decoder_static)
        self.decoder_state = list(decoder_state)
        self.start_id, self.eos_id, self.pad_id = start_id, eos_id, pad_id

    @classmethod
    def from_manifest(cls, version_dir: str | Path, manifest: Manifest, threads: int = 1) -> OrtModel:
        version_dir = Path(version_dir)
        ids = manifest.special_ids
        return cls(
            {role: version_dir / name for role, name in manifest.graphs.items()},
            manifest.decoder_static, manifest.decoder_state,
            start_id=ids["decoder_start"], eos_id=ids["eos"], pad_id=ids["pad"], threads=threads,
        )

    def initial_state(self, src: np.ndarray) -> dict[str, Tensor]:
        """``src`` int64 [B, S] -> static inputs + initial recurrent state, as torch tensors."""
        session = self.sessions["encoder"]
        names = [output.name for output in session.get_outputs()]
        encoded = dict(zip(names, session.run(None, {"src_ids": src.astype(np.int64)}), strict=True))
        state = {name: torch.from_numpy(encoded[name]) for name in self.decoder_static}
        for entry in self.decoder_state:
            if entry.init == "encoder":
                state[entry.input] = torch.from_numpy(encoded[entry.input])
            else:
                state[entry.input] = torch.zeros((src.shape[0], *entry.shape), dtype=getattr(torch, entry.dtype))
        return state

    def step(
        self, tokens: Tensor, state: dict[str, Tensor], need_attention: bool = False
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """tokens [B] -> (log-probs [B, V], attention [B, S] or None, new state)."""
        session = self.sessions["decoder_attention" if need_attention else "decoder"]
        feeds = {"input_ids": tokens.numpy().astype(np.int64)}
        feeds.update({name: value.contiguous().numpy() for name, value in state.items()})
        names = ["log_probs"] + [entry.output for entry in self.decoder_state]
        if need_attention:
            names.append("attention")
        outputs = session.run(names, feeds)
        new_state = dict(state)
        for k, entry in enumerate(self.decoder_state):
            new_state[entry.input] = torch.from_numpy(outputs[1 + k])
        attention = torch.from_numpy(outputs[-1]) if need_attention else None
        return torch.from_numpy(outputs[0]), attention, new_state

    def step_fn(self, need_attention: bool) -> StepFn:
        def step(tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
            return self.step(tokens, state, need_attention)

        return step

    def translate_ids(
        self,
        source_ids: list[int],
        *,
        beam_size: int = 1,
        num_hypotheses: int = 1,
        max_length: int = 256,
        length_penalty: float = 1.0,
        need_attention: bool = False,
    ) -> list[Hypothesis]:
        """The ONNX twin of :func:`export.search.translate_ids` (same search, same length rule)."""
        state = self.initial_state(np.array([source_ids], dtype=np.int64))
        return beam_search(
            self.step_fn(need_attention), state, start_id=self.start_id, eos_id=self.eos_id,
            beam_size=beam_size, num_hypotheses=num_hypotheses,
            max_length=max_target_length(len(source_ids), max_length), length_penalty=length_penalty,
        )

    def greedy_batch(self, sources: Sequence[list[int]], batch_size: int = 32) -> list[list[int]]:
        """Batched greedy decoding (same rule as :func:`export.search.greedy_batch`), EOS stripped."""
        results: list[list[int]] = [[] for _ in sources]
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            src = pad_rows([sources[i] for i in chunk], self.pad_id)
            state = self.initial_state(src)
            max_length = max_target_length(src.shape[1])
            tokens = torch.full((len(chunk),), self.start_id, dtype=torch.long)
            done = torch.zeros(len(chunk), dtype=torch.bool)
            outputs: list[Tensor] = []
            for t in range(max_length):
                log_probs, _, state = self.step(tokens, state)
                tokens = log_probs.argmax(-1) if t < max_length - 1 else torch.full_like(tokens, self.eos_id)
                tokens = tokens.masked_fill(done, self.pad_id)
                outputs.append(tokens)
                done |= tokens == self.eos_id
                if bool(done.all()):
                    break
            for row, i in zip(torch.stack(outputs, 1).tolist(), chunk, strict=True):
                results[i] = row[: row.index(self.eos_id)] if self.eos_id in row else row
        return results


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
    width = max(len(row) for row in rows)
    array = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array


# --------------------------------------------------------------------------------------------------
# Parity


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

    def ok(self, tolerance: float = LOGIT_TOLERANCE) -> bool:
        return (
            self.max_logit_diff <= tolerance
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
        }


@torch.no_grad()
def check_parity(
    model: Seq2SeqModel,
    onnx_model: OrtModel,
    sources: Sequence[list[int]],
    targets: Sequence[list[int]],
    *,
    beam_size: int = 4,
    max_target_steps: int = 64,
) -> ParityReport:
    """Compare ONNX Runtime with PyTorch on ``sources`` (ids ending with EOS).

    Teacher-forced steps over ``targets`` (the whole batch at once, so padding is exercised) compare
    log-probabilities (``decoder.onnx``) and attention (``decoder_attention.onnx``) at every real
    position; then greedy and beam search run one sentence at a time through both and must agree.
    """
    model.eval()
    cfg = model.config
    src = pad_rows(sources, cfg.pad_id)
    tgt_in = [[cfg.decoder_start_id] + list(target)[: max_target_steps - 1] for target in targets]
    lengths = torch.tensor([len(row) for row in tgt_in])
    tgt = torch.from_numpy(pad_rows(tgt_in, cfg.pad_id))
    torch_state = model.init_state(model.encode(torch.from_numpy(src)))
    onnx_state = onnx_model.initial_state(src)
    max_logit = max_attention = max_row_error = 0.0
    steps = 0
    for t in range(tgt.shape[1]):
        rows = lengths > t
        logits, attention, torch_state = model.decode_step(tgt[:, t], torch_state, need_attention=True)
        log_probs = logits.float().log_softmax(-1)
        onnx_log_probs, _, next_state = onnx_model.step(tgt[:, t], onnx_state, need_attention=False)
        _, onnx_attention, _ = onnx_model.step(tgt[:, t], onnx_state, need_attention=True)
        onnx_state = next_state
        max_logit = max(max_logit, float((onnx_log_probs - log_probs)[rows].abs().max()))
        max_attention = max(max_attention, float((onnx_attention - attention)[rows].abs().max()))
        max_row_error = max(max_row_error, float((onnx_attention[rows].sum(-1) - 1).abs().max()))
        steps += int(rows.sum())

    greedy = beam = 0
    mismatches: list[str] = []
    for index, source in enumerate(sources):
        for size in (1, beam_size):
            reference = translate_ids(model, list(source), beam_size=size)[0].tokens
            candidate = onnx_model.translate_ids(list(source), beam_size=size)[0].tokens
            if reference == candidate:
                greedy += size == 1
                beam += size != 1
            else:
                mismatches.append(f"sentence {index}, beam {size}: torch {reference} vs onnx {candidate}")
    return ParityReport(
        max_logit_diff=max_logit, max_attention_diff=max_attention, max_attention_row_error=max_row_error,
        greedy_match=(greedy, len(sources)), beam4_match=(beam, len(sources)), sentences=len(sources),
        teacher_forced_steps=steps, mismatches=mismatches,
    )


# --------------------------------------------------------------------------------------------------
# Quantization


def gemm_to_matmul(model: onnx.ModelProto) -> int:
    """Rewrite ``Gemm(x, W, b, transB=1)`` with constant ``W`` as ``MatMul(x, W^T) + b`` (in place), so
    dynamic quantization, which skips Gemm, covers those layers too. Returns the number rewritten."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "Gemm"
            or node.input[1] not in initializers
            or attributes.get("transA", 0)
            or attributes.get("alpha", 1.0) != 1.0
            or attributes.get("beta", 1.0) != 1.0
        ):
            nodes.append(node)
            continue
        weight = onnx.numpy_helper.to_array(initializers[node.input[1]])
        if attributes.get("transB", 0):
            weight = weight.T
        name = f"{node.input[1]}__matmul_{rewritten}"
        graph.initializer.append(onnx.numpy_helper.from_array(np.ascontiguousarray(weight), name))
        product = node.output[0] + "__matmul" if len(node.input) > 2 and node.input[2] else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.name}_matmul"))
        if product != node.output[0]:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    prune(model)
    return rewritten


def quantize_int8(source: Path, target: Path, *, per_channel: bool) -> None:
    """Dynamic int8 quantization of the MatMul weights (GRU and attention kernels stay fp32)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source))
    gemm_to_matmul(model)
    prepared = target.with_suffix(".fp32.onnx")
    onnx.save(model, str(prepared))
    try:
        with _quiet():
            quantize_dynamic(
                prepared, target, op_types_to_quantize=["MatMul"], per_channel=per_channel,
                weight_type=QuantType.QInt8,
                # onnx shape inference cannot type the outputs of com.microsoft ops; all tensors are float
                extra_options={"DefaultTensorType": TensorProto.FLOAT},
            )
    except Exception as error:
        raise NmtError(f"int8 quantization of {source.name} failed: {type(error).__name__}: {error}") from error
    finally:
        prepared.unlink(missing_ok=True)
    quantized = onnx.load(str(target))
    if quantized.ir_version > MAX_IR_VERSION:
        quantized.ir_version = MAX_IR_VERSION
        onnx.save(quantized, str(target))


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    import sacrebleu

    return round(float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score), 2)


# --------------------------------------------------------------------------------------------------
# The export command


@dataclass
class ExportOptions:
    """Everything ``nmt export`` takes (see :mod:`export.export_cli` for the flags' help)."""

    checkpoint: str  # run directory (best.pt + spm.model) or a checkpoint file with spm.model beside it
    name: str
    version: str | None = None  # default: next integer after the existing versions
    repository: str = "models"
    quantize: str | None = None  # None or "int8"
    per_channel: bool = False  # per-tensor scales measured closer to fp32 on the dates models
    force: bool = False
    opset: int = 18
    parity_sentences: int = 20
    # fp32 log-prob/attention tolerance; 1e-4 holds for trained models, random large-vocabulary weights
    # (benchmarks) have logits in the hundreds where kernel reassociation alone moves them ~1e-3
    parity_tolerance: float = LOGIT_TOLERANCE
    bleu_sentences: int = 200
    allow_unfused: bool = False
    source_language: str = "en"
    target_language: str = "de"
    beam_size: int = 4  # serving defaults recorded in the manifest
    length_penalty: float = 1.0
    max_length: int = 256
    threads: int = 1  # ONNX Runtime and torch threads while verifying
    progress: bool = True


@dataclass
class ExportResult:
    version_dir: Path
    manifest: Manifest
    parity: ParityReport
    parity_int8: ParityReport | None = None


@dataclass
class _Inputs:
    checkpoint: Path
    run_dir: Path
    model: Seq2SeqModel
    payload: dict[str, Any]
    tokenizer: Tokenizer
    summary: dict[str, Any]
    pairs: list[tuple[str, str]]  # held-out (source, target) texts; empty if the run has no test.tsv


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """A run directory or a checkpoint file -> (checkpoint file, directory holding spm.model)."""
    path = Path(path)
    if path.is_dir():
        checkpoint = path / "best.pt"
        if not checkpoint.is_file():
            raise NmtError(f"{path} holds no best.pt; pass a training run directory or a checkpoint file")
        return checkpoint, path
    if not path.exists():
        raise NmtError(f"checkpoint not found: {path}")
    return path, path.parent


def _load_inputs(options: ExportOptions) -> _Inputs:
    from export.data import load_tsv

    checkpoint, run_dir = resolve_checkpoint(options.checkpoint)
    spm_path = run_dir / MODEL_FILENAME
    if not spm_path.is_file():
        raise NmtError(f"tokenizer not found: {spm_path} (the run directory's {MODEL_FILENAME} must sit beside "
                       f"the checkpoint)")
    model, payload = load_checkpoint(checkpoint)
    try:
        tokenizer = Tokenizer.load(run_dir)
    except Exception as error:
        raise NmtError(f"cannot load tokenizer {spm_path}: {error}") from error
    cfg = model.config
    if tokenizer.vocab_size != cfg.vocab_size:
        raise NmtError(f"tokenizer {spm_path} has {tokenizer.vocab_size} pieces but the model expects "
                       f"{cfg.vocab_size}: they come from different runs")
    summary: dict[str, Any] = {}
    if (run_dir / "summary.json").is_file():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError as error:
            raise NmtError(f"cannot read {run_dir / 'summary.json'}: {error}") from error
    pairs: list[tuple[str, str]] = []
    if (run_dir / "test.tsv").is_file():
        pairs = [(p.source, p.target) for p in load_tsv(run_dir / "test.tsv")]
    if options.quantize and not pairs:
        raise NmtError(f"--quantize {options.quantize} scores held-out BLEU and needs {run_dir / 'test.tsv'}")
    return _Inputs(checkpoint, run_dir, model, payload, tokenizer, summary, pairs)


def _validate_options(options: ExportOptions) -> None:
    if not NAME_PATTERN.match(options.name):
        raise NmtError(f"bad model name {options.name!r}: use letters, digits, '.', '_' and '-'")
    if options.version is not None and not NAME_PATTERN.match(options.version):
        raise NmtError(f"bad version {options.version!r}: use letters, digits, '.', '_' and '-'")
    if options.quantize not in (None, "int8"):
        raise NmtError(f"unknown quantization {options.quantize!r}; the only choice is int8")
    if options.opset not in OPSETS:
        raise NmtError(f"opset {options.opset} is not supported; choose {OPSETS.start}..{OPSETS.stop - 1}")
    if options.parity_sentences < 1:
        raise NmtError("--parity-sentences must be at least 1")
    if options.beam_size < 1 or options.max_length < 1:
        raise NmtError("--beam-size and --max-length must be positive")


def next_version(model_dir: Path) -> str:
    """One more than the largest integer version directory (1 for a new model)."""
    if not model_dir.is_dir():
        return "1"
    numbers = [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    return str(max(numbers, default=0) + 1)


def _parity_pairs(inputs: _Inputs, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out sentences as ids (sources end with EOS); random id strings if the run has no test.tsv."""
    cfg = inputs.model.config
    if inputs.pairs:
        chosen = inputs.pairs[:count]
        sources = [ids + [cfg.eos_id] for ids in inputs.tokenizer.encode_batch([s for s, _ in chosen])]
        targets = inputs.tokenizer.encode_batch([t for _, t in chosen])
        return sources, targets
    generator = torch.Generator().manual_seed(0)
    special = {cfg.pad_id, cfg.bos_id, cfg.eos_id, UNK_ID}
    ordinary = torch.tensor([i for i in range(cfg.vocab_size) if i not in special])
    sources, targets = [], []
    for _ in range(count):
        length = int(torch.randint(3, 12, (1,), generator=generator))
        picks = ordinary[torch.randint(len(ordinary), (2, length), generator=generator)]
        sources.append(picks[0].tolist() + [cfg.eos_id])
        targets.append(picks[1].tolist())
    return sources, targets


def _training_info(inputs: _Inputs) -> dict[str, Any]:
    summary, payload = inputs.summary, inputs.payload
    train_config = summary.get("train_config") or payload.get("train_config") or {}
    return {
        "corpus": summary.get("corpus", train_config.get("corpus")),
        "valid_bleu": summary.get("best_valid_bleu", payload.get("valid_bleu")),
        "test_bleu": summary.get("test_bleu"),
        "steps": summary.get("steps", payload.get("step")),
        "checkpoint_step": payload.get("step"),
    }


def _save(model: onnx.ModelProto, path: Path) -> None:
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, str(path))


class _Stages:
    """The progress bar over the export's stages."""

    def __init__(self, names: Sequence[str], enabled: bool) -> None:
        self.bar = tqdm(total=len(names), disable=not enabled, unit="stage", dynamic_ncols=True, leave=False)
        self.started = False

    def __call__(self, name: str) -> None:
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_description(name)

    def close(self) -> None:
        if self.started:
            self.bar.update(1)
        self.bar.close()


def export_model(options: ExportOptions) -> ExportResult:
    """Run the whole export (see the module docstring); returns the new version and its manifest."""
    _validate_options(options)
    names = ["validate", "export graphs", "verify parity"] + (["quantize int8"] if options.quantize else []) + ["write"]
    stage = _Stages(names, options.progress)
    created: list[Path] = []
    try:
        with torch_threads(options.threads):
            stage("validate")
            inputs = _load_inputs(options)
            model_dir = Path(options.repository) / options.name
            version = options.version or next_version(model_dir)
            version_dir = model_dir / version
            if version_dir.exists() and not options.force:
                raise NmtError(f"{version_dir} already exists; use --force to overwrite it or --version for another")
            for directory in reversed([model_dir, *model_dir.parents]):
                if not directory.exists():
                    directory.mkdir()
                    created.append(directory)
            with tempfile.TemporaryDirectory(prefix=f".export-{version}-", dir=model_dir) as tmp:
                result = _export(options, inputs, version, Path(tmp), stage)
                _move_into_place(result.version_dir, version_dir, Path(tmp))
                result.version_dir = version_dir
            created.clear()
            return result
    finally:
        stage.close()
        for directory in reversed(created):  # a failed first export leaves no empty model directory
            with contextlib.suppress(OSError):
                directory.rmdir()


def _export(options: ExportOptions, inputs: _Inputs, version: str, work: Path, stage: _Stages) -> ExportResult:
    """Export, verify (and quantize) into ``work``; returns the result with ``version_dir`` = ``work/version``."""
    model = inputs.model
    cfg = model.config
    stage("export graphs")
    graph_set = graph_exporter(model.arch)(model, options.opset)
    if graph_set.attention_fused < graph_set.attention_total and not options.allow_unfused:
        raise NmtError(
            f"only {graph_set.attention_fused} of {graph_set.attention_total} attention blocks were fused into "
            "com.microsoft.MultiHeadAttention; use --allow-unfused to export anyway"
        )
    for graph in graph_set.graphs().values():
        pack_parallel_matmuls(graph)
    for step_graph in (graph_set.decoder, graph_set.decoder_attention):
        add_top_k(step_graph, cfg.eos_id)
    fp32_files = {role: work / "fp32" / GRAPH_FILES[role] for role in GRAPH_FILES}
    fp32_files["encoder"].parent.mkdir()
    for role, graph in graph_set.graphs().items():
        _save(graph, fp32_files[role])

    stage("verify parity")
    sources, targets = _parity_pairs(inputs, options.parity_sentences)
    runner = dict(start_id=cfg.decoder_start_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id, threads=options.threads)
    fp32_model = OrtModel(fp32_files, graph_set.decoder_static, graph_set.decoder_state, **runner)
    parity = check_parity(model, fp32_model, sources, targets, beam_size=4)
    if not parity.ok(options.parity_tolerance):
        details = "; ".join(parity.mismatches[:3])
        raise NmtError(
            f"ONNX parity check failed: max log-prob diff {parity.max_logit_diff:.2e}, max attention diff "
            f"{parity.max_attention_diff:.2e} (tolerance {options.parity_tolerance:g}), greedy "
            f"{parity.greedy_match[0]}/{parity.greedy_match[1]}, beam-4 {parity.beam4_match[0]}/"
            f"{parity.beam4_match[1]} identical" + (f"; {details}" if details else "")
        )
    files, parity_int8, quantization = fp32_files, None, None
    parity_record = {"precision": "fp32", "enforced": True, **parity.to_dict(),
                     "tolerance": options.parity_tolerance}

    if options.quantize:
        stage("quantize int8")
        files = {role: work / "int8" / GRAPH_FILES[role] for role in GRAPH_FILES}
        files["encoder"].parent.mkdir()
        for role in GRAPH_FILES:
            quantize_int8(fp32_files[role], files[role], per_channel=options.per_channel)
        int8_model = OrtModel(files, graph_set.decoder_static, graph_set.decoder_state, **runner)
        parity_int8 = check_parity(model, int8_model, sources, targets, beam_size=4)
        parity_record = {"precision": "int8", "enforced": False, **parity_int8.to_dict(), "fp32": parity_record}
        quantization = _bleu_comparison(inputs, options, fp32_model, int8_model)

    stage("write")
    out = work / "version"
    out.mkdir()
    for role, path in files.items():
        shutil.copyfile(path, out / GRAPH_FILES[role])
    inputs.tokenizer.save(out)
    manifest = Manifest(
        name=options.name,
        version=version,
        architecture=model.arch,
        source_language=options.source_language,
        target_language=options.target_language,
        vocab_size=cfg.vocab_size,
        dimensions=dataclasses.asdict(cfg),
        special_ids={"pad": cfg.pad_id, "unk": UNK_ID, "bos": cfg.bos_id, "eos": cfg.eos_id,
                     "decoder_start": cfg.decoder_start_id},
        opset=options.opset,
        onnxruntime_version=ort.__version__,
        precision="int8" if options.quantize else "fp32",
        graphs=dict(GRAPH_FILES),
        decoder_static=graph_set.decoder_static,
        decoder_state=graph_set.decoder_state,
        static_src_axes=graph_set.static_src_axes,
        tokenizer=MODEL_FILENAME,
        fused_ops={role: fused_op_counts(onnx.load(str(path))) for role, path in files.items()},
        attention_blocks={"fused": graph_set.attention_fused, "total": graph_set.attention_total},
        parity=parity_record,
        training=_training_info(inputs),
        quantization=quantization,
        defaults={"beam_size": options.beam_size, "length_penalty": options.length_penalty,
                  "max_length": options.max_length},
        files={name: sha256_file(out / name) for name in [*GRAPH_FILES.values(), MODEL_FILENAME]},
        created=datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
    )
    write_manifest(manifest, out)
    return ExportResult(version_dir=out, manifest=manifest, parity=parity, parity_int8=parity_int8)


def _bleu_comparison(inputs: _Inputs, options: ExportOptions, fp32: OrtModel, int8: OrtModel) -> dict[str, Any]:
    """Greedy held-out BLEU of the fp32 and int8 graphs (ONNX Runtime, sacrebleu)."""
    pairs = inputs.pairs[: options.bleu_sentences]
    eos = inputs.model.config.eos_id
    sources = [ids + [eos] for ids in inputs.tokenizer.encode_batch([source for source, _ in pairs])]
    references = [target for _, target in pairs]
    scores = {}
    for label, runner in (("fp32", fp32), ("int8", int8)):
        outputs = runner.greedy_batch(sources)
        scores[label] = corpus_bleu([inputs.tokenizer.decode(ids) for ids in outputs], references)
    return {
        "method": "onnxruntime quantize_dynamic: int8 MatMul weights, "
        + ("per-channel" if options.per_channel else "per-tensor") + " scales",
        "bleu_fp32": scores["fp32"],
        "bleu_int8": scores["int8"],
        "delta": round(scores["int8"] - scores["fp32"], 2),
        "test_sentences": len(pairs),
    }


def _move_into_place(new: Path, target: Path, scratch: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` (``--force``) is moved aside first."""
    old = None
    if target.exists():
        old = scratch / "replaced"
        os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        if old is not None:
            os.replace(old, target)
        raise


def manifest_summary(manifest: Manifest) -> str:
    """A few lines for the terminal after an export."""
    parity = manifest.parity
    lines = [
        f"{manifest.name}/{manifest.version}: {manifest.architecture}, {manifest.precision}, opset {manifest.opset}",
        f"  attention blocks fused: {manifest.attention_blocks.get('fused')}/{manifest.attention_blocks.get('total')}",
        "  fused ops: " + "; ".join(
            f"{role} " + ", ".join(f"{op.removeprefix('com.microsoft.')} {n}" for op, n in ops.items())
            for role, ops in manifest.fused_ops.items()
        ),
        f"  parity: max log-prob diff {parity.get('max_logit_diff')}, max attention diff "
        f"{parity.get('max_attention_diff')}, greedy {parity.get('greedy_match')}, beam-4 {parity.get('beam4_match')}",
    ]
    if manifest.quantization:
        q = manifest.quantization
        lines.append(f"  BLEU on {q['test_sentences']} held-out sentences: fp32 {q['bleu_fp32']}, "
                     f"int8 {q['bleu_int8']} (delta {q['delta']:+})")
    return "\n".join(lines)


__all__ = [
    "EXPORTERS", "GRAPH_FILES", "LOGIT_TOLERANCE", "ExportOptions", "ExportResult", "GraphSet", "OrtModel",
    "ParityReport", "check_parity", "export_model", "fused_op_counts", "register_exporter", "MANIFEST_FILENAME",
]
