"""Logits -> probabilities, the same for target p and draft q (pure numpy).

The chain and its semantics follow llama-cpp-python's default sampler (llama.cpp src/llama-sampling.cpp):
penalties -> top_k -> top_p -> min_p -> temperature -> sample. Temperature 0 is greedy: argmax of the
penalized logits, the filters cannot change it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from localspec.errors import LocalspecError


class SamplingError(LocalspecError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """llama-cpp-python's sampling knobs and defaults; top_k<=0, top_p=1, min_p=0 disable their filter."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1] (0 disables it)"),
            ("repeat_penalty", self.repeat_penalty > 0, "> 0 (1 disables it)"),
            ("penalty_last_n", self.penalty_last_n >= 0, ">= 0 (0 disables penalties)"),
        )
        for name, ok, allowed in checks:
            if not ok:  # also catches NaN, which fails every comparison
                raise SamplingError(f"{name}={getattr(self, name)!r} is out of range: it must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.penalty_last_n > 0 and (
            self.repeat_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
        )


def penalize(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """Repeat/frequency/presence penalties over the last `penalty_last_n` tokens of `history`.

    Returns `logits` itself when nothing applies, else a penalized copy; the input is never written.
    """
    if not params.penalized or len(history) == 0:
        return logits
    window = np.asarray(history[-params.penalty_last_n :], dtype=np.int64)
    window = window[(window >= 0) & (window < logits.shape[-1])]  # llama.cpp ignores ids outside the vocab
    tokens, counts = np.unique(window, return_counts=True)
    out = np.array(logits, dtype=np.promote_types(logits.dtype, np.float32))
    z = out[tokens]
    # Dividing a negative logit would make the token more likely, hence the multiply (as llama.cpp).
    z = np.where(z > 0, z / params.repeat_penalty, z * params.repeat_penalty)
    out[tokens] = z - (counts * params.frequency_penalty + params.presence_penalty)
    return out


def probs(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The distribution the sampler draws from, for one 1-D row of logits.

    float64 of len V summing to 1, zero outside the kept set; one-hot at the penalized argmax at T=0.
    """
    z = penalize(logits, history, params)
    p = np.zeros(z.shape[-1], dtype=np.float64)
    if params.greedy:
        p[np.argmax(z)] = 1.0
        return p
    # ids: the vocab ids of the candidates x, or None while x is still the whole vocab (no index array).
    # w stays in the logits' dtype: float32 exp over 151,936 entries is ten times faster than float64.
    m = float(z.max())
    k = params.top_k
    ids, x = None, z
    if 0 < k < len(z):
        ids = _head(z, m, lambda mask: np.count_nonzero(mask) >= k)
        if len(ids) > k:
            ids = ids[np.argpartition(z[ids], -k)[-k:]]
        x = z[ids]
    w = np.exp(x - m)  # top_p's softmax is over every top_k candidate, at temperature 1
    total = w.sum(dtype=np.float64)
    # top_p and min_p each keep a prefix of the same descending order, so min_p may go first: only
    # the survivors of both get sorted.
    if params.min_p > 0:
        keep = np.flatnonzero(x >= m + np.log(params.min_p))  # prob >= min_p * max prob, as llama.cpp
        ids, x, w = (keep if ids is None else ids[keep]), x[keep], w[keep]
    if params.top_p < 1:
        head = _head(x, m, lambda mask: w[mask].sum(dtype=np.float64) >= params.top_p * total)
        ids, x, w = (head if ids is None else ids[head]), x[head], w[head]
        order = np.lexsort((ids, -x))  # descending logit, ties by lower id
        cum = np.cumsum(w[order], dtype=np.float64) / total
        n = int(np.searchsorted(cum, params.top_p)) + 1  # smallest prefix reaching top_p, at least 1
        ids, x = ids[order[:n]], x[order[:n]]
    e = np.exp((x - m) / params.temperature)  # the max logit survives every filter
    p[slice(None) if ids is None else ids] = e / e.sum(dtype=np.float64)
    return p


def _head(x: np.ndarray, m: float, enough) -> np.ndarray:
    """Indices of x >= m - gap for the first doubling gap where enough(mask) holds.

    A top-k set or nucleus is a prefix of the descending order, so it lies inside such a head; a few O(V)
    passes replace a 1 ms partition or a 20 ms sort of a 151,936-entry vocab.
    """
    for gap in 4.0 * 2.0 ** np.arange(12):
        mask = x >= m - gap
        if enough(mask):
            return np.flatnonzero(mask)
    return np.arange(len(x))  # a spread beyond 8192 nats (-inf or masked logits): take everything


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from `p` (need not sum to exactly 1); never returns an index where p is 0."""
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    if i >= len(p):  # u rounded up to the total
        i = int(np.flatnonzero(p)[-1])
    return i


def choose(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int], rng: np.random.Generator
) -> int:
    """The token this sampler picks: argmax of the penalized logits when greedy, else a draw from probs()."""
    if params.greedy:
        return int(np.argmax(penalize(logits, history, params)))
    return sample(probs(logits, params, history), rng)
