"""auto: each round, the candidate draft (n-gram lookup, grammar-forced tokens, a prediction, the draft
model) and length that maximise expected tokens per second on this machine, or plain decoding.

Costs come from this machine's calibration (costs.Costs); acceptance rates are learned per request as it
goes (AcceptanceStats, KindOdds), starting from priors measured on recorded outputs.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

import numpy as np

from .drafters import EMPTY, Draft, ModelDrafter, NgramDrafter, Plan, Prediction, constrained, cut
from .odds import NEWLINE, PUNCT, WORD, AcceptanceStats, KindOdds, token_kinds, vocab_kinds  # noqa: F401
from .tuning import TUNING, Tuning


# the caps on an n-gram token's rate, by origin (tuning.Tuning.cap: what chose them)
CAP = TUNING.cap


NO_RATES = np.empty(0)  # the acceptance rates of no forced tokens (most rounds)
NO_RATES.flags.writeable = False


def _bucket(size: int) -> int:
    """Match sizes that predict alike share statistics: 1, 2, 3, 4-5, 6 and more."""
    return size if size <= 3 else 4 if size <= 5 else 6


def _best(rates: np.ndarray, cost, extra_per_token: float = 0.0, per_emitted: float = 0.0,
          start: int = 0, fixed: float = 0.0) -> tuple[int, float, float, float]:
    """(K, expected tokens per second, expected tokens per round, expected seconds per round) of the best
    draft length K >= max(start, 1) given per-position acceptance rates.

    cost(n) is the seconds of a verify of n tokens; extra_per_token the cost of drafting one of the tokens past
    `start` (the first `start` are given: forced by a grammar); per_emitted the cost of each row the acceptance
    rule reads (one per emitted token: rows past a rejection are never read); fixed a cost the round pays
    whatever K (catching the draft model's cache up).
    """
    expected = 1.0 + np.cumsum(np.cumprod(rates))  # tokens a round yields with K = 1..len(rates) drafts
    ks = np.arange(1, len(rates) + 1)
    seconds = cost(ks + 1) + extra_per_token * np.maximum(ks - start, 0) + per_emitted * expected + fixed
    speed = expected / seconds
    i = max(start, 1) - 1 + int(np.argmax(speed[max(start, 1) - 1:]))
    return i + 1, float(speed[i]), float(expected[i]), float(seconds[i])


class Candidate(NamedTuple):
    """One source's draft for this round, priced: K tokens drafted (the lead included), expected tokens per
    second, tokens per round and seconds per round; `cont` the source's tokens after the lead; for the draft
    model, its cost per drafted token, the catch-up of its cache it pays, and the part of that bought as an
    investment (not this round's loss)."""
    source: str
    k: int
    speed: float
    tokens: float
    seconds: float
    cont: Sequence[int] = ()
    step: float = 0.0
    price: float = 0.0
    bought: float = 0.0


def choose(*candidates: Candidate | None) -> Candidate:
    """The candidate expected to give the most tokens per second; on a tie, the one named first (plain
    decoding, then the grammar's forced tokens, n-gram, prediction, history)."""
    return max((c for c in candidates if c is not None), key=lambda c: c.speed)


@dataclass
class Round:
    """What one round's candidates are priced with: the context (with the lead: grammar-forced tokens, then the
    guessed token that spells the rest of their bytes), the most tokens it may draft, the verify costs at its
    depth and the lead's acceptance rates."""
    context: Sequence[int]
    n: int
    cost: Callable
    forced: list[int]
    guess: list[int]
    rates: np.ndarray
    row_cost: float

    def __post_init__(self):
        self.lead = self.forced + self.guess
        self.f = len(self.lead)
        self.ctx = [*self.context, *self.lead] if self.f else self.context

    def score(self, source: str, guessed=(), per_token: float = 0.0, fixed: float = 0.0, **extra) -> Candidate:
        """The source's best K after the lead, given its tokens' acceptance rates (`guessed`)."""
        best = _best(np.concatenate([self.rates, guessed]), self.cost, per_token, self.row_cost, start=self.f,
                     fixed=fixed)
        return Candidate(source, *best, **extra)


def ngram_stats(t: Tuning, k_max: int, copying: bool) -> dict[tuple[int, int, str], AcceptanceStats]:
    """The n-gram guesses' statistics, by (match size bucket, copy run level, origin), at their priors.

    A guess is judged by the size of the match behind it (longer predicts better), by the copy run it extends
    (how many tokens in a row the latest guesses got right: 0, 1-3, 4+; quoting is bursty) and by where it
    comes from, learned apart: copied from the prompt, repeated from the output, or split (the match's earlier
    occurrences went on differently). A guess's later tokens start from continue_prior, its first from
    ngram_first or the run's prior. Under a grammar (`copying`: JSON extraction copies its values from the
    prompt), prompt copies start from what extraction showed, one prior for every position, as measured."""
    cont = {} if copying else t.continue_prior

    def prior(p0: float, run: int, origin: str) -> np.ndarray:
        short = t.grammar_short_run_prior if copying else t.short_run_prior
        p = t.split_prior if origin == "split" else (p0, short, t.long_run_prior)[run]
        if copying and origin == "prompt" and run < 2:
            p = max(p, t.grammar_prompt_prior)
        return np.concatenate([[p], np.full(k_max - 1, max(p, cont.get(origin, p)))])

    return {(size, run, origin): AcceptanceStats(k_max, prior(p0, run, origin), cap=t.cap[origin])
            for size, p0 in t.ngram_first.items() for run in (0, 1, 2) for origin in ("prompt", "output", "split")}


class AutoDrafter:
    """Each round, the drafter and K that maximise expected tokens per second on this machine, or nothing.

    Expected speed of a K-token draft = (1 + sum over i <= K of a_1 * ... * a_i) / (verify(K + 1) + draft
    cost), with verify and draft costs measured on this machine at the current context depth (calibrate.py)
    and acceptance rates a_i learned as it goes. Each source (the grammar's forced tokens, an n-gram lookup, a
    prediction, the history, the draft model) gives one Candidate from these; `choose` takes the fastest, and
    plain decoding (1 / verify(1), times a margin) is always one, so auto never speculates when nothing is
    expected to beat it. Every number it was tuned with is in tuning.TUNING, with what chose it.

    N-gram, prediction and history lookups cost nothing, so every one is also scored against the tokens that
    actually follow, whether it was drafted or not: the policy notices at once when the text becomes
    predictable. The draft model is probed in the first round it could draft, then again now and then (less
    often each time it loses), but only while its cache is at most probe_lag tokens behind.

    The draft model's cache is never filled ahead of need (not even with the prompt: that would be paid
    before the first token, whatever the request turns out to be). A long lag is caught up as an investment,
    ski-rental style: while the lag alone keeps the model out (caught up, it would beat the round's choice),
    the time it would have saved accrues; once that reaches the catch-up's price, the catch-up is made. So a
    request pays at most about twice what the better of the two (catching up at once, never) would have cost.

    Each request also keeps the account of its drafts: the time each round saved or lost against plain
    decoding of the tokens it gave, priced with the measured costs. While the account is in deficit, a draft
    must be expected to win by a wider margin (caution per plain step lost), so a text that keeps defeating
    the learned rates costs little against plain decoding; a request whose drafts pay is not held back.

    Under a grammar, the tokens it forces open every draft, priced with their own learned acceptance (nearly
    always accepted, yet a model may spell the same bytes otherwise), then the token spelling the rest of
    the forced bytes while the model has mostly written it (learned per token), and a continuation is added
    where that is expected to pay more.

    One AutoDrafter serves one request and starts from the same priors every time: its decisions depend on
    the request alone, so the same request drafts the same way (and, at temperature 0, gives the same
    text) however many requests came before it. Drafting from a history (off by default) is the exception:
    what earlier requests wrote, and what drafting from it was worth to them (its statistics are the scope's,
    learned across its requests), decide too.
    """

    def __init__(self, costs, ngram: NgramDrafter, model: ModelDrafter | None, *, k_max: int = 33,
                 sample_rows: bool = False, grammar=None, prediction: Prediction | None = None,
                 kinds: np.ndarray | None = None, history=None, tuning: Tuning = TUNING):
        self.costs, self.ngram, self.model, self.grammar, self.prediction = costs, ngram, model, grammar, prediction
        self.history = history  # earlier requests' outputs (history.SuffixCache), or None
        self.kinds = kinds  # token id -> kind (token_kinds): when given, n-gram guesses are also judged by it
        self.tuning = t = tuning
        # Seconds to turn each verified row into a sampling distribution: nothing at temperature 0.
        self.row_cost = costs.sample_row if sample_rows else 0.0
        self.k_max = k_max
        # the rates learned per thinking span ('thinking', 'answer'; '' without one): acceptance differs sharply
        # between a reasoning model's thinking and its answer, in either direction
        self.span = grammar.span if grammar is not None else ""
        self.model_stats, self.ngram_stats, self.kind_odds, self.run = self._fresh(self.span)
        self.learned: dict[str, tuple] = {}
        self.output_from: int | None = None  # where the output starts: the first round's context length
        self.forced_stats = AcceptanceStats(k_max, t.forced_prior)
        self.guess_stats: dict[int, AcceptanceStats] = {}  # by token: how often the model wrote each guess
        # a prediction is the client's own guess at the output: aligned with it, the output tends to follow it
        self.prediction_stats = {run: AcceptanceStats(k_max, p) for run, p in enumerate(t.prediction_prior)}
        # the longest draft it prices: as far as its statistics go and the measured verify curve reaches (a
        # verify of n + 1 tokens; past the curve's end its cost is not known, and a k the request allows
        # beyond it is not drafted)
        self.cap = min(k_max, int(costs.sizes[-1]) - 1)
        self.probe_every = t.probe_every
        self.may_win: tuple[tuple[int, int], bool] | None = None  # ((n, depth bucket), model_may_win's answer)
        self.since_model = self.probe_every  # the first round the model could draft in probes it
        # seconds the draft model would have saved so far in rounds where only its cache's lag kept it out
        self.missed = 0.0
        # seconds this request's drafts have saved against plain decoding (< 0: lost), priced with the measured
        # costs rather than timed, so the same request still drafts the same way every time
        self.bank = 0.0
        # the last draft: the context's length then, the seconds its round cost, and a plain step's then
        self.bet: tuple[int, float, float] | None = None
        # guesses not settled yet: (position, tokens, whose stats, how many leading ones are counted already,
        # the KindOdds that also learn from them and each token's kind)
        self.pending: list[tuple[int, list[int], AcceptanceStats, int, tuple[KindOdds, np.ndarray] | None]] = []
        self._ngram_set = set(self.ngram_stats.values()) | set(self.prediction_stats.values())

    def _fresh(self, span: str) -> tuple:
        """New learned rates (draft model, n-gram, token kinds, copy run) for a span: from the priors of
        structured output where the answer is constrained (a thinking budget alone constrains none)."""
        t = self.tuning
        copying = self.grammar is not None and self.grammar.copying and span != "thinking"
        return (AcceptanceStats(self.k_max, t.model_prior), ngram_stats(t, self.k_max, copying=copying),
                {origin: KindOdds(t.grammar_kind_rates[origin]) if copying else KindOdds()
                 for origin in ("prompt", "output", "split")}, 0)

    def _enter_span(self) -> None:
        """The learned rates of the span this round starts in (those of the span left are kept for its return)."""
        span = self.grammar.span if self.grammar is not None else ""
        if span != self.span:
            self.learned[self.span] = (self.model_stats, self.ngram_stats, self.kind_odds, self.run)
            rates = self.learned.get(span) or self._fresh(span)
            self._ngram_set |= set(rates[1].values())
            self.model_stats, self.ngram_stats, self.kind_odds, self.run = rates
            self.span = span

    def _cost(self, depth: int, n: int):
        """cost(m): seconds of a verify of m tokens (1..n + 1, a number or an array) at this depth, the curve
        interpolated once for the round (a round prices several candidates)."""
        row = self.costs.verify_costs(n + 1, depth)
        return lambda m: row[np.asarray(m) - 1]

    def model_may_win(self, depth: int, n: int = 16) -> bool:
        """Whether the draft model could pay on this machine at all. Where even a draft model that is always
        right would not clearly beat plain decoding (slow batched verify, costly draft), it is never tried: a
        probe would also pay for catching its cache up. Decided at the start of each stretch of may_win_every
        tokens of context (the costs move slowly with depth)."""
        if self.model is None or self.costs.draft is None:
            return False
        every = self.tuning.may_win_every
        key = (n, depth // every)
        if self.may_win is None or self.may_win[0] != key:
            at = key[1] * every
            cost = self._cost(at, n)
            speed = _best(np.ones(n), cost, self.costs.draft_cost(at), self.row_cost)[1]
            self.may_win = key, speed > self.tuning.may_win_factor / (cost(1) + self.row_cost)
        return self.may_win[1]

    def _learn(self, context: Sequence[int]) -> None:
        with self.history.lock if self.history is not None else nullcontext():  # (history's stats are shared)
            self._settle(context)

    def _settle(self, context: Sequence[int]) -> None:
        keep, run = [], None
        for pos, tokens, stats, counted, odds in self.pending:
            known = context[pos:pos + len(tokens)]
            m = next((i for i, (a, b) in enumerate(zip(tokens, known)) if a != b), len(known))
            if stats in self._ngram_set and pos + len(known) == len(context):
                # the latest guesses (n-gram, prediction) against the newest tokens: a copy run goes on if any held
                run = (m == len(known) and m > 0) or (run is not None and run[0]), len(known)
            settled = m < len(known) or len(known) == len(tokens)
            tried = min(m + 1, len(tokens)) if settled else m
            stats.update(tried, m, counted, final=settled)  # if not settled: confirmed so far, the rest to come
            if odds is not None:
                odds[0].update(odds[1][counted:tried], m - counted, settled)
            if not settled:
                keep.append((pos, tokens, stats, m, odds))
        self.pending = keep
        if run is not None:
            self.run = self.run + run[1] if run[0] else 0

    @property
    def _run_level(self) -> int:
        return 0 if self.run == 0 else 1 if self.run < 4 else 2

    def _watch(self, at: int, tokens: list[int], stats: AcceptanceStats, odds=None) -> None:
        """Score a guess against the tokens that will follow position `at`, drafted or not (_settle)."""
        self.pending.append((at, tokens, stats, 0, odds))

    # -- one round --
    def propose(self, context: Sequence[int], n: int) -> Draft:
        self._learn(context)
        self._enter_span()
        if self.output_from is None:
            self.output_from = len(context)
        self._close_account(len(context))
        n = min(n, self.cap)
        if n <= 0:
            return EMPTY
        r = self._round(context, n)
        plain = 1.0 / (r.cost(1) + self.row_cost)  # expected tokens per second of plain decoding
        # a request whose drafts have lost time so far asks more of the next one (caution)
        margin = self.tuning.margin + self.tuning.caution * max(-self.bank, 0.0) * plain
        best = choose(Candidate("none", 0, margin * plain, 1.0, 1.0 / plain),
                      r.score("forced") if r.f else None, *self._lookups(r))
        if r.n > r.f and self.model_may_win(len(context), r.n) and self.model.fits(r.ctx):
            best = self._model(r, len(context), best)
        return self._draft(r, len(context), best)

    def _close_account(self, depth: int) -> None:
        """What the last draft's round gave, against plain decoding of as many tokens, into the account (the
        sampler's time per row is the same per token with or without a draft: left out of both)."""
        if self.bet is not None:
            at, seconds, step = self.bet
            self.bank += (depth - at) * step - seconds
            self.bet = None

    def _round(self, context: Sequence[int], n: int) -> Round:
        """The round's lead: the tokens the grammar forces, then the token that spells the rest of their bytes,
        drafted while the model mostly writes it (' "' before a value, yes; '"}' where the model writes '"},',
        no), each scored every time like n-gram guesses."""
        forced = self.grammar.forced()[:n] if self.grammar is not None else []
        rates = self.forced_stats.rates(len(forced)) if forced else NO_RATES
        if forced:
            self._watch(len(context), forced, self.forced_stats)
        guess = self.grammar.spelled(forced) if self.grammar is not None and len(forced) < n else []
        if guess:
            stats = self.guess_stats.setdefault(guess[0], AcceptanceStats(1, self.tuning.guess_prior))
            self._watch(len(context) + len(forced), guess, stats)
            rate = stats.rates(1)
            rates, guess = (np.concatenate([rates, rate]), guess) if rate[0] >= self.tuning.guess_min else (rates, [])
        return Round(context, n, self._cost(len(context), n), forced, guess, rates, self.row_cost)

    def _lookups(self, r: Round) -> list[Candidate | None]:
        """The n-gram, prediction and history candidates (those that found something), each scored."""
        if r.n <= r.f:
            return []
        found = [self._ngram(r), self._prediction(r), self._history(r)]
        if not any(found):
            self.run = 0
        return found

    def _ngram(self, r: Round) -> Candidate | None:
        match = self.ngram.lookup(r.ctx, r.n - r.f)
        cont = cut(self.grammar, r.lead, match.tokens)  # priced (and scored) as far as the grammar lets it be drafted
        if not cont:
            return None
        origin = "split" if match.split else "output" if match.at >= self.output_from else "prompt"
        stats = self.ngram_stats[_bucket(match.size), self._run_level, origin]
        guessed = stats.rates(len(cont))
        odds = self.kind_odds[origin] if self.kinds is not None else None
        if odds is not None:
            guessed = odds.adjust(guessed, self.kinds[cont])
        self._watch(len(r.ctx), cont, stats, (odds, self.kinds[cont]) if odds is not None else None)
        return r.score("ngram", guessed, cont=cont)

    def _prediction(self, r: Round) -> Candidate | None:
        if self.prediction is None:
            return None
        _, cont = self.prediction.lookup(r.ctx, r.n - r.f)
        if not cont:
            return None
        stats = self.prediction_stats[self._run_level]
        self._watch(len(r.ctx), cont, stats)
        return r.score("prediction", stats.rates(len(cont)), cont=cont)

    def _history(self, r: Round) -> Candidate | None:
        """A continuation from earlier requests' outputs, judged by the size of the match (3, 4-5, 6+ tokens),
        how many earlier places agree (1, 2-3, 4+) and whether it opens the output (a match then may be the
        chat template's turn header alone), learned across the scope's requests (under its lock: requests
        decoded together share it); each token also by the share of the places still agreeing that agree on
        it (as SuffixDecoding scores its drafts), and its kind of token."""
        if self.history is None or not self.history.size:  # nothing kept yet: no lookup
            return None
        found = self.history.lookup(r.ctx, r.n - r.f)
        cont = cut(self.grammar, r.lead, found.tokens)
        if not cont:
            return None
        t = self.tuning
        size = max(_bucket(found.size), 3)  # history matches are 3 tokens at least: 3, 4-5, 6+
        support = 0 if found.support == 1 else 1 if found.support < 4 else 2
        key = (size, support, len(r.context) == self.output_from and not r.f)
        learned = self.history.learned
        with self.history.lock:
            stats = learned.stats.get(key)
            if stats is None:
                stats = learned.stats[key] = AcceptanceStats(self.k_max, min(
                    t.history_base + t.history_size_step * (size // 2) + t.history_support_step * support,
                    t.history_max))
            guessed = stats.rates(len(cont)) * np.asarray(found.shares[:len(cont)])
            odds = None
            if self.kinds is not None:
                if learned.kinds is None:
                    learned.kinds = KindOdds()
                kinds = self.kinds[cont]
                guessed, odds = learned.kinds.adjust(guessed, kinds), (learned.kinds, kinds)
        self._ngram_set.add(stats)
        self._watch(len(r.ctx), cont, stats, odds)
        return r.score("history", guessed, cont=cont)

    def _model(self, r: Round, depth: int, best: Candidate) -> Candidate:
        """The draft model against the round's best so far: it wins if expected faster after paying to catch
        its cache up (or once the time only that catch-up kept it from saving has paid for it), or when due
        for a probe, which learns what it is worth here (only while its cache is nearly caught up: a probe
        after a long gap would pay a long catch-up for one round's answer)."""
        lag = self.model.lag(r.ctx)
        guessed, step = self.model_stats.rates(r.n - r.f), self.costs.draft_cost(depth)
        price = lag * self.costs.fill_cost(depth)
        model = r.score("model", guessed, step, price, step=step, price=price)
        ready = r.score("model", guessed, step, step=step, price=price) if lag and model.speed <= best.speed \
            else model
        if model.speed <= best.speed < ready.speed:  # only the lag keeps it out: the time lost buys the catch-up
            self.missed += best.tokens * (1.0 / best.speed - 1.0 / ready.speed)
            if self.missed >= price:
                model, self.missed = ready._replace(bought=price), 0.0
        self.since_model += 1
        probe = self.since_model >= self.probe_every and lag <= self.tuning.probe_lag
        if model.speed > best.speed or probe:
            if probe and model.speed <= best.speed:
                self.probe_every = min(2 * self.probe_every, self.tuning.probe_every_max)
            return model
        return best

    def _draft(self, r: Round, depth: int, best: Candidate) -> Draft:
        """The chosen candidate as a Draft (the lead, then its tokens, cut to what a grammar allows), and the
        round's priced cost kept for the account."""
        plan = Plan(best.source, best.tokens, best.seconds)
        if best.source == "none":
            return Draft([], plan=plan)
        k = best.k - r.f
        rest = EMPTY
        if best.source in ("ngram", "history"):
            rest = Draft(list(best.cont[:k]))
        elif best.source == "prediction":
            rest = Draft(list(best.cont[:k]), predicted=k)
        elif best.source == "model":
            self.since_model = 0
            if self.grammar is not None:
                self.grammar.consume(r.lead)
            try:
                rest = self.model.propose(r.ctx, k)
            finally:
                if self.grammar is not None:
                    self.grammar.rollback(r.f)
            if rest.tokens:
                self._watch(len(r.ctx), rest.tokens, self.model_stats)
        d = replace(constrained(self.grammar, r.forced, rest, r.guess) if self.grammar is not None else rest,
                    plan=plan)
        seconds = float(r.cost(len(d.tokens) + 1))
        if best.source == "model":  # (a catch-up bought as an investment is not this round's loss)
            seconds += best.step * max(len(rest.tokens), 1) + best.price - best.bought
        # a probe of the draft model counts too: the account is this request's time against plain decoding
        # (leaving probes out lowered the replay's sums, 1.3164 -> 1.3146)
        self.bet = (depth, seconds, float(r.cost(1)))
        return d
