"""Build the demo model repository: train both architectures on the generated corpus, export, verify.

Used by ``nmt serve --demo`` when the repository lacks them. The first model is built before the server
starts (about three minutes on 2 CPU cores); the others are built by a child process while it serves
(:class:`BackgroundBuild`) and served as soon as each is ready.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from common.model_format.layout import discover_versions, has_models

if TYPE_CHECKING:
    from server.frontend.app import TranslationServer

# served model name -> training preset, in the order they are built; the first is the demo's default model
# (the Bahdanau model: it reaches the demo's quality in about half the Transformer's training time)
DEMO_MODELS = {"demo-bahdanau": "dates-bahdanau", "demo-transformer": "dates-transformer"}
DEMO_DEFAULT_MODEL = next(iter(DEMO_MODELS))
# the demo versions' default length penalty: the same BLEU as 1.0 on the dates test split, and a glossary term the
# model has never seen (April -> Ostermond) stays where the source word is; at 1.0 the term's fixed cost, divided
# by the length, lets hypotheses that write the date twice around it outrank it (docs/decisions.md)
DEMO_LENGTH_PENALTY = 0.6
BUILD_LOG = "demo-build.log"  # in the runs directory: the background build's output
INTERRUPTED = {130, -2, -15}  # exit codes of a child stopped by SIGINT (nmt's own 130, or the signal) or SIGTERM

log = logging.getLogger("nmt.demo")


def missing_demo_models(repository: str | Path) -> list[str]:
    """The demo models ``repository`` lacks, or none when it holds models of other names (a repository of
    one's own is served as it is). A demo build cut short left only some of them: they are built then."""
    existing = set(discover_versions(repository)) if has_models(repository) else set()
    if existing - set(DEMO_MODELS):
        return []
    return [name for name in DEMO_MODELS if name not in existing]


def demo_default_model(repository: str | Path) -> str:
    """The default model ``--demo`` serves ``repository`` with: the first demo model where the repository holds
    it and no models of other names (so that it does not depend on which model a build left out), else ""."""
    existing = set(discover_versions(repository)) if has_models(repository) else set()
    return DEMO_DEFAULT_MODEL if DEMO_DEFAULT_MODEL in existing and existing <= set(DEMO_MODELS) else ""


def build_demo_models(
    repository: str | Path, runs: str | Path, names: list[str], *, progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Train and export the demo models ``names`` (from :func:`missing_demo_models`); returns the new version
    dirs. Needs the train extra (torch), imported here so that the serving install can ask what is missing."""
    from export.options import ExportOptions
    from export.pipeline import export_model, manifest_summary
    from training.config import TrainConfig
    from training.presets import PRESETS
    from training.train import train

    repository, runs = Path(repository), Path(runs)
    created = []
    for name in names:
        preset = DEMO_MODELS[name]
        log(f"building {name}: training preset {preset} (two to four minutes on 2 CPU cores)")
        run_dir = runs / name
        settings = dict(PRESETS[preset])
        train(TrainConfig(**settings, out=str(run_dir), force=True, progress=progress), log=log)
        result = export_model(
            ExportOptions(checkpoint=str(run_dir), name=name, model_repository=str(repository), progress=progress,
                          length_penalty=DEMO_LENGTH_PENALTY)
        )
        log(manifest_summary(result.manifest))
        created.append(result.version_dir)
    return created


def demo_build_command(repository: str | Path, runs: str | Path) -> list[str]:
    """The child process that builds the demo models a repository lacks (what the trainer container runs)."""
    return [sys.executable, "-m", "nmt", "serve", "--demo", "--demo-only", "--model-repository", str(repository),
            "--demo-runs", str(runs)]


class BackgroundBuild:
    """Models built by a child process (``command``, its output in ``log_path``) while the server serves:
    ``nmt serve --demo`` builds the demo models after the first this way. When the child is done the server
    scans its repository, so what it built is served at once whatever ``--reload-interval``; a server that
    stops first stops the child (a later ``--demo`` builds what it left out)."""

    def __init__(self, command: list[str], log_path: Path, names: list[str]) -> None:
        self.command, self.log_path, self.names = command, log_path, names

    async def run(self, server: TranslationServer) -> None:
        """Run the child, then have ``server`` load what it built; logs the outcome either way."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fields = {"models": self.names, "log": str(self.log_path)}
        log.info("building models in the background", extra={"fields": fields})
        with self.log_path.open("wb") as output:
            child = await asyncio.create_subprocess_exec(*self.command, stdout=output,
                                                         stderr=asyncio.subprocess.STDOUT)
            try:
                code = await child.wait()
            except asyncio.CancelledError:  # the server stopped first
                child.terminate()
                await child.wait()
                raise
        if code in INTERRUPTED:  # Ctrl-C reaches the child too: not a failure
            log.info("background build interrupted; a later --demo builds what it left out",
                     extra={"fields": {**fields, "exit_code": code}})
            return
        if code != 0:
            log.error("background build failed", extra={"fields": {**fields, "exit_code": code}})
            return
        await server.reload()
        log.info("background build done", extra={"fields": {**fields, "served": server.repository.names}})
