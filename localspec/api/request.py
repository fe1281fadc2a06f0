"""OpenAI request bodies -> typed, validated requests for the engine (the server's edge, and the API's
create_chat_completion): every field checked once, bounded, and refused with an error that names it."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace

import numpy as np

from ..core.errors import LocalspecError
from ..core.grammar import GrammarError, compile_spec
from ..core.chat_template import RESERVED
from ..core.request import make_request
from ..core.thinking import Span
from .reasoning import FieldError, Spans, markers_of, template_variables
from .tools import _NAME, ToolError, ToolFormat, _params, check_choice, check_tools, detect


class ApiError(LocalspecError):
    """A request answered with an OpenAI error object (HTTP `status`) instead of a completion."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers


# request field -> (engine option, type); the last three are llama.cpp server extensions
_OPTIONS = {"max_tokens": ("max_tokens", int), "max_completion_tokens": ("max_tokens", int),
            "temperature": ("temperature", float), "top_p": ("top_p", float), "seed": ("seed", int),
            "frequency_penalty": ("frequency_penalty", float), "presence_penalty": ("presence_penalty", float),
            "stop": ("stop", "stop"), "top_k": ("top_k", int), "min_p": ("min_p", float),
            "repeat_penalty": ("repeat_penalty", float)}
# under the request's "localspec" key
_SPECULATION = {"drafter": str, "k": int, "accept": str, "p_min": float, "threshold": float, "history": bool,
                "prompt_cache": bool}
# sent by OpenAI clients and changing nothing here
_IGNORED = {"model", "stream", "user", "store", "metadata", "service_tier", "localspec", "safety_identifier",
            "prompt_cache_key", "prompt_cache_retention", "verbosity"}
# honoured only at their no-op value (null always is one): anything else would be silently wrong here
_NOOP = {"n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logit_bias": ({},), "functions": ([],),
         "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (), "web_search_options": ()}
_STRUCTURED = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}
_EXTRAS = {"logprobs", "top_logprobs", "prediction", "stream_options"}  # parsed by extras()
_CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "functions", "function_call", "modalities",
              "audio", "reasoning_effort", "reasoning_budget", "chat_template_kwargs", "web_search_options"} | _STRUCTURED
_COMPLETION_ONLY = {"prompt", "best_of", "echo", "suffix"}
_KNOWN = _OPTIONS.keys() | _IGNORED | _NOOP.keys() | _CHAT_ONLY | _COMPLETION_ONLY | _EXTRAS
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
_KINDS = {int: "an integer in the 64-bit range", float: "a finite number", str: "a string", bool: "true or false",
          "stop": "a string or an array of strings"}
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's limits; each stop string is searched for after every token
MAX_TOOLS = 128  # OpenAI's limit


@dataclass
class ChatRequest:
    messages: list[dict]
    options: dict  # engine options, the server's defaults included
    names: dict  # engine option -> request field, to name the field in an engine error
    stream: bool
    tools: list[dict] | None = None  # offered to the model through its chat template
    tool_format: ToolFormat | None = None  # set when the output is to be parsed for tool calls
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage and no choices
    stop: tuple[str, ...] = ()  # with tool calls: stop strings end the content, not a call (openai_shapes.Chat)
    variables: dict | None = None  # more template variables (chat_template_kwargs, reasoning_effort)
    thinking: Span | None = None  # the model's thinking markers: its span is reasoning, not content

    def spans(self) -> Spans | None:
        """A new splitter of this request's output into reasoning and answer (None: the model has no span): by
        the span the server gave the engine (options["span"]: whether the prompt opened it)."""
        span = self.options.get("span")
        return Spans(span) if span is not None else None


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    options: dict
    names: dict
    stream: bool
    include_usage: bool = False


def _typed(param: str, value, kind):
    try:
        ok = {int: lambda v: type(v) is int and -2**63 <= v < 2**63,
              float: lambda v: type(v) in (int, float) and math.isfinite(float(v)),
              str: lambda v: isinstance(v, str),
              bool: lambda v: isinstance(v, bool),
              "stop": lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
              }[kind](value)
    except OverflowError:  # float(10**400)
        ok = False
    if not ok:
        raise ApiError(f"{param} must be {_KINDS[kind]}, got {json.dumps(value)[:60]}", param=param)
    return float(value) if kind is float else value  # numpy cannot take a 400-digit int as a float


