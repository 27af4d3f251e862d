"""Prometheus metrics of the translation server, and the standard gRPC server metrics.

Every metric lives in an injected :class:`CollectorRegistry` (tests use a fresh one); names follow
``nmt_<thing>_<unit>``; label values are bounded (model names and versions, method names, status
codes, stages) and never carry texts or request ids. The ``grpc_server_*`` family matches the
go-grpc-prometheus / py-grpc-prometheus names so stock Grafana dashboards work. The request and
``grpc_server_*`` metrics are counted by :mod:`server.frontend.interceptor`, the others by the scheduler and
the model repository (loads, model info, queue capacity); prometheus-client's standard ``process_*``
and ``python_*`` collectors are registered beside them.

Ready for alerting: a series that appears only on its first use reads 0 in ``rate()``/``increase()``
for that first increment, so an error-ratio alert would miss the first errors after a restart.
:meth:`ServerMetrics.init_service` and :meth:`ServerMetrics.init_model` therefore create every
known series at zero: each method of the service with each status code (also for ``model=""``,
the label of requests refused before a model was resolved) and every per-model family.

``python -m server.metrics`` prints the README's metrics table, built from a real scrape by
:func:`metrics_table` (a test checks the README against the live ``/metrics``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.metrics_core import Metric

from server.config import split_host_port

# seconds: 1 ms .. 60 s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SENTENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SENTENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TEXT_FORMATS = ("text", "html", "xml")  # nmt_text_sentences' labels: server.frontend.documents.model.TextFormat
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)  # seconds
STAGES = ("encode", "join", "decode")  # nmt_inference_duration_seconds
SELECTIONS = ("plain", "general")  # nmt_decode_steps: how a step's hypotheses were chosen
STATUS_CODES = tuple(code.name for code in grpc.StatusCode)
CACHE_LAYERS = ("memory", "redis")  # server.frontend.cache
LOOKUP_METHODS = frozenset({"ListModels", "ListLanguages"})  # counted, but neither timed nor in flight
HTTP_LABEL_PREFIX = "http:"  # the method label of the HTTP face's calls: http:Translate (server.frontend.http_face)
# ... and of its requests that reached no method: an unknown path, a wrong verb, a request that is not valid HTTP
HTTP_UNROUTED = HTTP_LABEL_PREFIX + "unknown"


def current_versions_only(families: Iterable[Metric]) -> list[Metric]:
    """``families`` without the series of model versions that are no longer loaded: those whose
    ``nmt_model_info`` is absent or 0 (every series labelled with a ``version``; the info series at 0 too).
    prometheus_client's multiprocess files keep a removed series with its last value, so ``/metrics`` of
    ``nmt serve --frontends`` would report a removed version's series forever without this."""
    families = list(families)
    loaded = {(s.labels.get("model"), s.labels["version"]) for family in families if family.name == "nmt_model_info"
              for s in family.samples if s.value > 0}
    for family in families:
        family.samples = [s for s in family.samples
                          if "version" not in s.labels or (s.labels.get("model"), s.labels["version"]) in loaded]
    return families


@dataclass(frozen=True)
class VersionSeries:
    """One model version's series (each per-version family's, and its encode and decode durations), looked up once
    for its scheduler, which writes them per sentence and per batch: prometheus_client's ``labels()`` checks,
    converts and locks at every call (~2 us)."""

    queue_duration: Any
    queue_depth: Any
    queue_capacity: Any
    batch_sentences: Any
    batch_tokens: Any
    padding_ratio: Any
    generated_tokens: Any
    source_tokens: Any
    cancelled_sentences: Any
    running_rows: Any
    admission_wait_steps: Any
    cuda_graph_runs: Any
    cuda_graph_failures: Any
    cuda_graph_reuses: Any
    cuda_graph_pool_bytes: Any
    encode_duration: Any
    join_duration: Any
    decode_duration: Any
    plain_steps: Any
    general_steps: Any


# The fields of VersionSeries that are one label value of a family with a third label: the stages of
# nmt_inference_duration_seconds and the selections of nmt_decode_steps
LABELLED_SERIES = ("encode_duration", "join_duration", "decode_duration", "plain_steps", "general_steps")
# The families labelled by model and version alone (their series come and go with the version)
VERSION_FAMILIES = tuple(f.name for f in fields(VersionSeries) if f.name not in LABELLED_SERIES)


@dataclass(frozen=True)
class CacheSeries:
    """One translation-cache layer's series (server.frontend.cache), looked up once."""

    hits: Any
    misses: Any
    evictions: Any
    bytes: Any
    errors: Any

    def evicted(self, count: int) -> None:
        if count:
            self.evictions.inc(count)

    def size(self, value: int) -> None:
        self.bytes.set(value)

    def error(self) -> None:
        self.errors.inc()


