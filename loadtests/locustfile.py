"""Locust users for the Translator over gRPC, through the project's client (``nmt loadtest`` runs this file).

Each user holds a :class:`clients.TranslatorClient` (no retries: a failure is counted, not hidden) whose
channel carries a :class:`LocustInterceptor`, which fires Locust's ``request`` event once per RPC,
named after the scenario that sent it, with its latency, the response size and, for a failure, the
status code name. The scenarios are weighted tasks (:data:`loadtests.scenarios.WEIGHTS`). Texts come from
``--texts`` (a TSV whose first column is the source, e.g. a corpus' held-out ``test.tsv``, or plain
lines).

:class:`LoadShape` drives the user count: ``--load-shape steady`` holds ``--users`` for the run time;
``ramp`` adds ``--step-users`` every ``--step-seconds`` up to ``--users`` (the saturation search:
:mod:`loadtests.slo` finds the step where p95 leaves its SLO or failures start).
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import LoadTestShape, User, between, events, task

from clients import TranslationError, TranslatorClient
from loadtests.scenarios import LONG_JOIN, MANY_TEXTS, WEIGHTS

grpc_gevent.init_gevent()  # gRPC's blocking calls must yield to the other users' greenlets



class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Reports every unary RPC to Locust as one request named :attr:`scenario` (set by the task)."""

    def __init__(self, environment: Any) -> None:
        self.environment = environment
        self.scenario = ""

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        start = time.perf_counter()
        outcome = continuation(client_call_details, request)
        exception, length = None, 0
        try:
            length = outcome.result().ByteSize()
        except grpc.RpcError as error:
            exception = RpcFailure(error.code().name)
        self.environment.events.request.fire(
            request_type="grpc", name=self.scenario or client_call_details.method,
            response_time=(time.perf_counter() - start) * 1000, response_length=length, exception=exception,
            context={})
        return outcome


class RpcFailure(Exception):
    """A failed RPC, named by its status code (how Locust groups failures)."""


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--texts", default="", help="source texts: a TSV (first column) or one text per line")
    parser.add_argument("--model", default="", help="model to translate with (default: the server's)")
    parser.add_argument("--load-shape", choices=["steady", "ramp"], default="steady")
    parser.add_argument("--step-users", type=int, default=4, help="ramp: users added per step")
    parser.add_argument("--step-seconds", type=float, default=10.0, help="ramp: seconds per step")
    parser.add_argument("--call-timeout", type=float, default=30.0, help="deadline of each RPC, seconds")


def read_texts(path: str) -> list[str]:
    """Source texts of a TSV (first column) or a plain text file, blank lines skipped."""
    if not path:
        raise ValueError("--texts is required: a held-out split of the model's corpus (e.g. a run's test.tsv)")
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    texts = [line.split("\t")[0].strip() for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"{path} holds no texts")
    return texts


class TranslatorUser(User):
    """One caller: a client of its own, the scenarios as weighted tasks."""

    wait_time = between(0.0, 0.05)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.texts = read_texts(options.texts)
        self.model = options.model
        self.rng = random.Random()
        self.stats = LocustInterceptor(self.environment)
        self.client = TranslatorClient(self.host, timeout=options.call_timeout, max_attempts=1,
                                       interceptors=[self.stats])

    def on_stop(self) -> None:
        self.client.close()

    def _translate(self, scenario: str, texts: list[str], **options: Any) -> None:
        self.stats.scenario = scenario
        with contextlib.suppress(TranslationError):  # counted by the interceptor, with its status code
            self.client.translate(texts, model=self.model, **options)

    def _texts(self, count: int, long: bool = False) -> list[str]:
        if long:  # a long sentence: a few texts of the split joined
            return [" and ".join(self.rng.choice(self.texts) for _ in range(LONG_JOIN)) for _ in range(count)]
        return [self.rng.choice(self.texts) for _ in range(count)]

    @task(WEIGHTS["short greedy"])
    def short_greedy(self) -> None:
        self._translate("short greedy", self._texts(1), beam_size=1)

    @task(WEIGHTS["long beam 4"])
    def long_beam(self) -> None:
        self._translate("long beam 4", self._texts(1, long=True), beam_size=4)

    @task(WEIGHTS["attention beam 4 n-best 2"])
    def alignment_ui(self) -> None:
        self._translate("attention beam 4 n-best 2", self._texts(1), beam_size=4, num_hypotheses=2,
                        attention=True, scores=True)

    @task(WEIGHTS["many texts"])
    def many_texts(self) -> None:
        self._translate("many texts", self._texts(MANY_TEXTS))

    @task(WEIGHTS["list models"])
    def list_models(self) -> None:
        self.stats.scenario = "list models"
        with contextlib.suppress(TranslationError):  # counted by the interceptor
            self.client.list_models()


class LoadShape(LoadTestShape):
    """Steady: ``--users`` for the run time. Ramp: ``--step-users`` more every ``--step-seconds`` up to
    ``--users``, each step held for ``--step-seconds``; both stop at ``--run-time``."""

    use_common_options = True  # tick() reads --users, --spawn-rate and --run-time: Locust must not call them ignored

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        elapsed = self.get_run_time()
        if options.run_time and elapsed >= options.run_time:
            return None
        if options.load_shape == "steady":
            return options.num_users, options.spawn_rate
        steps = int(elapsed // options.step_seconds) + 1
        return min(options.num_users, steps * options.step_users), options.spawn_rate
