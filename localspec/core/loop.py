"""The decoding loop: one generator, and the named phases it runs each round.

One round: the drafter proposes up to k tokens; the target evaluates [pending, d1..dk] in one llama_decode
and returns k+1 logit rows; the acceptance rule keeps a prefix of the draft and picks the next token; the
target's KV cache is cut back to what was kept. Plain decoding is the same loop with an empty draft.

`speculate` yields facts (Prefill, Round, Token, Finish); stream.Stream turns them into user events with
text and folds them into Stats. Everything else (generate, chat, CLI, server, bench) reads that one stream.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from . import acceptance
from .acceptance import Lazy
from .drafters import EMPTY, Draft, Drafter, Plan
from .grammar import Unconstrained
from .model import Cancelled, Model
from .sampling import SamplingParams, dist, penalize, position_rng


# ---- facts the loop yields ----
@dataclass(frozen=True, slots=True)
class Prefill:
    reused: int  # prompt tokens the target's cache held already (its own, a neighbour's, or a kept state's)
    prefilled: int
    draft_reused: int
    draft_prefilled: int
    seconds: float
    restored: int = 0  # of the reused: from a kept state (the prefix store), and from which tier ('ram', 'disk')
    restored_from: str = ""


@dataclass(frozen=True, slots=True)
class Round:
    drafted: int
    accepted: int  # draft tokens emitted (an end-of-generation token inside the draft ends the count)
    draft_s: float
    verify_s: float
    forced: int = 0  # leading draft tokens a grammar forced, and how many of them were accepted
    accepted_forced: int = 0
    predicted: int = 0  # draft tokens from the request's prediction, and how many of them were accepted
    accepted_predicted: int = 0
    plan: Plan | None = None  # auto: what it chose and expected of this round
    span: str = ""  # where the round started: 'thinking' or 'answer' under a thinking span ('' without one)


@dataclass(frozen=True, slots=True)
class Token:
    token: int
    from_draft: bool
    logprob: float | None = None  # the target's log-probability of it, and of its top alternatives (logprobs=N)
    top: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop", "length" or "cancelled"
    note: str | None = None  # why, where the reason alone does not say (a full context)


# ---- the loop ----
def prefill(target: Model, draft: Model | None, prompt: Sequence[int], cancel) -> Prefill:
    """Cache all but the last prompt token in both models, reusing any cached prefix.

    The last prompt token opens round one (the target verifies it, the drafter re-reads it).
    """
    t = time.perf_counter()
    reused, _ = target.sync(prompt[:-1], cancel=cancel)
    restored = target.last_restore
    d_reused = draft.sync(prompt[:-1], cancel=cancel)[0] if draft is not None else 0
    n = len(prompt) - 1
    return Prefill(reused, n - reused, d_reused, (n - d_reused) if draft else 0, time.perf_counter() - t,
                   *restored)


def verify(target: Model, pending: int, draft: Draft) -> np.ndarray:
    """One llama_decode of [pending, d1..dk]: k+1 logit rows, row i predicts the token after position i."""
    return target.decode([pending, *draft.tokens], logits="all")


def accept(rule: str, rows: np.ndarray, draft: Draft, params: SamplingParams, history: list[int],
           rngs: Sequence[np.random.Generator], tau: float) -> tuple[int, int]:
    """Turn logit rows into the target's distributions (only as far as the rule reads) and apply the rule."""
    d, n = draft.tokens, len(draft.tokens) + 1

    def hist(i: int) -> list[int]:
        return history + d[:i] if params.penalized else history

    def argmax(i: int) -> int:
        return int(np.argmax(penalize(rows[i], hist(i), params)))

    if params.greedy and rule != "threshold":
        # At temperature 0 rejection sampling reduces exactly to token match: no softmax needed.
        return acceptance.accept_greedy(Lazy(n, argmax), d)
    p = Lazy(n, lambda i: dist(rows[i], params, hist(i)))
    choice = Lazy(n, argmax if params.greedy else lambda i: p[i].sample(rngs[i]))
    if rule == "greedy":
        return acceptance.accept_greedy(choice, d)
    if rule == "rejection":
        return acceptance.accept_rejection(p, draft.q, d, rngs)
    # threshold: at temperature 0 the test uses the distribution at temperature 1, the choice stays argmax
    p1 = Lazy(n, lambda i: dist(rows[i], replace(params, temperature=1.0), hist(i))) if params.greedy else p
    return acceptance.accept_threshold(p1, d, tau, choice)


