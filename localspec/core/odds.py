"""What auto learns as it goes: per-position acceptance rates (AcceptanceStats) and how the kind of token a
guess holds moves its odds (KindOdds, over token_kinds of the vocabulary). Their starting numbers are in
tuning.TUNING."""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from .tuning import TUNING


class AcceptanceStats:
    """Per-position conditional acceptance rates, a[i] = P(token i accepted | tokens before it accepted).

    Smoothed towards a prior (one for every position, or one per position) with `weight` pseudo-observations,
    and forgetting old rounds geometrically so the estimate follows the text (code being quoted, then prose);
    never above `cap`.
    """

    def __init__(self, k_max: int, prior: float | Sequence[float], weight: float = TUNING.stats_weight,
                 decay: float = TUNING.stats_decay, cap: float = 1.0):
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

    WEIGHT, DECAY = TUNING.kind_weight, TUNING.kind_decay

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
