"""OpenAI-shaped response dicts (the shapes llama-cpp-python and the OpenAI API return).

`Chat` and `Completion` build one response's objects from the engine's Events: the whole answer, or its stream
chunks. Each carries the engine's stats under a `localspec` key (in a stream, on the chunk that finishes it).
"""
from __future__ import annotations

import time
import uuid
from typing import Callable, Iterable, Iterator


def usage(stats) -> dict:
    """OpenAI's usage; prediction tokens are counted as speculation sees them: accepted = drafted from the
    prediction and accepted, rejected = drafted from it and rejected (verified by the model, then dropped)."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated,
            "total_tokens": stats.prompt_tokens + stats.generated,
            "prompt_tokens_details": {"cached_tokens": stats.prompt_reused},
            "completion_tokens_details": {
                "accepted_prediction_tokens": stats.accepted_prediction,
                "rejected_prediction_tokens": stats.drafted_prediction - stats.accepted_prediction}}


def error(message: str, *, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
    """OpenAI's error object: what a 4xx/5xx response body holds."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Logprobs:
    """Events' logprobs as OpenAI entries, held until the text they belong to is sent."""

    def __init__(self, piece: Callable[[int], bytes] | None):
        self.piece, self.held = piece, []

    def _one(self, token: int, logprob: float) -> dict:
        b = self.piece(token)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}

    def add(self, ev) -> None:
        if ev.logprob is not None:
            self.held.append(self._one(ev.token, ev.logprob) |
                             {"top_logprobs": [self._one(t, lp) for t, lp in ev.top_logprobs or ()]})

    def take(self) -> list[dict]:
        out, self.held = self.held, []
        return out


class Chat:
    """The chat.completion object, or its chat.completion.chunk stream, of one response.

    With a tool-call format, the text is parsed as it comes: content until the model opens a call, then each
    complete call as a `tool_calls` entry (streamed as one delta per call, with its whole arguments), and
    finish_reason "tool_calls" when the reply made any. With logprobs, each chunk carries the entries of the
    tokens whose text it sends (choices[].logprobs.content).
    """

    def __init__(self, model: str, tool_format=None, tools=None, *, piece=None, include_usage: bool = False):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.parser = tool_format.parser(tools) if tool_format is not None else None
        self.lp, self.include_usage = _Logprobs(piece), include_usage

    def _finish(self, stats) -> str:
        """"tool_calls" for a reply that made calls and ended by itself; cut short (length, cancelled), it says so."""
        calls = self.parser is not None and self.parser.calls
        return "tool_calls" if calls and stats.finish_reason == "stop" else stats.finish_reason

    def response(self, events: Iterable, stats) -> dict:
        text = ""
        for ev in events:
            text += ev.text
            self.lp.add(ev)
        content, calls = text, []
        if self.parser is not None:
            parts = self.parser.feed(text) + [self.parser.finish()]
            content = "".join(p for p in parts if isinstance(p, str))
            content = content.strip() if self.parser.calls else content
            calls = [c.to_openai() for c in self.parser.calls]
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        entries = self.lp.take()
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": {"content": entries} if entries else None,
                             "finish_reason": self._finish(stats)}],
                "usage": usage(stats), "localspec": stats.to_dict()}

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        entries = self.lp.take()
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": {"content": entries} if entries else None,
                             "finish_reason": finish}], **extra}

    def first_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant"})]

    def _deltas(self, parts) -> list[dict]:
        out = []
        for p in parts:
            if isinstance(p, str):
                if p:
                    out.append(self._chunk({"content": p}))
            else:
                index = self.parser.calls.index(p)
                out.append(self._chunk({"tool_calls": [{"index": index, **p.to_openai()}]}))
        return out

    def chunks(self, ev) -> list[dict]:
        self.lp.add(ev)
        if not ev.text:
            return []
        return self._deltas(self.parser.feed(ev.text) if self.parser is not None else [ev.text])

    def final_chunks(self, stats) -> list[dict]:
        rest = self._deltas([self.parser.finish()]) if self.parser is not None else []
        done = self._chunk({}, self._finish(stats), localspec=stats.to_dict())  # usage: below, if asked for
        if not self.include_usage:
            return rest + [done]
        return rest + [done, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                              "model": self.model, "choices": [], "usage": usage(stats)}]


class Completion:
    """The text_completion object, or its chunk stream, of one /v1/completions response (with the legacy
    logprobs object: tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, model: str, *, piece=None, include_usage: bool = False):
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.lp, self.include_usage, self.offset = _Logprobs(piece), include_usage, 0

    def _legacy(self) -> dict | None:
        entries = self.lp.take()
        if not entries:
            return None
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def _obj(self, text: str, finish: str | None, **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": self._legacy(), "finish_reason": finish}], **extra}

    def response(self, events: Iterable, stats) -> dict:
        text = ""
        for ev in events:
            text += ev.text
            self.lp.add(ev)
        return self._obj(text, stats.finish_reason, usage=usage(stats), localspec=stats.to_dict())

    def first_chunks(self) -> list[dict]:
        return []

    def chunks(self, ev) -> list[dict]:
        self.lp.add(ev)
        return [self._obj(ev.text, None)] if ev.text else []

    def final_chunks(self, stats) -> list[dict]:
        done = self._obj("", stats.finish_reason, localspec=stats.to_dict())  # usage: below, if asked for
        if not self.include_usage:
            return [done]
        return [done, {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [], "usage": usage(stats)}]


def chat_completion(model: str, stream, tool_format=None, tools=None, piece=None) -> dict:
    events = list(stream)
    return Chat(model, tool_format, tools, piece=piece).response(events, stream.stats)


def chat_chunks(model: str, stream, tool_format=None, tools=None, piece=None,
                include_usage: bool = False) -> Iterator[dict]:
    shape = Chat(model, tool_format, tools, piece=piece, include_usage=include_usage)
    yield from shape.first_chunks()
    for e in stream:
        yield from shape.chunks(e)
    yield from shape.final_chunks(stream.stats)
