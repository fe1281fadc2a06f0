"""Constrained output: JSON Schema, grammars (Lark or llama.cpp GBNF) and regexes, through llguidance.

A `Grammar` is an llguidance matcher beside the context: its state is that of the tokens emitted so far. Each
round it masks the target's logit rows (row i with the state after draft[:i], tokens it forbids get -inf,
so every sampling rule works on the constrained distribution unchanged) and then advances by what was
emitted. Drafters ask it what it forces and cut their drafts to what it allows (drafters.GrammarDrafter), so
a forbidden token never reaches the target. `Unconstrained` is the same interface doing nothing.
"""
from __future__ import annotations

import functools
import hashlib
import json
import threading
from typing import Sequence

import numpy as np

from .acceptance import Lazy
from .errors import LocalspecError

# JSON on one line with a space after each ':' and ',' (as Python's json.dumps writes it), no other whitespace:
# the grammar then forces the keys, quotes and punctuation, which become drafts. Not the tightest form,
# '{"a":1,"b":2}': models write '": "' and ', "' as tokens of their own, and forced into the tightest form a
# model's choices drift (Qwen2.5-Coder 1.5B on the shipped structured prompts: an empty list where three
# people were named, a function's return type of '":["', a leading space in values; with the spaces its
# answers carry the same data as with free whitespace on 7 of 8 prompts, and ~20% fewer tokens). A schema
# opts out with "x-guidance": {"whitespace_flexible": true} (llguidance applies these defaults, then the
# schema's own x-guidance).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A schema, grammar or regex longer than 1 MiB is refused before compiling it (the grammar of 128 tools with
# 1 KB of parameters each is 350 KB). Compiling near that size can take seconds (16,000 pattern properties,
# 1 MB: 8 s): the server does it off its event loop, once per process for each text (below).
MAX_SPEC_CHARS = 1 << 20
CACHED_CHARS = 256 << 10  # texts up to this size keep their compiled grammar (an app resends its schema)
# llguidance recurses through a grammar when it compiles it (validate_grammar) and again when it builds a matcher
# from it: a few frames deeper for each rule a rule refers to, each object or array a schema nests or refers to,
# each group in a Lark rule. A chain of 1,000 objects (75 KB of schema) or 2,700 Lark rules overflowed an 8 MB
# thread stack: SIGSEGV, the whole process gone. So those calls run on a thread of their own with STACK bytes of
# stack (address space; only the depth used is touched, and it is freed with the thread), and a constraint with
# over MAX_UNITS '{', '[', '(' and line breaks (each object, array, group and Lark rule has one: a bound on that
# depth, however they are chained) is refused before llguidance sees it. Measured, one unit costs up to 4.1 KB
# (a chain of "items" $refs; a Lark rule 3.1 KB, a group 1.8 KB): MAX_UNITS of them take 205 MB, 40% of STACK
# (which held 172,000 chained Lark rules; 13,800 rules of 20 groups each, 290,000 units, overflowed it). Real
# constraints are far below: 300 $defs in 200 KB of schema are 5,700 units, a tool's 50 KB of parameters 1,000.
# The per-token calls (masks, consume, rollback, validate, forced tokens) do not recurse with this depth (run on
# a 1 MiB stack for grammars 20,000 deep): they stay on the caller's thread.
STACK = 512 << 20
MAX_UNITS = 50_000


class GrammarError(LocalspecError):
    """A schema, grammar or regex is invalid or too large (llguidance's own message says where)."""


def _limits():
    from llguidance import LLParserLimits

    # llguidance's limits bound compile time and memory; these are its defaults made explicit, and the grammar
    # size halved: a schema that compiles past them is refused with its message, never left to eat memory.
    return LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                          step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=250_000)


