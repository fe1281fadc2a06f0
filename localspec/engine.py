"""The decoding loop and the engine object that `localspec.load` returns.

One round: the drafter proposes up to k tokens; the target evaluates [pending, d1..dk] in one llama_decode
and returns k+1 logit rows; the acceptance rule keeps a prefix of the draft and picks the next token; the
target's KV cache is cut back to what was kept. Plain decoding is the same loop with an empty draft.

`speculate` yields facts (Prefill, Round, Token, Finish); `Stream` turns them into user events with text
and folds them into Stats. Everything else (generate, chat, CLI) reads that one stream.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Iterator, Sequence

import numpy as np

from . import acceptance
from .drafters import (EMPTY, AutoDrafter, AutoState, Draft, Drafter, HybridDrafter, ModelDrafter, NgramDrafter,
                       NoDrafter)
from .errors import LocalspecError
from .model import Model
from .registry import DRAFTERS
from .sampling import SamplingParams, choose, penalize, probs
from .text import TextStream

RULES = ("rejection", "greedy", "threshold")


class RequestError(LocalspecError):
    """A generation request is invalid (empty prompt, too long for n_ctx, k < 1, ...)."""


# ---- facts the loop yields ----
@dataclass(frozen=True, slots=True)
class Prefill:
    reused: int
    prefilled: int
    draft_reused: int
    draft_prefilled: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Round:
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float


@dataclass(frozen=True, slots=True)
class Token:
    token: int
    from_draft: bool


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" or "length"


# ---- the loop ----
def prefill(target: Model, draft: Model | None, prompt: Sequence[int]) -> Prefill:
    """Cache all but the last prompt token in both models, reusing any cached prefix.

    The last prompt token opens round one (the target verifies it, the drafter re-reads it).
    """
    t = time.perf_counter()
    reused, _ = target.sync(prompt[:-1])
    d_reused = draft.sync(prompt[:-1])[0] if draft is not None else 0
    n = len(prompt) - 1
    return Prefill(reused, n - reused, d_reused, (n - d_reused) if draft else 0, time.perf_counter() - t)


def verify(target: Model, pending: int, draft: Draft) -> np.ndarray:
    """One llama_decode of [pending, d1..dk]: k+1 logit rows, row i predicts the token after position i."""
    return target.decode([pending, *draft.tokens], logits="all")


def accept(rule: str, rows: np.ndarray, draft: Draft, params: SamplingParams, history: list[int],
           rng: np.random.Generator, tau: float) -> tuple[int, int]:
    """Turn logit rows into the target's distributions and apply the acceptance rule."""
    d = draft.tokens
    hist = [history + d[:i] for i in range(len(d) + 1)] if params.penalized else [history] * (len(d) + 1)
    if params.greedy and rule != "threshold":
        # At temperature 0 rejection sampling reduces exactly to token match: no softmax needed.
        if params.penalized:
            return acceptance.accept_greedy([int(np.argmax(penalize(r, h, params))) for r, h in zip(rows, hist)], d)
        return acceptance.accept_greedy(rows.argmax(axis=1).tolist(), d)
    if rule == "greedy":
        return acceptance.accept_greedy([choose(r, params, h, rng) for r, h in zip(rows, hist)], d)
    if rule == "rejection":
        p = np.stack([probs(r, params, h) for r, h in zip(rows, hist)])
        return acceptance.accept_rejection(p, draft.q, d, rng)
    # threshold: at temperature 0 the test uses the distribution at temperature 1, the choice stays argmax
    tp = replace(params, temperature=1.0) if params.greedy else params
    p = np.stack([probs(r, tp, h) for r, h in zip(rows, hist)])
    return acceptance.accept_threshold(p, d, tau, [choose(r, params, h, rng) for r, h in zip(rows, hist)])


def rewind(target: Model, n: int) -> None:
    """Cut the target's cache back to n tokens (pending plus the accepted draft)."""
    target.truncate(n)


