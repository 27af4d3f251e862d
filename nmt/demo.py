"""Build the demo model repository: train both architectures on the generated corpus, export, verify.

Used by ``nmt serve --demo`` when the repository lacks them; minutes on 2 CPU cores.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nmt.model_format.layout import discover_versions, has_models

# served model name -> training preset
DEMO_MODELS = {"demo-transformer": "dates-transformer", "demo-bahdanau": "dates-bahdanau"}


def missing_demo_models(repository: str | Path) -> list[str]:
    """The demo models ``repository`` lacks, or none when it holds models of other names (a repository of
    one's own is served as it is). A demo build cut short left only some of them: they are built then."""
    existing = set(discover_versions(repository)) if has_models(repository) else set()
    if existing - set(DEMO_MODELS):
        return []
    return [name for name in DEMO_MODELS if name not in existing]


def build_demo_models(
    repository: str | Path, runs: str | Path, *, progress: bool = True, log: Callable[[str], None] = print
) -> list[Path]:
    """Train and export the demo models :func:`missing_demo_models` names; returns the new version dirs.
    Needs the train extra (torch), imported here so that the serving install can ask what is missing."""
    from export.options import ExportOptions
    from export.pipeline import export_model, manifest_summary
    from training.config import TrainConfig
    from training.presets import PRESETS
    from training.train import train

    repository, runs = Path(repository), Path(runs)
    created = []
    for name in missing_demo_models(repository):
        preset = DEMO_MODELS[name]
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
