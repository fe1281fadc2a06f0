"""The engine as the OpenAI-shaped Python API: `create_chat_completion`, as llama-cpp-python's Llama has it.

`localspec.load` returns this Engine: the core engine (generation, streams) plus the chat-completion call,
whose request parsing, response shapes and tool-call formats live in this package.
"""
from __future__ import annotations

from typing import Sequence

from ..core.chat_template import RESERVED
from ..core.engine import Engine as CoreEngine
from ..core.request import RequestError, make_request
from .reasoning import FieldError, Spans, span_for, template_variables
from .request import content_stops, extras, structured
from .shapes import chat_chunks, chat_completion
from .tools import for_template


class Engine(CoreEngine):
    __doc__ = CoreEngine.__doc__

    def create_chat_completion(self, messages: Sequence[dict], *, stream: bool = False, tools=None, tool_choice=None,
                               parallel_tool_calls: bool | None = None, response_format: dict | None = None,
                               logprobs: bool | None = None, top_logprobs: int | None = None,
                               prediction: dict | None = None, stream_options: dict | None = None,
                               reasoning_effort: str | None = None, chat_template_kwargs: dict | None = None,
                               reasoning_budget: int | None = None, **options):
        """OpenAI-shaped chat completion dicts, as llama-cpp-python's Llama.create_chat_completion returns.

        OpenAI's own fields: response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"name", "schema"}}); tools / tool_choice / parallel_tool_calls (calls come back in message.tool_calls
        with finish_reason "tool_calls"); logprobs / top_logprobs; prediction ({"type": "content", "content":
        TEXT}); stream_options ({"include_usage": true}). Other options as for stream(), except that without
        max_tokens the reply runs until it ends or the context is full (as llama-cpp-python's).

        A reasoning model (its chat template writes <think>...</think>): the thinking comes back apart from the
        answer, as message.reasoning_content and message.reasoning (deltas of those names when streamed);
        reasoning_effort "none" turns it off where the template can; chat_template_kwargs reach the template;
        reasoning_budget (tokens) forces the span's end after that many, and a constraint (response_format,
        tools) holds for the answer after it.
        """
        template = self.chat_template()
        try:
            variables = template_variables({"reasoning_effort": reasoning_effort,
                                            "chat_template_kwargs": chat_template_kwargs}, template, RESERVED)
        except FieldError as e:
            raise RequestError(str(e)) from None
        if reasoning_budget is not None and (isinstance(reasoning_budget, bool) or not isinstance(reasoning_budget, int)
                                             or reasoning_budget < 0):
            raise RequestError(f"reasoning_budget must be a number of tokens (0 or more), got {reasoning_budget!r}")
        span = span_for(self, for_template(messages), tools=tools, variables=variables, budget=reasoning_budget)
        extra, _, tools, fmt = structured(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                          response_format=response_format, template=template,
                                          token_of=self.single_token)
        fields = {k: v for k, v in dict(logprobs=logprobs, top_logprobs=top_logprobs, prediction=prediction,
                                        stream_options=stream_options).items() if v is not None}
        more, _, include_usage = extras(fields, chat=True)
        if options.get("max_tokens") is None and "max_tokens" not in self.defaults:
            options["max_tokens"] = self.target.n_ctx  # as OpenAI and llama-cpp-python: until the context is full
        stop = ()
        if fmt is not None or span is not None:  # the stop strings end the content, not a call nor the thinking
            make_request(stop=options.get("stop"))  # refused here as the engine would refuse it
            stop = content_stops(options)
        if span is not None:
            options["span"] = span
        s = self.stream(self.chat_tokens(for_template(messages), tools=tools, variables=variables),
                        **(options | extra | more))
        spans = Spans(span) if span is not None else None
        if stream:
            return chat_chunks(self.name, s, fmt, tools, self.target.piece, include_usage, stop, spans)
        return chat_completion(self.name, s, fmt, tools, self.target.piece, stop, spans)
