"""The emulated device of ``nmt bench batching --emulate-device`` (``benchmarks/emulated_device``): a process
started with its folder on ``PYTHONPATH`` and the floors set runs every decoder graph (a session taking
``input_ids``) at least the step floor, with an I/O binding or without, every encoder graph (``src_ids``) at
least the encoder floor, and other graphs as they are; without the floors nothing changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMULATION = ROOT / "benchmarks" / "emulated_device"

# one Identity graph per input name, each run 5 times; prints the fastest run of each, in ms
PROBE = """
import json, time
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
def session(name):
    graph = helper.make_graph([helper.make_node("Identity", [name], ["y"])], "g",
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
def fastest(run):
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return min(times)
x = np.zeros(2, dtype=np.float32)
step = session("input_ids")
binding = step.io_binding()
binding.bind_cpu_input("input_ids", x)
binding.bind_output("y")
encoder, other = session("src_ids"), session("x")
print(json.dumps({"step": fastest(lambda: step.run(None, {"input_ids": x})),
                  "bound step": fastest(lambda: step.run_with_iobinding(binding)),
                  "encoder": fastest(lambda: encoder.run(None, {"src_ids": x})),
                  "other": fastest(lambda: other.run(None, {"x": x}))}))
"""


def probe(**env: str) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(EMULATION), **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_emulated_device_floors_the_decoder_and_encoder_runs() -> None:
    floored = probe(NMT_EMULATED_STEP_MS="30", NMT_EMULATED_ENCODER_MS="15")
    assert floored["step"] >= 30 and floored["bound step"] >= 30 and floored["encoder"] >= 15, floored
    assert floored["encoder"] < 30 and floored["other"] < 15, floored  # each graph its own floor, others none
    plain = probe()  # the folder on the path, no floor set: runs as they are
    assert max(plain.values()) < 15, plain
