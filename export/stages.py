"""The stages of ``nmt export`` that need PyTorch, the exporter or a loaded version, in the three groups
:func:`export.pipeline.export_model` runs one after another, by default each in a process of its own
(``python -m export.stages REQUEST REPLY``, :func:`main`), so that no group's memory stays behind for the
next (see :mod:`export.pipeline`):

- :func:`check_source`: an imported Hugging Face model against transformers' own class of it;
- :func:`trace`: load the source, PyTorch's reference outputs (kept on disk), the graphs traced and edited,
  the fp32 version written without its parity figures;
- :func:`verify`: the fp32 version loaded by the serving engine and checked against the reference, then the
  reduced-precision version converted and checked (``--precision fp16``, ``--quantize int8``), the manifest.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from common.errors import NmtError
from common.model_format.layout import GRAPH_FILES, OPTIONAL_GRAPH_FILES, TOKENIZER_FILE
from common.model_format.manifest import Manifest, read_manifest, sha256_file, write_manifest
from common.model_format.tokenizer import Tokenizer
from common.model_format.weights import WEIGHTS_FILE, WeightStore, store_once
from export.decoder_outputs import add_logits, add_top_k
from export.flat_rows import flatten_rows
from export.graph_passes import (
    fold_embedding_scale,
    fold_output_bias,
    fuse_silu,
    fused_op_counts,
    one_position_gemms,
    pack_attention_inputs,
    pack_parallel_matmuls,
    save_graph,
)
from export.graphs import GraphSet
from export.handoff import STAGE_LINE, ExportResult
from export.huggingface import compare_with_transformers, write_marian
from export.options import ExportOptions
from export.quantize import convert_fp16, quantize_int8
from export.registry import graph_exporter
from export.shared_tensors import align_packed_blocks, gemm_weights, packed_blocks
from export.sources import ExportInputs, load_inputs, parity_pairs, return_freed_memory, training_info
from export.tracing import torch_threads
from export.verify import TorchReference, check_parity, greedy_texts, torch_reference
from server.engine.engine import Engine
from training.train import bleu

EDIT_ORDER = ("decoder", "decoder_attention", "decoder_forced", "encoder")  # the decoder's weights first: the
# output projection (tied to the embedding that every graph gathers from) and the packed self-attention
FP32_DIR, REFERENCE_DIR = "fp32", "reference"  # in the export's scratch directory

Stage = Callable[[str], None]


def check_source(options: ExportOptions, stage: Stage) -> float:
    """Max |logit difference| of the imported Hugging Face model (as this project loads it) and
    transformers' class of it loading the same directory, teacher forced on the parity sentences (logits
    of suppressed ids left out); raises beyond the parity tolerance."""
    stage("check against transformers")
    with torch_threads(options.threads):
        inputs = load_inputs(options)
        sources, targets = parity_pairs(inputs, options.parity_sentences)
        diff = compare_with_transformers(inputs.model, inputs.run_dir, sources, targets,
                                         inputs.origin.get("suppressed_ids", []), inputs.source_state)
    if diff > options.parity_tolerance:
        raise NmtError(f"the imported model's logits differ from transformers' by {diff:.2e} "
                       f"(tolerance {options.parity_tolerance:g}): config.json holds something the import misreads")
    return diff


def trace(options: ExportOptions, version: str, work: Path, source_diff: float | None,
          stage: Stage) -> list[tuple[str, str]]:
    """Load the source, keep PyTorch's reference outputs in ``work/reference``, trace and edit the graphs and
    write the fp32 version into ``work/fp32`` (its manifest without parity figures yet). The reference comes
    before tracing, whose objects stay in the process, and the model is freed before the graphs are edited.
    Returns the held-out (source, target) texts (the reduced-precision BLEU comparison's)."""
    with torch_threads(options.threads):
        stage("validate")
        inputs = load_inputs(options)
        sources, targets = parity_pairs(inputs, options.parity_sentences)
        if source_diff is not None:  # check_source passed
            inputs.origin["max_logit_diff_vs_transformers"] = float(f"{source_diff:.3g}")
        inputs.source_state = None  # the model holds what it needs
        stage("PyTorch reference")
        reference_dir = work / REFERENCE_DIR
        reference_dir.mkdir()
        with torch_reference(inputs.model, sources, targets, beam_size=4, directory=reference_dir) as reference:
            reference.save(reference_dir)
        stage("export graphs")
        traced = work / "traced"  # each graph's weights as traced, until its edits are done (a model's worth)
        traced.mkdir()
        with WeightStore(traced / WEIGHTS_FILE) as scratch:
            graph_set = graph_exporter(inputs.arch)(inputs.model, options.opset, store=scratch)
        if graph_set.attention_fused < graph_set.attention_total and not options.allow_unfused:
            raise NmtError(
                f"only {graph_set.attention_fused} of {graph_set.attention_total} attention blocks were fused "
                "into com.microsoft.MultiHeadAttention; use --allow-unfused to export anyway"
            )
        inputs.release_model()
        stage("edit graphs")
        files = _graph_files(graph_set)
        fp32_dir = work / FP32_DIR
        fp32_dir.mkdir()
        traced_nodes = _edit_graphs(graph_set.release(), files, traced, fp32_dir, inputs)
        shutil.rmtree(traced)
        return_freed_memory()
        _write_version(fp32_dir, options, inputs, graph_set, files, traced_nodes, version)
    return inputs.pairs


def verify(options: ExportOptions, work: Path, pairs: list[tuple[str, str]], stage: Stage) -> ExportResult:
    """Check the fp32 version in ``work/fp32`` against the reference in ``work/reference`` (and convert and
    check the reduced-precision one); returns the version that is to be moved into place, manifest written."""
    stage("verify parity")
    fp32_dir = work / FP32_DIR
    manifest = read_manifest(fp32_dir, verify=False)  # written by trace() a moment ago
    with TorchReference.load(work / REFERENCE_DIR) as reference:
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
        manifest.parity = {"precision": "fp32", "enforced": True, **parity.to_dict(),
                           "tolerance": options.parity_tolerance}
        version_dir = fp32_dir
        reduced = options.reduced_precision
        if reduced:
            stage(f"convert {reduced}")
            reduced_dir = work / reduced
            reduced_dir.mkdir()
            fp16_io = _fp16_io(manifest, fp32_dir) if reduced == "fp16" else set()
            for filename in manifest.graphs.values():
                if reduced == "int8":
                    quantize_int8(fp32_dir / filename, reduced_dir / filename, per_channel=options.per_channel)
                else:
                    convert_fp16(fp32_dir / filename, reduced_dir / filename, fp16_io)
            store_once(reduced_dir, list(manifest.graphs.values()))
            reduced_manifest = _reduced_version(manifest, fp32_dir, reduced_dir, reduced)
            reduced_engine = _load_engine(reduced_dir, options)
            parity_reduced = check_parity(reference, reduced_engine)
            reduced_manifest.parity = {"precision": reduced, "enforced": False, **parity_reduced.to_dict(),
                                       "fp32": manifest.parity}
            reduced_manifest.quantization = _bleu_comparison(pairs, options, fp32_engine, reduced_engine, reduced)
            version_dir, manifest = reduced_dir, reduced_manifest
    stage("write")
    write_manifest(manifest, version_dir)
    return ExportResult(version_dir=version_dir, manifest=manifest)


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
            fuse_silu(graph)
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
                   graph_files: dict[str, str], traced_nodes: dict[str, int], version: str) -> Manifest:
    """Complete the fp32 version in ``directory`` (whose graphs ``graph_files`` are written): tokenizer and a
    manifest without parity figures yet. Returns the manifest."""
    cfg = inputs.config
    inputs.tokenizer.save(directory)
    manifest = Manifest(
        name=options.name,
        version=version,
        architecture=inputs.arch,
        **_languages(options, inputs),
        vocab_size=cfg.vocab_size,
        dimensions=dataclasses.asdict(cfg),
        special_ids={"pad": cfg.pad_id, "unk": inputs.tokenizer.unk_id, "bos": cfg.bos_id, "eos": cfg.eos_id,
                     "decoder_start": cfg.decoder_start_id},
        opset=options.opset,
        onnxruntime_version=ort.__version__,
        precision="fp32",
        graphs=graph_files,
        decoder_static=graph_set.decoder_static,
        decoder_state=graph_set.decoder_state,
        static_src_axes=graph_set.static_src_axes,
        decoder_positions=graph_set.decoder_positions,
        tokenizer=TOKENIZER_FILE,
        tokenizer_type=inputs.tokenizer.kind,
        origin=inputs.origin,
        attention_blocks={"fused": graph_set.attention_fused, "total": graph_set.attention_total},
        training=training_info(inputs),
        defaults=_serving_defaults(options, inputs),
        **_written_graphs(directory, graph_files, traced_nodes, inputs.tokenizer.files),
    )
    write_manifest(manifest, directory)
    return manifest