def compile_spec(*, json_schema=None, grammar: str | None = None, regex: str | None = None,
                 json_object: bool = False) -> str | None:
    """The llguidance grammar of a request's constraint, or None without one. GrammarError names the field."""
    given = [name for name, v in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex),
                                  ("json_object", json_object or None)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"give one constraint, not {' and '.join(given)}")
    field = given[0]
    if field == "json_schema":
        if isinstance(json_schema, str):
            _size(field, json_schema)
            try:
                json_schema = json.loads(json_schema)
            except (ValueError, RecursionError) as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(json_schema, dict):
            raise GrammarError("json_schema must be a JSON object (a schema)")
        try:
            text = json.dumps(json_schema)  # key order kept: it is the order of the output's keys
        except (ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"json_schema is not JSON: {e}") from None
    elif field == "json_object":
        text = '{"type": "object"}'
    else:
        text = grammar if field == "grammar" else regex
        if not isinstance(text, str) or not (text.strip() if field == "grammar" else text):
            raise GrammarError("grammar must be non-empty Lark or GBNF text" if field == "grammar" else
                               "regex must be a non-empty string")
    _size(field, text)
    return _cached(field, text) if len(text) <= CACHED_CHARS else _compiled(field, text)


def _compiled(field: str, text: str) -> str:
    """The checked llguidance grammar of one constraint's text."""
    return _deep(_compile, field, text)


def _compile(field: str, text: str) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # these only wrap the text (a schema nests at most 128 levels in llguidance's JSON parser)
        if field in ("json_schema", "json_object"):
            g = LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_DEFAULTS)
        elif field == "grammar":
            g = LLMatcher.grammar_from_lark(any_to_lark(text))
        else:
            g = LLMatcher.grammar_from_regex(text)
    except Exception as e:  # llguidance's converters raise ValueError and friends on malformed input
        raise GrammarError(f"{field} is invalid: {_one_line(e)}") from None
    _bound(field, g)
    error = LLMatcher.validate_grammar(g, limits=_limits())
    if error:
        raise GrammarError(f"{field} is invalid: {_one_line(error)}")
    return g


def _bound(field: str, g: str) -> None:
    """GrammarError when llguidance's grammar `g` might nest deeper than STACK holds (see MAX_UNITS)."""
    units = g.count("{") + g.count("[") + g.count("(") + g.count("\n")
    if units > MAX_UNITS:
        raise GrammarError(f"{field} has {units:,} objects, arrays, groups and lines ('{{', '[', '(' and line "
                           f"breaks); at most {MAX_UNITS:,} are accepted, as llguidance's compiler recurses through "
                           "them: send a smaller one")


_stack_size = threading.Lock()  # threading.stack_size is one setting for the process


def _deep(fn, *args):
    """fn(*args) on a new thread with STACK bytes of stack; its result or its exception."""
    out: list = []

    def run():
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller, raised there
            out.append((False, e))

    with _stack_size:  # another thread started meanwhile (not through here) gets this stack too: address space
        before = threading.stack_size(STACK)
        try:
            thread = threading.Thread(target=run, name="llguidance-compile", daemon=True)
            thread.start()
        except RuntimeError as e:  # the address space is capped (ulimit -v) or memory is not overcommitted
            raise GrammarError(f"no thread with {STACK >> 20} MiB of stack could be started to compile the "
                               f"constraint ({e}): allow the process more address space") from None
        finally:
            threading.stack_size(before)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


# compiled once per process (at most 32 x 256 KiB of text and their grammars kept): a request's options are
# checked where it arrives and again where it runs, and an app tends to send the same schema each time
_cached = functools.lru_cache(maxsize=32)(_compiled)


