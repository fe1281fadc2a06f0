"""Chat prompts: the Jinja chat template stored in the target GGUF, rendered with jinja2.

Rendering follows llama-cpp-python's Jinja2ChatFormatter (sandboxed environment, trim_blocks, lstrip_blocks,
the bos/eos token strings and raise_exception), so a template behaves as it does there.
"""
from __future__ import annotations

import datetime
import json
import re
import uuid
from typing import Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import LocalspecError


class ChatError(LocalspecError):
    """Messages are malformed, or the model has no usable chat template."""


def _raise(message: str):
    raise ChatError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False) -> str:
    # as transformers' chat templates have it: plain JSON, no HTML escaping (jinja2's own escapes < > & ')
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def text_of(content) -> str | None:
    """A message's content as text: a string, or OpenAI's content parts of type text joined by newlines (as
    the server reads them); None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and all(
            isinstance(c, Mapping) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
        return "\n".join(c["text"] for c in content)
    return None


RESERVED = frozenset({"messages", "tools", "bos_token", "eos_token", "add_generation_prompt", "raise_exception",
                      "strftime_now"})  # what render() gives every template: a caller's variables cannot replace it


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env


def check_template(template: str) -> None:
    """A template given in place of the GGUF's: refused now, naming the fault, where jinja2 cannot compile it."""
    if not isinstance(template, str) or not template.strip():
        raise ChatError("chat_template must be the text of a Jinja chat template")
    try:
        _env().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"chat template: line {e.lineno}: {e.message}") from None


def render(template: str | None, messages: Sequence[Mapping], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, tools: Sequence[Mapping] | None = None,
           variables: Mapping | None = None) -> str:
    """The prompt text for a conversation (OpenAI-style messages: role and content; tool calls and results
    too, where the template renders them), and the tools offered to the model (OpenAI `tools`); `variables`
    are more names the template may read (`enable_thinking`: a request's chat_template_kwargs)."""
    if variables and RESERVED & variables.keys():
        raise ChatError(f"template variables cannot replace {', '.join(sorted(RESERVED & variables.keys()))}")
    if template is None:
        raise ChatError("this model has no chat template in its GGUF metadata; pass a pre-rendered prompt instead")
    if not messages:
        raise ChatError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or not isinstance(m.get("content", ""), (str, type(None))):
            raise ChatError(f"message {i} must be an object with 'role' and string 'content', got {m!r}")
    try:
        return _env().from_string(template).render(
            **(variables or {}), messages=[dict(m) for m in messages], bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, raise_exception=_raise, tools=tools or None,
            strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    except ChatError:
        raise
    except Exception as e:  # TemplateError, and what a template's filters raise on odd input (RecursionError, ...)
        raise ChatError(f"chat template failed to render: {type(e).__name__}: {e}"[:500]) from None


def segments(template: str | None, messages: Sequence[Mapping], spellings: re.Pattern | None, *,
             bos_token: str = "", eos_token: str = "", add_generation_prompt: bool = True,
             tools: Sequence[Mapping] | None = None, variables: Mapping | None = None) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_markup) pieces: wherever the messages or tools spell a control token
    (`spellings` finds them: '<|im_start|>'), the spelling comes out as a piece of its own with is_markup
    False, to be tokenized as plain text; everything else is the template's output, markup and all.

    Every string the template is given (message content, names, past tool calls, tool definitions, a request's
    template variables, field names) has each spelling swapped for a placeholder that the template cannot
    mistake for anything; after rendering, each placeholder's spelling is put back. The spellings hold no
    character that JSON escapes, so this holds whether a template prints the text as it is or through tojson,
    once or twice.
    """
    kw = dict(bos_token=bos_token, eos_token=eos_token, add_generation_prompt=add_generation_prompt, tools=tools,
              variables=variables)
    found: list[str] = []
    mark = f"\ue000{uuid.uuid4().hex}"  # a private-use character and a nonce: no message can contain it

    def hide(value):
        if isinstance(value, str):
            return spellings.sub(lambda m: f"{mark}{found.append(m.group()) or len(found) - 1}{mark}", value)
        if isinstance(value, Mapping):
            return {hide(k): hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [hide(v) for v in value]
        return value

    try:
        hidden = hide([messages, tools, dict(variables or {})]) if spellings is not None else None
    except RecursionError:
        raise ChatError("the messages or tools nest too deeply to render") from None
    if not found:
        return [(render(template, messages, **kw), True)]
    parts = render(template, hidden[0], **(kw | {"tools": hidden[1], "variables": hidden[2]})).split(mark)
    if len(parts) % 2 == 0 or not all(p.isdigit() and int(p) < len(found) for p in parts[1::2]) \
            or any(mark[1:].lower() in p.lower() for p in parts[::2]):
        raise ChatError("the chat template alters the text it is given, so control-token text in it cannot be "
                        "kept apart from the template's markup; remove the control-token text")
    out = [(part, True) if j % 2 == 0 else (found[int(part)], False) for j, part in enumerate(parts)]
    return [(t, m) for t, m in out if t]
