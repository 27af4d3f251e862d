"""``nmt`` command dispatcher.

Each subcommand lives in the package that owns it and exposes ``add_parser(subparsers)``; ``serve``
lives here in ``nmt`` because its ``--demo`` composes training and export, which ``server/`` never
imports. Those modules import heavy dependencies (torch, onnxruntime) only inside the command body, so
``nmt serve --help`` works on a serving-only install and ``nmt train`` errors clearly without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from common.errors import NmtError

# subcommand -> module that defines add_parser(subparsers); order is the order in --help.
SUBCOMMANDS: dict[str, str] = {
    "data": "training.data_cli",
    "train": "training.train_cli",
    "export": "export.export_cli",
    "serve": "nmt.serve_cli",
    "translate": "clients.translate_cli",
    "score": "clients.score_cli",
    "bench": "nmt.bench_cli",
    "loadtest": "loadtests.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt", description="Neural machine translation: train, export, serve.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except NmtError as error:
        print(f"nmt {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)
