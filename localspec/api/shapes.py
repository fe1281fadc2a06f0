"""OpenAI-shaped response dicts (the shapes llama-cpp-python and the OpenAI API return).

`Chat` and `Completion` build one response's objects from the engine's Events: the whole answer, or its stream
chunks. Each carries the engine's stats under a `localspec` key (in a stream, on the chunk that finishes it).
"""
from __future__ import annotations

import time
import uuid
from typing import Callable, Iterator, Sequence

from ..core.text import StopStrings


def usage(stats, spans=None) -> dict:
    """OpenAI's usage; prediction tokens are counted as speculation sees them: accepted = drafted from the
    prediction and accepted, rejected = drafted from it and rejected (verified by the model, then dropped).
    With a thinking span, its tokens (markers included) are reasoning_tokens, as OpenAI counts them, and (our
    own keys, which OpenAI clients keep as extra fields) each span's tokens that were drafted and accepted:
    reasoning_accepted_draft_tokens and answer_accepted_draft_tokens."""
    details = {"accepted_prediction_tokens": stats.accepted_prediction,
               "rejected_prediction_tokens": stats.drafted_prediction - stats.accepted_prediction}
    if spans is not None:
        details["reasoning_tokens"] = spans.counts["reasoning"]["tokens"]
        for span in ("reasoning", "answer"):
            details[f"{span}_accepted_draft_tokens"] = spans.counts[span]["from_draft"]
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated,
            "total_tokens": stats.prompt_tokens + stats.generated,
            "prompt_tokens_details": {"cached_tokens": stats.prompt_reused},
            "completion_tokens_details": details}


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


class Thought:
    """A piece of a thinking span (reasoning.Spans), sent as reasoning_content and reasoning."""

    def __init__(self, text: str):
        self.text = text


