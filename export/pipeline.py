"""``nmt export``: a training run -> a verified ONNX model version in the model repository.

:func:`export_model` reads as its stages (each a step of the progress bar):

1. **validate** the inputs before writing anything: the source, loaded by its loader
   (:data:`export.sources.SOURCE_LOADERS`): a training run's checkpoint (``weights_only=True``) and the
   tokenizer beside it, or a Hugging Face Marian directory (:mod:`export.huggingface`, checked against
   ``transformers.MarianMTModel`` itself, on the same tensors); the target directory (refused if it
   exists, unless ``force``);
2. **export graphs**: the architecture's exporter (:mod:`export.registry`) traces ``encoder.onnx``,
   ``decoder.onnx`` (one step), ``decoder_attention.onnx`` (the same step plus ``attention``) and, for the
   Transformer, ``decoder_forced.onnx`` (every given target position in one call) with fused attention,
   their weights written to a scratch store as they are traced. The I/O contract is described in
   :mod:`nmt.model_format.manifest`;
3. **PyTorch reference**: what the parity check compares a version with (:func:`export.verify.torch_reference`);
   then the PyTorch model is freed: the later stages read only graphs, so the model and a loaded version
   (each the size of the checkpoint) are never in memory together;
4. **edit graphs**: graph passes (:mod:`export.graph_passes`) pack parallel projections and add the
   decoder's in-graph top-k, one graph at a time, reading each weight from the scratch store when a pass
   needs it, and store every weight once (:class:`nmt.model_format.weights.WeightStore`);
5. **verify parity**: the version is written and loaded with the serving engine, which must match
   PyTorch's reference (:mod:`export.verify`);
6. optionally **reduce precision** (dynamic int8 for CPUs or fp16 for GPUs, :mod:`export.quantize`),
   verify again and score held-out BLEU of fp32 vs the reduced version;
7. **write**: the manifest records the parity figures; the version is renamed into place from a hidden
   temporary directory, so a failed export leaves nothing half-written.

``nmt bench export`` (:mod:`benchmarks.export_size`) measures the export's peak memory and what it writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from tqdm import tqdm

from export.flat_rows import flatten_rows
from export.graph_passes import (
    add_logits,
    add_top_k,
    fold_embedding_scale,
    fold_output_bias,
    fused_op_counts,
    one_position_gemms,
    pack_attention_inputs,
    pack_parallel_matmuls,
    save_graph,
)
from export.graphs import GraphSet
from export.huggingface import compare_with_transformers, write_marian
from export.options import OPSETS, ExportOptions
from export.quantize import convert_fp16, quantize_int8
from export.registry import graph_exporter
from export.shared_tensors import align_packed_blocks, gemm_weights, packed_blocks
from export.sources import ExportInputs, load_inputs, parity_pairs, return_freed_memory, training_info
from export.tracing import torch_threads
from export.verify import ParityReport, TorchReference, check_parity, greedy_texts, torch_reference
from nmt.errors import NmtError
from nmt.model_format.layout import (
    GRAPH_FILES,
    OPTIONAL_GRAPH_FILES,
    TOKENIZER_FILE,
    next_version,
)
from nmt.model_format.manifest import Manifest, sha256_file, write_manifest
from nmt.model_format.tokenizer import Tokenizer
from nmt.model_format.weights import WEIGHTS_FILE, WeightStore, store_once
from server.engine.engine import Engine
from training.train import bleu

EDIT_ORDER = ("decoder", "decoder_attention", "decoder_forced", "encoder")  # the decoder's weights first: the
# output projection (tied to the embedding that every graph gathers from) and the packed self-attention
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class ExportResult:
    version_dir: Path
    manifest: Manifest
    parity: ParityReport
    parity_reduced: ParityReport | None = None


def _validate_options(options: ExportOptions) -> None:
    if not options.name:
        raise NmtError("--name is required (the model's name in the repository)")
    if not NAME_PATTERN.match(options.name):
        raise NmtError(f"bad model name {options.name!r}: use letters, digits, '.', '_' and '-'")
    if options.version is not None and not NAME_PATTERN.match(options.version):
        raise NmtError(f"bad version {options.version!r}: use letters, digits, '.', '_' and '-'")
    if options.quantize not in (None, "int8"):
        raise NmtError(f"unknown quantization {options.quantize!r}; the only choice is int8")
    if options.precision not in ("fp32", "fp16"):
        raise NmtError(f"unknown precision {options.precision!r}; choose fp32 or fp16")
    if options.quantize and options.precision != "fp32":
        raise NmtError("--quantize int8 (CPUs) and --precision fp16 (GPUs) exclude each other")
    if options.opset not in OPSETS:
        raise NmtError(f"opset {options.opset} is not supported; choose {OPSETS.start}..{OPSETS.stop - 1}")
    if options.parity_sentences < 1:
        raise NmtError("--parity-sentences must be at least 1")
    if any(value is not None and value < 1 for value in (options.beam_size, options.max_length)):
        raise NmtError("--beam-size and --max-length must be positive")


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
    reduced = options.reduced_precision
    names = (["validate", "export graphs", "PyTorch reference", "edit graphs", "verify parity"]
             + ([f"convert {reduced}"] if reduced else []) + ["write"])
    stage = _Stages(names, options.progress)
    created: list[Path] = []
    try:
        with torch_threads(options.threads):
            stage("validate")
            inputs = load_inputs(options)
            model_dir = Path(options.model_repository) / options.name
            version = options.version or next_version(model_dir)
            version_dir = model_dir / version
            if version_dir.exists() and not options.force:
                raise NmtError(f"{version_dir} already exists; use --force to overwrite it or --version for another")
            sources, targets = parity_pairs(inputs, options.parity_sentences)
            if inputs.origin:
                _check_against_source(inputs, options, sources, targets)
            for directory in reversed([model_dir, *model_dir.parents]):
                if not directory.exists():
                    directory.mkdir()
                    created.append(directory)
            with tempfile.TemporaryDirectory(prefix=f".export-{version}-", dir=model_dir) as tmp:
                result = _export(options, inputs, (sources, targets), version, Path(tmp), stage)
                _move_into_place(result.version_dir, version_dir, Path(tmp))
                result.version_dir = version_dir
            created.clear()
            return result
    finally:
        stage.close()
        for directory in reversed(created):  # a failed first export leaves no empty model directory
            with contextlib.suppress(OSError):
                directory.rmdir()


def export_huggingface(options: ExportOptions) -> tuple[Path, float]:
    """``--to huggingface``: a training run's Transformer as a Marian directory ``options.out``; returns it
    and the max |logit difference| of ``MarianMTModel`` loading it."""
    if not options.out:
        raise NmtError("--to huggingface needs --out DIR")
    with torch_threads(options.threads):
        inputs = load_inputs(options)
        if inputs.model.arch != "transformer" or not isinstance(inputs.tokenizer, Tokenizer):
            raise NmtError(f"only a Transformer with a joint SentencePiece tokenizer exports to Hugging Face Marian, "
                           f"not {inputs.model.arch!r} with {inputs.tokenizer.kind!r}")
        diff = write_marian(inputs.model, inputs.tokenizer, options.out, defaults=_serving_defaults(options, inputs),
                            force=options.force)
    if diff > options.parity_tolerance:
        raise NmtError(f"transformers.MarianMTModel loading {options.out} differs from the checkpoint by {diff:.2e}")
    return Path(options.out), diff


def _export(options: ExportOptions, inputs: ExportInputs, pairs: tuple[list[list[int]], list[list[int]]],
            version: str, work: Path, stage: _Stages) -> ExportResult:
    """Export, verify (and quantize) into ``work``; returns the result with ``version_dir`` under ``work``."""
    stage("export graphs")
    traced = work / "traced"  # each graph's weights as traced, until its edits are done (a model's worth)
    traced.mkdir()
    with WeightStore(traced / WEIGHTS_FILE) as scratch:
        graph_set = graph_exporter(inputs.arch)(inputs.model, options.opset, store=scratch)
    if graph_set.attention_fused < graph_set.attention_total and not options.allow_unfused:
        raise NmtError(
            f"only {graph_set.attention_fused} of {graph_set.attention_total} attention blocks were fused into "
            "com.microsoft.MultiHeadAttention; use --allow-unfused to export anyway"
        )
    stage("PyTorch reference")
    with torch_reference(inputs.model, *pairs, beam_size=4, directory=work) as reference:
        inputs.release_model()
        stage("edit graphs")
        files = _graph_files(graph_set)
        fp32_dir = work / "fp32"
        fp32_dir.mkdir()
        traced_nodes = _edit_graphs(graph_set.release(), files, traced, fp32_dir, inputs)
        shutil.rmtree(traced)
        return_freed_memory()
        stage("verify parity")
        return _verify(options, inputs, reference, graph_set, files, traced_nodes, version, work, stage)


def _edit_graphs(graphs: dict[str, onnx.ModelProto], files: dict[str, str], traced: Path, out: Path,
                 inputs: ExportInputs) -> dict[str, int]:
    """Apply the graph passes to each traced graph (whose weights are in ``traced``'s store, read one at a
    time) and save it in ``out`` with its weights in ``out``'s store, each once. Returns each graph's node
    count as traced (and fused)."""
    traced_nodes = {}
    projections: set[bytes] = set()  # the output projections' weights: a tied embedding stays one tensor
    step_blocks: set[tuple[bytes, ...]] = set()  # the step decoder's packed projections, block by block
    with WeightStore(out / WEIGHTS_FILE) as store:
        for role in sorted(graphs, key=EDIT_ORDER.index):  # one graph in memory at a time
            graph = graphs.pop(role)
            traced_nodes[role] = len(graph.graph.node)
            projections |= gemm_weights([graph], traced)
            pack_parallel_matmuls(graph, traced)
            pack_attention_inputs(graph, traced)
            fold_output_bias(graph, traced)
            fold_embedding_scale(graph, keep=projections, base_dir=traced)
            if role == "decoder":  # its packed projections, in query-key-value order, before they become Gemms
                step_blocks = packed_blocks([graph], base_dir=traced)
            elif role == "decoder_forced":
                align_packed_blocks(graph, step_blocks, traced)
            if role in ("decoder", "decoder_attention"):
                if inputs.arch == "transformer":  # its step graphs project [rows, 1, d] (Bahdanau's are 2-D)
                    one_position_gemms(graph)
                add_logits(graph)
                add_top_k(graph, inputs.config.eos_id)
                if inputs.arch == "transformer":
                    flatten_rows(graph)
            save_graph(store.externalize(graph, traced), out / files[role])
            del graph
    return traced_nodes


def _verify(options: ExportOptions, inputs: ExportInputs, reference: TorchReference, graph_set: GraphSet,
            files: dict[str, str], traced_nodes: dict[str, int], version: str, work: Path,
            stage: _Stages) -> ExportResult:
    """Write the fp32 version in ``work/fp32``, check it against ``reference`` (and the reduced-precision one)."""
    fp32_dir = work / "fp32"
    manifest = _write_version(fp32_dir, options, inputs, graph_set, files, traced_nodes, version, precision="fp32")
    fp32_engine = _load_engine(fp32_dir, options)
    parity = check_parity(reference, fp32_engine)
    if not parity.ok(options.parity_tolerance):
        details = "; ".join(parity.mismatches[:3])
        raise NmtError(
            f"ONNX parity check failed: max log-prob diff {parity.max_logit_diff:.2e}, max attention diff "
            f"{parity.max_attention_diff:.2e}, max forced-pass diff {parity.max_forced_diff or 0:.2e} "
            f"(log-probabilities as |onnx - torch| / max(1, |torch|), attention and cache absolute; tolerance "
            f"{options.parity_tolerance:g}, --parity-tolerance relaxes it), greedy "
            f"{parity.greedy_match[0]}/{parity.greedy_match[1]}, beam-4 {parity.beam4_match[0]}/"
            f"{parity.beam4_match[1]} identical" + (f"; {details}" if details else "")
        )
    manifest.parity = {"precision": "fp32", "enforced": True, **parity.to_dict(), "tolerance": options.parity_tolerance}
    version_dir, parity_reduced = fp32_dir, None

    reduced = options.reduced_precision
    if reduced:
        stage(f"convert {reduced}")
        reduced_dir = work / reduced
        reduced_dir.mkdir()
        for filename in files.values():
            if reduced == "int8":
                quantize_int8(fp32_dir / filename, reduced_dir / filename, per_channel=options.per_channel)
            else:
                convert_fp16(fp32_dir / filename, reduced_dir / filename, _buffer_io(graph_set))
        store_once(reduced_dir, list(files.values()))
        reduced_manifest = _write_version(reduced_dir, options, inputs, graph_set, files, traced_nodes, version,
                                          precision=reduced)
        reduced_engine = _load_engine(reduced_dir, options)
        parity_reduced = check_parity(reference, reduced_engine)
        reduced_manifest.parity = {"precision": reduced, "enforced": False, **parity_reduced.to_dict(),
                                   "fp32": manifest.parity}
        reduced_manifest.quantization = _bleu_comparison(inputs, options, fp32_engine, reduced_engine, reduced)
        version_dir, manifest = reduced_dir, reduced_manifest

    stage("write")
    write_manifest(manifest, version_dir)
    return ExportResult(version_dir=version_dir, manifest=manifest, parity=parity, parity_reduced=parity_reduced)


def _check_against_source(inputs: ExportInputs, options: ExportOptions, sources: list[list[int]],
                          targets: list[list[int]]) -> None:
    """An imported model's logits against the library it came from (``MarianMTModel``), recorded in
    ``inputs.origin``; raises beyond the parity tolerance."""
    diff = compare_with_transformers(inputs.model, inputs.run_dir, sources, targets,
                                     inputs.origin.get("suppressed_ids", []), inputs.source_state)
    inputs.source_state = None  # the model holds what it needs
    inputs.origin["max_logit_diff_vs_transformers"] = float(f"{diff:.3g}")
    if diff > options.parity_tolerance:
        raise NmtError(f"the imported model's logits differ from transformers.MarianMTModel's by {diff:.2e} "
                       f"(tolerance {options.parity_tolerance:g}): config.json holds something the import misreads")


def _serving_defaults(options: ExportOptions, inputs: ExportInputs) -> dict[str, Any]:
    """Flags over the source's own defaults (a Marian model's num_beams...) over beam 4, penalty 1, 256 tokens."""
    fallback = {"beam_size": 4, "length_penalty": 1.0, "max_length": 256}
    return {key: next(v for v in (getattr(options, key), inputs.defaults.get(key), value) if v is not None)
            for key, value in fallback.items()}


def _graph_files(graph_set: GraphSet) -> dict[str, str]:
    """Role -> file name of every graph the exporter produced (the forced pass only where it has one)."""
    names = {**GRAPH_FILES, **OPTIONAL_GRAPH_FILES}
    return {role: names[role] for role in graph_set.graphs()}


def _write_version(directory: Path, options: ExportOptions, inputs: ExportInputs, graph_set: GraphSet,
                   graph_files: dict[str, str], traced_nodes: dict[str, int], version: str, *,
                   precision: str) -> Manifest:
    """Complete the model version in ``directory`` (whose graphs ``graph_files`` are written): tokenizer and
    a manifest without parity figures yet (with each graph's node count as traced and as written). Returns
    the manifest."""
    graphs = {role: onnx.load(str(directory / name), load_external_data=False) for role, name in graph_files.items()}
    cfg = inputs.config
    inputs.tokenizer.save(directory)
    state = graph_set.decoder_state
    if precision == "fp16":  # the in-place KV cache is fp16 there (export.quantize.convert_fp16)
        state = [dataclasses.replace(entry, dtype="float16") if entry.init == "buffer" else entry for entry in state]
    manifest = Manifest(
        name=options.name,
        version=version,
        architecture=inputs.arch,
        source_language=options.source_language,
        target_language=options.target_language,
        vocab_size=cfg.vocab_size,
        dimensions=dataclasses.asdict(cfg),
        special_ids={"pad": cfg.pad_id, "unk": inputs.tokenizer.unk_id, "bos": cfg.bos_id, "eos": cfg.eos_id,
                     "decoder_start": cfg.decoder_start_id},
        opset=options.opset,
        onnxruntime_version=ort.__version__,
        precision=precision,
        graphs=graph_files,
        decoder_static=graph_set.decoder_static,
        decoder_state=state,
        static_src_axes=graph_set.static_src_axes,
        decoder_positions=graph_set.decoder_positions,
        tokenizer=TOKENIZER_FILE,
        tokenizer_type=inputs.tokenizer.kind,
        target_languages=inputs.tokenizer.target_languages,
        origin=inputs.origin,
        fused_ops={role: fused_op_counts(graph) for role, graph in graphs.items()},
        node_counts={role: {"traced": traced_nodes[role], "written": len(graph.graph.node)}
                     for role, graph in graphs.items()},
        attention_blocks={"fused": graph_set.attention_fused, "total": graph_set.attention_total},
        training=training_info(inputs),
        defaults=_serving_defaults(options, inputs),
        files={name: sha256_file(directory / name)
               for name in [*graph_files.values(), WEIGHTS_FILE, *inputs.tokenizer.files]},
        created=datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
    )
    write_manifest(manifest, directory)
    return manifest


def _buffer_io(graph_set: GraphSet) -> set[str]:
    """The graph inputs and outputs of the in-place KV cache (its "buffer" state entries)."""
    return {name for entry in graph_set.decoder_state if entry.init == "buffer" for name in (entry.input, entry.output)}


def _load_engine(version_dir: Path, options: ExportOptions) -> Engine:
    """The version as ``nmt serve --no-ort-prepack`` loads it (CPU, ``options.threads`` threads): each weight
    held once, and without the CPU memory arena (the checks' largest calls give their memory back)."""
    return Engine.load(version_dir, provider="cpu", intra_op_threads=options.threads, inter_op_threads=1,
                       prepack=False, cpu_arena=False)


REDUCTION_METHODS = {
    "fp16": "onnxruntime.transformers.float16: fp16 weights and activations, graph I/O, Softmax, LogSoftmax, "
            "ReduceMean and TopK in fp32 (export.quantize.FP32_OPS)",
}


def _bleu_comparison(inputs: ExportInputs, options: ExportOptions, fp32: Engine, reduced: Engine,
                     precision: str) -> dict[str, Any]:
    """Greedy held-out BLEU of the fp32 and reduced-precision versions (serving engine, sacrebleu), CPU provider."""
    pairs = inputs.pairs[: options.bleu_sentences]
    sources = [source for source, _ in pairs]
    references = [target for _, target in pairs]
    scores = {label: round(bleu(greedy_texts(engine, sources), references), 2)
              for label, engine in (("fp32", fp32), (precision, reduced))}
    method = REDUCTION_METHODS.get(precision) or ("onnxruntime quantize_dynamic: int8 MatMul weights, "
                                                  + ("per-channel" if options.per_channel else "per-tensor")
                                                  + " scales")
    return {
        "method": method,
        "bleu_fp32": scores["fp32"],
        f"bleu_{precision}": scores[precision],
        "delta": round(scores[precision] - scores["fp32"], 2),
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
        f"{parity.get('max_attention_diff')}, greedy {parity.get('greedy_match')}, beam-4 {parity.get('beam4_match')}"
        + (f", forced pass {parity['max_forced_diff']}" if "max_forced_diff" in parity else ""),
        "  nodes (traced -> written): " + ", ".join(f"{role} {counts['traced']} -> {counts['written']}"
                                                    for role, counts in manifest.node_counts.items()),
    ]
    if manifest.quantization:
        q = manifest.quantization
        lines.append(f"  BLEU on {q['test_sentences']} held-out sentences: fp32 {q['bleu_fp32']}, "
                     f"{manifest.precision} {q[f'bleu_{manifest.precision}']} (delta {q['delta']:+})")
    return "\n".join(lines)
