"""Tool calls: each format is data — how a chat template is recognised, how a call is constrained, how the
model's output is parsed into OpenAI `tool_calls`, and how past calls are rendered back through the template.

Supported: the Hermes/Qwen format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), recognised as
llama.cpp's common/chat.cpp does, by "<tool_call>" in the template. Other templates are refused by name.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..core.errors import LocalspecError


class ToolError(LocalspecError):
    """tools / tool_choice / tool messages are malformed, or the model's template has no known call format."""


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # text in a chat template that says it writes calls this way
    open: str
    close: str
    # How the template writes a call's JSON (Qwen's: json.dumps separators): forcing the same spelling keeps the
    # model on its own tokens, and the keys, quotes and punctuation become forced drafts.
    json_style: dict
    # Another way the model may open a call when free to choose (tool_choice auto), with its closing text:
    # Qwen2.5-Coder writes ```json {"name": ..., "arguments": ...} ``` rather than <tool_call> (llama.cpp's
    # Hermes handler accepts it too). Only a fence whose JSON starts with a tool's name counts as a call.
    fence: tuple[str, str] | None = None
    parallel: bool = True  # a request's parallel_tool_calls (structured() sets it): false parses one call at most

    def grammar(self, tools: list[dict], choice: str, parallel: bool, token_of) -> str | None:
        """The Lark grammar for a request's calls; None when output is free (tool_choice none).

        token_of(text) -> the id of the single token spelling `text`, or None: a tag that is one token in the
        model's vocabulary is matched as that token, as the model writes it.
        """
        if choice == "none":
            return None
        chosen = tools if choice in ("auto", "required") else [t for t in tools if t["function"]["name"] == choice]
        tag = lambda text: f"<[{token_of(text)}]>" if token_of(text) is not None else json.dumps(text)  # noqa: E731
        body = f'"\\n" {self._call(chosen)} "\\n" {tag(self.close)}'
        if choice != "auto":  # required: one call or more (parallel); a named function: one call to it
            # the template's line break after a call may end the reply too: without it, once the model wrote
            # `</tool_call>\n` (as it does) the grammar masked the end and it invented calls until the context filled
            start = 'start: call ("\\n" call)* "\\n"?' if choice == "required" and parallel else "start: call"
            return f"{start}\ncall: {tag(self.open)} {body}\n"
        # auto: free text until the model opens a call, where the constraint starts (a lazy trigger)
        rules = [f"tagged: TEXT {tag(self.open)} {body}"]
        kinds = ["tagged"]
        if self.fence is not None:
            # a fence is constrained only once the model has itself written a tool's whole name as the JSON's
            # first value: triggered by `{"name": "` alone, any fenced JSON with a "name" key (a package.json,
            # an example record) was forced into a call to some tool
            fo, fc = self.fence
            for i, t in enumerate(chosen):
                name = json.dumps(t["function"]["name"])
                rules += [f'fence_open{i}[lazy]: TEXT /{_re(fo)}\\s*\\{{\\s*"name"\\s*:\\s*{_re(name)}/',
                          f'fenced{i}: fence_open{i} /\\s*,\\s*"arguments"\\s*:\\s*/ '
                          f'%json {json.dumps(_params(t) | {"x-guidance": self.json_style})} /\\s*\\}}\\s*{_re(fc)}/']
                kinds.append(f"fenced{i}")
        start = f"start: ({' | '.join(kinds)}){'*' if parallel else '?'} TEXT"
        return "\n".join([start, *rules, "TEXT: /(.|\\n)*/"]) + "\n"

    def _call(self, chosen: list[dict]) -> str:
        """One call's JSON as the template spells it ({"name": ..., "arguments": {...}}), each function's
        parameters compiled as a schema of their own, so that their $defs and $refs resolve (nested under the
        call's "arguments" key, '#/$defs/...' pointed nowhere)."""
        kv, sep = self.json_style["key_separator"], self.json_style["item_separator"]
        head = lambda t: json.dumps('{"name"' + kv + json.dumps(t["function"]["name"]) + sep + '"arguments"' + kv)  # noqa: E731
        alts = [f'{head(t)} %json {json.dumps(_params(t) | {"x-guidance": self.json_style})}' for t in chosen]
        return f'({" | ".join(alts)}) "}}"'

    def parser(self, tools: list[dict] | None = None) -> "CallParser":
        return CallParser(self, {t["function"]["name"] for t in tools or ()}, self.parallel)


