"""The engine benchmark measures each runtime alone: a real run on a tiny random Marian model.

Its CTranslate2 and ONNX Runtime workers must never load torch (torch's OpenMP runtime in the same
process slowed CTranslate2 up to 8x); the PyTorch worker reporting torch proves the probe sees it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")


def test_each_runtime_alone_in_its_process() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "engine_throughput.py"), "--sizes", "TINY",
               "--precisions", "fp32", "--batches", "2", "--beams", "1", "2", "--repeats", "1", "--seconds", "0.1",
               "--pause", "0", "--anatomy", "--runtimes", "ctranslate2", "pytorch", "generate"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "torch loaded in the workers: project no, ctranslate2 no, pytorch yes, generate yes" in out
    assert "greedy outputs agree with the project's on ctranslate2 8/8, pytorch 8/8, generate 8/8" in out
    assert "Selected ISA" in out and "onnxruntime" in out and "CPU capability" in out  # backends beside the table
    assert out.count("host: ") == 2
    grid, heading, rest = out.partition("fixed cost per call and cost per decoding step")
    assert heading, "no --anatomy table"
    anatomy = rest.splitlines()
    rows = [line for line in grid.splitlines() if line.startswith("| TINY | fp32 | 2 |")]
    assert len(rows) == 2  # greedy and beam 2
    greedy = rows[0].split(" | ")
    assert greedy[5] != "-" and greedy[7] != "-" and greedy[6].endswith("x")  # CTranslate2, PyTorch, ratio
    assert greedy[9] != "-" and greedy[10].rstrip(" |").endswith("x")  # Hugging Face generate tok/s, project/generate
    assert "| project fixed ms | project us/step | CT2 fixed ms | CT2 us/step |" in anatomy[1]
    split = [line.split(" | ") for line in anatomy if line.startswith("| TINY | fp32 | 2 |")]
    assert len(split) == 2 and all(float(cells[5].replace(",", "")) > 0 for cells in split)  # project us/step
    assert split[0][8].endswith("x") and split[0][9].endswith("x")  # project/CT2 per step, fixed
    encoder, graphs, rest = (float(cell.rstrip(" |").replace(",", "")) for cell in split[0][10:13])
    assert encoder > 0 and graphs > 0 and rest > 0  # the project's call: encoder ms, step graphs and rest us/step
    assert anatomy[1].rstrip().endswith("| rest us/step | host us between steps |")
    gap = float(split[0][13].rstrip(" |").replace(",", ""))
    assert 0 < gap < 2 * rest  # the host's work between two steps: about the rest, which also holds the call's set-up


def test_a_worker_that_loaded_torch_says_so(tmp_path: Path) -> None:
    """``--load-torch`` (the old benchmark's situation) shows up in the worker's report."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import engine_throughput as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    model = bench.convert_ctranslate2(bench.marian_model("TINY"), tmp_path, None)
    job = tmp_path / "job.json"
    job.write_text('{"threads": 1, "seconds": 0.05, "output_tokens": 24, "precision": "fp32", "cells": [[1, 1]], '
                   '"sources": {"1": [[5, 6, 7]]}, "check": [[5, 6, 7]]}')
    alone, _ = bench.run_worker("ctranslate2", model, job)
    beside_torch, _ = bench.run_worker("ctranslate2", model, job, load_torch=True)
    assert (alone["torch_loaded"], beside_torch["torch_loaded"]) == (False, True)
    assert alone["check"] == beside_torch["check"] and len(alone["check"][0]) == 24
