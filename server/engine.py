"""ONNX Runtime decoding engine: batched greedy and beam search over exported model versions.

No torch here. The engine is architecture-agnostic: the manifest names the decoder's static inputs
(encoder outputs fed unchanged every step) and its recurrent state (input -> output pairs), and
:class:`server.decode.RunningDecode` drives any model through the :class:`StepModel` contract. On the
CPU the state lives in NumPy arrays that share ONNX Runtime's memory; with CUDA it stays on the GPU
(:class:`DeviceStepModel`).

The provider an :class:`Engine` reports is the one its sessions really got (:mod:`server.device`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from nmt.errors import NmtError
from nmt.model_format.manifest import FORMAT, TOP_K_INPUT, TOP_K_OUTPUTS, Manifest, ManifestError, read_manifest
from nmt.model_format.tokenizer import AnyTokenizer, load_tokenizer
from server.alignment import merge_to_words, segment_words
from server.decode import RunningDecode
from server.device import (
    CUDA,
    DeviceSettings,
    check_provider,
    is_out_of_memory,
    provider_list,
    runtime_build,
    session_provider,
)
from server.errors import DeviceMemoryExhausted, InvalidArgument
from server.search import BeamSentence, SearchResult, StepOutput, concat_rows, take_rows
from server.types import DecodingOptions, Hypothesis, SentenceRequest, Translation


@dataclass
class BatchResult:
    """What one :meth:`Engine.translate_batch` call produced and cost."""

    translations: list[Translation | None]  # None for sentences cancelled mid-way
    encode_seconds: float
    decode_seconds: float
    generated_tokens: int
    source_tokens: int
    padding_ratio: float  # padded positions / all positions of the source batch
    cancelled: int  # sentences that left the batch because their request was cancelled or expired


class OnnxStepModel:
    """The :class:`server.search.StepModel` of an exported model version: encoder + one-step decoder."""

    def __init__(self, manifest: Manifest, sessions: dict[str, ort.InferenceSession]) -> None:
        self.manifest = manifest
        self.sessions = sessions
        self.static_names = list(manifest.decoder_static)
        self.state = list(manifest.decoder_state)
        for role in ("decoder", "decoder_attention"):
            missing = set(TOP_K_OUTPUTS) - {o.name for o in sessions[role].get_outputs()}
            if missing:
                raise ManifestError(f"the {role} graph lacks the outputs {sorted(missing)} of the {FORMAT} "
                                    "format: export the model again with this version of nmt export")
        self._top_k_feeds: dict[int, np.ndarray] = {}  # k -> the int64 [1] feed (built once, not every step)
        # rows may decode at different steps (continuous batching) when no state grows with the step
        # (an RNN: its step reads no target position)
        self.per_row_positions = all(entry.init != "empty" for entry in self.state)

    def encode(self, src: np.ndarray) -> dict[str, np.ndarray]:
        """``src`` [B, S] int64 -> the decoder's static inputs and initial state, per sentence (batch first)."""
        outputs = self.sessions["encoder"].run(None, {"src_ids": src})
        names = [o.name for o in self.sessions["encoder"].get_outputs()]
        encoded = dict(zip(names, outputs, strict=True))
        batch = src.shape[0]
        for entry in self.state:
            if entry.init == "empty":
                encoded[entry.input] = np.zeros((batch, *entry.shape), dtype=entry.dtype or "float32")
        return encoded

    def step(
        self, tokens: np.ndarray, static: dict[str, np.ndarray], state: dict[str, np.ndarray], need_attention: bool,
        k: int, full: bool = False, positions: np.ndarray | None = None,
    ) -> StepOutput:
        """One decoding step (see :class:`server.search.StepModel`): only the ``k`` best tokens of each
        row leave ONNX Runtime, not the [R, V] distribution, unless ``full`` asks for it. ``positions``
        is not fed: only a position-free model takes it (:attr:`per_row_positions`)."""
        session = self.sessions["decoder_attention" if need_attention else "decoder"]
        feeds = {"input_ids": tokens, **static, **state, TOP_K_INPUT: self._top_k(k)}
        output_names = TOP_K_OUTPUTS + [entry.output for entry in self.state]
        if need_attention:
            output_names.append("attention")
        if full:
            output_names.append("log_probs")
        outputs = session.run(output_names, feeds)
        heads = len(TOP_K_OUTPUTS)
        new_state = {entry.input: outputs[heads + i] for i, entry in enumerate(self.state)}
        attention = outputs[heads + len(self.state)] if need_attention else None
        return StepOutput(*outputs[:heads], attention, new_state, outputs[-1] if full else None)

    def _top_k(self, k: int) -> np.ndarray:
        if k not in self._top_k_feeds:
            self._top_k_feeds[k] = np.array([min(k, self.manifest.vocab_size)], dtype=np.int64)
        return self._top_k_feeds[k]

    def select_rows(self, tensors: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
        return take_rows(tensors, rows)

    def concat_rows(self, first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return concat_rows(first, second)

    @property
    def state_names(self) -> list[str]:
        return [entry.input for entry in self.state]


class DeviceStepModel(OnnxStepModel):
    """:class:`OnnxStepModel` with I/O binding: the encoder outputs and the recurrent state (the
    Transformer's KV cache) stay on ``device`` as ``OrtValue`` buffers from step to step, and rows are
    selected there by a ``Gather`` graph. Each step sends the [R] token ids in and brings only the
    top-k, the EOS log-prob and (when asked) the attention back to the host.

    For CUDA, where copying the cache to the host and back at every step would dominate. On the CPU
    it gains nothing (NumPy arrays already share ONNX Runtime's memory) and serves to test the
    binding logic on machines without a GPU.

    The ``Gather`` sessions (one per element type of the static inputs and the state) are created
    here, at load, with the decoder's options and providers (device id and memory limit included)."""

    def __init__(self, manifest: Manifest, sessions: dict[str, ort.InferenceSession], device: str) -> None:
        super().__init__(manifest, sessions)
        self.device = device
        self._top_k_values: dict[int, ort.OrtValue] = {}  # k -> top_k as an OrtValue (wraps the cached feed)
        types = {o.type for o in sessions["encoder"].get_outputs()}
        types |= {o.type for o in sessions["decoder"].get_outputs() if o.name in {e.output for e in self.state}}
        self._gathers = {element_type: self._gather_session(element_type) for element_type in sorted(types)}

    def encode(self, src: np.ndarray) -> dict[str, ort.OrtValue]:
        session = self.sessions["encoder"]
        binding = session.io_binding()
        binding.bind_cpu_input("src_ids", src)
        names = [o.name for o in session.get_outputs()]
        for name in names:
            binding.bind_output(name, self.device)
        session.run_with_iobinding(binding)
        encoded = dict(zip(names, binding.get_outputs(), strict=True))
        for entry in self.state:
            if entry.init == "empty":
                zeros = np.zeros((src.shape[0], *entry.shape), dtype=entry.dtype or "float32")
                encoded[entry.input] = ort.OrtValue.ortvalue_from_numpy(zeros, self.device)
        return encoded

    def step(
        self, tokens: np.ndarray, static: dict[str, ort.OrtValue], state: dict[str, ort.OrtValue],
        need_attention: bool, k: int, full: bool = False, positions: np.ndarray | None = None,
    ) -> StepOutput:
        session = self.sessions["decoder_attention" if need_attention else "decoder"]
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", tokens)
        for name, value in (static | state).items():
            binding.bind_ortvalue_input(name, value)
        if k not in self._top_k_values:  # an overridable initializer: only an OrtValue binds to it
            self._top_k_values[k] = ort.OrtValue.ortvalue_from_numpy(self._top_k(k))
        binding.bind_ortvalue_input(TOP_K_INPUT, self._top_k_values[k])
        for name in TOP_K_OUTPUTS:
            binding.bind_output(name, "cpu")
        for entry in self.state:
            binding.bind_output(entry.output, self.device)
        if need_attention:
            binding.bind_output("attention", "cpu")
        if full:
            binding.bind_output("log_probs", "cpu")
        session.run_with_iobinding(binding)
        outputs = binding.get_outputs()  # in binding order
        heads = len(TOP_K_OUTPUTS)
        new_state = {entry.input: outputs[heads + i] for i, entry in enumerate(self.state)}
        attention = outputs[heads + len(self.state)].numpy() if need_attention else None
        return StepOutput(*(value.numpy() for value in outputs[:heads]), attention, new_state,
                          outputs[-1].numpy() if full else None)

    def select_rows(self, tensors: dict[str, ort.OrtValue], rows: np.ndarray) -> dict[str, ort.OrtValue]:
        selected = {}
        rows_value = ort.OrtValue.ortvalue_from_numpy(rows.astype(np.int64, copy=False), self.device)  # once
        for name, value in tensors.items():
            session = self._gathers[value.data_type()]
            binding = session.io_binding()
            binding.bind_ortvalue_input("x", value)
            binding.bind_ortvalue_input("rows", rows_value)
            binding.bind_output("y", self.device)
            session.run_with_iobinding(binding)
            selected[name] = binding.get_outputs()[0]
        return selected

    def concat_rows(self, first: dict[str, ort.OrtValue], second: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        """:func:`server.search.concat_rows` through the host: sentences join a running decode a few times per
        sentence, not every step, so the copy to the host and back is not worth a graph of its own."""
        joined = concat_rows({name: value.numpy() for name, value in first.items()},
                             {name: value.numpy() for name, value in second.items()})
        return {name: ort.OrtValue.ortvalue_from_numpy(value, self.device) for name, value in joined.items()}

    def _gather_session(self, element_type: str) -> ort.InferenceSession:
        """A one-node ``Gather(x, rows, axis=0)`` session for tensors of ``element_type`` ("tensor(float)")."""
        dtype = _ELEMENT_TYPES[element_type]
        graph = helper.make_graph(
            [helper.make_node("Gather", ["x", "rows"], ["y"], axis=0)], "select_rows",
            [helper.make_tensor_value_info("x", dtype, None),
             helper.make_tensor_value_info("rows", TensorProto.INT64, ["rows"])],
            [helper.make_tensor_value_info("y", dtype, None)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
        decoder = self.sessions["decoder"]
        options = decoder.get_provider_options()  # provider -> its options (device id, memory limit, ...)
        providers = [(name, options.get(name, {})) for name in decoder.get_providers()]
        return ort.InferenceSession(model.SerializeToString(), decoder.get_session_options(), providers=providers)

    @property
    def gather_sessions(self) -> dict[str, ort.InferenceSession]:
        """Element type -> the ``Gather`` session that selects rows of such tensors."""
        return self._gathers


_ELEMENT_TYPES = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16,
                  "tensor(int64)": TensorProto.INT64, "tensor(int32)": TensorProto.INT32,
                  "tensor(bool)": TensorProto.BOOL}


def session_options(intra_op_threads: int, inter_op_threads: int, *, spinning: bool) -> ort.SessionOptions:
    """ONNX Runtime options of a model version's sessions. With ``spinning``, idle workers busy-wait for
    the next operator only while a ``run`` is in progress (``session.force_spinning_stop``): each session
    has its own thread pool, and pools left spinning between runs fight each other, the Python search
    and the gRPC event loop for the cores."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1" if spinning else "0")
    return options


class Engine:
    """A loaded model version: tokenizer, ONNX Runtime sessions and batched search."""

    def __init__(self, manifest: Manifest, tokenizer: AnyTokenizer, model: OnnxStepModel, provider: str, *,
                 device_id: int = 0) -> None:
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.model = model
        self.provider = provider  # what the sessions really run on (``get_providers()[0]``)
        self.device = "cpu" if provider != CUDA else f"cuda:{device_id}"
        self.runtime_build = runtime_build()
        self.max_positions = int(manifest.dimensions.get("max_positions") or 0)  # 0: no position table
        ids = manifest.special_ids
        self.eos_id, self.pad_id, self.start_id = ids["eos"], ids["pad"], ids["decoder_start"]

    @classmethod
    def load(
        cls,
        version_dir: str | Path,
        *,
        provider: str = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        spinning: bool = True,
        device_state: bool | None = None,
        device_id: int = 0,
        gpu_mem_limit: int = 0,
        cuda_tf32: bool = False,
    ) -> Engine:
        """Load ``models/<name>/<version>/``: validate the manifest, open every graph.

        ``spinning``: while a ``run`` is in progress, idle worker threads busy-wait for the next operator
        instead of sleeping; they stop when it returns (:func:`session_options`). On 2 cores it makes
        the SMALL engine 1.5-1.6x faster at batch 1 and the server 1.05-1.6x faster at 1-128 callers
        with no more CPU per request (benchmarks/README.md). Turn it off where other processes need
        the cores more than inference does.

        ``device_state``: keep the encoder outputs and the KV cache on the execution provider's device
        between steps (:class:`DeviceStepModel`, I/O binding). Default: on for CUDA, off for the CPU.

        ``device_id``, ``gpu_mem_limit`` (bytes per session arena, 0: unbounded) and ``cuda_tf32`` go to
        every CUDA session (:class:`server.device.DeviceSettings`). The provider is read back from the
        sessions: an explicit ``cuda`` that fell back to the CPU raises :class:`NmtError` naming the
        reason; ``auto`` logs the fallback. An int8 version is refused on CUDA (its ``MatMulInteger``
        nodes run on the CPU, copying every step between host and device): export fp16 for GPUs.
        """
        version_dir = Path(version_dir)
        manifest = read_manifest(version_dir)
        settings = DeviceSettings(provider, device_id, gpu_mem_limit, cuda_tf32)
        providers = provider_list(settings)
        options = session_options(intra_op_threads, inter_op_threads, spinning=spinning)
        sessions = {
            role: ort.InferenceSession(str(version_dir / filename), options, providers=providers)
            for role, filename in manifest.graphs.items()
        }
        got = session_provider(sessions)
        check_provider(provider, providers, got)
        on_gpu = got == CUDA
        if on_gpu and manifest.precision == "int8":
            raise NmtError("an int8 version cannot run on CUDA (DynamicQuantizeLinear/MatMulInteger have no CUDA "
                           "kernels); export with --precision fp16 for GPUs, or serve it with --provider cpu")
        tokenizer = load_tokenizer(version_dir, manifest.tokenizer_type)
        if device_state or (device_state is None and on_gpu):
            model = DeviceStepModel(manifest, sessions, "cuda" if on_gpu else "cpu")
        else:
            model = OnnxStepModel(manifest, sessions)
        return cls(manifest, tokenizer, model, got, device_id=device_id)

    def tokenize(self, text: str) -> list[int]:
        """Subword ids of ``text`` (EOS excluded)."""
        return self.tokenizer.encode(text)

    def language_prefix(self, language: str) -> list[int]:
        """The source prefix that asks for target ``language``: ``[id of >>language<<]`` for a multilingual
        Marian model, ``[]`` for none asked or the model's own target language; else InvalidArgument."""
        languages = self.manifest.target_languages
        if not language or (not languages and language == self.manifest.target_language):
            return []
        token = self.tokenizer.language_id(language) if languages else None
        if token is None:
            known = ", ".join(languages or [self.manifest.target_language])
            raise InvalidArgument(f"target_language {language!r} is not served by {self.manifest.name}; "
                                  f"choose {known}")
        return [token]

    def default_options(self) -> DecodingOptions:
        defaults = self.manifest.defaults
        beam = int(defaults.get("beam_size", 4))
        return DecodingOptions(
            beam_size=beam,
            num_hypotheses=1,
            max_length=int(defaults.get("max_length", 256)),
            length_penalty=float(defaults.get("length_penalty", 1.0)),
        )

    def translate(self, texts: Sequence[str], options: DecodingOptions | None = None) -> list[Translation]:
        """Translate ``texts`` in one batch (convenience for scripts and tests)."""
        options = options or self.default_options()
        requests = [SentenceRequest(self.tokenize(text), options, text=text) for text in texts]
        return [t for t in self.translate_batch(requests).translations if t is not None]

    def translate_batch(self, requests: Sequence[SentenceRequest]) -> BatchResult:
        """Decode sentences together (a running decode that admits them all at its first step); their
        options may differ. Cancelled sentences leave the batch between steps."""
        if not requests:
            return BatchResult([], 0.0, 0.0, 0, 0, 0.0, 0)
        try:
            results, src, encode_seconds, decode_seconds = self._search(requests)
        except Exception as error:
            exhausted = self.memory_error(error, len(requests))
            if exhausted is None:
                raise
            raise exhausted from error
        translations = [
            None if result is None else self.to_translation(request, result)
            for request, result in zip(requests, results, strict=True)
        ]
        source_tokens = sum(len(r.source_ids) + 1 for r in requests)  # EOS included, padding not
        return BatchResult(
            translations=translations,
            encode_seconds=encode_seconds,
            decode_seconds=decode_seconds,
            generated_tokens=sum(len(h.tokens) for r in results if r is not None for h in r.hypotheses),
            source_tokens=source_tokens,
            padding_ratio=1.0 - source_tokens / src.size,
            cancelled=sum(r is None for r in results),
        )

    def memory_error(self, error: Exception, sentences: int) -> DeviceMemoryExhausted | None:
        """The error to raise instead of ``error`` when the device arena could not hold a batch of ``sentences``
        (the engine is fine), else None."""
        if not is_out_of_memory(error):
            return None
        return DeviceMemoryExhausted(f"{self.provider} memory exhausted by a batch of {sentences} sentences; "
                                     "retry with fewer or shorter texts")

    def search(self, requests: Sequence[SentenceRequest]) -> list[SearchResult | None]:
        """:meth:`translate_batch` before detokenization: token ids, scores and subword attention
        [tokens incl. EOS, source tokens incl. EOS] of each sentence's hypotheses."""
        return self._search(requests)[0] if requests else []

    def _search(
        self, requests: Sequence[SentenceRequest]
    ) -> tuple[list[SearchResult | None], np.ndarray, float, float]:
        """Encode and search; returns the results, the padded source batch and the seconds of both stages."""
        start = time.perf_counter()
        encoded, sentences, src = self.encode(requests)
        encode_seconds = time.perf_counter() - start
        start = time.perf_counter()
        decode = RunningDecode(self.model, start_id=self.start_id, eos_id=self.eos_id)
        decode.admit(encoded, sentences, range(len(requests)))
        results: list[SearchResult | None] = [None] * len(requests)
        while decode.rows:
            for index, result in decode.step():
                results[index] = result
        return results, src, encode_seconds, time.perf_counter() - start

    def encode(self, requests: Sequence[SentenceRequest]) -> tuple[dict, list[BeamSentence], np.ndarray]:
        """Run the encoder on the sentences (padded into one batch): their encoder outputs, search settings
        and the padded source batch [N, S]."""
        sources = [list(r.source_ids) + [self.eos_id] for r in requests]
        width = max(len(s) for s in sources)
        src = np.full((len(sources), width), self.pad_id, dtype=np.int64)
        for i, ids in enumerate(sources):
            src[i, : len(ids)] = ids
        encoded = self.model.encode(src)
        sentences = [
            BeamSentence(
                source_length=len(sources[i]),
                num_hypotheses=r.options.num_hypotheses,
                max_length=min(r.options.max_length, self.max_positions or r.options.max_length),
                length_penalty=r.options.length_penalty,
                is_cancelled=r.is_cancelled,
                controls=replace(r.options.controls, forced=tuple(r.target_prefix)),
                patience=r.options.patience,
                beam_size=r.options.beam_size,
                need_attention=r.options.return_attention,
            )
            for i, r in enumerate(requests)
        ]
        return encoded, sentences, src

    def to_translation(self, request: SentenceRequest, result: SearchResult) -> Translation:
        """Detokenize one sentence's result: pieces, text and words (computed once here, see
        :func:`server.alignment.segment_words`) and word-level attention over those same words."""
        source_pieces = self.tokenizer.pieces(request.source_ids)
        source_words = segment_words(source_pieces, request.text)
        hypotheses = []
        for hyp in result.hypotheses:
            ids = hyp.tokens[:-1] if hyp.tokens and hyp.tokens[-1] == self.eos_id else hyp.tokens
            pieces = self.tokenizer.pieces(ids)
            text = self.tokenizer.decode(ids)
            words = segment_words(pieces, text)
            attention = None
            if hyp.attention is not None:
                attention = merge_to_words(hyp.attention[:, : len(source_pieces) + 1], source_pieces, pieces,
                                           source_words, words)
            hypotheses.append(
                Hypothesis(
                    text=text,
                    tokens=pieces,
                    words=words,
                    token_ids=list(ids),
                    score=hyp.score,
                    token_scores=hyp.token_scores,
                    attention=attention,
                )
            )
        return Translation(source_tokens=source_pieces, source_words=source_words, hypotheses=hypotheses)
