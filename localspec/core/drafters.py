"""Drafters: where the candidate tokens of a round come from. One protocol and small classes; auto, which
chooses among them each round, is in auto.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import numpy as np

from .match import longest_match
from .model import Model
from .sampling import Dist, SamplingParams, dist, penalize, position_rng


@dataclass(frozen=True, slots=True)
class Draft:
    """Proposed tokens and, for a stochastic drafter, the distributions q they were sampled from.

    q is None for a deterministic draft: a point mass on each token (n-gram lookup, or a greedy draft model).
    forced: how many leading tokens are what a grammar forces (counted apart in the stats).
    """

    tokens: list[int]
    q: list[Dist] | None = None
    forced: int = 0
    predicted: int = 0  # how many tokens after the forced ones come from the request's prediction
    plan: Plan | None = None  # auto: what it chose and expected of the round


@dataclass(frozen=True, slots=True)
class Plan:
    """Why auto drafted what it did, to set beside what the round then gave (a trace, not a decision input):
    the candidate it chose ('none' for plain decoding, 'ngram', 'model', 'forced', 'prediction'), the tokens
    it expected the round to emit, and the seconds it expected the round to take on this machine (verify,
    drafting, catching the draft model up)."""

    source: str
    tokens: float
    seconds: float


EMPTY = Draft([])


class Drafter(Protocol):
    def propose(self, context: Sequence[int], n: int) -> Draft:
        """Up to n tokens likely to follow context (which ends with the token the target chose last)."""


class NoDrafter:
    """Plain decoding through the same loop: the baseline every speedup is measured against."""

    def propose(self, context: Sequence[int], n: int) -> Draft:
        return EMPTY


class Prediction:
    """The text a request expects back (Predicted Outputs), as a lookup corpus of its own.

    Where the output so far ends with tokens that occur in the prediction, the draft is what follows them
    there; among equally long matches the one nearest after the last is taken, so the lookup stays aligned
    through a prediction that repeats itself. Before any output, the draft is the prediction's start.
    """

    def __init__(self, tokens: Sequence[int], prompt_len: int, n_max: int = 8):
        self.tokens, self.prompt_len, self.n_max = np.asarray(tokens, dtype=np.int32), prompt_len, n_max
        self.cursor = 0  # where the last continuation was taken from

    def lookup(self, context: Sequence[int], n: int) -> tuple[int, list[int]]:
        """(size of the match, up to n tokens of the prediction that follow it), or (0, [])."""
        pred = self.tokens
        if len(context) <= self.prompt_len:  # nothing generated yet: the prediction from its start
            self.cursor = 0
            return self.n_max, pred[:n].tolist()
        tail = np.asarray(context[-self.n_max:], dtype=np.int32)
        # prediction positions holding the last output token, and of those the ones matching furthest back
        ends, size = longest_match(pred, np.flatnonzero(pred == tail[-1]), tail)
        if not ends.size:
            return 0, []
        after = ends[ends + 1 >= self.cursor]
        end = int(after[0] if after.size else ends[-1])
        self.cursor = end + 1
        return size, pred[end + 1:end + 1 + n].tolist()


class Match(NamedTuple):
    """An n-gram lookup's answer: the size of the match, the tokens that followed its latest occurrence,
    whether other occurrences were followed by another token (the context disagrees with itself), and where
    the tokens start in the context."""
    size: int
    tokens: list[int]
    split: bool
    at: int


NO_MATCH = Match(0, [], False, 0)


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n-gram, propose what followed.

    Tries n-gram sizes from n_max down to n_min; no model, so drafting costs microseconds. With a request's
    prediction, that is searched first.
    """

    def __init__(self, n_min: int = 2, n_max: int = 4, prediction: Prediction | None = None):
        self.n_min, self.n_max, self.prediction = n_min, n_max, prediction

    def lookup(self, context: Sequence[int], n: int) -> Match:
        """The longest n-gram match and up to n tokens that followed it, or NO_MATCH."""
        ctx = np.asarray(context, dtype=np.int32)
        last = len(ctx) - 1
        # earlier positions holding the last token, and of those the ones matching furthest back (n_max at most)
        ends, size = longest_match(ctx, np.flatnonzero(ctx[:last] == ctx[last]), ctx[-self.n_max:])
        if not ends.size or size < self.n_min:
            return NO_MATCH
        start = ends[-1] + 1  # the latest of the longest matches
        following = ctx[ends + 1]
        return Match(size, ctx[start:start + n].tolist(), bool((following != following[-1]).any()), int(start))

    def propose(self, context: Sequence[int], n: int) -> Draft:
        if self.prediction is not None:
            size, cont = self.prediction.lookup(context, n)
            if cont and size >= self.n_min:
                return Draft(cont, predicted=len(cont))
        return Draft(self.lookup(context, n).tokens)


