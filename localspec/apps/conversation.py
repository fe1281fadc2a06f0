"""A chat's conversation, apart from the terminal: messages (as OpenAI writes them), turns dropped to fit the
context (kept, marked, for /save), the session's totals and the stats line."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.chat_template import ChatError, text_of
from ..core.stream import Stats

ROLES = ("system", "user", "assistant")


def parse_messages(data: object) -> list[dict]:
    """Messages from JSON: a list of {role, content[, reasoning_content, interrupted, dropped]}, or an object with a
    "messages" list."""
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list):
        raise ChatError("expected a JSON list of messages (or an object with a \"messages\" list)")
    out = []
    for i, m in enumerate(data):
        text = text_of(m.get("content")) if isinstance(m, dict) else None
        if not (isinstance(m, dict) and m.get("role") in ROLES and text is not None):
            raise ChatError(f"message {i} must be an object with role ({', '.join(ROLES)}) and content (text, or "
                            f"a list of text parts), got {json.dumps(m)[:80]}")
        out.append({"role": m["role"], "content": text})
        if m["role"] == "assistant" and isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            out[-1]["reasoning_content"] = m["reasoning_content"]  # its thinking, kept beside the answer
        for mark in ("interrupted", "dropped"):
            if m.get(mark) and m["role"] != "system":  # the system prompt is never dropped
                out[-1][mark] = True
    return out


def plain(messages: list[dict]) -> list[dict]:
    """What the model sees: role and content only (the interruption and dropped marks, and a reply's thinking,
    stay out)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class DoesNotFit(ChatError):
    """Even the system prompt and the newest message alone are too long."""


def drop_oldest_turns(messages: list[dict], fits: Callable[[list[dict]], bool],
                      roomy: Callable[[list[dict]], bool] | None = None) -> int:
    """Drop whole turns (a user message and what follows it) from the front until `fits(messages)`; once any
    must go, go on until `roomy(messages)` too, while older turns remain.

    The system prompt and the newest user message always stay; returns the number of turns dropped, and
    raises DoesNotFit when even those alone do not fit.
    """
    start = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while not fits(messages) or (dropped and roomy is not None and not roomy(messages)):
        users = [i for i in range(start, len(messages)) if messages[i]["role"] == "user"]
        if len(users) < 2 and not (users and users[0] > start):
            if dropped and fits(messages):
                break  # no slack left to make, but it fits
            raise DoesNotFit("the new message alone does not fit")
        # everything before the second user turn (or before the only one, when replies precede it)
        del messages[start:users[1] if users[0] == start else users[0]]
        dropped += 1
    return dropped


class Conversation:
    """The messages so far; an assistant message may carry `interrupted: True` beside role and content, and
    a message dropped from the model's context to make room (`dropped: True`) stays here, for /save."""

    def __init__(self, system: str | None = None):
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    def set_system(self, text: str) -> None:
        if self.system is not None:
            self.messages[0] = {"role": "system", "content": text}
        else:
            self.messages.insert(0, {"role": "system", "content": text})

    def reset(self) -> None:
        del self.messages[1 if self.system is not None else 0:]

    def in_context(self) -> list[dict]:
        """The messages the model still sees."""
        return [m for m in self.messages if not m.get("dropped")]

    def save(self, path: Path) -> None:
        """A regular file is written beside itself (through a symlink, to where it points) and moved over, with
        its mode kept: a save cut short (a full disk) leaves the old file whole. Anything else (/dev/stdout, a
        pipe) is written to as it is."""
        text = json.dumps(self.messages, indent=2, ensure_ascii=False) + "\n"
        if path.exists() and not path.is_file():  # /dev/stdout (a pipe's /proc link has no real path)
            path.write_text(text, encoding="utf-8")
            return
        real = Path(os.path.realpath(path))
        tmp = real.with_name(f".{real.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            if real.exists():
                shutil.copymode(real, tmp)
            os.replace(tmp, real)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def load(self, path: Path) -> None:
        self.messages = parse_messages(json.loads(path.read_text(encoding="utf-8")))


@dataclass
class Totals:
    """Session totals over every reply, for /stats."""

    replies: int = 0
    interrupted: int = 0
    generated: int = 0
    gen_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    drafting_rounds: int = 0
    prefilled: int = 0
    reused: int = 0
    dropped: int = 0

    def add(self, s: Stats, *, interrupted: bool) -> None:
        self.replies += 1
        self.interrupted += interrupted
        self.generated += s.generated
        self.gen_s += s.gen_s
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.drafting_rounds += s.drafting_rounds
        self.prefilled += s.prompt_prefilled
        self.reused += s.prompt_reused

    def line(self, context: int, n_ctx: int) -> str:
        tps = self.generated / self.gen_s if self.gen_s > 0 else 0.0
        rate = self.accepted / self.drafted if self.drafted else 0.0
        mean = self.accepted / self.drafting_rounds if self.drafting_rounds else 0.0
        return (f"{self.replies} replies ({self.interrupted} interrupted), {self.generated} tokens in "
                f"{self.gen_s:.1f}s ({tps:.1f} tok/s); drafts {self.accepted}/{self.drafted} accepted ({rate:.0%}), "
                f"{mean:.2f} per round; prompt {self.prefilled} prefilled, {self.reused} reused; "
                f"{self.dropped} turns dropped; conversation {context}/{n_ctx} tokens of context")


def stats_line(s: Stats, *, interrupted: bool = False, max_tokens: int | None = None, n_ctx: int | None = None) -> str:
    """The dim line after each reply: speed, acceptance, mean accepted length, prompt prefilled/reused, and
    why a reply was cut (max_tokens, or the context filling up before it)."""
    parts = [f"{s.generated} tokens, {s.gen_tps:.1f} tok/s"]
    if s.drafted:
        parts.append(f"{s.drafter} drafts {s.accepted}/{s.drafted} accepted ({s.acceptance_rate:.0%}), "
                     f"{s.mean_accepted:.2f} per round")
    else:
        parts.append(f"drafter {s.drafter}: nothing drafted")
    for name, p in (s.spans or {}).items():  # a reasoning model's thinking and answer, each on its own
        parts.append(f"{name} {p['tokens']} tokens" + (f", {p['accepted']}/{p['drafted']} accepted" if p["drafted"]
                                                        else "") + (f", {p['tokens'] / p['seconds']:.1f} tok/s"
                                                                    if p["seconds"] > 0 else ""))
    parts.append(f"prompt {s.prompt_prefilled} prefilled, {s.prompt_reused} reused")
    if interrupted:
        parts.append("interrupted (the partial reply stays in the conversation)")
    elif s.finish_reason == "length" and max_tokens is not None and s.generated < max_tokens:
        parts.append(f"cut where the context filled up (n_ctx={n_ctx}): the next message drops the oldest turns; "
                     "restart chat with a larger --n-ctx to keep more")
    elif s.finish_reason == "length":
        parts.append("cut at max_tokens (/set max_tokens N)")
    return "; ".join(parts)


# ---- terminal ----
