"""Request checks against the configured limits and the model's defaults; every failure is InvalidArgument."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from common.model_format.decoding import max_target_length
from server.completion import WIDTH
from server.config import ServerConfig
from server.controls import Controls
from server.errors import InvalidArgument
from server.types import DecodingOptions, RequestedOptions, TargetPrefix

MAX_LENGTH_PENALTY = 10.0
MAX_REPETITION_PENALTY = 10.0
MAX_PATIENCE = 10.0
MAX_TEMPERATURE = 100.0
MAX_SUPPRESS_SEQUENCES = 256


def check_texts(texts: Sequence[str], config: ServerConfig) -> None:
    """Count, emptiness and character limits (no model needed)."""
    if not texts:
        raise InvalidArgument("no texts: send at least one text to translate")
    if len(texts) > config.max_texts:
        raise InvalidArgument(f"too many texts: {len(texts)}, the limit is {config.max_texts} per request")
    total = sum(map(len, texts))
    if total > config.max_request_chars:
        raise InvalidArgument(f"texts have {total} characters in all, the limit is {config.max_request_chars} per "
                              "request (max_request_chars)")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidArgument(f"texts[{i}] is empty or whitespace-only")
        if len(text) > config.max_chars:
            raise InvalidArgument(f"texts[{i}] has {len(text)} characters, the limit is {config.max_chars}")


def resolve_options(requested: RequestedOptions, defaults: dict[str, Any], config: ServerConfig, *,
                    max_positions: int = 0, target_ids: Callable[[str], list[int]] = lambda text: [],
                    unk_id: int = 0) -> DecodingOptions:
    """Fill zeros from the model's defaults and check every option against the configured limits and the
    model's ``max_positions`` (its position table; 0: none, as in an RNN). Beyond that table CUDA's
    Gather reads zeros silently where the CPU raises, so a longer ``max_length`` is refused. The
    decoding controls need the model's target tokenizer (``target_ids``) and unknown token (``unk_id``)."""
    sampling = requested.sampling_topk > 1 or 0 < requested.sampling_topp < 1  # samples: the default beam is 1
    beam = requested.beam_size or (1 if sampling else min(int(defaults.get("beam_size", 1) or 1), config.max_beam))
    if beam > config.max_beam:
        raise InvalidArgument(f"beam_size {beam} is over the limit of {config.max_beam}")
    hypotheses = requested.num_hypotheses or 1
    if requested.return_alternatives:  # each alternative is a search of its own: n is not bound by the beam
        if hypotheses > config.max_beam:
            raise InvalidArgument(f"num_hypotheses {hypotheses} (the alternatives returned) is over the limit of "
                                  f"{config.max_beam}")
    elif hypotheses > beam:
        raise InvalidArgument(f"num_hypotheses {hypotheses} is larger than the beam size {beam}"
                              + ("" if requested.beam_size else " (the model's default)"))
    max_length = requested.max_length or min(int(defaults.get("max_length", 256) or 256), config.max_length,
                                             max_positions or config.max_length)
    if max_length > config.max_length:
        raise InvalidArgument(f"max_length {max_length} is over the limit of {config.max_length}")
    if max_positions and requested.max_length > max_positions:
        raise InvalidArgument(f"max_length {max_length} is over this model's {max_positions} target positions")
    penalty = requested.length_penalty
    if not math.isfinite(penalty) or penalty < 0 or penalty > MAX_LENGTH_PENALTY:
        raise InvalidArgument(f"length_penalty {penalty} must be between 0 (the model's default) "
                              f"and {MAX_LENGTH_PENALTY}")
    if penalty == 0:
        penalty = float(defaults.get("length_penalty", 1.0))
    controls = resolve_controls(requested, beam, max_length, target_ids, unk_id)
    patience = _bounded("patience", requested.patience, 1.0, MAX_PATIENCE) or 1.0
    if requested.return_alternatives and controls.repetition_penalty != 1.0:
        raise InvalidArgument("return_alternatives does not combine with repetition_penalty: the forced pass that "
                              "finds the alternatives returns log-probabilities, not the logits the penalty scales")
    if requested.return_alternatives and controls.samples:
        raise InvalidArgument("return_alternatives returns the most likely next tokens; it excludes sampling "
                              "(sampling_topk > 1 or sampling_topp < 1)")
    return DecodingOptions(beam_size=beam, num_hypotheses=hypotheses, max_length=max_length,
                           length_penalty=penalty, return_attention=requested.return_attention,
                           controls=controls, patience=patience, return_alternatives=requested.return_alternatives)


def _bounded(name: str, value: float, low: float, high: float) -> float:
    """``value`` if it is 0 (off) or within [low, high]; else InvalidArgument."""
    if not math.isfinite(value) or (value != 0 and not low <= value <= high):
        raise InvalidArgument(f"{name} {value} must be 0 (off) or between {low} and {high}")
    return value


