"""Lexically constrained beam search (server.engine.constraints) on a hand-written bigram table: exact hypotheses
and scores, checked against brute-force enumeration of every sequence."""

import itertools
import math

import numpy as np
import pytest

from server.controls import Controls
from server.engine.constraints import Terms
from server.engine.decode import RunningDecode, beam_search
from server.engine.step_model import BeamSentence, Capabilities, StepOutput, take_rows

BOS, EOS, A, B, C, D = range(6)
VOCAB = 6
# p(next | previous); D is possible only from the fourth position on (it takes 0.1 of EOS's mass there)
BIGRAM = {BOS: {A: 0.4, B: 0.2, C: 0.2, EOS: 0.2}, A: {B: 0.5, A: 0.1, C: 0.1, EOS: 0.3},
          B: {C: 0.3, B: 0.1, A: 0.1, EOS: 0.5}, C: {EOS: 0.6, A: 0.2, B: 0.1, C: 0.1},
          D: {EOS: 0.7, A: 0.1, B: 0.1, C: 0.1}}


def distribution(prefix: tuple[int, ...]) -> dict[int, float]:
    table = dict(BIGRAM[prefix[-1] if prefix else BOS])
    if len(prefix) >= 3:
        table[EOS] -= 0.1
        table[D] = 0.1
    return table


class BigramModel:
    """A StepModel over :func:`distribution` (or ``table``); the state is each row's prefix; rows may be at
    different steps."""

    static_names: list[str] = []
    state_names = ["prefix"]
    static_src_axes: dict[str, int] = {}
    capabilities = Capabilities(per_row_positions=True)

    def __init__(self, table=None) -> None:
        self.table = table or distribution

    def step(self, tokens, static, state, need_attention, k, full=False, positions=None, logits=False):
        prefixes = [tuple(t for t in row if t >= 0) for row in state["prefix"].tolist()]
        prefixes = [p + (int(t),) if t != BOS else p for p, t in zip(prefixes, tokens, strict=True)]
        width = max(map(len, prefixes), default=0)
        padded = np.full((len(prefixes), width), -1, dtype=np.int64)
        for r, p in enumerate(prefixes):
            padded[r, : len(p)] = p
        log_probs = np.full((len(prefixes), VOCAB), -np.inf)
        for r, p in enumerate(prefixes):
            for token, prob in self.table(p).items():
                log_probs[r, token] = math.log(prob)
        ids = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
        attention = np.full((len(prefixes), 2), 0.5, dtype=np.float32) if need_attention else None
        return StepOutput(ids, np.take_along_axis(log_probs, ids, 1), log_probs[:, EOS].copy(), attention,
                          {"prefix": padded}, log_probs if full else None, log_probs if logits else None)

    def release(self):
        pass  # holds nothing between decodes

    def select_rows(self, tensors, rows, in_place=False):
        return take_rows(tensors, rows)

    def concat_rows(self, first, second):
        joined = {}
        for name in first:
            width = max(first[name].shape[1], second[name].shape[1])
            joined[name] = np.concatenate([np.pad(x[name], ((0, 0), (0, width - x[name].shape[1])), constant_values=-1)
                                           for x in (first, second)])
        return joined


def search(constraints=(), beam=3, n=1, max_length=10, length_penalty=0.0, table=None, joiners=frozenset(),
           **controls):
    spec = BeamSentence(source_length=2, num_hypotheses=n, max_length=max_length, length_penalty=length_penalty,
                        beam_size=beam, controls=Controls(constraints=tuple(constraints), **controls))
    [result] = beam_search(BigramModel(table), {"prefix": np.zeros((1, 0), dtype=np.int64)}, [spec], start_id=BOS,
                           eos_id=EOS, joiners=joiners)
    return result


def score(tokens: list[int]) -> float:
    """The summed log-probability of ``tokens`` (EOS included) under the table."""
    return sum(math.log(distribution(tuple(tokens[:i])).get(t, 0.0) or 1e-300) for i, t in enumerate(tokens))


def assert_the_best_of_all(best, constraints) -> None:
    """``best`` is the best sequence of at most 8 tokens that holds ``constraints``, with its score."""
    tokens, score = brute_force_best(constraints, 8)
    assert best.tokens == tokens
    assert best.score == pytest.approx(score)


