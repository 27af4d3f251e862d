"""Device memory of one loaded model version on CUDA: the weights made once on the device and shared by
every session (the default) against host weights that each session copies to the device for itself.

    python benchmarks/device_memory.py                   # SMALL fp32, 2 rounds
    python benchmarks/device_memory.py --size BASE --precision fp16

A random-weight Marian model of ``--size`` is exported as in ``engine_throughput.py``. Each configuration
then runs in a process of its own (the CUDA context, ONNX Runtime's arenas and the CUDA libraries'
workspaces make up most of a process's device memory, so only processes apart compare), and reports its
device memory from ``nvidia-smi`` after loading the version and after one beam-4 batch of 8 sentences:

* ``context``: a CUDA context and one value, no model (the floor);
* ``host``: the version with host weights (each CUDA session copies every weight it reads);
* ``device``: the version as ``Engine.load`` opens it (:class:`server.engine.shared_weights.SharedWeights`
  on the device).

The configurations alternate for ``--rounds`` rounds. Needs a GPU and ``nvidia-smi``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules

MODES = ("context", "host", "device")


def device_mib() -> int:
    """Device memory this process holds (nvidia-smi), in MiB."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(used) for pid, used in (line.split(", ") for line in out.splitlines()) if int(pid) == os.getpid())


def measure(mode: str, version: str) -> dict:
    """One configuration, in this (child) process."""
    import numpy as np
    import onnxruntime as ort

    import server.engine.engine as engine_module
    from server.types import DecodingOptions, SentenceRequest

    if mode == "context":
        ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32), "cuda", 0)
        return {"loaded": device_mib()}
    if mode == "host":
        shared = engine_module.SharedWeights

        class HostWeights(shared):
            def __init__(self, version_dir: Path, device: str = "cpu", device_id: int = 0) -> None:
                super().__init__(version_dir)

        engine_module.SharedWeights = HostWeights
    engine = engine_module.Engine.load(version, provider="cuda")
    loaded = device_mib()
    rng = np.random.default_rng(0)
    vocab = engine.manifest.vocab_size
    engine.translate_batch([SentenceRequest(rng.integers(2, vocab - 1, 20).tolist(),
                                            DecodingOptions(beam_size=4, max_length=24)) for _ in range(8)])
    return {"loaded": loaded, "translated": device_mib(), "weights_on": engine.model.weights.device}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["SMALL", "BASE"], default="SMALL")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "VERSION"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    if shutil.which("nvidia-smi") is None:
        raise SystemExit("device_memory.py needs an NVIDIA GPU and nvidia-smi (it reads each process's device memory)")
    from engine_throughput import export_project, marian_model

    with tempfile.TemporaryDirectory() as work:
        version, _ = export_project(marian_model(args.size), Path(work), None, args.precision)
        weights = (version / "weights.bin").stat().st_size / 2**20
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                result = subprocess.run([sys.executable, __file__, "--child", mode, str(version)],
                                        capture_output=True, text=True)
                if result.returncode != 0:
                    raise SystemExit(f"{mode} failed:\n{result.stderr[-3000:]}")
                runs[mode].append(json.loads(result.stdout.strip().splitlines()[-1]))
    print(f"{args.size} {args.precision} version: weights.bin {weights:.1f} MiB; medians of {args.rounds} rounds")
    print("| process | device MiB after load | after a beam-4 batch of 8 | weights on |")
    print("|---|---|---|---|")
    for mode, values in runs.items():
        loaded = statistics.median(v["loaded"] for v in values)
        translated = statistics.median(v["translated"] for v in values) if mode != "context" else None
        print(f"| {mode} | {loaded:,.0f} | {'-' if translated is None else f'{translated:,.0f}'} | "
              f"{values[0].get('weights_on', '-')} |")
    saved = (statistics.median(v["loaded"] for v in runs["host"])
             - statistics.median(v["loaded"] for v in runs["device"]))
    print(f"device weights save {saved:,.0f} MiB against host weights ({weights:.1f} MiB of weights)")


if __name__ == "__main__":
    main()
