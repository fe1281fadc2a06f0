"""auto: each round, the candidate draft (n-gram lookup, grammar-forced tokens, a prediction, the draft
model) and length that maximise expected tokens per second on this machine, or plain decoding.

Costs come from this machine's calibration (costs.Costs); acceptance rates are learned per request as it
goes (AcceptanceStats, KindOdds), starting from priors measured on recorded outputs.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import replace
from typing import Sequence

import numpy as np

from .drafters import EMPTY, Draft, ModelDrafter, NgramDrafter, Plan, Prediction, constrained, cut


class AcceptanceStats:
    """Per-position conditional acceptance rates, a[i] = P(token i accepted | tokens before it accepted).

    Smoothed towards a prior (one for every position, or one per position) with `weight` pseudo-observations,
    and forgetting old rounds geometrically so the estimate follows the text (code being quoted, then prose);
    never above `cap`.
    """

    def __init__(self, k_max: int, prior: float | Sequence[float], weight: float = 2.0, decay: float = 0.99,
                 cap: float = 1.0):
        self.tried, self.accepted = np.zeros(k_max), np.zeros(k_max)
        self.prior = np.broadcast_to(np.asarray(prior, dtype=float), (k_max,))
        self.weight, self.decay, self.cap = weight, decay, cap

    def update(self, n_tried: int, n_accepted: int, start: int = 0, final: bool = True) -> None:
        """Count positions start..n_tried-1 as tried and start..n_accepted-1 as accepted. A guess whose tokens
        are confirmed one round at a time is counted as they are (final=False), so a long copy run teaches
        while it lasts; the forgetting applies once per guess, when it is settled."""
        if final:
            self.tried *= self.decay
            self.accepted *= self.decay
        self.tried[start:n_tried] += 1
        self.accepted[start:n_accepted] += 1

    def rates(self, n: int) -> np.ndarray:
        return np.minimum((self.accepted[:n] + self.weight * self.prior[:n]) / (self.tried[:n] + self.weight), self.cap)


WORD, PUNCT, NEWLINE = 0, 1, 2  # token kinds: holds a letter or digit; spaces and punctuation only; a line break


_ASCII_ALNUM = np.zeros(256, dtype=bool)
_ASCII_ALNUM[list(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")] = True


def token_kinds(pieces: Sequence[bytes]) -> np.ndarray:
    """The kind of each token of a vocabulary, from its bytes (token id order): NEWLINE if it holds a line
    break, else WORD if it holds a letter or digit (of any script), else PUNCT. Read off the bytes of the whole
    vocabulary at once; only tokens with non-ASCII bytes and no ASCII letter or digit are decoded one by one."""
    lens = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    owner = np.repeat(np.arange(len(pieces)), lens)  # the token each byte belongs to

    def has(mask: np.ndarray) -> np.ndarray:
        return np.bincount(owner[mask], minlength=len(pieces)) > 0

    newline, alnum, high = has(data == ord("\n")), has(_ASCII_ALNUM[data]), has(data >= 0x80)
    kinds = np.where(newline, NEWLINE, np.where(alnum, WORD, PUNCT)).astype(np.int8)
    for t in np.flatnonzero(high & ~newline & ~alnum):
        if any(c.isalnum() for c in pieces[t].decode("utf-8", "ignore")):
            kinds[t] = WORD
    return kinds


_KINDS_LOCK = threading.Lock()


def vocab_kinds(model) -> np.ndarray:
    """token_kinds of a model's vocabulary: built on first use (once: requests that arrive together wait for
    the one building it, rather than each building it beside the others), kept on the model."""
    with _KINDS_LOCK:
        kinds = getattr(model, "_token_kinds", None)
        if kinds is None:
            kinds = model._token_kinds = token_kinds(model.pieces())
    return kinds


class KindOdds:
    """How the kind of the token a guess holds moves the odds that the guess is right there, learned per
    origin and pooled over match sizes, run levels and positions, so a few guesses teach it. Copying a value
    into JSON, the copy from the prompt stops at the prompt's punctuation (a JSON guess holding ',' or a
    line break from the prompt was right 0-60% of the time, holding a word 90%), while the output repeats
    its own punctuation (keys, quotes: 94-98%) more surely than its words (60%); in code the gaps are
    smaller and go either way, so they are learned, not assumed."""

    WEIGHT, DECAY = 8.0, 0.99

    def __init__(self, prior: Sequence[float | None] = (None, None, None)):
        """prior: a rate per kind to start from (worth WEIGHT guesses, forgotten as the others are), or None."""
        self.tried = np.array([0.0 if r is None else self.WEIGHT for r in prior])
        self.accepted = np.array([0.0 if r is None else self.WEIGHT * r for r in prior])
        self._factor = None  # each kind's factor on the odds against (adjust), until the next update

    def update(self, kinds: np.ndarray, n_accepted: int, final: bool) -> None:
        """kinds: those of the tokens tried (in order); the first n_accepted of them were accepted."""
        if final:
            self.tried *= self.DECAY
            self.accepted *= self.DECAY
        np.add.at(self.tried, kinds, 1)
        np.add.at(self.accepted, kinds[:n_accepted], 1)
        self._factor = None

    def adjust(self, rates: np.ndarray, kinds: np.ndarray) -> np.ndarray:
        """rates with each position's odds moved by its token's kind (its rate against all kinds')."""
        if self._factor is None:
            mean = (self.accepted.sum() + 0.5 * self.WEIGHT) / (self.tried.sum() + self.WEIGHT)
            p = (self.accepted + self.WEIGHT * mean) / (self.tried + self.WEIGHT)
            self._factor = np.exp(-(np.log(p / (1 - p)) - np.log(mean / (1 - mean))))
        r = np.clip(rates, 1e-3, 1 - 1e-3)
        return 1 / (1 + (1 - r) / r * self._factor[kinds])


# Under a grammar auto starts from what JSON extraction showed, measured on the plain outputs of the held-out
# structured prompts (scripts/holdout_structured.jsonl; the shipped ones were left to judge it by): a token of
# an n-gram guess was right, by kind (word, punctuation, line break) and origin, this often ...
GRAMMAR_KIND_RATES = {"prompt": (0.92, 0.46, 0.05), "output": (0.70, 0.97, None), "split": (0.29, 0.78, None)}
# ... and the first token of a guess copied from the prompt, before a copy run is under way, 72% of the time
# (216 guesses; 44-100% by the size of the match), where code's priors (below: 0.1-0.55) expect little.
GRAMMAR_PROMPT_PRIOR = 0.65


# an n-gram guess's tokens after its first, by where it comes from (the first token has its own priors)
CONTINUE = {"prompt": 0.8, "output": 0.6, "split": 0.4}
# ... and no more than this, however well a request's guesses have done so far. Inside a long copy run the next
# token held, in the recorded outputs of the shipped and held-out prompts (run of 4+, match of 6+ tokens), 94%
# of the time at every position of a copy from the prompt and 80-87% of a repeat from the output: a copy run ends
# somewhere, and one stretch of it counted guess after guess had made auto 97% sure of the next 16 tokens. A
# 17-token verify costs ten single steps on the slowest-verifying hosts, so such a bet lost nine of them when it
# failed. Replayed on 23 prompts and 5 cost curves, these caps lifted this host's worst prompt from 0.95x of plain
# to 0.99x, and no curve's geometric mean fell (on the structured and history sets, by 0.001 at most).
CAP = {"prompt": 0.94, "output": 0.88, "split": 0.88}


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


class AutoDrafter:
    """Each round, the drafter and K that maximise expected tokens per second on this machine, or nothing.

    Expected speed of a K-token draft = (1 + sum over i <= K of a_1 * ... * a_i) / (verify(K + 1) + draft
    cost), with verify and draft costs measured on this machine at the current context depth (calibrate.py)
    and acceptance rates a_i learned as it goes. Plain decoding (1 / verify(1)) is always a candidate, so
    auto never speculates when nothing is expected to beat it. N-gram lookups cost nothing, so every one is
    also scored against the tokens that actually follow, whether it was drafted or not: the policy notices
    at once when the text becomes predictable. The draft model is probed in the first round it could draft,
    then again now and then (less often each time it loses), but only while its cache is at most PROBE_LAG
    tokens behind: after a long stretch of plain decoding it is not probed again in that request, since a
    probe would first pay for catching its cache up.

    The draft model's cache is never filled ahead of need (not even with the prompt: that would be paid
    before the first token, whatever the request turns out to be). A long lag is caught up as an investment,
    ski-rental style: while the lag alone keeps the model out (caught up, it would beat the round's choice),
    the time it would have saved accrues; once that reaches the catch-up's price, the catch-up is made. So a
    request pays at most about twice what the better of the two (catching up at once, never) would have cost.

    Each request also keeps the account of its drafts: the time each round saved or lost against plain
    decoding of the tokens it gave, priced with the measured costs. While the account is in deficit, a draft
    must be expected to win by a wider margin (CAUTION per plain step lost), so a text that keeps defeating
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

    # Speculate only when it is expected to beat plain decoding by this factor: the estimates are noisy, and
    # a draft that fails costs more than one that succeeds gains. Without the account below, 1.05 beat 1.0
    # slightly and lifted the worst prompt; with it, 1.02 beats 1.05 and 1.0 (replayed on 23 prompts, 5 cost
    # curves: sums of log geomeans 1.3164 against 1.3025 and 1.3154, 7 prompts trailing a fixed drafter by
    # more than 0.02 against 9 and 8, the worst prompt 0.980x of plain or above; the structured sets alike).
    MARGIN = 1.02
    # Each plain step's worth of time a request's drafts have lost so far raises that request's margin by this
    # much (replayed on 23 prompts and 5 cost curves: 0.05 lifted the worst prompt and the geometric means a
    # little; 0.1 and more cost the slowest-verifying host, where one failed draft loses several steps, 1-3%).
    CAUTION = 0.05
    PROBE_LAG = 8  # probe the draft model only when its cache lacks at most this many tokens
    MAY_WIN_EVERY = 32  # model_may_win is decided again each time the context grows by this many tokens

    def __init__(self, costs, ngram: NgramDrafter, model: ModelDrafter | None, *, k_max: int = 33,
                 sample_rows: bool = False, grammar=None, prediction: Prediction | None = None,
                 kinds: np.ndarray | None = None, history=None):
        self.costs, self.ngram, self.model, self.grammar, self.prediction = costs, ngram, model, grammar, prediction
        self.history = history  # earlier requests' outputs (history.SuffixCache), or None
        self.kinds = kinds  # token id -> kind (token_kinds): when given, n-gram guesses are also judged by it
        # Seconds to turn each verified row into a sampling distribution: nothing at temperature 0.
        self.row_cost = costs.sample_row if sample_rows else 0.0
        # n-gram guesses are judged by the size of the match behind them (longer predicts better) and by the
        # copy run they extend: how many tokens in a row the latest guesses got right (0, 1-3, 4+). Quoting is
        # bursty: once the model copies a span it tends to go on, and a miss tends to start a new stretch. A
        # short run (1-3 tokens) says little: generated code repeats short n-grams that then part.
        # And by where the guess comes from, learned apart: copied from the prompt (a quote goes on: a match of
        # 3-4 tokens there was followed ~85% of the time in the recorded outputs), repeated from the output
        # (~60%: generated code and JSON records repeat their openings, then part), or split, where the
        # match's earlier occurrences were followed by other tokens than its latest (~15% at any size). Then
        # each position's odds are moved by the kind of token it holds, learned per origin (KindOdds).
        # These priors are for a guess's first token. Once that holds, the next ones hold far more often (in
        # auto's replayed rounds of the 8 shipped prompts, by position: 63-100% for a copy from the prompt,
        # 49-83% for a repeat from the output, about 45% after a split match), and one prior for every
        # position left a guess's length unpriced: over all 23 prompts a copy from the prompt after a 2-token
        # match held for 6.3 tokens on average where auto expected 0.9, so it cut copies short or skipped them.
        # Later positions start from CONTINUE instead (below the measured rates, as MARGIN is above 1: a draft
        # that fails costs more than one that holds gains), and a short run's first token from 0.3, not 0.4:
        # with its continuation priced each such bet is larger, so its first token is judged more warily
        # (that keeps the worst prompt of the replay at 0.98x plain on every curve; 0.6 -> 0.4 was the same
        # trade before).
        # Under a grammar, prompt copies and the kinds of token start from what JSON extraction showed (above),
        # with one prior for every position, as they were measured (the shape lost 1% there on AMD curves).
        copying = grammar is not None
        cont = {} if copying else CONTINUE  # under a grammar, later positions start from the first's prior

        def prior(p0: float, run: int, origin: str) -> np.ndarray:
            p = 0.1 if origin == "split" else (p0, 0.4 if copying else 0.3, 0.85)[run]
            if copying and origin == "prompt" and run < 2:
                p = max(p, GRAMMAR_PROMPT_PRIOR)
            return np.concatenate([[p], np.full(k_max - 1, max(p, cont.get(origin, p)))])

        self.ngram_stats = {(size, run, origin): AcceptanceStats(k_max, prior(p0, run, origin), cap=CAP[origin])
                            for size, p0 in ((1, 0.1), (2, 0.25), (3, 0.35), (4, 0.45), (6, 0.55))
                            for run in (0, 1, 2) for origin in ("prompt", "output", "split")}
        self.kind_odds = {origin: KindOdds(GRAMMAR_KIND_RATES[origin]) if copying else KindOdds()
                          for origin in ("prompt", "output", "split")}
        self.output_from: int | None = None  # where the output starts: the first round's context length
        self.run = 0
        self.model_stats = AcceptanceStats(k_max, 0.7)
        self.forced_stats = AcceptanceStats(k_max, 0.95)
        self.guess_stats: dict[int, AcceptanceStats] = {}  # by token: how often the model wrote each guess
        # a prediction is the client's own guess at the output: aligned with it, the output tends to follow it
        self.prediction_stats = {run: AcceptanceStats(k_max, prior) for run, prior in ((0, 0.5), (1, 0.7), (2, 0.9))}
        # history: by the size of the match (3, 4-5, 6+ tokens), how many earlier places agree (1, 2-3, 4+) and
        # whether it opens the output (a match then may be the chat template's turn header alone); a long match
        # that many earlier outputs share (a JSON record's keys, a tool call's skeleton) holds most often.
        # Learned across the scope's requests (kept with its history), from these priors; and, as for n-gram
        # guesses, how the kind of token a position holds moves its odds (an earlier output's words may hold
        # where its punctuation does not, or the other way round): history.learned, read and taught under the
        # scope's lock, as requests decoded together share it.
        self.k_max = k_max
        # the longest draft it prices: as far as its statistics go and the measured verify curve reaches (a
        # verify of n + 1 tokens; past the curve's end its cost is not known, and a k the request allows
        # beyond it is not drafted)
        self.cap = min(k_max, int(costs.sizes[-1]) - 1)
        self.probe_every = 64
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

    def _cost(self, depth: int, n: int):
        """cost(m): seconds of a verify of m tokens (1..n + 1, a number or an array) at this depth, the curve
        interpolated once for the round (a round prices several candidates)."""
        row = self.costs.verify_costs(n + 1, depth)
        return lambda m: row[np.asarray(m) - 1]

    def model_may_win(self, depth: int, n: int = 16) -> bool:
        """Whether the draft model could pay on this machine at all. Where even a draft model that is always
        right would not clearly beat plain decoding (slow batched verify, costly draft), it is never tried: a
        probe would also pay for catching its cache up. Decided at the start of each stretch of MAY_WIN_EVERY
        tokens of context (the costs move slowly with depth)."""
        if self.model is None or self.costs.draft is None:
            return False
        key = (n, depth // self.MAY_WIN_EVERY)
        if self.may_win is None or self.may_win[0] != key:
            at = key[1] * self.MAY_WIN_EVERY
            cost = self._cost(at, n)
            speed = _best(np.ones(n), cost, self.costs.draft_cost(at), self.row_cost)[1]
            self.may_win = key, speed > 1.25 / (cost(1) + self.row_cost)
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

    def propose(self, context: Sequence[int], n: int) -> Draft:
        self._learn(context)
        if self.output_from is None:
            self.output_from = len(context)
        depth = len(context)
        if self.bet is not None:  # what the last draft's round gave, against plain decoding of as many tokens
            at, seconds, step = self.bet
            # (the sampler's time per row is the same per token with or without a draft: left out of both)
            self.bank += (depth - at) * step - seconds
            self.bet = None
        n = min(n, self.cap)
        if n <= 0:
            return EMPTY
        cost = self._cost(depth, n)
        forced = self.grammar.forced()[:n] if self.grammar is not None else []
        rates = self.forced_stats.rates(len(forced)) if forced else NO_RATES
        if forced:
            self.pending.append((len(context), forced, self.forced_stats, 0, None))
        # the token that spells the rest of the forced bytes, drafted while the model mostly writes it (' "'
        # before a value, yes; '"}' where the model writes '"},', no): scored every time, like n-gram guesses
        guess = self.grammar.spelled(forced) if self.grammar is not None and len(forced) < n else []
        if guess:
            stats = self.guess_stats.setdefault(guess[0], AcceptanceStats(1, 0.7))
            self.pending.append((len(context) + len(forced), guess, stats, 0, None))
            rate = stats.rates(1)
            rates, guess = (np.concatenate([rates, rate]), guess) if rate[0] >= 0.5 else (rates, [])
        f = len(forced) + len(guess)
        catch_up = 0.0  # a catch-up of the draft model's cache bought as an investment (below)
        plain = 1.0 / (cost(1) + self.row_cost)  # expected tokens per second of plain decoding
        # A request whose drafts have lost time so far asks more of the next one (CAUTION), so a text that keeps
        # defeating the estimates costs little against plain decoding.
        margin = self.MARGIN + self.CAUTION * max(-self.bank, 0.0) * plain
        # (source, K, expected tokens/s, expected tokens, expected seconds)
        best = ("none", 0, margin * plain, 1.0, 1.0 / plain)

        def score(source: str, guessed=(), per_token: float = 0.0, fixed: float = 0.0):
            return (source, *_best(np.concatenate([rates, guessed]), cost, per_token, self.row_cost, start=f,
                                   fixed=fixed))

        if f:
            best = max(best, score("forced"), key=lambda b: b[2])
        lead = forced + guess
        ctx = [*context, *lead] if f else context
        cont, pcont, hcont = [], [], []
        if n > f:
            match = self.ngram.lookup(ctx, n - f)
            cont = cut(self.grammar, lead, match.tokens)  # priced (and scored) as far as the grammar lets it be drafted
            if cont:
                origin = "split" if match.split else "output" if match.at >= self.output_from else "prompt"
                stats = self.ngram_stats[_bucket(match.size), self._run_level, origin]
                guessed = stats.rates(len(cont))
                odds = self.kind_odds[origin] if self.kinds is not None else None
                if odds is not None:
                    guessed = odds.adjust(guessed, self.kinds[cont])
                self.pending.append((len(ctx), cont, stats, 0, (odds, self.kinds[cont]) if odds is not None else None))
                best = max(best, score("ngram", guessed), key=lambda b: b[2])
            if self.prediction is not None:
                _, pcont = self.prediction.lookup(ctx, n - f)
            if pcont:
                stats = self.prediction_stats[self._run_level]
                self.pending.append((len(ctx), pcont, stats, 0, None))
                best = max(best, score("prediction", stats.rates(len(pcont))), key=lambda b: b[2])
            if self.history is not None and self.history.size:  # nothing kept yet: no lookup
                found = self.history.lookup(ctx, n - f)
                hcont = cut(self.grammar, lead, found.tokens)
            if hcont:
                size = max(_bucket(found.size), 3)  # history matches are 3 tokens at least: 3, 4-5, 6+
                support = 0 if found.support == 1 else 1 if found.support < 4 else 2
                key = (size, support, depth == self.output_from and not f)
                learned = self.history.learned
                with self.history.lock:
                    stats = learned.stats.get(key)
                    if stats is None:
                        stats = learned.stats[key] = AcceptanceStats(
                            self.k_max, min(0.15 + 0.1 * (size // 2) + 0.1 * support, 0.7))
                    # each token also by the share of the places still agreeing that agree on it (the counts
                    # of a suffix tree's nodes, as SuffixDecoding scores its drafts): the length follows the
                    # counts as far as the costs say it pays (replayed: +0.3-0.4% on 4 of 5 curves, -0.3% amd1)
                    guessed = stats.rates(len(hcont)) * np.asarray(found.shares[:len(hcont)])
                    odds = None
                    if self.kinds is not None:
                        if learned.kinds is None:
                            learned.kinds = KindOdds()
                        kinds = self.kinds[hcont]
                        guessed, odds = learned.kinds.adjust(guessed, kinds), (learned.kinds, kinds)
                self._ngram_set.add(stats)
                self.pending.append((len(ctx), hcont, stats, 0, odds))
                best = max(best, score("history", guessed), key=lambda b: b[2])
            if not cont and not pcont and not hcont:
                self.run = 0
        if n > f and self.model_may_win(depth, n) and self.model.fits(ctx):
            # catching the draft's cache up over what it has not seen is paid before it can draft
            lag = self.model.lag(ctx)
            guessed, step = self.model_stats.rates(n - f), self.costs.draft_cost(depth)
            price = lag * self.costs.fill_cost(depth)
            model = score("model", guessed, step, price)
            ready = score("model", guessed, step) if lag and model[2] <= best[2] else model
            if model[2] <= best[2] < ready[2]:  # only the lag keeps it out: the time lost buys the catch-up
                self.missed += best[3] * (1.0 / best[2] - 1.0 / ready[2])
                if self.missed >= price:
                    model, catch_up, self.missed = ready, price, 0.0
            self.since_model += 1
            # a probe learns what the model is worth here, but only while its cache is nearly caught up: a
            # probe after a long gap would pay a long catch-up for one round's answer
            probe = self.since_model >= self.probe_every and lag <= self.PROBE_LAG
            if model[2] > best[2] or probe:
                if probe and model[2] <= best[2]:
                    self.probe_every = min(2 * self.probe_every, 4096)
                best = model
        name, k, _, tokens, seconds = best
        plan = Plan(name, tokens, seconds)
        if name == "none":
            return Draft([], plan=plan)
        rest = EMPTY
        if name == "ngram":
            rest = Draft(cont[:k - f])
        elif name == "prediction":
            rest = Draft(pcont[:k - f], predicted=k - f)
        elif name == "history":
            rest = Draft(hcont[:k - f])
        elif name == "model":
            self.since_model = 0
            if self.grammar is not None:
                self.grammar.consume(lead)
            try:
                rest = self.model.propose(ctx, k - f)
            finally:
                if self.grammar is not None:
                    self.grammar.rollback(f)
            if rest.tokens:
                self.pending.append((len(ctx), rest.tokens, self.model_stats, 0, None))
        d = replace(constrained(self.grammar, forced, rest, guess) if self.grammar is not None else rest, plan=plan)
        seconds = float(cost(len(d.tokens) + 1))
        if name == "model":  # (a catch-up bought as an investment is not this round's loss)
            seconds += step * max(len(rest.tokens), 1) + price - catch_up  # draft steps, its cache's catch-up
        # a probe of the draft model counts too: the account is this request's time against plain decoding
        # (leaving probes out lowered the replay's sums, 1.3164 -> 1.3146)
        self.bet = (depth, seconds, float(cost(1)))
        return d
