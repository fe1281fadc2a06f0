"""Thinking spans: a reasoning model's `<think>...</think>` kept apart from its answer.

Which markers a model uses is read from its chat template, not guessed from its output: a template that writes
both `<think>` and `</think>` (Qwen3, DeepSeek-R1 distills, SmolLM3, GLM) has a span; one that writes neither has
none, and its whole output is answer. A template may open the span itself, at the end of the prompt (R1
distills' later templates, Qwen3 with thinking on): then the output starts inside it. gpt-oss's harmony format
is read the same way: its analysis channel is the span, its final channel the answer (its tool calls, in the
commentary channel, are not read: a request with tools is refused, see docs/server.md).

The span is recognised once, where the output starts (after any whitespace), or from the prompt: after it closes
everything is answer, so a literal `<think>` the answer writes (code about tags, a quote) stays answer. Text that
may be the start of a marker is held until the next text says whether it is one; what a stream shows never has
to be taken back.
"""
from __future__ import annotations

import re
from dataclasses import replace

from ..core.thinking import Span, partial


# The markers of a span (core.thinking.Span's open, close, end and lead; inside and budget are a request's)
THINK = Span("<think>", "</think>")
# gpt-oss (OpenAI's harmony format): the analysis channel is the thinking, the final channel the answer (opened
# without an analysis channel too). llama.cpp renders these tokens as text, <|end|> included.
_FINAL = "<|start|>assistant<|channel|>final<|message|>"
HARMONY = Span("<|channel|>analysis<|message|>", "<|end|>" + _FINAL, end="<|end|>" + _FINAL,
               lead="<|channel|>final<|message|>")


def markers_of(template: str | None) -> Span | None:
    """The thinking markers a chat template writes, or None where it writes none (no reasoning span)."""
    if not template:
        return None
    if THINK.open in template and THINK.close in template:
        return THINK
    if "<|channel|>analysis<|message|>" in template and "<|channel|>final<|message|>" in template:
        return HARMONY
    return None


def opens_in_prompt(prompt: str, markers: Span) -> bool:
    """Whether the rendered prompt leaves the span open (its last marker is an open one): the output starts
    inside it."""
    last_open, last_close = prompt.rfind(markers.open), prompt.rfind(markers.close)
    return last_open > last_close and not prompt[last_open + len(markers.open):].strip()


def span_for(llm, messages: list[dict], *, tools=None, variables: dict | None = None,
             budget: int | None = None) -> Span | None:
    """The thinking span of a chat request's reply (None where the model's template writes none): its markers,
    whether the prompt the template renders opens it, and its budget."""
    markers = markers_of(llm.chat_template())
    if markers is None:
        return None
    inside = opens_in_prompt(llm.render_chat(messages, tools=tools, variables=variables), markers)
    return replace(markers, inside=inside, budget=budget)


def split(text: str, span: Span | None) -> tuple[str | None, str]:
    """A whole reply's (thinking, answer); thinking is None where there is no span."""
    if span is None:
        return None, text
    s = Spans(span)
    pieces = s.feed(text) + s.finish()
    return "".join(t for r, t in pieces if r), "".join(t for r, t in pieces if not r)


