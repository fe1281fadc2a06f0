"""The sampler chain against hand-computed tiny examples (tier 1: no model)."""

import tracemalloc

import numpy as np
import pytest
from scipy.stats import chisquare

from localspec.core.errors import LocalspecError
from localspec.core.sampling import Dist, SamplingError, SamplingParams, choose, dist, penalize, position_rng, residual

# Every filter off, temperature 1: probs() is a plain softmax unless a test turns something on.
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def probs(logits, sp, history=()):
    """dist() as a dense row, for comparing with hand-computed rows."""
    return dist(np.asarray(logits), sp, history).dense(len(logits))


def sparse(p):
    p = np.asarray(p, dtype=np.float64)
    ids = np.flatnonzero(p)
    return Dist(ids, p[ids] / p[ids].sum())


def softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def read_only(values, dtype=np.float32):
    a = np.array(values, dtype=dtype)
    a.setflags(write=False)
    return a


def test_defaults_are_llama_cpp_pythons():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (0.8, 40, 0.95, 0.05)
    assert not sp.greedy and not sp.penalized


def test_penalties_hand_computed_with_negative_and_zero_logits():
    logits = read_only([2.0, -1.0, 0.5, 0.0])
    sp = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = penalize(logits, [0, 1, 1, 3], sp)
    # token 0, count 1: 2/2 - 0.5 - 0.25; token 1, count 2: -1*2 - 1.0 - 0.25; token 2 untouched;
    # token 3, count 1: 0*2 - 0.5 - 0.25 (a non-positive logit is multiplied, never divided)
    np.testing.assert_allclose(out, [0.25, -3.25, 0.5, -0.75])
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 0.0])


def test_penalty_window_is_the_last_n_tokens():
    sp = SamplingParams(repeat_penalty=2.0, penalty_last_n=2)
    out = penalize(np.array([4.0, 4.0, 4.0]), [0, 0, 1, 2], sp)
    np.testing.assert_allclose(out, [4.0, 2.0, 2.0])


def test_no_active_penalty_returns_the_input_itself():
    logits = read_only([1.0, 2.0])
    assert penalize(logits, [0, 1], SamplingParams()) is logits
    assert penalize(logits, [0, 1], SamplingParams(repeat_penalty=1.3, penalty_last_n=0)) is logits
    assert penalize(logits, [], SamplingParams(repeat_penalty=1.3)) is logits
    assert SamplingParams(presence_penalty=0.1).penalized
    assert not SamplingParams(presence_penalty=0.1, penalty_last_n=0).penalized


def test_penalize_never_writes_into_a_read_only_view():
    base = read_only(np.linspace(-2, 2, 16))
    view = base[4:12]
    out = penalize(view, [0, 1, 2, 2], SamplingParams(repeat_penalty=1.5, frequency_penalty=0.3))
    assert out is not view and out.dtype == np.float32 and out.flags.writeable
    np.testing.assert_array_equal(view, np.linspace(-2, 2, 16, dtype=np.float32)[4:12])


def test_top_k():
    logits = [1.0, 3.0, 2.0, 0.0]
    p = probs(np.array(logits), SamplingParams(**{**PLAIN, "top_k": 2}))
    np.testing.assert_allclose(p, [0, *softmax([3.0, 2.0]), 0])
    np.testing.assert_allclose(probs(np.array(logits), SamplingParams(**PLAIN)), softmax(logits))
    np.testing.assert_allclose(  # top_k at or above V keeps everything
        probs(np.array(logits), SamplingParams(**{**PLAIN, "top_k": 9})), softmax(logits)
    )


def test_top_p_keeps_the_smallest_prefix_reaching_it():
    logits = np.log([0.05, 0.5, 0.15, 0.3])
    def keep(top_p):
        return np.flatnonzero(probs(logits, SamplingParams(**{**PLAIN, "top_p": top_p})))

    assert set(keep(0.75)) == {1, 3}  # 0.5 + 0.3 = 0.8 >= 0.75
    assert set(keep(0.81)) == {1, 2, 3}
    assert set(keep(0.01)) == {1}  # at least one token
    assert set(keep(0.5)) == {1}  # reaching top_p exactly is enough (exact in binary: 0.5)
    p = probs(logits, SamplingParams(**{**PLAIN, "top_p": 0.75}))
    np.testing.assert_allclose(p, [0, 0.625, 0, 0.375])