class ModelDrafter:
    """A small draft model with its own KV cache, advanced incrementally across rounds.

    Samples with the same SamplingParams as the target (greedy at temperature 0, where the draft is a point
    mass), and stops early when its top probability falls below p_min. Its vocabulary may be up to 128
    tokens wider or narrower than the target's (llama.cpp's rule): it drafts only ids both share, and stands
    aside (drafts nothing) where the context holds an id it lacks or no longer fits its n_ctx.
    Draws come from the stream of the output position drafted (seed, position, 1), so a seeded request
    drafts the same tokens every time.
    """

    def __init__(self, model: Model, params: SamplingParams, *, seed: int, p_min: float = 0.0,
                 prompt_len: int = 0, target_vocab: int | None = None, grammar=None):
        self.model, self.params, self.seed, self.p_min, self.prompt_len = model, params, seed, p_min, prompt_len
        self.grammar = grammar  # masks each row it drafts from, as the target's rows are masked: q stays exact
        self.width = min(model.n_vocab, target_vocab or model.n_vocab)
        self.checked, self.foreign = 0, False  # context tokens checked so far; whether one is not in its vocab

    def fits(self, context: Sequence[int]) -> bool:
        """Whether the draft model can read this context: within its n_ctx, and only ids it has (a request's
        context only grows, so each token is checked once)."""
        if not self.foreign and len(context) > self.checked:
            self.foreign = max(context[self.checked:]) >= self.model.n_vocab
            self.checked = len(context)
        return not self.foreign and len(context) < self.model.n_ctx

    def lag(self, context: Sequence[int]) -> int:
        """How many context tokens the draft's cache lacks: what drafting now must first catch up."""
        return len(context) - self.model.cached_prefix(context)

    def propose(self, context: Sequence[int], n: int) -> Draft:
        m = self.model
        n = min(n, m.n_ctx - len(context))
        if n <= 0 or not self.fits(context):
            return EMPTY
        row = m.sync(context, logits=True)[1][0][:self.width]
        history = list(context[self.prompt_len:]) if self.params.penalized else []  # only penalties read it
        tokens, qs = [], []
        try:
            for i in range(n):
                tok, q = self._one(row, history, len(context) - self.prompt_len + i)
                if tok is None:
                    break
                tokens.append(tok)
                history.append(tok)
                if q is not None:
                    qs.append(q)
                if m.is_eog(tok):  # nothing follows the end
                    break
                if self.grammar is not None:
                    self.grammar.consume([tok])
                if i + 1 < n:  # the last draft token is never decoded here: the target verifies it
                    row = m.decode([tok], logits="last")[0][:self.width]
        finally:
            if self.grammar is not None:
                self.grammar.rollback(len(tokens) - (bool(tokens) and m.is_eog(tokens[-1])))
        return Draft(tokens, qs if qs else None)

    def _one(self, row: np.ndarray, history: list[int], position: int) -> tuple[int | None, Dist | None]:
        """The next draft token from one row (and its q at T > 0), or None when the draft is too unsure."""
        if self.grammar is not None:
            row = self.grammar.mask(row)
        if self.params.greedy:
            z = penalize(row, history, self.params)
            tok = int(np.argmax(z))
            # top probability without a softmax of the whole row: 1 / sum(exp(l - l_max))
            if self.p_min > 0 and 1.0 / np.exp(z - z[tok]).sum() < self.p_min:
                return None, None
            return tok, None
        q = dist(row, self.params, history)
        if q.p.max() < self.p_min:
            return None, None
        return q.sample(position_rng(self.seed, position, 1)), q


def allowed(grammar, tokens: Sequence[int]) -> int:
    """How many leading tokens of a draft the grammar allows from its current state, and none after an
    end-of-generation token (nothing follows it)."""
    end = grammar.first_end(tokens)
    return min(grammar.validate(tokens[:end + 1]), end + 1)


def cut(grammar, lead: Sequence[int], tokens: list[int]) -> list[int]:
    """tokens, a continuation drafted after lead (forced and guessed tokens), cut to what the grammar allows
    after them (as they are without a grammar, or when there are none)."""
    if grammar is None or not tokens:
        return tokens
    return tokens[:max(allowed(grammar, [*lead, *tokens]) - len(lead), 0)]


def constrained(grammar, forced: list[int], rest: Draft, guessed: Sequence[int] = ()) -> Draft:
    """forced + guessed + rest, cut to what the grammar allows from its current state (forced and guessed
    drafts are point masses) and after an end-of-generation token (nothing follows it)."""
    lead = [*forced, *guessed]
    tokens = lead + rest.tokens
    ok = allowed(grammar, tokens)
    q = None if rest.q is None else ([Dist.point(t) for t in lead] + rest.q)[:ok]
    return Draft(tokens[:ok], q, forced=min(len(forced), ok), predicted=min(rest.predicted, max(ok - len(lead), 0)))


class GrammarDrafter:
    """Under a grammar: what it forces (keys, quotes, punctuation), then what `inner` proposes after that, cut
    to what the grammar allows. Forced tokens are verified like any draft: the model may spell the same bytes
    with other tokens, so nothing is skipped unverified."""

    def __init__(self, grammar, inner: Drafter):
        self.grammar, self.inner = grammar, inner

    def propose(self, context: Sequence[int], n: int) -> Draft:
        forced = self.grammar.forced()[:n]
        self.grammar.consume(forced)
        try:
            rest = self.inner.propose([*context, *forced], n - len(forced)) if n > len(forced) else EMPTY
        finally:
            self.grammar.rollback(len(forced))
        return constrained(self.grammar, forced, rest)


class HybridDrafter:
    """N-gram lookup when the context repeats itself, else the draft model."""

    def __init__(self, ngram: NgramDrafter, model: ModelDrafter):
        self.ngram, self.model = ngram, model

    def propose(self, context: Sequence[int], n: int) -> Draft:
        d = self.ngram.propose(context, n)
        return d if d.tokens else self.model.propose(context, n)
