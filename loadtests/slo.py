"""SLO gates and the saturation point, read from the CSV files Locust writes (``--csv PREFIX``).

``PREFIX_stats.csv`` holds one row per scenario (and ``Aggregated``): request and failure counts and
latency percentiles in ms. ``PREFIX_stats_history.csv`` (``--csv-full-history``) holds one row per
second and name, with the user count and the percentiles of the last seconds.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

AGGREGATED = "Aggregated"


@dataclass(frozen=True)
class Slo:
    """Per-scenario objectives; a run that misses one fails."""

    max_failure_ratio: float = 0.0
    p95_ms: float = 1000.0
    p99_ms: float = 2000.0

    def with_override(self, text: str) -> tuple[str, Slo]:
        """``"SCENARIO:p95=MS,p99=MS,failures=RATIO"`` (any of the three) -> (scenario, its objectives)."""
        scenario, sep, settings = text.rpartition(":")
        fields = {"p95": "p95_ms", "p99": "p99_ms", "failures": "max_failure_ratio"}
        changes = {}
        for setting in settings.split(","):
            key, eq, value = setting.partition("=")
            if not (sep and scenario and eq and key.strip() in fields):
                raise ValueError(f"bad SLO override {text!r}: use 'SCENARIO:p95=MS,p99=MS,failures=RATIO'")
            changes[fields[key.strip()]] = float(value)
        return scenario.strip(), replace(self, **changes)


@dataclass(frozen=True)
class ScenarioStats:
    name: str
    requests: int
    failures: int
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def _number(value: str) -> float:
    return float(value) if value not in ("", "N/A") else 0.0


def read_stats(prefix: Path) -> list[ScenarioStats]:
    """The scenarios of ``PREFIX_stats.csv`` (the ``Aggregated`` row last)."""
    with open(f"{prefix}_stats.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    return [ScenarioStats(row["Name"], int(row["Request Count"]), int(row["Failure Count"]),
                          _number(row["Requests/s"]), _number(row["50%"]), _number(row["95%"]), _number(row["99%"]))
            for row in rows]


def violations(stats: list[ScenarioStats], default: Slo, overrides: Mapping[str, Slo] | None = None) -> list[str]:
    """Every objective a scenario missed (its own objectives from ``overrides``, else ``default``), in
    words; a scenario that sent nothing is one too."""
    found = []
    for s in stats:
        if s.name == AGGREGATED:
            continue
        slo = (overrides or {}).get(s.name, default)
        if s.requests == 0:
            found.append(f"{s.name}: no requests")
            continue
        if s.failure_ratio > slo.max_failure_ratio:
            found.append(f"{s.name}: failure ratio {s.failure_ratio:.3f} > {slo.max_failure_ratio}")
        if s.p95_ms > slo.p95_ms:
            found.append(f"{s.name}: p95 {s.p95_ms:.0f} ms > {slo.p95_ms:.0f} ms")
        if s.p99_ms > slo.p99_ms:
            found.append(f"{s.name}: p99 {s.p99_ms:.0f} ms > {slo.p99_ms:.0f} ms")
    return found


@dataclass(frozen=True)
class Step:
    users: int
    rps: float
    p95_ms: float
    failures_per_s: float


def ramp_steps(prefix: Path, min_seconds: int = 3) -> list[Step]:
    """Each user count a ramp held for at least ``min_seconds`` (the counts passed through while spawning
    are left out): median requests/s, failures/s and p95 over its seconds but the first."""
    with open(f"{prefix}_stats_history.csv", encoding="utf-8", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["Name"] == AGGREGATED]
    by_users: dict[int, list[dict]] = {}
    for row in rows:
        by_users.setdefault(int(row["User Count"]), []).append(row)
    steps = []
    for users, seconds in sorted(by_users.items()):
        if len(seconds) < min_seconds:
            continue
        settled = seconds[1:]
        steps.append(Step(users, statistics.median(_number(r["Requests/s"]) for r in settled),
                          statistics.median(_number(r["95%"]) for r in settled),
                          statistics.median(_number(r["Failures/s"]) for r in settled)))
    return [s for s in steps if s.users > 0]


def saturation(steps: list[Step], slo: Slo) -> tuple[Step | None, Step | None]:
    """(the busiest step within the SLO, the first step past it): where p95 leaves its SLO or failures start."""
    best = None
    for step in steps:
        if step.p95_ms > slo.p95_ms or step.failures_per_s > 0:
            return best, step
        if best is None or step.rps > best.rps:
            best = step
    return best, None


def summary_table(stats: list[ScenarioStats]) -> str:
    """The run's per-scenario figures as a Markdown table."""
    rows = ["| scenario | requests | failures | req/s | p50 ms | p95 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {s.name} | {s.requests} | {s.failures} | {s.rps:.1f} | {s.p50_ms:.0f} | {s.p95_ms:.0f} | "
             f"{s.p99_ms:.0f} |" for s in stats]
    return "\n".join(rows)