def brute_force_best(constraints, limit: int) -> tuple[list[int], float]:
    """The best sequence ending in EOS within ``limit`` tokens that contains every constraint (greedy counting)."""
    terms = Terms(constraints)
    best, best_score = None, -math.inf
    for length in range(limit):
        for body in itertools.product((A, B, C, D), repeat=length):
            tokens = [*body, EOS]
            total = score(tokens)
            if total > best_score and terms.done(terms.follow(body)):
                best, best_score = tokens, total
    return best, best_score


def non_overlapping(tokens: list[int], run: tuple[int, ...]) -> int:
    count, i = 0, 0
    while i + len(run) <= len(tokens):
        if tuple(tokens[i: i + len(run)]) == run:
            count, i = count + 1, i + len(run)
        else:
            i += 1
    return count


def test_without_constraints_the_best_is_the_empty_output():
    result = search()
    assert result.hypotheses[0].tokens == [EOS]
    assert result.hypotheses[0].score == pytest.approx(math.log(0.2))


def test_one_constraint_exact_hypothesis_and_score():
    result = search([(C,)])
    [best] = result.hypotheses
    # [C, EOS] = 0.2 x 0.6 = 0.12 beats [A, C, EOS] = 0.4 x 0.1 x 0.6 and [B, C, EOS] = 0.2 x 0.3 x 0.6
    assert best.tokens == [C, EOS]
    assert best.score == pytest.approx(math.log(0.2) + math.log(0.6))
    assert best.token_scores == pytest.approx([math.log(0.2), math.log(0.6)])
    assert best.terms_met
    assert_the_best_of_all(best, [(C,)])


def test_a_multi_token_constraint_and_n_best_all_contain_it():
    result = search([(B, C)], beam=4, n=3)
    assert [h.tokens for h in result.hypotheses[:2]] == [[B, C, EOS], [A, B, C, EOS]]
    assert result.hypotheses[0].score == pytest.approx(math.log(0.2 * 0.3 * 0.6))
    assert result.hypotheses[1].score == pytest.approx(math.log(0.4 * 0.5 * 0.3 * 0.5))
    assert result.hypotheses[2].score == pytest.approx(math.log(0.003))  # a tie of several, e.g. "C B C"
    assert all(non_overlapping(h.tokens, (B, C)) for h in result.hypotheses)


def test_two_overlapping_constraints_each_get_their_own_tokens():
    """"A B" and "B C" share B: "A B C" holds both only by counting B twice, so each needs its own."""
    result = search([(A, B), (B, C)], beam=4)
    [best] = result.hypotheses
    assert best.tokens == [A, B, B, C, EOS]  # 0.4 x 0.5 x 0.1 x 0.3 x 0.5 beats "B C A B" (0.2 x 0.3 x 0.2 x 0.5 x 0.4)
    assert best.score == pytest.approx(math.log(0.4 * 0.5 * 0.1 * 0.3 * 0.5))
    assert_the_best_of_all(best, [(A, B), (B, C)])


def test_a_term_and_its_own_prefix_and_a_repeated_term():
    result = search([(A,), (A, B)], beam=4)
    assert result.hypotheses[0].tokens == [A, A, B, EOS]  # "A" then "A B": A's tokens count once
    result = search([(C,), (C,)], beam=4)  # two occurrences: two Cs
    assert result.hypotheses[0].tokens == [C, C, EOS]
    assert result.hypotheses[0].score == pytest.approx(math.log(0.2 * 0.1 * 0.6))


def test_a_constraint_that_can_only_be_met_late():
    """D has probability only from the fourth position: the search keeps hypotheses alive until then."""
    result = search([(D,)], beam=3)
    [best] = result.hypotheses
    assert best.tokens[3] == D and best.tokens[-1] == EOS
    assert_the_best_of_all(best, [(D,)])
    assert best.tokens == [A, B, C, D, EOS]
    assert best.score == pytest.approx(math.log(0.4 * 0.5 * 0.3 * 0.1 * 0.6))


def test_a_constraint_that_cannot_fit_the_output_limit_returns_the_best_hypothesis_flagged():
    """max_length 3: two tokens and EOS, and D needs three before it. Nothing can meet the term: the result is
    the best hypothesis that ends at the limit, with terms_met False."""
    result = search([(D,)], beam=3, max_length=3)
    [best] = result.hypotheses
    assert not best.terms_met
    assert best.tokens == [A, B, EOS]
    assert best.score == pytest.approx(math.log(0.4 * 0.5 * 0.5))


