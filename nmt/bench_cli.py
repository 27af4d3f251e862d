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
    "head-of-line": "head_of_line.py",
    "stream": "streaming.py",
    "interactive": "interactive.py",
    "soak": "soak.py",
    "export": "export_size.py",
    "device-memory": "device_memory.py",
    "documents": "documents.py",
    "cache": "cache.py",
    "glossary": "glossary.py",
}
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run a maintained benchmark (engine, server, batching, streaming, soak, export, ...)",
        description=(
            "Run benchmarks/<script>.py with the remaining arguments; `nmt bench NAME --help` shows its options "
            "and benchmarks/README.md its current figures. train: held-out BLEU and wall time of the presets; "
            "engine: this engine against CTranslate2 and PyTorch on the same weights (on a GPU: against Hugging "
            "Face generate); server: the gRPC server against the bare engine under load (--capacity: the serving "
            "layer alone, one process and --frontends N); batching: static against continuous batching under a "
            "mix of short and long sentences; head-of-line: one-sentence requests behind a large one; stream: "
            "TranslateStream's time to the first word beside Translate's latency; interactive: completing from a "
            "target prefix, and Score against Translate; soak: a long run at a fraction of saturation (latency "
            "drift, memory); export: an OPUS-MT-sized import through nmt export and nmt serve (time, memory, "
            "bytes); documents: a text of many sentences in one request against its sentences as texts of their "
            "own, and what reading and putting a document back cost per sentence; cache: a replay of repeated "
            "strings with the translation cache off, in the serving process and on Redis; glossary: what 0-3 "
            "glossary terms per sentence cost in sentences/s, and BLEU with a glossary of the references' month "
            "names; device-memory: a version's device memory on CUDA (needs a GPU)."
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
