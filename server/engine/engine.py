"""ONNX Runtime decoding engine: batched greedy and beam search over exported model versions.

No torch here. The engine is architecture-agnostic: the manifest names the decoder's static inputs
(encoder outputs fed unchanged every step) and its recurrent state (input -> output pairs), and
:class:`server.engine.decode.RunningDecode` drives any model through the :class:`StepModel` contract. On the
CPU the state lives in NumPy arrays that share ONNX Runtime's memory; with CUDA it stays on the GPU
(:class:`DeviceStepModel`).

The step models live in :mod:`server.engine.onnx_step_model` (with the in-place KV cache of ``nmt-model/2``) and
:mod:`server.engine.device_step_model`.

The provider an :class:`Engine` reports is the one its sessions really got (:mod:`server.engine.device`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from common.errors import NmtError
from common.model_format.manifest import REEXPORT, Manifest, ManifestError, read_manifest
from common.model_format.tokenizer import AnyTokenizer, load_tokenizer
from server.completion import Completion
from server.config import PREPACK
from server.engine.cuda_graphs import graph_options
from server.engine.device import (
    CPU,
    CUDA,
    DeviceSettings,
    check_provider,
    is_out_of_memory,
    provider_list,
    runtime_build,
    session_provider,
)
from server.engine.device_step_model import DeviceStepModel
from server.engine.forced import decode_batch
from server.engine.onnx_step_model import OnnxStepModel
from server.engine.session_graphs import session_graph
from server.engine.shared_weights import SharedWeights
from server.engine.step_model import Alternatives, BeamSentence
from server.errors import DeviceMemoryExhausted
from server.text import LanguageTokens, TextCodec
from server.types import DecodingOptions, SearchResult, SentenceRequest, TargetPrefix, Translation

log = logging.getLogger("nmt.server")

ENCODER_CALL_TOKENS = 64  # the cost of one more encoder call, in padded source tokens (length_runs; the
# demo models measured 8-128 alike from 8 sentences up, and 64 no slower than one call for 2 sentences)


@dataclass(frozen=True)
class SourceBatch:
    """The source side of a batch, as the metrics count it."""

    tokens: int  # source tokens, EOS included, padding not
    positions: int  # sentences x the longest source: what the scheduler's token budget counts
    encoded_positions: int  # positions the encoder ran over: each length run padded to its own longest

    @property
    def padding_ratio(self) -> float:
        """Padded positions / all positions the encoder ran over."""
        return 1.0 - self.tokens / self.encoded_positions


@dataclass
class BatchResult:
    """What one :meth:`Engine.search_batch` call produced and cost."""

    results: list[SearchResult | None]  # None for sentences cancelled mid-way
    encode_seconds: float
    decode_seconds: float
    generated_tokens: int
    source_tokens: int
    padding_ratio: float  # padded positions / all positions the encoder ran over (see SourceBatch)
    cancelled: int  # sentences that left the batch because their request was cancelled or expired
    translations: list[Translation | None] = field(default_factory=list)  # detokenized (translate_batch only)


def generated_tokens(result: SearchResult) -> int:
    """Target tokens of a sentence's returned hypotheses (what ``nmt_generated_tokens_total`` counts)."""
    return sum(len(h.tokens) for h in result.hypotheses)


MAIN_SESSIONS = frozenset({"encoder", "decoder"})  # the sessions every translation runs (prepack "main")


