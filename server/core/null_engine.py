"""An engine that decodes nothing: ``nmt serve --engine null`` measures the serving layer by itself.

Every sentence gets at once one hypothesis made of its own source tokens (and EOS), so a request goes
through everything a real one does (gRPC or HTTP, validation, tokenizing, the scheduler, the IPC of a
split server, detokenizing, the response) except the model. ``nmt bench server --engine null`` reads
the CPU the server spends per request from it. Not for serving translations.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.engine.engine import BatchResult, generated_tokens
from server.text import TextCodec
from server.types import ScoredSequence, SearchResult, SentenceRequest


class NullEngine:
    """The engine API (:class:`server.engine.engine.Engine`) over a version's tokenizer, answering without a model."""

    provider = "null"
    device = "cpu"
    runtime_build = "none"
    model = None  # no step model: the scheduler batches statically and records no CUDA graphs

    def __init__(self, text: TextCodec) -> None:
        self.text = text
        self.manifest, self.tokenizer, self.eos_id = text.manifest, text.tokenizer, text.eos_id

    @classmethod
    def load(cls, version_dir: str | Path, **_settings: Any) -> NullEngine:
        """The engine of ``version_dir`` (its manifest and tokenizer; the graphs are not opened)."""
        return cls(TextCodec.load(version_dir))

    def tokenize(self, text: str) -> list[int]:
        return self.text.tokenize(text)

    def search_batch(self, requests: Sequence[SentenceRequest]) -> BatchResult:
        """One hypothesis per sentence, its source tokens, score 0."""
        results: list[SearchResult | None] = []
        for r in requests:
            tokens = r.source(self.eos_id)
            results.append(SearchResult([ScoredSequence(tokens, 0.0, [0.0] * len(tokens))]))
        source = sum(len(r.source(self.eos_id)) for r in requests)
        return BatchResult(results, 0.0, 0.0, sum(generated_tokens(r) for r in results if r), source, 0.0, 0)

    def memory_error(self, error: Exception, sentences: int) -> None:
        return None