def parse_options(body: dict, *, chat: bool, defaults: dict) -> tuple[dict, dict]:
    """(engine options over `defaults`, engine option -> request field) from a request body, or ApiError
    naming the field."""
    other = _COMPLETION_ONLY if chat else _CHAT_ONLY
    for field in body:
        if field in other or field not in _KNOWN:
            raise ApiError(f"unknown field {field!r} for {'/v1/chat/completions' if chat else '/v1/completions'}",
                           param=field)
    for field, allowed in _NOOP.items():
        value = body.get(field)
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise ApiError(f"{field}={json.dumps(value)[:60]} is not supported by localspec serve "
                           f"(supported: {', '.join(json.dumps(a) for a in (None, *allowed))})", param=field)
    if body.get("stream") is not None and type(body["stream"]) is not bool:
        raise ApiError("stream must be true or false", param="stream")
    options, names = {}, {}
    for field, (name, kind) in _OPTIONS.items():
        if body.get(field) is not None:
            options[name], names[name] = _typed(field, body[field], kind), field
    spec = {} if body.get("localspec") is None else body["localspec"]
    if not isinstance(spec, dict):
        raise ApiError(f"localspec must be an object with {', '.join(_SPECULATION)}", param="localspec")
    for field, value in spec.items():
        if field not in _SPECULATION:
            raise ApiError(f"unknown field localspec.{field}; allowed: {', '.join(_SPECULATION)}",
                           param=f"localspec.{field}")
        if value is not None:
            options[field], names[field] = _typed(f"localspec.{field}", value, _SPECULATION[field]), f"localspec.{field}"
    # Ranges the engine leaves open: numpy seeds are non-negative; OpenAI bounds the penalties.
    if options.get("seed", 0) < 0:
        raise ApiError(f"seed must be >= 0, got {options['seed']}", param="seed")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= options.get(name, 0) <= 2:
            raise ApiError(f"{name} must be in [-2, 2], got {options[name]}", param=name)
    stop = options.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError(f"stop takes at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters each "
                       f"(OpenAI's limits), got {len(stop)} of up to {max(map(len, stop), default=0)}", param="stop")
    return defaults | options, names  # the server's defaults (the pair's, serve's flags); the request's fields win


def extras(body: dict, *, chat: bool) -> tuple[dict, dict, bool]:
    """logprobs / top_logprobs, prediction and stream_options -> (engine options, option -> field,
    include_usage)."""
    options, names = {}, {}
    if chat:
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise ApiError("logprobs must be true or false", param="logprobs")
        if top is not None:
            if type(top) is not int or not 0 <= top <= MAX_LOGPROBS:
                raise ApiError(f"top_logprobs must be an integer in 0..{MAX_LOGPROBS}, got {json.dumps(top)[:40]}",
                               param="top_logprobs")
            if not lp:
                raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        if lp:
            options["logprobs"], names["logprobs"] = top or 0, "top_logprobs" if top is not None else "logprobs"
        pred = body.get("prediction")
        if pred is not None:
            content = pred.get("content") if isinstance(pred, dict) and pred.get("type") == "content" else None
            if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                                 and isinstance(c.get("text"), str) for c in content):
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise ApiError('prediction must be {"type": "content", "content": TEXT or an array of text parts}',
                               param="prediction")
            options["prediction"], names["prediction"] = content, "prediction"
    else:
        lp = body.get("logprobs")
        if lp is not None:
            if type(lp) is not int or not 0 <= lp <= MAX_LOGPROBS:
                raise ApiError(f"logprobs must be an integer in 0..{MAX_LOGPROBS} (top alternatives per token), "
                               f"got {json.dumps(lp)[:40]}", param="logprobs")
            options["logprobs"], names["logprobs"] = lp, "logprobs"
        pred = body.get("prediction")
        if pred is not None:
            if not isinstance(pred, str):
                raise ApiError("prediction must be the text the completion is expected to resemble", param="prediction")
            options["prediction"], names["prediction"] = pred, "prediction"
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool)
                           or set(so) - {"include_usage", "continuous_usage_stats"}):
        raise ApiError('stream_options must be {"include_usage": true or false}', param="stream_options")
    return options, names, bool(so and so.get("include_usage"))


_CONSTRAINTS = ("json_schema", "grammar", "regex", "json_object")


