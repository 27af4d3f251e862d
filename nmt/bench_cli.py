"""``nmt bench``: run one of the benchmark scripts in ``benchmarks/`` (from a source checkout)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from common.errors import NmtError

SCRIPTS = {
    "train": "train_quality.py",
    "engine": "engine_throughput.py",
    "server": "server_load.py",
    "batching": "batching.py",
    "http": "http_vs_grpc.py",
    "proxy": "proxy.py",
    "interactive": "interactive.py",
    "controls": "controls_cost.py",
    "export": "export_size.py",
    "device-memory": "device_memory.py",
    "device-search": "device_search.py",
    "cache-reorder": "cache_reorder.py",
    "decode-cuts": "decode_cuts.py",
    "encoder-shapes": "encoder_shapes.py",
    "gc": "gc_pauses.py",
    "stream": "streaming.py",
    "timeline": "request_timeline.py",
}
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run a benchmark (training quality, engine throughput, server load)",
        description=(
            "Run benchmarks/<script>.py with the remaining arguments; `nmt bench NAME --help` shows its options. "
            "train: held-out BLEU and wall time of the presets; engine: this engine vs CTranslate2 and PyTorch on the "
            "same weights; server: the gRPC server vs the bare engine under load (--capacity: the serving layer "
            "alone, --engine null, as one process and with --frontends); batching: static vs continuous batching "
            "under a mix of short and long sentences; interactive: completing a sentence from a target prefix vs from "
            "scratch, Score vs Translate; controls: what the decoders' logits output and the decoding controls cost; "
            "export: an OPUS-MT-sized model through nmt export and nmt serve (time, peak memory, bytes written, "
            "server memory, outputs against transformers); stream: TranslateStreaming's time to the first word and "
            "between words beside Translate's latency; device-memory: a version's device memory on CUDA with its "
            "weights shared on the device or copied by each session (needs a GPU); device-search: beam search's "
            "selection on the device against the host's, on the engine that keeps its state on the device (with "
            "--cuda-graphs, also its runs kept for CUDA graphs); cache-reorder: one decoder layer's in-place attention "
            "plus the beam's row copy against DecoderMaskedMultiHeadAttention reading through a cache indirection "
            "table; decode-cuts: how often a decode's plain steps are cut when sentences end, and the host's work "
            "each cut costs; encoder-shapes: encoder calls at shapes not run before, against the same shapes again "
            "and against shapes rounded up to buckets; gc: the cyclic garbage collector's pauses in the server with "
            "start-up's objects frozen and without; timeline: where a lone caller's request spends its time, "
            "hand-off by hand-off, with the model, the null engine and the null engine streaming memory as a "
            "model's weights do."
        ),
    )
    p.add_argument("name", choices=sorted(SCRIPTS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    script = BENCHMARKS / SCRIPTS[args.name]
    if not script.is_file():
        raise NmtError(f"{script} not found: benchmarks run from a source checkout")
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(BENCHMARKS))  # as `python benchmarks/<script>.py` would: the scripts import each other
    runpy.run_path(str(script), run_name="__main__")
    return 0
