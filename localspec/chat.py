"""Chat prompts: the Jinja chat template stored in the target GGUF, rendered with jinja2.

Rendering follows llama-cpp-python's Jinja2ChatFormatter (sandboxed environment, trim_blocks, lstrip_blocks,
the bos/eos token strings and raise_exception), so a template behaves as it does there.
"""
from __future__ import annotations

import datetime
import json
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


def render(template: str | None, messages: Sequence[Mapping], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, tools: Sequence[Mapping] | None = None) -> str:
    """The prompt text for a conversation (OpenAI-style messages: role and content; tool calls and results
    too, where the template renders them), and the tools offered to the model (OpenAI `tools`)."""
    if template is None:
        raise ChatError("this model has no chat template in its GGUF metadata; pass a pre-rendered prompt instead")
    if not messages:
        raise ChatError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or not isinstance(m.get("content", ""), (str, type(None))):
            raise ChatError(f"message {i} must be an object with 'role' and string 'content', got {m!r}")
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages], bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, raise_exception=_raise, tools=tools or None,
            strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    except ChatError:
        raise
    except Exception as e:  # TemplateError, and what a template's filters raise on odd input (RecursionError, ...)
        raise ChatError(f"chat template failed to render: {type(e).__name__}: {e}"[:500]) from None


def segments(template: str | None, messages: Sequence[Mapping], special, *, bos_token: str = "",
             eos_token: str = "", add_generation_prompt: bool = True,
             tools: Sequence[Mapping] | None = None) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_markup) pieces: message text that spells a control token (as
    `special(text)` says) comes out as its own piece with is_markup False, to be tokenized as plain text.

    Such a message is rendered through a placeholder that the template cannot mistake for anything, and its
    text is put back in the placeholder's place; every other message renders as the template writes it.
    """
    for where, text in _strings(messages, tools):
        if special(text):
            raise ChatError(f"{where} spells a control token; only message content may hold such text (kept there "
                            "as plain text): remove it")
    risky = {i for i, m in enumerate(messages) if isinstance(m, Mapping) and isinstance(m.get("content"), str)
             and m["content"] and special(m["content"])}
    kw = dict(bos_token=bos_token, eos_token=eos_token, add_generation_prompt=add_generation_prompt, tools=tools)
    if not risky:
        return [(render(template, messages, **kw), True)]
    mark = f"\ue000{uuid.uuid4().hex}"  # a private-use character and a nonce: no message can contain it
    stand_in = [dict(m, content=f"{mark}{i}{mark}") if i in risky else m for i, m in enumerate(messages)]
    parts = render(template, stand_in, **kw).split(mark)
    if len(parts) != 2 * len(risky) + 1 or sorted(parts[1::2]) != sorted(map(str, risky)):
        raise ChatError("the chat template repeats or drops message text, so control-token text in a message "
                        "cannot be kept apart from the template's markup; remove it from the message")
    out = [(part, True) if j % 2 == 0 else (messages[int(part)]["content"], False) for j, part in enumerate(parts)]
    return [(t, m) for t, m in out if t]


def _strings(messages: Sequence[Mapping], tools: Sequence[Mapping] | None):
    """(where, text) for every string the template may print besides message content (roles, names, ids, tool
    calls, tool definitions, and the keys of them all): those cannot go through a placeholder, as templates
    print them inside JSON, so text there that spells a control token is refused instead."""
    todo = [(f"messages[{i}]", m, True) for i, m in enumerate(messages)] + \
           [(f"tools[{i}]", t, False) for i, t in enumerate(tools or ())]
    while todo:
        where, value, message = todo.pop()
        if isinstance(value, str):
            yield where, value
        elif isinstance(value, Mapping):
            for key, v in value.items():
                if isinstance(key, str):
                    yield f"a field name in {where}", key
                if not (message and key == "content"):
                    todo.append((f"{where}.{key}", v, False))
        elif isinstance(value, (list, tuple)):
            todo.extend((f"{where}[{i}]", v, False) for i, v in enumerate(value))
