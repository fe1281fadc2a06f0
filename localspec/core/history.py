"""What earlier requests generated, as a draft source for the next ones (a suffix index over past outputs).

Apps repeat themselves: the same JSON shape over many documents, the same tool-call skeleton every agent step,
the same code regenerated after a small edit. Each finished request adds its output (with the last few prompt
tokens before it, so the output's opening is found too) to a bounded store; a round looks up the context's
tail there and proposes what followed it, as SuffixDecoding (Oliaro et al. 2024) does with a suffix tree.

Here the index maps each ANCHOR-token window of the stored tokens to where it ends; a lookup takes the latest
CANDIDATES places that end like the context, measures how far back each agrees with it (the match), keeps
the longest matches, and walks forward while most of them agree on the next token (the counts a suffix tree
keeps at each node). Drafts are point masses, verified like any other, so history never changes an output's
distribution; it changes only how fast it comes (and so, across API keys, it could leak timing: a server
keeps one History per key).
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .match import longest_match

ANCHOR = 3  # tokens a place must share with the context's end to be a candidate
CANDIDATES = 64  # latest places per anchor a lookup looks at: bounds its cost whatever the store holds
MAX_MATCH = 32  # how far back a match is measured
PROMPT_TAIL = 16  # prompt tokens kept before each output: where its opening is found
BYTES_PER_TOKEN = 130  # the index's Python objects per stored token, at most (dict slot, int): measured in tests
SHARE = 0.5  # a continuation goes on while at least this share of the places still agreeing agree on the next


@dataclass(frozen=True, slots=True)
class Found:
    """A lookup's answer: the size of the longest match, how many places matched that far, the tokens that
    followed there (while most of those places agree), and for each token the share of the places that
    agreed up to it which also agree on it."""

    size: int
    support: int
    tokens: list[int]
    shares: list[float]


NOTHING = Found(0, 0, [], [])


@dataclass
class Learned:
    """What drafting from one scope's history has been worth, learned across its requests (auto keeps it, under
    the scope's lock: requests decoded together update it at once): its acceptance statistics by the match's
    features, and how the kind of token a guess holds moves its odds (auto.KindOdds, made on first use)."""

    stats: dict = field(default_factory=dict)
    kinds: object = None


def _key(a: int, b: int, c: int) -> int:
    return (a << 42) | (b << 21) | c  # token ids below 2**21 (vocabularies are ~150k)


def _index(index: dict, tokens: np.ndarray, start: int, end: int) -> None:
    """Add the ANCHOR-token windows of tokens[start:end] to index (anchor key -> position(s) of its last token)."""
    t = tokens[start:end].astype(np.int64)
    keys = (t[:-2] << 42) | (t[1:-1] << 21) | t[2:]
    for pos, key in zip(range(start + ANCHOR - 1, end), keys.tolist()):
        bucket = index.get(key)
        if bucket is None:
            index[key] = pos  # most windows occur once: a list only from the second on
        elif type(bucket) is int:
            index[key] = [bucket, pos]
        else:
            bucket.append(pos)


class SuffixCache:
    """Past outputs of one scope (a model, an API key), bounded to `max_bytes` (the oldest go first)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.tokens = np.empty(1024, dtype=np.int32)  # stored sequences, each followed by -1
        self.size = 0
        self.starts: list[int] = []  # where each stored sequence begins
        self.index: dict[int, int | list[int]] = {}  # anchor key -> position(s) of the anchor's last token
        self.lock = threading.Lock()  # the store and `learned`
        self._adding = threading.Lock()  # one adder at a time (it rebuilds the store without `lock` held)
        # an app's outputs repeat in ways its requests share: what drafting from them was worth is the scope's
        self.learned = Learned()

    @property
    def nbytes(self) -> int:
        """What the store holds, estimated: its token array and its index."""
        return self.tokens.nbytes + BYTES_PER_TOKEN * self.size

    def add(self, tokens: Sequence[int], held: bool = False) -> None:
        """Keep one finished sequence (prompt tail + output); held: the caller holds _adding already."""
        seq = np.asarray(tokens, dtype=np.int32)
        if len(seq) <= ANCHOR or int(seq.min()) < 0 or int(seq.max()) >= 1 << 21:
            return
        if (len(seq) + 1) * (4 + BYTES_PER_TOKEN) > self.max_bytes:
            room = self.max_bytes // (2 * (4 + BYTES_PER_TOKEN))  # one huge output keeps its end
            if room <= ANCHOR:
                return
            seq = seq[-room:]
        with nullcontext() if held else self._adding:
            with self.lock:
                if self.size + len(seq) + 1 > len(self.tokens):
                    grown = np.empty(max(2 * len(self.tokens), self.size + len(seq) + 1), dtype=np.int32)
                    grown[:self.size] = self.tokens[:self.size]
                    self.tokens = grown
                at = self.size
                self.tokens[at:at + len(seq)] = seq
                self.tokens[at + len(seq)] = -1
                self.starts.append(at)
                self.size = at + len(seq) + 1
                _index(self.index, self.tokens, at, at + len(seq))
                full = self.nbytes > self.max_bytes
            if full:  # indexed anew without the lock (~1 s at 64 MB): lookups meanwhile read the store as it was
                evicted = self._evicted()
                with self.lock:
                    self.tokens, self.size, self.starts, self.index = evicted

    def _evicted(self) -> tuple[np.ndarray, int, list[int], dict]:
        """The store without its oldest sequences, at most 3/4 full, and its index anew (made while only the
        adder, holding _adding, could change the store)."""
        budget = self.max_bytes * 3 // 4
        keep_from = len(self.starts) - 1
        while keep_from > 0 and (self.size - self.starts[keep_from - 1]) * (4 + BYTES_PER_TOKEN) <= budget:
            keep_from -= 1
        cut = self.starts[keep_from]
        rest = self.tokens[cut:self.size]
        tokens = np.empty(max(1024, 2 * len(rest)), dtype=np.int32)
        tokens[:len(rest)] = rest
        starts = [s - cut for s in self.starts[keep_from:]]
        index: dict = {}
        for i, s in enumerate(starts):
            _index(index, tokens, s, starts[i + 1] - 1 if i + 1 < len(starts) else len(rest) - 1)
        return tokens, len(rest), starts, index

    def lookup(self, context: Sequence[int], n: int) -> Found:
        """What followed the longest earlier match of the context's end, up to n tokens, or NOTHING."""
        if n <= 0 or len(context) < ANCHOR:
            return NOTHING
        a, b, c = (int(x) for x in context[-ANCHOR:])
        if max(a, b, c) >= 1 << 21:
            return NOTHING
        with self.lock:
            ends = self.index.get(_key(a, b, c))
            if ends is None:
                return NOTHING
            ends = np.asarray([ends] if type(ends) is int else ends[-CANDIDATES:], dtype=np.int64)
            buf = self.tokens[:self.size]
            ends = ends[buf[ends + 1] >= 0]  # places with something after them (the last cell is always -1)
            if not ends.size:
                return NOTHING
            # the places that agree furthest back with the context (a -1 separator never equals a token)
            places, size = longest_match(buf, ends, np.asarray(context[-MAX_MATCH:], dtype=np.int32))
            support = len(places)
            tokens, shares = [], []
            for step in range(1, n + 1):
                nxt = buf[np.minimum(places + step, self.size - 1)]
                nxt = nxt[places + step < self.size]
                nxt = nxt[nxt >= 0]
                if not nxt.size:
                    break
                values, counts = np.unique(nxt, return_counts=True)
                best = counts.max()
                # the most frequent next token; among equals, the latest place's
                top = values[counts == best]
                tok = int(top[0]) if len(top) == 1 else int(next(t for t in nxt[::-1] if t in top))
                share = best / len(places)
                if share < SHARE:
                    break
                tokens.append(tok)
                shares.append(float(share))
                places = places[buf[np.minimum(places + step, self.size - 1)] == tok]
        return Found(size, support, tokens, shares)


