"""Engine benchmark: this project's ONNX Runtime engine vs CTranslate2 vs PyTorch on the same weights,
each runtime alone in its own process.

    python benchmarks/engine_throughput.py                 # SMALL and BASE, fp32 and int8, batch 1/8/32, beam 1/4
    python benchmarks/engine_throughput.py --sizes SMALL --batches 1 32 --repeats 3
    python benchmarks/engine_throughput.py --sizes SMALL --precisions fp32 --runtimes project ctranslate2 \
        --baseline /work/main            # this checkout's engine against main's, same weights

A random-weight Hugging Face ``MarianMTModel`` is built for each size, converted with CTranslate2's
``TransformersConverter`` and loaded into this project's Transformer, which the project's exporter
turns into a model version. This process only builds those artifacts; every measurement runs in a
worker process (``runtime_worker.py``) that imports one runtime and nothing else: torch and
CTranslate2 in one process slowed CTranslate2 up to 8x (two OpenMP runtimes; see
benchmarks/README.md), and the benchmark refuses a project or CTranslate2 worker in which torch was
loaded.

Each worker warms up, then decodes each batch back to back for a fixed wall time (``--seconds``) and
reports target tokens/s; outputs are forced to 24 tokens (EOS suppressed through
``final_logits_bias``), 20-token sources, 2 threads each. Workers of the different runtimes alternate
(the order rotates every repeat) with a pause between them; the tables give medians with min-max and
the project/CTranslate2 ratio of the medians. Greedy outputs are checked to agree token for token.
``--baseline CHECKOUT`` adds another checkout of this project as a runtime ("baseline"): that
checkout's exporter turns the same weights into a model version and that checkout's worker decodes
it, so a change to the export or the engine is measured against the code before it in the same run.
Printed beside the tables: the CPU model and instruction set, each runtime's backend (CTranslate2 with
``CT2_VERBOSE=1``: its CPU ISA and GEMM backend), and the machine's fp32 GEMM rate (the compute
ceiling) with the share of it each batch-32 cell uses.

``--anatomy`` also times every cell at 2 output tokens and splits each runtime's time per call into a
fixed part (the encoder, the call's own set-up and results) and a part per decoding step, from the two
lengths (time = fixed + steps x per step): it shows whether a gap lies in the steps or around them.
The fit is a straight line: a step's cost that grows with its position (attention over more entries,
the KV cache's one growth past 16 positions) lands partly in the fixed part. For the project the table
also splits the measured call at the full length into the time inside ONNX Runtime (the encoder's
session, the step decoders' sessions) and the rest (Python: the search, tokens, I/O binding, the call's
own set-up), and times the host's work per decoding step directly: "host us between steps" is the median
time from the end of one step-graph run to the start of the next within a call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages

from bench_common import host  # noqa: E402

SIZES = {
    "TINY": dict(d_model=32, layers=1, heads=2, ffn=64, vocab=64),  # for the benchmark's own test
    "SMALL": dict(d_model=256, layers=3, heads=4, ffn=1024, vocab=8000),
    "BASE": dict(d_model=512, layers=6, heads=8, ffn=2048, vocab=32000),
    # M2M100ForConditionalGeneration shaped like facebook/nllb-200-distilled-600M, and a reduced one
    "NLLB-SMALL": dict(d_model=256, layers=3, heads=4, ffn=1024, vocab=8000, family="nllb"),
    "NLLB-600M": dict(d_model=1024, layers=12, heads=16, ffn=4096, vocab=256206, family="nllb"),
}
NLLB_PAIR = ("eng_Latn", "deu_Latn")  # the NLLB cells' source and target language
OUTPUT_TOKENS = 24
ANATOMY_TOKENS = 2  # the short output length of --anatomy
SOURCE_TOKENS = 20
THREADS = 2
EOS, UNK = 0, 1  # Marian's layout; pad is the last id
WORKER = Path(__file__).resolve().parent / "runtime_worker.py"
RUNTIMES = ("project", "ctranslate2", "pytorch", "generate")
DEFAULT_RUNTIMES = {"cpu": ["project", "ctranslate2", "pytorch"], "cuda": ["project", "generate"]}
WITHOUT_TORCH = ("project", "ctranslate2", "baseline")


def marian_model(size: str, seed: int = 0):
    """Random-weight Marian model with Marian's vocabulary layout (eos 0, unk 1, pad last = decoder start)."""
    from transformers import MarianConfig, MarianMTModel

    s = SIZES[size]
    vocab = s["vocab"]
    config = MarianConfig(
        vocab_size=vocab, d_model=s["d_model"], encoder_layers=s["layers"], decoder_layers=s["layers"],
        encoder_attention_heads=s["heads"], decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"],
        decoder_ffn_dim=s["ffn"], activation_function="swish", scale_embedding=True, pad_token_id=vocab - 1,
        eos_token_id=EOS, decoder_start_token_id=vocab - 1, max_position_embeddings=256, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0,
    )
    import torch

    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, EOS] = -1e4  # never EOS: every runtime generates exactly 24 tokens
        model.final_logits_bias[0, [UNK, vocab - 1]] = -1e4  # nor unk, nor pad (CTranslate2 drops pad)
    return model