class Children:
    """A family's children by their label values, each looked up once (see :class:`VersionSeries`); for series
    that are never removed (the request series of a model, the gRPC series of a method)."""

    def __init__(self, family: Any, *fixed: str) -> None:
        self._family, self._fixed = family, fixed  # ``fixed``: the leading label values, the same for every child
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._family.labels(*self._fixed, *values)
        return child


class ServerMetrics:
    """The ``nmt_*`` and ``grpc_server_*`` metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # requests, seen by the interceptor
        self.requests = Counter("nmt_requests", "Translator requests by model, method and status code",
                                ["model", "method", "code"], registry=r)
        self.request_duration = Histogram("nmt_request_duration_seconds",
                                          "End-to-end request latency inside the server", ["model", "method"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.undecodable = Counter("nmt_undecodable_messages", "Request messages that did not parse "
                                   "(answered with INVALID_ARGUMENT)", ["grpc_service", "grpc_method"], registry=r)
        self.inflight = Gauge("nmt_inflight_requests", "Translator requests being handled", registry=r,
                              multiprocess_mode="livesum")
        # scheduler
        self.queue_duration = Histogram("nmt_queue_duration_seconds",
                                        "Time a sentence waited between admission and the start of its batch",
                                        ["model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("nmt_queue_depth", "Sentences waiting for a batch", ["model", "version"], registry=r,
                                 multiprocess_mode="livesum")
        self.queue_capacity = Gauge("nmt_queue_capacity", "Most sentences the queue holds (--queue-size); a request "
                                    "that does not fit gets RESOURCE_EXHAUSTED", ["model", "version"], registry=r,
                                    multiprocess_mode="livemax")
        self.inference_duration = Histogram("nmt_inference_duration_seconds",
                                            "Compute time by stage: encode (a batch's encoder calls), join (continuous "
                                            "batching: sentences joining the running decode, after their encoder "
                                            "call), decode (a batch's steps, or a stretch of the running decode's)",
                                            ["model", "version", "stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.decode_steps = Counter("nmt_decode_steps", "Decoding steps of the running decode (continuous batching) "
                                    "by how their hypotheses were chosen: plain (in a run of the model's own arg-max "
                                    "or plain beam steps) or general (the host's full selection: where such a run "
                                    "ends, a sentence leaves or joins, or a control or a prefix needs it)",
                                    ["model", "version", "selection"], registry=r)
        self.batch_sentences = Histogram("nmt_batch_size_sentences", "Sentences per batch", ["model", "version"],
                                         buckets=SENTENCE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("nmt_batch_size_tokens",
                                      "Source positions per batch including padding (what the token budget limits)",
                                      ["model", "version"], buckets=TOKEN_BUCKETS, registry=r)
        self.padding_ratio = Histogram("nmt_batch_padding_ratio",
                                       "Padded positions / all positions the encoder ran over in a batch (each "
                                       "run of similar source lengths padded to its own longest)",
                                       ["model", "version"], buckets=RATIO_BUCKETS, registry=r)
        self.generated_tokens = Counter("nmt_generated_tokens", "Target tokens generated (all returned hypotheses)",
                                        ["model", "version"], registry=r)
        self.source_tokens = Counter("nmt_source_tokens", "Source tokens encoded (EOS included, padding excluded)",
                                     ["model", "version"], registry=r)
        self.cancelled_sentences = Counter("nmt_cancelled_sentences",
                                           "Sentences that left a running batch because their request was "
                                           "cancelled or expired", ["model", "version"], registry=r)
        self.running_rows = Gauge("nmt_running_rows", "Decoder rows in the running decode (continuous batching; "
                                  "a sentence holds beam_size rows)", ["model", "version"], registry=r,
                                  multiprocess_mode="livesum")
        self.cuda_graph_runs = Counter("nmt_cuda_graph_runs", "Runs of steps on the device (beam or arg-max) given "
                                       "CUDA graph ids of their own (--cuda-graphs: captured on their third step, "
                                       "replayed after)",
                                       ["model", "version"], registry=r)
        self.cuda_graph_failures = Counter("nmt_cuda_graph_capture_failures", "CUDA graph captures that failed (that "
                                           "bucket's runs then use ordinary session runs)", ["model", "version"],
                                           registry=r)
        self.cuda_graph_reuses = Counter("nmt_cuda_graph_run_reuses", "Runs of steps started again from the runs "
                                         "kept for CUDA graphs (their buffers, and on CUDA their graphs, reused)",
                                         ["model", "version"], registry=r)
        self.cuda_graph_pool_bytes = Gauge("nmt_cuda_graph_pool_bytes", "Device memory of the runs kept for CUDA "
                                           "graphs (--cuda-graph-pool-mib bounds it)", ["model", "version"],
                                           registry=r, multiprocess_mode="livesum")
        self.admission_wait_steps = Histogram("nmt_admission_wait_steps", "Decoding steps the running decode ran "
                                              "while a sentence waited to join it (continuous batching)",
                                              ["model", "version"], buckets=STEP_BUCKETS, registry=r)
        self.stream_first_word = Histogram("nmt_stream_first_word_seconds", "TranslateStreaming: time from the "
                                           "request to the first message that carries text", ["model"],
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.stream_word_gap = Histogram("nmt_stream_word_gap_seconds", "TranslateStreaming: time between "
                                         "consecutive messages that carry text", ["model"], buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.text_sentences = Histogram("nmt_text_sentences", "Sentences per translated text, by text format (its "
                                        "_count: texts by format)", ["model", "format"], buckets=SENTENCE_BUCKETS,
                                        registry=r)
        self.glossary_terms = Counter("nmt_glossary_terms", "Glossary term occurrences found in sources and "
                                      "required of the translations (constraints of the search)", ["model"],
                                      registry=r)
        self.constrained_sentences = Counter("nmt_constrained_sentences", "Sentences decoded under glossary terms",
                                             ["model"], registry=r)
        self.cache_lookups = Counter("nmt_cache_lookups", "Sentences looked up in the translation cache by layer "
                                     "(memory: this process; redis: the shared one, asked for what memory missed) "
                                     "and result (hit, miss)", ["layer", "result"], registry=r)
        self.cache_evictions = Counter("nmt_cache_evictions", "Entries the in-process translation cache dropped to "
                                       "stay within --cache-mb", ["layer"], registry=r)
        self.cache_bytes = Gauge("nmt_cache_bytes", "Bytes the in-process translation cache holds (keys and "
                                 "values)", ["layer"], registry=r, multiprocess_mode="livesum")
        self.cache_errors = Counter("nmt_cache_errors", "Calls to the shared Redis cache that failed or timed out "
                                    "(the request then decodes as without it)", ["layer"], registry=r)
        self.model_info = Gauge("nmt_model_info", "Loaded model versions (value 1)",
                                ["model", "version", "architecture", "provider"], registry=r,
                                multiprocess_mode="livemax")
        self.model_loads = Counter("nmt_model_loads", "Model version loads (start-up, hot reload and reloads of a "
                                   "failing version) by outcome: loaded, or refused (bad manifest or hash, "
                                   "load error, failed smoke translation)", ["model", "result"], registry=r)
        self.gc_pause = Histogram("nmt_gc_pause_seconds", "Pauses of the interpreter's cyclic garbage collector "
                                  "(every thread of the process stands still) by generation (server.collector)",
                                  ["generation"], buckets=PAUSE_BUCKETS, registry=r)
        for generation in range(3):
            self.gc_pause.labels(str(generation))
        # standard gRPC server metrics
        self.grpc_started = Counter("grpc_server_started", "RPCs started on the server",
                                    ["grpc_type", "grpc_service", "grpc_method"], registry=r)
        self.grpc_handled = Counter("grpc_server_handled", "RPCs completed on the server, regardless of success",
                                    ["grpc_type", "grpc_service", "grpc_method", "grpc_code"], registry=r)
        self.grpc_handling = Histogram("grpc_server_handling_seconds", "Response latency of RPCs handled",
                                       ["grpc_type", "grpc_service", "grpc_method"], buckets=LATENCY_BUCKETS,
                                       registry=r)
        # the process: resident memory, CPU seconds, open file descriptors, ...; the interpreter
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._methods: dict[str, str] = {}
        self._http_methods: list[str] = []

    def init_service(self, service: str, methods: Mapping[str, str]) -> None:
        """Create the series of ``service``'s methods (name -> gRPC type) at zero, for every status code:
        the ``grpc_server_*`` family and the requests refused before a model was resolved (``model=""``)."""
        for method, grpc_type in methods.items():
            labels = (grpc_type, service, method)
            self.grpc_started.labels(*labels)
            self.grpc_handling.labels(*labels)
            self.undecodable.labels(service, method)
            for code in STATUS_CODES:
                self.grpc_handled.labels(*labels, code)
        self._methods = dict(methods)
        self.init_requests("")
        for layer in CACHE_LAYERS:  # at zero whether or not the layer is configured, as the request series
            self.cache_series(layer)

    def init_http(self, methods: Iterable[str]) -> None:
        """Create the request series of the methods the HTTP face serves (``method="http:<Method>"``) at zero,
        like :meth:`init_service` does for gRPC (call it before the models load), and those of the requests
        that reach no method (:data:`HTTP_UNROUTED`, ``model=""`` only: they never resolve a model)."""
        self._http_methods = list(methods)
        self.init_requests("")
        for code in STATUS_CODES:
            self.requests.labels("", HTTP_UNROUTED, code)

    def init_model(self, model: str, version: str) -> None:
        """Create every series of one model version at zero (after :meth:`init_service`)."""
        self.init_requests(model)
        for family in self._version_families():
            family.labels(model, version)
        for stage in STAGES:
            self.inference_duration.labels(model, version, stage)
        for selection in SELECTIONS:
            self.decode_steps.labels(model, version, selection)

    def retire_info(self, *labels: str) -> None:
        """Remove a version's ``nmt_model_info`` series, set to 0 first: in prometheus_client's multiprocess
        mode (``nmt serve --frontends``) a removed series stays in the process's file with its last value, and
        :func:`current_versions_only` drops the series of versions whose info reads 0."""
        self.model_info.labels(*labels).set(0)
        self.model_info.remove(*labels)

    def remove_model(self, model: str, version: str) -> None:
        """Remove the series of a model version that is gone (the per-model request series stay: the
        model's other versions, or a later one, count there)."""
        for family in self._version_families():
            family.remove(model, version)
        for stage in STAGES:
            self.inference_duration.remove(model, version, stage)
        for selection in SELECTIONS:
            self.decode_steps.remove(model, version, selection)

    def version_series(self, model: str, version: str) -> VersionSeries:
        """The series of one model version, created at zero if new (its scheduler's, see :class:`VersionSeries`)."""
        return VersionSeries(**{name: getattr(self, name).labels(model, version) for name in VERSION_FAMILIES},
                             encode_duration=self.inference_duration.labels(model, version, "encode"),
                             join_duration=self.inference_duration.labels(model, version, "join"),
                             decode_duration=self.inference_duration.labels(model, version, "decode"),
                             plain_steps=self.decode_steps.labels(model, version, "plain"),
                             general_steps=self.decode_steps.labels(model, version, "general"))

    def _version_families(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in VERSION_FAMILIES)

    def init_requests(self, model: str) -> None:
        labels = [(method, method) for method in self._methods]
        labels += [(method, HTTP_LABEL_PREFIX + method) for method in self._http_methods]
        for method, label in labels:
            if method not in LOOKUP_METHODS:
                self.request_duration.labels(model, label)
            for code in STATUS_CODES:
                self.requests.labels(model, label, code)
        self.stream_first_word.labels(model)
        self.stream_word_gap.labels(model)
        for text_format in TEXT_FORMATS:
            self.text_sentences.labels(model, text_format)

    def cache_series(self, layer: str) -> CacheSeries:
        """The series of translation-cache ``layer`` (memory or redis), initialised."""
        return CacheSeries(self.cache_lookups.labels(layer, "hit"), self.cache_lookups.labels(layer, "miss"),
                           self.cache_evictions.labels(layer), self.cache_bytes.labels(layer),
                           self.cache_errors.labels(layer))

    def observe_texts(self, model: str, text_format: str, sentences: list[int]) -> None:
        """A request's texts read as documents: each one's sentence count."""
        histogram = self.text_sentences.labels(model, text_format)
        for count in sentences:
            histogram.observe(count)

    def observe_terms(self, model: str, sentences: int, terms: int) -> None:
        """A request's sentences decoded under glossary terms, and its terms."""
        if sentences:
            self.constrained_sentences.labels(model).inc(sentences)
            self.glossary_terms.labels(model).inc(terms)

    def serve_http(self, address: str) -> Any:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread; returns the HTTP server (``.server_port``)."""
        host, port = split_host_port(address)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


def metrics_table(families: Iterable[Metric]) -> str:
    """The Markdown table of the ``nmt_*`` and ``grpc_server_*`` families (name, type, labels, help)."""
    rows = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for family in sorted(families, key=lambda f: f.name):
        if not family.name.startswith(("nmt_", "grpc_server_")) or family.name.endswith("_created"):
            continue  # (the text parser reads a counter's or histogram's ``_created`` series as a gauge)
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = list(dict.fromkeys(key for sample in family.samples for key in sample.labels if key != "le"))
        rows.append(f"| `{name}` | {family.type} | {', '.join(labels) or '-'} | {family.documentation} |")
    return "\n".join(rows)


def _print_table() -> None:
    """Print the table from a scrape of a registry with one model version initialised."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from server.protos import SERVICE_NAME, method_types

    metrics = ServerMetrics()
    metrics.init_service(SERVICE_NAME, method_types())
    metrics.init_model("model", "1")
    metrics.model_info.labels("model", "1", "transformer", "cpu").set(1)
    metrics.model_loads.labels("model", "loaded").inc()
    print(metrics_table(text_string_to_metric_families(generate_latest(metrics.registry).decode())))


if __name__ == "__main__":
    _print_table()