class History:
    """One SuffixCache per scope (an API key; '' for the process's own requests), each bounded to `mb` MB;
    at most `scopes` scopes, the least recently used forgotten first.

    keeper: where scopes outlive the process (store.history.HistoryFiles): a scope's kept outputs are read when
    it is first used, and new ones handed back every SAVE_EVERY outputs, when the scope is forgotten and on save()."""

    SAVE_EVERY = 16

    def __init__(self, mb: float, scopes: int = 16, keeper=None):
        self.max_bytes, self.scopes, self.keeper = int(mb * 2 ** 20), scopes, keeper
        self._caches: dict[str, SuffixCache] = {}
        self._unsaved: dict[str, list[list[int]]] = {}
        self._lock = threading.Lock()

    def cache(self, scope: str = "") -> SuffixCache:
        forgotten, fresh = [], False
        with self._lock:
            c = self._caches.pop(scope, None)
            if c is None:
                c, fresh = SuffixCache(self.max_bytes), True
                c._adding.acquire()  # filled from its file below: adds wait for that, lookups see what is in
            self._caches[scope] = c  # most recently used last
            while len(self._caches) > self.scopes:
                old = next(iter(self._caches))
                del self._caches[old]
                forgotten.append((old, self._unsaved.pop(old, [])))
        for old, seqs in forgotten:
            if seqs:
                self.keeper.save(old, seqs)
        if fresh:  # read without the scopes' lock: other scopes' requests do not wait for this file
            try:
                for seq in self.keeper.load(scope) if self.keeper is not None else ():
                    c.add(seq, held=True)
            finally:
                c._adding.release()
        return c

    def record(self, scope: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep a finished request's output (after its prompt's last PROMPT_TAIL tokens)."""
        if not output:
            return
        seq = [*prompt[-PROMPT_TAIL:], *output]
        self.cache(scope).add(seq)
        if self.keeper is not None:
            with self._lock:
                pending = self._unsaved.setdefault(scope, [])
                pending.append(seq)
                due = self._unsaved.pop(scope) if len(pending) >= self.SAVE_EVERY else None
            if due:
                self.keeper.save(scope, due)

    def save(self) -> None:
        """Hand every output not yet kept to the keeper (the engine does this when it closes)."""
        with self._lock:
            unsaved, self._unsaved = self._unsaved, {}
        for scope, seqs in unsaved.items():
            if seqs and self.keeper is not None:
                self.keeper.save(scope, seqs)
