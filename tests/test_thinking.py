"""Tier 1: a thinking span as a constraint (core/thinking.py): its budget, its phases, the answer's grammar after
it, and the loop's output the same whatever is drafted across the span's end."""
from __future__ import annotations

import numpy as np
import pytest

from localspec.core.drafters import Draft, GrammarDrafter, NgramDrafter, NoDrafter
from localspec.core.loop import Token, speculate
from localspec.core.sampling import SamplingParams
from localspec.core.thinking import Span, Thinking

from conftest import FakeModel, onehot

TEXTS = ["", "<think>", "</think>", "\n", "\n\n", " ", "a", "b", "{", "}", "<", "think>", "</", "ok"]
T = {t: i for i, t in enumerate(TEXTS) if t}
V, EOG = len(TEXTS), 0
GREEDY = SamplingParams(temperature=0.0)


class Thinker(FakeModel):
    """A FakeModel with a vocabulary of texts: what Thinking reads of a model (pieces, tokenize, eos)."""

    eos = EOG

    def piece(self, t, special=False):
        return TEXTS[t].encode()

    def tokenize(self, text, add_special=True, parse_special=True):
        out = []
        while text:
            t = max((s for s in T if text.startswith(s)), key=len)
            out.append(T[t])
            text = text[len(t):]
        return out


def model(table=None) -> Thinker:
    return Thinker(table or {}, V, n_ctx=128, eog=EOG)


class Braces:
    """An answer grammar that allows exactly '{' '}' and then the end (the Grammar protocol, scripted)."""

    eog = frozenset({EOG})
    copying = True

    def __init__(self):
        self.at = 0
        self.matcher = self

    def is_stopped(self):
        return self.at == 2

    def _ok(self, i, t):
        return t == [T["{"], T["}"], EOG][i] if i < 3 else False

    def validate(self, tokens):
        n = 0
        while n < len(tokens) and self._ok(self.at + n, tokens[n]):
            n += 1
        return n

    def consume(self, tokens):
        assert self.validate(tokens) == len(tokens)
        self.at += len(tokens)

    def rollback(self, n):
        self.at -= n

    def allowed(self):
        out = np.zeros(V, dtype=bool)
        out[[T["{"], T["}"], EOG][self.at]] = True
        return out

    def forced(self):
        return [[T["{"], T["}"]][self.at]] if self.at < 2 else []

    def spelled(self, forced):
        return []


def test_the_budget_forces_the_end_marker_and_a_blank_line():
    th = Thinking(model(), Span(inside=True, budget=3))
    th.consume([T["a"]] * 3)
    assert th.state.phase == "closing" and th.thinking
    assert th.forced() == [T["\n"], T["</think>"], T["\n\n"]]
    row = np.zeros(V, dtype=np.float32)
    assert np.flatnonzero(np.isfinite(th.mask(row))).tolist() == [T["\n"]]
    assert th.validate([T["\n"], T["a"]]) == 1  # nothing but the transition
    th.consume(th.forced())
    assert th.state.phase == "after" and not th.thinking and th.state.thought == 3
    assert th.mask(row) is row  # a free answer: rows pass through


def test_a_budget_of_zero_closes_a_span_the_prompt_opened_at_once():
    th = Thinking(model(), Span(inside=True, budget=0))
    assert th.forced() == [T["\n"], T["</think>"], T["\n\n"]]


def test_a_span_the_model_closes_within_its_budget_is_not_forced():
    th = Thinking(model(), Span(inside=True, budget=5))
    th.consume([T["a"], T["</"], T["think>"]])  # the close marker across two tokens
    assert th.state.phase == "after" and th.forced() == []
    th.consume([T["a"]] * 10)
    assert th.state.phase == "answer"


@pytest.mark.parametrize("tokens, phase", [
    (["<think>"], "inside"), ([" ", "<think>"], "inside"), (["<", "think>"], "inside"), (["\n"], "start"),
    (["a"], "answer"), (["<", "a"], "answer"), (["{"], "answer")])
