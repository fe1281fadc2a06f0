"""The acceptance rules on synthetic distributions (tier 1): lossless ones must emit exactly p."""

import numpy as np
import pytest
from scipy.stats import chisquare

from localspec.acceptance import LOSSLESS, accept_greedy, accept_rejection, accept_threshold
from localspec.sampling import SamplingParams, probs, sample

V = 8
TRIALS = 20_000
CHAINS = [(t, top_p) for t in (0.5, 1.0, 1.5) for top_p in (1.0, 0.9, 0.6)]


def dists(rng, temperature, top_p):
    """Target p (3 rows) and draft q (2 rows) through the real sampler chain: q sees noisy target logits
    at a hotter temperature, so drafts are often but not always accepted. top_k is off; min_p and a
    -10 logit per row make sure p filters some tokens out."""
    logits = 2 * rng.standard_normal((3, V))
    logits[np.arange(3), rng.integers(V, size=3)] = -10.0
    target = SamplingParams(temperature=temperature, top_k=0, top_p=top_p, min_p=0.02)
    draft = SamplingParams(temperature=temperature + 0.3, top_k=0, top_p=1.0, min_p=0.0)
    p = np.array([probs(row, target) for row in logits])
    q = np.array([probs(row + 0.7 * rng.standard_normal(V), draft) for row in logits[:2]])
    return p, q


def emitted(n, token, draft):
    """The tokens one verify step emits: the accepted draft, then the correction or bonus."""
    return [int(t) for t in draft[:n]] + [token]


