"""The engine object that `localspec.load` returns: a target model, an optional draft model, and the
generation API over them (prompts, drafters chosen per request, the stream)."""
from __future__ import annotations

import contextlib
import operator
import secrets
import sys
import threading
from typing import Callable, Sequence

from . import defaults
from .auto import AutoDrafter, vocab_kinds
from .batch import Batcher
from .costs import Costs, Shared, measure, measure_batch
from .drafters import Drafter, GrammarDrafter, HybridDrafter, ModelDrafter, NgramDrafter, NoDrafter, Prediction
from .grammar import Grammar, Unconstrained
from .thinking import Thinking
from .history import History
from .loop import Finish, Token, speculate
from .model import Cancelled, Model, ModelError
from .prefix import PrefixCache
from .request import Request, RequestError, make_request
from .stream import Result, Stream


EXACT_PARALLEL = ModelError(
    "exact mode cannot be kept with parallel requests: a request decoded beside others shares each llama_decode "
    "with their tokens and its cache with their cells, which exact mode's probe does not cover, so its text could "
    "differ from the same request served alone; use parallel 1 with exact, or run without exact")


class Engine:
    """A target model, an optional draft model, and the generation API over them (see localspec.load).

    Safe to share between threads and between interleaved streams. With one sequence (parallel 1, the
    default) each round holds the engine's lock and first restores the target's cache to its own context if
    another stream changed it (correct, but each switch costs a prefill of what differs; one stream at a time
    is the fast way). In exact mode each stream gets the very text it would get alone; in the default mode a
    cache rebuilt in other batches than a fresh prefill can flip a near-tie at temperature 0.
    With parallel N (models loaded with n_seq=N) up to N streams decode together, each in a sequence of its
    own (a slot), their rounds joined into one llama_decode per model (batch.Batcher); a stream waits for a
    free slot when N are open, and takes the one whose cache shares most of its prompt.
    """

    def __init__(self, target: Model, draft: Model | None = None, *, name: str | None = None,
                 defaults: dict | None = None, costs: Callable[..., Costs] | None = None, history_mb: float = 0,
                 history_keeper=None, prompt_cache: PrefixCache | None = None, chat_template: str | None = None):
        """costs(target, draft, force=, stop=) gives this machine's speculation costs: localspec.load passes one
        that keeps them under $LOCALSPEC_HOME (store.calibration); without it they are measured on first use.
        history_mb > 0 keeps what requests generate (up to that many MB per scope) for auto to draft from;
        history_keeper makes it outlive the engine (store.history.HistoryFiles: localspec.load passes one).
        prompt_cache keeps the KV states of prompts (prefix.PrefixCache, its models attached): a prompt that
        starts like a kept one restores those cells instead of prefilling them.
        chat_template: renders chats in place of the template in the target's GGUF."""
        self.target, self.draft = target, draft
        self._chat_template = chat_template
        self.history = History(history_mb, keeper=history_keeper) if history_mb > 0 else None
        self.prompt_cache = prompt_cache
        self.name = name or target.path.stem
        self.defaults = dict(defaults or {})  # a pair's recommended drafter, k, p_min
        self._measure = costs or (lambda target, draft, force=False, stop=None:
                                  measure_batch(target, measure(target, draft, stop=stop)))
        self._costs = None
        self._lock = threading.RLock()
        self.parallel = target.n_seq
        self._batcher = Batcher() if self.parallel > 1 else None
        if self._batcher is not None:
            if target.cfg.exact:
                raise EXACT_PARALLEL
            for m in (target, draft):
                if m is not None:
                    m.batcher = self._batcher
        self._slots = threading.Condition()
        self._free = list(range(1, self.parallel + 1)) if self.parallel > 1 else []
        self._held: dict[int, int] = {}  # slot -> the thread whose stream holds it
        self._waiting = 0  # streams waiting for a free slot
        self.queued = lambda: 0  # requests waiting for this engine outside it (a server sets its queue's length)
        self._closing = threading.Event()  # close() asks the stream in progress to stop at its next check

    # -- prompts --
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"tokenize takes text (a str), got {type(text).__name__}")
        return self.target.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.target.detokenize(self._ids(tokens, "detokenize takes a list of token ids"))

    def _ids(self, tokens, expected: str) -> list[int]:
        """Token ids of the target's vocabulary, checked: llama.cpp aborts the process on an id outside it."""
        try:  # integers, not bytes (whose items are ints) nor floats (int() would truncate)
            if isinstance(tokens, (str, bytes, bytearray, memoryview)):
                raise TypeError
            ids = [operator.index(t) for t in tokens]
        except TypeError:
            raise RequestError(f"{expected}, got {type(tokens).__name__}") from None
        bad = next((t for t in ids if not 0 <= t < self.target.n_vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        return ids

    def single_token(self, text: str) -> int | None:
        """The id of the one token that spells `text` (a special tag such as <tool_call>), or None."""
        ids = self.tokenize(text, add_special=False)
        return ids[0] if len(ids) == 1 else None

    def _template_kwargs(self) -> dict:
        t = self.target
        return dict(bos_token=t.token_text(t.bos).decode(errors="replace") if t.bos >= 0 else "",
                    eos_token=t.token_text(t.eos).decode(errors="replace") if t.eos >= 0 else "")

    def chat_template(self) -> str | None:
        """The Jinja template chats are rendered with: the one given at load, else the target GGUF's."""
        return self._chat_template if self._chat_template is not None else self.target.chat_template()

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None, variables: dict | None = None) -> str:
        from .chat_template import render

        return render(self.chat_template(), messages, add_generation_prompt=add_generation_prompt,
                      tools=tools, variables=variables, **self._template_kwargs())

    def chat_tokens(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                    variables: dict | None = None) -> list[int]:
        """The prompt tokens of a conversation, rendered with the target's chat template.

        Message text is tokenized as plain text: a message (or a tool definition, a past tool call) that
        contains '<|im_start|>' gets the characters, never the control token, so no message can forge a turn.
        Only the template's own markup becomes special tokens. (The template writes BOS itself when the model
        wants one.)
        """
        from .chat_template import segments

        out = []
        for text, markup in segments(self.chat_template(), messages, self.target.control_spellings(),
                                     tools=tools, variables=variables, **self._template_kwargs()):
            out += self.tokenize(text, add_special=False, parse_special=markup)
        return out

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            tokens = self.tokenize(prompt)
        else:
            tokens = self._ids(prompt, "prompt must be text or a list of token ids")
        if not tokens:
            raise RequestError("prompt is empty")
        if len(tokens) > self.target.n_ctx:
            raise RequestError(f"prompt is {len(tokens)} tokens but n_ctx is {self.target.n_ctx}; "
                               "raise n_ctx (--n-ctx) or shorten the prompt")
        return tokens

    def calibration(self, *, force: bool = False):
        """This machine's speculation costs for these models (costs.Costs); measured on first use, kept.
        With parallel slots, measured only once every slot is free (localspec.load and the server do it before
        any request): measuring decodes in the slots' sequences and empties them after."""
        if self._costs is None or force:
            with self._all_slots(), self._quiet():
                try:
                    self._costs = self._measure(self.target, self.draft, force=force, stop=self._closing.is_set)
                except Cancelled:  # close() was called meanwhile: nothing was kept, it is measured next time
                    raise ModelError(f"{self.name} was closed while measuring its costs") from None
        return self._costs

    @contextlib.contextmanager
    def _all_slots(self):
        """Every parallel slot, taken once free (none without slots): what measures the batch surface never
        changes the sequence of a request in progress."""
        if self._batcher is None:
            yield
            return
        with self._slots:
            if threading.get_ident() in self._held.values():
                raise RequestError("this thread has a stream open in a slot: read it to its end or close it before "
                                   "measuring the costs (localspec.load measures them before any request)")
            self._slots.wait_for(lambda: len(self._free) == self.parallel or self._closing.is_set())
            taken, self._free = self._free, []
        try:
            yield
        finally:
            with self._slots:
                self._free = taken
                self._slots.notify_all()

    def _quiet(self):
        """Held while the models are measured or closed: no stream decodes meanwhile."""
        return self._batcher.exclusive() if self._batcher is not None else self._lock

    def token_kinds(self):
        """Each target token's kind (drafters.vocab_kinds), as auto reads them."""
        return vocab_kinds(self.target)

    def _prediction(self, req: Request, tokens: list[int], notes: list[str]) -> Prediction | None:
        if req.prediction is None:
            return None
        pred = (self.tokenize(req.prediction, add_special=False, parse_special=False)
                if isinstance(req.prediction, str) else self._ids(req.prediction, "prediction must be token ids"))
        room = self.target.n_ctx - len(tokens)
        if len(pred) > room:  # the output cannot be longer than the room left: neither need the prediction be
            notes.append(f"the prediction ({len(pred)} tokens) is longer than the room left in n_ctx; "
                         f"its first {max(room, 0)} tokens are used")
            pred = pred[:max(room, 0)]
        if req.drafter in ("none", "model"):
            notes.append(f"drafter {req.drafter!r} does not draft from a prediction; use 'auto', 'ngram' or 'hybrid'")
        return Prediction(pred, len(tokens)) if pred else None

    def _drafter(self, req: Request, seed: int, tokens: list[int], notes: list[str],
                 grammar, scope: str, target=None, draft=None) -> tuple[str, Drafter, bool]:
        """(name, drafter, whether to prefill the draft model with the prompt); target and draft: the sequences
        the request decodes in (the models' own by default)."""
        name, drafter, prefill_draft = self._free_drafter(req, seed, tokens, notes, grammar,
                                                          self._prediction(req, tokens, notes), scope,
                                                          self.target if target is None else target,
                                                          self.draft if draft is None else draft)
        if grammar is not None and name not in ("none", "auto"):  # auto drafts the forced tokens itself
            drafter = GrammarDrafter(grammar, drafter)
        return name, drafter, prefill_draft

    def _free_drafter(self, req: Request, seed: int, tokens: list[int], notes: list[str], grammar,
                      prediction: Prediction | None, scope: str, target, draft) -> tuple[str, Drafter, bool]:
        name = req.drafter or defaults.DRAFTER
        if name in ("model", "hybrid") and self.draft is None:
            raise RequestError(f"drafter {name!r} needs a draft model: load one (draft=PATH, --draft) "
                               "or use drafter 'auto', 'ngram' or 'none'")
        if name == "none":
            return name, NoDrafter(), False
        if name == "ngram":
            return name, NgramDrafter(prediction=prediction), False
        model = (ModelDrafter(draft, req.sampling, seed=seed, p_min=req.p_min, prompt_len=len(tokens),
                              target_vocab=self.target.n_vocab, grammar=grammar) if self.draft is not None else None)
        fits = model is not None and model.fits(tokens)
        if model is not None and not fits:
            why = (f"the prompt ({len(tokens)} tokens) does not fit the draft model's context "
                   f"(n_ctx_draft={self.draft.n_ctx})" if len(tokens) >= self.draft.n_ctx else
                   f"the prompt holds token ids the draft model lacks (its vocabulary has {self.draft.n_vocab})")
            if name == "model":
                raise RequestError(f"drafter 'model' cannot draft for this request: {why}; raise --n-ctx-draft, "
                                   "or use drafter 'auto' or 'ngram', which stand aside")
            notes.append(f"the draft model stands aside: {why}")
        if name == "auto":
            costs = self.calibration()
            if self._batcher is not None:  # priced as a share of the batch it decodes in
                costs = Shared(costs, lambda: self._batcher.others(target), lambda: self._waiting + self.queued())
            auto = AutoDrafter(costs, NgramDrafter(n_min=1, n_max=8), model if fits else None,
                               sample_rows=not req.sampling.greedy, grammar=grammar, prediction=prediction,
                               kinds=self.token_kinds(),
                               history=self.history.cache(scope) if self.history is not None and req.history else None)
            # the draft model's cache is caught up only once auto decides that pays (not before the first token)
            return name, auto, False
        if name == "model":
            return name, model, True
        return name, HybridDrafter(NgramDrafter(prediction=prediction), model), fits

    # -- generation --
    def stream(self, prompt: str | Sequence[int], *, cancel: Callable[[], bool] | None = None,
               trace: Callable[[dict], None] | None = None, scope: str = "", **options) -> Stream:
        """Generate, yielding one Event per token; `.stats` is set once the stream ends.

        prompt: text (special tokens such as <|im_start|> are recognised) or token ids.
        options: max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, frequency_penalty,
        presence_penalty, penalty_last_n, seed, drafter ('auto', 'model', 'ngram', 'hybrid', 'none'), accept
        ('rejection', 'greedy', 'threshold'), k, p_min, threshold, stop; at most one constraint on the
        output: json_schema (a dict or JSON text), grammar (Lark or llama.cpp GBNF), regex, json_object=True;
        prediction (text or token ids the output is expected to resemble: drafted from, never trusted);
        span (a thinking.Span: the output opens, or starts inside, a reasoning model's thinking span; a
        constraint then holds for the answer after it, and the span's budget forces its end);
        logprobs=N (0..20: each Event's logprob and top_logprobs); history=False (where the engine keeps a
        history, history_mb: neither draft from it nor add this output to it); prompt_cache=False (where the
        engine keeps prompt states: neither restore this prompt from one nor keep its own).
        cancel: a callable checked between prefill chunks and rounds; when it returns True the stream ends
        with finish_reason 'cancelled'.
        trace: a callable given one dict per round (trace_row): what was drafted and accepted, how long it took,
        and with drafter='auto' what it chose and expected of the round.
        scope: whose history this request drafts from and adds to, and whose cached prompts it may reuse (the
        server passes one per API key): one scope's outputs never draft another's, its prompts never make
        another's prefill shorter.
        """
        for name, f in (("cancel", cancel), ("trace", trace)):
            if f is not None and not callable(f):
                raise RequestError(f"{name} must be a callable (or None), got {type(f).__name__}")
        if self._closing.is_set():
            raise ModelError(f"{self.name} is closed: load the models again to generate")
        halt, closing, asked = threading.Event(), self._closing.is_set, cancel
        stopped = lambda: halt.is_set() or closing()  # noqa: E731 - Stream.close() or Engine.close()
        cancel = (lambda: asked() or stopped()) if asked is not None else stopped  # noqa: E731
        req = make_request(**(self.defaults | {k: v for k, v in options.items() if v is not None}))
        tokens = self._prompt_tokens(prompt)
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        notes: list[str] = []
        spec = req.constraint()
        grammar = Grammar(self.target, spec) if spec is not None else None
        if req.span is not None:  # the constraint holds after the span; statistics are kept per span
            grammar = Thinking(self.target, req.span, grammar)
        name, drafter, prefill_draft = self._drafter(req, seed, tokens, notes, grammar, scope)
        k = req.k or (defaults.K_FIXED if name != "auto" else
                      defaults.K_PREDICTION if req.prediction is not None else defaults.K_AUTO)
        if k > self.target.n_batch - 1:  # [pending, d1..dk] must fit one decode
            notes.append(f"k={k} is more than one decode holds: clamped to {self.target.n_batch - 1} "
                         f"(n_batch={self.target.n_batch})")
            k = self.target.n_batch - 1
        uses_draft = name in ("model", "hybrid", "auto")
        cache = self.prompt_cache if req.prompt_cache else None

        def run(target, draft, drafter=drafter, lock=self._lock):
            return speculate(target, draft if uses_draft else None, drafter, tokens, max_tokens=req.max_tokens, k=k,
                             rule=req.accept, params=req.sampling, seed=seed, tau=req.threshold,
                             prefill_draft=prefill_draft, lock=lock, cancel=cancel,
                             grammar=grammar or Unconstrained(), top_logprobs=req.logprobs)

        if self._batcher is None:
            facts = self._scoped(run(self.target, self.draft), scope, cache)
        else:  # in a slot, once the stream starts; its drafter is made again for the slot's sequences
            facts = self._in_slot(tokens, cancel, lambda t, d: run(
                t, d, self._drafter(req, seed, tokens, [], grammar, scope, t, d)[1], self._batcher), scope, cache)
        if self.history is not None and req.history:
            facts = _recorded(facts, self.history, scope, tokens)
        return Stream(facts, self.target.piece, stop=req.stop, drafter=name, rule=req.accept, k=k,
                      prompt_tokens=len(tokens), seed=seed, notes=notes, trace=trace, halt=halt, stopped=stopped)

    def _in_slot(self, prompt: list[int], cancel, run, scope: str = "", cache: PrefixCache | None = None):
        """run(target sequence, draft sequence)'s facts, in a free slot (of the slots last used by the same
        scope, the one caching most of the prompt), given back when the stream ends. A slot another scope used
        is emptied first, and a sequence borrows cells only from its own scope's (Seq._borrow): one API key's
        prompts never make another's faster, as with history."""
        me = threading.get_ident()
        with self._slots:
            self._waiting += 1
            try:
                while not self._free and not cancel():
                    if sum(t == me for t in self._held.values()) == self.parallel:
                        raise RequestError(f"all {self.parallel} parallel slots are held by streams this thread "
                                           "has open: read one to its end or close it first (or load with a larger "
                                           "parallel)")
                    self._slots.wait(0.1)
            finally:
                self._waiting -= 1
            slot = None
            if self._free:
                seqs = self.target.seqs
                slot = max(self._free, key=lambda s: (seqs[s].scope == scope, seqs[s].cached_prefix(prompt)))
                self._free.remove(slot)
                self._held[slot] = me
        if slot is None:  # cancelled while waiting (yielded outside the lock: the consumer may never resume)
            yield Finish("cancelled")
            return
        try:
            self._claim(slot, scope, cache)
            try:
                with self._batcher.holding(slot):
                    yield from run(self.target.seqs[slot], self.draft.seqs[slot] if self.draft is not None else None)
            finally:
                self._keep(slot, cache)
        finally:
            with self._slots:
                del self._held[slot]
                self._free.append(slot)
                self._slots.notify()

    def _scoped(self, facts, scope: str, cache: PrefixCache | None = None):
        """facts, in the one sequence all streams take turns in (parallel 1), claimed for scope first."""
        with self._lock:
            self._claim(0, scope, cache)
        try:
            yield from facts
        finally:
            with self._lock:
                self._keep(0, cache)

    def _claim(self, slot: int, scope: str, cache: PrefixCache | None = None) -> None:
        """Empty a sequence's cache (both models') that another scope used last: one scope's prompts never make
        another's prefill shorter (streams of two scopes interleaved in one sequence still reuse each other's
        common head while both run; the server runs one at a time there). The request's prompt cache (None: it
        asked for none) is what its sequences restore from."""
        for m in (self.target, self.draft):
            if m is not None:
                seq = m.seqs[slot]
                if seq.scope != scope:
                    seq.truncate(0)
                    seq.scope = scope
                seq.prompt_cache = cache

    def _keep(self, slot: int, cache: PrefixCache | None) -> None:
        """Keep what a request's sequences hold (its prompt and output) in the prompt cache, as it ends (a cache
        is a speed-up: never a reason for a request to fail)."""
        if cache is None or self._closing.is_set():
            return
        for m in (self.target, self.draft):
            if m is not None:
                try:
                    cache.keep(m.seqs[slot])
                except Exception as e:  # noqa: BLE001
                    print(f"localspec: the prompt's state was not kept ({e})", file=sys.stderr)

    def generate(self, prompt: str | Sequence[int], **options) -> Result:
        """Generate to the end and return the text, tokens, from_draft flags, finish_reason and stats."""
        s = self.stream(prompt, **options)
        events = list(s)
        return Result("".join(e.text for e in events), [e.token for e in events], [e.from_draft for e in events],
                      s.finish_reason, s.stats,
                      [(e.logprob, e.top_logprobs) for e in events] if options.get("logprobs") is not None else None)

    def close(self) -> None:
        """Free both models (after the round or prefill chunk in progress, if another thread is generating: its
        stream ends 'cancelled'). A closed engine, and a stream still open on it, raise ModelError instead of
        touching freed memory."""
        self._closing.set()
        try:
            with self._quiet():
                for m in (self.target, self.draft):
                    if m is not None:
                        m.close()
            if self._batcher is not None:
                self._batcher.close()
        finally:
            if self.history is not None:  # after the round in progress: its output is recorded by then
                self.history.save()
            if self.prompt_cache is not None:  # its writes to disk, finished
                self.prompt_cache.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _recorded(facts, history: History, scope: str, prompt: list[int]):
    """The loop's facts, passed on; the tokens emitted are added to the history once the stream ends (also when
    its consumer stops early: what was emitted is text the model wrote)."""
    out = []
    try:
        for f in facts:
            if type(f) is Token:
                out.append(f.token)
            yield f
    finally:
        facts.close()
        try:
            history.record(scope, prompt, out)
        except Exception as e:  # noqa: BLE001 - a history is a speed-up: never a reason for a request to fail
            print(f"localspec: the output was not added to the history ({e})", file=sys.stderr)