def nllb_directory(size: str, work: Path, seed: int = 0) -> Path:
    """A random NLLB-shaped ``M2M100ForConditionalGeneration`` with an ``NllbTokenizer`` (over a SentencePiece model
    trained here; the rest of the vocabulary no piece of it), saved as a Hugging Face directory. Its special and
    language tokens are never generated, so every runtime decodes to the length asked: the final layer norm's bias
    points away from their embeddings (the model has no logits bias to push them down with)."""
    import torch

    from tests.multilingual_dirs import random_nllb

    directory = work / "nllb"
    if directory.exists():
        return directory
    shape = {key: value for key, value in SIZES[size].items() if key != "family"}
    model, tokenizer = random_nllb(directory, **shape, max_positions=256, seed=seed)
    special = sorted({*tokenizer.convert_tokens_to_ids(tokenizer.all_special_tokens), 0, 1, 2, 3})
    with torch.no_grad():
        away = torch.nn.functional.normalize(torch.randn(shape["d_model"]), dim=0)
        model.model.decoder.layer_norm.bias.copy_(50.0 * away)
        model.model.shared.weight[special] = -8.0 * away
    model.save_pretrained(directory)
    return directory


def nllb_languages(directory: Path) -> dict:
    """The NLLB cells' language tokens (ids and pieces) and the ids ordinary source tokens are drawn from."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    source, target = NLLB_PAIR
    ids = tokenizer.convert_tokens_to_ids([source, target])
    return {"source": ids[0], "target": ids[1], "source_token": source, "target_token": target,
            "ordinary": [4, min(tokenizer.convert_tokens_to_ids(tokenizer.all_special_tokens[5:]))]}


def export_nllb(directory: Path, work: Path) -> Path:
    """The NLLB directory imported through ``nmt export``; returns the version directory."""
    from export.options import ExportOptions
    from export.pipeline import export_model

    options = ExportOptions(checkpoint=str(directory), name="bench-nllb", model_repository=str(work / "models"),
                            target_language=NLLB_PAIR[1], force=True, progress=False, threads=THREADS,
                            parity_tolerance=1e-2)  # random weights: logits in the hundreds
    return export_model(options).version_dir


class _Vocabulary:
    """The little of a tokenizer CTranslate2's Marian loader reads."""

    eos_token, unk_token = "</s>", "<unk>"

    def __init__(self, size: int) -> None:
        self.tokens = ["</s>", "<unk>"] + [f"t{i}" for i in range(2, size - 1)] + ["<pad>"]

    def get_vocab(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}


def save_marian(model, work: Path) -> Path:
    """The Marian model saved as a Hugging Face directory (what ``generate`` and CTranslate2 read)."""
    hf_dir = work / "hf"
    if not hf_dir.exists():
        model.save_pretrained(hf_dir)
    return hf_dir


def convert_ctranslate2(model, work: Path, quantization: str | None) -> Path:
    import ctranslate2

    if isinstance(model, Path):  # an NLLB directory: CTranslate2's own M2M-100 loader with its tokenizer
        out = work / f"ct2-{quantization or 'fp32'}"
        ctranslate2.converters.TransformersConverter(str(model)).convert(str(out), quantization=quantization,
                                                                         force=True)
        return out
    hf_dir = save_marian(model, work)
    vocabulary = _Vocabulary(model.config.vocab_size)

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return vocabulary

    out = work / f"ct2-{quantization or 'fp32'}"
    Converter(str(hf_dir)).convert(str(out), quantization=quantization, force=True)
    return out


