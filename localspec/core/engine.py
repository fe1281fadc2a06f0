"""The decoding loop and the engine object that `localspec.load` returns.

One round: the drafter proposes up to k tokens; the target evaluates [pending, d1..dk] in one llama_decode
and returns k+1 logit rows; the acceptance rule keeps a prefix of the draft and picks the next token; the
target's KV cache is cut back to what was kept. Plain decoding is the same loop with an empty draft.

`speculate` yields facts (Prefill, Round, Token, Finish); `Stream` turns them into user events with text
and folds them into Stats. Everything else (generate, chat, CLI, server, bench) reads that one stream.
"""
from __future__ import annotations

import contextlib
import inspect
import numbers
import operator
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from . import acceptance, defaults
from .acceptance import Lazy
from .drafters import (EMPTY, AutoDrafter, Draft, Drafter, GrammarDrafter, HybridDrafter, ModelDrafter, NgramDrafter,
                       NoDrafter, Plan, Prediction, vocab_kinds)
from .errors import LocalspecError
from .grammar import Grammar, Unconstrained, compile_spec
from .model import Cancelled, Model, ModelError
from .sampling import SamplingParams, dist, penalize, position_rng
from .text import TextStream


class RequestError(LocalspecError):
    """A generation request is invalid (empty prompt, too long for n_ctx, k < 1, ...)."""


# ---- facts the loop yields ----
@dataclass(frozen=True, slots=True)
class Prefill:
    reused: int
    prefilled: int
    draft_reused: int
    draft_prefilled: int
    seconds: float


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
    d_reused = draft.sync(prompt[:-1], cancel=cancel)[0] if draft is not None else 0
    n = len(prompt) - 1
    return Prefill(reused, n - reused, d_reused, (n - d_reused) if draft else 0, time.perf_counter() - t)


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
                        draft.predicted, min(max(n_acc - draft.forced, 0), draft.predicted), draft.plan)
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


# ---- events and stats for users ----
@dataclass(frozen=True, slots=True)
class Event:
    """One generated token: its id, the text it makes printable now, whether the draft proposed it, and (when
    asked for with logprobs=N) the target's log-probability of it and its N most likely tokens."""

    token: int
    text: str
    from_draft: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class Stats:
    drafter: str
    rule: str
    lossless: bool
    k: int  # draft tokens per round at most, after clamping to what one decode holds
    finish_reason: str
    prompt_tokens: int
    prompt_reused: int
    prompt_prefilled: int
    draft_prompt_reused: int
    draft_prompt_prefilled: int
    prompt_s: float
    generated: int
    gen_s: float
    rounds: int
    drafting_rounds: int
    drafted: int
    accepted: int
    accepted_at: tuple[int, ...]  # accepted_at[i]: rounds whose draft token i was accepted
    draft_s: float
    verify_s: float
    drafted_forced: int  # draft tokens a grammar forced (part of drafted), and how many were accepted
    accepted_forced: int
    drafted_prediction: int  # draft tokens taken from the request's prediction, and how many were accepted
    accepted_prediction: int
    seed: int  # the request's seed (drawn at random when none was given): pass it again to reproduce a run
    notes: tuple[str, ...] = ()  # what the request asked for but did not get, and why

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per round that drafted anything."""
        return self.accepted / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def prompt_tps(self) -> float:
        """Prefill speed: the tokens prefill evaluated (the prompt's last one goes with the first round)."""
        timed = self.prompt_prefilled - 1
        return timed / self.prompt_s if timed > 0 and self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.generated / self.gen_s if self.gen_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accepted_at"], d["notes"] = list(self.accepted_at), list(self.notes)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted,
                 prompt_tps=self.prompt_tps, gen_tps=self.gen_tps)
        return d

    def line(self) -> str:
        s = (f"{self.generated} tokens in {self.gen_s:.2f}s ({self.gen_tps:.1f} tok/s), "
             f"prompt {self.prompt_prefilled} prefilled + {self.prompt_reused} reused; drafter {self.drafter}")
        if self.drafted:
            s += (f", accepted {self.accepted}/{self.drafted} ({self.acceptance_rate:.0%}), "
                  f"{self.mean_accepted:.2f} per round")
        if self.drafted_prediction:
            s += f" (prediction {self.accepted_prediction}/{self.drafted_prediction})"
        s += f"; {self.rule} ({'lossless' if self.lossless else 'LOSSY'})"
        return s + "".join(f"\nnote: {n}" for n in self.notes)


