"""The prompt cache's disk tier: KV states of prompt prefixes kept under $LOCALSPEC_HOME/kv, shared by processes.

core.prefix.PrefixCache finds, verifies against the tokens and restores states; this module keeps their bytes.
The layout is ROOT/FINGERPRINT/SCOPE/NAME.kv: FINGERPRINT names everything that shapes a state's bytes (the
model file, its settings, the llama.cpp build and state format: store.prefix_key), so a state is only ever found
by a process that would have computed the same bytes; SCOPE is one API key's (or 'default'), NAME the state's
own (core names it by its tokens). ROOT/FINGERPRINT/meta.json says which model and settings, for people and
`localspec cache`.

A file is a 64-byte header (FORMAT's magic and version, the fingerprint, the token count, the state's length,
a crc32 of the tokens and one of the state) then the tokens (int32, little-endian) then the state. Each is
written whole to a temp file in its folder and renamed into place, so a reader sees a whole file or none; the
checksums catch what a crash or a bad disk leaves. Every read checks all of it; a file that fails is said once,
removed, and its prompt prefilled.

The whole ROOT, every model's folder, is kept under one cap, least recently used out first (a file's mtime is
its last use, touched on each: the order holds across processes), counted in the files' real sizes.
store.prefix_listing reads and clears it for `localspec cache`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from .registry import home

MAGIC = b"LSKV"
FORMAT = 1  # bump when a file's layout changes (it is in the fingerprint too: a new format, a new folder)
HEADER = struct.Struct("<4sI32sQQII")  # magic, format, fingerprint, n_tokens, blob length, crc32 tokens, crc32 blob
SUFFIX = ".kv"
CAP_BYTES = 4 << 30  # the default cap of the whole disk tier
MAX_PENDING = 4  # writes waiting for the writer thread; beyond this (or half the cap in bytes) the oldest is dropped
STALE_TEMP_S = 60  # a temp file older than this is a crashed writer's: removed; a younger one may still be written
SETTLED_NS = 2_000_000_000  # a folder listed this soon after it changed may change again within its mtime's tick
_NAME = re.compile(r"[0-9A-Za-z_-]{1,128}")
_SAFE_SCOPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def default_root() -> Path:
    return home() / "kv"


def default_disk_mb(root: Path) -> float:
    """The disk tier's default cap: CAP_BYTES, or a quarter of the free space where root's disk has less."""
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return CAP_BYTES / 2 ** 20
    return min(CAP_BYTES, free / 4) / 2 ** 20


def scope_folder(scope: str) -> str:
    """'' -> 'default'; a name safe as a folder ('key-0123abcd') as it is; anything else by its hash."""
    if scope == "":
        return "default"
    if _SAFE_SCOPE.fullmatch(scope) and scope != "default":
        return scope
    return "scope-" + hashlib.sha256(scope.encode()).hexdigest()[:24]


def _say_to_stderr(msg: str) -> None:
    print(f"localspec: {msg}", file=sys.stderr, flush=True)


@dataclass
class _Listing:
    """One scope folder as last listed: its mtime then, whether that listing can be trusted while the mtime stays
    (taken long enough after the change), and each state file's inode and tokens."""
    mtime_ns: int | None = None
    settled: bool = False
    files: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    out: list[tuple[str, np.ndarray]] = field(default_factory=list)


@dataclass
class _Write:
    scope: str
    name: str
    tokens: np.ndarray
    blob: bytearray


