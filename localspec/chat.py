"""Chat prompts: the Jinja chat template stored in the target GGUF, rendered with jinja2.

Rendering follows llama-cpp-python's Jinja2ChatFormatter (sandboxed environment, trim_blocks, lstrip_blocks,
the bos/eos token strings and raise_exception), so a template behaves as it does there.
"""
from __future__ import annotations

import datetime
from typing import Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import LocalspecError


class ChatError(LocalspecError):
    """Messages are malformed, or the model has no usable chat template."""


def _raise(message: str):
    raise ChatError(f"chat template: {message}")


def render(template: str | None, messages: Sequence[Mapping], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """The prompt text for a conversation (OpenAI-style messages: role and content)."""
    if template is None:
        raise ChatError("this model has no chat template in its GGUF metadata; pass a pre-rendered prompt instead")
    if not messages:
        raise ChatError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or not isinstance(m.get("content", ""), (str, type(None))):
            raise ChatError(f"message {i} must be an object with 'role' and string 'content', got {m!r}")
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages], bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, raise_exception=_raise,
            strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    except jinja2.TemplateError as e:
        raise ChatError(f"chat template failed to render: {e}") from None
