"""The stable prefix of a sentence in a beam search: the tokens no later step can change.

A sentence's result is one of its finished hypotheses or a continuation of a live one, so the tokens that
every live hypothesis and every finished one share are the start of its result, whatever the next steps
decide. With one live hypothesis and none finished (greedy decoding, sampling) that is every token so far.
:meth:`server.engine.decode.RunningDecode._report_stable` reports it to streaming sentences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.types import ScoredSequence


def stable_length(live: np.ndarray, finished: Sequence[ScoredSequence]) -> int:
    """How many leading tokens ``live`` ([live hypotheses, tokens so far]) and ``finished`` all share."""
    length = live.shape[1]
    if live.shape[0] > 1:
        agree = (live == live[0]).all(axis=0)
        length = length if agree.all() else int(np.argmin(agree))
    for done in finished:
        n = min(length, len(done.tokens))
        same = np.asarray(done.tokens[:n]) == live[0, :n]
        length = n if same.all() else int(np.argmin(same))
    return length
