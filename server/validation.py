"""Request checks against the configured limits and the model's defaults; every failure is InvalidArgument."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from server.config import ServerConfig
from server.errors import InvalidArgument
from server.types import DecodingOptions, RequestedOptions

MAX_LENGTH_PENALTY = 10.0


def check_texts(texts: Sequence[str], config: ServerConfig) -> None:
    """Count, emptiness and character limits (no model needed)."""
    if not texts:
        raise InvalidArgument("no texts: send at least one text to translate")
    if len(texts) > config.max_texts:
        raise InvalidArgument(f"too many texts: {len(texts)}, the limit is {config.max_texts} per request")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidArgument(f"texts[{i}] is empty or whitespace-only")
        if len(text) > config.max_chars:
            raise InvalidArgument(f"texts[{i}] has {len(text)} characters, the limit is {config.max_chars}")


def resolve_options(requested: RequestedOptions, defaults: dict[str, Any], config: ServerConfig) -> DecodingOptions:
    """Fill zeros from the model's defaults and check every option against the configured limits."""
    beam = requested.beam_size or min(int(defaults.get("beam_size", 1) or 1), config.max_beam)
    if beam > config.max_beam:
        raise InvalidArgument(f"beam_size {beam} is over the limit of {config.max_beam}")
    hypotheses = requested.num_hypotheses or 1
    if hypotheses > beam:
        raise InvalidArgument(f"num_hypotheses {hypotheses} is larger than the beam size {beam}"
                              + ("" if requested.beam_size else " (the model's default)"))
    max_length = requested.max_length or min(int(defaults.get("max_length", 256) or 256), config.max_length)
    if max_length > config.max_length:
        raise InvalidArgument(f"max_length {max_length} is over the limit of {config.max_length}")
    penalty = requested.length_penalty
    if not math.isfinite(penalty) or penalty < 0 or penalty > MAX_LENGTH_PENALTY:
        raise InvalidArgument(f"length_penalty {penalty} must be between 0 (the model's default) "
                              f"and {MAX_LENGTH_PENALTY}")
    if penalty == 0:
        penalty = float(defaults.get("length_penalty", 1.0))
    return DecodingOptions(beam_size=beam, num_hypotheses=hypotheses, max_length=max_length,
                           length_penalty=penalty, return_attention=requested.return_attention)


def tokenize_texts(texts: Sequence[str], tokenize: Callable[[str], list[int]], max_tokens: int) -> list[list[int]]:
    """Subword ids of each text (EOS excluded); a text with no tokens or more than ``max_tokens`` is refused."""
    ids = [tokenize(text) for text in texts]
    for i, sentence in enumerate(ids):
        if len(sentence) > max_tokens:
            raise InvalidArgument(f"texts[{i}] has {len(sentence)} tokens, the limit is {max_tokens}")
        if not sentence:
            raise InvalidArgument(f"texts[{i}] has no tokens")
    return ids