def placeholder_tokenizer(size: int):
    """A SentencePiece model in Marian's layout with exactly ``size`` pieces ("</s>", "<unk>", "t2", ...,
    "<pad>"): the engine is driven with token ids here, but a model version carries a tokenizer whose
    vocabulary matches the model's."""
    from sentencepiece import sentencepiece_model_pb2 as spm_pb2

    from common.model_format.tokenizer import Tokenizer, train_tokenizer

    proto = spm_pb2.ModelProto()
    proto.ParseFromString(train_tokenizer(["a b c d e f g"] * 10, vocab_size=20).model_proto)
    kind = spm_pb2.ModelProto.SentencePiece
    del proto.pieces[:]
    proto.pieces.add(piece="</s>", score=0.0, type=kind.CONTROL)
    proto.pieces.add(piece="<unk>", score=0.0, type=kind.UNKNOWN)
    for i in range(2, size - 1):
        proto.pieces.add(piece=f"t{i}", score=-float(i), type=kind.NORMAL)
    proto.pieces.add(piece="<pad>", score=0.0, type=kind.CONTROL)
    proto.trainer_spec.eos_id, proto.trainer_spec.unk_id = EOS, UNK
    proto.trainer_spec.bos_id, proto.trainer_spec.pad_id = -1, size - 1
    return Tokenizer(proto.SerializeToString())


def export_project(model, work: Path, quantize: str | None, precision: str = "fp32") -> tuple[Path, Path]:
    """Load the Marian weights into this project's Transformer and export a model version; returns the
    version directory and the PyTorch checkpoint."""
    from common.model_format.layout import BEST_CHECKPOINT, TEST_SPLIT_FILE
    from export.options import ExportOptions
    from export.pipeline import export_model
    from training.models.checkpoint import build_model, save_checkpoint
    from training.models.transformer import hf_state_dict

    c = model.config
    ours = build_model(
        "transformer", vocab_size=c.vocab_size, d_model=c.d_model, encoder_layers=c.encoder_layers,
        decoder_layers=c.decoder_layers, heads=c.encoder_attention_heads, ffn_dim=c.encoder_ffn_dim,
        activation="swish", dropout=0.0, max_positions=256, pad_id=c.vocab_size - 1, eos_id=EOS, bos_id=EOS,
        decoder_start_id=c.vocab_size - 1,
    ).eval()
    ours.load_state_dict(hf_state_dict(model.state_dict()))
    run = work / "run"
    run.mkdir(exist_ok=True)
    save_checkpoint(run / BEST_CHECKPOINT, ours)
    placeholder_tokenizer(c.vocab_size).save(run)
    # int8 export scores held-out BLEU: random "sentences" of placeholder pieces (the figure is meaningless
    # for random weights; the export only needs the file)
    rng = np.random.default_rng(0)
    lines = [" ".join(f"t{i}" for i in rng.integers(2, c.vocab_size - 1, 8)) for _ in range(20)]
    (run / TEST_SPLIT_FILE).write_text("".join(f"{line}\t{line}\n" for line in lines))
    options = ExportOptions(checkpoint=str(run), name=f"bench-{quantize or precision}",
                            model_repository=str(work / "models"), quantize=quantize, precision=precision,
                            force=True, progress=False, threads=THREADS,
                            parity_tolerance=1e-2)  # random weights: logits in the hundreds
    return export_model(options).version_dir, run / BEST_CHECKPOINT


