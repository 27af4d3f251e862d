"""Stored glossaries: one file per glossary in the ``--glossary-dir`` directory, shared by every serving process.

A glossary ``acme`` for English to German is ``acme.en.de.tsv`` (or ``.csv``), in the format of
:mod:`common.glossary_file`; a first line ``# name: <text>`` gives it a display name (the API writes one when
asked to; DeepL's glossaries have names).
The API writes ``.tsv`` files atomically (a hidden temporary file in the same directory, then a hard link
that fails when the name is taken, so a reader never sees half a file); operators may drop, edit or delete
files there too. Every lookup checks the file's modification time and size, so an edited file is read again
on its next use, in every process, without a restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.glossary_file import read_entries, write_entries
from server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from server.frontend.glossary import Entry, Glossary, check_entries

log = logging.getLogger("nmt.server")

MAX_ENTRIES = 10_000  # entries in one stored glossary
MAX_FILE_BYTES = 4 * 1024 * 1024  # one glossary's file
MAX_GLOSSARIES = 1_000  # in the directory
GLOSSARY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
LANGUAGE = re.compile(r"[A-Za-z]{2,3}(?:-[A-Za-z0-9]{1,8})*")
SUFFIXES = (".tsv", ".csv")
NAME_LINE = "# name: "  # a glossary file's first line, when it has a display name
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class StoredGlossary:
    glossary_id: str
    source_language: str
    target_language: str
    glossary: Glossary
    name: str  # its display name (its id where the file names none)
    written_ns: int  # the file's modification time (ns since the epoch)

    @property
    def entries(self) -> list[Entry]:
        return self.glossary.entries


def parse_name(name: str) -> tuple[str, str, str] | None:
    """``acme.en.de.tsv`` -> ``("acme", "en", "de")``; None for a name that is not a glossary's."""
    stem, suffix = os.path.splitext(name)
    parts = stem.split(".")
    if suffix not in SUFFIXES or len(parts) != 3:
        return None
    glossary_id, source, target = parts
    if not (GLOSSARY_ID.fullmatch(glossary_id) and LANGUAGE.fullmatch(source) and LANGUAGE.fullmatch(target)):
        return None
    return glossary_id, source, target


def parse_entries(text: str, comma: bool, where: str) -> list[Entry]:
    """A glossary file's entries (:mod:`common.glossary_file`), checked; InvalidArgument names the line."""
    try:
        entries = [Entry(*row) for row in read_entries(text, comma, where)]
    except ValueError as error:
        raise InvalidArgument(str(error)) from error
    if len(entries) > MAX_ENTRIES:
        raise InvalidArgument(f"{where} has {len(entries)} entries, the limit is {MAX_ENTRIES}")
    return check_entries(entries, where)


