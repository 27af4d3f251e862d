"""The emulated device of ``nmt bench batching --emulate-device`` (``benchmarks/emulated_device``): a process
started with its folder on ``PYTHONPATH`` and a step floor runs every ONNX Runtime step at least that long,
and its encoder calls at least theirs; without the floor nothing changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMULATION = ROOT / "benchmarks" / "emulated_device"

# one Identity node, run 5 times plainly and 5 times through an I/O binding; prints the fastest of each, in ms
PROBE = """
import json, time
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
x = np.zeros(2, dtype=np.float32)
binding = session.io_binding()
binding.bind_cpu_input("x", x)
binding.bind_output("y")
def fastest(run):
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return min(times)
print(json.dumps({"plain": fastest(lambda: session.run(None, {"x": x})),
                  "bound": fastest(lambda: session.run_with_iobinding(binding))}))
"""


def probe(**env: str) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(EMULATION), **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_emulated_device_floors_steps_and_encoder_calls() -> None:
    floored = probe(NMT_EMULATED_STEP_MS="30", NMT_EMULATED_ENCODER_MS="15")
    assert floored["bound"] >= 30 and floored["plain"] >= 15, floored
    assert floored["plain"] < 30, floored  # each kind of run has its own floor
    plain = probe()  # the folder on the path, no floor set: runs as they are
    assert plain["bound"] < 15 and plain["plain"] < 15, plain
