"""What users read: Events (one per token, with its text), Stats folded from the loop's facts, the Stream
that carries both, and the Result of a whole generation."""
from __future__ import annotations

import inspect
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterator, Sequence

from . import acceptance
from .loop import Finish, Prefill, Round, Token
from .model import ModelError
from .text import TextStream


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
    prompt_reused: int  # prompt tokens not prefilled: held by the cache already (see prompt_restored)
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
    drafted_history: int  # draft tokens from earlier requests' outputs (history_mb), and how many were accepted
    accepted_history: int
    seed: int  # the request's seed (drawn at random when none was given): pass it again to reproduce a run
    notes: tuple[str, ...] = ()  # what the request asked for but did not get, and why
    prompt_restored: int = 0  # of prompt_reused, tokens restored from a kept prompt state (the prefix store)
    prompt_restored_from: str = ""  # 'ram' or 'disk' ('' where nothing was restored)
    # under a thinking span, per span ('thinking', 'answer'): tokens, rounds, drafted, accepted and seconds; a
    # round counts in the span it started in (the one that crosses the span's end, in 'thinking')
    spans: dict | None = None

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
        s = f"{self.generated} tokens in {self.gen_s:.2f}s ({self.gen_tps:.1f} tok/s), prompt {self.prompt_tokens:,}"
        if self.prompt_reused:
            where = (f"{self.prompt_restored_from}" if self.prompt_restored == self.prompt_reused else
                     f"{self.prompt_restored:,} {self.prompt_restored_from}" if self.prompt_restored else "kept")
            s += f" = {self.prompt_reused:,} cached ({where}) + {self.prompt_prefilled:,} prefilled"
        else:
            s += " prefilled"
        s += f" in {self.prompt_s:.2f}s; drafter {self.drafter}"
        if self.drafted:
            s += (f", accepted {self.accepted}/{self.drafted} ({self.acceptance_rate:.0%}), "
                  f"{self.mean_accepted:.2f} per round")
        if self.drafted_prediction:
            s += f" (prediction {self.accepted_prediction}/{self.drafted_prediction})"
        if self.drafted_history:
            s += f" (history {self.accepted_history}/{self.drafted_history})"
        for name, p in (self.spans or {}).items():
            s += f"; {name} {p['tokens']} tokens"
            if p["drafted"]:
                s += f" (accepted {p['accepted']}/{p['drafted']})"
            if p["seconds"] > 0:
                s += f" {p['tokens'] / p['seconds']:.1f} tok/s"
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
        forced, predicted, history = [0, 0], [0, 0], [0, 0]
        reason, held = "cancelled", None  # until the loop says why it ended: a consumer that closes early cancels
        last, got = None, 0  # the latest drafting round, and how many of its draft tokens this stream emitted
        spans: dict[str, dict] = {}  # per thinking span: what its rounds drafted and emitted (Stats.spans)
        span, t_span = None, 0.0  # the latest round's span, and when that round's fact came

        def close_span() -> None:
            if span is not None:
                span["seconds"] += time.perf_counter() - t_span

        def settle() -> None:
            """Count the latest round's accepted tokens as far as they were emitted: a stop sequence or a close
            mid-round leaves the rest of the round's tokens unread."""
            nonlocal acc
            acc += got
            for i in range(got):
                at[i] += 1
            if last.span:
                spans[last.span]["accepted"] += got
            forced[1] += min(got, last.forced)
            predicted[1] += min(max(got - last.forced, 0), last.predicted)
            if last.plan is not None and last.plan.source == "history":
                history[1] += max(got - last.forced, 0)

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
                    if span is not None:
                        span["tokens"] += 1
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
                    close_span()
                    span, t_span = None, time.perf_counter()
                    if f.span:
                        span = spans.setdefault(f.span, dict(tokens=0, rounds=0, drafted=0, accepted=0, seconds=0.0))
                        span["rounds"] += 1
                        span["drafted"] += f.drafted
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
                        if f.plan is not None and f.plan.source == "history":
                            history[0] += f.drafted - f.forced
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
            close_span()
            self.finish_reason = reason
            self.stats = Stats(finish_reason=reason, prompt_reused=pre.reused if pre else 0,
                               # + the prompt's last token, evaluated with the first round: reused +
                               # prefilled is the whole prompt
                               prompt_prefilled=pre.prefilled + 1 if pre else 0,
                               draft_prompt_reused=pre.draft_reused if pre else 0,
                               draft_prompt_prefilled=pre.draft_prefilled if pre else 0, prompt_s=pre.seconds if pre else 0.0,
                               prompt_restored=pre.restored if pre else 0,
                               prompt_restored_from=pre.restored_from if pre else "",
                               generated=n, gen_s=time.perf_counter() - t_gen, rounds=rounds, drafted=drafted,
                               accepted=acc, accepted_at=tuple(at), draft_s=t_d, verify_s=t_v,
                               drafted_forced=forced[0], accepted_forced=forced[1],
                               drafted_prediction=predicted[0], accepted_prediction=predicted[1],
                               drafted_history=history[0], accepted_history=history[1],
                               drafting_rounds=drafting, spans=spans or None, **self._meta)


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
