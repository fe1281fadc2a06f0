"""OpenAI-shaped response dicts (the shapes llama-cpp-python and the OpenAI API return).

`Chat` and `Completion` build one response's objects: the whole answer, or its stream chunks. Each carries
the engine's stats under a `localspec` key (in a stream, on the final chunk).
"""
from __future__ import annotations

import time
import uuid
from typing import Iterator


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated,
            "total_tokens": stats.prompt_tokens + stats.generated,
            "prompt_tokens_details": {"cached_tokens": stats.prompt_reused}}


def error(message: str, *, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict:
    """OpenAI's error object: what a 4xx/5xx response body holds."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Chat:
    """The chat.completion object, or its chat.completion.chunk stream, of one response.

    With a tool-call format, the text is parsed as it comes: content until the model opens a call, then each
    complete call as a `tool_calls` entry (streamed as one delta per call, with its whole arguments), and
    finish_reason "tool_calls" when the reply made any.
    """

    def __init__(self, model: str, tool_format=None, tools=None):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.parser = tool_format.parser(tools) if tool_format is not None else None

    def _finish(self, stats) -> str:
        return "tool_calls" if self.parser is not None and self.parser.calls else stats.finish_reason

    def response(self, text: str, stats) -> dict:
        content, calls = text, []
        if self.parser is not None:
            parts = self.parser.feed(text) + [self.parser.finish()]
            content = "".join(p for p in parts if isinstance(p, str)).strip() if self.parser.calls else text
            calls = [c.to_openai() for c in self.parser.calls]
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self._finish(stats)}],
                "usage": usage(stats), "localspec": stats.to_dict()}

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

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

    def chunks(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text) if self.parser is not None else [text])

    def final_chunks(self, stats) -> list[dict]:
        rest = self._deltas([self.parser.finish()]) if self.parser is not None else []
        return rest + [self._chunk({}, self._finish(stats), usage=usage(stats), localspec=stats.to_dict())]


class Completion:
    """The text_completion object, or its chunk stream, of one /v1/completions response."""

    def __init__(self, model: str):
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model

    def _obj(self, text: str, finish: str | None, **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra}

    def response(self, text: str, stats) -> dict:
        return self._obj(text, stats.finish_reason, usage=usage(stats), localspec=stats.to_dict())

    def first_chunks(self) -> list[dict]:
        return []

    def chunks(self, text: str) -> list[dict]:
        return [self._obj(text, None)]

    def final_chunks(self, stats) -> list[dict]:
        return [self._obj("", stats.finish_reason, usage=usage(stats), localspec=stats.to_dict())]


def chat_completion(model: str, stream, tool_format=None, tools=None) -> dict:
    text = "".join(e.text for e in stream)
    return Chat(model, tool_format, tools).response(text, stream.stats)


def chat_chunks(model: str, stream, tool_format=None, tools=None) -> Iterator[dict]:
    shape = Chat(model, tool_format, tools)
    yield from shape.first_chunks()
    for e in stream:
        if e.text:
            yield from shape.chunks(e.text)
    yield from shape.final_chunks(stream.stats)