def check_options(options: dict, names: dict, constraint=None) -> None:
    """The engine's own range checks and the constraint's compilation, before the request waits its turn.
    constraint(fields), when given, compiles the constraint ({"json_schema": ...}) in the engine's place: the
    server's (server.Constraints) also builds the matcher the engine will build (a schema that llguidance refuses
    only then, such as one that refers to itself, is a 400 on arrival, not at the head of the queue), and bounds
    the CPU that compiling takes."""
    given = {k: options[k] for k in _CONSTRAINTS if options.get(k) not in (None, False)}
    try:
        if constraint is None or not given:
            make_request(**options)  # compiles the constraint
        else:
            make_request(**{k: v for k, v in options.items() if k not in given})
            constraint(given)
    except LocalspecError as e:
        raise bad_request(e, names, None) from None


def bad_request(e: LocalspecError, names: dict, fallback: str | None) -> ApiError:
    """An engine error as a 400; its message starts with the option it is about ('top_p=1.5 is ...')."""
    if isinstance(e, ApiError):
        return e
    head = re.match(r"\w+", str(e))
    key = head.group() if head else ""
    if isinstance(e, GrammarError):  # a constraint that gave out midway: the field that set it
        key = next((k for k in ("json_schema", "json_object", "grammar", "regex") if k in names), key)
    return ApiError(str(e), param=names.get(key, fallback))


