"""Bearer-token authentication: a tokens file, and the check of a call's ``authorization`` metadata.

The tokens file (``--auth-tokens-file``, ``NMT_AUTH_TOKENS_FILE``) holds one token per line, optionally
followed by the model names that token may use (none: every model) and by permissions, fields starting with
``+`` (:data:`PERMISSIONS`: ``+glossaries`` may create and delete stored glossaries); blank lines are ignored
and a field starting with ``#`` begins a comment::

    # operators: every model, and the glossaries
    0c8f5b1e2d7a4c9b8e6f3a2d1c0b9a87  +glossaries
    # the partner's token: only these two models
    Zx9-partner_token.v2  demo-transformer demo-bahdanau   # a comment may follow

A token is at least 16 characters of ``A-Z a-z 0-9 - . _ ~ + /`` (optionally ending in ``=``), the
``b64token`` of RFC 6750, so it travels unchanged in a header.

A client sends ``authorization: Bearer <token>``. The interceptor (:mod:`server.frontend.interceptor`) calls
:meth:`Authenticator.authenticate` before the handler of every service but ``grpc.health.v1.Health``
(:data:`OPEN_SERVICES`: load balancers and orchestrators probe without credentials); a missing or
unknown token is :class:`~server.errors.Unauthenticated`. The :class:`Grant` it returns rides on the
call's record, and the servicer checks the model a request uses against it
(:class:`~server.errors.PermissionDenied`) and lists only the models it allows.

Tokens are kept only as SHA-256 digests and compared with :func:`hmac.compare_digest` against every
entry (no early exit, equal lengths), so the time taken says nothing about how close a guess was. No
token ever appears in a log line or an error message: lines of the file are named by their number.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from common.errors import NmtError
from server.errors import PermissionDenied, Unauthenticated

AUTHORIZATION_KEY = "authorization"
SCHEME = "bearer"
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})  # never asks for a token
MIN_TOKEN_CHARS = 16
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


WRITE_GLOSSARIES = "+glossaries"
PERMISSIONS = frozenset({WRITE_GLOSSARIES})


@dataclass(frozen=True)
class Grant:
    """What an authenticated call may use: ``models`` (``None``: every model), and whether it may write stored
    glossaries."""

    models: frozenset[str] | None = None
    write_glossaries: bool = True

    def check_glossary_write(self) -> None:
        if not self.write_glossaries:
            raise PermissionDenied(f"this token may not create or delete glossaries (give it {WRITE_GLOSSARIES} in "
                                   "the tokens file)")

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def check(self, model: str) -> None:
        """Raise :class:`PermissionDenied` unless the call may use ``model``."""
        if not self.allows(model):
            raise PermissionDenied(f"this token may not use model {model!r}")


ANYONE = Grant()  # the grant of every call when authentication is off


class Authenticator:
    """The tokens of a tokens file, as digests, each with its :class:`Grant`."""

    def __init__(self, entries: Iterable[tuple[str, Grant]]) -> None:
        self._entries = [(_digest(token), grant) for token, grant in entries]
        if not self._entries:
            raise NmtError("the tokens file holds no token: every call would be refused")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def model_names(self) -> set[str]:
        """Every model name some token is restricted to."""
        return {name for _, grant in self._entries if grant.models for name in grant.models}

    @classmethod
    def from_file(cls, path: str | Path) -> Authenticator:
        """Read a tokens file (format in the module docstring); :class:`NmtError` names the line, never the token."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise NmtError(f"cannot read the tokens file {path}: {getattr(error, 'strerror', None) or error}") \
                from error
        entries: list[tuple[str, Grant]] = []
        seen: set[bytes] = set()
        for number, line in enumerate(text.splitlines(), start=1):
            fields = []
            for field in line.split():
                if field.startswith("#"):
                    break
                fields.append(field)
            if not fields:
                continue
            token, models = fields[0], [f for f in fields[1:] if not f.startswith("+")]
            permissions = {f for f in fields[1:] if f.startswith("+")}
            if permissions - PERMISSIONS:
                raise NmtError(f"{path} line {number}: unknown permission {sorted(permissions - PERMISSIONS)[0]} "
                               f"(known: {', '.join(sorted(PERMISSIONS))})")
            if len(token) < MIN_TOKEN_CHARS or not _TOKEN.fullmatch(token):
                raise NmtError(f"{path} line {number}: a token must be at least {MIN_TOKEN_CHARS} characters of "
                               "A-Z a-z 0-9 - . _ ~ + / (optionally ending in =)")
            if _digest(token) in seen:
                raise NmtError(f"{path} line {number}: this token is already on an earlier line")
            seen.add(_digest(token))
            entries.append((token, Grant(frozenset(models) if models else None,
                                         write_glossaries=WRITE_GLOSSARIES in permissions)))
        return cls(entries)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Grant:
        """The grant of the call's bearer token; :class:`Unauthenticated` when it is missing or unknown."""
        presented = bearer_token(metadata)
        if presented is None:
            raise Unauthenticated("missing bearer token: send the metadata 'authorization: Bearer <token>'")
        digest = _digest(presented)
        found = None
        for known, grant in self._entries:  # every entry, no early exit
            if hmac.compare_digest(digest, known):
                found = grant
        if found is None:
            raise Unauthenticated("invalid bearer token")
        return found


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the ``authorization: Bearer <token>`` metadata (scheme case-insensitive), else None."""
    for key, value in metadata or ():
        if key != AUTHORIZATION_KEY:
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == SCHEME and token.strip():
            return token.strip()
    return None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()
