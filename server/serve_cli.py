"""``nmt serve``: the gRPC translation server.

Only :mod:`server.config` (standard library) is imported to build the parser, so ``nmt serve --help``
is fast; grpc, onnxruntime and the models load when the command runs.
"""

from __future__ import annotations

import argparse

from server.config import ServerConfig

DESCRIPTION = """\
Serve every model version of a model repository (<repo>/<name>/<version>/manifest.json) over gRPC:
translation.v1.Translator, grpc.health.v1.Health (overall "", per model name and per service) and
server reflection; Prometheus metrics at http://METRICS_LISTEN/metrics. A request names a model
(default: --default-model, else the first by name) and optionally a version (default: the newest).

Every flag can also be set by the environment variable shown in its help (flags win). Logs are JSON
lines on stderr. SIGTERM or SIGINT: health turns NOT_SERVING, new requests get UNAVAILABLE and
in-flight ones finish within --grace-seconds.

example:
  nmt serve --model-repository models --listen 0.0.0.0:50051 --metrics-listen 0.0.0.0:9400
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        help="serve models over gRPC",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ServerConfig.add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import asyncio

    from server.app import configure_logging, serve

    config = ServerConfig.from_args(args)
    configure_logging(config.log_level)
    asyncio.run(serve(config))
    return 0
