"""Keeping drafts' history across runs: each scope's stored outputs in $LOCALSPEC_HOME/history/MODEL/SCOPE.npy.

Read when a scope is first used; written, merged with what other processes wrote meanwhile, every SAVE_EVERY
outputs and when the engine closes. Each write goes to a temp file and replaces the file whole (a reader sees
the old store or the new one); on POSIX an flock around read-merge-replace keeps two processes from dropping
each other's outputs (elsewhere the later of two simultaneous writes wins: outputs lost, never a broken file).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from ..core.history import BYTES_PER_TOKEN


def folder(home: Path, model_path: Path) -> Path:
    """One folder per target model file (its name and size: token ids mean nothing to another vocabulary)."""
    st = model_path.stat()
    return home / "history" / hashlib.sha256(f"{model_path.name}:{st.st_size}".encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path):
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the write itself stays atomic
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _split(flat: np.ndarray) -> list[np.ndarray]:
    ends = np.flatnonzero(flat < 0)
    starts = np.concatenate([[0], ends[:-1] + 1]) if ends.size else np.empty(0, dtype=np.int64)
    return [flat[s:e] for s, e in zip(starts, ends) if e > s]


class HistoryFiles:
    """The keeper a History is given (core.history.History(keeper=)): load(scope) and save(scope, new)."""

    def __init__(self, where: Path, max_bytes: int, n_vocab: int | None = None):
        """where: the model's folder (folder()); n_vocab: its vocabulary's size, when known (a file holding ids
        past it is not this model's, or is damaged: it is ignored, not drafted from)."""
        self.where, self.max_bytes, self.n_vocab = where, max_bytes, n_vocab

    def path(self, scope: str) -> Path:
        return self.where / f"{hashlib.sha256(scope.encode()).hexdigest()[:16]}.npy"

    def _read(self, path: Path) -> list[np.ndarray]:
        try:
            flat = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001 - a broken file (empty after a power loss, a full disk): start afresh
            print(f"localspec: ignoring the unreadable history file {path} ({e})", file=sys.stderr)
            return []
        why = None
        if flat.ndim != 1 or flat.dtype != np.int32:
            why = "it holds no token ids"
        elif flat.size and (flat.min() < -1 or (self.n_vocab is not None and flat.max() >= self.n_vocab)):
            why = f"it holds token ids outside this model's vocabulary ({self.n_vocab})"
        if why:
            print(f"localspec: ignoring the history file {path}: {why}; it is started afresh", file=sys.stderr)
            return []
        return _split(flat)

    def load(self, scope: str) -> list[np.ndarray]:
        return self._read(self.path(scope))

    def save(self, scope: str, new: Sequence[Sequence[int]]) -> None:
        """Add `new` outputs to the file, keeping the newest that fit max_bytes. Failures are said, not raised:
        a history is a speed-up, never a reason for a request to fail."""
        path = self.path(scope)
        try:
            path.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # every output kept: the user's alone
            path.parent.mkdir(exist_ok=True, mode=0o700)
            with _locked(path.with_suffix(".lock")):
                seqs = self._read(path) + [np.asarray(s, dtype=np.int32) for s in new]
                kept, room = [], self.max_bytes // (4 + BYTES_PER_TOKEN)  # tokens that fit, with separators
                for s in reversed(seqs):  # newest first, while they fit; the newest keeps its end if it alone is too long
                    if len(s) + 1 > room:
                        if not kept and room > 1:
                            kept.append(s[-(room - 1):])
                        break
                    kept.append(s)
                    room -= len(s) + 1
                flat = np.concatenate([np.append(s, -1).astype(np.int32) for s in reversed(kept)]) if kept else \
                    np.empty(0, dtype=np.int32)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                with open(tmp, "wb") as fh:
                    np.save(fh, flat, allow_pickle=False)
                    fh.flush()
                    os.fsync(fh.fileno())  # whole on disk before it replaces the old file
                os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - a history is a speed-up: never a reason for a request to fail
            with contextlib.suppress(OSError, UnboundLocalError):
                tmp.unlink(missing_ok=True)
            print(f"localspec: could not keep the history in {path} ({e}); it is kept in memory only",
                  file=sys.stderr)