class Stream:
    """Iterate for Events; after the last one, `stats` and `finish_reason` are set. `close()` (or leaving a
    `with` block) ends it early, as finish_reason 'cancelled', from any thread.

    `halt` is set by close(); `stopped` says whether it is set or the engine is closing (the loop's cancel
    hook reads both): checked before each token, so a round's remaining tokens are not read from a model
    being freed."""

    def __init__(self, facts: Iterator, piece, *, stop: Sequence[str], drafter: str, rule: str, k: int,
                 prompt_tokens: int, seed: int = 0, notes: Sequence[str] = (),
                 trace: Callable[[dict], None] | None = None, halt: threading.Event | None = None,
                 stopped: Callable[[], bool] | None = None):
        self._facts, self._piece, self._trace = facts, piece, trace
        self._halt = halt or threading.Event()
        self._stopped = stopped or self._halt.is_set
        self._text = TextStream(stop)
        self._meta = dict(drafter=drafter, rule=rule, lossless=acceptance.LOSSLESS[rule], k=k,
                          prompt_tokens=prompt_tokens, seed=seed, notes=tuple(notes))
        self.stats: Stats | None = None
        self.finish_reason: str | None = None
        self._events: Iterator[Event] | None = None
        self._closing = False
        self._step = threading.Lock()  # held by the reader inside next(): close() from elsewhere only halts

    def __iter__(self) -> Iterator[Event]:
        if self._events is not None:  # read once: a second pass yields nothing and leaves the stats as they are
            return iter(())
        self._events = self._run()
        return self._read()

    def _read(self) -> Iterator[Event]:
        try:
            while True:
                with self._step:
                    ev = next(self._events, None)
                if ev is None:
                    return
                yield ev
        finally:  # the consumer stopped early (break, it.close(), garbage): end the loop now, 'cancelled'
            self.close()  # never waits for _step (a finalizer may run on any thread, at any point)

    def close(self) -> None:
        """End the stream now: finish_reason 'cancelled' (unless it had ended), stats counting what it produced.
        Called while the reader is inside next() (from another thread, or from the trace callback), it asks the
        loop to stop: the reader's stream ends at its next token or round."""
        self._halt.set()
        if self._events is None:
            self._events = self._run()
        if not self._step.acquire(blocking=False):
            return
        try:
            if inspect.getgeneratorstate(self._events) == inspect.GEN_CREATED:
                self._closing = True  # never started: run it just far enough to settle its stats
                next(self._events, None)
            self._events.close()
        finally:
            self._step.release()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> Iterator[Event]:
        pre, rounds, drafting, drafted, acc, at, t_d, t_v, n = None, 0, 0, 0, 0, [], 0.0, 0.0, 0
        forced, predicted = [0, 0], [0, 0]
        reason, held = "cancelled", None  # until the loop says why it ended: a consumer that closes early cancels
        last, got = None, 0  # the latest drafting round, and how many of its draft tokens this stream emitted

        def settle() -> None:
            """Count the latest round's accepted tokens as far as they were emitted: a stop sequence or a close
            mid-round leaves the rest of the round's tokens unread."""
            nonlocal acc
            acc += got
            for i in range(got):
                at[i] += 1
            forced[1] += min(got, last.forced)
            predicted[1] += min(max(got - last.forced, 0), last.predicted)

        t_gen = time.perf_counter()
        try:
            for f in () if self._closing else self._facts:
                if type(f) is Token:
                    if self._stopped():  # closed mid-round: the rest of the round is not read
                        break
                    try:
                        piece = self._piece(f.token)
                    except ModelError:  # the engine closed since the check above
                        if self._stopped():
                            break
                        raise
                    if held is not None:
                        yield held
                        held = None
                    n += 1
                    got += f.from_draft
                    ev = Event(f.token, self._text.push(piece), f.from_draft, f.logprob, f.top)
                    if self._text.stopped:
                        reason = "stop"
                        yield ev
                        break
                    if self._text.holding:
                        held = ev  # may receive the final flush
                    else:
                        yield ev
                elif type(f) is Round:
                    if self._trace is not None:
                        self._trace(trace_row(f, self._meta["prompt_tokens"] + n))
                    rounds += 1
                    t_d += f.draft_s
                    t_v += f.verify_s
                    if last is not None:
                        settle()
                    last, got = f if f.drafted else None, 0
                    if f.drafted:
                        drafting += 1
                        drafted += f.drafted
                        forced[0] += f.forced
                        predicted[0] += f.predicted
                        at.extend([0] * (f.drafted - len(at)))
                elif type(f) is Prefill:
                    pre = f
                    t_gen = time.perf_counter()
                elif type(f) is Finish:
                    reason = f.reason
                    if f.note is not None:
                        self._meta["notes"] += (f.note,)
            tail = self._text.flush()
            if held is not None:
                yield replace(held, text=held.text + tail)
        finally:
            self._facts.close()
            if last is not None:
                settle()
            self.finish_reason = reason
            self.stats = Stats(finish_reason=reason, prompt_reused=pre.reused if pre else 0,
                               # + the prompt's last token, evaluated with the first round: reused +
                               # prefilled is the whole prompt
                               prompt_prefilled=pre.prefilled + 1 if pre else 0,
                               draft_prompt_reused=pre.draft_reused if pre else 0,
                               draft_prompt_prefilled=pre.draft_prefilled if pre else 0, prompt_s=pre.seconds if pre else 0.0,
                               generated=n, gen_s=time.perf_counter() - t_gen, rounds=rounds, drafted=drafted,
                               accepted=acc, accepted_at=tuple(at), draft_s=t_d, verify_s=t_v,
                               drafted_forced=forced[0], accepted_forced=forced[1],
                               drafted_prediction=predicted[0], accepted_prediction=predicted[1],
                               drafting_rounds=drafting, **self._meta)


