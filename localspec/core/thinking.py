"""A thinking span as a constraint: its budget, and the answer's grammar starting where the span ends.

A reasoning model writes `<think>...</think>`, then its answer. Two things act on what it generates: a budget
(after `budget` thinking tokens the end marker is forced, with a short transition), and the grammar of the
answer (structured output constrains the answer, never the thinking). `Thinking` speaks the grammar protocol
the loop and the drafters already use (rows/advance for the loop; forced, spelled, consume, rollback,
validate, first_end and mask for drafters), so neither adds a branch to `speculate`: the span is one more mask
step, and the forced end marker is a forced draft like a JSON key's quotes (drafted for free, read by the
draft model as it catches up, as every emitted token is).

Phases, one per consumed token (kept on a stack, so rollback is a pop):
  start    the output may open the span: whitespace, then the open marker (else it is all answer)
  inside   thinking, its tokens counted; the close marker (or the budget) ends it; with an answer grammar to
           come, the output may not end here
  closing  over budget: the transition's tokens, forced one by one
  after    whitespace between the span and the answer (neither's)
  answer   the inner grammar's (free when there is none)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from .grammar import Masked


@dataclass(frozen=True)
class Span:
    """How a request's output holds a thinking span: the markers its template writes, whether the prompt
    already opened it (the output starts inside), and the most thinking tokens before the end is forced."""

    open: str = "<think>"
    close: str = "</think>"
    inside: bool = False
    budget: int | None = None
    end: str = ""  # what the budget forces, where the format has its own ('' : the usual transition)
    lead: str = ""  # what may open the answer without a span (gpt-oss's final channel): the answer's, not shown

    def transition(self) -> str:
        """What is forced when the budget runs out: the format's own end, else the end marker on a line of its
        own, then a blank line."""
        return self.end or f"\n{self.close}\n\n"


class _State(NamedTuple):
    phase: str
    thought: int  # tokens consumed inside the span
    held: str  # text that may yet be a marker (start: an open marker's beginning; inside: a close marker's)
    held_tokens: tuple[int, ...]  # start: the tokens of held, which become answer if no marker comes
    forced: int  # closing: transition tokens emitted so far
    inner: int  # tokens the inner grammar consumed for this step (what a rollback of it gives back)


def partial(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _tables(model) -> tuple[list[str], np.ndarray]:
    """Every token's text (control tokens spelled out) and which tokens are whitespace alone; per model, built
    the first time a mask needs them (~0.5 s for 150k tokens): only where an answer grammar follows a span."""
    t = getattr(model, "_thinking_tables", None)
    if t is None:
        texts = [model.piece(i, True).decode("utf-8", "replace") for i in range(model.n_vocab)]
        space = np.fromiter((bool(s) and not s.strip() for s in texts), dtype=bool, count=len(texts))
        t = model._thinking_tables = (texts, space)
    return t


class Thinking(Masked):
    """The span of one request's output, over `inner` (a Grammar for the answer, or None: a free answer)."""

    def __init__(self, model, span: Span, inner=None):
        self.model, self.spec, self.inner, self.n_vocab = model, span, inner, model.n_vocab
        self.close_tokens = model.tokenize(span.transition(), add_special=False)
        first = self._enter_inside(0, "") if span.inside else _State("start", 0, "", (), 0, 0)
        self.stack: list[_State] = [first]
        self._opening: np.ndarray | None = None  # start, nothing held: the tokens that may begin the marker
        self._thinking_row: np.ndarray | None = None  # inside, with an answer grammar: all but the end

    @property
    def state(self) -> _State:
        return self.stack[-1]

    @property
    def copying(self) -> bool:
        """Whether the answer is structured output (auto prices its drafts as copied values then)."""
        return self.inner is not None

    @property
    def thinking(self) -> bool:
        """Whether the next token is the span's (for statistics kept per span)."""
        return self.state.phase in ("inside", "closing")

    @property
    def span(self) -> str:
        """The span the next token is in, as the loop's Round names it."""
        return "thinking" if self.thinking else "answer"

    def _enter_inside(self, thought: int, rest: str) -> _State:
        s = _State("inside", thought, "", (), 0, 0)
        if self.spec.budget is not None and thought >= self.spec.budget:
            return _State("closing", thought, "", (), 0, 0)
        return self._inside_text(s, rest) if rest else s

    def _inside_text(self, s: _State, text: str) -> _State:
        """Inside, text was written: closed where it holds the close marker, else what may begin one held."""
        text = s.held + text
        close = self.spec.close
        if close in text:
            return _State("after", s.thought, "", (), 0, 0)
        keep = partial(text, close)
        return s._replace(held=text[len(text) - keep:] if keep else "")

    def _text(self, tok: int) -> str:
        return self.model.piece(tok, True).decode("utf-8", "replace") if 0 <= tok < self.n_vocab else ""

    # ---- one token ----
    def _step(self, s: _State, tok: int) -> _State | None:
        """The state after tok, or None where tok is not allowed here."""
        if s.phase == "answer":  # the answer's grammar judges it (its text is not needed)
            return self._answer([tok], s.thought)
        text = self._text(tok)
        if s.phase == "start":
            now = s.held + text
            lead = now.lstrip()
            if lead.startswith(self.spec.open):
                return self._enter_inside(0, lead[len(self.spec.open):])._replace(inner=0)
            if not lead or self.spec.open.startswith(lead):
                return _State("start", 0, now, (*s.held_tokens, tok), 0, 0)
            return self._answer([*s.held_tokens, tok])
        if s.phase == "inside":
            n = self._inside_text(s._replace(thought=s.thought + 1), text)
            if n.phase == "inside" and self.spec.budget is not None and n.thought >= self.spec.budget:
                return _State("closing", n.thought, "", (), 0, 0)
            return n
        if s.phase == "closing":
            if tok != self.close_tokens[s.forced]:
                return None
            if s.forced + 1 < len(self.close_tokens):
                return s._replace(forced=s.forced + 1)
            return _State("after", s.thought, "", (), 0, 0)
        if s.phase == "after" and not text.strip() and text:
            return s._replace(inner=0)
        return self._answer([tok], s.thought)

    def _answer(self, tokens: list[int], thought: int = 0) -> _State | None:
        if self.inner is not None:
            if self.inner.validate(tokens) < len(tokens):
                return None
            self.inner.consume(tokens)
        return _State("answer", thought, "", (), 0, len(tokens) if self.inner is not None else 0)

    # ---- the grammar protocol: for drafters ----
    def consume(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            s = self._step(self.state, t)
            if s is None:
                raise ValueError(f"token {t} is not allowed here ({self.state.phase})")  # pragma: no cover - a bug
            self.stack.append(s)

    def rollback(self, n: int) -> None:
        for _ in range(n):
            s = self.stack.pop()
            if s.inner:
                self.inner.rollback(s.inner)

    def first_end(self, tokens: Sequence[int]) -> int:
        return next((j for j, t in enumerate(tokens) if self.model.is_eog(t)), len(tokens))

    def validate(self, tokens: Sequence[int]) -> int:
        n = 0
        try:
            for t in tokens:
                if self.state.phase == "answer":  # the rest is the answer's grammar's to judge (or free)
                    return n + (self.inner.validate(tokens[n:]) if self.inner is not None else len(tokens) - n)
                if self.model.is_eog(t):
                    return n + (self.state.phase != "closing" and self._free_end())
                s = self._step(self.state, t)
                if s is None:
                    return n
                self.stack.append(s)
                n += 1
            return n
        finally:
            self.rollback(n)

    def _free_end(self) -> bool:
        """Whether the end may come now: anywhere without an answer grammar; with one, only where the answer
        could end (never inside the span: an output that ends thinking has no answer to hold to its schema)."""
        if self.inner is None:
            return True
        return self.state.phase != "inside" and bool(self.inner.allowed()[list(self.inner.eog)].any())

    def forced(self) -> list[int]:
        s = self.state
        if s.phase == "closing":
            return self.close_tokens[s.forced:]
        if s.phase == "answer" and self.inner is not None:
            return self.inner.forced()
        return []

    def spelled(self, forced: Sequence[int]) -> list[int]:
        if self.state.phase == "answer" and self.inner is not None:
            return self.inner.spelled(forced)
        return []

    def allowed(self) -> np.ndarray | None:
        """Which tokens may come next, or None where any may."""
        s = self.state
        if s.phase == "inside":  # thinking is free; with an answer grammar to come, it may not end the output
            if self.inner is None:
                return None
            if self._thinking_row is None:
                self._thinking_row = np.ones(self.n_vocab, dtype=bool)
                self._thinking_row[[t for t in self.inner.eog if t < self.n_vocab]] = False
            return self._thinking_row
        if s.phase == "closing":
            out = np.zeros(self.n_vocab, dtype=bool)
            out[self.close_tokens[s.forced]] = True
            return out
        if self.inner is None:
            return None
        if s.phase == "answer":
            return self.inner.allowed()
        if s.phase == "after":
            return _tables(self.model)[1][:self.n_vocab] | self.inner.allowed()
        return self._start_allowed(s)

    def _start_allowed(self, s: _State) -> np.ndarray:
        """At the start: what continues an open marker (or whitespace before it), or what the answer's
        grammar allows after the tokens held so far."""
        if not s.held and self._opening is not None:
            opening = self._opening
        else:
            open_, texts = self.spec.open, _tables(self.model)[0]
            opening = np.fromiter(((lambda lead: not lead or lead.startswith(open_) or open_.startswith(lead))(
                (s.held + t).lstrip()) and bool(t) for t in texts), dtype=bool, count=len(texts))
            if not s.held:
                self._opening = opening
        out = np.zeros(self.n_vocab, dtype=bool)
        out[:len(opening)] = opening[:self.n_vocab]
        held = list(s.held_tokens)
        if self.inner.validate(held) == len(held):
            self.inner.consume(held)
            try:
                out |= self.inner.allowed()
            finally:
                self.inner.rollback(len(held))
        return out

    # ---- the grammar protocol: for the loop (the rest is Masked's) ----
    def ends(self) -> list[int]:
        return sorted(self.inner.eog) if self.inner is not None else [self.model.eos]

    def done(self) -> bool:
        """True once the answer's grammar is complete."""
        return self.state.phase == "answer" and self.inner is not None and self.inner.matcher.is_stopped()
