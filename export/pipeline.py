"""``nmt export``: a training run -> a verified ONNX model version in the model repository.

:func:`export_model` reads as its stages (each a step of the progress bar), run by :mod:`export.stages`:

1. **validate** the inputs before writing anything: the target directory (refused if it exists, unless
   ``force``); the source, loaded by its loader (:data:`export.sources.SOURCE_LOADERS`): a training run's
   checkpoint (``weights_only=True``) and the tokenizer beside it, or a Hugging Face Marian directory
   (:mod:`export.huggingface`), which is first **checked against** ``transformers.MarianMTModel`` itself;
2. **PyTorch reference**: what the parity check compares a version with (:func:`export.verify.torch_reference`),
   kept on disk;
3. **export graphs**: the architecture's exporter (:mod:`export.registry`) traces ``encoder.onnx``,
   ``decoder.onnx`` (one step), ``decoder_attention.onnx`` (the same step plus ``attention``) and, for the
   Transformer, ``decoder_forced.onnx`` (every given target position in one call) with fused attention,
   their weights written to a scratch store as they are traced (the I/O contract is described in
   :mod:`common.model_format.manifest`); then the PyTorch model is freed;
4. **edit graphs**: graph passes (:mod:`export.graph_passes`) pack parallel projections and add the
   decoder's in-graph top-k, one graph at a time, reading each weight from the scratch store when a pass
   needs it, and store every weight once (:class:`common.model_format.weights.WeightStore`);
5. **verify parity**: the version is written and loaded with the serving engine, which must match
   PyTorch's reference (:mod:`export.verify`);
6. optionally **reduce precision** (dynamic int8 for CPUs or fp16 for GPUs, :mod:`export.quantize`),
   verify again and score held-out BLEU of fp32 vs the reduced version;
7. **write**: the manifest records the parity figures; the version is renamed into place from a hidden
   temporary directory, so a failed export leaves nothing half-written.

**Memory.** Each stage leaves memory behind in its process (torch and transformers' modules, the exporter's
objects: ~590 MiB on an OPUS-MT-sized model once its model is freed), and a loaded version adds the size of
its weights. So, by default (``stage_processes``), the stages run in three processes one after another,
each started afresh and gone before the next: the check against transformers (1), the PyTorch stages
(1-4, writing the fp32 version and the reference into the export's scratch directory) and the verification
(5-7); this process imports none of their libraries. An OPUS-MT-sized export then peaks at the largest of
the three instead of their sum (``nmt bench export``, :mod:`benchmarks.export_size`). Without it they run
in this process, as one program (what tests that patch the exporter use).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.errors import NmtError
from common.model_format.layout import next_version
from common.model_format.manifest import Manifest
from export.handoff import STAGE_LINE, ExportResult
from export.options import OPSETS, ExportOptions, source_format

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


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
    checked = source_format(options) == "huggingface"
    names = (["check against transformers"] * checked + ["validate", "PyTorch reference", "export graphs",
             "edit graphs", "verify parity"] + ([f"convert {reduced}"] if reduced else []) + ["write"])
    stage = _Stages(names, options.progress)
    created: list[Path] = []
    try:
        model_dir = Path(options.model_repository) / options.name
        version = options.version or next_version(model_dir)
        version_dir = model_dir / version
        if version_dir.exists() and not options.force:
            raise NmtError(f"{version_dir} already exists; use --force to overwrite it or --version for another")
        source_diff = _run(options, "check_source", {"options": options}, stage, None) if checked else None
        for directory in reversed([model_dir, *model_dir.parents]):
            if not directory.exists():
                directory.mkdir()
                created.append(directory)
        with tempfile.TemporaryDirectory(prefix=f".export-{version}-", dir=model_dir) as tmp:
            work = Path(tmp)
            pairs = _run(options, "trace", {"options": options, "version": version, "work": work,
                                            "source_diff": source_diff}, stage, work)
            result = _run(options, "verify", {"options": options, "work": work, "pairs": pairs}, stage, work)
            _move_into_place(result.version_dir, version_dir, work)
            result.version_dir = version_dir
        created.clear()
        return result
    finally:
        stage.close()
        for directory in reversed(created):  # a failed first export leaves no empty model directory
            with contextlib.suppress(OSError):
                directory.rmdir()


def _run(options: ExportOptions, group: str, kwargs: dict[str, Any], stage: _Stages, work: Path | None) -> Any:
    """``export.stages.<group>(**kwargs)``: in a process of its own (``python -m export.stages``, its request
    and reply pickled in ``work`` or a temporary directory, its stages relayed to the progress bar), or in
    this one without ``options.stage_processes``."""
    if not options.stage_processes:
        from export import stages

        return getattr(stages, group)(**kwargs, stage=stage)
    with tempfile.TemporaryDirectory(prefix=f".{group}-", dir=work) as scratch:
        request, reply = Path(scratch, "request.pickle"), Path(scratch, "reply.pickle")
        request.write_bytes(pickle.dumps((group, kwargs)))
        path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
        process = subprocess.Popen([sys.executable, "-m", "export.stages", str(request), str(reply)],
                                   stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=path))
        try:
            for line in process.stdout:
                if line.startswith(STAGE_LINE):
                    stage(line.removeprefix(STAGE_LINE).strip())
                else:
                    sys.stdout.write(line)
            code = process.wait()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        if not reply.is_file():
            raise NmtError(f"the export's {group} process ended without an answer (exit code {code}); "
                           "out of memory?")
        ok, value = pickle.loads(reply.read_bytes())
    if not ok:
        raise NmtError(value)
    return value


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