def _languages(options: ExportOptions, inputs: ExportInputs) -> dict[str, Any]:
    """The manifest's language fields: the flags' pair; for a many-to-many import every code of its tokenizer, as
    source and as target (its default source: the flag's if it is one of them, else the tokenizer's own; its
    default target: the flag's, else the first other code)."""
    tokens = inputs.origin.get("languages")
    if not tokens:
        return {"source_language": options.source_language, "target_language": options.target_language,
                "target_languages": inputs.tokenizer.target_languages}
    codes = sorted(tokens, key=tokens.get)
    source = options.source_language if options.source_language in tokens else inputs.origin["default_source"]
    target = options.target_language if options.target_language in tokens else next(c for c in codes if c != source)
    return {"source_language": source, "target_language": target, "target_languages": codes,
            "source_languages": codes, "language_tokens": dict(tokens), "target_language_token": "decoder",
            "source_language_token": inputs.origin.get("source_language_token", "")}


def _fp16_io(manifest: Manifest, fp32_dir: Path) -> set[str]:
    """The graph inputs and outputs an fp16 version keeps in fp16: the in-place KV cache's (read and written in
    place by the attention operators) and the encoder's float outputs that the decoders take as static inputs
    (the cross-attention keys and values: computed once a sentence and read at every step, so a cast in the step
    graph would run at every step)."""
    buffers = {name for entry in manifest.decoder_state if entry.init == "buffer"
               for name in (entry.input, entry.output)}
    encoder = onnx.load(str(fp32_dir / manifest.graphs["encoder"]), load_external_data=False).graph
    static = {value.name for value in encoder.output if value.name in manifest.decoder_static
              and value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    return buffers | static


def _reduced_version(fp32: Manifest, fp32_dir: Path, directory: Path, precision: str) -> Manifest:
    """Complete the reduced-precision version in ``directory`` (its graphs written) from the fp32 version: the
    tokenizer's files copied, the manifest with its precision, graphs and files. Returns the manifest."""
    tokenizer_files = [name for name in fp32.files if name not in (*fp32.graphs.values(), WEIGHTS_FILE)]
    for name in tokenizer_files:
        shutil.copy2(fp32_dir / name, directory / name)
    state = fp32.decoder_state
    if precision == "fp16":  # the in-place KV cache is fp16 there (export.quantize.convert_fp16)
        state = [dataclasses.replace(entry, dtype="float16") if entry.init == "buffer" else entry for entry in state]
    traced_nodes = {role: counts["traced"] for role, counts in fp32.node_counts.items()}
    manifest = dataclasses.replace(fp32, precision=precision, decoder_state=state, parity={},
                                   **_written_graphs(directory, fp32.graphs, traced_nodes, tokenizer_files))
    write_manifest(manifest, directory)
    return manifest


def _written_graphs(directory: Path, graph_files: dict[str, str], traced_nodes: dict[str, int],
                    other_files: list[str]) -> dict[str, Any]:
    """The manifest's fields that describe the graphs as written in ``directory``: fused ops, node counts (as
    traced and as written), every file's hash and the time."""
    graphs = {role: onnx.load(str(directory / name), load_external_data=False) for role, name in graph_files.items()}
    return {
        "fused_ops": {role: fused_op_counts(graph) for role, graph in graphs.items()},
        "node_counts": {role: {"traced": traced_nodes[role], "written": len(graph.graph.node)}
                        for role, graph in graphs.items()},
        "files": {name: sha256_file(directory / name) for name in [*graph_files.values(), WEIGHTS_FILE, *other_files]},
        "created": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
    }


def _load_engine(version_dir: Path, options: ExportOptions) -> Engine:
    """The version as ``nmt serve --ort-prepack none`` loads it (CPU, ``options.threads`` threads): each weight
    held once, and without the CPU memory arena (the checks' largest calls give their memory back)."""
    return Engine.load(version_dir, provider="cpu", intra_op_threads=options.threads, inter_op_threads=1,
                       prepack="none", cpu_arena=False)


REDUCTION_METHODS = {
    "fp16": "onnxruntime.transformers.float16: fp16 weights and activations, graph I/O (but the KV cache and the "
            "cross-attention keys and values), Softmax, LogSoftmax, ReduceMean and TopK in fp32 "
            "(export.quantize.FP32_OPS)",
}


def _bleu_comparison(pairs: list[tuple[str, str]], options: ExportOptions, fp32: Engine, reduced: Engine,
                     precision: str) -> dict[str, Any]:
    """Greedy held-out BLEU of the fp32 and reduced-precision versions (serving engine, sacrebleu), CPU provider."""
    pairs = pairs[: options.bleu_sentences]
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


STAGES: dict[str, Callable[..., Any]] = {"check_source": check_source, "trace": trace, "verify": verify}


def main(argv: list[str] | None = None) -> int:
    """``python -m export.stages REQUEST REPLY``: run the stage group named in the pickled ``REQUEST`` (a name
    and its keyword arguments), announcing each stage on stdout (:data:`export.handoff.STAGE_LINE`); pickle ``(True,
    result)`` or ``(False, message)`` into ``REPLY``."""
    request, reply = (Path(arg) for arg in (argv or sys.argv[1:]))
    name, kwargs = pickle.loads(request.read_bytes())

    def stage(label: str) -> None:
        print(STAGE_LINE + label, flush=True)

    try:
        outcome: tuple[bool, Any] = (True, STAGES[name](**kwargs, stage=stage))
    except NmtError as error:
        outcome = (False, str(error))
    except Exception:  # noqa: BLE001 - anything else: the parent reports it with its traceback
        outcome = (False, f"the export's {name} stage failed:\n{traceback.format_exc()}")
    reply.write_bytes(pickle.dumps(outcome))
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
