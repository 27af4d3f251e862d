"""``nmt score``: score a given translation with a running ``nmt serve`` (the Score RPC): its per-token
log-probabilities, score and, with ``--attention``/``--plot``, its alignment, as Translate reports its own.

The connection, output and plot code is ``nmt translate``'s (:mod:`clients.translate_cli`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from clients.translate_cli import _penalty, add_connection_arguments, add_output_arguments, connect, print_translation

DESCRIPTION = """\
Score TARGET as the translation of SOURCE with a running translation server (nmt serve): the model's
log-probability of each target piece (end of sentence included) and the length-normalised score; with
--attention the target x source alignment grid and Pharaoh alignments, with --plot the heatmap. A
translator's own translation gets the same figures Translate gives the model's hypotheses.

examples:
  nmt score "Tuesday, April 25, 2045" "Dienstag, 25. April 2045" --attention
  nmt score --plot alignment.png "Tuesday, April 25, 2045" "Dienstag, der 25. April 2045"
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``score`` subcommand."""
    parser = subparsers.add_parser("score", help="score a given translation with a running server (the client)",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="SOURCE", help="the source text")
    parser.add_argument("target", metavar="TARGET", help="its translation, to score")
    add_connection_arguments(parser)
    model = parser.add_argument_group("model (0: the model's default)")
    model.add_argument("--model", default="", help="model name (default: the server's default model)")
    model.add_argument("--version", "--model-version", dest="model_version", default="", metavar="VERSION",
                       help="model version (default: the newest)")
    model.add_argument("--length-penalty", type=_penalty, default=0.0, metavar="ALPHA",
                       help="score = log-probability / length^ALPHA")
    model.add_argument("--target-language", default="", metavar="LANG", help="a multilingual model's output language")
    add_output_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    with connect(args) as client:
        [translation] = client.score([args.source], [args.target], model=args.model, version=args.model_version,
                                     attention=args.attention or bool(args.plot), length_penalty=args.length_penalty,
                                     target_language=args.target_language)
    print_translation(args, args.source, translation, 1, numbered=False, verbose=True, stdout=stdout, stderr=stderr)
    return 0