def assert_distributed_as(tokens, p):
    """Chi-square goodness of fit, pooling bins expected under 5; mass outside p's support is a failure."""
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"emitted tokens p gives zero probability: {counts} vs {p}"
    expected = len(tokens) * p
    small = (expected < 5) & (p > 0)
    obs = np.append(counts[(p > 0) & ~small], counts[small].sum())
    exp = np.append(expected[(p > 0) & ~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) > 1:
        assert chisquare(obs, exp).pvalue > 1e-3, f"{counts} vs expected {expected.round(1)}"


def run(step, trials=TRIALS):
    """Emitted sequences of `trials` calls; position j is collected only where it was reached."""
    out = [step() for _ in range(trials)]
    return [[seq[j] for seq in out if len(seq) > j] for j in range(max(map(len, out)))]


@pytest.mark.parametrize("temperature, top_p", CHAINS)
def test_rejection_with_a_stochastic_draft_emits_p(temperature, top_p):
    rng = np.random.default_rng(10)
    p, q = dists(rng, temperature, top_p)

    def step():
        draft = [sample(q[0], rng), sample(q[1], rng)]
        return emitted(*accept_rejection(p, q, draft, rng), draft)

    positions = run(step)
    for j in range(3):  # the correction, the second token given the first accepted, the bonus
        assert len(positions[j]) > 1000
        assert_distributed_as(positions[j], p[j])


@pytest.mark.parametrize("temperature, top_p", CHAINS)
def test_rejection_with_a_point_mass_draft_emits_p(temperature, top_p):
    rng = np.random.default_rng(11)
    p, _ = dists(rng, temperature, top_p)
    inside = [int(np.argmax(p[0])), int(np.argmax(p[1]))]  # often accepted, so position 1 is reached
    outside = [int(np.argmin(p[0])), inside[1]]
    assert p[0, outside[0]] == 0

    for draft in (inside, outside):
        positions = run(lambda: emitted(*accept_rejection(p, None, draft, rng), draft))
        assert_distributed_as(positions[0], p[0])
        if draft is inside:
            assert_distributed_as(positions[1], p[1])


@pytest.mark.parametrize("temperature, top_p", CHAINS)
def test_greedy_matching_with_a_sampled_target_emits_p(temperature, top_p):
    rng = np.random.default_rng(12)
    p, q = dists(rng, temperature, top_p)

    def step():
        draft = [sample(q[0], rng), sample(q[1], rng)]
        target_choice = [sample(row, rng) for row in p]
        return emitted(*accept_greedy(target_choice, draft), draft)

    positions = run(step, trials=5_000)
    for j in range(2):
        assert_distributed_as(positions[j], p[j])


def one_hot(token):
    row = np.zeros(V)
    row[token] = 1.0
    return row


def test_rejection_at_temperature_zero_is_greedy_matching():
    rng = np.random.default_rng(13)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(2_000):
        k = int(rng.integers(0, 5))
        p = np.array([probs(rng.standard_normal(V), greedy) for _ in range(k + 1)])
        target_choice = [int(np.argmax(row)) for row in p]
        # each draft token matches the target about half the time
        draft = [c if rng.random() < 0.5 else int(rng.integers(V)) for c in target_choice[:k]]
        q = np.array([one_hot(d) for d in draft]).reshape(k, V)
        expected = accept_greedy(target_choice, draft)
        seeds = [np.random.default_rng(s) for s in (0, 1)]
        assert accept_rejection(p, q, draft, seeds[0]) == expected
        assert accept_rejection(p, None, draft, seeds[1]) == expected


def test_greedy_exact_cases():
    assert accept_greedy([5, 6, 7], [5, 6]) == (2, 7)  # full accept, bonus
    assert accept_greedy([5, 6, 7], [5, 9]) == (1, 6)  # correction at the first mismatch
    assert accept_greedy([5, 6, 7], [4, 6]) == (0, 5)  # later matches do not count
    with pytest.raises(ValueError, match="len\\(draft\\)\\+1"):
        accept_greedy([5, 6], [5, 6])


def test_threshold_exact_cases():
    p = np.array(
        [
            [0.5, 0.3, 0.2, 0.0],
            [0.1, 0.6, 0.3, 0.0],
            [0.25, 0.25, 0.25, 0.25],
        ]
    )
    choice = [0, 1, 3]
    assert accept_threshold(p, [1, 2], 0.5, choice) == (2, 3)  # 0.3 >= 0.25, 0.3 >= 0.3: bonus
    assert accept_threshold(p, [1, 0], 0.5, choice) == (1, 1)  # 0.1 < 0.3: the target's choice
    assert accept_threshold(p, [2, 2], 0.5, choice) == (0, 0)  # 0.2 < 0.25
    assert accept_threshold(p, [1, 0], 0.0, choice) == (2, 3)  # tau=0 accepts anything p allows
    assert accept_threshold(p, [3, 1], 0.0, choice) == (0, 0)  # ... but not what p filtered out
    assert accept_threshold(p, [0, 1], 1.0, choice) == (2, 3)  # tau=1: argmax only
    assert accept_threshold(p, [1, 1], 1.0, choice) == (0, 0)
    with pytest.raises(ValueError, match="tau"):
        accept_threshold(p, [1, 2], 1.5, choice)


def test_only_threshold_is_lossy():
    assert LOSSLESS == {"greedy": True, "rejection": True, "threshold": False}
    assert "LOSSY" in accept_threshold.__doc__
    assert all("Lossless" in f.__doc__ for f in (accept_greedy, accept_rejection))


def test_no_draft():
    rng = np.random.default_rng(14)
    p = np.array([[0.0, 0.0, 1.0, 0.0]])
    assert accept_greedy([2], []) == (0, 2)
    assert accept_rejection(p, None, [], rng) == (0, 2)
    assert accept_rejection(p, np.zeros((0, 4)), [], rng) == (0, 2)
    assert accept_threshold(p, [], 0.5, [2]) == (0, 2)
    p = np.array([[0.2, 0.0, 0.5, 0.3]])
    assert_distributed_as([accept_rejection(p, None, [], rng)[1] for _ in range(5_000)], p[0])


def test_degenerate_rows():
    rng = np.random.default_rng(15)
    p = np.array([[0.0, 0.6, 0.4], [0.0, 0.0, 1.0]])
    # q says the draft token was impossible: reject, resample from the residual (p where p > q)
    assert accept_rejection(p, np.array([[0.0, 0.0, 1.0]]), [1], rng) == (0, 1)
    # p == q and that impossible token again: the residual is all zero, so the correction comes from p
    tokens = [accept_rejection(p, p[:1].copy(), [0], rng) for _ in range(2_000)]
    assert {n for n, _ in tokens} == {0} and {t for _, t in tokens} == {1, 2}
    # p == q: every drafted token is accepted, and the bonus comes from p_K
    assert all(accept_rejection(p, p[:1], [d], rng) == (1, 2) for d in (1, 2))