def rare_term(prefix: tuple[int, ...]) -> dict[int, float]:
    """C is a word the model hardly writes (0.01 anywhere) and after which it ends (0.9)."""
    return {EOS: 0.9, A: 0.05, B: 0.05} if prefix and prefix[-1] == C else {A: 0.3, B: 0.3, D: 0.2, EOS: 0.19,
                                                                                C: 0.01}


def test_a_hypothesis_that_met_its_term_ends_where_the_model_ends_it():
    """[C, EOS] (0.01 x 0.9) is the best sequence that holds C. After C its EOS ranks below the six continuations
    of the two hypotheses still without C (each above 0.3 x 0.2): it must still end there, among the hypotheses
    that met the term, not write on."""
    result = search([(C,)], beam=3, table=rare_term)
    best = result.hypotheses[0]
    assert best.tokens == [C, EOS]
    assert best.score == pytest.approx(math.log(0.01 * 0.9))
    assert best.terms_met


def glued(prefix: tuple[int, ...]) -> dict[int, float]:
    """After B the model would rather go on with C (a piece that continues the word before it) than end."""
    return {BOS: {A: 0.5, C: 0.1, EOS: 0.4}, A: {B: 0.5, C: 0.2, EOS: 0.3}, B: {C: 0.6, EOS: 0.3, A: 0.1},
            C: {EOS: 0.9, A: 0.1}}[prefix[-1] if prefix else BOS]


def test_a_term_stays_a_word_of_its_own():
    """The term [A, B] is a word; C continues the word before it. Without the rule the best holding the term is
    [A, B, C, EOS] (0.5 x 0.5 x 0.6 x 0.9), the term glued to C; with C a joiner it may not follow the term's last
    piece, and the best is [A, B, EOS] (0.5 x 0.5 x 0.3). A joiner that is a term's own piece stays allowed."""
    assert search([(A, B)], table=glued).hypotheses[0].tokens == [A, B, C, EOS]
    best = search([(A, B)], table=glued, joiners=frozenset({C})).hypotheses[0]
    assert best.tokens == [A, B, EOS]
    assert best.score == pytest.approx(math.log(0.5 * 0.5 * 0.3))
    assert search([(C,)], table=glued, joiners=frozenset({C})).hypotheses[0].tokens == [A, B, C, EOS]


def test_a_forced_prefix_counts_toward_the_terms():
    result = search([(B, C)], beam=3, forced=(A, B))
    assert result.hypotheses[0].tokens == [A, B, C, EOS]
    assert result.hypotheses[0].score == pytest.approx(math.log(0.3 * 0.5))  # the prefix adds nothing


def test_greedy_needs_a_beam():
    with pytest.raises(ValueError, match="beam_size 2"):
        search([(C,)], beam=1)


@pytest.mark.parametrize("seed", range(20))
def test_random_constraints_are_always_met_and_continuous_equals_static(seed):
    """Random terms over the table's tokens: every returned hypothesis holds them; a sentence joining a running
    decode later gets what it gets alone; one without terms is what it is in a decode without any."""
    rng = np.random.default_rng(seed)
    terms = [tuple(int(t) for t in rng.choice([A, B, C], size=rng.integers(1, 3))) for _ in range(rng.integers(1, 3))]
    beam = int(rng.integers(2, 5))
    alone = search(terms, beam=beam, n=2)
    for h in alone.hypotheses:
        assert Terms(terms).done(Terms(terms).follow(h.tokens[:-1])), (terms, h.tokens)
        assert h.terms_met
    plain = search([], beam=beam, n=2)

    decode = RunningDecode(BigramModel(), start_id=BOS, eos_id=EOS)
    encoded = {"prefix": np.zeros((1, 0), dtype=np.int64)}
    spec = BeamSentence(source_length=2, num_hypotheses=2, max_length=10, length_penalty=0.0, beam_size=beam)
    decode.admit(encoded, [spec], ["plain"])
    results = dict(decode.step())
    decode.admit(encoded, [BeamSentence(source_length=2, num_hypotheses=2, max_length=10, length_penalty=0.0,
                                        beam_size=beam, controls=Controls(constraints=tuple(terms)))], ["terms"])
    while decode.rows:
        results.update(decode.step())
    assert [(h.tokens, h.score) for h in results["terms"].hypotheses] == \
        [(h.tokens, h.score) for h in alone.hypotheses]
    assert [(h.tokens, h.score) for h in results["plain"].hypotheses] == \
        [(h.tokens, h.score) for h in plain.hypotheses]


