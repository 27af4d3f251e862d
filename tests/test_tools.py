"""The developer probes in ``tools/probes/`` (questions answered once, kept for rerunning on other hardware): each
still starts (its imports resolve, its options parse), and the encoder-shapes probe's padding keeps every token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBES = sorted((ROOT / "tools" / "probes").glob("*.py"))


def test_the_probes_are_found() -> None:
    assert len(PROBES) >= 5


@pytest.mark.parametrize("probe", PROBES, ids=lambda path: path.stem)
def test_a_probe_starts(probe: Path) -> None:
    result = subprocess.run([sys.executable, str(probe), "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: ")


def test_a_bucket_pads_each_sentence_and_fills_the_other_rows_with_eos() -> None:
    sys.path.insert(0, str(ROOT / "tools" / "probes"))
    try:
        from encoder_shapes import bucket, padded
    finally:
        sys.path.remove(str(ROOT / "tools" / "probes"))
    assert bucket(3, 17) == (4, 32) and bucket(16, 16) == (16, 16) and bucket(1, 1) == (1, 16)
    src = np.arange(6, dtype=np.int64).reshape(2, 3) + 10
    out = padded(src, (4, 16), pad_id=9, eos_id=0)
    assert out.shape == (4, 16) and (out[:2, :3] == src).all() and (out[:2, 3:] == 9).all()
    assert (out[2:, 0] == 0).all() and (out[2:, 1:] == 9).all()