class Spans:
    """Generated text split into reasoning and answer as it streams: feed() returns (is_reasoning, text) pieces,
    finish() what was held at the end."""

    def __init__(self, span: Span):
        """span: its markers, and whether the prompt opened it (span.inside: the output starts inside it)."""
        self.markers = span
        # start -> inside -> after -> answer; start -> answer; start -> lead (an answer's own opening) -> answer
        self.state = "inside" if span.inside else "start"
        self.held = ""
        self.reasoning_chars = 0
        # per span, the generated tokens and those of them drafted and accepted (token())
        self.counts = {span: {"tokens": 0, "from_draft": 0} for span in ("reasoning", "answer")}
        self._undecided: list[bool] = []  # start: tokens that may be the open marker's (from_draft each)

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self.held += text
        out: list[tuple[bool, str]] = []
        m = self.markers
        while self.held:
            if self.state == "start":
                s = self.held.lstrip()
                if s.startswith(m.open):
                    self.held, self.state = s[len(m.open):], "inside"
                elif m.lead and s.startswith(m.lead):  # the answer's own opening: neither's text
                    self.held, self.state = s[len(m.lead):], "lead"
                elif not s or m.open.startswith(s) or m.lead.startswith(s):
                    break  # whitespace, or what may yet be the open marker: wait for more
                else:
                    self.state = "answer"  # no span: the answer is everything, whitespace and all
            elif self.state == "inside":
                i = self.held.find(m.close)
                if i >= 0:
                    out.append((True, self.held[:i]))
                    self.held, self.state = self.held[i + len(m.close):], "after"
                else:
                    keep = partial(self.held, m.close)
                    out.append((True, self.held[:len(self.held) - keep]))
                    self.held = self.held[len(self.held) - keep:]
                    break
            elif self.state in ("after", "lead"):  # the whitespace between the span and the answer is neither
                s = self.held.lstrip()
                self.held = s
                if s:
                    self.state = "answer"
            else:
                out.append((False, self.held))
                self.held = ""
        return self._count([(r, t) for r, t in out if t])

    def token(self, text: str, from_draft: bool = False) -> list[tuple[bool, str]]:
        """feed() one generated token's text, counting the token in its span: a token is thinking where it
        opens, continues or closes the span (its markers are the span's), answer otherwise."""
        before = self.state
        pieces = self.feed(text)
        if self.state == "start":  # what may yet open the span (a marker of several tokens): counted once known
            self._undecided.append(from_draft)
            return pieces
        thinking = self.state == "inside" or (before in ("start", "inside") and self.state == "after")
        for drafted in [*self._undecided, from_draft]:
            self._add("reasoning" if thinking else "answer", drafted)
        self._undecided.clear()
        return pieces

    def _add(self, span: str, from_draft: bool) -> None:
        self.counts[span]["tokens"] += 1
        self.counts[span]["from_draft"] += bool(from_draft)

    def finish(self) -> list[tuple[bool, str]]:
        """What was held: an unclosed span's end is reasoning; text that only looked like an open marker is
        answer."""
        held, self.held = self.held, ""
        for drafted in self._undecided:  # what only looked like an open marker: answer
            self._add("answer", drafted)
        self._undecided.clear()
        if not held or self.state in ("after", "lead"):
            return []
        return self._count([(self.state == "inside", held)])

    def _count(self, pieces: list[tuple[bool, str]]) -> list[tuple[bool, str]]:
        self.reasoning_chars += sum(len(t) for r, t in pieces if r)
        return pieces


# ---- a chat request's fields that reach the template ----
EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values, and "none"
MAX_VARIABLES = 32
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class FieldError(ValueError):
    """A request field that cannot be honoured: its message, and the field (`param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def budget_of(body: dict, cap: int | None) -> int | None:
    """A chat request's thinking budget: its `reasoning_budget` (the most thinking tokens before the end marker
    is forced; -1 or absent: none of its own), never over the server's --reasoning-budget (`cap`, None: none)."""
    b = body.get("reasoning_budget")
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < -1):
        raise FieldError("reasoning_budget must be an integer: the most thinking tokens, or -1 for no limit",
                         "reasoning_budget")
    own = None if b is None or b == -1 else b
    return own if cap is None else cap if own is None else min(own, cap)


def template_variables(body: dict, template: str | None, reserved: frozenset) -> dict:
    """The variables a chat request gives its chat template: `chat_template_kwargs` (names that are no
    identifier, or that would replace what every template is given, are refused), and `reasoning_effort`
    "none" as `enable_thinking` false, which a template that thinks must read (else the request is refused:
    the thinking could not be turned off); low, medium and high reach a template that reads `reasoning_effort`
    (gpt-oss's), and change nothing elsewhere: no budget is tied to them."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise FieldError("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    if len(kwargs) > MAX_VARIABLES:
        raise FieldError(f"chat_template_kwargs takes at most {MAX_VARIABLES} variables, got {len(kwargs)}",
                         "chat_template_kwargs")
    for name in kwargs:
        if not _VARIABLE.fullmatch(name) or name in reserved:
            raise FieldError(f"chat_template_kwargs: {name[:64]!r} is not a variable a request may set",
                             f"chat_template_kwargs.{name[:64]}")
    variables = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise FieldError(f"reasoning_effort must be one of {', '.join(EFFORTS)}", "reasoning_effort")
        if effort == "none" and markers_of(template) is not None:
            if "enable_thinking" not in (template or ""):
                raise FieldError("reasoning_effort 'none': this model's chat template cannot turn its thinking "
                                 "off (it reads no enable_thinking)", "reasoning_effort")
            variables.setdefault("enable_thinking", False)
        elif effort in ("low", "medium", "high") and "reasoning_effort" in (template or ""):
            variables.setdefault("reasoning_effort", effort)  # gpt-oss's template: "Reasoning: low"
    return variables