def export_baseline(checkout: Path, model, work: Path, quantize: str | None) -> Path:
    """The same weights exported by another checkout's code (its own ``export_project``); returns the
    model version directory."""
    hf_dir = save_marian(model, work)
    code = (f"import sys; sys.path[:0] = [{str(checkout)!r}, {str(checkout / 'benchmarks')!r}]\n"
            "from pathlib import Path\nfrom transformers import MarianMTModel\nimport engine_throughput as bench\n"
            f"model = MarianMTModel.from_pretrained({str(hf_dir)!r})\n"
            f"print(bench.export_project(model, Path({str(work / 'baseline')!r}), {quantize!r})[0])")
    (work / "baseline").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=checkout, env=env)
    if result.returncode != 0:
        raise SystemExit(f"the baseline export failed:\n{result.stderr[-3000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def sources(batch: int, vocab: int, seed: int = 1, ordinary: tuple[int, int] | None = None) -> list[list[int]]:
    """Random source ids: Marian's ordinary ids (all but EOS, unk and pad), or those in ``ordinary``'s range."""
    rng = np.random.default_rng(seed)
    low, high = ordinary or (2, vocab - 1)
    return [rng.integers(low, high, SOURCE_TOKENS).tolist() for _ in range(batch)]


@dataclass
class Cell:
    size: str
    precision: str
    batch: int
    beam: int
    runs: dict[str, list[float]] = field(default_factory=dict)  # runtime -> tokens/s per repeat
    calls: dict[str, list[list[float]]] = field(default_factory=dict)  # runtime -> per repeat, seconds per
    # call at ANATOMY_TOKENS and at OUTPUT_TOKENS (--anatomy)
    ort: list[list[float]] = field(default_factory=list)  # the project's per repeat: seconds per call inside
    # the encoder's and the step decoders' ONNX Runtime sessions, at OUTPUT_TOKENS (--anatomy)
    step_gaps: list[float] = field(default_factory=list)  # the project's per repeat: median seconds between two
    # step-graph runs of one call, at OUTPUT_TOKENS (--anatomy)

    def anatomy(self, runtime: str) -> tuple[float, float] | None:
        """``runtime``'s fixed seconds per call and seconds per decoding step (medians over the repeats)."""
        if runtime not in self.calls:
            return None
        steps = [(full - short) / (OUTPUT_TOKENS - ANATOMY_TOKENS) for short, full in self.calls[runtime]]
        fixed = [short - ANATOMY_TOKENS * step for (short, _), step in zip(self.calls[runtime], steps, strict=True)]
        return statistics.median(fixed), statistics.median(steps)


def run_worker(runtime: str, model: Path, job: Path, *, load_torch: bool = False,
               baseline: Path | None = None) -> tuple[dict, str]:
    """One worker process; returns its report and the backend lines of its stderr (CTranslate2's ISA).
    Runtime "baseline" is the project worker of the ``baseline`` checkout."""
    env = {**os.environ, "CT2_VERBOSE": "1"}
    worker, kind = (WORKER, runtime) if runtime != "baseline" else (baseline / "benchmarks" / WORKER.name, "project")
    command = [sys.executable, str(worker), kind, str(model), str(job)] + (["--load-torch"] if load_torch else [])
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{runtime} worker failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    backend = [re.sub(r"^(\s*\[[^\]]*\])+\s*-?\s*", "", line) for line in result.stderr.splitlines()
               if "ctranslate2" in line and ("CPU:" in line or "ISA" in line or "backend" in line.lower())]
    return report, "; ".join(backend)


def measure(size: str, precision: str, models: dict[str, Path], args: argparse.Namespace, work: Path,
            notes: dict[str, str], torch_loaded: dict[str, bool]) -> tuple[list[Cell], list[float]]:
    """Every runtime's workers for one model, alternating; returns the cells and the GEMM rates seen, and
    fills in each runtime's backend note and whether torch was loaded in its workers."""
    vocab = SIZES[size]["vocab"]
    cells = [Cell(size, precision, batch, beam) for batch in args.batches for beam in args.beams]
    jobs = {}
    languages = nllb_languages(work / "nllb") if SIZES[size].get("family") == "nllb" else None
    ordinary = tuple(languages["ordinary"]) if languages else None
    for runtime in models:
        wanted = [(c.batch, c.beam) for c in cells if runtime != "pytorch" or c.beam == 1]
        job = {"threads": THREADS, "provider": args.provider, "seconds": args.seconds, "output_tokens": OUTPUT_TOKENS,
               "precision": precision,
               "ort_spinning": args.ort_spinning, "anatomy_tokens": ANATOMY_TOKENS if args.anatomy else None,
               "cells": wanted, "sources": {str(b): sources(b, vocab, ordinary=ordinary) for b in args.batches},
               "check": sources(8, vocab, seed=7, ordinary=ordinary), "languages": languages,
               "attention_cell": max(args.batches) if attention_cell(args, precision) else None}
        jobs[runtime] = work / f"job-{runtime}.json"
        jobs[runtime].write_text(json.dumps(job))
    order, reports, gemm = list(models), {runtime: [] for runtime in models}, []
    for repeat in range(args.repeats):
        for runtime in order[repeat % len(order):] + order[: repeat % len(order)]:
            report, backend = run_worker(runtime, models[runtime], jobs[runtime], baseline=args.baseline)
            if report["torch_loaded"] and runtime in WITHOUT_TORCH:
                raise SystemExit(f"the {runtime} worker loaded torch: its figures would not be its own")
            notes.setdefault(runtime, report["backend"] + (f"; {backend}" if backend else ""))
            torch_loaded[runtime] = torch_loaded.get(runtime, False) or report["torch_loaded"]
            gemm += [report["gemm_gflops"]] if "gemm_gflops" in report else []
            reports[runtime].append(report)
            time.sleep(args.pause)
    for cell in cells:
        for runtime, runs in reports.items():
            key = f"{cell.batch}x{cell.beam}"
            if key in runs[0]["tok_s"]:
                cell.runs[runtime] = [run["tok_s"][key] for run in runs]
            if key in runs[0].get("call_s", {}):  # a baseline checkout's worker may not report them
                cell.calls[runtime] = [run["call_s"][key] for run in runs]
            if runtime == "project" and key in runs[0].get("ort_s", {}):
                cell.ort = [run["ort_s"][key] for run in runs]
            if runtime == "project" and key in runs[0].get("step_gap_s", {}):
                cell.step_gaps = [run["step_gap_s"][key] for run in runs]
    check = {runtime: runs[0]["check"] for runtime, runs in reports.items()}
    agree = {runtime: sum(a[: OUTPUT_TOKENS - 1] == b[: OUTPUT_TOKENS - 1]
                          for a, b in zip(check["project"], outputs, strict=True))
             for runtime, outputs in check.items() if runtime != "project"}
    if agree:
        print(f"{size} {precision}: greedy outputs agree with the project's on "
              + ", ".join(f"{runtime} {n}/{len(check['project'])}" for runtime, n in agree.items()), flush=True)
    if "project" in reports and attention_cell(args, precision):
        key = f"{max(args.batches)}x1"
        plain = statistics.median(run["tok_s"][key] for run in reports["project"])
        attention = statistics.median(run["tok_s"][key + "+attention"] for run in reports["project"])
        print(f"{size} fp32 B={max(args.batches)} greedy: {plain:,.0f} tok/s without attention output, "
              f"{attention:,.0f} with ({attention / plain:.2f}x)", flush=True)
    return cells, gemm


def attention_cell(args: argparse.Namespace, precision: str) -> bool:
    """Whether the project's worker also times the largest greedy batch with attention output (and the CPU's
    GEMM rate): fp32 on the CPU."""
    return precision == "fp32" and 1 in args.beams and args.provider == "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["SMALL", "BASE"], choices=list(SIZES))
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu",
                        help="where the project's engine, generate and CTranslate2 run (cuda: the first GPU)")
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "fp16", "int8"],
                        help="default: fp32 int8 on the CPU, fp32 fp16 on CUDA")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES,
                        help="which runtimes to measure (the project's is always included; default: ctranslate2 and "
                             "pytorch on the CPU, generate on CUDA)")
    parser.add_argument("--repeats", type=int, default=5, help="worker runs per runtime, alternating")
    parser.add_argument("--seconds", type=float, default=1.5, help="sustained timing per cell and worker run")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between worker runs")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also measure another checkout of this project (e.g. main's) on the same weights, "
                             "exported by its own code")
    parser.add_argument("--anatomy", action="store_true",
                        help=f"also time every cell at {ANATOMY_TOKENS} output tokens and split each runtime's time "
                             "into a fixed cost per call and a cost per decoding step")
    parser.add_argument("--ort-spinning", action=argparse.BooleanOptionalAction, default=True,
                        help="the project's ONNX Runtime threads busy-wait within a run (the engine's default)")
    args = parser.parse_args()
    args.precisions = args.precisions or (["fp32", "int8"] if args.provider == "cpu" else ["fp32", "fp16"])
    if args.provider == "cuda" and "int8" in args.precisions:
        raise SystemExit("int8 versions do not run on CUDA (their MatMulInteger nodes have no CUDA kernel)")
    runtimes = ["project"] + [r for r in args.runtimes or DEFAULT_RUNTIMES[args.provider] if r != "project"]
    if args.provider == "cuda" and "pytorch" in runtimes:
        raise SystemExit("the pytorch runtime (this project's greedy decoder) runs on the CPU only; use generate")

    print(f"host: {host()}; {THREADS} threads per runtime, each runtime in its own process; provider "
          f"{args.provider}", flush=True)
    cells: list[Cell] = []
    gemm: list[float] = []
    notes: dict[str, str] = {}
    torch_loaded: dict[str, bool] = {}
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            nllb = SIZES[size].get("family") == "nllb"
            hf = nllb_directory(size, work) if nllb else marian_model(size)
            for precision in args.precisions:
                if nllb and precision != "fp32":  # an import exports in fp32 (no held-out BLEU to check the rest)
                    print(f"{size}: {precision} skipped: a Hugging Face import exports in fp32", flush=True)
                    continue
                quantize = "int8" if precision == "int8" else None
                if nllb:
                    version_dir, checkpoint = export_nllb(hf, work), None
                else:
                    version_dir, checkpoint = export_project(hf, work, quantize,
                                                             "fp16" if precision == "fp16" else "fp32")
                models = {"project": version_dir}
                if "ctranslate2" in runtimes:
                    models["ctranslate2"] = convert_ctranslate2(hf, work, quantize)
                if "pytorch" in runtimes and precision == "fp32" and checkpoint is not None:
                    models["pytorch"] = checkpoint
                if "generate" in runtimes and precision != "int8":
                    models["generate"] = hf if nllb else save_marian(hf, work)
                if args.baseline and not nllb:
                    models["baseline"] = export_baseline(args.baseline.resolve(), hf, work, quantize)
                measured, rates = measure(size, precision, models, args, work, notes, torch_loaded)
                cells += measured
                gemm += rates
                for cell in measured:
                    print(format_cell(cell, max(gemm, default=0.0)), flush=True)
    print("\nbackends:\n" + "\n".join(f"  {runtime}: {note}" for runtime, note in notes.items()))
    print("torch loaded in the workers: " + ", ".join(f"{r} {'yes' if loaded else 'no'}"
                                                       for r, loaded in torch_loaded.items()))
    if gemm:
        print(f"fp32 GEMM ceiling (ORT MatMul 1024^3, {THREADS} threads): {max(gemm):.1f} GFLOP/s, the best of "
              f"{len(gemm)} measurements spread over the run (range {min(gemm):.1f}-{max(gemm):.1f})")
    print(f"\nhost: {host()}")
    print(table(cells, max(gemm, default=0.0)))
    if args.anatomy:
        print(f"\nfixed cost per call and cost per decoding step (from {ANATOMY_TOKENS} and {OUTPUT_TOKENS} "
              "output tokens; medians):")
        print(anatomy_table(cells))


