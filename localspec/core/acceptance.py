"""The acceptance rules: which drafted tokens the target keeps, and the token it emits next (pure numpy).

Names follow the papers: p = target distribution, q = draft distribution, K = len(draft). Each rule
returns (n_accepted, next_token): the caller emits draft[:n_accepted] and then next_token, which is the
target's correction at the first rejected position or, after a full accept, a bonus token from p_K.

Row i of p (and rngs[i]) belongs to output position i of this round: p, q and target_choice may be lazy
sequences, read only as far as the rule gets. rngs[i] is that position's own random stream, so a draw at
one position never depends on how many draws another used.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .sampling import Dist, residual

LOSSLESS = {"greedy": True, "rejection": True, "threshold": False}


def accept_greedy(target_choice: Sequence[int], draft: Sequence[int]) -> tuple[int, int]:
    """Greedy matching: accept draft[i] while it equals the target's own token at that position. Lossless.

    target_choice[i] is what the target emits at position i on its own (argmax at T=0, a draw from p_i
    above 0), one more than len(draft); the output is exactly the target's own output.
    """
    _check_len(len(target_choice), draft, "target_choice")
    n = 0
    while n < len(draft) and draft[n] == target_choice[n]:
        n += 1
    return n, int(target_choice[n])


def accept_rejection(p: Sequence[Dist], q: Sequence[Dist] | None, draft: Sequence[int],
                     rngs: Sequence[np.random.Generator]) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Lossless: output tokens ~ p.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on rejection resample from
    norm(max(0, p_i - q_i)); after a full accept draw a bonus token from p_K.

    q is None for a deterministic draft (a point mass at each token: n-gram lookup, a greedy draft model).
    Then accepting d with probability p(d) and resampling from p without d is, in law, drawing x ~ p and
    accepting while x == d; the draw is made exactly as plain decoding makes it (the first uniform of the
    position's stream), so with a seed the output is the same token for token as without a draft.
    """
    _check_len(len(p), draft, "p")
    if q is None:
        return accept_greedy(_Draws(p, rngs, len(draft) + 1), draft)
    if len(q) < len(draft):
        raise ValueError(f"q has {len(q)} rows for a draft of {len(draft)} tokens; it needs one per token")
    for i, d in enumerate(draft):
        p_d, q_d = p[i].prob(d), q[i].prob(d)
        # p_d >= q_d accepts and p_d == 0 rejects without a draw.
        if q_d > 0 and p_d > 0 and (p_d >= q_d or rngs[i].random() < p_d / q_d):
            continue
        # None only when p_i <= q_i everywhere (p_i == q_i up to rounding, or q_d == 0): then p_i is exact.
        return i, (residual(p[i], q[i]) or p[i]).sample(rngs[i])
    return len(draft), p[len(draft)].sample(rngs[len(draft)])


def accept_threshold(p: Sequence[Dist], draft: Sequence[int], tau: float,
                     target_choice: Sequence[int]) -> tuple[int, int]:
    """Probability threshold: accept d_i while p_i(d_i) >= tau * max(p_i). LOSSY: output is not ~ p.

    At the first failure emit target_choice[i], after a full accept target_choice[K]. tau=1 accepts only
    the target's argmax; a token p gives zero probability (filtered out) is never accepted, even at tau=0.
    """
    if not 0 <= tau <= 1:
        raise ValueError(f"tau={tau!r} is out of range: it must be in [0, 1]")
    _check_len(len(p), draft, "p")
    _check_len(len(target_choice), draft, "target_choice")
    for i, d in enumerate(draft):
        p_d = p[i].prob(d)
        if not (p_d > 0 and p_d >= tau * p[i].p.max()):
            return i, int(target_choice[i])
    return len(draft), int(target_choice[len(draft)])


class Lazy(Sequence):
    """A sequence of n items computed on first access: rules read only the rows they reach."""

    def __init__(self, n: int, make):
        self._n, self._make, self._done = n, make, {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        if i not in self._done:
            self._done[i] = self._make(i)
        return self._done[i]


def _Draws(p: Sequence[Dist], rngs: Sequence[np.random.Generator], n: int) -> Lazy:
    return Lazy(n, lambda i: p[i].sample(rngs[i]))


def _check_len(n: int, draft: Sequence[int], name: str) -> None:
    if n != len(draft) + 1:
        raise ValueError(f"{name} has {n} rows for a draft of {len(draft)} tokens; it needs len(draft)+1")
