"""``nmt bench timeline``: a real server per configuration, stamped at each hand-off of a lone caller's request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_timeline_splits_a_request_into_its_hand_offs(tiny_models: dict[str, Path]) -> None:
    repository = Path(tiny_models["transformer"]).parent.parent
    command = [sys.executable, "-m", "nmt", "bench", "timeline", "--model-repository", str(repository),
               "--model", "tiny-transformer", "--requests", "40", "--warmup", "10", "--traffic-mb", "16"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("host: ") and " cores, " in line for line in lines)
    header = next(line for line in lines if line.startswith("| segment |"))
    assert header == "| segment | model | null engine | null engine + 16 MiB |"
    table = {cells[0]: [float(c.replace(",", "")) for c in cells[1:]]
             for cells in (line.strip("| ").split(" | ") for line in lines if line.startswith("| ") and line != header)}
    assert len(table) == 10  # eight segments, the total, the total less the engine
    assert all(value > 0 for values in table.values() for value in values)
    model, null, traffic = table["engine (worker thread)"]
    assert null < model and null < traffic  # the null engine answers at once; streaming 16 MiB takes a while
    assert all(total > engine for total, engine in zip(table["total"], table["engine (worker thread)"], strict=True))
    assert "grpc.aio echo servicer (answers at once), round trip: " in result.stdout
