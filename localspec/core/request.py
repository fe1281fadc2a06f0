"""A generation request: every option one call may set, validated once, before anything runs."""
from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field

from . import defaults
from .errors import LocalspecError
from .grammar import compile_spec
from .sampling import SamplingParams
from .thinking import Span


class RequestError(LocalspecError):
    """A generation request is invalid (empty prompt, too long for n_ctx, k < 1, ...)."""


@dataclass(frozen=True)
class Request:
    """Everything one generation call may set, validated once."""

    max_tokens: int = defaults.MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    drafter: str | None = None
    accept: str = defaults.ACCEPT
    k: int | None = None  # draft tokens per round; under auto the upper bound. Default: K_AUTO (K_PREDICTION) / K_FIXED
    p_min: float = defaults.P_MIN
    threshold: float = defaults.THRESHOLD
    stop: tuple[str, ...] = ()
    # constrained output, at most one (grammar.compile_spec): a JSON Schema (dict or JSON text), a Lark or
    # llama.cpp GBNF grammar, a regex, or any JSON object
    json_schema: dict | str | None = None
    grammar: str | None = None
    regex: str | None = None
    json_object: bool = False
    logprobs: int | None = None  # 0..20: each token's log-probability and this many top alternatives
    prediction: str | tuple[int, ...] | None = None  # text (or token ids) the output is expected to resemble
    history: bool = True  # where the engine keeps a history of outputs: draft from it and add this one to it
    prompt_cache: bool = True  # where the engine keeps prompt states: restore this prompt from one, keep its own
    # a reasoning model's thinking span (its markers, whether the prompt opened it, its budget): the constraint
    # above then applies to the answer after it, and the budget ends the span (thinking.Thinking)
    span: Span | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "seed", "k", "logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise RequestError(f"{name} must be an integer, got {v!r}")
            if v is not None and type(v) is not int:  # numpy's integers too, held as Python's
                object.__setattr__(self, name, int(v))
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be a non-negative integer below 2**63, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs (top alternatives per token) must be in 0..20, got {self.logprobs}")
        if self.prediction is not None and not (isinstance(self.prediction, str) or isinstance(
                self.prediction, tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in self.prediction)):
            raise RequestError("prediction must be text or a list of token ids")
        if self.k is not None and self.k < 1:
            raise RequestError(f"k (draft tokens per round) must be at least 1, got {self.k}")
        if self.drafter is not None and self.drafter not in defaults.DRAFTERS:
            raise RequestError(f"drafter must be one of {', '.join(defaults.DRAFTERS)}, got {self.drafter!r}")
        if self.accept not in defaults.RULES:
            raise RequestError(f"accept must be one of {', '.join(defaults.RULES)}, got {self.accept!r}")
        for name in ("p_min", "threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v <= 1.0:
                raise RequestError(f"{name} must be in [0, 1], got {v!r}")
            object.__setattr__(self, name, float(v))
        if not all(isinstance(x, str) for x in self.stop):
            raise RequestError("stop must be a string or a list of strings")
        for name in ("json_object", "history", "prompt_cache"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.span is not None:
            if not isinstance(self.span, Span):
                raise RequestError(f"span must be a localspec Span, got {type(self.span).__name__}")
            b = self.span.budget
            if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0):
                raise RequestError(f"the thinking budget must be a non-negative integer (tokens), got {b!r}")
        self.constraint()  # an invalid schema, grammar or regex is an error now, naming it

    def constraint(self) -> str | None:
        """The compiled llguidance grammar of this request, or None when its output is free."""
        return compile_spec(json_schema=self.json_schema, grammar=self.grammar, regex=self.regex,
                            json_object=self.json_object)


_SAMPLING_KEYS = set(defaults.SAMPLING)


def make_request(**kw) -> Request:
    """Request from flat keyword arguments (the names of generate(), as in llama-cpp-python)."""
    sampling = SamplingParams(**{k: kw.pop(k) for k in list(kw) if k in _SAMPLING_KEYS})
    if isinstance(kw.get("stop"), str):
        kw["stop"] = (kw["stop"],)
    elif kw.get("stop") is not None:
        if not isinstance(kw["stop"], (list, tuple)):
            raise RequestError(f"stop must be a string or a list of strings, got {type(kw['stop']).__name__}")
        kw["stop"] = tuple(kw["stop"])
    else:
        kw.pop("stop", None)
    pred = kw.get("prediction")
    if pred is not None and not isinstance(pred, str):
        try:  # token ids: a list, a tuple, a range, a numpy array; not bytes
            if isinstance(pred, (bytes, bytearray, memoryview)):
                raise TypeError
            kw["prediction"] = tuple(operator.index(t) for t in pred)
        except TypeError:
            raise RequestError(f"prediction must be text or a list of token ids, got {type(pred).__name__}") from None
    unknown = sorted(set(kw) - {f for f in Request.__dataclass_fields__})
    if unknown:
        raise RequestError(f"unknown generation option {unknown[0]!r}")
    return Request(sampling=sampling, **kw)
