"""Reference greedy and beam search in PyTorch: the oracle the ONNX engine must reproduce.

Clarity over speed: one sentence at a time, beams as the batch. The length and scoring rules are
those of :mod:`common.model_format.decoding`, shared with the serving engine (:mod:`server.engine.step_model`).
Beam search keeps the best ``beam_size`` finished hypotheses and stops once it has that many and
the best live beam, scored as if it ended now, is no better than the worst of them (or when no live
beam is left). A forced target prefix takes its tokens first, each reported with its model
log-probability but, as in CTranslate2, not added to the hypothesis score (the length it is divided by
still counts them); the serving engine's target prefixes and alternatives are tested against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.model_format.decoding import max_target_length, normalized_score
from training.models.interface import DecoderState, Seq2SeqModel

# step(previous tokens [k], state) -> (log-probabilities [k, V], attention [k, S] or None, new state)
StepFn = Callable[[Tensor, DecoderState], tuple[Tensor, Tensor | None, DecoderState]]


@dataclass
class ScoredSequence:
    """A finished output of the search (the serving engine's :class:`server.engine.step_model.ScoredSequence` twin)."""

    tokens: list[int]  # generated ids, ending with EOS
    score: float  # length-normalised
    token_scores: list[float] = field(default_factory=list)
    attention: Tensor | None = None  # [len(tokens), S]


def beam_search(
    step: StepFn,
    state: DecoderState,
    *,
    start_id: int,
    eos_id: int,
    beam_size: int,
    num_hypotheses: int,
    max_length: int,
    length_penalty: float = 1.0,
    forced: Sequence[int] = (),
) -> list[ScoredSequence]:
    """Beam search for one sentence; ``state`` has batch 1 and is expanded to the live beams; the first
    tokens are ``forced`` (a target prefix), whatever their probability.

    Each step scores every (beam, token) continuation by summed log-probability and walks the
    ``2 * beam_size`` best candidates in order: those ending in EOS join the finished list, the others
    become the next live beams until there are ``beam_size`` of them. Returns the best
    ``num_hypotheses`` finished hypotheses by normalised score (ties: first found).
    """
    if not 1 <= num_hypotheses <= beam_size:
        raise ValueError("need 1 <= num_hypotheses <= beam_size")
    tokens = torch.tensor([start_id])
    histories: list[list[int]] = [[]]
    token_scores: list[list[float]] = [[]]
    attentions: list[list[Tensor]] = [[]]
    totals = torch.zeros(1, dtype=torch.float64)
    finished: list[ScoredSequence] = []
    for t in range(max_length):
        log_probs, attention, state = step(tokens, state)
        log_probs = log_probs.double()
        added = log_probs  # what each continuation adds to the score
        if t < len(forced):  # the prefix: only its token, reported with its log-probability, adding nothing
            only = torch.full_like(log_probs, float("-inf"))
            only[:, forced[t]] = log_probs[:, forced[t]]
            log_probs = only
            added = torch.where(only > float("-inf"), 0.0, only)
        if t == max_length - 1:  # out of room: only EOS may follow
            forced = torch.full_like(log_probs, float("-inf"))
            forced[:, eos_id] = log_probs[:, eos_id]
            log_probs = added = forced
        vocab = log_probs.shape[1]
        candidates = (totals[:, None] + added).view(-1)
        top_scores, top_index = candidates.topk(min(2 * beam_size, candidates.numel()))
        keep: list[tuple[int, int, float]] = []
        for total, index in zip(top_scores.tolist(), top_index.tolist(), strict=True):
            if total == float("-inf"):
                break
            beam, token = divmod(index, vocab)
            token_score = log_probs[beam, token].item()
            if token == eos_id:
                rows = attentions[beam] + ([attention[beam]] if attention is not None else [])
                finished.append(
                    ScoredSequence(
                        tokens=histories[beam] + [token],
                        score=normalized_score(total, t + 1, length_penalty),
                        token_scores=token_scores[beam] + [token_score],
                        attention=torch.stack(rows) if rows else None,
                    )
                )
            else:
                keep.append((beam, token, total))
            if len(keep) == beam_size:
                break
        finished.sort(key=lambda hyp: hyp.score, reverse=True)  # stable: ties keep discovery order
        del finished[beam_size:]
        if not keep or (
            len(finished) == beam_size and normalized_score(keep[0][2], t + 1, length_penalty) <= finished[-1].score
        ):
            break
        index = torch.tensor([beam for beam, _, _ in keep])
        state = Seq2SeqModel.reorder_state(state, index)
        histories = [histories[beam] + [token] for beam, token, _ in keep]
        token_scores = [token_scores[beam] + [log_probs[beam, token].item()] for beam, token, _ in keep]
        if attention is not None:
            attentions = [attentions[beam] + [attention[beam]] for beam, _, _ in keep]
        else:
            attentions = [[] for _ in keep]
        totals = torch.tensor([total for _, _, total in keep], dtype=torch.float64)
        tokens = torch.tensor([token for _, token, _ in keep])
    return finished[:num_hypotheses]


def model_step(model: Seq2SeqModel, need_attention: bool) -> StepFn:
    """Adapt a model's ``decode_step`` (logits) to the search's log-probability contract."""

    def step(tokens: Tensor, state: DecoderState) -> tuple[Tensor, Tensor | None, DecoderState]:
        logits, attention, state = model.decode_step(tokens, state, need_attention)
        return logits.float().log_softmax(-1), attention, state

    return step


@torch.no_grad()
def translate_ids(
    model: Seq2SeqModel,
    source_ids: list[int],
    *,
    beam_size: int = 1,
    num_hypotheses: int = 1,
    max_length: int = 256,
    length_penalty: float = 1.0,
    need_attention: bool = False,
    forced: Sequence[int] = (),
) -> list[ScoredSequence]:
    """Decode one source sentence (ids ending with EOS); beam 1 is greedy search; ``forced``: the first
    target tokens (the output is at least one longer)."""
    model.eval()
    cfg = model.config
    state = model.init_state(model.encode(torch.tensor([source_ids])))
    return beam_search(
        model_step(model, need_attention),
        state,
        start_id=cfg.decoder_start_id,
        eos_id=cfg.eos_id,
        beam_size=beam_size,
        num_hypotheses=num_hypotheses,
        max_length=max(max_target_length(len(source_ids), max_length), len(forced) + 1),
        length_penalty=length_penalty,
        forced=forced,
    )


@torch.no_grad()
def greedy_batch(model: Seq2SeqModel, src: Tensor, max_length: int) -> list[list[int]]:
    """Batched greedy decoding for validation: ``src`` [B, S] -> token lists (EOS stripped).

    Same length rule as :func:`beam_search`: at most ``max_length`` tokens, the last one EOS."""
    model.eval()
    cfg = model.config
    state = model.init_state(model.encode(src))
    tokens = torch.full((src.shape[0],), cfg.decoder_start_id, dtype=torch.long)
    outputs = torch.zeros(src.shape[0], 0, dtype=torch.long)
    done = torch.zeros(src.shape[0], dtype=torch.bool)
    for t in range(max_length):
        logits, _, state = model.decode_step(tokens, state)
        tokens = logits.argmax(-1) if t < max_length - 1 else torch.full_like(tokens, cfg.eos_id)
        tokens = tokens.masked_fill(done, cfg.pad_id)
        outputs = torch.cat([outputs, tokens[:, None]], 1)
        done |= tokens == cfg.eos_id
        if bool(done.all()):
            break
    result = []
    for row in outputs.tolist():
        result.append(row[: row.index(cfg.eos_id)] if cfg.eos_id in row else row)
    return result
