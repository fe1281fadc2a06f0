"""The match walk the n-gram lookups share (drafters.NgramDrafter, drafters.Prediction, history.SuffixCache): how
far back a corpus agrees with the context's end at each of some candidate places."""
from __future__ import annotations

import numpy as np


def longest_match(corpus: np.ndarray, ends: np.ndarray, tail: np.ndarray) -> tuple[np.ndarray, int]:
    """(the places among `ends` where the corpus agrees longest with `tail`, in their order; how long), where a
    place is the corpus position lined up with tail's last token and the agreement is measured backwards from
    it, at most len(tail) tokens and never before the corpus's start (nor across a -1 in it). (ends, 0) when
    ends is empty."""
    if not ends.size:
        return ends, 0
    back = ends[:, None] - np.arange(len(tail))[None, :]
    seen = np.where(back >= 0, corpus[np.maximum(back, 0)], -1)
    agree = np.cumprod(seen == tail[::-1][None, :], axis=1).sum(axis=1)
    size = int(agree.max())
    return ends[agree == size], size