def speculate(target: Model, draft_model: Model | None, drafter: Drafter, prompt: Sequence[int], *, max_tokens: int,
              k: int, rule: str, params: SamplingParams, rng: np.random.Generator, tau: float = 0.0,
              prefill_draft: bool = True) -> Iterator:
    """The decoding loop. Yields Prefill, then per round a Round and its Tokens, then one Finish.

    draft_model is the drafter's model, if any: prefilled with the prompt (unless prefill_draft is False,
    for drafters that may never use it) and kept consistent when the consumer stops early.

    Invariant at the top of each round: target.tokens == context[:-1]; context[-1] is `pending`, the
    newest token, not yet evaluated by the target.
    """
    context = list(prompt)
    try:
        yield prefill(target, draft_model if prefill_draft else None, context)
        produced = 0
        while True:
            room = target.n_ctx - len(context)  # positions left once pending is evaluated
            if produced >= max_tokens or room < 0:
                yield Finish("length")
                return
            n = min(k, max_tokens - produced - 1, room)
            t0 = time.perf_counter()
            draft = drafter.propose(context, n) if n > 0 else EMPTY
            t1 = time.perf_counter()
            rows = verify(target, context[-1], draft)
            t2 = time.perf_counter()
            history = context[len(prompt):] if params.penalized else []  # only penalties read it
            n_acc, nxt = accept(rule, rows, draft, params, history, rng, tau)
            rewind(target, len(context) + n_acc)
            yield Round(len(draft.tokens), n_acc, t1 - t0, t2 - t1)
            for tok, from_draft in [*((t, True) for t in draft.tokens[:n_acc]), (nxt, False)]:
                if target.is_eog(tok):
                    yield Finish("stop")
                    return
                context.append(tok)
                produced += 1
                yield Token(tok, from_draft)
    finally:
        # A consumer that stops early (stop string, Ctrl-C, closed stream) may leave the generator between a
        # decode and the bookkeeping after it: drop any position the token list does not account for.
        for m in (target, draft_model):
            if m is not None:
                m.truncate(len(m.tokens))


# ---- events and stats for users ----
@dataclass(frozen=True, slots=True)
class Event:
    """One generated token: its id, the text it makes printable now, and whether the draft proposed it."""

    token: int
    text: str
    from_draft: bool


