"""llama.cpp glue below the Model: errors, its log (silent unless asked, kept for error messages), a Ctrl-C
held while it is inside a long call, the settings one model runs with (ModelConfig) and their checks.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import numbers
import os
import re
import signal
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

import llama_cpp as L

from .errors import LocalspecError


class ModelError(LocalspecError):
    """A model file cannot be used: missing, not GGUF, truncated, unsupported, or a bad setting."""


class DecodeError(LocalspecError):
    """A decode failed mid-generation (llama_decode returned an error): the request ends with it, and the
    sequence it was decoding in is emptied. Its message names what failed, never a Python exception."""


class ContextFullError(DecodeError):
    """The KV cache has no room for the tokens asked to decode."""


class Cancelled(LocalspecError):
    """A caller's cancel() returned True during a long decode (a prefill); the cache holds what was done."""


# A prefill that may be cancelled runs in chunks of this many tokens: about a second each for a 1.5B model
# on two CPU cores, so a client that leaves, or a shutdown, waits at most that long.
PREFILL_CHUNK = 128


# ---- llama.cpp logging: silent unless asked, but the last lines are kept for error messages ----
_recent_log: deque[str] = deque(maxlen=20)
_verbose = False


@L.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    msg = text.decode("utf-8", errors="replace")
    if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR: they explain failed loads
        _recent_log.append(msg.strip())
    if _verbose:
        import sys

        sys.stderr.write(msg)


L.llama_log_set(_log_callback, ctypes.c_void_p(0))
L.llama_backend_init()


@contextlib.contextmanager
def _interrupt_after(cleanup):
    """Hold a Ctrl-C that comes while llama.cpp is inside a long call (loading a model) and raise it, after
    cleanup(), once the call returns: raised in the middle, inside llama.cpp's log callback, ctypes printed a
    traceback, dropped it, and the command went on. Yields a list that is non-empty once one came (a load's
    progress callback reads it to stop early). Only the main thread receives signals; elsewhere this holds
    nothing."""
    hit: list[bool] = []
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield hit
        return
    signal.signal(signal.SIGINT, lambda *_: hit.append(True))
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hit:
        cleanup()
        raise KeyboardInterrupt


def set_verbose(on: bool) -> None:
    """Show llama.cpp's own log output on stderr (off by default)."""
    global _verbose
    _verbose = on


def _last_log() -> str:
    lines = [x for x in _recent_log if x]
    return f" (llama.cpp: {lines[-1]})" if lines else ""


KV_TYPES = {"f32": L.GGML_TYPE_F32, "f16": L.GGML_TYPE_F16, "bf16": 30, "q8_0": L.GGML_TYPE_Q8_0,
            "q4_0": L.GGML_TYPE_Q4_0, "q4_1": L.GGML_TYPE_Q4_1, "q5_0": L.GGML_TYPE_Q5_0,
            "q5_1": L.GGML_TYPE_Q5_1, "iq4_nl": L.GGML_TYPE_IQ4_NL}
FLASH_ATTN = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}
# Pointer and callback fields cannot be set from a Python value: they are not offered as pass-through keys.
_SETTABLE = (ctypes.c_bool, ctypes.c_int, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_size_t)


# ggml's tiled K-quant matmul (batches of 8 rows and more) sums in another order than a single-token decode, so
# exact mode turns it off. ggml reads GGML_CPU_TILED_MM once per process, when it plans its first graph: the
# value it had when this process made its first context is the one in effect.
_first_context_tiled: str | None = None
_made_context = False


def tiled_matmul_setting() -> str:
    """Whether ggml's tiled matmul is on in this process ('1', ggml's default) or off ('0'), as ggml reads
    GGML_CPU_TILED_MM (C's atoi: any value that is not a non-zero number turns it off)."""
    v = _first_context_tiled if _made_context else os.environ.get("GGML_CPU_TILED_MM")
    if v is None:
        return "1"
    m = re.match(r"\s*([+-]?\d+)", v)
    return "1" if m and int(m.group(1)) != 0 else "0"


def note_context() -> None:
    """Called as each context is made: the first one fixes the tiled-matmul setting ggml reads."""
    global _made_context, _first_context_tiled
    if not _made_context:
        _made_context, _first_context_tiled = True, os.environ.get("GGML_CPU_TILED_MM")


def exact_matmuls() -> None:
    """Turn ggml's tiled matmul off for this process where nothing was computed yet and the user has not
    set it (exact mode's probe then finds whether that sufficed)."""
    if not _made_context:
        os.environ.setdefault("GGML_CPU_TILED_MM", "0")


def system_info() -> str:
    """llama.cpp's own account of the backends and CPU features it was built with and uses."""
    return L.llama_print_system_info().decode(errors="replace").strip()