# keywords that say which keys an object may hold besides `properties`: where a schema has none of them, the
# arguments hold only its declared keys (as OpenAI's strict mode and llama.cpp's converter have it)
_KEYS_SAID = {"additionalProperties", "patternProperties", "unevaluatedProperties", "$ref", "allOf", "anyOf",
              "oneOf", "not", "if", "dependentSchemas", "dependencies", "propertyNames"}


def _params(tool: dict) -> dict:
    """A function's parameters as the call's arguments are constrained: a JSON Schema that accepts no key it
    does not declare (a tool without parameters is called with {}), unless it says otherwise (or requires a key
    it does not declare)."""
    params = tool["function"].get("parameters") or {"type": "object"}
    declared = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = params.get("required") if isinstance(params.get("required"), list) else []
    if _KEYS_SAID & params.keys() or not set(required) <= declared.keys():
        return params
    return params | {"additionalProperties": False}


def _re(text: str) -> str:
    """text as a Lark /regex/ literal body."""
    return re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", text)


HERMES = ToolFormat("hermes (Qwen2.5, Hermes 2/3)", marker="<tool_call>", open="<tool_call>", close="</tool_call>",
                    json_style={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
                    fence=("```json", "```"))
FORMATS = (HERMES,)


def detect(template: str | None) -> ToolFormat:
    for f in FORMATS:
        if template and f.marker in template:
            return f
    raise ToolError("this model's chat template writes no tool-call format localspec knows (supported: "
                    f"{', '.join(f.name for f in FORMATS)}); use a model whose template has one, or leave tools out")


def check_tools(tools) -> list[dict]:
    """OpenAI `tools`, validated: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty array of {type: function, function: {name, parameters}}")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {json.dumps(name)[:60]}")
        if name in names:
            raise ToolError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if f.get("parameters") is not None and (not isinstance(f["parameters"], dict)
                                                or f["parameters"].get("type", "object") != "object"):
            raise ToolError(f"{where}.function.parameters must be a JSON Schema of an object (arguments are "
                            "an object of named values)")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ToolError(f"{where}.function.description must be a string")
        out.append({"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters")
                                                     if f.get(k) is not None}})
    return out


def check_choice(choice, tools: list[dict] | None) -> str:
    """tool_choice -> 'none' | 'auto' | 'required' | a function name."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ToolError(f"tool_choice {choice!r} needs tools")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": NAME}}')
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools")
    return name


