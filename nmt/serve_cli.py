"""``nmt serve``: the gRPC translation server, and with ``--demo`` the demo models it serves.

It lives in ``nmt`` (the layer that composes the parts) rather than in ``server/``: building the demo
models needs training and export, and ``server/`` never imports those. Only :mod:`server.config`
(standard library) is imported to build the parser, so ``nmt serve --help`` is fast; grpc,
onnxruntime and the models load when the command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import NmtError
from common.model_format.layout import discover_versions
from server.config import ServerConfig

if TYPE_CHECKING:
    from server.frontend.app import TranslationServer

DESCRIPTION = """\
Serve every model version of a model repository (<repo>/<name>/<version>/manifest.json) over gRPC:
translation.v1.Translator, grpc.health.v1.Health (overall "", per model name and per service) and
server reflection; Prometheus metrics at http://METRICS_LISTEN/metrics; HTTP/JSON at HTTP_LISTEN (POST
/v1/translate, GET /v1/models, /healthz, /readyz; the routes are the proto's google.api.http annotations)
and the alignment explorer page at http://HTTP_LISTEN/. A request names a model
(default: --default-model, else the first by name) and optionally a version (default: the newest).

Security (all off by default): --tls-cert and --tls-key make the gRPC port TLS-only, --tls-client-ca
adds mutual TLS (client certificates signed by those CAs required), --auth-tokens-file requires
"authorization: Bearer <token>" metadata on every service but health (a token may be limited to some
models: UNAUTHENTICATED / PERMISSION_DENIED), --no-reflection turns reflection (v1 and v1alpha) off.

Every flag can also be set by the environment variable shown in its help (flags win). Logs are JSON
lines on stderr. SIGTERM or SIGINT: health turns NOT_SERVING, new requests get UNAVAILABLE and
in-flight ones finish within --grace-seconds.

Hot reload: every --reload-interval seconds and on SIGHUP the repository is scanned again. New versions
(and models) are verified (sha256 of every file, a smoke translation) and then served, the newest as the
latest; broken ones are refused with a "model version refused" log line while the others serve; removed
ones stop taking requests and close once their in-flight requests finish (within --grace-seconds).

With --demo, the demo models the repository lacks are built (demo-bahdanau and demo-transformer, trained
on the generated English->German dates corpus, exported and verified; needs the train extra), unless it
holds models of other names: the first before serving starts (about three minutes on 2 CPU cores), the
other by a background process while the first serves (its output in DEMO_RUNS/demo-build.log), served
as soon as it is ready. demo-bahdanau is the default model. A second run reuses them.

examples:
  nmt serve --demo
  nmt serve --model-repository models --listen 0.0.0.0:50051 --metrics-listen 0.0.0.0:9400
  nmt serve --tls-cert server.pem --tls-key server.key --tls-client-ca clients-ca.pem --auth-tokens-file tokens