def _size(field: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(f"{field} is {len(text):,} characters; at most {MAX_SPEC_CHARS:,} are accepted")


def _one_line(e) -> str:
    return " ".join(str(e).split())[:500]


def tokenizer(model):
    """llguidance's tokenizer for a model's llama.cpp vocabulary, built once per model (about a second)."""
    tok = getattr(model, "_llg_tokenizer", None)
    if tok is None:
        import warnings

        from llguidance.llamacpp import lltokenizer_from_vocab

        eog = [i for i in range(model.n_vocab) if model.is_eog(i)]  # every token that ends generation
        with warnings.catch_warnings():  # it reads token attributes through a name llama-cpp-python deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            tok = lltokenizer_from_vocab(model.vocab, n_vocab=model.n_vocab, eos_token=eog or None)
        model._llg_tokenizer = tok
    return tok


def first_bytes(model) -> np.ndarray:
    """Each token's first byte (-1 for none), built on first use, kept on the model."""
    fb = getattr(model, "_first_bytes", None)
    if fb is None:
        fb = np.fromiter((p[0] if p else -1 for p in model.pieces()), dtype=np.int16, count=model.n_vocab)
        model._first_bytes = fb
    return fb


class Unconstrained:
    """No constraint: rows pass through, nothing to advance."""

    span = ""  # no thinking span (thinking.Thinking names the one each round starts in)

    def rows(self, rows, draft: Sequence[int]):
        return rows

    def advance(self, emitted: Sequence[int], draft: Sequence[int]) -> bool:
        return False


def _matcher(model, grammar: str):
    """The model's llguidance tokenizer and a matcher of `grammar` over it."""
    from llguidance import LLMatcher

    with model.in_use():  # llguidance tokenizes through the llama.cpp vocabulary: not freed meanwhile
        tok = tokenizer(model)
        return tok, LLMatcher(tok, grammar, log_level=0, limits=_limits())


class Masked:
    """The loop's half of a constraint: each verified row masked by the state after the draft tokens before it,
    then the state moved to what was emitted. A subclass keeps the state (consume, rollback, first_end), says
    what it allows next (allowed: a boolean row, or None for anything), which tokens end the output (ends) and
    whether nothing but the end may follow (done)."""

    _ahead = 0  # draft tokens consumed beyond the emitted ones (while rows are being masked)

    def mask(self, row: np.ndarray) -> np.ndarray:
        """A copy of a logit row with the tokens the constraint forbids at -inf (ids past its vocabulary too)."""
        allowed = self.allowed()
        if allowed is None:
            return row
        out = np.full(row.shape, -np.inf, dtype=row.dtype)
        n = min(len(row), len(allowed))
        np.copyto(out[:n], row[:n], where=allowed[:n])
        return out

    def _at(self, i: int, draft: Sequence[int]) -> bool:
        """Put the state after draft[:i] (from the emitted tokens); True when that is past an end-of-generation
        token, where nothing follows."""
        k = min(i, self.first_end(draft))
        if k < self._ahead:
            self.rollback(self._ahead - k)
        else:
            self.consume(draft[self._ahead:k])
        self._ahead = k
        return k < i

    def _row(self, row: np.ndarray, i: int, draft: Sequence[int]) -> np.ndarray:
        if self._at(i, draft):  # after the end: a well-defined row that is never emitted from
            out = np.full(row.shape, -np.inf, dtype=row.dtype)
            out[self.ends()] = 0.0
            return out
        return self.mask(row)

    def rows(self, rows, draft: Sequence[int]):
        """The verified rows, row i masked by the state after draft[:i]; computed when first read."""
        return Lazy(len(draft) + 1, lambda i: self._row(rows[i], i, draft))

    def advance(self, emitted: Sequence[int], draft: Sequence[int]) -> bool:
        """Move to the state after `emitted` (the accepted draft and the next token, without an end token);
        True once the constraint is complete and nothing but the end can follow."""
        n = next((i for i, (a, b) in enumerate(zip(emitted, draft)) if a != b), min(len(emitted), len(draft)))
        self._at(min(n, self._ahead), draft)
        self.consume(list(emitted[self._ahead:]))
        self._ahead = 0
        return self.done()


class Grammar(Masked):
    """An llguidance matcher whose state follows the emitted tokens; row masks for each verified position."""

    span = ""
    copying = True  # structured output: auto prices drafts as values copied from the prompt (auto.ngram_stats)

    def __init__(self, model, grammar: str):
        self.model, self.n_vocab = model, model.n_vocab
        _bound("the constraint", grammar)  # compile_spec's output has been bounded: a grammar from elsewhere
        self.tok, self.matcher = _deep(_matcher, model, grammar)  # it compiles the grammar again (see STACK)
        self.eog = frozenset(self.tok.eos_tokens)
        self._check()
        self._spelled: dict[tuple, bool] = {}  # _spelled_so's answers

    def _check(self) -> None:
        if self.matcher.is_error():  # its first line says what (a dump of the parser's state follows)
            raise GrammarError(f"the constraint failed: {_one_line(self.matcher.get_error().split(chr(10))[0])}; "
                               "a simpler schema, grammar or regex may stay within llguidance's limits")

    # -- for drafters --
    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (keys, quotes, punctuation)."""
        forced = list(self.matcher.compute_ff_tokens())
        return forced[:self.first_end(forced)]

    def spelled(self, forced: Sequence[int]) -> list[int]:
        """The token that spells the rest of the forced bytes past `forced` (empty when none), a guess.

        llguidance's forced tokens stop where the forced bytes could still end inside a longer token: after a
        key the bytes '": "' are forced but only the token '":', since ' "' might open a token that runs on
        into the value. The tokenizer's own spelling of those bytes ends in a token the model may or may not
        write (' "' before a value, yes; '"}' where it writes '"},', no). It is offered only where the tokenizer
        itself would write it before some byte the grammar allows next: ' [' opening an array of objects is
        always merged into ' [{"' (or ' []'), ' ' before true or false into ' true' and ' false', and a
        model writes its tokenizer's spelling (in the plain outputs of 16 extraction prompts, the guesses this
        leaves out held once in 127, those it keeps 985 times in 1012)."""
        text = bytes(self.matcher.compute_ff_bytes())
        spelled = self.tok.tokenize_bytes(text)
        if len(spelled) <= len(forced) or spelled[:len(forced)] != forced:
            return []
        ok = min(self.validate(spelled), self.first_end(spelled))
        guess = spelled[len(forced):ok][:1]
        return guess if guess and self._spelled_so(text, [*forced, *guess]) else []

    def _spelled_so(self, text: bytes, tokens: list[int]) -> bool:
        """Whether the tokenizer begins `text`, followed by some byte the grammar allows after `tokens`, with
        `tokens`. Remembered per grammar state (records in a JSON array ask the same at every key)."""
        self.consume(tokens)
        try:
            if self.matcher.is_stopped():  # nothing follows
                return True
            bits = self.matcher.compute_bitmask()
        finally:
            self.rollback(len(tokens))
        key = (text, tuple(tokens), hashlib.blake2b(bits, digest_size=16).digest())
        if key not in self._spelled:
            if len(self._spelled) >= 256:
                self._spelled.clear()
            self._spelled[key] = self._spelled_before_any(text, tokens, self.allowed(bits))
        return self._spelled[key]

    def _spelled_before_any(self, text: bytes, tokens: list[int], allowed: np.ndarray) -> bool:
        """_spelled_so's answer, worked out: `allowed` holds the tokens the grammar allows after `tokens`."""
        allowed[list(self.eog)] = False
        if not allowed.any():  # only the end follows
            return True
        firsts = first_bytes(self.model)
        nexts = np.zeros(257, dtype=bool)
        nexts[firsts[allowed[:len(firsts)]] + 1] = True  # index 0: tokens with no bytes
        n = len(tokens)
        return any(self.tok.tokenize_bytes(text + bytes([b]))[:n] == tokens for b in np.flatnonzero(nexts[1:]))

    def first_end(self, tokens: Sequence[int]) -> int:
        """Where the first end-of-generation token is (len when none): the matcher never consumes the end."""
        return next((j for j, t in enumerate(tokens) if t in self.eog), len(tokens))

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar allows from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def consume(self, tokens: Sequence[int]) -> None:
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            self._check()
            raise GrammarError("the grammar refused a token it had allowed")  # pragma: no cover - a bug

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def allowed(self, bits: bytes | None = None) -> np.ndarray:
        """A boolean row: which tokens the grammar allows next (from the matcher's bitmask, or `bits`)."""
        bits = np.frombuffer(self.matcher.compute_bitmask() if bits is None else bits, dtype=np.uint8)
        self._check()  # past a limit (too many lexer states) its mask allows only the end: not a finished output
        allowed = np.unpackbits(bits, bitorder="little", count=self.n_vocab).view(bool)
        if not allowed.any():
            self._check()
            raise GrammarError("the grammar allows no token here")
        return allowed

    def ends(self) -> list[int]:
        return sorted(self.eog)

    def done(self) -> bool:
        return self.matcher.is_stopped()
