"""What the export's processes hand each other (:mod:`export.pipeline` and :mod:`export.stages`), importable
without torch, ONNX Runtime or transformers: the result, and how a stage process names the stage it starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.model_format.manifest import Manifest

STAGE_LINE = "nmt-export-stage:"  # a line of a stage process's stdout naming the stage it starts


@dataclass
class ExportResult:
    """The version an export wrote (under the export's scratch directory until it is moved into place)."""

    version_dir: Path
    manifest: Manifest  # with the parity figures (and the reduced precision's BLEU)