class GlossaryStore:
    """The glossaries of one directory (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._read: dict[str, tuple[tuple[int, int], StoredGlossary]] = {}  # file name -> (mtime, size), glossary

    def _files(self) -> dict[str, tuple[str, str, str]]:
        """Glossary id -> (file name, source, target) of the directory's glossary files."""
        found: dict[str, tuple[str, str, str]] = {}
        with os.scandir(self.directory) as listing:
            for item in listing:
                parsed = parse_name(item.name)
                if parsed is not None and item.is_file():
                    if parsed[0] in found:
                        log.warning("two files hold glossary %s: %s is used, %s ignored", parsed[0],
                                    found[parsed[0]][0], item.name)
                        continue
                    found[parsed[0]] = (item.name, parsed[1], parsed[2])
        return found

    def _load(self, name: str, source: str, target: str) -> StoredGlossary:
        path = self.directory / name
        try:
            stat = path.stat()
            key = (stat.st_mtime_ns, stat.st_size)
            cached = self._read.get(name)
            if cached is not None and cached[0] == key:
                return cached[1]
            if stat.st_size > MAX_FILE_BYTES:
                raise FailedPrecondition(f"glossary file {name} has {stat.st_size} bytes, the limit is "
                                         f"{MAX_FILE_BYTES}")
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError as error:  # deleted between the listing and now
            raise NotFound(f"glossary {name.split('.')[0]!r} was deleted") from error
        except (OSError, UnicodeDecodeError) as error:
            raise FailedPrecondition(f"cannot read glossary file {name}: {error}") from error
        try:
            entries = parse_entries(text, name.endswith(".csv"), name)
        except InvalidArgument as error:  # an operator's file: the request is fine, the store is not
            raise FailedPrecondition(str(error)) from error
        glossary_id = name.split(".")[0]
        first = text.split("\n", 1)[0].rstrip("\r")
        display = first[len(NAME_LINE):].strip() if first.startswith(NAME_LINE) else ""
        stored = StoredGlossary(glossary_id, source, target, Glossary(entries), display or glossary_id,
                                stat.st_mtime_ns)
        self._read[name] = (key, stored)
        return stored

    def list(self) -> list[StoredGlossary]:
        """Every readable glossary, by id (one that cannot be read is logged and left out)."""
        listed = []
        for glossary_id, (name, source, target) in sorted(self._files().items()):
            try:
                listed.append(self._load(name, source, target))
            except (FailedPrecondition, NotFound) as error:
                log.warning("glossary %s left out: %s", glossary_id, error)
        return listed

    def get(self, glossary_id: str) -> StoredGlossary:
        """One glossary; NotFound for an unknown id, FailedPrecondition for a file that cannot be read."""
        found = self._files().get(glossary_id)
        if found is None:
            raise NotFound(f"no glossary {glossary_id!r} (ListGlossaries lists them)")
        return self._load(*found)

    def create(self, glossary_id: str, source: str, target: str, entries: list[Entry],
               display_name: str = "") -> StoredGlossary:
        """Write a new glossary (``display_name``, if any, on its first line); AlreadyExists for an id in use,
        ResourceExhausted past :data:`MAX_GLOSSARIES`."""
        if not GLOSSARY_ID.fullmatch(glossary_id):
            raise InvalidArgument(f"glossary_id {glossary_id!r}: 1-64 of A-Z a-z 0-9 _ -, starting with a letter or "
                                  "digit")
        for field, code in (("source_language", source), ("target_language", target)):
            if not LANGUAGE.fullmatch(code):
                raise InvalidArgument(f"{field} {code!r} is not a language code (e.g. en, de, pt-BR)")
        if len(display_name) > MAX_NAME_CHARS or any(c in display_name for c in "\r\n"):
            raise InvalidArgument(f"a glossary's name is one line of at most {MAX_NAME_CHARS} characters")
        if not entries:
            raise InvalidArgument("a glossary needs at least one entry")
        if len(entries) > MAX_ENTRIES:
            raise InvalidArgument(f"{len(entries)} entries, the limit is {MAX_ENTRIES}")
        entries = check_entries(entries, "entries")
        files = self._files()
        if glossary_id in files:
            raise AlreadyExists(f"glossary {glossary_id!r} exists; delete it first to replace it")
        if len(files) >= MAX_GLOSSARIES:
            raise ResourceExhausted(f"the store holds {len(files)} glossaries, the limit is {MAX_GLOSSARIES}")
        header = f"{NAME_LINE}{display_name.strip()}\n" if display_name.strip() else ""
        data = (header + write_entries([(e.source, e.target, e.case_insensitive) for e in entries])).encode("utf-8")
        if len(data) > MAX_FILE_BYTES:
            raise InvalidArgument(f"the glossary takes {len(data)} bytes, the limit is {MAX_FILE_BYTES}")
        name = f"{glossary_id}.{source}.{target}.tsv"
        handle, temporary = tempfile.mkstemp(prefix=f".{glossary_id}.", dir=self.directory)
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(temporary, self.directory / name)  # fails if another process created it meanwhile
            except FileExistsError as error:
                raise AlreadyExists(f"glossary {glossary_id!r} exists; delete it first to replace it") from error
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        return self._load(name, source, target)

    def delete(self, glossary_id: str) -> None:
        found = self._files().get(glossary_id)
        if found is None:
            raise NotFound(f"no glossary {glossary_id!r}")
        with contextlib.suppress(FileNotFoundError):
            (self.directory / found[0]).unlink()
        self._read.pop(found[0], None)
