"""Server configuration: one dataclass, each field with its help text, flag and environment variable.

Precedence: command-line flag > environment variable (``NMT_`` + the field name upper-cased, e.g.
``NMT_LISTEN``, ``NMT_BATCH_TOKENS``) > the default below. ``nmt serve --help`` prints every field.

The default listen address is loopback (``127.0.0.1:50051``) so that a development server is never
exposed by accident; containers set ``NMT_LISTEN=0.0.0.0:50051`` (and ``NMT_METRICS_LISTEN``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from common.errors import NmtError
from common.options import (
    add_arguments,
    canonicalize_choices,
    env_name,
    field_type,
    flags_table,
    option,
    parse_value,
    values_from_args,
)
from server.policy import AUTO_BY_DEVICE, BY_DEVICE, DEVICE_RULE_REASONS
from server.routing import parse_pair_models

ENV_PREFIX = "NMT_"
PROVIDERS = ("auto", "cpu", "cuda")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
BATCHING = ("auto", "static", "continuous")
# Which sessions' CPU kernels keep packed copies of their MatMul/Gemm weights (--ort-prepack): the encoder and the
# decoder every translation runs ("main"), every session ("all"), or none; each packed session holds a copy.
PREPACK = ("main", "all", "none")
ENGINES = ("onnx", "null")
COMPAT_APIS = ("libretranslate", "deepl")  # server/frontend/compat/


def compat_apis(setting: str) -> list[str]:
    """``--compat-apis``: the names, lower-cased."""
    return [name.strip().lower() for name in setting.split(",") if name.strip()]


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``nmt serve`` can be told; see each field's help."""

    # network
    listen: str = option("127.0.0.1:50051", "gRPC listen address host:port (port 0 picks a free port)")
    metrics_listen: str = option(
        "127.0.0.1:9400", "Prometheus /metrics HTTP address host:port; empty disables the metrics endpoint"
    )
    http_listen: str = option(
        "127.0.0.1:8080", "HTTP/JSON address host:port: POST /v1/translate, GET /v1/models, /healthz, /readyz and "
        "the alignment explorer page at /; empty disables the HTTP face"
    )
    cors_origins: str = option("", "origins (comma-separated, or *) whose browser pages may call the HTTP face "
                               "(CORS); empty: none but the server's own page")
    compat_apis: str = option("libretranslate,deepl", "the HTTP APIs of other translation services also served on "
                              "the HTTP face (comma-separated): libretranslate (POST /translate, /detect, "
                              "GET /languages), deepl (/v2/...); empty: only this service's own")
    max_connection_age: float = option(
        60.0, "seconds after which a client connection is closed gracefully (GOAWAY, with gRPC's jitter of a tenth): "
        "the client opens a new one for its next calls while the calls and streams on the old one run to their "
        "end, so new replicas, and a front-end restarted under --frontends N, get their share of long-lived "
        "clients. Costs each client a reconnection (and TLS handshake) per period; 0: never")
    # security
    tls_cert: str = option("", "PEM certificate chain of the gRPC port (leaf first); with --tls-key, the port "
                           "speaks TLS only (empty: plaintext)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_client_ca: str = option("", "PEM CA certificates for mutual TLS: every client must present a certificate "
                                "signed by one of them (needs --tls-cert)")
    auth_tokens_file: str = option("", "bearer tokens, one per line, each optionally followed by the model names "
                                   "it may use ('#' starts a comment); every service but health then requires "
                                   "'authorization: Bearer <token>' metadata (empty: no authentication)")
    reflection: bool = option(True, "serve gRPC server reflection (grpc.reflection.v1 and v1alpha)")
    # models
    model_repository: str = option("models", "model repository directory: <repo>/<name>/<version>/manifest.json")
    default_model: str = option("", "model used when a request names none (default: the first by name at "
                                "start-up)")
    pair_models: str = option("", "the model a request naming a language pair and no model gets, where several "
                              "serve the pair: comma-separated source:target=model (e.g. en:de=opus-mt-en-de); "
                              "default: the default model if it serves the pair, else the first by name")
    detect_default: str = option("", "source_language auto: the language taken for a text whose language cannot be "
                                 "told (too short, too uncertain); empty: such a request is INVALID_ARGUMENT")
    provider: str = option("auto", "ONNX Runtime execution provider: cuda fails at start-up unless the sessions "
                           "really run on CUDA (naming the library that did not load); auto uses CUDA when it "
                           "runs, else the CPU (and logs why)", choices=PROVIDERS)
    device_id: int = option(0, "CUDA device ordinal of every session")
    gpu_mem_limit: int = option(0, "bytes each CUDA session's memory arena may hold (0: unbounded); a batch that "
                                "needs more fails with RESOURCE_EXHAUSTED and the model stays healthy")
    cuda_tf32: bool = option(False, "let CUDA run fp32 MatMul in TF32 (faster on Ampere and later, ~1e-3 relative "
                             "error in the scores)")
    cuda_graphs: bool = option(False, "experimental: run beam search's selection on the device and capture the "
                               "device's beam and arg-max steps as CUDA graphs, replayed by length bucket (powers "
                               "of two and 1.5x them; one decoder session more); a bucket that cannot capture runs "
                               "ordinary steps and says so once. Off until a GPU run of the server shows it pays "
                               "(docs/gpu.md)")
    cuda_graph_pool_mib: int = option(1024, "MiB of device memory the runs kept for CUDA graphs may hold (the least "
                                      "recently used bucket goes first)")
    intra_op_threads: int = option(0, "ONNX Runtime intra-op threads per model version (0: runtime default)")
    inter_op_threads: int = option(1, "ONNX Runtime inter-op threads per model version")
    ort_spinning: bool = option(True, "let idle ONNX Runtime threads busy-wait for the next operator while a graph "
                                "runs (they stop when it returns); off where other processes need the cores")
    ort_prepack: str = option(
        "main", "which sessions' ONNX Runtime CPU kernels keep a re-laid-out copy of their MatMul/Gemm weights "
        "(faster steps; each decoder's copy is about the size of its weights). main: the encoder and the decoder "
        "every translation runs, while the decoders for attention (alignments, markup) and target prefixes "
        "read the stored weights; all: those too, for services whose requests mostly ask for alignments or "
        "prefixes; none: a loaded version holds each weight once, for hosts that keep many versions in memory",
        choices=PREPACK)
    malloc_retain_mb: int = option(1024, "MiB of freed memory glibc's malloc keeps for the next batch, arrays up to "
                                   "32 MiB served from its heap: large batches then reuse their arrays' pages "
                                   "instead of faulting in fresh ones (the process then keeps its peak "
                                   "memory up to this bound); 0 leaves malloc as it is")
    reload_interval: float = option(
        10.0, "seconds between scans of the model repository for new, changed and removed versions "
        "(hot reload; SIGHUP scans at once); 0 disables polling")
    # batching
    batching: str = option(
        "auto", "static: a batch is formed and decoded to its end while later sentences wait; continuous: "
        "one running decode per model version that sentences join between decoding steps and leave as soon as "
        "they finish (--max-batch-rows, --decode-tokens; a model that cannot decode rows at different steps "
        "falls back to static, with a log line); auto: by device (the device rules below)", choices=BATCHING)
    max_batch_rows: int = option(0, "continuous batching: most decoder rows in the running decode (a sentence "
                                 "holds beam_size rows); beyond what the device computes in parallel, more rows "
                                 "only slow every sentence down. 0: by device (the device rules below)")
    decode_tokens: int = option(0, "continuous batching: token budget of the running decode, rows x (widest "
                                "source + longest target so far), checked when sentences join (bounds its "
                                "memory). 0: by device (the device rules below)")
    batch_tokens: int = option(0, "token budget of a batch: source tokens including padding (longest x count); "
                               "continuous: of the sentences encoded together to join the running decode. 0: by "
                               "device (the device rules below)")
    max_batch_sentences: int = option(64, "most sentences in one batch")
    max_wait_ms: float = option(5.0, "longest a sentence waits for companions before its batch starts; continuous: "
                                "how long sentences gather before they join a running decode (one encoder call)")
    queue_size: int = option(1024, "most sentences queued per model version; beyond it RESOURCE_EXHAUSTED")
    batch_work: int = option(0, "most decoder work in one batch, in row-steps (beam_size x longest allowed "
                             "output, summed over sentences): bounds how long one batch holds the worker, so "
                             "large requests are split into batches that interleave with other requests. 0: by "
                             "device (the device rules below)")
    # translation cache (docs/cache.md)
    cache_mb: int = option(256, "MiB of sentence translations each serving process keeps (keyed on the model "
                           "version's content, the options and the source tokens; least recently used out first); "
                           "0: none")
    cache_redis: str = option("", "redis:// (or rediss://, unix://) URL of a translation cache shared by replicas, "
                              "asked for what this process's cache misses; a Redis that fails or is slow is skipped "
                              "(counted, retried with back-off); empty: none")
    cache_ttl: float = option(86400.0, "seconds an entry lives in the shared Redis cache")
    # glossaries (docs/glossaries.md)
    glossary_dir: str = option("", "directory of the stored glossaries (one .tsv or .csv file per glossary, which "
                               "operators may also drop, edit or delete there; shared by the front-ends and by "
                               "replicas that mount it); empty: only inline glossaries, and the glossary RPCs "
                               "answer FAILED_PRECONDITION")
    # request limits
    max_beam: int = option(8, "largest beam_size a request may ask for")
    max_texts: int = option(64, "most texts in one request")
    max_chars: int = option(20000, "most characters in one text")
    max_request_chars: int = option(100000, "most characters in one request, over all its texts")
    max_sentences: int = option(512, "most sentences in one request, over all its texts (a text is cut into "
                                "sentences unless the request turns splitting off); at most queue_size")
    max_tokens: int = option(256, "most source subword tokens in one text (EOS excluded)")
    max_length: int = option(512, "largest max_length (generated tokens, EOS included) a request may ask for; "
                             "the output is also capped at 2 x source tokens + 10")
    max_request_work: int = option(65536, "most decoder work one request may ask for, in row-steps (beam_size x "
                                   "longest allowed output, summed over its texts); beyond it INVALID_ARGUMENT")
    max_response_bytes: int = option(4 * 1024 * 1024, "most bytes a response may reach (a bound computed before "
                                     "any compute; 4 MiB is gRPC's default client receive limit); beyond it "
                                     "INVALID_ARGUMENT")
    # lifecycle and logs
    grace_seconds: float = option(10.0, "on SIGTERM/SIGINT: how long in-flight requests may take to finish; "
                                  "also how long a removed model version drains")
    log_level: str = option("INFO", "log level (logs are JSON lines on stderr)", choices=LOG_LEVELS)
    engine: str = option("onnx", "what decodes: onnx (the models' ONNX graphs), or null (no model: every sentence "
                         "comes back as its own tokens at once; measures the serving layer alone)", choices=ENGINES)
    frontends: int = option(0, "front-end processes (gRPC, HTTP, tokenizing, responses) beside one engine-core "
                            "process that decodes; they share the ports. 0: one process does everything")

    def __post_init__(self) -> None:
        canonicalize_choices(self)  # choices are case-insensitive everywhere (flags, environment, code)

    def validate(self) -> ServerConfig:
        """Check ranges and cross-field rules; raise :class:`NmtError` naming the field and its limit."""
        positive = ("max_batch_sentences", "queue_size", "max_beam", "max_texts", "max_chars", "max_request_chars",
                    "max_sentences", "max_tokens",
                    "max_length", "max_request_work", "max_response_bytes")
        for name in positive:
            if getattr(self, name) < 1:
                raise NmtError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("intra_op_threads", "inter_op_threads", "max_wait_ms", "grace_seconds", "reload_interval",
                     "device_id", "gpu_mem_limit", "max_connection_age", "frontends", *BY_DEVICE,
                     "cuda_graph_pool_mib"):
            if getattr(self, name) < 0:
                raise NmtError(f"{name} must not be negative, got {getattr(self, name)}")
        if not 0 <= self.malloc_retain_mb < 2048:
            raise NmtError(f"malloc_retain_mb must be 0-2047 (glibc takes the bound as a C int of bytes), got "
                           f"{self.malloc_retain_mb}")
        # a budget left to the device (0) must hold one sentence on every device: checked at its smallest value
        least = {name: getattr(self, name) or min(values.values()) for name, values in BY_DEVICE.items()}
        if self.max_tokens + 1 > least["batch_tokens"]:
            raise NmtError(f"batch_tokens ({least['batch_tokens']}) must hold one text of max_tokens "
                           f"({self.max_tokens}) plus EOS")
        if 0 < self.max_batch_rows < self.max_beam:
            raise NmtError(f"max_batch_rows ({self.max_batch_rows}) must hold one sentence of max_beam "
                           f"({self.max_beam}) rows")
        if least["decode_tokens"] < self.max_beam * (self.max_tokens + 1):
            raise NmtError(f"decode_tokens ({least['decode_tokens']}) must hold one sentence of max_tokens "
                           f"({self.max_tokens}) plus EOS at max_beam ({self.max_beam}) rows")
        if self.ort_prepack not in PREPACK:
            raise NmtError(f"ort_prepack must be one of {', '.join(PREPACK)}, got {self.ort_prepack!r}")
        if self.batching not in BATCHING:
            raise NmtError(f"batching must be one of {', '.join(BATCHING)}, got {self.batching!r}")
        if self.max_texts > self.queue_size:
            raise NmtError(f"queue_size ({self.queue_size}) must be at least max_texts ({self.max_texts})")
        parse_pair_models(self.pair_models)  # raises naming the entry that does not parse
        unknown = set(compat_apis(self.compat_apis)) - set(COMPAT_APIS)
        if unknown:
            raise NmtError(f"compat_apis: {', '.join(sorted(unknown))} unknown; choose from {', '.join(COMPAT_APIS)}")
        if self.cache_mb < 0 or self.cache_ttl < 1:
            raise NmtError(f"cache_mb must not be negative and cache_ttl must be at least 1 s, got {self.cache_mb} "
                           f"and {self.cache_ttl}")
        if self.cache_redis and not self.cache_redis.startswith(("redis://", "rediss://", "unix://")):
            raise NmtError(f"cache_redis must be a redis://, rediss:// or unix:// URL, got {self.cache_redis!r}")
        if self.engine not in ENGINES:
            raise NmtError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.provider not in PROVIDERS:
            raise NmtError(f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if self.log_level not in LOG_LEVELS:
            raise NmtError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            given, missing = ("tls_cert", "tls_key") if self.tls_cert else ("tls_key", "tls_cert")
            raise NmtError(f"{given} is set but {missing} is not: TLS needs both the certificate and its key")
        if self.tls_client_ca and not self.tls_cert:
            raise NmtError("tls_client_ca (mutual TLS) needs TLS: set tls_cert and tls_key too")
        for name in ("listen", "metrics_listen", "http_listen"):
            value = getattr(self, name)
            if (value or name == "listen") and not _is_host_port(value):
                raise NmtError(f"{name} must be host:port, got {value!r}")
        return self

    def to_json(self) -> str:
        """The configuration as one JSON object (how the supervisor hands it to its worker processes)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServerConfig:
        """The configuration :meth:`to_json` wrote (validated)."""
        return cls(**json.loads(text)).validate()

    def with_(self, **changes: Any) -> ServerConfig:
        """A copy with ``changes`` applied (validated)."""
        return replace(self, **changes).validate()

    # ---- command line and environment -------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
        """One ``--flag`` per field; its default comes from the environment variable when set."""
        add_arguments(cls, parser, env_prefix=ENV_PREFIX, environ=environ)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(**values_from_args(cls, args)).validate()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """Defaults, then environment variables, then ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = env_name(f, ENV_PREFIX)
            if env in environ:
                values[f.name] = parse_value(field_type(f), environ[env], env)
        values.update(overrides)
        return cls(**values).validate()


def flags_reference() -> str:
    """The reference of ``nmt serve``'s flags and of the device rules that their 0 or ``auto`` leave to the device
    (``docs/flags.md``, checked by ``tests/test_docs.py``)."""
    rules = ["| setting | on the CPU | on CUDA | why |", "|---|---|---|---|"]
    for name, values in {**BY_DEVICE, **AUTO_BY_DEVICE}.items():
        rules.append(f"| `{name}` | {values['cpu']} | {values['cuda']} | {DEVICE_RULE_REASONS[name]} |")
    return flags_table(ServerConfig, ENV_PREFIX) + "\n\n### Device rules\n\n" + "\n".join(rules)


def split_host_port(address: str) -> tuple[str, int]:
    """``"127.0.0.1:50051"`` -> ``("127.0.0.1", 50051)``; IPv6 as ``[::1]:50051``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 <= int(port) <= 65535)


if __name__ == "__main__":
    print(flags_reference())
