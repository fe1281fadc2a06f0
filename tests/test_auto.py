"""The auto drafter's policy and the calibration, with scripted costs and acceptance (no timing asserted)."""
import json

import numpy as np

from localspec.calibrate import Costs, load_or_measure, measure
from localspec.drafters import AutoDrafter, AutoState, Draft, NgramDrafter

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 24, 33)
# This machine's kind of CPU (../shared/MODELS.md): verifying 5 tokens costs ~3 single decodes.
CPU = Costs(SIZES, tuple(np.interp(SIZES, [1, 2, 4, 6, 8, 16, 32], [29, 38, 63, 90, 106, 119, 211]) / 1e3), 0.016)
# Verification that costs n decodes for n tokens: speculation can never pay.
LINEAR = Costs(SIZES, tuple(0.029 * n for n in SIZES), 0.016)
# A GPU: a 33-token verify costs about one decode, and the draft is cheap.
GPU = Costs(SIZES, tuple(0.010 + 0.0002 * n for n in SIZES), 0.002)

REPEATING = list(range(100, 140)) * 3  # a long stretch of context that repeats itself


class FakeModelDrafter:
    def __init__(self, tokens):
        self.tokens, self.calls = tokens, []

    def propose(self, context, n):
        self.calls.append(n)
        return Draft(self.tokens[:n])


def test_plain_when_verify_is_expensive_and_acceptance_low():
    state = AutoState(LINEAR)
    for s in state.ngram.values():
        for _ in range(50):
            s.update(1, 0)  # every n-gram guess failed
    auto = AutoDrafter(state, NgramDrafter(n_min=1), None)
    assert auto.propose(REPEATING, 16).tokens == []


def test_never_speculates_when_only_perfect_acceptance_could_break_even():
    auto = AutoDrafter(AutoState(LINEAR), NgramDrafter(n_min=1), FakeModelDrafter([1] * 16))
    assert auto.propose(REPEATING, 16).tokens == []


def test_long_ngram_drafts_when_acceptance_is_high():
    state = AutoState(CPU)
    for s in state.ngram.values():
        for _ in range(100):
            s.update(16, 16)
    d = AutoDrafter(state, NgramDrafter(n_min=1), None).propose(REPEATING, 16)
    assert len(d.tokens) >= 12
    assert d.tokens == REPEATING[-80:-80 + len(d.tokens)]  # what followed the previous occurrence


def test_learns_from_what_actually_follows_even_when_not_drafting():
    """Shadow scoring: n-gram guesses are checked against the real continuation, drafted or not."""
    state = AutoState(CPU)
    auto = AutoDrafter(state, NgramDrafter(n_min=1), None)
    ctx = list(range(100, 140)) + list(range(100, 105))
    first = auto.propose(ctx, 16)
    for t in range(105, 140):  # the text keeps quoting itself, one token per round
        ctx.append(t)
        auto.propose(ctx, 16)
    assert max(s.rates(4).min() for s in state.ngram.values()) > 0.9
    assert len(auto.propose(ctx + list(range(100, 104)), 16).tokens) > len(first.tokens)


def test_draft_model_wins_where_verification_is_nearly_free():
    model = FakeModelDrafter(list(range(16)))
    state = AutoState(GPU)
    for _ in range(50):
        state.model.update(16, 12)
    d = AutoDrafter(state, NgramDrafter(n_min=1), model).propose([1, 2, 3, 4, 5], 16)
    assert model.calls and len(d.tokens) >= 8


def test_draft_model_is_probed_now_and_then_and_less_often_when_it_loses():
    model = FakeModelDrafter([7] * 16)
    state = AutoState(CPU)
    for _ in range(50):
        state.model.update(4, 0)  # the model keeps failing
    auto = AutoDrafter(state, NgramDrafter(n_min=1), model)
    ctx = [1, 2, 3]
    for i in range(200):
        auto.propose(ctx, 16)
        ctx.append(1000 + i)
    assert 1 <= len(model.calls) <= 4
    assert state.probe_every > 64


def test_costs_interpolate():
    c = Costs((1, 2, 4), (0.01, 0.02, 0.05), None)
    assert c.verify_cost(3) == 0.035 and c.verify_cost(1) == 0.01


def test_calibration_measures_once_then_reads_the_cache(smol_path, tmp_path, monkeypatch):
    from localspec.model import Model, ModelConfig

    m = Model(smol_path, ModelConfig(n_ctx=512))
    calls = []
    import localspec.calibrate as cal

    def counting(target, draft, **kw):
        calls.append(1)
        return measure(target, draft, reps=1, **kw)

    monkeypatch.setattr(cal, "measure", counting)
    a = load_or_measure(m, m, tmp_path)
    b = load_or_measure(m, m, tmp_path)
    assert calls == [1] and a == b
    assert list(a.sizes) == sorted(a.sizes) and all(v > 0 for v in a.verify) and a.draft > 0
    assert len(m.tokens) == 0  # calibration leaves the cache empty
    (cached,) = tmp_path.glob("*.json")
    assert json.loads(cached.read_text())["sizes"][0] == 1
    m.close()


def test_a_new_request_starts_from_a_share_of_the_last_ones_statistics():
    """An edit's long copy runs must not make the next request (new text) bet on long drafts for long."""
    state = AutoState(CPU)
    for s in state.ngram.values():
        for _ in range(200):
            s.update(16, 16)  # the last request copied everything
    state.run = 50
    assert len(AutoDrafter(state, NgramDrafter(n_min=1), None).propose(REPEATING, 16).tokens) >= 12
    auto = AutoDrafter(state, NgramDrafter(n_min=1), None)  # the next request
    assert state.run == 0
    for s in state.ngram.values():
        for _ in range(12):
            s.update(1, 0)  # its guesses fail from the first token
    assert auto.propose(REPEATING, 16).tokens == []