@dataclass(frozen=True)
class Stats:
    drafter: str
    rule: str
    lossless: bool
    k: int
    finish_reason: str
    prompt_tokens: int
    prompt_reused: int
    prompt_prefilled: int
    draft_prompt_reused: int
    draft_prompt_prefilled: int
    prompt_s: float
    generated: int
    gen_s: float
    rounds: int
    drafting_rounds: int
    drafted: int
    accepted: int
    accepted_at: tuple[int, ...]  # accepted_at[i]: rounds whose draft token i was accepted
    draft_s: float
    verify_s: float

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per round that drafted anything."""
        return self.accepted / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_prefilled / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.generated / self.gen_s if self.gen_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accepted_at"] = list(self.accepted_at)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted,
                 prompt_tps=self.prompt_tps, gen_tps=self.gen_tps)
        return d

    def line(self) -> str:
        s = (f"{self.generated} tokens in {self.gen_s:.2f}s ({self.gen_tps:.1f} tok/s), "
             f"prompt {self.prompt_prefilled} prefilled + {self.prompt_reused} reused; drafter {self.drafter}")
        if self.drafted:
            s += (f", accepted {self.accepted}/{self.drafted} ({self.acceptance_rate:.0%}), "
                  f"{self.mean_accepted:.2f} per round")
        return s + f"; {self.rule} ({'lossless' if self.lossless else 'LOSSY'})"


class Stream:
    """Iterate for Events; after the last one, `stats` and `finish_reason` are set."""

    def __init__(self, facts: Iterator, piece, *, stop: Sequence[str], drafter: str, rule: str, k: int,
                 prompt_tokens: int):
        self._facts, self._piece = facts, piece
        self._text = TextStream(stop)
        self._meta = dict(drafter=drafter, rule=rule, lossless=acceptance.LOSSLESS[rule], k=k,
                          prompt_tokens=prompt_tokens)
        self.stats: Stats | None = None
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[Event]:
        pre, rounds, drafting, drafted, acc, at, t_d, t_v, n = None, 0, 0, 0, 0, [], 0.0, 0.0, 0
        reason, held = "stop", None
        t_gen = time.perf_counter()
        try:
            for f in self._facts:
                if type(f) is Token:
                    if held is not None:
                        yield held
                        held = None
                    n += 1
                    ev = Event(f.token, self._text.push(self._piece(f.token)), f.from_draft)
                    if self._text.stopped:
                        reason = "stop"
                        yield ev
                        break
                    if self._text.holding:
                        held = ev  # may receive the final flush
                    else:
                        yield ev
                elif type(f) is Round:
                    rounds += 1
                    t_d += f.draft_s
                    t_v += f.verify_s
                    if f.drafted:
                        drafting += 1
                        drafted += f.drafted
                        acc += f.accepted
                        at.extend([0] * (f.drafted - len(at)))
                        for i in range(f.accepted):
                            at[i] += 1
                elif type(f) is Prefill:
                    pre = f
                    t_gen = time.perf_counter()
                elif type(f) is Finish:
                    reason = f.reason
            tail = self._text.flush()
            if held is not None:
                yield replace(held, text=held.text + tail)
        finally:
            self._facts.close()
            self.finish_reason = reason
            self.stats = Stats(finish_reason=reason, prompt_reused=pre.reused if pre else 0,
                               prompt_prefilled=pre.prefilled if pre else 0,
                               draft_prompt_reused=pre.draft_reused if pre else 0,
                               draft_prompt_prefilled=pre.draft_prefilled if pre else 0, prompt_s=pre.seconds if pre else 0.0,
                               generated=n, gen_s=time.perf_counter() - t_gen, rounds=rounds, drafted=drafted,
                               accepted=acc, accepted_at=tuple(at), draft_s=t_d, verify_s=t_v,
                               drafting_rounds=drafting, **self._meta)


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]
    from_draft: list[bool]
    finish_reason: str
    stats: Stats

    def to_dict(self) -> dict:
        return dict(text=self.text, tokens=self.tokens, from_draft=self.from_draft,
                    finish_reason=self.finish_reason, stats=self.stats.to_dict())


# ---- the engine object ----
@dataclass(frozen=True)
class Request:
    """Everything one generation call may set, validated once."""

    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    drafter: str | None = None
    accept: str = "rejection"
    k: int | None = None  # draft tokens per round; under auto the upper bound. Default: 16 for auto, else 4
    p_min: float = 0.75
    threshold: float = 0.5
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be a non-negative integer, got {self.seed}")
        if self.k is not None and self.k < 1:
            raise RequestError(f"k (draft tokens per round) must be at least 1, got {self.k}")
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise RequestError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.accept not in RULES:
            raise RequestError(f"accept must be one of {', '.join(RULES)}, got {self.accept!r}")
        if not 0.0 <= self.p_min <= 1.0:
            raise RequestError(f"p_min must be in [0, 1], got {self.p_min}")
        if not 0.0 <= self.threshold <= 1.0:
            raise RequestError(f"threshold must be in [0, 1], got {self.threshold}")


_SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "frequency_penalty",
                  "presence_penalty", "penalty_last_n"}


def make_request(**kw) -> Request:
    """Request from flat keyword arguments (the names of generate(), as in llama-cpp-python)."""
    sampling = SamplingParams(**{k: kw.pop(k) for k in list(kw) if k in _SAMPLING_KEYS})
    if isinstance(kw.get("stop"), str):
        kw["stop"] = (kw["stop"],)
    elif kw.get("stop") is not None:
        kw["stop"] = tuple(kw["stop"])
    else:
        kw.pop("stop", None)
    unknown = sorted(set(kw) - {f for f in Request.__dataclass_fields__} )
    if unknown:
        raise RequestError(f"unknown generation option {unknown[0]!r}")
    return Request(sampling=sampling, **kw)


class Engine:
    """A target model, an optional draft model, and the generation API over them (see localspec.load)."""

    def __init__(self, target: Model, draft: Model | None = None, *, name: str | None = None,
                 defaults: dict | None = None):
        self.target, self.draft = target, draft
        self.name = name or target.path.stem
        self.defaults = dict(defaults or {})  # a pair's recommended drafter, k, p_min
        self._auto: AutoState | None = None

    # -- prompts --
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.target.detokenize(tokens)

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        from .chat import render

        t = self.target
        return render(t.chat_template(), messages, add_generation_prompt=add_generation_prompt,
                      bos_token=t.token_text(t.bos).decode(errors="replace") if t.bos >= 0 else "",
                      eos_token=t.token_text(t.eos).decode(errors="replace") if t.eos >= 0 else "")

    def chat_tokens(self, messages: Sequence[dict]) -> list[int]:
        # The template writes BOS itself when the model wants one: do not add it again.
        return self.tokenize(self.render_chat(messages), add_special=False)

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            tokens = self.tokenize(prompt)
        else:
            tokens = [int(t) for t in prompt]
        if not tokens:
            raise RequestError("prompt is empty")
        if len(tokens) > self.target.n_ctx:
            raise RequestError(f"prompt is {len(tokens)} tokens but n_ctx is {self.target.n_ctx}; "
                               "raise n_ctx (--n-ctx) or shorten the prompt")
        bad = next((t for t in tokens if not 0 <= t < self.target.n_vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        return tokens

    def auto_state(self) -> AutoState:
        """What auto has learned on this engine; the first call measures this machine's costs (cached on disk)."""
        if self._auto is None:
            from .calibrate import load_or_measure
            from .registry import home

            self._auto = AutoState(load_or_measure(self.target, self.draft, home() / "calibration"))
        return self._auto

    def _drafter(self, req: Request, rng: np.random.Generator, prompt_len: int) -> tuple[str, Drafter]:
        name = req.drafter or "auto"
        if name in ("model", "hybrid") and self.draft is None:
            raise RequestError(f"drafter {name!r} needs a draft model: load one (draft=PATH, --draft) "
                               "or use drafter 'auto', 'ngram' or 'none'")
        if name == "none":
            return name, NoDrafter()
        if name == "ngram":
            return name, NgramDrafter()
        model = (ModelDrafter(self.draft, req.sampling, rng, p_min=req.p_min, prompt_len=prompt_len)
                 if self.draft is not None else None)
        if name == "auto":
            return name, AutoDrafter(self.auto_state(), NgramDrafter(n_min=1, n_max=8), model)
        return name, model if name == "model" else HybridDrafter(NgramDrafter(), model)

    # -- generation --
    def stream(self, prompt: str | Sequence[int], **options) -> Stream:
        """Generate, yielding one Event per token; `.stats` is set once the stream ends.

        prompt: text (special tokens such as <|im_start|> are recognised) or token ids.
        options: max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, frequency_penalty,
        presence_penalty, seed, drafter ('auto', 'model', 'ngram', 'hybrid', 'none'), accept ('rejection',
        'greedy', 'threshold'), k, p_min, threshold, stop.
        """
        req = make_request(**(self.defaults | {k: v for k, v in options.items() if v is not None}))
        tokens = self._prompt_tokens(prompt)
        rng = np.random.default_rng(req.seed)
        name, drafter = self._drafter(req, rng, len(tokens))
        k = req.k or (16 if name == "auto" else 4)
        # auto may never call the draft model (on a CPU it rarely pays): it catches up lazily if it does.
        facts = speculate(self.target, None if name in ("none", "ngram") else self.draft, drafter, tokens,
                          max_tokens=req.max_tokens, k=k, rule=req.accept, params=req.sampling, rng=rng,
                          tau=req.threshold, prefill_draft=name != "auto")
        return Stream(facts, self.target.piece, stop=req.stop, drafter=name, rule=req.accept, k=k,
                      prompt_tokens=len(tokens))

    def generate(self, prompt: str | Sequence[int], **options) -> Result:
        """Generate to the end and return the text, tokens, from_draft flags, finish_reason and stats."""
        s = self.stream(prompt, **options)
        events = list(s)
        return Result("".join(e.text for e in events), [e.token for e in events], [e.from_draft for e in events],
                      s.finish_reason, s.stats)

    def create_chat_completion(self, messages: Sequence[dict], *, stream: bool = False, **options):
        """OpenAI-shaped chat completion dicts, as llama-cpp-python's Llama.create_chat_completion returns."""
        from .openai_shapes import chat_chunks, chat_completion

        s = self.stream(self.chat_tokens(messages), **options)
        return chat_chunks(self.name, s) if stream else chat_completion(self.name, s)

    def close(self) -> None:
        for m in (self.target, self.draft):
            if m is not None:
                m.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
