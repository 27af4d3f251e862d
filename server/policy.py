"""What both sides of a request hold: its handle (deadline and cancellation) and the limits it is checked
against (:class:`BatchPolicy`, from the server configuration). The front-end checks a request's token,
work and response limits before submitting it; the scheduler applies the batching limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from server.errors import Cancelled, DeadlineExceeded, ServingError

# The device rules: the limits whose 0 (the server's default) and the choices whose "auto" mean "by the device", and
# the choices that are the device's alone (no flag: encoder_overlap, hold_ended). A CPU computes a few dozen rows in
# parallel, a GPU hundreds in the time of one; the figures behind each rule are in benchmarks/README.md and
# docs/decisions.md.
BY_DEVICE = {
    "max_batch_rows": {"cpu": 32, "cuda": 512},
    "batch_tokens": {"cpu": 4096, "cuda": 32768},
    "batch_work": {"cpu": 16384, "cuda": 262144},
    "decode_tokens": {"cpu": 65536, "cuda": 262144},
}
AUTO_BY_DEVICE = {
    "batching": {"cpu": "static", "cuda": "continuous"},
    "encoder_overlap": {"cpu": "off", "cuda": "on"},
    "hold_ended": {"cpu": "off", "cuda": "on"},
}
DEVICE_RULE_REASONS = {
    "max_batch_rows": "decoder rows of the running decode: 32 are 8 beam-4 sentences, what a CPU computes at once; "
                      "512 are 128 beam-4 sentences, as many as a GPU's static batches hold",
    "batch_tokens": "source tokens of one encoder call: 128 sentences of 256 tokens on CUDA",
    "batch_work": "row-steps one static batch may hold the worker for: 32 rows for 512 steps on the CPU, 512 rows "
                  "for 512 steps on CUDA, where a step costs about the same at any row count",
    "decode_tokens": "rows x (widest source + longest target) of the running decode, which bounds its KV cache "
                     "(512 rows of 512 on CUDA: ~3 GiB for a 6-layer d-512 fp16 model)",
    "batching": "continuous batching pays where a step's cost hardly grows with its rows (a GPU); on a CPU it "
                "adds admissions and saves nothing",
    "encoder_overlap": "encoding the sentences that join beside the decode's steps uses a GPU's idle time; on a "
                       "CPU it would take the decode's cores",
    "hold_ended": "a sentence that ends in plain arg-max steps leaves at once while its row runs on unread to the "
                  "next admission: free on a GPU, whose step costs the same at any row count; a CPU pays per row",
}


@dataclass(frozen=True)
class BatchPolicy:
    """Limits of the scheduler (from :class:`server.config.ServerConfig`)."""

    batch_tokens: int = 4096  # longest source (EOS incl.) x sentences
    max_batch_sentences: int = 64
    max_wait_seconds: float = 0.005
    queue_size: int = 1024  # queued sentences (not yet in a batch)
    max_tokens: int = 256  # source tokens of one text (EOS excl.); longer texts are refused
    batch_work: int = 16384  # decoder row-steps of one batch (beam x longest allowed output, summed)
    max_request_work: int = 65536  # decoder row-steps of one request
    max_response_bytes: int = 4 * 1024 * 1024  # bound on one response's serialized size
    batching: str = "auto"  # "static", "continuous" (server.core.continuous) or "auto": by device
    max_batch_rows: int = 32  # decoder rows of the running decode (a sentence holds its beam size); 0: by device
    decode_tokens: int = 65536  # running decode: rows x (widest source + longest target so far)
    encoder_overlap: str = "auto"  # continuous: "on" encodes joining sentences beside the decode; "auto": by device
    hold_ended: str = "auto"  # continuous: "on" runs an ended sentence's row on unread to the end of the run; by device

    def for_device(self, device: str) -> BatchPolicy:
        """This policy with the choices of :data:`AUTO_BY_DEVICE` left "auto" and the limits of :data:`BY_DEVICE` left
        at 0 resolved for ``device`` ("cpu", "cuda:0", ...)."""
        kind = "cuda" if device.startswith("cuda") else "cpu"
        return replace(self, **{name: values[kind] if getattr(self, name) == "auto" else getattr(self, name)
                                for name, values in AUTO_BY_DEVICE.items()},
                       **{name: getattr(self, name) or values[kind] for name, values in BY_DEVICE.items()})

    @classmethod
    def from_config(cls, config: Any) -> BatchPolicy:
        """The policy of ``config`` (a :class:`server.config.ServerConfig`)."""
        return cls(batch_tokens=config.batch_tokens, max_batch_sentences=config.max_batch_sentences,
                   max_wait_seconds=config.max_wait_ms / 1000.0, queue_size=config.queue_size,
                   max_tokens=config.max_tokens, batch_work=config.batch_work,
                   max_request_work=config.max_request_work, max_response_bytes=config.max_response_bytes,
                   batching=config.batching, max_batch_rows=config.max_batch_rows,
                   decode_tokens=config.decode_tokens)


class RequestHandle:
    """Cancellation state and deadline of one request, shared by its sentences.

    ``is_cancelled`` is called from the engine's worker thread; it only reads two attributes.
    """

    def __init__(self, deadline: float | None = None, request_id: str = "") -> None:
        self.deadline = deadline  # time.monotonic() seconds, None: no deadline
        self.request_id = request_id  # for error messages and logs
        self._cancelled = False

    @classmethod
    def with_timeout(cls, seconds: float | None, request_id: str = "") -> RequestHandle:
        return cls(None if seconds is None else time.monotonic() + seconds, request_id)

    def cancel(self) -> None:
        self._cancelled = True

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def is_cancelled(self) -> bool:
        return self._cancelled or self.expired()

    def error(self) -> ServingError:
        if self.expired():
            return DeadlineExceeded("deadline exceeded while the request was queued or being translated")
        return Cancelled("request cancelled")
