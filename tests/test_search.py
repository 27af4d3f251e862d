"""Reference beam search against hand-written step probabilities (exact hypotheses and scores)."""

import math

import pytest
import torch

from training.search import ScoredSequence, beam_search

PAD, BOS, EOS, A, B = 0, 2, 3, 4, 5
VOCAB = 6
# next-token probabilities given the generated prefix; unlisted tokens have probability 0
TABLE: dict[tuple[int, ...], dict[int, float]] = {
    (): {A: 0.6, B: 0.4},
    (A,): {A: 0.5, B: 0.4, EOS: 0.1},
    (B,): {EOS: 0.9, A: 0.05, B: 0.05},
    (A, A): {EOS: 1.0},
    (A, B): {EOS: 1.0},
    (B, A): {EOS: 1.0},
    (B, B): {EOS: 1.0},
}


def table_step(tokens: torch.Tensor, state: dict[str, torch.Tensor]):
    """Step function reading TABLE; the state carries each row's generated prefix."""
    prefix = state["prefix"]
    if prefix.shape[1] or tokens[0] != BOS:
        prefix = torch.cat([prefix, tokens[:, None]], 1)
    rows = []
    for row in prefix.tolist():
        probs = torch.zeros(VOCAB, dtype=torch.float64)
        for token, p in TABLE[tuple(row)].items():
            probs[token] = p
        rows.append(probs.log())
    attention = torch.full((len(rows), 2), 0.5)
    return torch.stack(rows), attention, {"prefix": prefix}


def search(beam: int, n: int, length_penalty: float, max_length: int = 10) -> list[ScoredSequence]:
    return beam_search(
        table_step, {"prefix": torch.zeros(1, 0, dtype=torch.long)}, start_id=BOS, eos_id=EOS,
        beam_size=beam, num_hypotheses=n, max_length=max_length, length_penalty=length_penalty,
    )


def test_beam_finds_better_hypothesis_than_greedy_without_length_penalty():
    hyps = search(beam=2, n=2, length_penalty=0.0)
    assert [h.tokens for h in hyps] == [[B, EOS], [A, A, EOS]]
    assert hyps[0].score == pytest.approx(math.log(0.4) + math.log(0.9))
    assert hyps[1].score == pytest.approx(math.log(0.6) + math.log(0.5))
    assert hyps[0].token_scores == pytest.approx([math.log(0.4), math.log(0.9)])
    assert hyps[1].token_scores == pytest.approx([math.log(0.6), math.log(0.5), 0.0])


def test_length_penalty_normalises_by_length():
    hyps = search(beam=2, n=2, length_penalty=1.0)
    # B EOS (-0.51) finishes first but is pushed out of the two best by the longer A A / A B
    assert [h.tokens for h in hyps] == [[A, A, EOS], [A, B, EOS]]
    assert hyps[0].score == pytest.approx((math.log(0.6) + math.log(0.5)) / 3)
    assert hyps[1].score == pytest.approx((math.log(0.6) + math.log(0.4)) / 3)


def test_beam_one_is_greedy():
    hyps = search(beam=1, n=1, length_penalty=0.0)
    assert [h.tokens for h in hyps] == [[A, A, EOS]]
    assert hyps[0].attention.shape == (3, 2)


def test_max_length_forces_eos():
    hyps = search(beam=1, n=1, length_penalty=0.0, max_length=2)
    # after "A" the only allowed continuation is EOS (p=0.1)
    assert hyps[0].tokens == [A, EOS]
    assert hyps[0].score == pytest.approx(math.log(0.6) + math.log(0.1))


def test_search_keeps_going_until_beam_size_hypotheses_finish():
    # "B EOS" finishes at step 2 and is the best, but the search only stops once two hypotheses
    # have finished; n=1 then returns the best of them
    hyps = search(beam=2, n=1, length_penalty=0.0)
    assert [h.tokens for h in hyps] == [[B, EOS]]


def test_num_hypotheses_cannot_exceed_beam():
    with pytest.raises(ValueError):
        search(beam=1, n=2, length_penalty=0.0)