def flops_per_token(size: str, beam: int) -> float:
    """Matmul FLOPs per output token of a sentence (attention over ~24+20 positions is negligible): every
    beam row runs the decoder step; the encoder, including each decoder layer's cross-attention key and
    value projections, runs once per sentence over the source."""
    s = SIZES[size]
    d, f, layers, vocab = s["d_model"], s["ffn"], s["layers"], s["vocab"]
    decoder = layers * 2 * (4 * d * d + 2 * d * d + 2 * d * f) + 2 * d * vocab  # self q,k,v,o + cross q,o + ffn
    encoder = layers * 2 * (4 * d * d + 2 * d * f) + layers * 2 * (2 * d * d)  # + cross k,v per decoder layer
    return beam * decoder + encoder * SOURCE_TOKENS / OUTPUT_TOKENS


def _stat(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def _ratio(cell: Cell, other: str = "ctranslate2") -> str:
    if other not in cell.runs:
        return "-"
    return f"{statistics.median(cell.runs['project']) / statistics.median(cell.runs[other]):.2f}x"


def _share(cell: Cell, gflops: float) -> str:
    if cell.precision != "fp32" or cell.batch < 32 or not gflops:
        return "-"
    return f"{statistics.median(cell.runs['project']) * flops_per_token(cell.size, cell.beam) / (gflops * 1e9):.0%}"


def format_cell(cell: Cell, gflops: float) -> str:
    parts = [f"{cell.size:<5} {cell.precision:<4} B={cell.batch:<3} beam={cell.beam}",
             *(f"{runtime} {_stat(runs)}" for runtime, runs in cell.runs.items()), f"ratio {_ratio(cell)}"]
    for other in ("generate", "baseline"):
        if other in cell.runs:
            parts.append(f"project/{other} {_ratio(cell, other)}")
    return " | ".join(parts) + (f" | ceiling share {_share(cell, gflops)}" if _share(cell, gflops) != "-" else "")


def table(cells: list[Cell], gflops: float) -> str:
    extras = [(other, title) for other, title in (("generate", "generate"), ("baseline", "baseline"))
              if any(other in c.runs for c in cells)]
    lines = [
        "| size | precision | batch | beam | project tok/s | CTranslate2 tok/s | project/CT2 | PyTorch tok/s "
        "| % of fp32 ceiling |" + "".join(f" {title} tok/s | project/{title} |" for _, title in extras),
        "|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(extras),
    ]
    for c in cells:
        ct2 = _stat(c.runs["ctranslate2"]) if "ctranslate2" in c.runs else "-"
        torch_cell = _stat(c.runs["pytorch"]) if "pytorch" in c.runs else "-"
        extra = "".join(f" {_stat(c.runs[other]) if other in c.runs else '-'} | {_ratio(c, other)} |"
                        for other, _ in extras)
        lines.append(f"| {c.size} | {c.precision} | {c.batch} | {c.beam} | {_stat(c.runs['project'])} | {ct2} | "
                     f"{_ratio(c)} | {torch_cell} | {_share(c, gflops)} |{extra}")
    return "\n".join(lines)


def anatomy_table(cells: list[Cell]) -> str:
    """The --anatomy table: each runtime's fixed ms per call and us per step (a straight-line fit through
    the two lengths), the project's speed relative to CTranslate2 on each part (above 1: the project's
    part is faster), the project's measured call at the full length split into the encoder's and the
    step graphs' ONNX Runtime time and the rest (Python: the search, tokens, I/O binding, and the call's
    own set-up and results), per step, and the host's time per step: the median time between two step-graph
    runs of one call."""
    runtimes = [r for r in ("project", "ctranslate2", "baseline") if any(r in c.calls for c in cells)]
    names = {"project": "project", "ctranslate2": "CT2", "baseline": "baseline"}
    columns = [f"{names[r]} fixed ms | {names[r]} us/step" for r in runtimes] + [
        "project/CT2 per step | project/CT2 fixed",
        f"project at {OUTPUT_TOKENS} tokens: encoder ms | step graphs us/step | rest us/step",
        "host us between steps"]
    lines = ["| size | precision | batch | beam | " + " | ".join(columns) + " |",
             "|---|---|---|---|" + "---|---|" * (len(runtimes) + 1) + "---|---|---|---|"]
    for c in cells:
        parts = {r: c.anatomy(r) for r in runtimes}
        own, ct2 = parts.get("project"), parts.get("ctranslate2")
        row = [f"{p[0] * 1e3:.2f} | {p[1] * 1e6:,.0f}" if p else "- | -" for p in parts.values()]
        row.append(f"{ct2[1] / own[1]:.2f}x | {ct2[0] / own[0]:.2f}x" if own and ct2 and min(own) > 0 else "- | -")
        if c.ort and "project" in c.calls:  # the measured call, not the fit: encoder + step graphs + the rest
            call = statistics.median(full for _, full in c.calls["project"])
            encoder, graphs = (statistics.median(part[i] for part in c.ort) for i in (0, 1))
            row.append(f"{encoder * 1e3:.2f} | {graphs / OUTPUT_TOKENS * 1e6:,.0f} | "
                       f"{(call - encoder - graphs) / OUTPUT_TOKENS * 1e6:,.0f}")
        else:
            row.append("- | - | -")
        row.append(f"{statistics.median(c.step_gaps) * 1e6:,.0f}" if c.step_gaps else "-")
        lines.append(f"| {c.size} | {c.precision} | {c.batch} | {c.beam} | " + " | ".join(row) + " |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