def structured(*, tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None, template=None,
               token_of=None, constraint=None) -> tuple[dict, dict, list[dict] | None, ToolFormat | None]:
    """response_format and tools -> (engine options, option -> field, tools for the template, format to parse).
    constraint: as check_options', to compile each tool's parameters."""
    options, names = {}, {}
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            options["json_object"] = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ApiError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                               param="response_format.json_schema")
            if spec.get("name") is not None and not isinstance(spec["name"], str):
                raise ApiError("response_format.json_schema.name must be a string", param="response_format.json_schema.name")
            if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                raise ApiError("response_format.json_schema.strict must be true or false",
                               param="response_format.json_schema.strict")
            options["json_schema"] = spec["schema"]  # the output always follows the schema: strict or not
        elif kind != "text":
            raise ApiError('response_format.type must be "text", "json_object" or "json_schema"',
                           param="response_format")
        names.update({k: "response_format" for k in options})
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ApiError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return options, names, None, None
    try:
        tools = check_tools(tools)
        if len(tools) > MAX_TOOLS:
            raise ToolError(f"at most {MAX_TOOLS} tools, got {len(tools)}")
        choice = check_choice(tool_choice, tools)
    except ToolError as e:
        raise ApiError(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
    for i, t in enumerate(tools):  # each schema on its own: an error names its tool, not the call grammar
        try:
            if constraint is None:
                compile_spec(json_schema=_params(t))  # as the call constrains them
            else:  # alone: the call's grammar, which holds them all, is checked whole
                constraint({"json_schema": _params(t)}, matcher=False)
        except GrammarError as e:
            where = f"tools[{i}].function.parameters"
            raise ApiError(f"{where} ({t['function']['name']}): {str(e).removeprefix('json_schema ')}",
                           param=where) from None
    if choice == "none":
        return options, names, tools, None  # offered, never called: the output is free text
    if options:
        raise ApiError("response_format with tools is not supported: a reply is either a tool call or JSON",
                       param="response_format")
    try:
        fmt = detect(template)
    except ToolError as e:
        raise ApiError(str(e), param="tools") from None
    fmt = replace(fmt, parallel=parallel_tool_calls is not False)
    options["grammar"] = fmt.grammar(tools, choice, fmt.parallel, token_of)
    names["grammar"] = "tools"
    return options, names, tools, fmt


def parse_chat(body: dict, *, defaults: dict, n_ctx: int, template: str | None, token_of,
               constraint=None) -> ChatRequest:
    messages = parse_messages(body.get("messages"), n_ctx=n_ctx)
    options, names = parse_options(body, chat=True, defaults=defaults)
    extra, extra_names, tools, fmt = structured(**{k: body.get(k) for k in _STRUCTURED}, template=template,
                                                token_of=token_of, constraint=constraint)
    more, more_names, include_usage = extras(body, chat=True)
    options, names = options | extra | more, names | extra_names | more_names
    check_options(options, names, constraint)
    options.setdefault("max_tokens", n_ctx)  # OpenAI: until the context is full
    try:
        variables = template_variables(body, template, RESERVED)
    except FieldError as e:
        raise ApiError(str(e), param=e.param) from None
    thinking = markers_of(template)
    # with tool calls parsed or a thinking span, stop strings end the content alone (shapes.Chat)
    return ChatRequest(messages, options, names, bool(body.get("stream")), tools, fmt, include_usage,
                       content_stops(options) if fmt is not None or thinking else (), variables, thinking)


def content_stops(options: dict) -> tuple[str, ...]:
    """The stop strings, taken out of the engine's options: a reply parsed for tool calls applies them to its
    content alone (a stop string such as "\\n" would otherwise end the reply inside a call's markup, and the
    call was lost)."""
    stop = options.pop("stop", None) or ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def parse_completion(body: dict, *, defaults: dict, n_vocab: int | None = None,
                     constraint=None) -> CompletionRequest:
    """n_vocab: token ids of a prompt outside 0..n_vocab-1 are refused here (llama.cpp aborts on them)."""
    prompt = parse_prompt(body.get("prompt"))
    if isinstance(prompt, list) and n_vocab is not None:
        bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(f"prompt: token id {bad} is outside the vocabulary (0..{n_vocab - 1})", param="prompt")
    options, names = parse_options(body, chat=False, defaults=defaults)
    more, more_names, include_usage = extras(body, chat=False)
    options, names = options | more, names | more_names
    check_options(options, names, constraint)
    options.setdefault("max_tokens", 16)  # OpenAI's default for /v1/completions
    return CompletionRequest(prompt, options, names, bool(body.get("stream")), include_usage)


def _text(content, p: str, *, optional: bool = False) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
            raise ApiError(f"{p}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                           param=f"{p}.content")
        return "\n".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise ApiError(f"{p}.content must be a string or an array of text parts", param=f"{p}.content")
    return content


def _tool_calls(calls, p: str) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise ApiError(f"{p}.tool_calls must be a non-empty array", param=f"{p}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        q = f"{p}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise ApiError(f'{q} must be {{"id", "type": "function", "function": {{"name", "arguments": '
                           f'JSON text}}}}', param=q)
        if not _NAME.fullmatch(f["name"]):
            raise ApiError(f"{q}.function.name must be 1-64 letters, digits, _ or -, got {f['name'][:60]!r}",
                           param=f"{q}.function.name")
        if not isinstance(c.get("id") or "", str):
            raise ApiError(f"{q}.id must be a string", param=f"{q}.id")
        out.append({"id": c.get("id") or "", "type": "function",
                    "function": {"name": f["name"], "arguments": f["arguments"]}})
    return out


def parse_messages(value, *, n_ctx: int) -> list[dict]:
    """OpenAI messages: system/developer, user, assistant (text and/or tool_calls), tool results."""
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty array of {role, content} objects", param="messages")
    if len(value) > n_ctx:  # each message takes a token of template markup at least: spare rendering them
        raise ApiError(f"{len(value)} messages cannot fit in this model's context of {n_ctx} tokens",
                       param="messages", code="context_length_exceeded")
    out = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{p} must be an object with role and content", param=p)
        role = m.get("role")
        if role == "function" or m.get("function_call"):
            raise ApiError(f"{p}: the legacy function-call messages are not supported; use tools and role "
                           "'tool'", param=p)
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(f"{p}.role must be system, developer, user, assistant or tool, got "
                           f"{json.dumps(role)[:40]}", param=f"{p}.role")
        msg = {"role": "system" if role == "developer" else role,
               "content": _text(m.get("content"), p, optional=role == "assistant")}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], p)
        if role == "tool":
            if not isinstance(m.get("tool_call_id", ""), str):
                raise ApiError(f"{p}.tool_call_id must be a string", param=f"{p}.tool_call_id")
            msg["tool_call_id"] = m.get("tool_call_id", "")
        out.append(msg)
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


_SCALARS = {int, float, bool, type(None)}
MAX_DEPTH = 64  # JSON nesting: a schema or tool call needs a few levels; Python's own limits are near 1000
# What parsing a body may build. 8 MiB of '[{},{},...]' (in the ignored `metadata`, say) is 2.8 million objects
# (json.loads alone: 208 MB), and six such bodies parsed at once held 4.6 GB. Real requests hold thousands: 128
# tools of 20 parameters, ~6,000 objects and arrays; a conversation of 2,000 messages, a few per message; a prompt
# of token ids, one value per token. Within these limits a body parses into 80 MB at most (1M short strings:
# 64 MB; 100,000 objects of 9 strings: 82 MB).
MAX_JSON_CONTAINERS = 100_000  # objects and arrays
MAX_JSON_VALUES = 1 << 20  # values of every kind: a prompt of token ids filling a 1M-token context


def check_json_size(raw: bytes) -> None:
    """Refuse a JSON body whose parse would build more than MAX_JSON_CONTAINERS objects and arrays or
    MAX_JSON_VALUES values, before json.loads builds them: '{', '[' and ',' are counted over the raw bytes, those
    inside strings left out where it matters (~50 ms for 8 MiB whatever it holds, in 1 MiB blocks; a parse of
    8 MiB took up to 250 ms and 208 MB)."""
    containers = raw.count(b"{") + raw.count(b"[")
    if containers <= MAX_JSON_CONTAINERS and containers + raw.count(b",") <= MAX_JSON_VALUES:
        return  # within the limits even with what strings hold
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")  # escapes, in order: no quote left inside a string
    containers = commas = quotes = 0
    for at in range(0, len(raw), 1 << 20):
        b = np.frombuffer(raw, np.uint8, count=min(1 << 20, len(raw) - at), offset=at)
        seen = np.cumsum(b == ord('"'), dtype=np.uint8) + np.uint8(quotes)  # mod 256: the parity is what counts
        outside = (seen & 1) == 0
        quotes = int(seen[-1]) & 1
        containers += int(np.count_nonzero(((b == ord("{")) | (b == ord("["))) & outside))
        commas += int(np.count_nonzero((b == ord(",")) & outside))
    values = containers + commas  # n items have n - 1 commas
    if containers > MAX_JSON_CONTAINERS:
        raise ApiError(f"the request body holds {containers:,} JSON objects and arrays; at most "
                       f"{MAX_JSON_CONTAINERS:,} are accepted (a real request has tens of thousands at most)",
                       code="request_too_complex")
    if values > MAX_JSON_VALUES:
        raise ApiError(f"the request body holds {values:,} JSON values; at most {MAX_JSON_VALUES:,} are accepted "
                       "(as many as a prompt of token ids filling a 1M-token context)", code="request_too_complex")


def check_text(body) -> None:
    """Refuse lone UTF-16 surrogates ("\\ud800": valid JSON escapes, but no text, so UTF-8 cannot encode them)
    and nesting deeper than MAX_DEPTH (which every later step would walk again, some recursively)."""
    todo = [(None, body, 0)]  # (where: None for the body, else (parent's where, key or index)), value, depth)
    while todo:  # not recursive: the JSON parser allows deeper nesting than Python's stack
        where, value, depth = todo.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                path = _path(where)
                raise ApiError(f"{path or 'the body'} contains a lone UTF-16 surrogate, which is not text; "
                               "send the string as valid UTF-8", param=path or None)
            continue
        if depth >= MAX_DEPTH and isinstance(value, (dict, list)) and value:
            top = _path(_top(where))
            raise ApiError(f"{top or 'the body'} nests deeper than {MAX_DEPTH} levels", param=top or None)
        if isinstance(value, dict):
            for key, v in value.items():
                if _SURROGATE.search(key):
                    raise ApiError(f"a field name in {_path(where) or 'the body'} contains a lone UTF-16 surrogate",
                                   param=_path(where) or None)
                if isinstance(v, (str, dict, list)):
                    todo.append(((where, key), v, depth + 1))
        elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:  # a prompt of token ids: skipped
            todo.extend(((where, i), v, depth + 1) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))


def _top(where):
    """The top-level field of a place in the body."""
    while where is not None and where[0] is not None:
        where = where[0]
    return where


def _path(where) -> str:
    """A place in the body as a field path ('messages[0].content'), '' for the body itself."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path += f"[{key}]" if isinstance(key, int) else f".{key}" if path else key
    return path


def parse_prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise ApiError("prompt is empty", param="prompt")
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise ApiError(f"prompt: a batch of {len(value)} prompts is not supported; send one request per prompt",
                       param="prompt")
    raise ApiError("prompt must be a non-empty string or array of token ids", param="prompt")