def resolve_controls(requested: RequestedOptions, beam: int, max_length: int,
                     target_ids: Callable[[str], list[int]], unk_id: int) -> Controls:
    """The decoding controls of a request, checked; ``target_ids`` tokenizes the suppressed sequences."""
    if requested.min_length >= max_length:
        raise InvalidArgument(f"min_length {requested.min_length} must be below max_length {max_length}")
    if requested.no_repeat_ngram_size > max_length:
        raise InvalidArgument(f"no_repeat_ngram_size {requested.no_repeat_ngram_size} is over max_length "
                              f"{max_length}")
    repetition = _bounded("repetition_penalty", requested.repetition_penalty, 1.0, MAX_REPETITION_PENALTY)
    topp = _bounded("sampling_topp", requested.sampling_topp, 1e-6, 1.0)
    temperature = _bounded("sampling_temperature", requested.sampling_temperature, 1e-3, MAX_TEMPERATURE)
    samples = requested.sampling_topk > 1 or 0 < topp < 1
    if samples and beam > 1:
        raise InvalidArgument(f"sampling (sampling_topk > 1 or sampling_topp < 1) needs beam_size 1, not {beam}")
    if len(requested.suppress_sequences) > MAX_SUPPRESS_SEQUENCES:
        raise InvalidArgument(f"too many suppress_sequences: {len(requested.suppress_sequences)}, the limit is "
                              f"{MAX_SUPPRESS_SEQUENCES}")
    suppress = []
    for i, text in enumerate(requested.suppress_sequences):
        ids = target_ids(text)
        if not ids:
            raise InvalidArgument(f"suppress_sequences[{i}] has no tokens")
        suppress.append(tuple(ids))
    if requested.disable_unk:
        suppress.append((unk_id,))
    return Controls(
        min_length=requested.min_length, repetition_penalty=repetition or 1.0,
        no_repeat_ngram_size=requested.no_repeat_ngram_size, suppress=tuple(suppress),
        sampling_topk=(requested.sampling_topk if requested.sampling_topk > 1 else 0) if samples else 1,
        sampling_topp=topp or 1.0, sampling_temperature=temperature or 1.0, seed=requested.sampling_seed,
    )


def tokenize_texts(texts: Sequence[str], tokenize: Callable[[str], list[int]], max_tokens: int,
                   names: Sequence[str] = ()) -> list[list[int]]:
    """Subword ids of each text (EOS excluded); a text with no tokens or more than ``max_tokens`` is refused
    (``names``: what the messages call each text, by default ``texts[i]``)."""
    ids = [tokenize(text) for text in texts]
    for i, sentence in enumerate(ids):
        name = names[i] if names else f"texts[{i}]"
        if len(sentence) > max_tokens:
            raise InvalidArgument(f"{name} has {len(sentence)} tokens, the limit is {max_tokens}")
        if not sentence:
            raise InvalidArgument(f"{name} has no tokens")
    return ids


def longest_output(source_tokens: int, options: DecodingOptions, prefix_steps: int = 0) -> int:
    """The longest output the search allows a sentence (EOS included): :func:`max_target_length`, or more
    for a target prefix of ``prefix_steps`` steps (its pieces and the partial word it ends with)."""
    return max(max_target_length(source_tokens, options.max_length), prefix_steps + 1)


def sentence_work(source_tokens: int, options: DecodingOptions, prefix_steps: int = 0) -> int:
    """Decoder work a sentence may take, in row-steps: ``beam_size`` x its longest allowed output
    (:func:`longest_output`, the rule the search applies, so this bounds the decoder steps of every beam
    row); with alternatives, ``num_hypotheses`` times that (each is a search of its own) and the next-word
    search before them, :data:`server.completion.WIDTH` x ``num_hypotheses`` rows wide. ``source_tokens``
    includes EOS."""
    rows = options.num_hypotheses * (options.beam_size + WIDTH) if options.return_alternatives else options.beam_size
    return rows * longest_output(source_tokens, options, prefix_steps)


