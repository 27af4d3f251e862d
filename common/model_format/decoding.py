"""Decoding rules every search implements: the PyTorch reference (:mod:`training.search`) and the
serving engine (:mod:`server.engine.step_model`) must agree on them to produce identical hypotheses.

* A hypothesis' score is its summed token log-probability over ``length ** length_penalty``, where
  ``length`` counts generated tokens including EOS (:func:`normalized_score`). The serving search's
  forced target prefix counts in ``length`` but not in the sum (it is given, as in CTranslate2).
* At most :func:`max_target_length` tokens are generated; at the last allowed step only EOS may follow.
"""

from __future__ import annotations


def max_target_length(source_length: int, max_length: int = 256, ratio: float = 2.0, extra: int = 10) -> int:
    """Longest allowed output (EOS included): ``min(max_length, ratio * source_length + extra)``."""
    return max(1, min(max_length, int(ratio * source_length + extra)))


def normalized_score(total: float, length: int, length_penalty: float) -> float:
    """Length-normalised score of a hypothesis of ``length`` tokens whose log-probabilities sum to ``total``."""
    return total / (length**length_penalty)
