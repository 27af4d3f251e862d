"""Alignment rendering: a terminal grid and heatmap files (PNG/SVG/PDF with matplotlib, HTML without).

Both take an :class:`clients.messages.Attention` (or anything with ``source_words``, ``target_words``,
``weights`` [target][source] and ``alignments`` as ``(source_index, target_index)`` pairs). Target
words are the rows, source words the columns, as in the weights matrix.

::

    print(alignment_grid(hypothesis.attention))
    save_heatmap(hypothesis.attention, "alignment.png")   # or .svg, .pdf, .html
"""

from __future__ import annotations

import html
import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import NmtError

if TYPE_CHECKING:
    from clients.messages import Attention

UNICODE_SHADES = " ░▒▓█"
ASCII_SHADES = " .:+#"
THRESHOLDS = (0.05, 0.25, 0.5, 0.75)  # a weight below THRESHOLDS[i] gets shade i; 0.75 and above the darkest
MAX_COLUMN_WIDTH = 12  # longer source words are cut in the grid's header
MATPLOTLIB_FORMATS = (".png", ".svg", ".pdf")
FORMATS = (*MATPLOTLIB_FORMATS, ".html")


# ---- terminal grid --------------------------------------------------------------------------------------------


def _width(text: str) -> int:
    """Terminal columns of ``text`` (East Asian wide characters take two, combining marks none)."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _fit(text: str, width: int, ellipsis: str = "…") -> str:
    """``text`` cut to ``width`` columns (ending in ``ellipsis``) and padded to exactly ``width``."""
    if _width(text) > width:
        while text and _width(text) > width - _width(ellipsis):
            text = text[:-1]
        text += ellipsis
    return text + " " * (width - _width(text))


def shade(weight: float, shades: str = UNICODE_SHADES) -> str:
    """The shade character of an attention weight in [0, 1]."""
    for level, threshold in enumerate(THRESHOLDS):
        if weight < threshold:
            return shades[level]
    return shades[len(THRESHOLDS)]


def _check(attention: Any) -> tuple[list[str], list[str], list[list[float]], set[tuple[int, int]]]:
    sources, targets = list(attention.source_words), list(attention.target_words)
    weights = [list(map(float, row)) for row in attention.weights]
    if len(weights) != len(targets) or any(len(row) != len(sources) for row in weights):
        raise NmtError(f"attention weights are not {len(targets)} x {len(sources)} (target words x source words)")
    return sources, targets, weights, {(int(s), int(t)) for s, t in attention.alignments}


def alignment_grid(attention: Attention, *, ascii_only: bool = False, legend: bool = True) -> str:
    """A terminal grid: one row per target word, one column per source word, each cell shaded by its
    weight (`` ░▒▓█``; ``ascii_only``: `` .:+#``); the hard alignment of each target word is bracketed.
    ``legend`` adds a last line explaining the shades.

    ::

               one  two
        zwei   ░░░ [███]
        eins  [███] ░░░
    """
    shades, ellipsis, at_least = (ASCII_SHADES, "~", ">=") if ascii_only else (UNICODE_SHADES, "…", "≥")
    sources, targets, weights, aligned = _check(attention)
    if not targets or not sources:
        return "(empty alignment)"
    label = max(_width(t) for t in targets)
    widths = [max(3, min(MAX_COLUMN_WIDTH, _width(s))) + 2 for s in sources]  # +2: room for the brackets
    header = "".join(" " + _fit(s, w - 2, ellipsis) + " " for s, w in zip(sources, widths, strict=True))
    lines = [" " * label + " " + header]
    for t, (target, row) in enumerate(zip(targets, weights, strict=True)):
        cells = []
        for s, (weight, w) in enumerate(zip(row, widths, strict=True)):
            fill = shade(weight, shades) * (w - 2)
            cells.append(f"[{fill}]" if (s, t) in aligned else f" {fill} ")
        lines.append(_fit(target, label, ellipsis) + " " + "".join(cells))
    if legend:
        key = "  ".join(f"{shades[i + 1]} {at_least}{threshold:g}" for i, threshold in enumerate(THRESHOLDS))
        lines.append(f"{' ' * label} weight: {key}  [ ] alignment")
    return "\n".join(line.rstrip() for line in lines)


# ---- heatmap files ------------------------------------------------------------------------------------------------


def save_heatmap(attention: Attention, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Write the attention heatmap to ``path``; the suffix picks the format: ``.png``, ``.svg``, ``.pdf``
    (matplotlib, from the ``train`` extra) or ``.html`` (a self-contained table, no dependency).

    Source words run along the x axis, target words down the y axis; hard alignments are outlined.
    Returns the path written.
    """
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in FORMATS:
        raise NmtError(f"cannot write a heatmap as {target.name!r}: use one of {', '.join(FORMATS)}")
    sources, targets, weights, aligned = _check(attention)
    title = title if title is not None else default_title(sources, targets)
    try:
        if suffix == ".html":
            target.write_text(heatmap_html(sources, targets, weights, aligned, title), encoding="utf-8")
        else:
            _save_matplotlib(sources, targets, weights, aligned, title, target)
    except OSError as error:
        raise NmtError(f"cannot write {target}: {error.strerror or error}") from error
    return target


def default_title(sources: Sequence[str], targets: Sequence[str], limit: int = 60) -> str:
    def cut(words: Sequence[str]) -> str:
        text = " ".join(words)
        return text if len(text) <= limit else text[: limit - 1] + "…"

    return f"{cut(sources)} → {cut(targets)}"


def _save_matplotlib(sources: list[str], targets: list[str], weights: list[list[float]],
                     aligned: set[tuple[int, int]], title: str, path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as error:
        raise NmtError(f"writing a {path.suffix} heatmap needs matplotlib: pip install 'nmt-serving[train]' "
                       "(or pip install matplotlib); an .html heatmap needs nothing") from error

    # no pyplot: no global backend state, no GUI, safe in threads
    width = min(30.0, 3.5 + 0.6 * max(1, len(sources)))
    height = min(30.0, 2.5 + 0.45 * max(1, len(targets)))
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(weights if targets and sources else [[0.0]], cmap="viridis", vmin=0.0, vmax=1.0,
                        aspect="auto", interpolation="nearest")
    axes.set_xticks(range(len(sources)), labels=sources, rotation=45, ha="right", rotation_mode="anchor")
    axes.set_yticks(range(len(targets)), labels=targets)
    axes.set_xlabel("source")
    axes.set_ylabel("target")
    for s, t in sorted(aligned):
        if 0 <= s < len(sources) and 0 <= t < len(targets):
            axes.add_patch(Rectangle((s - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    figure.colorbar(image, ax=axes, label="attention weight")
    axes.set_title(title)
    figure.savefig(path, format=path.suffix.lower().lstrip("."), dpi=150)


def _colour(weight: float) -> str:
    """Background colour of a weight: white (0) to dark blue (1)."""
    w = min(1.0, max(0.0, weight))
    start, end = (255, 255, 255), (8, 48, 107)
    return "#" + "".join(f"{round(a + (b - a) * w):02x}" for a, b in zip(start, end, strict=True))


def heatmap_html(sources: Sequence[str], targets: Sequence[str], weights: Sequence[Sequence[float]],
                 aligned: set[tuple[int, int]], title: str) -> str:
    """A self-contained HTML page: a table whose cells are coloured by weight (hover shows the value)."""
    e = html.escape
    header = "".join(f'<th class="src"><span>{e(s)}</span></th>' for s in sources)
    rows = []
    for t, (target, row) in enumerate(zip(targets, weights, strict=True)):
        cells = []
        for s, weight in enumerate(row):
            ink = "#fff" if weight >= 0.5 else "#000"
            mark = " aligned" if (s, t) in aligned else ""
            cells.append(f'<td class="w{mark}" style="background:{_colour(weight)};color:{ink}" '
                         f'title="{e(target)} ← {e(sources[s])}: {weight:.3f}">{weight:.2f}</td>')
        rows.append(f'<tr><th class="tgt">{e(target)}</th>{"".join(cells)}</tr>')
    scale = "".join(f'<td style="background:{_colour(i / 10)}">{i / 10:.1f}</td>' for i in range(11))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{e(title)}</title>
<style>
  body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
  table {{ border-collapse: collapse; }}
  td.w {{ width: 3.2em; height: 2em; text-align: center; font-size: 0.8em; border: 1px solid #ddd; }}
  td.aligned {{ outline: 2px solid #d62728; outline-offset: -2px; font-weight: bold; }}
  th.tgt {{ text-align: right; padding-right: 0.5em; font-weight: normal; }}
  th.src {{ height: 7em; vertical-align: bottom; font-weight: normal; white-space: nowrap; }}
  th.src span {{ display: inline-block; transform: rotate(-45deg); transform-origin: left bottom;
                 translate: 1.6em 0; }}
  table.scale td {{ width: 2.5em; text-align: center; font-size: 0.7em; border: 1px solid #ddd; }}
  caption {{ font-weight: bold; padding-bottom: 0.5em; }}
</style>
</head>
<body>
<table class="heatmap">
<caption>{e(title)}</caption>
<tr><th></th>{header}</tr>
{chr(10).join(rows)}
</table>
<p>rows: target words · columns: source words · outlined: hard alignment</p>
<table class="scale"><tr>{scale}</tr></table>
</body>
</html>
"""