def default_threads() -> int:
    """All cores on small machines; half on large ones, where half are usually SMT siblings or E-cores."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2


# llama.cpp settings that localspec sets from its own options, and others it cannot run with
_OWN = {"n_ctx": "n_ctx (--n-ctx)", "n_threads": "n_threads (--threads)", "n_gpu_layers": "n_gpu_layers (--n-gpu-layers)", "flash_attn_type": "flash_attn (--flash-attn)",
        "type_k": "type_k (--type-k)", "type_v": "type_v (--type-v)"}
_REFUSED = {"vocab_only": "a model loaded for its vocabulary alone cannot generate",
            "no_alloc": "a model without its weights allocated cannot generate",
            "embeddings": "speculation reads the logits, which an embeddings context does not give",
            "n_outputs_max": "a verify needs a logit row for every drafted token",
            "n_outputs_max_per_seq": "a verify needs a logit row for every drafted token",
            "n_seq_max": "its own option sets it: n_seq (--parallel)", "kv_unified": "concurrent requests need one unified cache", "n_samplers": "llama.cpp's own samplers are not used"}


@dataclass(frozen=True)
class ModelConfig:
    """Settings of one model. `kwargs` reach llama_model_params / llama_context_params by field name."""

    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 0
    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"
    exact: bool = False
    # requests decoded together (each its own sequence of n_ctx positions); out of repr, which keys the measurements
    # kept per settings: the costs and exact verdicts of one sequence hold for any number
    n_seq: int = field(default=1, repr=False)
    kwargs: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_threads", "n_gpu_layers", "n_seq"):
            v = getattr(self, name)
            if not (v is None and name == "n_threads") and (isinstance(v, bool) or not isinstance(v, int)):
                raise ModelError(f"{name} must be an integer, got {v!r}")
        if self.n_ctx < 16:
            raise ModelError(f"n_ctx must be at least 16, got {self.n_ctx}")
        if not 1 <= self.n_seq <= 64:
            raise ModelError(f"n_seq (parallel requests) must be 1 to 64, got {self.n_seq}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ModelError(f"n_threads must be at least 1, got {self.n_threads}")
        if self.flash_attn not in FLASH_ATTN:
            raise ModelError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {self.flash_attn!r}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPES:
                raise ModelError(f"{name} must be one of {', '.join(KV_TYPES)}, got {getattr(self, name)!r}")
        model_keys, ctx_keys = _fields(L.llama_model_params), _fields(L.llama_context_params)
        for key, value in self.kwargs.items():
            if key in _OWN:
                raise ModelError(f"llama.cpp setting {key} has its own option here: {_OWN[key]}")
            if key in _REFUSED:
                raise ModelError(f"llama.cpp setting {key} cannot be set here: {_REFUSED[key]}")
            if key not in model_keys and key not in ctx_keys:
                known = {n for struct in (L.llama_model_params, L.llama_context_params) for n, _ in struct._fields_}
                allowed = ", ".join(sorted((model_keys | ctx_keys) - _OWN.keys() - _REFUSED.keys()))
                raise ModelError(f"llama.cpp setting {key} cannot be set here: it holds a pointer or a callback"
                                 if key in known else f"unknown llama.cpp setting {key!r}; allowed: {allowed}")
            ctype = dict((L.llama_model_params if key in model_keys else L.llama_context_params)._fields_)[key]
            if ctype is ctypes.c_float:  # as C holds it: 1e39 would be inf
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(
                    ctypes.c_float(value).value)
            else:  # what C would hold: 1.5 in an int is refused, -1 in an unsigned int would wrap to 4294967295
                try:
                    ok = ctype(value).value == value and (ctype is ctypes.c_bool or not isinstance(value, bool))
                except (TypeError, OverflowError):
                    ok = False
            if not ok:
                raise ModelError(f"llama.cpp setting {key}={value!r} does not fit its C type ({ctype.__name__})")
            if key == "n_batch" and value < 1:  # llama.cpp asserts (the process aborts) on 0
                raise ModelError(f"llama.cpp setting n_batch must be at least 1, got {value}")


def resolve_flash_attn(cfg: ModelConfig) -> str:
    """'auto' means off when the model runs on the CPU alone, llama.cpp's own choice when layers are offloaded.

    llama.cpp's auto turns flash attention on wherever it is supported, the CPU included, but there its CPU
    kernel is slower than the plain one, and more so with batches and long contexts. Measured on a 2-core
    EPYC with Qwen2.5-Coder-1.5B Q4_K_M at 2,000 cached tokens: a 1-token decode 41.7 ms off vs 46.0 ms on,
    a 16-token verify 291 vs 408 ms. A quantized V cache needs flash attention: it keeps llama.cpp's auto.
    (With `exact`, load() settles the setting by probing which one is batch-invariant on this machine.)
    """
    if cfg.flash_attn == "auto" and cfg.n_gpu_layers == 0 and cfg.type_v in ("f16", "f32", "bf16") and not cfg.exact:
        return "off"
    return cfg.flash_attn


def _fields(struct) -> set[str]:
    return {name for name, ctype in struct._fields_ if ctype in _SETTABLE}


class _Users:
    """The threads inside calls that read the vocabulary, any number at once; close() frees the model only
    when none is (the calling thread's own aside), and calls that start meanwhile wait, then find it closed.
    llama.cpp's vocabulary is freed with the model, and a stream's consumer reads token pieces outside the
    engine's lock. Each thread's count changes in one step under the lock, so an interrupt cannot leave the
    counts apart."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._inside: dict[int, int] = {}  # thread id -> how deep in vocabulary calls
        self._waiting = 0  # closers waiting: only then does a reader leaving notify

    def __enter__(self) -> None:
        me = threading.get_ident()
        with self._cond:
            self._inside[me] = self._inside.get(me, 0) + 1

    def __exit__(self, *exc) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._inside[me] == 1:
                del self._inside[me]
                if self._waiting:
                    self._cond.notify_all()
            else:
                self._inside[me] -= 1

    @contextlib.contextmanager
    def alone(self):
        me = threading.get_ident()
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._inside.keys() - {me})
            finally:
                self._waiting -= 1
            yield


def _in_use(method):
    """The model is not freed while this runs (see _Users)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        with self._use:
            return method(self, *args, **kwargs)
    return guarded