# ---- on the exported tiny models ---------------------------------------------------------------------

def test_random_terms_on_the_tiny_models_are_met_and_the_rest_untouched(tiny_models):
    """Random sentences of the tiny corpus with random terms from the target vocabulary: every hypothesis holds
    each term (once per occurrence); the sentences without terms are bit for bit what they are in the same batch
    without any; in a running decode that sentences join one by one, every sentence gets the static result."""
    from server.engine.engine import Engine
    from server.types import DecodingOptions, SentenceRequest
    from tests.conftest import number_pairs
    from tests.test_continuous import run_continuous

    rng = np.random.default_rng(7)
    pairs = number_pairs(40, seed=3)
    for arch, path in sorted(tiny_models.items()):
        engine = Engine.load(path, provider="cpu", intra_op_threads=1)
        words = sorted({w for _, target in pairs for w in target.split()})
        requests, plain = [], []
        for i, (source, _) in enumerate(pairs[:12]):
            beam = int(rng.integers(2, 5))
            options = DecodingOptions(beam_size=beam, num_hypotheses=2, max_length=32, return_attention=True)
            plain.append(SentenceRequest(engine.tokenize(source), options, text=source))
            if i % 2:
                terms = tuple(tuple(engine.tokenizer.encode_target(str(rng.choice(words))))
                              for _ in range(int(rng.integers(1, 3))))
                spans = tuple((0, len(plain[-1].source_ids)) for _ in terms)
                options = DecodingOptions(beam_size=beam, num_hypotheses=2, max_length=32, return_attention=True,
                                          controls=Controls(constraints=terms, constraint_sources=spans))
            requests.append(SentenceRequest(engine.tokenize(source), options, text=source))
        static = engine.search(requests)
        alone = engine.search(plain)  # the same batch without terms
        for i, (r, result) in enumerate(zip(requests, static, strict=True)):
            if r.options.controls.constraints:
                terms = Terms(r.options.controls.constraints)
                for h in result.hypotheses:
                    assert h.terms_met and terms.done(terms.follow(h.tokens[:-1])), (arch, i, h.tokens)
                    assert h.attention is not None and h.attention.shape[0] == len(h.tokens)
            else:
                assert [(h.tokens, h.score) for h in result.hypotheses] == \
                    [(h.tokens, h.score) for h in alone[i].hypotheses], (arch, i)
        if engine.model.capabilities.per_row_positions:
            joined, _, _ = run_continuous(engine, [(3 * i, r) for i, r in enumerate(requests)])
            for i, (a, b) in enumerate(zip(joined, static, strict=True)):
                assert [h.tokens for h in a.hypotheses] == [h.tokens for h in b.hypotheses], (arch, i)
                assert [h.score for h in a.hypotheses] == pytest.approx([h.score for h in b.hypotheses], abs=1e-5)


def test_the_glossary_benchmark_prints_its_tables_with_every_term_held(dates_models, capsys):
    """``nmt bench glossary``'s tables on a few sentences of the session's dates Transformer: every row holds
    all its terms, and BLEU with the month glossary is no lower than without."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import glossary as bench

    from server.engine.engine import Engine

    engine = Engine.load(dates_models["transformer"], provider="cpu", intra_op_threads=1)
    bench.speed(engine, 6, 1, 3)
    bench.quality(engine, 40, 8)
    out = capsys.readouterr().out
    speed_rows = [line.split(" | ") for line in out.splitlines() if line[:4] in ("| 0 ", "| 1 ", "| 2 ", "| 3 ")]
    assert [row[0] for row in speed_rows] == ["| 0", "| 1", "| 2", "| 3"]
    assert all(row[-1] == "6/6 |" for row in speed_rows), out
    without, with_glossary = (line.split(" | ") for line in out.splitlines()
                              if line.startswith(("| without", "| month-name")))
    held, needed = with_glossary[3].rstrip(" |").split("/")
    assert held == needed and int(needed) > 0, out
    assert float(with_glossary[1]) >= float(without[1]), out
