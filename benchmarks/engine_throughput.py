"""Engine benchmark: this project's ONNX Runtime engine vs CTranslate2 vs PyTorch on the same weights.

    python benchmarks/engine_throughput.py                 # SMALL and BASE, fp32 and int8, batch 1/8/32, beam 1/4
    python benchmarks/engine_throughput.py --sizes SMALL --batches 1 32 --repeats 3

A random-weight Hugging Face ``MarianMTModel`` is built for each size, converted with CTranslate2's
``TransformersConverter`` and loaded into this project's Transformer, which the project's exporter
turns into a model version. Greedy outputs are checked to agree token for token, then target
tokens/s are measured with the output forced to 24 tokens (EOS suppressed through
``final_logits_bias``), runtimes interleaved, 2 threads each. Prints medians with min-max and ratios,
plus this machine's fp32 GEMM rate (the compute ceiling) and the share of it each batch-32 cell uses.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SIZES = {
    "SMALL": dict(d_model=256, layers=3, heads=4, ffn=1024, vocab=8000),
    "BASE": dict(d_model=512, layers=6, heads=8, ffn=2048, vocab=32000),
}
OUTPUT_TOKENS = 24
SOURCE_TOKENS = 20
THREADS = 2
EOS, UNK = 0, 1  # Marian's layout; pad is the last id


def gemm_ceiling(threads: int = THREADS, n: int = 1024, repeats: int = 10) -> float:
    """fp32 GEMM FLOP/s of this machine through ONNX Runtime's MatMul (MLAS), ``threads`` threads."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    a = np.random.rand(n, n).astype(np.float32)
    feeds = {"a": a, "b": a}
    session.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    del onnx
    return 2 * n**3 / statistics.median(times)


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
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, EOS] = -1e4  # never EOS: every runtime generates exactly 24 tokens
        model.final_logits_bias[0, [UNK, vocab - 1]] = -1e4  # nor unk, nor pad (CTranslate2 drops pad)
    return model


class _Vocabulary:
    """The little of a tokenizer CTranslate2's Marian loader reads."""

    eos_token, unk_token = "</s>", "<unk>"

    def __init__(self, size: int) -> None:
        self.tokens = ["</s>", "<unk>"] + [f"t{i}" for i in range(2, size - 1)] + ["<pad>"]

    def get_vocab(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}


def convert_ctranslate2(model, work: Path, quantization: str | None) -> Path:
    import ctranslate2

    hf_dir = work / "hf"
    if not hf_dir.exists():
        model.save_pretrained(hf_dir)
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

    from nmt.model_format.tokenizer import Tokenizer, train_tokenizer

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


def export_project(model, work: Path, quantize: str | None):
    """Load the Marian weights into this project's Transformer and export a model version."""
    from export.options import ExportOptions
    from export.pipeline import export_model
    from nmt.model_format.layout import BEST_CHECKPOINT, TEST_SPLIT_FILE
    from server.engine import Engine
    from training.models.checkpoint import build_model, save_checkpoint
    from training.models.transformer import marian_state_dict

    c = model.config
    ours = build_model(
        "transformer", vocab_size=c.vocab_size, d_model=c.d_model, encoder_layers=c.encoder_layers,
        decoder_layers=c.decoder_layers, heads=c.encoder_attention_heads, ffn_dim=c.encoder_ffn_dim,
        activation="swish", dropout=0.0, max_positions=256, pad_id=c.vocab_size - 1, eos_id=EOS, bos_id=EOS,
        decoder_start_id=c.vocab_size - 1,
    ).eval()
    ours.load_state_dict(marian_state_dict(model.state_dict()))
    run = work / "run"
    run.mkdir(exist_ok=True)
    save_checkpoint(run / BEST_CHECKPOINT, ours)
    placeholder_tokenizer(c.vocab_size).save(run)
    # int8 export scores held-out BLEU: random "sentences" of placeholder pieces (the figure is meaningless
    # for random weights; the export only needs the file)
    rng = np.random.default_rng(0)
    lines = [" ".join(f"t{i}" for i in rng.integers(2, c.vocab_size - 1, 8)) for _ in range(20)]
    (run / TEST_SPLIT_FILE).write_text("".join(f"{line}\t{line}\n" for line in lines))
    options = ExportOptions(checkpoint=str(run), name=f"bench-{quantize or 'fp32'}",
                            model_repository=str(work / "models"), quantize=quantize,
                            force=True, progress=False, threads=THREADS,
                            parity_tolerance=1e-2)  # random weights: logits in the hundreds
    result = export_model(options)
    return ours, Engine.load(result.version_dir, provider="cpu", intra_op_threads=THREADS)