def test_min_p_is_relative_to_the_max_prob():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    p = probs(logits, SamplingParams(**{**PLAIN, "min_p": 0.2}))  # keeps prob >= 0.1
    np.testing.assert_allclose(p, np.array([0.5, 0.3, 0.15, 0]) / 0.95)
    np.testing.assert_allclose(probs(logits, SamplingParams(**{**PLAIN, "min_p": 1.0})), [1, 0, 0, 0])


def test_temperature_divides_the_logits():
    logits = np.array([1.0, 0.0, -1.0])
    np.testing.assert_allclose(
        probs(logits, SamplingParams(**{**PLAIN, "temperature": 0.5})), softmax(logits / 0.5)
    )


def test_chain_order_top_k_then_top_p():
    # top_p's softmax is over the top_k survivors: [4/7, 3/7] reaches 0.5 with one token; over the
    # full vocab 0.4 < 0.5 would keep two.
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    p = probs(logits, SamplingParams(**{**PLAIN, "top_k": 2, "top_p": 0.5}))
    np.testing.assert_array_equal(p, [1, 0, 0, 0])


def test_chain_order_top_p_and_min_p_before_temperature():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    # At T=1 the nucleus for 0.75 is two tokens; had T=2 flattened first it would be three.
    p = probs(logits, SamplingParams(**{**PLAIN, "top_p": 0.75, "temperature": 2.0}))
    np.testing.assert_allclose(p, [*softmax(logits[:2] / 2.0), 0, 0])
    # min_p=0.7 keeps prob >= 0.35 at T=1: one token, however flat T=10 would make it.
    p = probs(logits, SamplingParams(**{**PLAIN, "min_p": 0.7, "temperature": 10.0}))
    np.testing.assert_array_equal(p, [1, 0, 0, 0])


def test_top_p_and_min_p_together_keep_the_shorter_prefix():
    logits = np.log([0.3, 0.25, 0.2, 0.15, 0.1])
    def both(top_p, min_p):
        return np.flatnonzero(probs(logits, SamplingParams(**{**PLAIN, "top_p": top_p, "min_p": min_p})))

    assert list(both(0.7, 0.1)) == [0, 1, 2]  # top_p is the tighter one
    assert list(both(0.95, 0.6)) == [0, 1, 2]  # min_p (prob >= 0.18) is the tighter one


def test_temperature_zero_is_one_hot_at_the_penalized_argmax():
    logits = read_only([1.0, 3.0, 3.0, 2.0])
    greedy = SamplingParams(temperature=0.0)
    np.testing.assert_array_equal(probs(logits, greedy), [0, 1, 0, 0])  # ties -> lowest id
    penalized = SamplingParams(temperature=0.0, repeat_penalty=2.0)
    np.testing.assert_array_equal(probs(logits, penalized, [1, 2]), [0, 0, 0, 1])
    assert choose(logits, penalized, [1, 2], np.random.default_rng(0)) == 3


def test_choose_greedy_is_argmax_and_copies_nothing():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(2_000_000).astype(np.float32)
    # Writable on purpose: np.argmax itself copies a read-only array (it asks for a writeable buffer).
    greedy = SamplingParams(temperature=0.0)
    tracemalloc.start()
    token = choose(logits, greedy, list(range(100)), rng)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert token == int(np.argmax(logits))
    assert peak < 100_000  # a copy of the row would be 8 MB
    logits.setflags(write=False)
    assert choose(logits[10:], greedy, [], rng) == int(np.argmax(logits[10:]))


def test_large_vocab_defaults():
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal(151_936)).astype(np.float32)
    d = dist(logits, SamplingParams())
    assert 1 <= len(d.ids) <= 40 and d.p.sum() == pytest.approx(1.0)  # sparse: only the kept tokens
    assert list(d.ids) == sorted(d.ids) and (d.p > 0).all()
    p = d.dense(len(logits))
    assert np.argmax(p) == np.argmax(logits)
    # top_k off: top_p alone, over the whole vocab
    p = probs(logits, SamplingParams(top_k=0, min_p=0.0))
    kept = np.sort(logits)[::-1][: np.count_nonzero(p)]
    assert set(np.flatnonzero(p)) == set(np.flatnonzero(logits >= kept[-1]))
    assert softmax(logits)[p > 0].sum() >= 0.95


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.01),
        ("min_p", 2.0),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", 1e-300),  # would divide a logit to inf, then NaN: no distribution left
        ("repeat_penalty", 1000.0),
        ("penalty_last_n", -1),
        ("temperature", float("nan")),
    ],
)
def test_validation_names_the_parameter_value_and_range(field, value):
    with pytest.raises(SamplingError, match=rf"{field}={value!r} is out of range: it must be") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, LocalspecError)


