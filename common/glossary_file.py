"""The glossary file format, read by the server's glossary store and by ``nmt translate --glossary``.

UTF-8, one entry per line: the source term, a tab and the target term, optionally a tab and ``ci`` (the
source term matches in any case); blank lines and lines starting with ``#`` are skipped. A ``.csv`` file
has commas instead of tabs, with RFC 4180 quoting.
"""

from __future__ import annotations

import csv
import io

CASE_INSENSITIVE = "ci"


def read_entries(text: str, comma: bool, where: str) -> list[tuple[str, str, bool]]:
    """``(source, target, case_insensitive)`` of each entry; ValueError names the line that is not one."""
    entries = []
    rows = csv.reader(io.StringIO(text), **({} if comma else {"delimiter": "\t", "quoting": csv.QUOTE_NONE}))
    try:
        for row in rows:
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            if len(row) not in (2, 3) or (len(row) == 3 and row[2].strip() not in ("", CASE_INSENSITIVE)):
                raise ValueError(f"{where} line {rows.line_num}: expected source, target and optionally "
                                 f"{CASE_INSENSITIVE!r}, separated by {'commas' if comma else 'tabs'}")
            entries.append((row[0], row[1], len(row) == 3 and row[2].strip() == CASE_INSENSITIVE))
    except csv.Error as error:
        raise ValueError(f"{where} line {rows.line_num}: {error}") from error
    return entries


def write_entries(entries: list[tuple[str, str, bool]]) -> str:
    """The ``.tsv`` text of ``entries`` (terms hold no tab or line break)."""
    return "".join(f"{source}\t{target}{chr(9) + CASE_INSENSITIVE if ci else ''}\n" for source, target, ci in entries)
