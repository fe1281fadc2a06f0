"""The acceptance rules on synthetic distributions (tier 1): lossless ones must emit exactly p."""

import numpy as np
import pytest
from scipy.stats import chisquare

from localspec.core.acceptance import LOSSLESS, accept_greedy, accept_rejection, accept_threshold
from localspec.core.sampling import Dist, SamplingParams, dist

V = 8
TRIALS = 20_000
# every temperature and every top_p in the default run (the diagonal), all nine pairs with the slow tier
CHAINS = [pytest.param(t, top_p, marks=() if i == j else pytest.mark.slow)
          for i, t in enumerate((0.5, 1.0, 1.5)) for j, top_p in enumerate((1.0, 0.9, 0.6))]


def dists(rng, temperature, top_p):
    """Target p (3 rows) and draft q (2 rows) through the real sampler chain: q sees noisy target logits
    at a hotter temperature, so drafts are often but not always accepted. top_k is off; min_p and a
    -10 logit per row make sure p filters some tokens out."""
    logits = 2 * rng.standard_normal((3, V))
    logits[np.arange(3), rng.integers(V, size=3)] = -10.0
    target = SamplingParams(temperature=temperature, top_k=0, top_p=top_p, min_p=0.02)
    draft = SamplingParams(temperature=temperature + 0.3, top_k=0, top_p=1.0, min_p=0.0)
    p = [dist(row, target) for row in logits]
    q = [dist(row + 0.7 * rng.standard_normal(V), draft) for row in logits[:2]]
    return p, q


def dense(rows):
    return np.array([r.dense(V) for r in rows])


def sparse(row):
    row = np.asarray(row, dtype=np.float64)
    ids = np.flatnonzero(row)
    return Dist(ids, row[ids] / row[ids].sum())


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
        draft = [q[0].sample(rng), q[1].sample(rng)]
        return emitted(*accept_rejection(p, q, draft, [rng] * 3), draft)

    positions = run(step)
    for j in range(3):  # the correction, the second token given the first accepted, the bonus
        assert len(positions[j]) > 1000
        assert_distributed_as(positions[j], dense(p)[j])


@pytest.mark.parametrize("temperature, top_p", CHAINS)
def test_rejection_with_a_point_mass_draft_emits_p(temperature, top_p):
    rng = np.random.default_rng(11)
    rows, _ = dists(rng, temperature, top_p)
    p = dense(rows)
    inside = [int(np.argmax(p[0])), int(np.argmax(p[1]))]  # often accepted, so position 1 is reached
    outside = [int(np.argmin(p[0])), inside[1]]
    assert p[0, outside[0]] == 0

    for draft in (inside, outside):
        positions = run(lambda: emitted(*accept_rejection(rows, None, draft, [rng] * 3), draft))
        assert_distributed_as(positions[0], p[0])
        if draft is inside:
            assert_distributed_as(positions[1], p[1])


@pytest.mark.parametrize("temperature, top_p", CHAINS)
def test_greedy_matching_with_a_sampled_target_emits_p(temperature, top_p):
    rng = np.random.default_rng(12)
    p, q = dists(rng, temperature, top_p)

    def step():
        draft = [q[0].sample(rng), q[1].sample(rng)]
        target_choice = [row.sample(rng) for row in p]
        return emitted(*accept_greedy(target_choice, draft), draft)

    positions = run(step, trials=5_000)
    for j in range(2):
        assert_distributed_as(positions[j], dense(p)[j])


def test_rejection_at_temperature_zero_is_greedy_matching():
    rng = np.random.default_rng(13)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(2_000):
        k = int(rng.integers(0, 5))
        p = [dist(rng.standard_normal(V), greedy) for _ in range(k + 1)]
        target_choice = [int(row.ids[0]) for row in p]
        # each draft token matches the target about half the time
        draft = [c if rng.random() < 0.5 else int(rng.integers(V)) for c in target_choice[:k]]
        q = [Dist.point(d) for d in draft]
        expected = accept_greedy(target_choice, draft)
        assert accept_rejection(p, q, draft, [np.random.default_rng(0)] * (k + 1)) == expected
        assert accept_rejection(p, None, draft, [np.random.default_rng(1)] * (k + 1)) == expected


def test_greedy_exact_cases():
    assert accept_greedy([5, 6, 7], [5, 6]) == (2, 7)  # full accept, bonus
    assert accept_greedy([5, 6, 7], [5, 9]) == (1, 6)  # correction at the first mismatch
    assert accept_greedy([5, 6, 7], [4, 6]) == (0, 5)  # later matches do not count
    with pytest.raises(ValueError, match="len\\(draft\\)\\+1"):
        accept_greedy([5, 6], [5, 6])


def test_threshold_exact_cases():
    p = [sparse(r) for r in ([0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25])]
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
    p = [sparse([0.0, 0.0, 1.0, 0.0])]
    assert accept_greedy([2], []) == (0, 2)
    assert accept_rejection(p, None, [], [rng]) == (0, 2)
    assert accept_rejection(p, [], [], [rng]) == (0, 2)
    assert accept_threshold(p, [], 0.5, [2]) == (0, 2)
    p = [sparse([0.2, 0.0, 0.5, 0.3])]
    assert_distributed_as([accept_rejection(p, None, [], [rng])[1] for _ in range(5_000)], p[0].dense(4))


def test_degenerate_rows():
    rng = [np.random.default_rng(15)] * 2
    p = [sparse([0.0, 0.6, 0.4]), sparse([0.0, 0.0, 1.0])]
    # q says the draft token was impossible: reject, resample from the residual (p where p > q)
    assert accept_rejection(p, [sparse([0.0, 0.0, 1.0])], [1], rng) == (0, 1)
    # p == q and that impossible token again: the residual is all zero, so the correction comes from p
    tokens = [accept_rejection(p, p[:1], [0], rng) for _ in range(2_000)]
    assert {n for n, _ in tokens} == {0} and {t for _, t in tokens} == {1, 2}
    # p == q: every drafted token is accepted, and the bonus comes from p_K
    assert all(accept_rejection(p, p[:1], [d], rng) == (1, 2) for d in (1, 2))


def test_rules_mix_target_and_draft_rows_of_different_widths():
    """The standard pair: a Qwen2.5 7B target has 152,064 logits, its 0.5B draft 151,936 (case 1)."""
    from localspec.core.loop import accept
    from localspec.core.drafters import Draft

    rng = np.random.default_rng(16)
    wide = (3 * rng.standard_normal((3, 152_064))).astype(np.float32)
    narrow = wide[:2, :151_936] + 0.3 * rng.standard_normal((2, 151_936)).astype(np.float32)
    params = SamplingParams(temperature=0.8)
    q = [dist(row, params) for row in narrow]
    for rule in ("rejection", "greedy", "threshold"):
        for trial in range(50):
            d = Draft([q[0].sample(rng), q[1].sample(rng)], q)
            n, nxt = accept(rule, wide, d, params, [], [np.random.default_rng(trial)] * 3, 0.5)
            assert 0 <= n <= 2 and 0 <= nxt < 152_064