class KvFiles:
    """One model's states on disk (the keeper core.prefix.PrefixCache is given). Thread-safe. Writes go to one
    background thread (a reply never waits for the disk); nothing here raises into a request: a failure is said
    once and the state stays in RAM only."""

    def __init__(self, root: Path, fingerprint: str, cap_bytes: int, meta: dict, *, say=_say_to_stderr):
        if not _NAME.fullmatch(fingerprint) or len(fingerprint) > 32:
            raise ValueError(f"a fingerprint is 1-32 letters, digits, '-' or '_', got {fingerprint!r}")
        self.root, self.fingerprint, self.cap_bytes, self.meta = Path(root), fingerprint, cap_bytes, meta
        self.folder = self.root / fingerprint
        self._say_fn = say
        self._lock = threading.Condition()
        self._listings: dict[str, _Listing] = {}
        self._pending: deque[_Write] = deque()
        self._pending_bytes = 0
        self._in_flight: _Write | None = None  # the write under way
        self._cancelled: set[tuple[str, str]] = set()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._said: set[str] = set()
        self.dropped = 0  # writes dropped for a long queue (the state stays in RAM)

    # ---- where ----
    def _path(self, scope: str, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise ValueError(f"a state's name is 1-128 letters, digits, '-' or '_', got {name!r}")
        return self.folder / scope_folder(scope) / (name + SUFFIX)

    def _say(self, msg: str, key: str | None = None) -> None:
        with self._lock:
            if (key or msg) in self._said:
                return
            self._said.add(key or msg)
        self._say_fn(msg)

    def _damaged(self, path: Path, why: str) -> None:
        self._say(f"a kept prompt state ({path}) is damaged ({why}); it is removed and the prompt prefilled",
                  key=f"damaged {path}")
        with contextlib.suppress(OSError):
            path.unlink()

    # ---- reading ----
    def _check_header(self, raw: bytes, size: int) -> tuple[str | None, int, int, int, int]:
        """(why it is not ours or damaged, or None; n_tokens, blob length, crc of tokens, crc of blob)."""
        if len(raw) < HEADER.size:
            return f"{size} bytes, shorter than its header", 0, 0, 0, 0
        magic, fmt, fp, n, length, crc_t, crc_b = HEADER.unpack_from(raw)
        if magic != MAGIC:
            return "not a localspec prompt state", 0, 0, 0, 0
        if fmt != FORMAT:
            return f"format {fmt}, not {FORMAT}", 0, 0, 0, 0
        if fp.rstrip(b"\0") != self.fingerprint.encode():
            return "written for another model or other settings than its folder's", 0, 0, 0, 0
        if HEADER.size + 4 * n + length != size:
            return f"{size} bytes where its header says {HEADER.size + 4 * n + length}", 0, 0, 0, 0
        return None, n, length, crc_t, crc_b

    def _read_tokens(self, f, path: Path) -> tuple[np.ndarray, int, int] | None:
        """The header and tokens of an open file, checked; (tokens, blob length, crc of blob), or None (damaged
        files are said and removed)."""
        size = os.fstat(f.fileno()).st_size
        why, n, length, crc_t, crc_b = self._check_header(f.read(HEADER.size), size)
        if why is None:
            raw = f.read(4 * n)
            if len(raw) != 4 * n:
                why = "shorter than its header says"
            elif zlib.crc32(raw) != crc_t:
                why = "its tokens fail their checksum"
        if why is not None:
            self._damaged(path, why)
            return None
        return np.frombuffer(raw, dtype="<i4").astype(np.int32), length, crc_b

    def stored(self, scope: str) -> list[tuple[str, np.ndarray]]:
        """(name, tokens) of every state of `scope` on disk or on its way there (queued: read() returns it from
        memory meanwhile). One stat when the folder has not changed since it was last listed; when it has, only
        files not seen before are opened (their header and tokens)."""
        with self._lock:
            listed = self._listed(scope)
            queued = [(w.name, w.tokens) for w in self._queued(scope) if w.name not in self._listings[scope].files]
            return listed + queued if queued else listed

    def _queued(self, scope: str, name: str | None = None) -> list[_Write]:
        """The writes of scope (of name) waiting or under way, but a forgotten one. With the lock held."""
        return [w for w in (*self._pending, self._in_flight) if w is not None and w.scope == scope
                and (name is None or w.name == name) and (w.scope, w.name) not in self._cancelled]

    def _listed(self, scope: str) -> list[tuple[str, np.ndarray]]:
        """The scope folder's states, listed again only where it changed. With the lock held."""
        folder = self.folder / scope_folder(scope)
        seen = self._listings.setdefault(scope, _Listing())
        try:
            mtime = os.stat(folder).st_mtime_ns
        except OSError:
            seen.mtime_ns, seen.settled, seen.files, seen.out = None, False, {}, []
            return []
        if mtime == seen.mtime_ns and seen.settled:
            return seen.out
        now = time.time_ns()
        files: dict[str, tuple[int, np.ndarray]] = {}
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            self._say(f"cannot list the kept prompt states in {folder} ({e.strerror or e})")
            return []
        for entry in entries:
            name = entry.name[:-len(SUFFIX)]
            if not entry.name.endswith(SUFFIX) or not _NAME.fullmatch(name):
                continue
            known = seen.files.get(name)
            if known is not None and known[0] == entry.inode():
                files[name] = known
                continue
            try:
                with open(entry.path, "rb") as f:
                    got = self._read_tokens(f, Path(entry.path))
            except OSError:  # gone meanwhile (another process evicted it)
                continue
            if got is not None:
                files[name] = (entry.inode(), got[0])
        seen.mtime_ns, seen.settled, seen.files = mtime, now - mtime > SETTLED_NS, files
        seen.out = [(n, t) for n, (_, t) in files.items()]
        return seen.out

    def read(self, scope: str, name: str) -> bytearray | None:
        """The state's bytes, every check passed, or None: gone (another process evicted it) silently; damaged,
        said once and removed. A use: the file's mtime is set to now (least recently used goes first). A state
        still waiting for the writer is returned from memory (the bytes write() was given)."""
        path = self._path(scope, name)
        with self._lock:
            queued = self._queued(scope, name)
        if queued:
            return queued[-1].blob
        try:
            with open(path, "rb", buffering=0) as f:
                got = self._read_tokens(f, path)
                if got is None:
                    return None
                tokens, length, crc_b = got
                blob = mmap.mmap(-1, length) if length else bytearray()  # (as Seq.state's: freed when dropped)
                view, done = memoryview(blob), 0
                while done < length:
                    n = f.readinto(view[done:])
                    if not n:
                        break
                    done += n
                view.release()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._say(f"cannot read a kept prompt state ({path}: {e.strerror or e}); the prompt is prefilled",
                      key=f"unreadable {path}")
            return None
        if done != length:
            self._damaged(path, "shorter than its header says")
            return None
        if zlib.crc32(blob) != crc_b:
            self._damaged(path, "its state fails its checksum")
            return None
        with self._lock:
            listing = self._listings.get(scope)
            known = listing.files.get(name) if listing else None
            if known is not None and not np.array_equal(known[1], tokens):
                listing.files.pop(name)  # replaced since it was listed: listed again before it is used
                listing.settled = False
                return None
        self.touch(scope, name)
        return blob

    def size(self, scope: str, name: str) -> int | None:
        """About the bytes a read() of the state holds in memory (its file's size), None where it is not there."""
        with self._lock:
            queued = self._queued(scope, name)
        if queued:
            return len(queued[-1].blob)
        try:
            return os.stat(self._path(scope, name)).st_size
        except OSError:
            return None

    def held(self) -> list[bytearray]:
        """The states waiting for the writer, or being written: in memory until written (the RAM tier counts
        them where it no longer holds them itself)."""
        with self._lock:
            return [w.blob for w in self._pending] + ([self._in_flight.blob] if self._in_flight else [])

    # ---- writing ----
    def write(self, scope: str, name: str, tokens: np.ndarray, blob: bytearray) -> None:
        """Queue the state for the writer thread and return at once. `blob` is not copied: it must not change."""
        self._path(scope, name)  # a name that is no file name is a bug: said now, not in the writer thread
        size = HEADER.size + 4 * len(tokens) + len(blob)
        if size > self.cap_bytes:
            self._say(f"a prompt state of {size / 2 ** 20:.0f} MB is larger than the prompt cache's disk cap "
                      f"({self.cap_bytes / 2 ** 20:.0f} MB): it is kept in memory only", key="over cap")
            return
        with self._lock:
            if self._closing:
                return
            self._drop_pending(scope, name)
            self._cancelled.discard((scope, name))
            self._pending.append(_Write(scope, name, np.ascontiguousarray(tokens, dtype="<i4"), blob))
            self._pending_bytes += len(blob)
            while len(self._pending) > 1 and (len(self._pending) > MAX_PENDING
                                              or self._pending_bytes > self.cap_bytes // 2):
                self._pending_bytes -= len(self._pending.popleft().blob)
                self.dropped += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._writer, name="localspec-kv-writer", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _drop_pending(self, scope: str, name: str) -> None:
        for w in [w for w in self._pending if (w.scope, w.name) == (scope, name)]:
            self._pending.remove(w)
            self._pending_bytes -= len(w.blob)

    def _writer(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closing:
                    self._lock.wait()
                if not self._pending:
                    return
                w = self._pending.popleft()
                self._pending_bytes -= len(w.blob)
                self._in_flight = w
            try:
                # room first (write() refused a state over the cap): the folder never holds more than the cap
                evict(self.root, self.cap_bytes - (HEADER.size + w.tokens.nbytes + len(w.blob)))
                self._write_file(w)
                self._fit()  # (another process may have written meanwhile)
            except Exception as e:  # noqa: BLE001 - a state not kept on disk is a speed-up lost, never an error
                self._say(f"could not keep a prompt state in {self.folder} ({getattr(e, 'strerror', None) or e}); "
                          "prompt states are kept in memory only until it can", key="write failed")
            finally:
                with self._lock:
                    self._in_flight = None
                    self._cancelled.discard((w.scope, w.name))
                    self._lock.notify_all()
                del w  # not held while waiting for the next: the RAM tier may have let this state go

    def _folders(self, folder: Path) -> None:
        """The folders, made private (they hold users' prompts), and meta.json where it is missing."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        for f in (self.root, self.folder, folder):
            f.mkdir(mode=0o700, exist_ok=True)
        meta = self.folder / "meta.json"
        if not meta.exists():
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".meta.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({**self.meta, "fingerprint": self.fingerprint}, f, indent=1, default=str)
                os.replace(tmp, meta)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    def _write_file(self, w: _Write) -> None:
        path = self._path(w.scope, w.name)
        self._folders(path.parent)
        tokens = w.tokens.tobytes()
        header = HEADER.pack(MAGIC, FORMAT, self.fingerprint.encode(), len(w.tokens), len(w.blob),
                             zlib.crc32(tokens), zlib.crc32(w.blob))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{w.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:  # no fsync: a file a crash leaves short fails its checksums instead
                f.write(header)
                f.write(tokens)
                f.write(w.blob)
            with self._lock:
                if (w.scope, w.name) in self._cancelled:  # forgotten while it was being written
                    os.unlink(tmp)
                    return
                os.replace(tmp, path)
                with contextlib.suppress(OSError):
                    listing = self._listings.get(w.scope)
                    if listing is not None:  # known: the next listing need not open it again
                        listing.files[w.name] = (os.stat(path).st_ino, w.tokens.astype(np.int32, copy=False))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _fit(self) -> None:
        """Least recently used state files out of the whole root (every model's) until it holds cap_bytes or
        less; a crashed writer's temp files out too. Safe beside another process doing the same."""
        evict(self.root, self.cap_bytes)

    # ---- the rest of a state's life ----
    def touch(self, scope: str, name: str) -> None:
        """A use: the file goes to the back of the eviction order (in every process: its mtime is the order)."""
        with contextlib.suppress(OSError):
            os.utime(self._path(scope, name))

    def forget(self, scope: str, name: str) -> None:
        """Remove the state (superseded), and a write of it still waiting or under way."""
        path = self._path(scope, name)
        with self._lock:
            self._drop_pending(scope, name)
            if self._in_flight is not None and (self._in_flight.scope, self._in_flight.name) == (scope, name):
                self._cancelled.add((scope, name))
            listing = self._listings.get(scope)
            if listing is not None and listing.files.pop(name, None) is not None:
                listing.settled = False
            with contextlib.suppress(OSError):
                path.unlink()

    def flush(self, timeout: float = 30) -> bool:
        """Wait until the writes queued so far are on disk (or dropped); whether they are, within timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and self._in_flight is None, timeout)

    def close(self, timeout: float = 30) -> None:
        """Finish the writes waiting (up to timeout seconds); later writes are ignored."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)


# ---- the whole root: eviction ----
def list_dir(path) -> list[os.DirEntry]:
    """A folder's entries; none where it is gone or unreadable."""
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def files_under(folder) -> Iterator[tuple[Path, os.stat_result]]:
    """(path, stat) of each file in a model's folder (meta.json) and in its scope folders, skipping what vanishes."""
    for entry in list_dir(folder):
        for f in list_dir(entry.path) if entry.is_dir(follow_symlinks=False) else [entry]:
            if f.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    yield Path(f.path), f.stat(follow_symlinks=False)


def files_in_root(root: Path) -> Iterator[tuple[Path, os.stat_result]]:
    for model in list_dir(root):
        if model.is_dir(follow_symlinks=False):
            yield from files_under(model.path)


def is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


def evict(root: Path, cap_bytes: int) -> int:
    """Remove state files, least recently used first, until root holds cap_bytes or less (every file counted by
    its real size, meta.json and other processes' temp files too); temp files a crash left (older than a
    minute) go first. Bytes removed."""
    now, total, freed, states = time.time(), 0, 0, []
    for path, st in files_in_root(root):
        if is_temp(path) and now - st.st_mtime > STALE_TEMP_S:
            with contextlib.suppress(OSError):
                path.unlink()
                freed += st.st_size
            continue
        total += st.st_size
        if path.suffix == SUFFIX:
            states.append((st.st_mtime_ns, st.st_size, path))
    states.sort()
    for _, size, path in states:
        if total <= cap_bytes:
            break
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            freed += size
        total -= size  # removed by us or by another process meanwhile: gone either way
    return freed
