"""Drafters: where the candidate tokens of a round come from. One protocol, four small classes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .model import Model
from .sampling import SamplingParams, choose, probs, sample


@dataclass(frozen=True, slots=True)
class Draft:
    """Proposed tokens and, for a stochastic drafter, the rows q they were sampled from.

    q is None for a deterministic draft: a point mass on each token (n-gram lookup, or a greedy draft model).
    """

    tokens: list[int]
    q: np.ndarray | None = None


EMPTY = Draft([])


class Drafter(Protocol):
    def propose(self, context: Sequence[int], n: int) -> Draft:
        """Up to n tokens likely to follow context (which ends with the token the target chose last)."""


class NoDrafter:
    """Plain decoding through the same loop: the baseline every speedup is measured against."""

    def propose(self, context: Sequence[int], n: int) -> Draft:
        return EMPTY


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n-gram, propose what followed.

    Tries n-gram sizes from n_max down to n_min; no model, so drafting costs microseconds.
    """

    def __init__(self, n_min: int = 2, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, context: Sequence[int], n: int) -> Draft:
        ctx = np.asarray(context, dtype=np.int64)
        for size in range(min(self.n_max, len(ctx) - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], size)
            hits = np.flatnonzero((windows == ctx[-size:]).all(axis=1))
            if hits.size:
                start = hits[-1] + size  # the latest match's continuation
                return Draft(ctx[start:start + n].tolist())
        return EMPTY


class ModelDrafter:
    """A small draft model with its own KV cache, advanced incrementally across rounds.

    Samples with the same SamplingParams as the target (greedy at temperature 0, where the draft is a point
    mass), and stops early when its top probability falls below p_min.
    """

    def __init__(self, model: Model, params: SamplingParams, rng: np.random.Generator, *,
                 p_min: float = 0.0, prompt_len: int = 0):
        self.model, self.params, self.rng, self.p_min, self.prompt_len = model, params, rng, p_min, prompt_len

    def propose(self, context: Sequence[int], n: int) -> Draft:
        m = self.model
        n = min(n, m.n_ctx - len(context))
        if n <= 0:
            return EMPTY
        row = m.sync(context, logits=True)[1][0]
        history = list(context[self.prompt_len:])
        tokens, qs = [], []
        for i in range(n):
            if self.params.greedy:
                tok = choose(row, self.params, history, self.rng)
                # top probability without a softmax of the whole row: 1 / sum(exp(l - l_max))
                if self.p_min > 0 and 1.0 / np.exp(row - row[tok]).sum() < self.p_min:
                    break
            else:
                q = probs(row, self.params, history)
                if q.max() < self.p_min:
                    break
                tok = sample(q, self.rng)
                qs.append(q)
            tokens.append(tok)
            history.append(tok)
            if i + 1 < n:  # the last draft token is never decoded here: the target verifies it
                row = m.decode([tok], logits="last")[0]
        return Draft(tokens, np.stack(qs) if qs else None)


class HybridDrafter:
    """N-gram lookup when the context repeats itself, else the draft model."""

    def __init__(self, ngram: NgramDrafter, model: ModelDrafter):
        self.ngram, self.model = ngram, model

    def propose(self, context: Sequence[int], n: int) -> Draft:
        d = self.ngram.propose(context, n)
        return d if d.tokens else self.model.propose(context, n)