def session_options(intra_op_threads: int, inter_op_threads: int, *, spinning: bool,
                    prepack: bool = True, cpu_arena: bool = True) -> ort.SessionOptions:
    """ONNX Runtime options of a model version's sessions. With ``spinning``, idle workers busy-wait for
    the next operator only while a ``run`` is in progress (``session.force_spinning_stop``): each session
    has its own thread pool, and pools left spinning between runs fight each other, the Python search
    and the gRPC event loop for the cores. Without ``prepack``, the CPU kernels read the weights as stored
    instead of a re-laid-out copy of their own (``session.disable_prepacking``). Without ``cpu_arena``, a run's
    host memory goes back when it returns instead of staying in the session's arena."""
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = cpu_arena
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1" if spinning else "0")
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
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
        self.text = TextCodec(manifest, tokenizer)
        self.words = self.text.words  # which ids start a word (alternatives)

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
        prepack: str = "main",
        cpu_arena: bool = True,
        portable_attention: bool | None = None,
        device_search: bool = False,
        cuda_graphs: bool = False,
        graph_pool_mib: int = 1024,
    ) -> Engine:
        """Load ``models/<name>/<version>/``: validate the manifest, open every graph.

        ``spinning``: while a ``run`` is in progress, idle worker threads busy-wait for the next operator
        instead of sleeping; they stop when it returns (:func:`session_options`). On 2 cores it makes
        the SMALL engine 1.5-1.6x faster at batch 1 and the server 1.05-1.6x faster at 1-128 callers
        with no more CPU per request (benchmarks/README.md). Turn it off where other processes need
        the cores more than inference does.

        ``device_state``: keep the encoder outputs and the KV cache on the execution provider's device
        between steps (:class:`DeviceStepModel`, I/O binding). Default: on for CUDA, off for the CPU.

        ``device_search``: with the state on the device, beam search's selection runs there too
        (:mod:`server.engine.device_runs`); off by default: alone it measured level with the host's selection on an
        H200 (a step's time there is its launches), and what it is for is ``cuda_graphs``.

        ``cuda_graphs`` (with ``device_search``): beam runs on the device are kept for reuse by shape bucket,
        within ``graph_pool_mib`` MiB of device memory, and on CUDA their session runs are captured as CUDA graphs
        and replayed (a second decoder session, ``decoder_graphs``, with graphs enabled:
        :mod:`server.engine.cuda_graphs`); where they cannot capture (the CPU), runs say so once and run as they
        are. Off by default: on an H200 the engine's runs went 1.4-2.9x faster with it, but the server with it is not
        yet measured there (README, "Export").

        ``device_id``, ``gpu_mem_limit`` (bytes per session arena, 0: unbounded) and ``cuda_tf32`` go to
        every CUDA session (:class:`server.engine.device.DeviceSettings`). The provider is read back from the
        sessions: an explicit ``cuda`` that fell back to the CPU raises :class:`NmtError` naming the
        reason; ``auto`` logs the fallback. An int8 version is refused on CUDA (its ``MatMulInteger``
        nodes run on the CPU, copying every step between host and device): export fp16 for GPUs.

        A version stores its weights once (``weights.bin``, else it is refused): every session gets the same buffers
        (:class:`SharedWeights`; on CUDA, buffers in device memory, or host buffers where the sessions refuse
        those). ``prepack`` (:data:`server.config.PREPACK`) says whose CPU kernels keep a re-laid-out copy of the
        weights, one per session: faster steps, and a decoder's copy is about its weights' size. "main": the
        encoder and the decoder every translation runs; the decoders that return attention and run forced
        prefixes read the stored weights (their requests are slower, the version holds two copies fewer). "all":
        every session; "none": the loaded version holds each weight once. Where some session packs, the mapped
        pages only packing read are released (a session that reads them maps them again).
        ``cpu_arena``: ONNX Runtime's CPU memory arena, which keeps the most host memory any run of a session
        has needed, for the next (off: the export's checks, a few large calls, give it back after each).

        ``portable_attention``: run the decoder's self-attention over the in-place cache in standard operators
        (:mod:`server.engine.session_graphs`) instead of ``GroupQueryAttention``. Default: where CUDA is
        the first provider and that operator's CUDA kernel does not take the cache's type (fp32 versions);
        the CPU keeps the fused operator, its fastest.
        """
        version_dir = Path(version_dir)
        manifest = read_manifest(version_dir)
        settings = DeviceSettings(provider, device_id, gpu_mem_limit, cuda_tf32)
        providers = provider_list(settings)
        on_cuda = providers[0] != CPU
        if not SharedWeights.present(version_dir):
            raise ManifestError(f"{version_dir} keeps its weights inside each graph (an earlier export); {REEXPORT}")
        weights = SharedWeights(version_dir, "cuda" if on_cuda else "cpu", device_id)

        if prepack not in PREPACK:
            raise ValueError(f"prepack must be one of {', '.join(PREPACK)}, got {prepack!r}")

        def open_session(filename: str, providers: list[Any], role: str) -> ort.InferenceSession:
            packs = prepack == "all" or (prepack == "main" and role in MAIN_SESSIONS)
            options = session_options(intra_op_threads, inter_op_threads, spinning=spinning, prepack=packs,
                                      cpu_arena=cpu_arena)
            weights.add_to(options, version_dir / filename)
            graph = session_graph(version_dir / filename, options, portable_attention, on_cuda=on_cuda)
            return ort.InferenceSession(graph, options, providers=providers)

        def open_sessions() -> dict[str, ort.InferenceSession]:
            sessions = {role: open_session(filename, providers, role) for role, filename in manifest.graphs.items()}
            if cuda_graphs and device_search and on_cuda:  # the decoder once more, its runs captured as graphs
                try:
                    sessions["decoder_graphs"] = open_session(manifest.graphs["decoder"], graph_options(providers),
                                                              "decoder")
                except Exception as error:  # noqa: BLE001 - onnxruntime raises bare RuntimeErrors
                    log.warning("CUDA graphs: the graph-enabled decoder session did not open (%s); beam runs use "
                                "ordinary session runs", error)
            return sessions

        try:
            sessions = open_sessions()
        except Exception as error:  # noqa: BLE001 - onnxruntime raises bare RuntimeErrors
            if weights.device == "cpu":
                raise
            log.warning("the sessions did not take weights in device memory (%s); each keeps its own copy", error)
            weights = SharedWeights(version_dir)
            sessions = open_sessions()
        if prepack != "none":  # kernels hold packed copies: the pages only the packing read go
            weights.release_pages()
        got = session_provider(sessions)
        check_provider(provider, providers, got)
        on_gpu = got == CUDA
        if on_gpu and manifest.precision == "int8":
            raise NmtError("an int8 version cannot run on CUDA (DynamicQuantizeLinear/MatMulInteger have no CUDA "
                           "kernels); export with --precision fp16 for GPUs, or serve it with --provider cpu")
        tokenizer = load_tokenizer(version_dir, manifest.tokenizer_type)
        if device_state or (device_state is None and on_gpu):
            model = DeviceStepModel(manifest, sessions, "cuda" if on_gpu else "cpu", weights=weights,
                                    device_search=device_search, cuda_graphs=cuda_graphs,
                                    graph_pool_bytes=graph_pool_mib << 20, device_id=device_id if on_gpu else 0)
        else:
            model = OnnxStepModel(manifest, sessions, weights=weights)
        return cls(manifest, tokenizer, model, got, device_id=device_id)

    def tokenize(self, text: str) -> list[int]:
        """Subword ids of ``text`` (EOS excluded): :meth:`server.text.TextCodec.tokenize`."""
        return self.text.tokenize(text)

    def target_prefix(self, text: str, *, whole: bool = False) -> TargetPrefix:
        """:meth:`server.text.TextCodec.target_prefix`."""
        return self.text.target_prefix(text, whole=whole)

    def language_tokens(self, source: str = "", target: str = "") -> LanguageTokens:
        """:meth:`server.text.TextCodec.language_tokens`."""
        return self.text.language_tokens(source, target)

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
        languages = self.language_tokens()  # the model's default pair
        requests = [SentenceRequest([*languages.source, *self.tokenize(text)], options, text=text,
                                    target_prefix=TargetPrefix().led(languages.lead), source_end=languages.source_end)
                    for text in texts]
        return [t for t in self.translate_batch(requests).translations if t is not None]

    def translate_batch(self, requests: Sequence[SentenceRequest]) -> BatchResult:
        """:meth:`search_batch`, then each result detokenized (``translations``), for scripts and tests; the
        server detokenizes where the request came in (:mod:`server.frontend.translate`)."""
        result = self.search_batch(requests)
        result.translations = [None if r is None else self.to_translation(request, r)
                               for request, r in zip(requests, result.results, strict=True)]
        return result

    def search_batch(self, requests: Sequence[SentenceRequest]) -> BatchResult:
        """Decode sentences together (a running decode that admits them all at its first step); their
        options may differ. Cancelled sentences leave the batch between steps (their result is None)."""
        if not requests:
            return BatchResult([], 0.0, 0.0, 0, 0, 0.0, 0)
        try:
            results, source, encode_seconds, decode_seconds = self._search(requests)
        except Exception as error:
            exhausted = self.memory_error(error, len(requests))
            if exhausted is None:
                raise
            raise exhausted from error
        return BatchResult(
            results=results,
            encode_seconds=encode_seconds,
            decode_seconds=decode_seconds,
            generated_tokens=sum(generated_tokens(r) for r in results if r is not None),
            source_tokens=source.tokens,
            padding_ratio=source.padding_ratio,
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
    ) -> tuple[list[SearchResult | None], SourceBatch, float, float]:
        """Encode and search; returns the results, the source batch's counts and the seconds of both stages."""
        start = time.perf_counter()
        encoded, sentences, source = self.encode(requests)
        encode_seconds = time.perf_counter() - start
        start = time.perf_counter()
        results = decode_batch(self.model, encoded, sentences, start_id=self.start_id, eos_id=self.eos_id,
                               pad_id=self.pad_id, joiners=self.words.joiners)
        return results, source, encode_seconds, time.perf_counter() - start

    def encode(self, requests: Sequence[SentenceRequest]) -> tuple[dict, list[BeamSentence], SourceBatch]:
        """Run the encoder on the sentences (in runs of similar length, :meth:`_encode_by_length`): their
        encoder outputs (padded to the longest sentence), search settings and the source batch's counts."""
        sources = [r.source(self.eos_id) for r in requests]
        lengths = np.array([len(s) for s in sources])
        src = np.full((len(sources), lengths.max()), self.pad_id, dtype=np.int64)
        for i, ids in enumerate(sources):
            src[i, : len(ids)] = ids
        encoded, encoded_positions = self._encode_by_length(src, lengths)
        sentences = [
            BeamSentence(
                source_length=len(sources[i]),
                num_hypotheses=r.options.num_hypotheses,
                max_length=min(r.options.max_length, self.max_positions or r.options.max_length),
                length_penalty=r.options.length_penalty,
                is_cancelled=r.is_cancelled,
                controls=replace(r.options.controls, forced=r.target_prefix.ids,
                                 completion=self._completion(r)),
                patience=r.options.patience,
                alternatives=Alternatives(r.options.num_hypotheses, self.words) if r.options.return_alternatives
                else None,
                beam_size=r.options.beam_size,
                need_attention=r.options.return_attention,
                on_stable=None if r.options.return_alternatives else r.on_stable,  # several continuations:
                # none is "the" translation until they are ranked at the end
            )
            for i, r in enumerate(requests)
        ]
        return encoded, sentences, SourceBatch(int(lengths.sum()), int(src.size), encoded_positions)

    def _completion(self, request: SentenceRequest) -> Completion | None:
        """What the pieces after ``request``'s forced prefix must spell: its target prefix's completion; for
        alternatives at the start or after a finished word (the prefix ends with whitespace), a word
        boundary (:meth:`WordPieces.boundary`: the next word, not pieces glued onto the prefix's last one)."""
        prefix = request.target_prefix
        if request.options.return_alternatives and prefix.completion is None and (prefix.spaced or not prefix.ids):
            return self.words.boundary(len(prefix.ids))
        return prefix.completion

    def _encode_by_length(self, src: np.ndarray, lengths: np.ndarray) -> tuple[dict, int]:
        """The encoder's outputs for the padded batch ``src`` (rows of ``lengths`` tokens), encoded in runs of
        similar length (:func:`length_runs`): a batch that mixes short and long sentences no longer pads
        every short one to the longest. The runs' outputs are zero-padded to the widest run's shape and put
        back in the batch's row order (the padding is hidden by the source mask, as when a sentence joins
        a running decode). On a device the batch is encoded in one call (its outputs stay there). Returns
        the outputs and the source positions the encoder ran over, padding included."""
        runs = [] if isinstance(self.model, DeviceStepModel) else length_runs(lengths, ENCODER_CALL_TOKENS)
        if len(runs) <= 1:
            return self.model.encode(src), int(src.size)
        widths = [int(lengths[rows].max()) for rows in runs]
        parts = [(rows, self.model.encode(src[rows, :width])) for rows, width in zip(runs, widths, strict=True)]
        merged = {}
        for name, first in parts[0][1].items():
            shape = np.max([part[name].shape for _, part in parts], axis=0)
            merged[name] = np.zeros((len(src), *shape[1:]), dtype=first.dtype)
            for rows, part in parts:
                value = part[name]
                merged[name][(rows, *(slice(0, n) for n in value.shape[1:]))] = value
        return merged, sum(len(rows) * width for rows, width in zip(runs, widths, strict=True))

    def to_translation(self, request: SentenceRequest, result: SearchResult) -> Translation:
        """:meth:`server.text.TextCodec.to_translation`."""
        return self.text.to_translation(request, result)


def length_runs(lengths: np.ndarray, call_tokens: int) -> list[np.ndarray]:
    """The rows of a batch (``lengths``: each row's tokens) grouped into runs of similar length, each run to
    be padded to its longest row only: the grouping of the rows sorted by length that costs the fewest
    padded tokens, counting ``call_tokens`` for each run (what one more call costs). Dynamic programming
    over the sorted rows; on a tie, fewer runs."""
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order]
    n = len(order)
    best = np.zeros(n + 1)  # best[j]: the cost of the j shortest rows
    cut = np.zeros(n + 1, dtype=np.int64)  # cut[j]: where the last run of those j rows starts
    for j in range(1, n + 1):
        costs = best[:j] + (j - np.arange(j)) * ordered[j - 1] + call_tokens
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]