def for_template(messages: Sequence[dict]) -> list[dict]:
    """Messages as chat templates read them: a past call's arguments as an object, not OpenAI's JSON text."""
    from ..core.chat_template import ChatError, text_of

    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatError(f"message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
        # text parts joined, as the server reads them; an assistant's null content (a call alone) is empty
        text = "" if m.get("content") is None and m.get("role") == "assistant" else text_of(m.get("content"))
        if text is None:
            raise ChatError(f"message {i}: content must be a string or a list of text parts "
                            f"({{'type': 'text', 'text': ...}}), got {type(m.get('content')).__name__}")
        m = dict(m, content=text)
        if m.get("tool_calls"):
            calls = []
            if not isinstance(m["tool_calls"], (list, tuple)) or not all(
                    isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in m["tool_calls"]):
                raise ChatError(f"message {i}: tool_calls must be a list of {{\"function\": {{\"name\", "
                                "\"arguments\"}}}} objects")
            for c in m["tool_calls"]:
                f = dict(c["function"])
                try:
                    f["arguments"] = json.loads(f["arguments"]) if isinstance(f.get("arguments"), str) else f.get("arguments")
                except (ValueError, RecursionError):
                    pass  # not JSON (or nested past what Python parses): the template shows it as written
                calls.append(dict(c, function=f))
            m = dict(m, tool_calls=calls)
        out.append(m)
    return out


class CallParser:
    """Output text -> content and tool calls, incrementally: feed() returns what can be shown now.

    Text that may be the start of an opening tag is held back until it is known; a call is returned once its
    closing tag arrives. A fenced JSON block is a call only when it names one of the tools, and only the first
    call counts when parallel calls are off (a later fence is free text there, unconstrained: content). At the
    end, a fenced block left open comes back as content; a tagged call left open (cut short) is dropped.
    Whitespace after a call is held until text follows it: the line break a template writes after a call is
    not content. A reply that opens with a bare `{"name": TOOL, "arguments": {...}}` (no tag, no fence: what
    a small model writes under tool_choice auto; llama.cpp's Hermes parser takes it too) is a call as well,
    and so is one that follows a call; JSON after other text is content.
    """

    def __init__(self, fmt: ToolFormat, names: set[str], parallel: bool = True):
        self.names, self.parallel = names, parallel
        self.tags = [(fmt.open, fmt.close)] + ([fmt.fence] if fmt.fence else [])
        self._buf, self._open = "", None  # text not yet returned; the tag pair of the call being read
        self._after_call = False  # whether nothing but whitespace has come since the latest call
        self._bare = True  # whether the text to come may be a bare call (nothing but calls so far)
        self._scan = _Scan()  # how far a bare call's braces have been read (each character once)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if self._open is None and self._bare and (self.parallel or not self.calls):
                head = self._buf.lstrip()
                found = _bare_call(head, self.names, self._scan) if head else None
                if found is None:  # whitespace, or may still become a bare call: held
                    return out
                if found is not False:
                    call, end = found
                    self.calls.append(call)
                    out.append(call)
                    self._buf, self._scan, self._after_call = head[end:], _Scan(), True
                    continue
            self._bare = False
            if self._open is None:
                hits = [(i, pair) for pair in self.tags if (i := self._buf.find(pair[0])) >= 0]
                if not hits:
                    keep = max((n for o, _ in self.tags for n in range(1, len(o)) if self._buf.endswith(o[:n])),
                               default=0)
                    if self._after_call and not self._buf[:len(self._buf) - keep].strip():
                        return out  # only whitespace since the last call: held
                    if len(self._buf) > keep:
                        out.append(self._text(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                i, self._open = min(hits, key=lambda h: h[0])
                if i and (self._buf[:i].strip() or not self._after_call):  # whitespace between calls is not content
                    out.append(self._text(self._buf[:i]))
                self._buf = self._buf[i:]
            opening, closing = self._open
            j = self._buf.find(closing, len(opening))
            if j < 0:
                return out
            raw = self._buf[:j + len(closing)]
            call = _to_call(self._buf[len(opening):j], self.names) if self.parallel or not self.calls else None
            if call is None:  # not a call after all (or one too many): show it as the model wrote it
                out.append(raw)
            else:
                self.calls.append(call)
                out.append(call)
            self._buf, self._open = self._buf[len(raw):], None
            self._bare = self._after_call = call is not None

    def finish(self) -> str:
        """What is left at the end, as content; a tagged call left open (the reply was cut short) is markup, not
        content, and is dropped (a fenced block left open is shown: it may be a code block for the reader)."""
        rest = "" if self._open == self.tags[0] or (self._after_call and not self._buf.strip()) else self._buf
        rest = self._text(rest)
        self._buf, self._open = "", None
        return rest

    def _text(self, text: str) -> str:
        """Content about to be returned: the line break a template writes after a call is not content. Cut here,
        where the text is returned, so that a reply streamed a token at a time reads as the whole one does."""
        if self._after_call:
            text, self._after_call = text.lstrip("\n"), False
        return text


def _to_call(body: str, names: set[str]) -> ToolCall | None:
    """{"name": TOOL, "arguments": {...}} as a ToolCall, or None when it is not a call to one of the tools."""
    try:
        obj = json.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the object as JSON text
            if not isinstance(json.loads(args), dict):
                return None
        elif isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        else:
            return None
    except (ValueError, RecursionError):  # not JSON, or nested past what Python parses: not a call
        return None
    return ToolCall(obj["name"], args, f"call_{uuid.uuid4().hex[:24]}")


# a bare call's head, and every prefix of it ('{', '{"na', '{"name": "get_w')
_BARE_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"')
_BARE_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*(?:"([A-Za-z0-9_-]*))?)?)?)?)?)?)?)?')


def _bare_call(text: str, names: set[str], scan: "_Scan"):
    """text (starting at a non-space) as a bare call: (ToolCall, where it ends), False when it is not one, or
    None while it may still become one (a prefix of a call's head, or a call to a tool not yet closed)."""
    head = _BARE_HEAD.match(text)
    if head is None:
        part = _BARE_PREFIX.fullmatch(text)
        return None if part and any(n.startswith(part[1] or "") for n in names) else False
    if head[1] not in names:
        return False
    end = scan.object_end(text)
    if end is None:
        return None
    call = _to_call(text[:end], names)
    return (call, end) if call is not None else False


class _Scan:
    """Where the JSON object a text opens ends, read incrementally: the text grows between calls, and each
    character is read once (a long call streamed a token at a time would otherwise be read again per token)."""

    def __init__(self):
        self.at, self.depth, self.quoted, self.escaped = 0, 0, False, False

    def object_end(self, text: str) -> int | None:
        """Just past the object's closing brace, or None if it has not come yet."""
        for i in range(self.at, len(text)):
            c = text[i]
            if self.quoted:
                self.quoted, self.escaped = (c != '"' or self.escaped), (c == "\\" and not self.escaped)
            elif c == '"':
                self.quoted = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.at = len(text)
        return None
