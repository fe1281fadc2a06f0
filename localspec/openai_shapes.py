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
    """The chat.completion object, or its chat.completion.chunk stream, of one response."""

    def __init__(self, model: str):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model

    def response(self, text: str, stats) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": stats.finish_reason}],
                "usage": usage(stats), "localspec": stats.to_dict()}

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    def first_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant"})]

    def chunk(self, text: str) -> dict:
        return self._chunk({"content": text})

    def final_chunk(self, stats) -> dict:
        return self._chunk({}, stats.finish_reason, usage=usage(stats), localspec=stats.to_dict())


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

    def chunk(self, text: str) -> dict:
        return self._obj(text, None)

    def final_chunk(self, stats) -> dict:
        return self._obj("", stats.finish_reason, usage=usage(stats), localspec=stats.to_dict())


def chat_completion(model: str, stream) -> dict:
    text = "".join(e.text for e in stream)
    return Chat(model).response(text, stream.stats)


def chat_chunks(model: str, stream) -> Iterator[dict]:
    shape = Chat(model)
    yield from shape.first_chunks()
    for e in stream:
        if e.text:
            yield shape.chunk(e.text)
    yield shape.final_chunk(stream.stats)