def test_sample_matches_p_and_never_draws_zero_mass():
    p = np.array([0.1, 0.0, 0.4, 0.25, 0.0, 0.25])
    rng = np.random.default_rng(2)
    counts = np.bincount([sparse(p).sample(rng) for _ in range(20_000)], minlength=len(p))
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0], 20_000 * p[p > 0]).pvalue > 1e-3


class _EdgeRng:
    """random() returns the largest double below 1, where u * total can round up to total."""

    def random(self):
        return np.nextafter(1.0, 0.0)


def test_sample_is_robust_to_rounding():
    assert Dist(np.array([0, 1]), np.array([0.3, 0.7]) * (1 + 1e-12)).sample(_EdgeRng()) == 1
    assert sparse([0.0, 1 / 3, 1 / 3, 1 / 3, 0.0]).sample(_EdgeRng()) == 3


def test_dist_lookups_and_residual_over_the_union_of_supports():
    p, q = Dist(np.array([2, 5, 9]), np.array([0.5, 0.3, 0.2])), Dist(np.array([1, 5]), np.array([0.4, 0.6]))
    assert p.prob(5) == 0.3 and p.prob(4) == 0.0 and p.prob(100) == 0.0 and p.prob(0) == 0.0
    np.testing.assert_array_equal(p.on(np.array([1, 2, 9, 10])), [0, 0.5, 0.2, 0])
    r = residual(p, q)  # max(0, p - q): 2 -> 0.5, 9 -> 0.2, normalized; 1 and 5 are where q >= p
    assert list(r.ids) == [2, 9] and r.p == pytest.approx([5 / 7, 2 / 7])
    assert residual(p, p) is None


def test_target_and_draft_rows_of_different_widths_mix():
    """Qwen2.5 7B+ targets have 152,064 logits, their 0.5B drafts 151,936: ids, not widths, meet."""
    rng = np.random.default_rng(4)
    wide, narrow = rng.standard_normal(152_064).astype(np.float32), rng.standard_normal(151_936).astype(np.float32)
    p, q = dist(wide, SamplingParams()), dist(narrow, SamplingParams())
    r = residual(p, q)
    assert r is not None and set(r.ids) <= set(p.ids)


def test_position_rng_depends_on_seed_and_position_only():
    a = [position_rng(42, j).random() for j in range(5)]
    assert a == [position_rng(42, j).random() for j in range(5)]
    assert len(set(a)) == 5 and position_rng(43, 0).random() != a[0] and position_rng(42, 0, 1).random() != a[0]


def test_sparse_sampling_never_builds_a_dense_row():
    """Per row at T > 0: a few passes over the float32 logits, no dense float64 row over the vocabulary."""
    logits = (3 * np.random.default_rng(5).standard_normal(151_936)).astype(np.float32)
    tracemalloc.start()
    dist(logits, SamplingParams())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 400_000  # a dense float64 row alone is 1.2 MB


def reference_probs(logits, sp):
    """The chain step by step over a full sort, as llama.cpp reads."""
    order = np.argsort(-logits, kind="stable")
    x = logits[order].astype(np.float64)
    if sp.top_k > 0:
        x = x[: sp.top_k]
    if sp.top_p < 1:
        cum = np.cumsum(softmax(x))
        x = x[: next((i + 1 for i, c in enumerate(cum) if c >= sp.top_p), len(x))]
    if sp.min_p > 0:
        x = x[softmax(x) >= sp.min_p * softmax(x).max()]
    p = np.zeros(len(logits))
    p[order[: len(x)]] = softmax(x / sp.temperature)
    return p


def test_probs_matches_the_step_by_step_chain():
    rng = np.random.default_rng(3)
    for case in range(300):
        scale = [0.3, 3.0, 30.0][case % 3]  # flat to peaked, so the head search takes several rounds
        logits = (scale * rng.standard_normal(2_000)).astype(np.float32)
        logits[rng.integers(2_000, size=5)] = -np.inf
        sp = SamplingParams(
            temperature=float(rng.choice([0.3, 1.0, 2.0])),
            top_k=int(rng.choice([0, 1, 5, 40, 1_999, 5_000])),
            top_p=float(rng.choice([1.0, 0.95, 0.5, 0.01])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
        )
        np.testing.assert_allclose(probs(logits, sp), reference_probs(logits, sp), atol=1e-6, err_msg=str(sp))


def test_logits_that_are_not_finite_give_a_sampling_error_not_an_index_error():
    with pytest.raises(SamplingError, match="not finite"):
        dist(np.full(8, np.nan, dtype=np.float32), SamplingParams(temperature=0.8))