def sources(batch: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab - 1, SOURCE_TOKENS).tolist() for _ in range(batch)]


@dataclass
class Cell:
    size: str
    precision: str
    batch: int
    beam: int
    runs: dict[str, list[float]]  # runtime -> tokens/s per repeat


def project_runner(engine, batch_sources: list[list[int]], beam: int) -> Callable[[], list[list[int]]]:
    from server.types import DecodingOptions, SentenceRequest

    options = DecodingOptions(beam_size=beam, num_hypotheses=1, max_length=OUTPUT_TOKENS, length_penalty=1.0)
    requests = [SentenceRequest(ids, options) for ids in batch_sources]

    def run() -> list[list[int]]:
        result = engine.translate_batch(requests)
        return [t.hypotheses[0].token_ids for t in result.translations]

    return run


def ct2_runner(translator, batch_sources: list[list[int]], beam: int) -> Callable[[], list[list[int]]]:
    tokens = [[f"t{i}" for i in ids] + ["</s>"] for ids in batch_sources]

    def run() -> list[list[int]]:
        results = translator.translate_batch(
            tokens, beam_size=beam, max_decoding_length=OUTPUT_TOKENS, min_decoding_length=OUTPUT_TOKENS,
            max_batch_size=0,
        )
        return [[int(t[1:]) for t in r.hypotheses[0]] for r in results]  # pieces are "t<id>"

    return run


def torch_runner(model, batch_sources: list[list[int]]) -> Callable[[], list[list[int]]]:
    from training.search import greedy_batch

    pad = model.config.pad_id
    src = torch.tensor([ids + [model.config.eos_id] for ids in batch_sources])
    del pad

    def run() -> list[list[int]]:
        return greedy_batch(model, src, OUTPUT_TOKENS)

    return run


def attention_cost(engine, batch_sources: list[list[int]], repeats: int) -> tuple[float, float]:
    """Median tokens/s of greedy decoding without and with attention output, interleaved."""
    from server.types import DecodingOptions, SentenceRequest

    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for attention in (False, True):
            options = DecodingOptions(beam_size=1, max_length=OUTPUT_TOKENS, return_attention=attention)
            requests = [SentenceRequest(ids, options) for ids in batch_sources]
            start = time.perf_counter()
            engine.translate_batch(requests)
            runs[attention].append(len(batch_sources) * OUTPUT_TOKENS / (time.perf_counter() - start))
    return statistics.median(runs[False]), statistics.median(runs[True])


def timed(run: Callable[[], list[list[int]]], batch: int) -> float:
    start = time.perf_counter()
    run()
    return batch * OUTPUT_TOKENS / (time.perf_counter() - start)


