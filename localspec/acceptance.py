"""The acceptance rules: which drafted tokens the target keeps, and the token it emits next (pure numpy).

Names follow the papers: p = target distribution, q = draft distribution, K = len(draft). Each rule
returns (n_accepted, next_token): the caller emits draft[:n_accepted] and then next_token, which is the
target's correction at the first rejected position or, after a full accept, a bonus token from p_K.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localspec.sampling import sample

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


def accept_rejection(
    p: np.ndarray, q: np.ndarray | None, draft: Sequence[int], rng: np.random.Generator
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Lossless: output tokens ~ p.

    p: (K+1, V) target probabilities; q: (K, V) draft probabilities, or None for a deterministic draft
    (a point mass at each draft token, e.g. n-gram lookup). Accept d_i with probability
    min(1, p_i(d_i) / q_i(d_i)); on rejection resample from norm(max(0, p_i - q_i)); after a full accept
    draw a bonus token from p_K. With one-hot p and q (temperature 0) this is exactly greedy matching.
    """
    _check_len(len(p), draft, "p")
    if q is not None and len(q) < len(draft):
        raise ValueError(f"q has {len(q)} rows for a draft of {len(draft)} tokens; it needs one per token")
    for i, d in enumerate(draft):
        p_d = p[i, d]
        q_d = 1.0 if q is None else q[i, d]
        # p_d >= q_d accepts and p_d == 0 rejects without a draw, so one-hot p, q use no randomness here.
        if q_d > 0 and p_d > 0 and (p_d >= q_d or rng.random() < p_d / q_d):
            continue
        if q is None:
            residual = p[i].copy()
            residual[d] = 0.0  # max(0, p_i - e_d)
        else:
            residual = np.maximum(p[i] - q[i], 0.0)
        # All zero only when p_i <= q_i everywhere (p_i == q_i up to rounding, or q_d == 0): p_i is exact.
        return i, sample(residual if residual.sum() > 0 else p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def accept_threshold(
    p: np.ndarray, draft: Sequence[int], tau: float, target_choice: Sequence[int]
) -> tuple[int, int]:
    """Probability threshold: accept d_i while p_i(d_i) >= tau * max(p_i). LOSSY: output is not ~ p.

    At the first failure emit target_choice[i], after a full accept target_choice[K]. tau=1 accepts only
    the target's argmax; a token p gives zero probability (filtered out) is never accepted, even at tau=0.
    """
    if not 0 <= tau <= 1:
        raise ValueError(f"tau={tau!r} is out of range: it must be in [0, 1]")
    _check_len(len(p), draft, "p")
    _check_len(len(target_choice), draft, "target_choice")
    for i, d in enumerate(draft):
        p_d = p[i, d]
        if not (p_d > 0 and p_d >= tau * p[i].max()):
            return i, int(target_choice[i])
    return len(draft), int(target_choice[len(draft)])


def _check_len(n: int, draft: Sequence[int], name: str) -> None:
    if n != len(draft) + 1:
        raise ValueError(f"{name} has {n} rows for a draft of {len(draft)} tokens; it needs len(draft)+1")
