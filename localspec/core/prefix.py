"""Prompts that repeat start at once: a model's KV states for prompt prefixes, kept across requests.

A desktop app or an agent sends the same long head on every request (a system prompt, tool definitions, a
document, the conversation so far), and on a CPU prefilling it costs ~10 ms a token. A sequence's own cache
already keeps the latest prompt; this store keeps more of them, by content: when a request ends, the state of
its sequence (llama.cpp's per-sequence KV state: its cells, positions and K/V rows) is kept with its tokens; a
later prompt that starts with a kept one's tokens gets those cells restored (llama_state_seq_set_data) instead
of prefilled, and prefills only the rest.

Finding one: the tokens are cut into BLOCK-token blocks, each named by a hash chained over the blocks before
it (vLLM's prefix caching), and every kept state is indexed by each of its blocks' names. A prompt's longest
indexed block is where the longest candidates part from it; their tokens are then compared with the prompt's
(never trusted from the hash) and the one agreeing furthest is restored, and cut back to where it agrees.

Two tiers: the states themselves in RAM (up to ram_bytes, the least recently used dropped first) and, when the
engine is given a keeper (store.prefix.KvFiles), on disk, where they outlive the process: a state dropped
from RAM stays there and comes back when asked for. One store per model and settings (the keeper's folder is
named by everything that shapes the bytes); states are kept per scope, as history is: one API key's prompts
never make another's first token come sooner.

A state is worth keeping only where it adds MIN_NEW tokens or more to what is kept: one system prompt followed
by many questions keeps the first request's state, not one copy of the head per question; a conversation keeps
its latest turn, each one superseding the state it extends.
"""
from __future__ import annotations

import hashlib
import sys
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

BLOCK = 64  # tokens a block holds: where a match is found (it is then measured token by token)
MIN_KEEP = 2 * BLOCK  # a shorter sequence is not kept (prefilling it costs about as much as finding it)
MIN_NEW = 2 * BLOCK  # a state is kept only where it adds this many tokens to the longest one kept
MIN_GAIN = 16  # tokens a restore must add to what the sequence already holds to be worth it


