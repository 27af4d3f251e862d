"""Command-line flags generated from config dataclasses: each field documents itself once.

A field declared with :func:`option` carries its help text (and optionally ``choices``, a ``flag``
name, ``positional``, a ``group`` title, an environment variable ``env``); :func:`add_arguments` turns
every such field into an ``argparse`` argument whose default and help come from the field, so the CLI
cannot drift from the dataclass (the habit of fairseq's ``dataclass/configs.py``). Fields declared
without :func:`option` (no help) are not flags.

Precedence where a field has an environment variable: flag > environment variable > field default.
Choices are case-insensitive everywhere and stored in their canonical spelling.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from common.errors import NmtError

BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def option(default: Any = dataclasses.MISSING, help: str = "", **metadata: Any) -> Any:  # noqa: A002
    """A dataclass field with its flag metadata: ``help`` and, optionally, ``choices``, ``flag`` (the flag's
    name when it is not ``--field-name``), ``aliases``, ``positional``, ``required`` (a flag that must be
    given even where the field has a default source elsewhere), ``group``, ``env`` (its environment
    variable), ``metavar``."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def field_type(f: dataclasses.Field) -> type:
    """The scalar type of a field annotated ``str``, ``int``, ``float``, ``bool`` or ``X | None``."""
    name = f.type if isinstance(f.type, str) else f.type.__name__
    return _TYPES[name.removesuffix(" | None")]


def canonical_choice(value: Any, choices: tuple[str, ...] | None) -> Any:
    """``"debug"`` -> ``"DEBUG"`` when that is a choice; anything else unchanged (validation reports it)."""
    if isinstance(value, str) and choices:
        for choice in choices:
            if value.strip().lower() == choice.lower():
                return choice
    return value


def canonicalize_choices(config: Any) -> None:
    """Store every choice field of a (frozen or not) dataclass instance in its canonical spelling."""
    for f in dataclasses.fields(config):
        if f.metadata.get("choices"):
            object.__setattr__(config, f.name, canonical_choice(getattr(config, f.name), f.metadata["choices"]))


def parse_value(kind: type, raw: str, where: str) -> Any:
    """Convert an environment variable's text to ``kind``; raise :class:`NmtError` naming ``where``."""
    try:
        if kind is bool:
            return BOOLEANS[raw.strip().lower()]
        return kind(raw)
    except (KeyError, ValueError) as error:
        raise NmtError(f"environment variable {where}={raw!r} is not a valid {kind.__name__}") from error


def env_name(f: dataclasses.Field, env_prefix: str | None) -> str | None:
    """The environment variable of a field: its ``env`` metadata, else ``env_prefix`` + its name upper-cased."""
    if "env" in f.metadata:
        return f.metadata["env"]
    return env_prefix + f.name.upper() if env_prefix else None


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags (declared with :func:`option`)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_arguments(
    cls: type,
    parser: argparse.ArgumentParser,
    *,
    env_prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
    only_given: bool = False,
) -> None:
    """One argument per :func:`option` field of ``cls``.

    ``env_prefix``: every field also reads ``env_prefix + NAME`` (fields may name their own ``env``).
    ``only_given``: flags that are not given leave no attribute on the namespace (for configs merged
    from several sources, such as a training preset); the help still shows the field's default.
    """
    environ = os.environ if environ is None else environ
    groups: dict[str, Any] = {}
    for f in cli_fields(cls):
        kind = field_type(f)
        choices = f.metadata.get("choices")
        default = None if f.default is dataclasses.MISSING else f.default
        env = env_name(f, env_prefix)
        if env and env in environ:
            default = parse_value(kind, environ[env], env) if kind is bool else canonical_choice(environ[env], choices)
        shown = f" [env {env}; default: {default!r}]" if env else (
            f" (default: {default!r})" if f.default is not dataclasses.MISSING and default is not None else "")
        target = parser
        if "group" in f.metadata:
            title = f.metadata["group"]
            target = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        kwargs: dict[str, Any] = {"help": f.metadata["help"] + shown}
        if f.metadata.get("positional"):
            target.add_argument(f.name, metavar=f.metadata.get("metavar", f.name.upper()), **kwargs)
            continue
        names = [f.metadata.get("flag") or "--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        kwargs["dest"] = f.name
        if f.metadata.get("required") or (f.default is dataclasses.MISSING and not only_given):
            kwargs["required"] = True
        kwargs["default"] = argparse.SUPPRESS if only_given else default
        if kind is bool:
            target.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if choices:
            kwargs.update(type=lambda value, choices=choices: canonical_choice(value, choices), choices=choices)
        else:
            kwargs.update(type=kind, metavar=f.metadata.get("metavar", f.name.upper()))
        target.add_argument(*names, **kwargs)


def values_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flag fields of ``cls`` present on ``args``."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}


def flags_table(cls: type, env_prefix: str | None = None) -> str:
    """The Markdown reference of the :func:`option` fields of ``cls``: flag, environment variable, default, help."""
    rows = ["| flag | environment | default | what |", "|---|---|---|---|"]
    for f in cli_fields(cls):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if field_type(f) is bool:
            flag = f"{flag}, --no-{flag[2:]}"
        env = env_name(f, env_prefix)
        default = "required" if f.default is dataclasses.MISSING else repr(f.default)
        help_text = f.metadata["help"] + (f" (one of: {', '.join(f.metadata['choices'])})"
                                          if f.metadata.get("choices") else "")
        cells = [f"`{flag}`", f"`{env}`" if env else "-", f"`{default}`", help_text.replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