class Chat:
    """The chat.completion object, or its chat.completion.chunk stream, of one response.

    With a tool-call format, the text is parsed as it comes: content until the model opens a call, then each
    complete call as a `tool_calls` entry (streamed as one delta per call, with its whole arguments), and
    finish_reason "tool_calls" when the reply made any. Stop strings given here end the reply's content: a
    call's markup is not content, so a stop string such as "\n" does not cut a call short (the engine then
    runs without them; `stopped` says when the reply is over, and the engine's reader ends its stream there). With
    logprobs, each chunk carries the entries of the tokens whose text it sends (choices[].logprobs.content).
    """

    def __init__(self, model: str, tool_format=None, tools=None, *, piece=None, include_usage: bool = False,
                 stop: Sequence[str] = (), spans=None):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.spans = spans  # reasoning.Spans where the model thinks: its span is reasoning, not content
        self.parser = tool_format.parser(tools) if tool_format is not None else None
        self.lp, self.include_usage = _Logprobs(piece), include_usage
        self.stops = StopStrings(stop)
        self.calls: list = []  # the calls sent (a call after a stop string is not)
        self.parts: list = []  # content and calls so far, for the whole response (add)

    @property
    def stopped(self) -> bool:
        """A stop string has ended the content: what the engine writes from here on is not sent."""
        return self.stops.stopped

    def _finish(self, stats) -> str:
        """"tool_calls" for a reply that made calls and ended by itself; cut short (length, cancelled), it says so."""
        reason = "stop" if self.stopped else stats.finish_reason
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _stats(self, stats) -> dict:
        """The engine's stats, and with a thinking span the tokens of each span and how many of them were
        drafted and accepted (speculation's worth per span)."""
        spans = {"spans": self.spans.counts} if self.spans is not None else {}
        return stats.to_dict() | ({"finish_reason": "stop"} if self.stopped else {}) | spans

    def _parts(self, text: str, end: bool = False, counted: bool = False, from_draft: bool = False) -> list:
        """The engine's text as reasoning, content and calls to send, up to a stop string in the content (the
        reasoning is neither parsed for calls nor cut by stop strings: they are the answer's)."""
        if self.stopped:
            return []
        if self.spans is None:
            return self._answer(text, end)
        out = []
        fed = self.spans.token(text, from_draft) if counted else self.spans.feed(text)
        for thinking, piece in fed + (self.spans.finish() if end else []):
            out += [Thought(piece)] if thinking else self._answer(piece)
            if self.stopped:
                return out
        return out + (self._answer("", end=True) if end else [])

    def _answer(self, text: str, end: bool = False) -> list:
        parts = self.parser.feed(text) if self.parser is not None else [text]
        if end and self.parser is not None:
            parts.append(self.parser.finish())
        out = []
        for p in parts:
            if isinstance(p, str):
                out.append(self.stops.push(p))
                if self.stopped:
                    break
            else:  # text held as the possible start of a stop string is content: a call follows it
                out += [self.stops.flush(), p]
                self.calls.append(p)
        if end:
            out.append(self.stops.flush())
        return [p for p in out if p != ""]

    def ends(self, text: str) -> bool:
        """Whether `text`, the engine's next, ends the reply's content with a stop string: for the reader that
        stops the generation there (the server's worker), apart from the shape that sends the reply."""
        self._parts(text)
        return self.stopped

    def add(self, ev) -> None:
        """One event of a whole (not streamed) response."""
        if not self.stopped:
            self.lp.add(ev)
            self.parts += self._parts(ev.text, counted=True, from_draft=ev.from_draft)

    def response(self, stats) -> dict:
        """The chat.completion object of the events add()ed."""
        parts = self.parts + self._parts("", end=True)
        content = "".join(p for p in parts if isinstance(p, str))
        calls = [c.to_openai() for c in self.calls]
        content = content.strip() if calls else content
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if self.spans is not None:  # both names: clients read one or the other
            thought = "".join(p.text for p in parts if isinstance(p, Thought))
            message["reasoning_content"] = message["reasoning"] = thought or None
        if calls:
            message["tool_calls"] = calls
        entries = self.lp.take()
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": {"content": entries} if entries else None,
                             "finish_reason": self._finish(stats)}],
                "usage": usage(stats, self.spans), "localspec": self._stats(stats)}

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
            if isinstance(p, Thought):
                out.append(self._chunk({"reasoning_content": p.text, "reasoning": p.text}))
            elif isinstance(p, str):
                if p:
                    out.append(self._chunk({"content": p}))
            else:
                index = self.calls.index(p)
                out.append(self._chunk({"tool_calls": [{"index": index, **p.to_openai()}]}))
        return out

    def chunks(self, ev) -> list[dict]:
        if self.stopped:
            return []
        self.lp.add(ev)
        if not ev.text and self.spans is None:
            return []
        return self._deltas(self._parts(ev.text, counted=True, from_draft=ev.from_draft))

    def final_chunks(self, stats) -> list[dict]:
        rest = self._deltas(self._parts("", end=True))
        done = self._chunk({}, self._finish(stats), localspec=self._stats(stats))  # usage: below, if asked for
        if not self.include_usage:
            return rest + [done]
        return rest + [done, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                              "model": self.model, "choices": [], "usage": usage(stats, self.spans)}]


class Completion:
    """The text_completion object, or its chunk stream, of one /v1/completions response (with the legacy
    logprobs object: tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, model: str, *, piece=None, include_usage: bool = False):
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.lp, self.include_usage, self.offset = _Logprobs(piece), include_usage, 0
        self.text = ""

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

    def add(self, ev) -> None:
        """One event of a whole (not streamed) response."""
        self.text += ev.text
        self.lp.add(ev)

    def response(self, stats) -> dict:
        """The text_completion object of the events add()ed."""
        return self._obj(self.text, stats.finish_reason, usage=usage(stats), localspec=stats.to_dict())

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


def _read(stream, shape) -> Iterator:
    """The stream's events, until the shape's stop strings end the reply (the stream is then closed)."""
    for e in stream:
        yield e
        if shape.stopped:
            stream.close()
            return


def chat_completion(model: str, stream, tool_format=None, tools=None, piece=None, stop: Sequence[str] = (),
                    spans=None) -> dict:
    shape = Chat(model, tool_format, tools, piece=piece, stop=stop, spans=spans)
    for e in _read(stream, shape):
        shape.add(e)
    return shape.response(stream.stats)


def chat_chunks(model: str, stream, tool_format=None, tools=None, piece=None,
                include_usage: bool = False, stop: Sequence[str] = (), spans=None) -> Iterator[dict]:
    shape = Chat(model, tool_format, tools, piece=piece, include_usage=include_usage, stop=stop, spans=spans)
    yield from shape.first_chunks()
    for e in _read(stream, shape):
        yield from shape.chunks(e)
    yield from shape.final_chunks(stream.stats)
