"""``nmt export``: a training run -> a verified ONNX model version in the model repository.

The flags come from :class:`export.options.ExportOptions` (standard library only); torch, onnx and
onnxruntime load when the command runs.
"""

from __future__ import annotations

import argparse

from common.errors import NmtError
from common.options import add_arguments, values_from_args
from export.options import ExportOptions

DESCRIPTION = """\
Export a trained checkpoint to ONNX with fused attention and write a model version directory
MODEL_REPOSITORY/NAME/VERSION/ holding encoder.onnx, decoder.onnx (one decoding step),
decoder_attention.onnx (the same step plus the cross-attention output), spm.model and manifest.json.

The export checks itself before anything is written: every Transformer attention block must be fused
into com.microsoft.MultiHeadAttention, and on held-out sentences (the run's test.tsv) the version,
loaded by the serving engine, must match PyTorch (log-probabilities and attention within 1e-4,
identical greedy and beam-4 outputs). It writes into a hidden temporary directory and renames it at
the end: a failed export leaves nothing. Its stages run in three processes one after another (the
check against transformers, the PyTorch stages, the verification), so that the memory each leaves
behind does not add to the next's; --no-stage-processes runs them in this process.

SOURCE may also be a Hugging Face directory (config.json, model.safetensors or pytorch_model.bin and
the tokenizer's files), detected from config.json (or --from huggingface), by its model_type:
  marian   OPUS-MT (MarianMTModel; source.spm, target.spm, vocab.json)
  m2m_100  NLLB-200 (tokenizer.json) and M2M-100 (sentencepiece.bpe.model, vocab.json):
           M2M100ForConditionalGeneration, every pair of its languages in one version
  mbart    mBART-50 many-to-many (MBartForConditionalGeneration; tokenizer.json)
It is checked against transformers' own class and written as a normal model version with the model's
tokenizer (docs/importing.md); other model types are refused, named. The reverse, --to huggingface
--out DIR, writes a training run's Transformer as a Marian directory that transformers and CTranslate2
load.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``export`` subcommand."""
    p = subparsers.add_parser(
        "export",
        help="export a checkpoint to an ONNX model version",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ExportOptions, p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        from export.pipeline import export_model, manifest_summary
    except ImportError as error:
        raise NmtError(f"export needs the train extra ({error}); run: pip install -e '.[train]'") from error

    options = ExportOptions(**values_from_args(ExportOptions, args))
    if options.to == "huggingface":
        from export.stages import export_huggingface

        out, diff = export_huggingface(options)
        print(f"wrote {out} (transformers.MarianMTModel loads it; max logit difference {diff:.2e})")
        return 0
    result = export_model(options)
    print(f"wrote {result.version_dir}")
    print(manifest_summary(result.manifest))
    return 0
