"""Concurrent requests share one llama_decode, formed and run by one scheduler thread.

Each request runs the one decoding loop (loop.speculate) in its own sequence of each model's KV cache
(model.Seq, the same id in both models: its slot), read by its own thread. Request threads only enqueue their
work (a prompt's prefill chunk, a round's verify or draft step: a Job) and wait for it; the scheduler thread
forms each batch, runs it as one llama_decode per model and hands every job its rows or its error. No request
thread ever runs another's work, and a decode that fails fails only the jobs that fail alone (the others of
its batch are run again apart): nothing is left queued for a sequence whose request has gone.

While a request holds its slot, the scheduler expects a decode from it each round: a batch waits until every
held slot has asked for one (of the target or of the draft model), then they run together and each gets its
own logit rows. A request whose reader is away (between rounds, its consumer slow) is waited for a short while
only (a quarter of the last decode), so it delays the others by little and joins again next round.

Prompts are prefilled one at a time per model, the shortest first (one chunk per decode, beside the other
requests' rounds): requests that arrive together then see their first tokens in turn, a short one soon, instead
of all at the end of every prefill. An idle scheduler waits a moment (GATHER) when a prompt arrives, so that the
shortest of the prompts sent with it goes first, not whichever reached it first. A prefill passed over counts
as one chunk shorter each time, so a long prompt is not put off for ever by short ones. A request's first
round, right after its prefill, waits for no chunk: the decode it is in holds the rounds only (its first token
would otherwise wait out the next prompt's). A job whose request was cancelled (its client left) is dropped
from the queue, by its own thread at once or by the scheduler before it would run: a cancelled prompt's
remaining chunks never run.

The scheduler thread is also the only one that computes (llama.cpp's OpenMP build gives each thread that calls
into it a team of worker threads that spin a while after each decode; a team per request thread fought for a
small machine's cores). `with batcher:` marks a round in progress; `exclusive()` waits until none is and keeps
new ones out (closing the models, measuring their costs).
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import LocalspecError
from .llama import Cancelled, DecodeError, ModelError

POLL_S = 0.25  # a waiting request looks this often whether it was cancelled and whether the scheduler still runs


@dataclass(eq=False)
class Job:
    seq: object  # model.Seq
    tokens: list[int]
    logits: str  # "none", "last" or "all"
    prefill: int = 0  # a prompt's prefill: its tokens left, these included (0: not a prefill)
    first: bool = False  # the first round after a prefill: a request's first token waits on it
    cancel: Callable[[], bool] | None = None  # the request's own: once it says so, the job is not run
    thread: int = field(default_factory=threading.get_ident)
    rows: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False


class Batcher:
    LINGER = (0.001, 0.02)  # seconds a decode waits at most for a request that is away: a quarter of the last
    # decode, within these bounds
    AGING = 128  # tokens a waiting prefill counts as shorter each time another is run before it
    GATHER = (0.0005, 0.01)  # seconds an idle batcher waits, when a prompt arrives, for others arriving with it
    # (a fiftieth of its first chunk's time as the latest prefill measured it, within these bounds), so that
    # the shortest of them goes first and not whichever came first: requests sent together reach it within a
    # few milliseconds (HTTP, tokenizing), and a prefill chunk takes a machine from milliseconds to seconds

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._held: set[int] = set()  # slots (sequence ids) of the requests in progress
        self._thread_of: dict[int, int] = {}  # slot -> the thread that asked its latest decode
        self._rounds: dict[int, int] = {}  # thread id -> rounds in progress (exclusive waits for none)
        self._jobs: list[Job] = []  # waiting, in arrival order
        self._since = 0.0  # when the oldest waiting job arrived
        self._last_s = 4 * self.LINGER[1]  # how long the latest decode took
        self._running = False  # the scheduler is running a batch (outside the lock)
        self._exclusive: int | None = None  # the thread holding exclusive()
        self._width: dict[object, tuple[int, int, int]] = {}  # seq -> (its tokens, all tokens, sequences) of its
        # latest decode with others
        self._passed: dict[object, int] = {}  # seq -> decodes its prefill has been passed over in since it ran
        self._prefilled: set[object] = set()  # seqs whose latest decode was a prefill chunk
        self._gather_until = 0.0  # an idle batcher's first prefill waits until then for others (GATHER)
        self._per_token = 0.0  # seconds a token of the latest decode with a prefill chunk took (0: none yet)
        self._closed = False
        self._scheduler: threading.Thread | None = None  # started with the first job

    # -- who takes part --
    @contextlib.contextmanager
    def holding(self, slot: int):
        """Around a request's life in its slot: each round waits for its decode."""
        with self._cond:
            self._held.add(slot)
        try:
            yield
        finally:
            with self._cond:
                self._held.discard(slot)
                self._thread_of.pop(slot, None)
                # what a prefill left unfinished (cancelled) knew of its seqs
                self._passed = {s: n for s, n in self._passed.items() if s.id != slot}
                self._prefilled = {s for s in self._prefilled if s.id != slot}
                self._cond.notify_all()  # the others may all be waiting now

    def __enter__(self) -> None:
        """`with batcher:` around one round of a request's loop (what speculate calls its lock)."""
        me = threading.get_ident()
        with self._cond:
            self._cond.wait_for(lambda: self._exclusive in (None, me) or me in self._rounds)
            self._rounds[me] = self._rounds.get(me, 0) + 1

    def __exit__(self, *exc) -> None:
        me = threading.get_ident()
        with self._cond:
            self._rounds[me] -= 1
            if not self._rounds[me]:
                del self._rounds[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        """No other thread decodes meanwhile: rounds in progress end first, new ones wait. The holder's own
        decodes still go through the scheduler (they run at once)."""
        me = threading.get_ident()
        with self._cond:
            self._cond.wait_for(lambda: self._exclusive is None)
            self._exclusive = me
            self._cond.wait_for(lambda: not (self._rounds.keys() - {me}) and not self._running)
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = None
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the scheduler (once the models are closed: nothing decodes any more); a job still waiting is
        answered with ModelError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._scheduler is not None and self._scheduler is not threading.current_thread():
            self._scheduler.join(timeout=5.0)

    def others(self, seq) -> tuple[int, int]:
        """(tokens of the other sequences' rounds, sequences in all) in seq's latest decode: what its next one
        will likely share a llama_decode with. Prefill chunks are left out: priced as a share of the round, a
        chunk made plain decoding look dear and a long draft cheap beside it."""
        own, total, n = self._width.get(seq, (0, 0, 1))
        return total - own, max(n, 1)

    # -- a request's side: enqueue and wait --
    def decode(self, seq, tokens: list[int], logits: str, prefill: int = 0,
               cancel: Callable[[], bool] | None = None) -> np.ndarray | None:
        """Decode `tokens` in seq together with what the other requests ask at the same time (the scheduler
        thread runs it: its model's _run_jobs); seq's logit rows (a copy). prefill: see Job. cancel: checked
        while the job waits; once it returns True the job leaves the queue and Cancelled is raised."""
        job = Job(seq, tokens, logits, prefill, cancel=cancel)
        with self._cond:
            if self._closed:
                raise ModelError("the models are closed: load them again to generate")
            if self._scheduler is None:
                self._scheduler = threading.Thread(target=self._schedule, name="localspec-decode", daemon=True)
                self._scheduler.start()
            job.first = not prefill and seq in self._prefilled
            (self._prefilled.add if prefill else self._prefilled.discard)(seq)
            if not self._jobs:
                self._since = time.perf_counter()
                if prefill and not self._running:  # a prompt reaches an idle batcher: others may come with it
                    share = len(tokens) * self._per_token / 50 if self._per_token else self.GATHER[1]
                    self._gather_until = self._since + min(max(share, self.GATHER[0]), self.GATHER[1])
            self._jobs.append(job)
            self._thread_of[seq.id] = job.thread
            self._cond.notify_all()
            try:
                while not job.done:
                    self._cond.wait(POLL_S)
                    if job.done:
                        break
                    if job in self._jobs and cancel is not None and cancel():
                        raise Cancelled("cancelled while waiting to be decoded")  # not taken: it never runs
                    if not self._scheduler.is_alive():  # never expected: said rather than waited on for ever
                        raise ModelError("the decode scheduler has stopped: load the models again")
            except BaseException:
                # cancelled, or an interrupt in this thread (Ctrl-C): a job not taken leaves the queue; one being
                # run is waited for, so its sequence is never changed behind its request's back
                if job in self._jobs:
                    self._jobs.remove(job)
                    job.done = True
                    self._cond.notify_all()
                while not job.done and self._scheduler.is_alive():
                    self._cond.wait(POLL_S)
                raise
        if job.error is not None:
            raise job.error
        return job.rows

    # -- the scheduler's side --
    def _schedule(self) -> None:
        """The scheduler thread: form each batch, run it, answer its jobs."""
        with self._cond:
            while True:
                if self._closed:
                    for job in self._jobs:
                        job.error, job.done = ModelError("the models were closed before this decode ran"), True
                    self._jobs = []
                    self._cond.notify_all()
                    return
                wait = self._wait() if self._jobs else None
                if wait is None or wait > 0:
                    self._cond.wait(wait)
                    continue
                groups, self._running, self._gather_until = self._take(), True, 0.0
                self._cond.release()
                try:
                    self._step(groups)
                finally:
                    self._cond.acquire()
                    self._running = False
                    for jobs in groups.values():
                        for j in jobs:
                            j.done = True
                    if self._jobs:
                        self._since = time.perf_counter()
                    self._cond.notify_all()

    def _step(self, groups: dict[object, list[Job]]) -> None:
        """Run one batch and time it; whatever goes wrong is its jobs' error, never the scheduler's end."""
        try:
            t = time.perf_counter()
            self._run(groups)
            self._last_s = time.perf_counter() - t
            jobs = [j for js in groups.values() for j in js]
            n = sum(len(j.tokens) for j in jobs)  # a chunk wholly borrowed from another sequence ran nothing
            if n and any(j.prefill for j in jobs):
                self._per_token = self._last_s / n
        except BaseException as e:  # noqa: BLE001 - answered to the jobs, never raised in this thread
            for js in groups.values():
                for j in js:
                    if j.error is None and j.rows is None:
                        j.error = e

    def _run(self, groups: dict[object, list[Job]]) -> None:
        for model, jobs in groups.items():
            try:
                model._run_jobs(jobs)
            except Exception as e:  # noqa: BLE001 - find whose decode fails: each runs again alone
                if len(jobs) == 1:
                    self._fail(jobs[0], e)
                    continue
                for j in jobs:
                    try:
                        model._run_jobs([j])
                    except Exception as alone:  # noqa: BLE001
                        self._fail(j, alone)
                jobs = [j for j in jobs if j.error is None]
            # a prompt's prefill is work done whatever is drafted: it does not make a round look dear
            rounds = [j for j in jobs if not j.prefill]
            total = sum(len(j.tokens) for j in rounds)
            for j in rounds:
                self._width[j.seq] = (len(j.tokens), total, len(rounds))

    @staticmethod
    def _fail(job: Job, e: Exception) -> None:
        """A decode that failed alone: the job's error, typed (DecodeError where it was not already one of
        ours), and its sequence emptied, cells and token list, so no later request reuses what it left."""
        if isinstance(e, LocalspecError):
            job.error = e
        else:
            job.error = DecodeError(f"decoding failed ({type(e).__name__})")
            job.error.__cause__ = e
        try:
            job.seq.clear()
        except Exception:  # noqa: BLE001 - a closed model has nothing left to clear
            pass

    def _wait(self) -> float:
        """Seconds to wait for more requests' decodes before running the waiting ones (0: run now)."""
        asked = {j.seq.id for j in self._jobs}
        waiting = {j.thread for j in self._jobs}
        # a request read by a thread that waits here for another one's decode cannot ask (one thread reading
        # several streams in turn): nobody waits for it
        if self._exclusive is not None:
            return 0.0
        if all(j.prefill for j in self._jobs) and self._gather_until > time.perf_counter():
            return self._gather_until - time.perf_counter()
        if all(self._thread_of.get(s) in waiting for s in self._held - asked):
            return 0.0
        linger = min(max(self._last_s / 4, self.LINGER[0]), self.LINGER[1])
        return max(self._since + linger - time.perf_counter(), 0.0)

    def _take(self) -> dict[object, list[Job]]:
        """The jobs of the next llama_decode of each model: its shortest waiting prefill (by tokens left, less
        AGING for each time it was passed over) first, then the other requests' rounds in arrival order, as
        many as n_batch holds. The other prefills wait; all of them do while a request's first round waits.
        Jobs whose request was cancelled are answered Cancelled here and never run."""
        live = []
        for j in self._jobs:
            try:
                gone = j.cancel is not None and j.cancel()
            except Exception as e:  # noqa: BLE001 - the request's own callable failed: its job ends with that
                gone, j.error = True, e
            if gone:
                j.error, j.done = j.error or Cancelled("cancelled while waiting to be decoded"), True
            else:
                live.append(j)
        self._jobs = live
        chosen: dict[object, Job] = {}
        hurry = {j.seq.model for j in self._jobs if j.first}
        for j in self._jobs:
            m = j.seq.model
            if j.prefill and m not in hurry and (m not in chosen or self._due(j) < self._due(chosen[m])):
                chosen[m] = j
        groups: dict[object, list[Job]] = {m: [j] for m, j in chosen.items()}
        used: dict[object, int] = {m: len(j.tokens) for m, j in chosen.items()}
        rest = []
        for j in self._jobs:
            m = j.seq.model
            if chosen.get(m) is j:
                continue
            if not j.prefill and (m not in used or used[m] + len(j.tokens) <= m.n_batch):
                groups.setdefault(m, []).append(j)
                used[m] = used.get(m, 0) + len(j.tokens)
            else:
                if j.prefill and m in chosen:
                    self._passed[j.seq] = self._passed.get(j.seq, 0) + 1
                rest.append(j)
        for j in chosen.values():
            self._passed.pop(j.seq, None)
        self._jobs = rest
        return groups

    def _due(self, job: Job) -> int:
        return job.prefill - self.AGING * self._passed.get(job.seq, 0)