"""

HOW_TO_CALL = """serving {models} on {listen} (metrics: {metrics}); try:
  nmt translate "Tuesday, April 25, 2045" --server {listen} --model {model} --beam-size 4 --num-hypotheses 3 --attention
  nmt translate --server {listen} --list-models{security}{http}
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
    parser.add_argument(
        "--demo", action="store_true",
        help="build the demo models the model repository lacks first, unless it holds models of other names "
             "(needs the train extra)",
    )
    parser.add_argument("--demo-runs", default="runs", help="where --demo keeps its training runs")
    parser.add_argument("--demo-only", action="store_true",
                        help="with --demo: build the demo models the repository lacks, then exit without "
                             "serving (a one-shot trainer container)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from server.logs import configure_logging

    started = time.monotonic()
    config = ServerConfig.from_args(args)
    if args.demo_only and not args.demo:
        raise NmtError("--demo-only goes with --demo")
    if not args.demo:
        configure_logging(config.log_level)
        asyncio.run(serve(config, on_started=print_how_to_call))
        return 0
    from nmt.demo import (
        BUILD_LOG,
        DEMO_MODELS,
        BackgroundBuild,
        demo_build_command,
        demo_default_model,
        missing_demo_models,
    )

    missing = missing_demo_models(config.model_repository)
    nothing_to_serve = len(missing) == len(DEMO_MODELS)  # else one is there to serve while the rest builds
    now = missing if args.demo_only else missing[:1] if nothing_to_serve else []
    later = missing[len(now):]
    build_demo(config.model_repository, args.demo_runs, now)
    if args.demo_only:
        print(f"demo models ready in {config.model_repository}: "
              f"{', '.join(discover_versions(config.model_repository))}", flush=True)
        return 0
    if not config.default_model:  # the same whichever demo model was built first
        config = dataclasses.replace(config, default_model=demo_default_model(config.model_repository))
    background = BackgroundBuild(demo_build_command(config.model_repository, args.demo_runs),
                                 Path(args.demo_runs) / BUILD_LOG, later) if later else None
    tasks: set[asyncio.Task] = set()

    def on_started(server: TranslationServer) -> None:
        print_how_to_call(server)
        print(f"ready to translate {time.monotonic() - started:.0f} s after start", flush=True)
        if background is not None:
            print(f"building {', '.join(later)} in the background (log: {background.log_path}); "
                  "served as soon as it is ready", flush=True)
            task = asyncio.get_running_loop().create_task(background.run(server), name="demo-build")
            tasks.add(task)  # a reference keeps it alive; asyncio.run cancels it (and its child) at exit

    configure_logging(config.log_level)
    asyncio.run(serve(config, on_started=on_started))
    return 0


async def serve(config: ServerConfig, on_started: Callable[[Any], None] | None = None) -> None:
    """Run until SIGTERM / SIGINT, then drain and stop; ``on_started`` is called once the ports are bound
    (``server.port`` etc. then hold the real ports, e.g. for ``--listen 127.0.0.1:0``). One process loads
    the models and serves them (:class:`server.frontend.app.TranslationServer` over
    :func:`server.core.process.open_repository`); with ``config.frontends`` the server runs as an engine
    core and front-end processes (:mod:`server.supervisor`)."""
    if config.frontends:
        from server.supervisor import supervise

        await supervise(config, on_started)
        return
    from server import collector
    from server.core.process import open_repository
    from server.frontend.app import TranslationServer as Server

    server = Server(config, opener=open_repository)
    server.install_signal_handlers()
    await server.start()
    pauses = collector.watch(server.repository, server.metrics.gc_pause)
    if on_started is not None:
        on_started(server)
    await server.wait_for_termination()
    pauses.cancel()


def print_how_to_call(server: TranslationServer) -> None:
    """Print the models served and commands to try, with the ports the server bound (``--listen
    127.0.0.1:0`` binds a free port)."""
    config = server.config
    models = server.repository.names
    if not models:
        return
    listen = _with_port(config.listen, server.port)
    metrics = f"http://{_with_port(config.metrics_listen, server.metrics_port)}/metrics" if config.metrics_listen \
        else "off"
    http = _with_port(config.http_listen, server.http_port) if config.http_listen else ""
    print(HOW_TO_CALL.format(models=", ".join(models), listen=listen, metrics=metrics,
                             model=server.repository.default_model, security=_security_hint(config),
                             http=_http_hint(http)), flush=True)


def _with_port(address: str, port: int | None) -> str:
    """``address`` ("host:port") with the port the server bound instead of the one asked for."""
    return address if port is None else f"{address.rpartition(':')[0]}:{port}"


def _http_hint(address: str) -> str:
    """The HTTP face's page and a curl call, when it is on (``address``: where it listens)."""
    if not address:
        return ""
    return (f"\n  alignment explorer: http://{address}/\n"
            f"  curl -s {address}/v1/translate -d '{{\"texts\": [\"Tuesday, April 25, 2045\"]}}'")


def _security_hint(config: ServerConfig) -> str:
    """What ``nmt translate`` needs besides --server: a CA, a client certificate, a token."""
    needs = (["--ca-cert CA.pem"] if config.tls_cert else []) + \
        (["--client-cert CLIENT.pem --client-key CLIENT.key"] if config.tls_client_ca else []) + \
        (["a token (NMT_TOKEN=... or --token)"] if config.auth_tokens_file else [])
    return f"\n  (add {', '.join(needs)})" if needs else ""


def build_demo(repository: str, runs: str, names: list[str]) -> None:
    """Train, export and verify the demo models ``names`` (those the repository lacks)."""
    from nmt.demo import build_demo_models

    if not names:
        return
    try:
        import torch  # noqa: F401 - the train extra
    except ImportError as error:
        raise NmtError(f"--demo trains models and needs the train extra ({error}); run: pip install -e '.[train]'") \
            from error
    build_demo_models(repository, runs, names)
