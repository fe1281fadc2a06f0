"""Tier 1: the decoding loop against scripted fake models (exact accept / rewind / stop / EOS / context paths)."""
import numpy as np
import pytest

from localspec.core.drafters import Draft, NgramDrafter, NoDrafter
from localspec.core.loop import Finish, Round, Token, speculate
from localspec.core.stream import Stream
from localspec.core.sampling import SamplingParams
from localspec.core.text import TextStream

from conftest import FakeModel, onehot

V = 10
GREEDY = SamplingParams(temperature=0.0)


def counting(eog: int = -1, n_ctx: int = 64) -> FakeModel:
    """A target that always predicts t+1 after t (mod V)."""
    return FakeModel({t: onehot(V, (t + 1) % V) for t in range(V)}, V, n_ctx=n_ctx, eog=eog)


class Scripted:
    def __init__(self, proposals):
        self.proposals, self.calls = list(proposals), []

    def propose(self, context, n):
        self.calls.append((list(context), n))
        return Draft(self.proposals.pop(0)[:n] if self.proposals else [])


def run(target, drafter, prompt, **kw):
    kw = dict(max_tokens=20, k=4, rule="greedy", params=GREEDY, seed=0) | kw
    return list(speculate(target, None, drafter, prompt, **kw))


def tokens_of(facts):
    return [f.token for f in facts if type(f) is Token]


def test_accept_prefix_then_correct_and_rewind():
    target = counting()
    drafter = Scripted([[1, 2, 9], [4, 5, 6, 7]])
    facts = run(target, drafter, [0], max_tokens=9)
    rounds = [f for f in facts if type(f) is Round]
    assert (rounds[0].drafted, rounds[0].accepted) == (3, 2)  # 1, 2 accepted; 9 rejected, 3 emitted
    assert (rounds[1].drafted, rounds[1].accepted) == (4, 4)  # full accept plus the bonus token 8
    assert tokens_of(facts)[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [f.from_draft for f in facts if type(f) is Token][:8] == [True, True, False, True, True, True, True, False]
    # one target decode per round: [pending, d1..dk], and after each round the cache is context[:-1]
    assert target.decodes[0] == [0, 1, 2, 9] and target.decodes[1] == [3, 4, 5, 6, 7]
    assert facts[-1] == Finish("length")
    assert target.tokens == [0] + tokens_of(facts)[:-1]


def test_output_equals_plain_whatever_the_draft():
    plain = tokens_of(run(counting(), NoDrafter(), [3], max_tokens=15))
    rng = np.random.default_rng(1)
    noisy = Scripted([list(rng.integers(0, V, size=4)) for _ in range(30)])
    assert tokens_of(run(counting(), noisy, [3], max_tokens=15)) == plain
    assert plain == [(3 + i) % V for i in range(1, 16)]


def test_eos_ends_with_stop_and_is_not_emitted():
    facts = run(counting(eog=5), Scripted([[1, 2, 3, 4, 5, 6]]), [0], k=6)
    assert tokens_of(facts) == [1, 2, 3, 4]
    assert facts[-1] == Finish("stop")
    # the target accepted 1..6, but only what was emitted counts: stats never show more accepted than generated
    (rnd,) = [f for f in facts if type(f) is Round]
    assert (rnd.drafted, rnd.accepted) == (6, 4)


def test_cancel_ends_the_stream_between_rounds_and_leaves_the_cache_consistent():
    target, calls = counting(), []

    def cancel():
        calls.append(1)
        return len(calls) > 3

    facts = run(target, Scripted([[1, 2]] * 10), [0], cancel=cancel)
    assert facts[-1] == Finish("cancelled")
    assert target.tokens == [0] + tokens_of(facts)[:-1]


def test_context_full_ends_with_length_not_a_crash():
    target = counting(n_ctx=8)
    facts = run(target, Scripted([[1, 2, 3, 4]] * 5), [0], max_tokens=100)
    assert facts[-1].reason == "length" and "the context filled up (n_ctx=8) before max_tokens" in facts[-1].note
    assert len(target.tokens) <= 8
    assert tokens_of(facts) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_k_never_exceeds_tokens_left():
    drafter = Scripted([[1, 2, 3, 4]] * 10)
    facts = run(counting(), drafter, [0], max_tokens=3)
    assert len(tokens_of(facts)) == 3
    assert all(n <= 2 for _, n in drafter.calls)


def test_consumer_stopping_early_leaves_cache_consistent():
    target = counting()
    gen = speculate(target, None, Scripted([[1, 2, 3]] * 5), [0], max_tokens=20, k=3, rule="greedy",
                    params=GREEDY, seed=0)
    seen = [f for _, f in zip(range(4), gen)]
    gen.close()
    assert type(seen[-1]) is Token
    assert target.tokens == [0, 1, 2, 3]


def test_ngram_drafter_proposes_continuation_of_latest_match():
    d = NgramDrafter(n_min=2, n_max=3)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 2).tokens == [5, 7]
    assert d.propose([1, 2, 3, 4], 3).tokens == []


