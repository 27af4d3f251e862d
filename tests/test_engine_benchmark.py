"""The engine benchmark measures each runtime alone: a real run on a tiny random Marian model.

Its CTranslate2 and ONNX Runtime workers must never load torch (torch's OpenMP runtime in the same
process slowed CTranslate2 up to 8x); the PyTorch worker reporting torch proves the probe sees it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")


def test_each_runtime_alone_in_its_process() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "engine_throughput.py"), "--sizes", "TINY",
               "--precisions", "fp32", "--batches", "2", "--beams", "1", "2", "--repeats", "2", "--seconds", "0.1",
               "--pause", "0", "--anatomy", "--runtimes", "ctranslate2", "pytorch", "generate",
               "--baseline", str(ROOT)]  # this checkout as its own baseline
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "torch loaded in the workers: project no, ctranslate2 no, pytorch yes, generate yes, baseline no" in out
    assert "greedy outputs agree with the project's on ctranslate2 8/8, pytorch 8/8, generate 8/8, baseline 8/8" in out
    assert "Selected ISA" in out and "onnxruntime" in out and "CPU capability" in out  # backends beside the table
    assert out.count("host: ") == 2
    grid, heading, rest = out.partition("fixed cost per call and cost per decoding step")
    assert heading, "no --anatomy table"
    anatomy = rest.splitlines()
    rows = [line for line in grid.splitlines() if line.startswith("| TINY | fp32 | 2 |")]
    assert len(rows) == 2  # greedy and beam 2
    greedy = rows[0].split(" | ")
    assert greedy[5] != "-" and greedy[7] != "-" and greedy[6].endswith("x")  # CTranslate2, PyTorch, ratio
    assert greedy[9] != "-" and greedy[10].endswith("x")  # Hugging Face generate tok/s, project/generate
    assert greedy[11] != "-" and greedy[12].rstrip(" |").endswith("x")  # baseline tok/s, project/baseline
    assert "| project fixed ms | project us/step | CT2 fixed ms | CT2 us/step | baseline fixed ms" in anatomy[1]
    split = [line.split(" | ") for line in anatomy if line.startswith("| TINY | fp32 | 2 |")]
    assert len(split) == 2 and all(float(cells[5].replace(",", "")) > 0 for cells in split)  # project us/step
    assert split[0][10].endswith("x") and split[0][11].endswith("x")  # project/CT2 per step, fixed
    encoder, graphs, rest = (float(cell.rstrip(" |").replace(",", "")) for cell in split[0][12:15])
    assert encoder > 0 and graphs > 0 and rest > 0  # the project's call: encoder ms, step graphs and rest us/step
    assert anatomy[1].rstrip().endswith("| rest us/step | host us between steps |")
    gap = float(split[0][15].rstrip(" |").replace(",", ""))
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


def test_the_cache_reorder_benchmark_checks_both_attention_nodes_first() -> None:
    """``nmt bench cache-reorder``: DecoderMaskedMultiHeadAttention over a cache read through a random indirection
    table agrees with GroupQueryAttention over that cache's rows gathered (it exits otherwise), then both are
    timed beside the rows' copy, with the host named."""
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "nmt", "bench", "cache-reorder", "--sizes", "SMALL", "--batches", "1", "2",
               "--runs", "5", "--threads", "1"]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert " cores, " in result.stdout.splitlines()[0]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| SMALL |")]
    assert [row[1] for row in rows] == ["1", "2"] and [row[2] for row in rows] == ["4", "8"]
    assert all(float(row[-1].rstrip(" |")) <= 1e-4 and row[-2].endswith("x") for row in rows)


@pytest.mark.parametrize("device_state", [False, True])
def test_the_decode_cuts_benchmark_counts_the_cuts_and_splits_their_time(model_version_dir: Path,
                                                                         device_state: bool) -> None:
    """``nmt bench decode-cuts`` on the tiny Transformer: the steps of one batch, the ``step()`` calls they took
    (at least one, at most one a step), and the calls' time split into ONNX Runtime's runs and the host's."""
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "nmt", "bench", "decode-cuts", "--model-version", str(model_version_dir),
               "--sentences", "6", "--repeats", "1", "--threads", "1", *(["--device-state"] if device_state else [])]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert " cores, " in result.stdout.splitlines()[0]
    assert ("DeviceStepModel" in result.stdout.splitlines()[0]) == device_state
    row = next(line for line in result.stdout.splitlines() if line.startswith("| 1 |")).strip("| \n").split(" | ")
    steps, calls, in_step, in_runs, host_ms = int(row[1]), int(row[2]), float(row[3]), float(row[4]), float(row[5])
    assert 1 <= calls <= steps
    assert 0 < in_runs <= in_step and abs(in_step - in_runs - host_ms) <= 0.11


def test_the_decode_cuts_benchmark_holds_ended_rows_on_the_emulated_device(model_version_dir: Path) -> None:
    """``--hold-ended`` decodes the same steps in fewer ``step()`` calls than cutting the run at every sentence's
    end; ``--emulate-step-ms`` makes every step last at least that long."""
    root = Path(__file__).resolve().parent.parent
    rows = {}
    for hold in (False, True):
        command = [sys.executable, "-m", "nmt", "bench", "decode-cuts", "--model-version", str(model_version_dir),
                   "--sentences", "12", "--repeats", "1", "--threads", "1", "--emulate-step-ms", "2",
                   *(["--hold-ended"] if hold else [])]
        result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("ended rows held" in result.stdout) == hold and "emulated device" in result.stdout
        row = next(line for line in result.stdout.splitlines() if line.startswith("| 1 |")).strip("| \n").split(" | ")
        rows[hold] = int(row[1]), int(row[2]), float(row[4])  # steps, step() calls, ms in ONNX Runtime
    (steps, cut_calls, _), (held_steps, held_calls, held_runs_ms) = rows[False], rows[True]
    assert held_steps == steps and held_calls < cut_calls
    assert held_runs_ms >= 2 * steps


def test_the_encoder_shapes_benchmark_times_new_seen_and_bucketed_shapes() -> None:
    """``nmt bench encoder-shapes`` on the tiny Marian model: a row per way, each call timed, the padding of a
    bucket keeping every sentence's tokens and filling the other rows with EOS."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from encoder_shapes import bucket, padded

    assert bucket(3, 17) == (4, 32) and bucket(16, 16) == (16, 16) and bucket(1, 1) == (1, 16)
    src = np.arange(6, dtype=np.int64).reshape(2, 3) + 10
    out = padded(src, (4, 16), pad_id=9, eos_id=0)
    assert out.shape == (4, 16) and (out[:2, :3] == src).all() and (out[:2, 3:] == 9).all()
    assert (out[2:, 0] == 0).all() and (out[2:, 1:] == 9).all()

    command = [sys.executable, "-m", "nmt", "bench", "encoder-shapes", "--size", "TINY", "--shapes", "6",
               "--threads", "1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert " cores, " in lines[0] and "6 shapes" in lines[0]
    rows = {cells[0]: cells[1:] for cells in (line.strip("| ").split(" | ") for line in lines[3:])}
    assert list(rows) == ["new", "again", "bucket"]
    assert all(float(cells[0].replace(",", "")) > 0 and float(cells[1]) > 0 for cells in rows.values())
    assert rows["again"][2] == "1.00x"