def test_where_the_output_opens_the_span_itself(tokens, phase):
    th = Thinking(model(), Span(budget=4))
    th.consume([T[t] for t in tokens])
    assert th.state.phase == phase


def test_the_answer_grammar_holds_after_the_span_and_never_inside_it():
    th = Thinking(model(), Span(budget=2), Braces())
    start = th.allowed()
    assert start[T["<think>"]] and start[T["<"]] and start[T[" "]] and start[T["{"]] and not start[T["a"]]
    th.consume([T["<think>"]])
    inside = th.allowed()  # thinking is free, but may not end the output: an answer is owed
    assert inside[T["a"]] and inside[T["{"]] and inside[T["</think>"]] and not inside[EOG]
    assert th.validate([T["a"], EOG]) == 1
    assert th.validate([T["a"], T["b"], T["\n"], T["</think>"], T["\n\n"], T["{"], T["}"], EOG]) == 8
    assert th.state.phase == "inside" and th.inner.at == 0  # validate leaves no trace
    th.consume([T["a"], T["b"]])
    assert th.forced() == [T["\n"], T["</think>"], T["\n\n"]]
    th.consume(th.forced())
    after = th.allowed()
    assert after[T["{"]] and after[T["\n"]] and not after[T["a"]] and not after[EOG]  # the answer is owed
    assert th.forced() == []
    th.consume([T["{"]])
    assert th.forced() == [T["}"]] and th.inner.at == 1
    th.rollback(1)
    assert th.inner.at == 0 and th.state.phase == "after"


def test_without_a_span_in_the_output_the_grammar_holds_from_the_start():
    th = Thinking(model(), Span(budget=2), Braces())
    th.consume([T["{"], T["}"]])
    assert th.inner.at == 2 and th.validate([EOG]) == 1


# ---- through the loop: the same output whatever is drafted, the budget counted ----
def thinker_target() -> Thinker:
    """Thinks 'a' forever; after the blank line it answers 'ok' (or '{}') and ends."""
    blank = onehot(V, T["ok"]) + onehot(V, T["{"], 5.0)  # 'ok', or '{' where only a brace may follow
    table = {T["<think>"]: onehot(V, T["a"]), T["a"]: onehot(V, T["a"]), T["\n\n"]: blank,
             T["ok"]: onehot(V, EOG), T["{"]: onehot(V, T["}"]), T["}"]: onehot(V, EOG)}
    return model(table)


class Anything:
    """Drafts k tokens of a fixed guess: some right, some wrong, across the span's end."""

    def __init__(self, guess):
        self.guess = guess

    def propose(self, context, n):
        return Draft(list(self.guess[:n]))


def run(drafter_for, span, inner=None, k=4):
    target = thinker_target()
    th = Thinking(target, span, inner)
    facts = list(speculate(target, None, drafter_for(th), [T["<think>"]], max_tokens=40, k=k, rule="greedy",
                           params=GREEDY, seed=0, grammar=th))
    return [f.token for f in facts if type(f) is Token], th


@pytest.mark.parametrize("drafter_for", [
    lambda th: NoDrafter(), lambda th: NgramDrafter(n_min=1), lambda th: GrammarDrafter(th, NgramDrafter(n_min=1)),
    lambda th: GrammarDrafter(th, Anything([T["a"], T["a"], T["ok"], T["b"]]))])
def test_the_budget_ends_the_span_and_the_output_is_the_same_whatever_is_drafted(drafter_for):
    tokens, th = run(drafter_for, Span(inside=True, budget=5))
    assert tokens == [T["a"]] * 5 + [T["\n"], T["</think>"], T["\n\n"], T["ok"]]
    assert th.state.thought == 5


def test_the_answer_after_a_forced_end_follows_its_grammar_through_the_loop():
    for drafter_for in (lambda th: NoDrafter(), lambda th: GrammarDrafter(th, NgramDrafter(n_min=1))):
        tokens, th = run(drafter_for, Span(inside=True, budget=2), Braces())
        assert tokens == [T["a"]] * 2 + [T["\n"], T["</think>"], T["\n\n"], T["{"], T["}"]]
