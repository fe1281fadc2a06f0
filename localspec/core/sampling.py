"""Logits -> the distribution a token is drawn from, the same for target p and draft q (pure numpy).

The chain and its semantics follow llama-cpp-python's default sampler (llama.cpp src/llama-sampling.cpp):
penalties -> top_k -> top_p -> min_p -> temperature -> sample. Temperature 0 is greedy: argmax of the
penalized logits, the filters cannot change it.

A distribution is sparse (`Dist`): after top-k a row has at most 40 live tokens, so (ids, probs) travel
through sampling and acceptance instead of a dense row over a 152k-token vocabulary. Its ids are token ids,
so target and draft rows of different vocabulary widths mix without padding.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from . import defaults
from .errors import LocalspecError


class SamplingError(LocalspecError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """llama-cpp-python's sampling knobs and defaults; top_k<=0, top_p=1, min_p=0 disable their filter."""

    temperature: float = defaults.SAMPLING["temperature"]
    top_k: int = defaults.SAMPLING["top_k"]
    top_p: float = defaults.SAMPLING["top_p"]
    min_p: float = defaults.SAMPLING["min_p"]
    repeat_penalty: float = defaults.SAMPLING["repeat_penalty"]
    frequency_penalty: float = defaults.SAMPLING["frequency_penalty"]
    presence_penalty: float = defaults.SAMPLING["presence_penalty"]
    penalty_last_n: int = defaults.SAMPLING["penalty_last_n"]

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral if f.type == "int" else numbers.Real):
                raise SamplingError(f"{f.name}={v!r} must be {'an integer' if f.type == 'int' else 'a number'}")
            if f.type == "float" and not -1e9 < v < 1e9:  # also NaN and infinities, and ints too big for a float
                raise SamplingError(f"{f.name}={v!r} is out of range: it must be a finite number between "
                                    "-1e9 and 1e9")
            if type(v) is not (int if f.type == "int" else float):  # numpy's numbers too, held as Python's
                object.__setattr__(self, f.name, int(v) if f.type == "int" else float(v))
        checks = (
            ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1] (0 disables it)"),
            # dividing a logit by a tiny penalty overflows float32 to inf (then NaN): no distribution is left
            ("repeat_penalty", 0.01 <= self.repeat_penalty <= 100, "in [0.01, 100] (1 disables it)"),
            ("penalty_last_n", self.penalty_last_n >= 0, ">= 0 (0 disables penalties)"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise SamplingError(f"{name}={getattr(self, name)!r} is out of range: it must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.penalty_last_n > 0 and (
            self.repeat_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
        )


@dataclass(frozen=True, slots=True)
class Dist:
    """A sparse distribution: token `ids` (ascending) and their probabilities `p` (all > 0, summing to 1)."""

    ids: np.ndarray
    p: np.ndarray

    @staticmethod
    def point(token: int) -> "Dist":
        return Dist(np.array([token], dtype=np.int64), np.ones(1))

    def prob(self, token: int) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.p[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def on(self, ids: np.ndarray) -> np.ndarray:
        """The probabilities of `ids` (ascending), 0 where this distribution has none."""
        i = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[i] == ids, self.p[i], 0.0)

    def sample(self, rng: np.random.Generator) -> int:
        """One draw, from the first uniform of `rng`: the same rng and the same Dist give the same token."""
        cum = np.cumsum(self.p)
        i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        return int(self.ids[min(i, len(self.ids) - 1)])  # u * total may round up to the total

    def dense(self, n_vocab: int) -> np.ndarray:
        """A dense float64 row (for tests and inspection)."""
        out = np.zeros(n_vocab)
        out[self.ids] = self.p
        return out


def residual(p: Dist, q: Dist) -> Dist | None:
    """norm(max(0, p - q)) over the union of both supports, or None where p <= q everywhere."""
    ids = np.union1d(p.ids, q.ids)
    r = np.maximum(p.on(ids) - q.on(ids), 0.0)
    keep = r > 0
    if not keep.any():
        return None
    return Dist(ids[keep], r[keep] / r[keep].sum())


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


def dist(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> Dist:
    """The distribution the sampler draws from, for one 1-D row of logits (a point mass at T=0)."""
    z = penalize(logits, history, params)
    if params.greedy:
        return Dist.point(int(np.argmax(z)))
    # ids: the vocab ids of the candidates x, or None while x is still the whole vocab (no index array).
    # w stays in the logits' dtype: float32 exp over 151,936 entries is ten times faster than float64.
    m = float(z.max())
    k = params.top_k
    ids, x = None, z
    if 0 < k < len(z):
        ids = _head(z, m, lambda mask: np.count_nonzero(mask) >= k)
        if len(ids) > k:
            ids = np.sort(ids[np.argpartition(z[ids], -k)[-k:]])
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
        kept = np.sort(order[:n])
        ids, x = ids[kept], x[kept]
    if ids is None:
        ids = np.arange(len(x))
    e = np.exp((x.astype(np.float64) - m) / params.temperature)  # the max logit survives every filter
    live = e > 0  # masked (-inf) logits have no probability
    if not live.any():  # NaN logits: nothing to draw from (an IndexError further on)
        raise SamplingError("no token has a probability: the model's logits are not finite")
    return Dist(ids[live].astype(np.int64), e[live] / e[live].sum())


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


def choose(logits: np.ndarray, params: SamplingParams, history: Sequence[int], rng: np.random.Generator) -> int:
    """The token this sampler picks: argmax of the penalized logits when greedy, else a draw from dist()."""
    if params.greedy:
        return int(np.argmax(penalize(logits, history, params)))
    return dist(logits, params, history).sample(rng)


def position_rng(seed: int, position: int, stream: int = 0) -> np.random.Generator:
    """The random stream of one output position: the same (seed, position) draws the same numbers, however
    many draws earlier positions used (which depends on what was drafted). stream 1 is the draft model's."""
    return np.random.default_rng([seed, position, stream])
