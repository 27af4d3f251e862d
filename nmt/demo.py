"""Build the demo model repository: train both architectures on the generated corpus, export, verify.

Used by ``nmt serve --demo`` when the repository is empty; minutes on 2 CPU cores.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from export.options import ExportOptions
from export.pipeline import export_model, manifest_summary
from nmt.model_format.layout import discover_versions
from training.config import TrainConfig
from training.presets import PRESETS
from training.train import train

# served model name -> training preset
DEMO_MODELS = {"demo-transformer": "dates-transformer", "demo-bahdanau": "dates-bahdanau"}


def build_demo_models(
    repository: str | Path, runs: str | Path, *, progress: bool = True, log: Callable[[str], None] = print
) -> list[Path]:
    """Train and export every demo model missing from ``repository``; returns the new version dirs."""
    repository, runs = Path(repository), Path(runs)
    existing = discover_versions(repository) if repository.is_dir() else {}
    created = []
    for name, preset in DEMO_MODELS.items():
        if name in existing:
            continue
        log(f"building {name}: training preset {preset} (a few minutes on 2 CPU cores)")
        run_dir = runs / name
        settings = dict(PRESETS[preset])
        train(TrainConfig(**settings, out=str(run_dir), force=True, progress=progress), log=log)
        result = export_model(
            ExportOptions(checkpoint=str(run_dir), name=name, model_repository=str(repository), progress=progress)
        )
        log(manifest_summary(result.manifest))
        created.append(result.version_dir)
    return created
