"""One llama.cpp model and its context, on llama-cpp-python's low-level API.

A `Model` owns a llama_model, a llama_context (its own KV cache) and one reusable llama_batch. Its cache holds
one sequence (`Seq`) per concurrent request (one unless ModelConfig.n_seq says more), each with the exact
token list it holds (positions 0..len-1) and the three operations speculative decoding needs: `decode` a run
of tokens asking logits only for chosen rows, `truncate` back to a prefix (llama_memory_seq_rm), and `sync`
to a new prompt reusing the common prefix. The model's own `tokens`, `decode`, ... are sequence 0's. Logit
rows of a sequence decoding alone are zero-copy numpy views of llama.cpp's output buffer, valid until the
next decode of the same model.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading
import time
from pathlib import Path
from typing import Sequence

import llama_cpp as L
import numpy as np

from .llama import (FLASH_ATTN, KV_TYPES, PREFILL_CHUNK, Cancelled, ContextFullError, DecodeError,  # noqa: F401
                    ModelConfig, ModelError, _fields, _in_use, _interrupt_after, _last_log, _recent_log, _Users,
                    default_threads, exact_matmuls, note_context, resolve_flash_attn, set_verbose, tiled_matmul_setting)


class Model:
    """A llama.cpp model with its own context and KV cache (sequence 0), from a GGUF file the caller has checked
    (store.registry.check_gguf). Where this llama.cpp build's AMX kernels crash, the caller must pass
    use_extra_bufts=False in cfg.kwargs (store.machine.amx_safe finds out and sets it; load() does so)."""

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig = ModelConfig(), *, vocab_only: bool = False):
        self.path = Path(path).expanduser()
        self.cfg = cfg
        self.seqs: list[Seq] = []
        self.batcher = None  # with concurrent requests, the engine's batch.Batcher: decodes join others'
        self._ctx_lock = threading.Lock()  # llama.cpp's context is used by one thread at a time
        self.decode_s = 0.0  # total time inside llama_decode: profiles read it to find Python overhead
        self._model = self._ctx = self._batch = None
        self._use = _Users()  # the threads reading the vocabulary: close() waits for them
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = cfg.n_gpu_layers
        mp.vocab_only = vocab_only
        if cfg.exact:
            mp.use_extra_bufts = False  # no CPU weight repacking: batched logits == single-token logits
        cp = L.llama_context_default_params()
        threads = cfg.n_threads or default_threads()
        # Concurrent requests (n_seq > 1) each get a sequence of n_ctx positions, plus sequence 0 for the
        # model's own use (calibration). One unified cache of n_seq * n_ctx cells: llama.cpp splits a batch over
        # per-sequence caches into equal-width pieces, which would break a verify of k tokens beside others' 1.
        cp.n_ctx = cfg.n_ctx * cfg.n_seq
        cp.n_batch = cp.n_ubatch = min(cfg.n_ctx, 512)
        if cfg.n_seq > 1:
            cp.n_seq_max, cp.kv_unified = cfg.n_seq + 1, True
        if cfg.exact:
            # CPU matmuls switch kernels at 64-row batches: smaller physical batches keep a prompt prefilled in
            # one go bit-identical to the same tokens decoded a few at a time (multi-turn chat, prefix reuse).
            cp.n_ubatch = 32
        cp.n_threads = cp.n_threads_batch = self.n_threads = threads
        self.flash_attn = resolve_flash_attn(cfg)
        cp.flash_attn_type = FLASH_ATTN[self.flash_attn]
        cp.type_k, cp.type_v = KV_TYPES[cfg.type_k], KV_TYPES[cfg.type_v]
        cp.no_perf = True
        for key, value in cfg.kwargs.items():
            setattr(mp if key in _fields(L.llama_model_params) else cp, key, value)
        self.extra_bufts = bool(mp.use_extra_bufts)  # llama.cpp's extra weight layouts (AMX, CPU repacking)

        _recent_log.clear()
        with _interrupt_after(self.close) as hit:
            # a Ctrl-C stops the load at its next step (a large model from a slow disk takes a while)
            mp.progress_callback = stop = L.llama_progress_callback(lambda progress, data: not hit)  # noqa: F841
            self._model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise ModelError(f"llama.cpp could not load {self.path}: the file may be missing, not GGUF, truncated or "
                             f"corrupt, or its architecture unsupported by this llama.cpp{_last_log()}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self._piece_tls = threading.local()  # a piece buffer per thread: the server's event loop reads pieces too
        self._pieces: list[bytes] | None = None
        self._spellings: re.Pattern | bool | None = None
        if vocab_only:
            return
        if L.llama_model_is_recurrent(self._model) or L.llama_model_is_hybrid(self._model):
            self.close()
            raise ModelError(f"{self.path.name} is a recurrent or hybrid model (Mamba, RWKV, ...): its state cannot "
                             "be rolled back to an earlier position, which speculative decoding needs; "
                             "use a transformer model")
        note_context()
        with _interrupt_after(self.close):
            self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            quantized = cfg.type_k != "f16" or cfg.type_v != "f16"
            if cfg.type_v != "f16" and cp.flash_attn_type == L.LLAMA_FLASH_ATTN_TYPE_DISABLED:
                fix = f"a quantized V cache ({cfg.type_v}) needs flash attention: --flash-attn on, or type_v f16"
            else:
                fix = "try a smaller n_ctx" + ("" if quantized else " or a quantized KV cache (type_k/type_v q8_0)")
            raise ModelError(f"llama.cpp could not create a context for {self.path.name} with n_ctx={cfg.n_ctx}"
                             f"{_last_log()}; {fix}")
        self._mem = L.llama_get_memory(self._ctx)
        self.n_ctx = L.llama_n_ctx(self._ctx) // cfg.n_seq  # per sequence
        self.n_seq = cfg.n_seq
        self.seqs = [Seq(self, i, self.n_ctx) for i in range(cfg.n_seq + (cfg.n_seq > 1))]
        self.n_batch = L.llama_n_batch(self._ctx)  # as llama.cpp settled it (n_batch in kwargs, its own bounds)
        # One batch for the model's lifetime; numpy views over its arrays make filling it loop-free.
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        self._b_tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))[:] = 1
        self._b_seq = [0] * self.n_batch  # each batch position's sequence id, as set in b.seq_id
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0

    @property
    def vocab(self):
        """The vocabulary's handle; ModelError once the model is closed (it is freed with the model)."""
        if self._model is None:
            raise ModelError(f"{self.path.name} is closed: load it again to use it")
        return self._vocab

    def in_use(self) -> _Users:
        """`with model.in_use():` around anything outside this class that reads the vocabulary (llguidance's
        tokenizer over it): close() waits for it."""
        return self._use

    def check_open(self) -> None:
        """ModelError once the model is closed (before anything reaches for its freed memory)."""
        self.vocab  # noqa: B018

    def _live_ctx(self):
        if self._ctx is None:
            raise ModelError(f"{self.path.name} is closed: load it again to use it")
        return self._ctx

    # ---- tokens and text ----
    @_in_use
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text -> tokens; special tokens such as <|im_start|> are recognised, so rendered prompts work."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            buf = (L.llama_token * -n)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def _piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (control tokens render as b'' unless special)."""
        buf = getattr(self._piece_tls, "buf", None)
        if buf is None:
            buf = self._piece_tls.buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = self._piece_tls.buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    piece = _in_use(_piece)

    @_in_use
    def pieces(self) -> list[bytes]:
        """Every token's bytes, in id order (control tokens as b''): read once (~0.5 s for 150k tokens) and
        kept, for the tables built from the whole vocabulary (token kinds, first bytes)."""
        if self._pieces is None:
            self._pieces = [self._piece(t) for t in range(self.n_vocab)]
        return self._pieces

    @_in_use
    def control_spellings(self) -> re.Pattern | None:
        """What spells a control token in text ('<|im_start|>'): what tokenizing with special tokens parsed
        turns into one (llama.cpp matches control and unknown tokens by their text, longest first), or None
        when the vocabulary has none. Built on first use, kept."""
        if self._spellings is None:
            vocab = self.vocab
            texts = {(L.llama_vocab_get_text(vocab, t) or b"").decode("utf-8", "replace") for t in range(self.n_vocab)
                     if L.llama_vocab_get_attr(vocab, t) & (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN)}
            texts.discard("")
            self._spellings = re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) \
                if texts else False
        return self._spellings or None

    @_in_use
    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self._piece(t) for t in tokens).decode("utf-8", errors="replace")

    @property
    @_in_use
    def bos(self) -> int:
        return L.llama_vocab_bos(self.vocab)

    @property
    @_in_use
    def eos(self) -> int:
        return L.llama_vocab_eos(self.vocab)

    @_in_use
    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    @_in_use
    def token_text(self, token: int) -> bytes:
        return L.llama_vocab_get_text(self.vocab, token) or b""

    @_in_use
    def chat_template(self) -> str | None:
        self.vocab  # noqa: B018 - refuses a closed model
        t = L.llama_model_chat_template(self._model, None)
        return t.decode("utf-8") if t else None

    # ---- the KV cache: sequence 0's, for what uses one model alone (calibration, probes, tests) ----
    @property
    def tokens(self) -> list[int]:
        return self.seqs[0].tokens

    @property
    def version(self) -> int:
        return self.seqs[0].version

    def decode(self, tokens: Sequence[int], *, logits: str = "last") -> np.ndarray | None:
        return self.seqs[0].decode(tokens, logits=logits)

    def truncate(self, n: int) -> None:
        self.seqs[0].truncate(n)

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        return self.seqs[0].cached_prefix(tokens)

    def sync(self, tokens: Sequence[int], *, logits: bool = False, cancel=None) -> tuple[int, np.ndarray | None]:
        return self.seqs[0].sync(tokens, logits=logits, cancel=cancel)

    def pos_max(self) -> int:
        return self.seqs[0].pos_max()

    @property
    def last_restore(self) -> tuple[int, str]:
        return self.seqs[0].last_restore

    def _run_jobs(self, jobs) -> None:
        """One llama_decode of several sequences' tokens (batch.Job: each sequence at most once, n_batch in all);
        each job gets its rows, copied out of llama.cpp's buffer unless it is alone."""
        ctx = self._live_ctx()
        if len(self.seqs) > 1 and any(j.prefill for j in jobs):
            with self._ctx_lock:  # a prefill chunk whose head another request prefilled since it was asked for
                # (requests that arrive together with one system prompt) borrows it now: computed once
                for job in jobs:
                    if job.prefill and job.logits != "all":
                        keep = job.logits == "last"  # the row asked for is computed, not borrowed
                        n = job.seq._share(job.seq.tokens + list(job.tokens[:len(job.tokens) - keep]))
                        job.tokens = job.tokens[n:]
        at = 0
        for job in jobs:
            m, p0 = len(job.tokens), len(job.seq.tokens)
            self._b_tok[at:at + m] = job.tokens
            self._b_pos[at:at + m] = np.arange(p0, p0 + m)
            self._b_logits[at:at + m] = 1 if job.logits == "all" else 0
            if job.logits == "last":
                self._b_logits[at + m - 1] = 1
            for i in range(at, at + m):
                if self._b_seq[i] != job.seq.id:
                    self._batch.seq_id[i][0] = self._b_seq[i] = job.seq.id
            at += m
        self._batch.n_tokens = at
        t = time.perf_counter()
        with self._ctx_lock:
            rc = L.llama_decode(ctx, self._batch) if at else 0
        self.decode_s += time.perf_counter() - t
        if rc != 0:
            for job in jobs:
                job.seq.truncate(len(job.seq.tokens))  # drop whatever a failed decode may have left
            if rc == 1:
                raise ContextFullError(f"no KV cache slot for {at} tokens (n_ctx={self.n_ctx} per sequence)")
            raise DecodeError(f"llama_decode failed with code {rc}{_last_log()}")
        out = np.ctypeslib.as_array(L.llama_get_logits(self._ctx), shape=(at, self.n_vocab)) if at else None
        row = 0
        for job in jobs:
            job.seq.tokens.extend(job.tokens)
            job.seq.version += 1
            n = 0 if job.logits == "none" else len(job.tokens) if job.logits == "all" else 1
            job.rows = None if n == 0 else out[row:row + n] if len(jobs) == 1 and self.batcher is None \
                else np.array(out[row:row + n])
            row += n

    def close(self) -> None:
        """Free the model, once no other thread is inside a vocabulary call (the engine's lock covers its rounds;
        this covers a consumer reading token pieces). Each handle is forgotten before it is freed, so a check
        that passes sees a live one."""
        with self._use.alone():
            self._llg_tokenizer = None  # grammar.py's tokenizer over this vocabulary
            batch, self._batch = self._batch, None
            if batch is not None:
                L.llama_batch_free(batch)
            ctx, self._ctx = self._ctx, None
            if ctx:
                L.llama_free(ctx)
            model, self._model = self._model, None
            if model:
                L.llama_model_free(model)

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass


