"""Concurrent requests share one llama_decode.

Each request runs the one decoding loop (loop.speculate) in its own thread and its own sequence of each model's
KV cache (model.Seq). A thread inside a round is a *member*. A member's decode waits until every member is
waiting on one (of the target or of the draft model); then one of them runs each model's waiting decodes as
one llama_decode and hands each its own logit rows. A member whose consumer is reading between rounds is not
inside one, so nobody waits for it. `exclusive()` waits until no member is inside a round and keeps new ones
out (closing the models, measuring their costs).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Job:
    seq: object  # model.Seq
    tokens: list[int]
    logits: str  # "none", "last" or "all"
    thread: int = field(default_factory=threading.get_ident)
    rows: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False


class Batcher:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._members: dict[int, int] = {}  # thread id -> how many rounds deep
        self._jobs: list[Job] = []  # waiting, in arrival order
        self._running = False
        self._exclusive: int | None = None  # the thread holding exclusive()
        self._width: dict[object, tuple[int, int, int]] = {}  # seq -> (its tokens, all tokens, sequences) of its
        # latest decode with others

    def __enter__(self) -> None:
        """`with batcher:` around one round of a request's loop (what speculate calls its lock)."""
        me = threading.get_ident()
        with self._cond:
            self._cond.wait_for(lambda: self._exclusive in (None, me) or me in self._members)
            self._members[me] = self._members.get(me, 0) + 1

    def __exit__(self, *exc) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._members[me] == 1:
                del self._members[me]
                self._cond.notify_all()  # the others may all be waiting now
            else:
                self._members[me] -= 1

    @contextlib.contextmanager
    def exclusive(self):
        """No other thread decodes meanwhile: rounds in progress end first, new ones wait."""
        me = threading.get_ident()
        with self._cond:
            self._cond.wait_for(lambda: self._exclusive is None)
            self._exclusive = me
            self._cond.wait_for(lambda: not (self._members.keys() - {me}) and not self._running)
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = None
                self._cond.notify_all()

    def others(self, seq) -> tuple[int, int]:
        """(tokens of the other sequences, sequences in all) in seq's latest decode: what its next one will
        likely share a llama_decode with."""
        own, total, n = self._width.get(seq, (0, 0, 1))
        return total - own, max(n, 1)

    def decode(self, seq, tokens: list[int], logits: str) -> np.ndarray | None:
        """Decode `tokens` in seq (model.Seq._run_jobs does the work) together with whatever the other
        members ask at the same time; seq's logit rows (a copy)."""
        job = Job(seq, tokens, logits)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()
            while not job.done:
                if self._running or not self._ready():
                    self._cond.wait()
                    continue
                groups, self._running = self._take(), True
                self._cond.release()
                try:
                    for model, jobs in groups.items():
                        try:
                            model._run_jobs(jobs)
                        except BaseException as e:  # noqa: BLE001 - each waiting thread raises it as its own
                            for j in jobs:
                                j.error = e
                        self._note(jobs)
                finally:
                    self._cond.acquire()
                    self._running = False
                    for jobs in groups.values():
                        for j in jobs:
                            j.done = True
                    self._cond.notify_all()
        if job.error is not None:
            raise job.error
        return job.rows

    def _ready(self) -> bool:
        """Every member waits on a decode (a thread that is not a member waits alone)."""
        waiting = {j.thread for j in self._jobs}
        return bool(self._jobs) and not (self._members.keys() - waiting)

    def _take(self) -> dict[object, list[Job]]:
        """The waiting jobs in arrival order, by model, as many as one llama_decode of each holds."""
        groups: dict[object, list[Job]] = {}
        used: dict[object, int] = {}
        rest = []
        for j in self._jobs:
            m = j.seq.model
            if used.get(m, 0) + len(j.tokens) <= m.n_batch or m not in used:
                groups.setdefault(m, []).append(j)
                used[m] = used.get(m, 0) + len(j.tokens)
            else:
                rest.append(j)
        self._jobs = rest
        return groups

    def _note(self, jobs: list[Job]) -> None:
        total = sum(len(j.tokens) for j in jobs)
        for j in jobs:
            self._width[j.seq] = (len(j.tokens), total, len(jobs))
