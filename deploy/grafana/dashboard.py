"""The translator's Grafana dashboard, as code (Grafana's own ``grafana-foundation-sdk`` builders).

    python deploy/grafana/dashboard.py        # regenerates deploy/grafana/dashboards/translator.json

Grafana provisions the JSON file (``deploy/grafana/provisioning``); ``tests/test_dashboard.py`` fails
when the file and this code drift apart, and evaluates every expression against a real Prometheus.
Every query filters on the ``model`` and ``version`` template variables and uses the ``datasource``
variable, so the dashboard works with any Prometheus data source. The request panels also show, whatever
models are selected, the calls that belong to no model (:data:`REQUESTS`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption, VariableRefresh

UID = "nmt-translator"
OUTPUT = Path(__file__).resolve().parent / "dashboards" / "translator.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model=~"$model"'
VERSION = 'version=~"$version"'
SELECTED = f"{MODEL}, {VERSION}"
# nmt_requests_total counts with model="" the calls that name no model: ListModels, and calls refused before a
# model was resolved (unknown model, a message that does not parse, an unrouted HTTP request). `model=~"$model"`
# would hide them as soon as one model is selected, so the request panels match "" too (Grafana writes a
# selection as `a`, `(a|b)` or, for All, `.*`). Recording a model label for ListModels instead would invent a
# model name for a call about every model, and would still hide the refusals.
REQUESTS = 'model=~"$model|"'
RATE = "$__rate_interval"
SERVER_ERRORS = "INTERNAL|UNKNOWN|DATA_LOSS|UNAVAILABLE|DEADLINE_EXCEEDED"  # as in deploy/prometheus/alerts.yml


def query(expr: str, legend: str = "") -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    return target.legend_format(legend) if legend else target


def graph(title: str, unit: str, *targets: prometheus.Dataquery, width: int = 12) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(8).span(width)
    for ref, target in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def quantiles(metric: str, by: str, title: str) -> timeseries.Panel:
    """p50, p95 and p99 of a histogram, per ``by``."""
    return graph(title, "s", *(
        query(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{MODEL}}}[{RATE}])))",
              f"p{round(q * 100)} {{{{{by.replace(', ', '}} {{')}}}}}")
        for q in (0.5, 0.95, 0.99)))


def variable(name: str, label: str, expr: str) -> dashboard.QueryVariable:
    return (dashboard.QueryVariable(name).label(label).query(expr).datasource(DATASOURCE)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*")
            .current(VariableOption(selected=True, text="All", value="$__all")))


def build() -> dashboard.Dashboard:
    """The dashboard: traffic and errors, latency, scheduler, tokens, models, process."""
    return (
        dashboard.Dashboard("NMT translator").uid(UID).tags(["nmt", "translation", "grpc"])
        .refresh("30s").time("now-1h", "now").timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(variable("model", "Model", "label_values(nmt_model_info, model)"))
        .with_variable(variable("version", "Version", 'label_values(nmt_model_info{model=~"$model"}, version)'))
        .with_row(dashboard.Row("Traffic and errors"))
        .with_panel(graph("Requests by method, model and code", "reqps",
                          query(f"sum by (method, model, code) (rate(nmt_requests_total{{{REQUESTS}}}[{RATE}]))",
                                "{{method}} {{model}} {{code}}")))
        .with_panel(graph("Server error ratio by method and model", "percentunit",
                          query(f'sum by (method, model) (rate(nmt_requests_total{{{REQUESTS}, '
                                f'code=~"{SERVER_ERRORS}"}}[{RATE}])) / '
                                f"sum by (method, model) (rate(nmt_requests_total{{{REQUESTS}}}[{RATE}]))",
                                "{{method}} {{model}}"),
                          query(f'sum by (method, model) (rate(nmt_requests_total{{{REQUESTS}, code!="OK"}}'
                                f"[{RATE}])) / sum by (method, model) (rate(nmt_requests_total{{{REQUESTS}}}"
                                f"[{RATE}]))", "{{method}} {{model}} all non-OK")))
        .with_panel(graph("Undecodable messages", "reqps",
                          query(f"sum by (grpc_method) (rate(nmt_undecodable_messages_total[{RATE}]))",
                                "{{grpc_method}}")))
        .with_panel(graph("In-flight requests", "short", query("nmt_inflight_requests", "in flight")))
        .with_row(dashboard.Row("Latency"))
        .with_panel(quantiles("nmt_request_duration_seconds", "model, method", "Request latency"))
        .with_panel(quantiles("nmt_stream_first_word_seconds", "model", "Streaming: time to the first word"))
        .with_panel(quantiles("nmt_stream_word_gap_seconds", "model", "Streaming: gap between words"))
        .with_panel(graph("Queue wait vs inference (mean per batch / sentence)", "s",
                          query(f"sum by (model) (rate(nmt_queue_duration_seconds_sum{{{SELECTED}}}[{RATE}])) / "
                                f"sum by (model) (rate(nmt_queue_duration_seconds_count{{{SELECTED}}}[{RATE}]))",
                                "{{model}} queue wait"),
                          query(f"sum by (model, stage) (rate(nmt_inference_duration_seconds_sum{{{SELECTED}}}"
                                f"[{RATE}])) / sum by (model, stage) (rate(nmt_inference_duration_seconds_count"
                                f"{{{SELECTED}}}[{RATE}]))", "{{model}} {{stage}}")))
        .with_row(dashboard.Row("Scheduler"))
        .with_panel(graph("Queue depth and capacity", "short",
                          query(f"sum by (model, version) (nmt_queue_depth{{{SELECTED}}})", "{{model}}/{{version}}"),
                          query(f"sum by (model, version) (nmt_queue_capacity{{{SELECTED}}})",
                                "{{model}}/{{version}} capacity")))
        .with_panel(graph("Batch size (mean)", "short",
                          query(f"sum by (model) (rate(nmt_batch_size_sentences_sum{{{SELECTED}}}[{RATE}])) / "
                                f"sum by (model) (rate(nmt_batch_size_sentences_count{{{SELECTED}}}[{RATE}]))",
                                "{{model}} sentences"),
                          query(f"sum by (model) (rate(nmt_batch_size_tokens_sum{{{SELECTED}}}[{RATE}])) / "
                                f"sum by (model) (rate(nmt_batch_size_tokens_count{{{SELECTED}}}[{RATE}]))",
                                "{{model}} tokens")))
        .with_panel(graph("Padding ratio (mean)", "percentunit",
                          query(f"sum by (model) (rate(nmt_batch_padding_ratio_sum{{{SELECTED}}}[{RATE}])) / "
                                f"sum by (model) (rate(nmt_batch_padding_ratio_count{{{SELECTED}}}[{RATE}]))",
                                "{{model}}")))
        .with_panel(graph("Cancelled sentences", "short",
                          query(f"sum by (model) (rate(nmt_cancelled_sentences_total{{{SELECTED}}}[{RATE}]))",
                                "{{model}}")))
        .with_panel(graph("Running decode rows (continuous batching)", "short",
                          query(f"sum by (model, version) (nmt_running_rows{{{SELECTED}}})",
                                "{{model}} {{version}}")))
        .with_panel(graph("CUDA graphs: beam runs started per second, and failed captures", "short",
                          query(f"sum by (model) (rate(nmt_cuda_graph_runs_total{{{SELECTED}}}[{RATE}]))",
                                "{{model}} new runs (capture)"),
                          query(f"sum by (model) (rate(nmt_cuda_graph_run_reuses_total{{{SELECTED}}}[{RATE}]))",
                                "{{model}} kept runs started again (replay)"),
                          query(f"sum by (model) (rate(nmt_cuda_graph_capture_failures_total{{{SELECTED}}}[{RATE}]))",
                                "{{model}} failed captures")))
        .with_panel(graph("Running decode: share of steps chosen by the general selection (each ends a run of plain "
                          "steps)", "percentunit",
                          query(f"sum by (model) (rate(nmt_decode_steps_total{{selection=\"general\", {SELECTED}}}"
                                f"[{RATE}])) / sum by (model) (rate(nmt_decode_steps_total{{{SELECTED}}}[{RATE}]))",
                                "{{model}}")))
        .with_row(dashboard.Row("Tokens"))
        .with_panel(graph("Generated and source tokens per second", "short",
                          query(f"sum by (model) (rate(nmt_generated_tokens_total{{{SELECTED}}}[{RATE}]))",
                                "{{model}} generated"),
                          query(f"sum by (model) (rate(nmt_source_tokens_total{{{SELECTED}}}[{RATE}]))",
                                "{{model}} source")))
        .with_panel(stat.Panel().title("Generated tokens, last hour").datasource(DATASOURCE).height(8).span(12)
                    .with_target(query(f"sum(increase(nmt_generated_tokens_total{{{SELECTED}}}[1h]))").ref_id("A")))
        .with_row(dashboard.Row("Models and process"))
        .with_panel(table.Panel().title("Loaded model versions").datasource(DATASOURCE).height(8).span(12)
                    .with_target(query(f"nmt_model_info{{{SELECTED}}}").instant().format("table").ref_id("A")))
        .with_panel(graph("Model loads by outcome", "short",
                          query(f"sum by (model, result) (increase(nmt_model_loads_total{{{MODEL}}}[1h]))",
                                "{{model}} {{result}}")))
        .with_panel(graph("Resident memory", "bytes", query("process_resident_memory_bytes", "{{instance}}")))
        .with_panel(graph("CPU", "percentunit", query(f"rate(process_cpu_seconds_total[{RATE}])", "{{instance}}")))
        .with_panel(graph("Garbage collector: share of the time every thread stood still, by generation",
                          "percentunit",
                          query(f"sum by (generation) (rate(nmt_gc_pause_seconds_sum[{RATE}]))",
                                "generation {{generation}}")))
    )


def render() -> str:
    """The dashboard as the JSON Grafana provisions."""
    return json.dumps(build().build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def dashboard_expressions(path: Path = OUTPUT) -> list[str]:
    """Every PromQL expression of a dashboard JSON file: its panels' targets and its query variables."""
    model = json.loads(path.read_text(encoding="utf-8"))
    panels = [p for p in model.get("panels", [])] + [q for p in model.get("panels", []) for q in p.get("panels", [])]
    expressions = [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]
    for var in model.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            found = re.fullmatch(r"label_values\((.+), *\w+\)", str(var["query"]))
            expressions.append(found.group(1) if found else str(var["query"]))
    return expressions


if __name__ == "__main__":
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT}")