def flops_per_token(size: str, beam: int) -> float:
    """Matmul FLOPs per output token of a sentence (attention over ~24+20 positions is negligible): every
    beam row runs the decoder step; the encoder, including each decoder layer's cross-attention key and
    value projections, runs once per sentence over the source."""
    s = SIZES[size]
    d, f, layers, vocab = s["d_model"], s["ffn"], s["layers"], s["vocab"]
    decoder = layers * 2 * (4 * d * d + 2 * d * d + 2 * d * f) + 2 * d * vocab  # self q,k,v,o + cross q,o + ffn
    encoder = layers * 2 * (4 * d * d + 2 * d * f) + layers * 2 * (2 * d * d)  # + cross k,v per decoder layer
    return beam * decoder + encoder * SOURCE_TOKENS / OUTPUT_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--beams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import ctranslate2

    torch.set_num_threads(THREADS)
    # the machine's speed drifts (a shared host measured 35 and 70 GFLOP/s an hour apart): the ceiling is
    # the best of measurements spread over the run, so a slow moment cannot make the shares exceed 100 %
    ceilings = [gemm_ceiling()]
    print(f"fp32 GEMM rate (ORT MatMul 1024^3, {THREADS} threads): {ceilings[0] / 1e9:.1f} GFLOP/s", flush=True)
    cells: list[Cell] = []
    for size in args.sizes:
        if cells:
            ceilings.append(gemm_ceiling())
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            hf = marian_model(size)
            for precision in args.precisions:
                quantize = "int8" if precision == "int8" else None
                ours_torch, engine = export_project(hf, work, quantize)
                translator = ctranslate2.Translator(
                    str(convert_ctranslate2(hf, work, quantize)), device="cpu", compute_type=precision.replace(
                        "fp32", "float32"), inter_threads=1, intra_threads=THREADS,
                )
                check = sources(8, SIZES[size]["vocab"], seed=7)
                ours_tokens = project_runner(engine, check, 1)()
                ct2_tokens = ct2_runner(translator, check, 1)()
                pairs = zip(ours_tokens, ct2_tokens, strict=True)
                agree = sum(a[: OUTPUT_TOKENS - 1] == b[: OUTPUT_TOKENS - 1] for a, b in pairs)
                line = f"{size} {precision}: greedy outputs agree with CTranslate2 on {agree}/{len(check)} sentences"
                if precision == "fp32":
                    torch_tokens = torch_runner(ours_torch, check)()
                    same = sum(a == b[: len(a)] for a, b in zip(ours_tokens, torch_tokens, strict=True))
                    line += f", with PyTorch on {same}/{len(check)}"
                print(line, flush=True)
                if precision == "fp32":
                    plain, with_attention = attention_cost(engine, sources(32, SIZES[size]["vocab"]), args.repeats)
                    print(f"{size} fp32 B=32 greedy: {plain:,.0f} tok/s without attention output, "
                          f"{with_attention:,.0f} with ({with_attention / plain:.2f}x)", flush=True)
                for batch in args.batches:
                    batch_sources = sources(batch, SIZES[size]["vocab"])
                    for beam in args.beams:
                        runners = {
                            "project": project_runner(engine, batch_sources, beam),
                            "ctranslate2": ct2_runner(translator, batch_sources, beam),
                        }
                        if precision == "fp32" and beam == 1:
                            runners["pytorch"] = torch_runner(ours_torch, batch_sources)
                        for run in runners.values():
                            run()  # warm up
                        runs: dict[str, list[float]] = {name: [] for name in runners}
                        for _ in range(args.repeats):
                            for name, run in runners.items():
                                runs[name].append(timed(run, batch))
                        cell = Cell(size, precision, batch, beam, runs)
                        cells.append(cell)
                        print(format_cell(cell, max(ceilings)), flush=True)
                del translator, engine
    ceilings.append(gemm_ceiling())
    print(f"\nfp32 GEMM ceiling: {max(ceilings) / 1e9:.1f} GFLOP/s, the best of "
          f"{', '.join(f'{c / 1e9:.1f}' for c in ceilings)} measured through the run")
    print(table(cells, max(ceilings)))


def _stat(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def format_cell(cell: Cell, ceiling: float) -> str:
    ours, ct2 = statistics.median(cell.runs["project"]), statistics.median(cell.runs["ctranslate2"])
    parts = [f"{cell.size:<5} {cell.precision:<4} B={cell.batch:<3} beam={cell.beam}",
             f"project {_stat(cell.runs['project'])}", f"ct2 {_stat(cell.runs['ctranslate2'])}",
             f"ratio {ours / ct2:.2f}x"]
    if "pytorch" in cell.runs:
        parts.append(f"pytorch {_stat(cell.runs['pytorch'])}")
    if cell.precision == "fp32" and cell.batch >= 32:
        parts.append(f"ceiling share {ours * flops_per_token(cell.size, cell.beam) / ceiling:.0%}")
    return " | ".join(parts)


def table(cells: list[Cell], ceiling: float) -> str:
    lines = [
        "| size | precision | batch | beam | project tok/s | CTranslate2 tok/s | ratio | PyTorch tok/s "
        "| % of fp32 ceiling |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        ours, ct2 = statistics.median(c.runs["project"]), statistics.median(c.runs["ctranslate2"])
        torch_cell = _stat(c.runs["pytorch"]) if "pytorch" in c.runs else "-"
        share = (f"{ours * flops_per_token(c.size, c.beam) / ceiling:.0%}"
                 if c.precision == "fp32" and c.batch >= 32 else "-")
        lines.append(f"| {c.size} | {c.precision} | {c.batch} | {c.beam} | {_stat(c.runs['project'])} | "
                     f"{_stat(c.runs['ctranslate2'])} | {ours / ct2:.2f}x | {torch_cell} | {share} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