def test_ngram_lookup_says_where_its_guess_comes_from_and_whether_the_context_disagrees():
    d = NgramDrafter(n_min=1, n_max=3)
    m = d.lookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 2)
    assert m == (3, [5, 7], True, 8)  # "1 2 3" was followed by 4, then by 5: split; the latest starts at 8
    m = d.lookup([1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 1, 2, 3], 2)
    assert (m.tokens, m.split) == ([4, 7], False)  # both occurrences agree
    assert d.lookup([1, 2], 2) == (0, [], False, 0)


def test_stream_stop_string_and_stats():
    target = counting()
    facts = speculate(target, None, Scripted([[1, 2, 3, 4]] * 5), [0], max_tokens=20, k=4, rule="greedy",
                      params=GREEDY, seed=0)
    s = Stream(facts, target.piece, stop=["<4><5"], drafter="scripted", rule="greedy", k=4, prompt_tokens=1)
    text = "".join(e.text for e in s)
    assert text == "<1><2><3>"
    assert s.finish_reason == "stop"
    assert s.stats.drafted >= 4 and s.stats.accepted_at[0] >= 1 and s.stats.lossless


def test_text_stream_utf8_split_across_tokens():
    ts = TextStream()
    data = "é😀".encode()
    out = [ts.push(data[i:i + 1]) for i in range(len(data))]
    assert "".join(out) + ts.flush() == "é😀"
    assert all("\ufffd" not in o for o in out)


def test_text_stream_holds_possible_stop_prefix():
    ts = TextStream(["</end>"])
    assert ts.push(b"abc</") == "abc"
    assert ts.push(b"en") == ""
    assert ts.push(b"x") == "</enx"
    assert ts.push(b"</e") == ""
    assert ts.flush() == "</e"
    ts = TextStream(["STOP"])
    assert ts.push(b"aSTO") == "a" and ts.push(b"Pzz") == "" and ts.stopped


@pytest.mark.parametrize("rule", ["rejection", "greedy", "threshold"])
def test_rules_agree_at_temperature_zero_with_fakes(rule):
    out = tokens_of(run(counting(), Scripted([[1, 2, 7, 4]] * 10), [0], rule=rule, max_tokens=10, tau=0.9))
    assert out == list(range(1, 10)) + [0]


def test_prediction_lookup_follows_the_output_through_repeats():
    from localspec.core.drafters import Prediction

    pred = [1, 2, 3, 9, 1, 2, 3, 7, 8]
    p = Prediction(pred, prompt_len=2)
    assert p.lookup([50, 51], 3) == (8, [1, 2, 3])  # nothing generated yet: the prediction's start
    assert p.lookup([50, 51, 1, 2, 3], 2)[1] == [9, 1]  # nearest match after where it stood
    assert p.lookup([50, 51, 1, 2, 3, 9, 1, 2, 3], 2)[1] == [7, 8]  # the second occurrence, not the first
    assert p.lookup([50, 51, 4], 3) == (0, [])


def test_the_match_walk_finds_every_longest_agreement_as_a_plain_loop_does():
    """core.match.longest_match, the walk NgramDrafter, Prediction and SuffixCache share, against the plain
    definition: for each place, count backwards while corpus and tail agree (never before the corpus's start,
    never across a -1); keep the places with the most."""
    from localspec.core.match import longest_match

    def plain(corpus, ends, tail):
        agree = []
        for e in ends:
            k = 0
            while k < len(tail) and e - k >= 0 and corpus[e - k] == tail[-1 - k]:
                k += 1
            agree.append(k)
        if not agree:
            return [], 0
        best = max(agree)
        return [e for e, a in zip(ends, agree) if a == best], best

    rng = np.random.default_rng(7)
    for _ in range(300):
        corpus = rng.integers(-1, 4, size=int(rng.integers(1, 60))).astype(np.int32)  # small alphabet: long matches
        tail = rng.integers(0, 4, size=int(rng.integers(1, 10))).astype(np.int32)
        ends = np.flatnonzero(rng.random(len(corpus)) < 0.5)
        got, size = longest_match(corpus, ends, tail)
        want, want_size = plain(corpus, ends, tail)
        assert (got.tolist(), size) == (want, want_size)
