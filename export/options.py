"""What ``nmt export`` takes: one dataclass whose fields document themselves and generate the flags
(:mod:`common.options`). Standard library only, so ``nmt export --help`` needs no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.model_format.layout import MARIAN_CONFIG
from common.options import option

LOGIT_TOLERANCE = 1e-4  # fp32 parity: max |log-prob difference| and max |attention difference|
OPSETS = range(18, 23)  # opset 23 turns SDPA into ONNX Attention, which ORT's CPU kernel rejects with our masks
SOURCE_FORMATS = ("checkpoint", "huggingface")
SERVING_DEFAULTS = "serving defaults recorded in the manifest (what a request that sends 0 gets)"


@dataclass
class ExportOptions:
    """Everything ``nmt export`` takes."""

    checkpoint: str = option(help="training run directory (best.pt, spm.model, summary.json, test.tsv), a "
                             "checkpoint file with spm.model beside it, or a Hugging Face directory (config.json, "
                             "model.safetensors or pytorch_model.bin, the tokenizer's files) of model_type marian "
                             "(OPUS-MT), m2m_100 (NLLB-200, M2M-100) or mbart (mBART-50)", positional=True,
                             metavar="SOURCE")
    name: str = option("", "model name in the repository (letters, digits, '.', '_', '-'); required unless "
                       "--to huggingface")
    from_format: str | None = option(None, "what SOURCE is (default: huggingface if it holds a config.json, "
                                     "else checkpoint)", flag="--from", choices=SOURCE_FORMATS)
    to: str | None = option(None, "write a Hugging Face Marian directory (MarianMTModel, MarianTokenizer, "
                            "CTranslate2's converter load it) into --out instead of an ONNX model version",
                            choices=("huggingface",))
    out: str | None = option(None, "the directory --to huggingface writes (refused if it exists, unless --force)",
                             metavar="DIR")
    version: str | None = option(None, "version directory name (default: next integer after the existing "
                                 "versions)")
    model_repository: str = option("models", "model repository directory", env="NMT_MODEL_REPOSITORY")
    quantize: str | None = option(None, "dynamic int8 quantization of the MatMul weights; records held-out BLEU "
                                  "of fp32 vs int8 in the manifest (needs the run's test.tsv)", choices=("int8",))
    precision: str = option("fp32", "fp16: weights and activations in half precision for GPUs (softmax, "
                            "log-softmax and top-k in fp32); records held-out BLEU of fp32 vs fp16 and the fp16 "
                            "parity in the manifest (needs the run's test.tsv)", choices=("fp32", "fp16"))
    per_channel: bool = option(False, "int8: one scale per output channel instead of per weight tensor "
                               "(measured further from fp32 on the dates models)")
    force: bool = option(False, "overwrite an existing version directory")
    opset: int = option(18, f"ONNX opset, {OPSETS.start}..{OPSETS.stop - 1}")
    parity_sentences: int = option(20, "held-out sentences for the parity check", metavar="N")
    # 1e-4 holds for trained models, confident ones included: log-probabilities are compared relative to their
    # magnitude beyond 1 (export.verify.log_prob_diff); random large-vocabulary weights (benchmarks) have logits
    # in the hundreds, where kernel reassociation moves even the top ones ~1e-3
    parity_tolerance: float = option(LOGIT_TOLERANCE, "fp32 parity tolerance against PyTorch: max |onnx - torch| / "
                                     "max(1, |torch|) of log-probabilities, max |difference| of attention and cache",
                                     metavar="TOLERANCE")
    bleu_sentences: int = option(200, "held-out sentences scored for --quantize and --precision fp16", metavar="N")
    allow_unfused: bool = option(False, "export even if some attention blocks were not fused (slower serving)")
    source_language: str = option("en", "source language code (a many-to-many import's default source, where it is "
                                  "one of its codes; else its tokenizer's)")
    target_language: str = option("de", "target language code (a many-to-many import's default target, where it is "
                                  "one of its codes; else its first other code)")
    beam_size: int | None = option(None, "default beam size (default: a Marian model's num_beams, else 4)",
                                   group=SERVING_DEFAULTS)
    length_penalty: float | None = option(None, "default length penalty (default: a Marian model's, else 1.0)",
                                          group=SERVING_DEFAULTS)
    max_length: int | None = option(None, "default maximum output tokens, EOS included (default: a Marian "
                                    "model's max_length, else 256)", group=SERVING_DEFAULTS)
    threads: int = option(1, "torch and ONNX Runtime threads while verifying")
    progress: bool = option(True, "show a progress bar")
    stage_processes: bool = option(True, "run the check against transformers, the PyTorch stages and the "
                                   "verification each in a process of its own, so that none keeps the memory of "
                                   "the one before (an OPUS-MT-sized export then needs ~3x the checkpoint instead "
                                   "of ~3.6x); --no-stage-processes runs them all in this process")

    @property
    def reduced_precision(self) -> str | None:
        """The reduced precision asked for (int8 or fp16), or None for fp32 alone."""
        return self.quantize or (self.precision if self.precision != "fp32" else None)


def source_format(options: ExportOptions) -> str:
    """``--from``, else huggingface for a directory holding ``config.json``, else checkpoint."""
    if options.from_format:
        return options.from_format
    return "huggingface" if (Path(options.checkpoint) / MARIAN_CONFIG).is_file() else "checkpoint"
