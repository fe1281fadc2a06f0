"""OpenAI-shaped response dicts built from an engine Stream (the shapes llama-cpp-python returns)."""
from __future__ import annotations

import time
import uuid
from typing import Iterator


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated,
            "total_tokens": stats.prompt_tokens + stats.generated,
            "prompt_tokens_details": {"cached_tokens": stats.prompt_reused}}


def chat_completion(model: str, stream) -> dict:
    text = "".join(e.text for e in stream)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": stream.finish_reason}],
            "usage": _usage(stream.stats), "localspec": stream.stats.to_dict()}


def chat_chunks(model: str, stream) -> Iterator[dict]:
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(delta: dict, finish=None, **extra) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    yield chunk({"role": "assistant"})
    for e in stream:
        if e.text:
            yield chunk({"content": e.text})
    yield chunk({}, stream.finish_reason, usage=_usage(stream.stats), localspec=stream.stats.to_dict())
