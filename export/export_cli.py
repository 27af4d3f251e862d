"""``nmt export``: a training run -> a verified ONNX model version in the model repository.

Only the standard library is imported here; torch, onnx and onnxruntime load when the command runs.
"""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Export a trained checkpoint to ONNX with fused attention and write a model version directory
REPOSITORY/NAME/VERSION/ holding encoder.onnx, decoder.onnx (one decoding step), decoder_attention.onnx
(the same step plus the cross-attention output), spm.model and manifest.json.

The export checks itself before anything is written: every Transformer attention block must be fused
into com.microsoft.MultiHeadAttention, and on held-out sentences (the run's test.tsv) ONNX Runtime must
match PyTorch (log-probabilities and attention within 1e-4, identical greedy and beam-4 outputs).
It writes into a hidden temporary directory and renames it at the end: a failed export leaves nothing.

CHECKPOINT is a training run directory (best.pt, spm.model, summary.json, test.tsv from `nmt train`)
or a checkpoint file with spm.model beside it.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``export`` subcommand."""
    p = subparsers.add_parser(
        "export",
        help="export a checkpoint to an ONNX model version",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR_OR_FILE", help="training run directory or checkpoint file")
    p.add_argument("--name", required=True, help="model name in the repository (letters, digits, '.', '_', '-')")
    p.add_argument("--version", help="version directory name (default: next integer after the existing versions)")
    p.add_argument("--model-repository", default="models", help="model repository directory (default: models)")
    p.add_argument("--quantize", choices=["int8"], help="dynamic int8 quantization of the MatMul weights; records "
                   "held-out BLEU of fp32 vs int8 in the manifest (needs the run's test.tsv)")
    p.add_argument("--per-channel", action="store_true", help="int8: one scale per output channel instead of per "
                   "weight tensor (measured further from fp32 on the dates models)")
    p.add_argument("--force", action="store_true", help="overwrite an existing version directory")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, 18..22 (default: 18)")
    p.add_argument("--parity-sentences", type=int, default=20, metavar="N",
                   help="held-out sentences for the parity check (default: 20)")
    p.add_argument("--bleu-sentences", type=int, default=200, metavar="N",
                   help="held-out sentences scored for --quantize (default: 200)")
    p.add_argument("--allow-unfused", action="store_true",
                   help="export even if some attention blocks were not fused (slower serving)")
    p.add_argument("--source-language", default="en", help="source language code (default: en)")
    p.add_argument("--target-language", default="de", help="target language code (default: de)")
    serving = p.add_argument_group("serving defaults recorded in the manifest")
    serving.add_argument("--beam-size", type=int, default=4, help="default beam size (default: 4)")
    serving.add_argument("--length-penalty", type=float, default=1.0, help="default length penalty (default: 1.0)")
    serving.add_argument("--max-length", type=int, default=256, help="default maximum output tokens (default: 256)")
    p.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime threads while verifying "
                   "(default: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        from export.pipeline import ExportOptions, export_model, manifest_summary
    except ImportError as error:
        from nmt.errors import NmtError

        raise NmtError(f"export needs the train extra ({error}); run: pip install -e '.[train]'") from error

    options = ExportOptions(
        checkpoint=args.checkpoint, name=args.name, version=args.version, model_repository=args.model_repository,
        quantize=args.quantize, per_channel=args.per_channel, force=args.force, opset=args.opset,
        parity_sentences=args.parity_sentences, bleu_sentences=args.bleu_sentences,
        allow_unfused=args.allow_unfused, source_language=args.source_language,
        target_language=args.target_language, beam_size=args.beam_size, length_penalty=args.length_penalty,
        max_length=args.max_length, threads=args.threads, progress=not args.no_progress,
    )
    result = export_model(options)
    print(f"wrote {result.version_dir}")
    print(manifest_summary(result.manifest))
    return 0