class Seq:
    """One sequence of a Model's KV cache: the exact token list it holds (positions 0..len-1) and the three
    operations speculative decoding needs: `decode` a run of tokens asking logits only for chosen rows,
    `truncate` back to a prefix (llama_memory_seq_rm), and `sync` to a new prompt reusing the common prefix.
    Of its model it offers n_vocab, is_eog and check_open (what the loop and a drafter read); everything else (the
    vocabulary, n_batch, ...) is seq.model's. With concurrent requests (ModelConfig.n_seq) each request decodes
    in its own sequence, and its decodes join the others' in one llama_decode (batch.Batcher)."""

    def __init__(self, model: Model, seq_id: int, n_ctx: int):
        self.model, self.id, self.n_ctx = model, seq_id, n_ctx
        self.tokens: list[int] = []
        self.version = 0  # bumped by every change to the cache: a stream notices another user's changes
        self.borrowed = 0  # tokens whose cells it shares with another sequence (_borrow), in all
        self.scope = ""  # whose requests it holds (an API key's scope): it borrows only from its own scope's
        self.prompt_cache = None  # the engine's prefix.PrefixCache while the request it holds may use it
        self.last_restore: tuple[int, str] = (0, "")  # what the latest sync restored from it: (tokens, tier)
        # of its model, what the loop and a drafter ask of the sequence they decode in
        self.n_vocab, self.is_eog, self.check_open = model.n_vocab, model.is_eog, model.check_open

    def decode(self, tokens: Sequence[int], *, logits: str = "last", prefill: int = 0,
               cancel=None) -> np.ndarray | None:
        """Append tokens to the cache in one llama_decode per n_batch chunk.

        logits: "none", "last" (one row) or "all" (one row per token; needs len(tokens) <= n_batch).
        prefill: where these tokens are part of a prompt's prefill, how many of its tokens are left, these
        included (the batcher runs the shortest prefill first; 0: not a prefill).
        cancel: with a batcher, checked while the decode waits its turn: Cancelled once it returns True.
        Returns a (rows, n_vocab) float32 array: alone, a view of llama.cpp's buffer, valid until the next decode.
        """
        from .batch import Job

        n, model = len(tokens), self.model
        model._live_ctx()
        if n == 0:
            return None
        if len(self.tokens) + n > self.n_ctx:
            raise ContextFullError(f"{len(self.tokens)} + {n} tokens exceed n_ctx={self.n_ctx}")
        if logits == "all" and n > model.n_batch:
            raise ValueError(f"cannot return logits for {n} > n_batch={model.n_batch} tokens")
        rows = None
        for start in range(0, n, model.n_batch):
            chunk = list(tokens[start:start + model.n_batch])
            want = logits if logits != "last" or start + len(chunk) == n else "none"
            if model.batcher is not None:
                rows = model.batcher.decode(self, chunk, want, prefill=max(prefill - start, 0), cancel=cancel)
            else:
                job = Job(self, chunk, want)
                model._run_jobs([job])
                rows = job.rows
        return rows

    def truncate(self, n: int) -> None:
        """Forget every cached position >= n."""
        del self.tokens[n:]  # first: an interrupt between the two steps leaves the cache >= the list, never <
        self.version += 1
        model = self.model
        if model._ctx is None:  # closed: no cache left to roll back
            return
        with model._ctx_lock:
            ok = L.llama_memory_seq_rm(model._mem, self.id, n, -1)
        if not ok:
            raise ModelError(f"llama.cpp refused to roll the KV cache of {model.path.name} back to {n} tokens")

    def clear(self) -> None:
        """Forget the whole sequence: its cells (those it shares with another sequence stay that one's) and its
        token list. What a failed decode leaves is never reused."""
        self.truncate(0)

    def check(self) -> None:
        """Make sure the cells are what the token list says (llama.cpp's last position against the list), and
        empty the sequence where they are not: a request never decodes on top of state it does not know."""
        if self.model._ctx is None:
            return
        last = self.pos_max()
        if last < len(self.tokens) - 1:  # the list claims cells the cache lacks: nothing of it can be trusted
            self.clear()
        elif last >= len(self.tokens):  # cells past the list (an interrupted decode): dropped
            self.truncate(len(self.tokens))

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cache already holds."""
        cached = np.asarray(self.tokens[:len(tokens)], dtype=np.int64)
        differ = np.flatnonzero(cached != np.asarray(tokens[:len(cached)], dtype=np.int64))
        return int(differ[0]) if differ.size else len(cached)

    def sync(self, tokens: Sequence[int], *, logits: bool = False, cancel=None) -> tuple[int, np.ndarray | None]:
        """Make the cache hold exactly `tokens`, reusing the longest common prefix already cached.

        Returns (tokens reused, the last token's logit row when `logits`; that token is re-decoded if needed).
        cancel: checked between chunks of PREFILL_CHUNK tokens; when it returns True, Cancelled is raised and
        the cache holds the chunks done so far (a later sync reuses them).
        """
        head = tokens[:len(tokens) - 1] if logits else tokens  # what may come from a cache: the rest is decoded
        self.check()
        keep = self.cached_prefix(head)
        self.truncate(keep)  # always: also clears positions an interrupted decode left beyond the token list
        self._borrow(head)
        # a kept state holding more of the prompt than this sequence and its neighbours (the prefix store)
        self.last_restore = self.prompt_cache.restore(self, head) if self.prompt_cache is not None else (0, "")
        reused = len(self.tokens)
        rest = tokens[len(self.tokens):]
        if cancel is not None:
            # offloaded to a GPU, whole batches (a GPU wants them big, and gets through them fast); half batches
            # beside other requests, so their rounds fit the same decode rather than wait for the whole prefill
            m = self.model
            chunk = (PREFILL_CHUNK if m.cfg.n_gpu_layers == 0 else
                     max(PREFILL_CHUNK, m.n_batch // (2 if m.batcher is not None else 1)))
            while len(rest) > chunk:
                if cancel():
                    raise Cancelled("cancelled during the prefill")
                self.decode(rest[:chunk], logits="none", prefill=len(rest), cancel=cancel)
                rest = tokens[len(self.tokens):]  # the chunk, less what was borrowed when it ran (_run_jobs)
            if cancel():
                raise Cancelled("cancelled during the prefill")
        # a prompt's prefill (the loop's, which can be cancelled), not a drafter catching its cache up by a token
        prefill = len(rest) if cancel is not None else 0
        row = self.decode(rest, logits="last" if logits else "none", prefill=prefill, cancel=cancel)
        return reused, row

    def state_size(self) -> int:
        """The bytes state() would give now (llama_state_seq_get_size), without copying them."""
        with self.model._ctx_lock:
            return max(int(L.llama_state_seq_get_size(self.model._live_ctx(), self.id)), 0)

    def state(self) -> mmap.mmap | None:
        """A copy of this sequence's KV state (llama_state_seq_get_data: its cells' positions and K/V rows, not
        the tokens), or None where llama.cpp gives none."""
        model = self.model
        with model._ctx_lock:
            ctx = model._live_ctx()
            if (n := L.llama_state_seq_get_size(ctx, self.id)) <= 0:
                return None
            blob = mmap.mmap(-1, n)  # a mapping of its own: the memory goes back to the system once it is dropped
            got = L.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * n).from_buffer(blob), n, self.id)
        return blob if got == n else None

    def set_state(self, blob: bytearray, tokens: Sequence[int]) -> bool:
        """Make this sequence hold a kept state (replacing what it held) whose cells are `tokens`; False, and the
        sequence emptied, where llama.cpp refuses it (another layout: it checks the shape, never the weights,
        which is why the store keys states by the model file and settings)."""
        model = self.model
        with model._ctx_lock:
            ctx = model._live_ctx()
            got = L.llama_state_seq_set_data(ctx, (ctypes.c_uint8 * len(blob)).from_buffer(blob), len(blob), self.id)
            self.version += 1
            if got == len(blob):
                self.tokens[:] = list(tokens)
                return True
            self.tokens.clear()  # a refused state may have emptied the sequence half way
            L.llama_memory_seq_rm(model._mem, self.id, -1, -1)
        return False

    def _borrow(self, tokens: Sequence[int]) -> int:
        """Where another sequence of the model holds more of `tokens` than this one (which holds a prefix of
        them), share its cells for the difference (llama_memory_seq_cp: the unified cache marks them as this
        sequence's too; nothing is computed or copied), as a prompt's common head (a system prompt, tool
        definitions) is prefilled once for requests that arrive together; how many tokens it added. Only
        identical tokens at identical positions are shared: what follows them stays each sequence's own."""
        have = len(self.tokens)
        # a look without the lock first: a round's catch-up rarely finds more elsewhere, and the lock waits out
        # the decode in flight
        if have >= len(tokens) or not any(len(s.tokens) > have and s.tokens[have] == tokens[have]
                                          and s.cached_prefix(tokens) > have for s in self._lenders()):
            return 0
        with self.model._ctx_lock:
            return 0 if self.model._ctx is None else self._share(tokens)

    def _share(self, tokens: Sequence[int]) -> int:
        """_borrow's work, with the model's context lock held: a token list never runs ahead of its cells (a
        decode extends it after, a truncate shortens it before), and under the lock neither changes the cache."""
        have = len(self.tokens)
        src = max(self._lenders(), key=lambda s: s.cached_prefix(tokens), default=None)
        n = src.cached_prefix(tokens) if src is not None else 0
        if n <= have:
            return 0
        L.llama_memory_seq_cp(self.model._mem, src.id, self.id, have, n)
        self.tokens.extend(tokens[have:n])
        self.version += 1
        self.borrowed += n - have
        return n - have

    def _lenders(self) -> list[Seq]:
        return [s for s in self.model.seqs if s is not self and s.scope == self.scope]

    def pos_max(self) -> int:
        """llama.cpp's own view of the last cached position (-1 when empty)."""
        self.model._live_ctx()
        with self.model._ctx_lock:
            return L.llama_memory_seq_pos_max(self.model._mem, self.id)