def logprobs(row: np.ndarray, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The target's own log-probability of `token` and its n most likely tokens: a log-softmax of the raw
    logits, before penalties, temperature and truncation (as llama-cpp-python reports them)."""
    m = float(row.max())
    lse = m + float(np.log(np.exp(row - m).sum(dtype=np.float64)))
    top = np.argpartition(row, -n)[-n:] if n else np.empty(0, dtype=np.int64)
    top = top[np.lexsort((top, -row[top]))]  # most likely first, ties by lower id
    return float(row[token]) - lse, tuple((int(t), float(row[t]) - lse) for t in top)


def rewind(target: Model, n: int) -> None:
    """Cut the target's cache back to n tokens (pending plus the accepted draft)."""
    target.truncate(n)


def speculate(target: Model, draft_model: Model | None, drafter: Drafter, prompt: Sequence[int], *, max_tokens: int,
              k: int, rule: str, params: SamplingParams, seed: int, tau: float = 0.0, prefill_draft: bool = True,
              lock=contextlib.nullcontext(), cancel: Callable[[], bool] | None = None,
              grammar=Unconstrained(), top_logprobs: int | None = None) -> Iterator:
    """The decoding loop. Yields Prefill, then per round a Round and its Tokens, then one Finish.

    draft_model is the drafter's model, if any: prefilled with the prompt (unless prefill_draft is False,
    for drafters that may never use it) and kept consistent when the consumer stops early.
    Output position j draws from its own random stream position_rng(seed, j), so a seeded request gives the
    same tokens whatever was drafted. `lock` is held while the models are used (never across a yield), and
    a round that finds the target changed by someone else since (another stream on the same engine) first
    puts the target's cache back to its own context. `cancel` is checked between prefill chunks and rounds.
    `grammar` masks each verified row by its state at that position and follows what is emitted; the round
    after which it is complete is the last. With `top_logprobs` (0..20) each Token carries its logprobs.

    Invariant at the top of each round: target.tokens == context[:-1]; context[-1] is `pending`, the
    newest token, not yet evaluated by the target.
    """
    context = list(prompt)
    try:
        with lock:
            pre = prefill(target, draft_model if prefill_draft else None, context, cancel)
            seen = target.version
        yield pre
        produced = 0
        while True:
            room = target.n_ctx - len(context)  # positions left once pending is evaluated
            if produced >= max_tokens or room < 0:
                yield Finish("length", None if produced >= max_tokens else
                             f"the context filled up (n_ctx={target.n_ctx}) before max_tokens: raise n_ctx "
                             "(--n-ctx) for a longer output")
                return
            n = min(k, max_tokens - produced - 1, room)
            history = context[len(prompt):] if params.penalized else []  # only penalties read it
            rngs = Lazy(n + 1, lambda i, at=produced: position_rng(seed, at + i))
            with lock:
                if cancel is not None and cancel():  # under the lock: a close() that came first has said so
                    raise Cancelled
                target.check_open()  # the engine may have been closed since the last round: before drafting
                if target.version != seen:
                    target.sync(context[:-1], cancel=cancel)
                span = grammar.span
                t0 = time.perf_counter()
                draft = drafter.propose(context, n) if n > 0 else EMPTY
                t1 = time.perf_counter()
                rows = verify(target, context[-1], draft)
                t2 = time.perf_counter()
                n_acc, nxt = accept(rule, grammar.rows(rows, draft.tokens), draft, params, history, rngs, tau)
                rewind(target, len(context) + n_acc)
                seen = target.version
                out = [*draft.tokens[:n_acc], nxt]
                end = next((i for i, t in enumerate(out) if target.is_eog(t)), None)  # never emitted
                complete = grammar.advance(out[:end], draft.tokens)
                # row i predicted out[i]; the rows are llama.cpp's buffer, read before the next decode
                lps = ([logprobs(rows[i], t, top_logprobs) for i, t in enumerate(out[:end])]
                       if top_logprobs is not None else [(None, None)] * len(out[:end]))
            n_acc = n_acc if end is None else min(n_acc, end)
            yield Round(len(draft.tokens), n_acc, t1 - t0, t2 - t1, draft.forced, min(n_acc, draft.forced),
                        draft.predicted, min(max(n_acc - draft.forced, 0), draft.predicted), draft.plan, span)
            for i, tok in enumerate(out[:end]):
                context.append(tok)
                produced += 1
                yield Token(tok, i < n_acc, *lps[i])
            if end is not None or complete:
                yield Finish("stop")
                return
    except Cancelled:
        yield Finish("cancelled")
    finally:
        # A consumer that stops early (stop string, Ctrl-C, closed stream) may leave the generator between a
        # decode and the bookkeeping after it: drop any position the token list does not account for.
        with lock:
            for m in (target, draft_model):
                if m is not None:
                    m.truncate(len(m.tokens))