def response_bytes_bound(text: str, source_tokens: int, options: DecodingOptions, piece_bytes: int,
                         prefix_steps: int = 0) -> int:
    """An upper bound on the serialized size of one text's ``Translation`` in a ``TranslateResponse``.

    With ``T`` the longest allowed output, ``P`` the most bytes one target id adds (``piece_bytes``)
    and ``S`` the source words: every hypothesis has at most ``T`` subword pieces and words, so text,
    words and pieces take at most ``T x P`` bytes each plus their field headers; scores ``4 T``;
    attention ``4 T S`` weights and ``T`` word alignments; the source's words their text and four
    headers each, its ``source_tokens`` pieces at most ``P`` bytes each. Field headers are counted at their largest
    (1-byte tags, 5-byte lengths) and scores are always included, so the bound holds for any output
    of the search and any ``return_scores``.
    """
    longest = longest_output(source_tokens, options, prefix_steps)
    words = len(text.split())
    header = 6  # tag + length of a length-delimited field
    hypothesis = header + 3 * header  # the message, its text and its two repeated string fields' packing slack
    hypothesis += longest * piece_bytes  # text
    hypothesis += 2 * longest * (header + piece_bytes)  # words and subword pieces
    hypothesis += 5 + header + 4 * longest  # score, packed token scores
    if options.return_attention:
        hypothesis += header + 12  # the message, target and source lengths
        hypothesis += header + 4 * longest * words  # packed weights
        hypothesis += longest * (2 + 2 * 6)  # word alignments: header + two varints
        hypothesis += header + longest * (2 * 5 + 2)  # pharaoh "s-t " pairs
    source = len(text.encode("utf-8")) + words * 4 * header  # source words: message, text, start, end
    source += source_tokens * (header + piece_bytes)  # source pieces
    return header + source + options.num_hypotheses * hypothesis


def check_budget(texts: Sequence[str], sources: Sequence[Sequence[int]], options: DecodingOptions, *,
                 piece_bytes: int, max_work: int, max_response_bytes: int,
                 prefix_steps: Sequence[int] = (), where: str = "text", beams: Sequence[int] = ()) -> list[int]:
    """Refuse a request whose decoder work or response size could exceed the limits, or whose min_length no
    translation of a text could meet, before any compute; return each sentence's work (:func:`sentence_work`;
    ``prefix_steps``: each text's target prefix steps, which may go past the usual output limit; ``beams``:
    each text's beam where it differs from the options', as a sentence with glossary terms searches)."""
    steps = list(prefix_steps) or [0] * len(sources)
    widths = list(beams) or [options.beam_size] * len(sources)
    for i, (ids, n) in enumerate(zip(sources, steps, strict=True)):
        longest = longest_output(len(ids) + 1, options, n)
        if options.controls.min_length >= longest:
            raise InvalidArgument(
                f"min_length {options.controls.min_length} cannot be met for {where} {i}: its translation may have at "
                f"most {longest - 1} pieces before the end of sentence (twice its {len(ids) + 1} source tokens + 10, "
                f"and at most max_length); lower min_length")
    work = [sentence_work(len(ids) + 1, replace(options, beam_size=b), n)
            for ids, n, b in zip(sources, steps, widths, strict=True)]
    if sum(work) > max_work:
        raise InvalidArgument(
            f"request too large: up to {sum(work)} decoder row-steps (beam_size x longest allowed output, summed "
            f"over texts), the limit is {max_work} (max_request_work); send fewer or shorter texts, a smaller "
            "beam_size or a smaller max_length")
    size = 64 + sum(response_bytes_bound(text, len(ids) + 1, options, piece_bytes, n)
                    for text, ids, n in zip(texts, sources, steps, strict=True))
    if size > max_response_bytes:
        raise InvalidArgument(
            f"response could reach {size} bytes, the limit is {max_response_bytes} (max_response_bytes); send "
            "fewer texts, ask for fewer hypotheses or a smaller max_length, or leave out attention")
    return work


def target_prefixes(texts: Sequence[str], prefixes: Sequence[str], tokenize: Callable[..., TargetPrefix],
                    max_length: int, *, end_id: int | None = None) -> list[TargetPrefix]:
    """Each text's target prefix tokenized by ``tokenize`` (:meth:`server.engine.engine.Engine.target_prefix`), or []
    when the request has none; InvalidArgument unless there is one prefix per text, each shorter than
    ``max_length`` pieces. Scoring (``end_id``, the end-of-sentence id): the prefixes are whole
    translations, required, tokenized as they are and ended by it."""
    field = "targets" if end_id is not None else "target_prefixes"
    if not prefixes and end_id is None:
        return []
    if len(prefixes) != len(texts):
        allowed = "one per text" if end_id is not None else "none or one per text (\"\" for a text without a prefix)"
        raise InvalidArgument(f"{field} has {len(prefixes)} entries for {len(texts)} texts: give {allowed}")
    tokenized = [tokenize(prefix, whole=end_id is not None) if prefix else TargetPrefix() for prefix in prefixes]
    for i, target in enumerate(tokenized):
        if end_id is not None:
            if not target.ids:
                raise InvalidArgument(f"targets[{i}] is empty: give the translation to score")
            tokenized[i] = target = TargetPrefix((*target.ids, end_id))
        if target.steps() >= max_length:
            raise InvalidArgument(f"{field}[{i}] has {target.steps()} pieces; max_length is {max_length}")
    return tokenized