def trace_row(r: Round, depth: int) -> dict:
    """One round, decision beside outcome: the context length it started at; tokens drafted, accepted and
    emitted; seconds drafting and verifying; and, from auto, the candidate it chose and the tokens and seconds
    it expected (its calibrated costs at this depth and its learned acceptance rates)."""
    row = {"depth": depth, "drafted": r.drafted, "accepted": r.accepted, "emitted": r.accepted + 1,
           "draft_s": round(r.draft_s, 6), "verify_s": round(r.verify_s, 6)}
    if r.plan is not None:
        row |= {"source": r.plan.source, "expected_tokens": round(r.plan.tokens, 4),
                "expected_s": round(r.plan.seconds, 6)}
    return row


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]
    from_draft: list[bool]
    finish_reason: str
    stats: Stats
    # with logprobs=N: per token, (its log-probability, ((token id, log-probability) of the top N, ...))
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None

    def to_dict(self) -> dict:
        return dict(text=self.text, tokens=self.tokens, from_draft=self.from_draft,
                    finish_reason=self.finish_reason, stats=self.stats.to_dict())


# ---- the engine object ----
@dataclass(frozen=True)
class Request:
    """Everything one generation call may set, validated once."""

    max_tokens: int = defaults.MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    drafter: str | None = None
    accept: str = defaults.ACCEPT
    k: int | None = None  # draft tokens per round; under auto the upper bound. Default: K_AUTO (K_PREDICTION) / K_FIXED
    p_min: float = defaults.P_MIN
    threshold: float = defaults.THRESHOLD
    stop: tuple[str, ...] = ()
    # constrained output, at most one (grammar.compile_spec): a JSON Schema (dict or JSON text), a Lark or
    # llama.cpp GBNF grammar, a regex, or any JSON object
    json_schema: dict | str | None = None
    grammar: str | None = None
    regex: str | None = None
    json_object: bool = False
    logprobs: int | None = None  # 0..20: each token's log-probability and this many top alternatives
    prediction: str | tuple[int, ...] | None = None  # text (or token ids) the output is expected to resemble

    def __post_init__(self) -> None:
        for name in ("max_tokens", "seed", "k", "logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise RequestError(f"{name} must be an integer, got {v!r}")
            if v is not None and type(v) is not int:  # numpy's integers too, held as Python's
                object.__setattr__(self, name, int(v))
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be a non-negative integer below 2**63, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs (top alternatives per token) must be in 0..20, got {self.logprobs}")
        if self.prediction is not None and not (isinstance(self.prediction, str) or isinstance(
                self.prediction, tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in self.prediction)):
            raise RequestError("prediction must be text or a list of token ids")
        if self.k is not None and self.k < 1:
            raise RequestError(f"k (draft tokens per round) must be at least 1, got {self.k}")
        if self.drafter is not None and self.drafter not in defaults.DRAFTERS:
            raise RequestError(f"drafter must be one of {', '.join(defaults.DRAFTERS)}, got {self.drafter!r}")
        if self.accept not in defaults.RULES:
            raise RequestError(f"accept must be one of {', '.join(defaults.RULES)}, got {self.accept!r}")
        for name in ("p_min", "threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v <= 1.0:
                raise RequestError(f"{name} must be in [0, 1], got {v!r}")
            object.__setattr__(self, name, float(v))
        if not all(isinstance(x, str) for x in self.stop):
            raise RequestError("stop must be a string or a list of strings")
        if not isinstance(self.json_object, bool):
            raise RequestError(f"json_object must be true or false, got {self.json_object!r}")
        self.constraint()  # an invalid schema, grammar or regex is an error now, naming it

    def constraint(self) -> str | None:
        """The compiled llguidance grammar of this request, or None when its output is free."""
        return compile_spec(json_schema=self.json_schema, grammar=self.grammar, regex=self.regex,
                            json_object=self.json_object)


_SAMPLING_KEYS = set(defaults.SAMPLING)


def make_request(**kw) -> Request:
    """Request from flat keyword arguments (the names of generate(), as in llama-cpp-python)."""
    sampling = SamplingParams(**{k: kw.pop(k) for k in list(kw) if k in _SAMPLING_KEYS})
    if isinstance(kw.get("stop"), str):
        kw["stop"] = (kw["stop"],)
    elif kw.get("stop") is not None:
        if not isinstance(kw["stop"], (list, tuple)):
            raise RequestError(f"stop must be a string or a list of strings, got {type(kw['stop']).__name__}")
        kw["stop"] = tuple(kw["stop"])
    else:
        kw.pop("stop", None)
    pred = kw.get("prediction")
    if pred is not None and not isinstance(pred, str):
        try:  # token ids: a list, a tuple, a range, a numpy array; not bytes
            if isinstance(pred, (bytes, bytearray, memoryview)):
                raise TypeError
            kw["prediction"] = tuple(operator.index(t) for t in pred)
        except TypeError:
            raise RequestError(f"prediction must be text or a list of token ids, got {type(pred).__name__}") from None
    unknown = sorted(set(kw) - {f for f in Request.__dataclass_fields__})
    if unknown:
        raise RequestError(f"unknown generation option {unknown[0]!r}")
    return Request(sampling=sampling, **kw)


class Engine:
    """A target model, an optional draft model, and the generation API over them (see localspec.load).

    Safe to share between threads and between interleaved streams: each round holds the engine's lock and
    first restores the target's cache to its own context if another stream changed it (correct, but each
    switch costs a prefill of what differs; one stream at a time is the fast way). In exact mode each stream
    gets the very text it would get alone; in the default mode a cache rebuilt in other batches than a fresh
    prefill can flip a near-tie at temperature 0.
    """

    def __init__(self, target: Model, draft: Model | None = None, *, name: str | None = None,
                 defaults: dict | None = None):
        self.target, self.draft = target, draft
        self.name = name or target.path.stem
        self.defaults = dict(defaults or {})  # a pair's recommended drafter, k, p_min
        self._costs = None
        self._lock = threading.RLock()
        self._closing = threading.Event()  # close() asks the stream in progress to stop at its next check

    # -- prompts --
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"tokenize takes text (a str), got {type(text).__name__}")
        return self.target.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.target.detokenize(self._ids(tokens, "detokenize takes a list of token ids"))

    def _ids(self, tokens, expected: str) -> list[int]:
        """Token ids of the target's vocabulary, checked: llama.cpp aborts the process on an id outside it."""
        try:  # integers, not bytes (whose items are ints) nor floats (int() would truncate)
            if isinstance(tokens, (str, bytes, bytearray, memoryview)):
                raise TypeError
            ids = [operator.index(t) for t in tokens]
        except TypeError:
            raise RequestError(f"{expected}, got {type(tokens).__name__}") from None
        bad = next((t for t in ids if not 0 <= t < self.target.n_vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        return ids

    def single_token(self, text: str) -> int | None:
        """The id of the one token that spells `text` (a special tag such as <tool_call>), or None."""
        ids = self.tokenize(text, add_special=False)
        return ids[0] if len(ids) == 1 else None

    def _template_kwargs(self) -> dict:
        t = self.target
        return dict(bos_token=t.token_text(t.bos).decode(errors="replace") if t.bos >= 0 else "",
                    eos_token=t.token_text(t.eos).decode(errors="replace") if t.eos >= 0 else "")

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> str:
        from .chat import render

        return render(self.target.chat_template(), messages, add_generation_prompt=add_generation_prompt,
                      tools=tools, **self._template_kwargs())

    def chat_tokens(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None) -> list[int]:
        """The prompt tokens of a conversation, rendered with the target's chat template.

        Message text is tokenized as plain text: a message (or a tool definition, a past tool call) that
        contains '<|im_start|>' gets the characters, never the control token, so no message can forge a turn.
        Only the template's own markup becomes special tokens. (The template writes BOS itself when the model
        wants one.)
        """
        from .chat import segments

        out = []
        for text, markup in segments(self.target.chat_template(), messages, self.target.control_spellings(),
                                     tools=tools, **self._template_kwargs()):
            out += self.tokenize(text, add_special=False, parse_special=markup)
        return out

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            tokens = self.tokenize(prompt)
        else:
            tokens = self._ids(prompt, "prompt must be text or a list of token ids")
        if not tokens:
            raise RequestError("prompt is empty")
        if len(tokens) > self.target.n_ctx:
            raise RequestError(f"prompt is {len(tokens)} tokens but n_ctx is {self.target.n_ctx}; "
                               "raise n_ctx (--n-ctx) or shorten the prompt")
        return tokens

    def calibration(self, *, force: bool = False):
        """This machine's speculation costs for these models (calibrate.Costs); measured on first use, cached."""
        if self._costs is None or force:
            from .calibrate import load_or_measure
            from .registry import home

            with self._lock:
                try:
                    self._costs = load_or_measure(self.target, self.draft, home() / "calibration", force=force,
                                                  stop=self._closing.is_set)
                except Cancelled:  # close() was called meanwhile: nothing was kept, it is measured next time
                    raise ModelError(f"{self.name} was closed while measuring its costs") from None
        return self._costs

    def token_kinds(self):
        """Each target token's kind (drafters.vocab_kinds), as auto reads them."""
        return vocab_kinds(self.target)

    def _prediction(self, req: Request, tokens: list[int], notes: list[str]) -> Prediction | None:
        if req.prediction is None:
            return None
        pred = (self.tokenize(req.prediction, add_special=False, parse_special=False)
                if isinstance(req.prediction, str) else self._ids(req.prediction, "prediction must be token ids"))
        room = self.target.n_ctx - len(tokens)
        if len(pred) > room:  # the output cannot be longer than the room left: neither need the prediction be
            notes.append(f"the prediction ({len(pred)} tokens) is longer than the room left in n_ctx; "
                         f"its first {max(room, 0)} tokens are used")
            pred = pred[:max(room, 0)]
        if req.drafter in ("none", "model"):
            notes.append(f"drafter {req.drafter!r} does not draft from a prediction; use 'auto', 'ngram' or 'hybrid'")
        return Prediction(pred, len(tokens)) if pred else None

    def _drafter(self, req: Request, seed: int, tokens: list[int], notes: list[str],
                 grammar) -> tuple[str, Drafter, bool]:
        """(name, drafter, whether to prefill the draft model with the prompt)."""
        name, drafter, prefill_draft = self._free_drafter(req, seed, tokens, notes, grammar,
                                                          self._prediction(req, tokens, notes))
        if grammar is not None and name not in ("none", "auto"):  # auto drafts the forced tokens itself
            drafter = GrammarDrafter(grammar, drafter)
        return name, drafter, prefill_draft

    def _free_drafter(self, req: Request, seed: int, tokens: list[int], notes: list[str], grammar,
                      prediction: Prediction | None) -> tuple[str, Drafter, bool]:
        name = req.drafter or defaults.DRAFTER
        if name in ("model", "hybrid") and self.draft is None:
            raise RequestError(f"drafter {name!r} needs a draft model: load one (draft=PATH, --draft) "
                               "or use drafter 'auto', 'ngram' or 'none'")
        if name == "none":
            return name, NoDrafter(), False
        if name == "ngram":
            return name, NgramDrafter(prediction=prediction), False
        model = (ModelDrafter(self.draft, req.sampling, seed=seed, p_min=req.p_min, prompt_len=len(tokens),
                              target_vocab=self.target.n_vocab, grammar=grammar) if self.draft is not None else None)
        fits = model is not None and model.fits(tokens)
        if model is not None and not fits:
            why = (f"the prompt ({len(tokens)} tokens) does not fit the draft model's context "
                   f"(n_ctx_draft={self.draft.n_ctx})" if len(tokens) >= self.draft.n_ctx else
                   f"the prompt holds token ids the draft model lacks (its vocabulary has {self.draft.n_vocab})")
            if name == "model":
                raise RequestError(f"drafter 'model' cannot draft for this request: {why}; raise --n-ctx-draft, "
                                   "or use drafter 'auto' or 'ngram', which stand aside")
            notes.append(f"the draft model stands aside: {why}")
        if name == "auto":
            auto = AutoDrafter(self.calibration(), NgramDrafter(n_min=1, n_max=8), model if fits else None,
                               sample_rows=not req.sampling.greedy, grammar=grammar, prediction=prediction,
                               kinds=self.token_kinds())
            # Where the draft model cannot pay on this machine even if always right (most CPUs), its cache is
            # left alone; where it can, it is prefilled with the prompt, so drafting never waits for that.
            return name, auto, fits and auto.model_may_win(len(tokens))
        if name == "model":
            return name, model, True
        return name, HybridDrafter(NgramDrafter(prediction=prediction), model), fits

    # -- generation --
    def stream(self, prompt: str | Sequence[int], *, cancel: Callable[[], bool] | None = None,
               trace: Callable[[dict], None] | None = None, **options) -> Stream:
        """Generate, yielding one Event per token; `.stats` is set once the stream ends.

        prompt: text (special tokens such as <|im_start|> are recognised) or token ids.
        options: max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, frequency_penalty,
        presence_penalty, penalty_last_n, seed, drafter ('auto', 'model', 'ngram', 'hybrid', 'none'), accept
        ('rejection', 'greedy', 'threshold'), k, p_min, threshold, stop; at most one constraint on the
        output: json_schema (a dict or JSON text), grammar (Lark or llama.cpp GBNF), regex, json_object=True;
        prediction (text or token ids the output is expected to resemble: drafted from, never trusted);
        logprobs=N (0..20: each Event's logprob and top_logprobs).
        cancel: a callable checked between prefill chunks and rounds; when it returns True the stream ends
        with finish_reason 'cancelled'.
        trace: a callable given one dict per round (trace_row): what was drafted and accepted, how long it took,
        and with drafter='auto' what it chose and expected of the round.
        """
        for name, f in (("cancel", cancel), ("trace", trace)):
            if f is not None and not callable(f):
                raise RequestError(f"{name} must be a callable (or None), got {type(f).__name__}")
        if self._closing.is_set():
            raise ModelError(f"{self.name} is closed: load the models again to generate")
        halt, closing, asked = threading.Event(), self._closing.is_set, cancel
        stopped = lambda: halt.is_set() or closing()  # noqa: E731 - Stream.close() or Engine.close()
        cancel = (lambda: asked() or stopped()) if asked is not None else stopped  # noqa: E731
        req = make_request(**(self.defaults | {k: v for k, v in options.items() if v is not None}))
        tokens = self._prompt_tokens(prompt)
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        notes: list[str] = []
        spec = req.constraint()
        grammar = Grammar(self.target, spec) if spec is not None else None
        name, drafter, prefill_draft = self._drafter(req, seed, tokens, notes, grammar)
        k = req.k or (defaults.K_FIXED if name != "auto" else
                      defaults.K_PREDICTION if req.prediction is not None else defaults.K_AUTO)
        if k > self.target.n_batch - 1:  # [pending, d1..dk] must fit one decode
            notes.append(f"k={k} is more than one decode holds: clamped to {self.target.n_batch - 1} "
                         f"(n_batch={self.target.n_batch})")
            k = self.target.n_batch - 1
        draft_model = self.draft if name in ("model", "hybrid", "auto") else None
        facts = speculate(self.target, draft_model, drafter, tokens, max_tokens=req.max_tokens, k=k, rule=req.accept,
                          params=req.sampling, seed=seed, tau=req.threshold, prefill_draft=prefill_draft,
                          lock=self._lock, cancel=cancel, grammar=grammar or Unconstrained(),
                          top_logprobs=req.logprobs)
        return Stream(facts, self.target.piece, stop=req.stop, drafter=name, rule=req.accept, k=k,
                      prompt_tokens=len(tokens), seed=seed, notes=notes, trace=trace, halt=halt, stopped=stopped)

    def generate(self, prompt: str | Sequence[int], **options) -> Result:
        """Generate to the end and return the text, tokens, from_draft flags, finish_reason and stats."""
        s = self.stream(prompt, **options)
        events = list(s)
        return Result("".join(e.text for e in events), [e.token for e in events], [e.from_draft for e in events],
                      s.finish_reason, s.stats,
                      [(e.logprob, e.top_logprobs) for e in events] if options.get("logprobs") is not None else None)

    def create_chat_completion(self, messages: Sequence[dict], *, stream: bool = False, tools=None, tool_choice=None,
                               parallel_tool_calls: bool | None = None, response_format: dict | None = None,
                               logprobs: bool | None = None, top_logprobs: int | None = None,
                               prediction: dict | None = None, stream_options: dict | None = None, **options):
        """OpenAI-shaped chat completion dicts, as llama-cpp-python's Llama.create_chat_completion returns.

        OpenAI's own fields: response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"name", "schema"}}); tools / tool_choice / parallel_tool_calls (calls come back in message.tool_calls
        with finish_reason "tool_calls"); logprobs / top_logprobs; prediction ({"type": "content", "content":
        TEXT}); stream_options ({"include_usage": true}). Other options as for stream(), except that without
        max_tokens the reply runs until it ends or the context is full (as llama-cpp-python's).
        """
        from .openai_request import content_stops, extras, structured
        from .openai_shapes import chat_chunks, chat_completion
        from .tools import for_template

        extra, _, tools, fmt = structured(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                          response_format=response_format, template=self.target.chat_template(),
                                          token_of=self.single_token)
        fields = {k: v for k, v in dict(logprobs=logprobs, top_logprobs=top_logprobs, prediction=prediction,
                                        stream_options=stream_options).items() if v is not None}
        more, _, include_usage = extras(fields, chat=True)
        if options.get("max_tokens") is None and "max_tokens" not in self.defaults:
            options["max_tokens"] = self.target.n_ctx  # as OpenAI and llama-cpp-python: until the context is full
        stop = ()
        if fmt is not None:  # calls are parsed: the stop strings end the content, not a call (openai_shapes.Chat)
            make_request(stop=options.get("stop"))  # refused here as the engine would refuse it
            stop = content_stops(options)
        s = self.stream(self.chat_tokens(for_template(messages), tools=tools), **(options | extra | more))
        if stream:
            return chat_chunks(self.name, s, fmt, tools, self.target.piece, include_usage, stop)
        return chat_completion(self.name, s, fmt, tools, self.target.piece, stop)

    def close(self) -> None:
        """Free both models (after the round or prefill chunk in progress, if another thread is generating: its
        stream ends 'cancelled'). A closed engine, and a stream still open on it, raise ModelError instead of
        touching freed memory."""
        self._closing.set()
        with self._lock:
            for m in (self.target, self.draft):
                if m is not None:
                    m.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