def block_names(tokens: np.ndarray) -> list[bytes]:
    """The chained name of each whole block of tokens: block i's name hashes block i-1's name and its tokens, so
    equal names mean equal prefixes (up to a hash collision, which the token comparison catches)."""
    names, prev = [], b""
    data = np.ascontiguousarray(tokens, dtype=np.int32)
    for i in range(len(data) // BLOCK):
        prev = hashlib.blake2b(prev + data[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=16).digest()
        names.append(prev)
    return names


def agree(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass(eq=False)
class Entry:
    name: str  # the hex name of its whole-token chain and length: its file's name on disk
    tokens: np.ndarray  # int32: what the state's cells hold, positions 0..len-1
    blob: bytearray | None  # the state (None: on disk only)
    used: int = 0  # the store's clock at its latest use (least recently used goes first)


class Scope:
    """One scope's kept states and their index (block name -> entries holding that block)."""

    def __init__(self):
        self.entries: dict[str, Entry] = {}
        self.index: dict[bytes, set[str]] = {}

    def add(self, e: Entry) -> None:
        self.entries[e.name] = e
        for b in block_names(e.tokens):
            self.index.setdefault(b, set()).add(e.name)

    def drop(self, e: Entry) -> None:
        self.entries.pop(e.name, None)
        for b in block_names(e.tokens):
            held = self.index.get(b)
            if held is not None:
                held.discard(e.name)
                if not held:
                    del self.index[b]

    def best(self, tokens: np.ndarray) -> tuple[Entry | None, int]:
        """The entry agreeing with `tokens` furthest, and how far (tokens compared, not hashes)."""
        names = block_names(tokens)
        for i in range(len(names) - 1, -1, -1):
            held = self.index.get(names[i])
            if held:
                found = [(agree(self.entries[n].tokens, tokens), self.entries[n]) for n in held]
                n, e = max(found, key=lambda f: (f[0], f[1].used))
                if n > 0:
                    return e, n
        return None, 0


class PrefixCache:
    """The kept prompt states of an engine's models (see the module's docstring), in one RAM budget.
    Thread-safe: requests decoded together look up and keep at once. Each model is attached with its disk
    tier (store.prefix.KvFiles, in a folder named by everything that shapes its states' bytes) or None."""

    def __init__(self, ram_bytes: int):
        self.ram_bytes = ram_bytes
        self._keepers: dict[object, object] = {}  # model -> its disk tier (or None)
        self._scopes: dict[tuple[object, str], Scope] = {}
        self._lock = threading.Lock()
        self._clock = 0
        self.ram_used = 0  # bytes of the states held in RAM (their real lengths)
        self._said: set[str] = set()

    def attach(self, model, keeper=None) -> None:
        """Keep states of this model's sequences (keeper: its disk tier, or None for RAM only)."""
        self._keepers[model] = keeper

    def _scope(self, seq) -> Scope:
        """The entries of seq's model and scope, those on disk included (read again when another process
        wrote)."""
        s = self._scopes.get((seq.model, seq.scope))
        if s is None:
            s = self._scopes[seq.model, seq.scope] = Scope()
        keeper = self._keepers.get(seq.model)
        if keeper is not None:
            on_disk = dict(keeper.stored(seq.scope))
            for name in [n for n, e in s.entries.items() if e.blob is None and n not in on_disk]:
                s.drop(s.entries[name])  # gone from disk (another process evicted it)
            for name, tokens in on_disk.items():
                if name not in s.entries:
                    s.add(Entry(name, tokens, None))
        return s

    def _tick(self, e: Entry) -> None:
        self._clock += 1
        e.used = self._clock

    # -- a request's prompt: restore the longest kept prefix --
    def restore(self, seq, tokens: Sequence[int]) -> tuple[int, str]:
        """Restore into `seq` the kept state agreeing longest with `tokens` where it beats what seq holds by
        MIN_GAIN tokens, cut back to that agreement; (tokens now held from it, 'ram' or 'disk'), (0, '') when
        nothing was restored (seq is then as it was)."""
        want = np.asarray(tokens, dtype=np.int32)
        if len(want) < len(seq.tokens) + MIN_GAIN:
            return 0, ""
        with self._lock:
            s = self._scope(seq)
            e, n = s.best(want)
            if e is None or n < len(seq.tokens) + MIN_GAIN:
                return 0, ""
            self._tick(e)
            blob, tier = e.blob, "ram"
        keeper = self._keepers.get(seq.model)
        if blob is None:  # read outside the lock: other requests' lookups do not wait for the disk
            with self._lock:  # room first: what is read is held in memory, within the cap
                self._fit(room=keeper.size(seq.scope, e.name) or 0)
            tier, blob = "disk", keeper.read(seq.scope, e.name)
            if blob is None:  # damaged or gone (the keeper said which): recomputed, never restored
                with self._lock:
                    s.drop(e)
                return 0, ""
            with self._lock:
                if e.name in s.entries and e.blob is None:
                    e.blob = blob
                    self.ram_used += len(blob)
                    self._fit()
        if keeper is not None:
            keeper.touch(seq.scope, e.name)
        if not seq.set_state(blob, e.tokens.tolist()):
            self._say(f"a kept prompt state of {len(e.tokens)} tokens could not be restored (llama.cpp refused it); "
                      "it is prefilled instead")
            with self._lock:
                self._forget(s, e, keeper, seq.scope)
            return 0, ""
        seq.truncate(n)
        return n, tier

    # -- a request's end: keep its sequence's state --
    def keep(self, seq) -> bool:
        """Keep the state of what `seq` holds now (a request's prompt and output), where it adds MIN_NEW tokens
        or more to the longest state kept that it starts with; the states it extends are dropped (it holds them
        whole). Whether it was kept."""
        tokens = np.asarray(seq.tokens, dtype=np.int32)
        if len(tokens) < MIN_KEEP:
            return False
        with self._lock:
            s = self._scope(seq)
            e, n = s.best(tokens)
            if e is not None and len(tokens) - n < MIN_NEW:
                self._tick(e)  # what this request used stays
                return False
        with self._lock:  # room first: the copy is held in memory from the moment it is taken
            self._fit(room=seq.state_size())
        blob = seq.state()  # a copy of the sequence's cells (milliseconds): before anything else changes them
        if blob is None:
            return False
        entry = Entry(hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest(), tokens, blob)
        keeper = self._keepers.get(seq.model)
        with self._lock:
            s = self._scope(seq)
            for old in [o for o in s.entries.values() if len(o.tokens) <= len(tokens)
                        and agree(o.tokens, tokens) == len(o.tokens)]:
                self._forget(s, old, keeper, seq.scope)  # superseded: the new state holds all of it
            s.add(entry)
            self._tick(entry)
            self.ram_used += len(blob)
            if keeper is not None:  # queued before _fit may drop the blob from RAM
                keeper.write(seq.scope, entry.name, tokens, blob)
            self._fit()
        return True

    def _forget(self, s: Scope, e: Entry, keeper, scope: str) -> None:
        s.drop(e)
        if e.blob is not None:
            self.ram_used -= len(e.blob)
            e.blob = None
        if keeper is not None:
            keeper.forget(scope, e.name)

    def _in_memory(self) -> int:
        """Bytes of states in memory: those RAM holds, and those still waiting to be written to disk (held by
        the writer until then, whether RAM still holds them or not), each once."""
        sizes = {id(e.blob): len(e.blob) for s in self._scopes.values() for e in s.entries.values()
                 if e.blob is not None}
        for keeper in self._keepers.values():
            for blob in keeper.held() if keeper is not None else ():
                sizes.setdefault(id(blob), len(blob))
        return sum(sizes.values())

    def _fit(self, room: int = 0) -> None:
        """The least recently used states out of RAM (to disk only, if kept there) until the states in memory
        and `room` more (a state about to be taken or read) fit ram_bytes: memory stays under the cap itself.
        Writes still pending hold their states until written: evicting cannot free those."""
        if self._in_memory() + room <= self.ram_bytes:
            return
        held = sorted(((e, s, model) for (model, _), s in self._scopes.items() for e in s.entries.values()
                       if e.blob is not None), key=lambda h: h[0].used)
        for e, s, model in held:
            if self._in_memory() + room <= self.ram_bytes:
                break
            self.ram_used -= len(e.blob)
            e.blob = None
            if self._keepers.get(model) is None:  # not on disk: gone
                s.drop(e)

    def _say(self, msg: str) -> None:
        if msg not in self._said:
            self._said.add(msg)
            print(f"localspec: {msg}", file=sys.stderr)

    def clear(self) -> None:
        with self._lock:
            self._scopes.clear()
            self.ram_used = 0

    def close(self) -> None:
        """Let pending disk writes finish."""
        for keeper in self._keepers.values():
            if keeper is not None:
                keeper.close()
