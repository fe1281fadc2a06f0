"""localspec: local, offline speculative decoding for GGUF models on llama-cpp-python.

    import localspec
    llm = localspec.load(target="t.gguf", draft="d.gguf", n_ctx=4096)
    r = llm.generate("prompt", max_tokens=128, temperature=0.0)
    r.text, r.tokens, r.from_draft, r.finish_reason, r.stats
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from typing import Mapping

from typing import TYPE_CHECKING

from .core.errors import LocalspecError
from .core.compat import Check, compare_vocab
from .core.model import ContextFullError, Model, ModelConfig, ModelError, set_verbose
from .core.request import RequestError
from .core.stream import Event, Result, Stats, Stream

if TYPE_CHECKING:
    from .api.completions import Engine


def __getattr__(name: str):
    # Engine is the api's (core's engine plus create_chat_completion): imported when asked for, so that importing
    # localspec.core alone loads nothing above it (tests/test_layout.py)
    if name == "Engine":
        from .api.completions import Engine

        return Engine
    raise AttributeError(f"module 'localspec' has no attribute {name!r}")


__all__ = ["load", "Engine", "Event", "Result", "Stats", "Stream", "LocalspecError", "ModelError",
           "RequestError", "ContextFullError", "IncompatibleModelsError", "Check", "compare_vocab"]


class IncompatibleModelsError(LocalspecError):
    """The draft model's vocabulary does not match the target's (llama.cpp's compatibility rules)."""


def load(*, target: str | os.PathLike | None = None, draft: str | os.PathLike | None = None,
         pair: str | None = None, n_ctx: int | None = None, n_threads: int | None = None, n_gpu_layers: int = 0,
         flash_attn: str = "auto", type_k: str = "f16", type_v: str = "f16",
         n_ctx_draft: int | None = None, n_threads_draft: int | None = None, n_gpu_layers_draft: int | None = None,
         flash_attn_draft: str | None = None, type_k_draft: str | None = None, type_v_draft: str | None = None,
         exact: bool = False, target_kwargs: Mapping[str, object] | None = None,
         draft_kwargs: Mapping[str, object] | None = None, memory_check: bool = True, allow_mirror: bool = True,
         history_mb: float = 0, history_file: bool = True, prompt_cache_mb: float | None = None,
         prompt_cache_disk_mb: float | None = None, parallel: int | str = 1, chat_template: str | None = None,
         verbose: bool = False) -> Engine:
    """Load a target model and, optionally, a draft model that shares its tokenizer.

    Models by path (target=, draft=) or by name: pair="NAME" from models.toml, or nothing at all for the
    default pair; named models are fetched and verified on first use (see `localspec pull`), and the
    pair's recommended drafter, k, p_min and n_ctx become the defaults.

    n_ctx: context size in tokens (default: the pair's, else 4096); 0 = the one the model was trained for, as in
    llama.cpp (n_ctx_draft=0: the draft's; the memory check still applies).
    Each setting has a `*_draft` twin for the draft model that defaults to the target's value.
    n_gpu_layers: layers offloaded to the GPU (CUDA/Metal builds of llama-cpp-python); -1 offloads all.
    flash_attn: 'auto', 'on' or 'off'. type_k/type_v: KV cache type ('f16', 'q8_0', 'q4_0', ...).
    exact: make the target's batched and single-token logits bit-identical, so speculative greedy output
    equals plain greedy output token for token (and a reused prefix gives the same logits as a fresh
    prefill): no CPU weight repacking, 32-token physical batches, ggml's tiled matmul off for the process
    (GGML_CPU_TILED_MM=0, where no model has run yet), and the flash-attention setting that a probe on this
    machine finds batch-invariant at every verify width over the whole context (once per settings, cached);
    refused with the cells that differ and the fix when no setting is (on some CPUs the fix is a build of
    llama-cpp-python without llamafile). Plain decode is ~10-25% slower. The draft model is made exact the same way (so a
    seeded request at T > 0 drafts the same whatever else the engine ran), or said on stderr where it
    cannot be.
    target_kwargs/draft_kwargs: any other llama_model_params / llama_context_params field by name.
    memory_check: refuse to load, saying what to lower, when the models clearly cannot fit in memory.
    history_mb: keep what requests generate (up to this many MB per scope, the oldest dropped first) and let
    drafter 'auto' draft from it: apps that repeat themselves (one JSON shape over many documents, an agent's
    tool calls, code regenerated after an edit) get those tokens drafted. Off (0) by default: outside exact
    mode, a draft from history can flip a near-tie at temperature 0, so an output could depend on earlier
    requests. A request opts out with history=False. It is kept in $LOCALSPEC_HOME/history (read when first
    used, written as it grows and when the engine closes; safe with several processes) unless history_file is
    False.
    prompt_cache_mb, prompt_cache_disk_mb: keep the KV states of prompts (up to this many MB in memory, and on
    disk in $LOCALSPEC_HOME/kv, shared by processes and kept across runs), so that a prompt starting like a kept
    one (a system prompt, tools, a document, a conversation) restores those tokens instead of prefilling them
    (on a CPU ~10 ms a token). Defaults: 1024 MB or a tenth of the free memory, whichever is less, and 4096 MB
    or a quarter of the free disk; 0 turns a tier off. A state is used only with the model file and every
    setting that shapes its bytes, and its tokens compared first; a request opts out with prompt_cache=False.
    parallel: requests decoded together (1-64, or 'auto'): each gets a KV cache sequence of n_ctx positions
    (memory for parallel x n_ctx), and the streams open at once share each llama_decode (of the target, and of
    the draft model), so a wide verify's cost is shared rather than paid by one; the N+1th stream waits for a
    free one. 'auto' picks 1, 2, 4 or 8 from this machine's measured costs (where a wider decode costs nearly
    in proportion to its width, as on many CPUs, 1). Not with exact.
    chat_template: a Jinja chat template to render chats with in place of the one in the target's GGUF (one
    that has none, or a fixed one; as llama-server's --chat-template-file).
    verbose: show llama.cpp's own log output and the memory estimate.
    """
    from .api.completions import Engine
    from .core.chat_template import check_template
    from .core.engine import EXACT_PARALLEL
    from .store import download, memory, registry
    from .store.calibration import costs_keeper, exact_flash_attn
    from .store.machine import amx_safe

    check_gguf = registry.check_model_path

    set_verbose(verbose)
    for key, value in (("target", target), ("draft", draft)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ModelError(f"{key}= must be a path to a GGUF file (str or Path), got {type(value).__name__}")
    if pair is not None and not isinstance(pair, str):
        raise ModelError(f"pair= must be a name from models.toml (a str), got {type(pair).__name__}")
    defaults, name = {}, None
    if target is None:
        if draft is not None:
            raise ModelError("draft= was given without target=: pass both paths, or pair='NAME'")
        spec, target, draft = download.resolve_pair(pair, allow_mirror=allow_mirror)
        defaults, name = {"drafter": spec.drafter, "k": spec.k, "p_min": spec.p_min}, spec.name
        n_ctx = spec.n_ctx if n_ctx is None else n_ctx
    elif pair is not None:
        raise ModelError("pass either pair='NAME' or target=/draft= paths, not both")
    n_ctx = 4096 if n_ctx is None else n_ctx
    if chat_template is not None:
        check_template(chat_template)  # a template that does not compile is an error now, not at the first chat
    if parallel == "auto":
        if exact:
            parallel = 1
        else:  # loaded for one request first: its measured costs say whether more pay (kept when they do not)
            from .core.costs import parallel_for

            kw = dict(locals())
            kw = {k: kw[k] for k in ("target", "draft", "n_ctx", "n_threads", "n_gpu_layers", "flash_attn", "type_k",
                                     "type_v", "n_ctx_draft", "n_threads_draft", "n_gpu_layers_draft",
                                     "flash_attn_draft", "type_k_draft", "type_v_draft", "target_kwargs",
                                     "draft_kwargs", "memory_check", "history_mb", "history_file", "prompt_cache_mb",
                                     "prompt_cache_disk_mb", "chat_template", "verbose")}
            one = load(**kw, parallel=1)
            try:
                parallel = parallel_for(one.calibration())
            except BaseException:
                one.close()
                raise
            if parallel == 1:
                one.name, one.defaults = name or one.name, defaults | one.defaults
                return one
            one.close()
    if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= 64:
        raise ModelError(f"parallel must be 1 to 64 or 'auto', got {parallel!r}")
    if exact and parallel > 1:
        raise EXACT_PARALLEL
    if n_ctx == 0:  # as in llama.cpp: the context the model was trained for
        n_ctx = memory.trained_ctx(check_gguf(target))
    if n_ctx_draft == 0:
        n_ctx_draft = memory.trained_ctx(check_gguf(draft)) if draft is not None else None
    tcfg = ModelConfig(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
                       type_k=type_k, type_v=type_v, exact=exact, n_seq=parallel, kwargs=dict(target_kwargs or {}))
    try:
        dcfg = ModelConfig(n_ctx=n_ctx if n_ctx_draft is None else n_ctx_draft,
                           n_threads=n_threads if n_threads_draft is None else n_threads_draft,
                           n_gpu_layers=n_gpu_layers if n_gpu_layers_draft is None else n_gpu_layers_draft,
                           flash_attn=flash_attn_draft or flash_attn, type_k=type_k_draft or type_k,
                           type_v=type_v_draft or type_v, n_seq=parallel, kwargs=dict(draft_kwargs or {}))
    except ModelError as e:  # name the draft's own setting: 'n_ctx_draft must be ...', 'draft_kwargs: ...'
        setting = re.match(r"(n_ctx|n_threads|n_gpu_layers|flash_attn|type_k|type_v) ", str(e))
        own = re.sub(r"(\w+) \(--([\w-]+)\)$", r"\1_draft (--\2-draft)", str(e))  # its own option: the draft's
        raise ModelError(f"{setting.group(1)}_draft{str(e)[len(setting.group(1)):]}" if setting else
                         f"draft_kwargs: {own}") from None
    est = memory.estimate(check_gguf(target), check_gguf(draft) if draft is not None else None,
                          tcfg.n_ctx * parallel, type_k=type_k, type_v=type_v,
                          n_ctx_draft=dcfg.n_ctx * parallel if draft is not None else None,
                          type_k_draft=dcfg.type_k, type_v_draft=dcfg.type_v)
    if verbose:
        print(f"localspec: estimated memory {est}", file=sys.stderr)
    if memory_check:
        memory.check_fits(est, memory.available_memory(), parallel)
    if exact:
        from .core.model import exact_matmuls

        exact_matmuls()
        say = lambda m: print(f"localspec: {m}", file=sys.stderr, flush=True)  # noqa: E731
        tcfg = replace(tcfg, flash_attn=exact_flash_attn(check_gguf(target), tcfg, registry.home() / "calibration",
                                                         log=say))
        if draft is not None:
            # The target's logits decide greedy output, but at T > 0 the draft's q decides the acceptance draws:
            # a draft cache rebuilt in other batches (another stream, a reused prefix) gave another text.
            dcfg = replace(dcfg, exact=True)
            try:
                dcfg = replace(dcfg, flash_attn=exact_flash_attn(check_gguf(draft), dcfg,
                                                                 registry.home() / "calibration", log=say))
            except ModelError as e:
                dcfg = replace(dcfg, exact=False)
                say(f"the draft model runs without exactness (at temperature > 0 its text may then depend on "
                    f"what else the engine ran): {str(e).split(';')[0]}")
    t = Model(target, amx_safe(check_gguf(target), tcfg))  # (where this build's AMX kernels crash, without them)
    d = None
    try:
        if draft is not None:
            d = Model(draft, amx_safe(check_gguf(draft), dcfg))
            failed = [c for c in compare_vocab(t, d) if not c.ok]
            if failed:
                raise IncompatibleModelsError(f"draft {d.path.name} is incompatible with target {t.path.name}: "
                                              f"{failed[0].rule} differs ({failed[0].detail}); "
                                              "use a draft from the same model family")
    except BaseException:
        t.close()
        if d is not None:
            d.close()
        raise
    keeper = None
    if history_mb > 0 and history_file:
        from .store.history import HistoryFiles, folder

        keeper = HistoryFiles(folder(registry.home(), t.path), int(history_mb * 2 ** 20), t.n_vocab)
    try:
        cache = _prompt_cache(t, d, prompt_cache_mb, prompt_cache_disk_mb)
    except BaseException:
        t.close()
        if d is not None:
            d.close()
        raise
    engine = Engine(t, d, name=name, defaults=defaults, costs=costs_keeper(registry.home() / "calibration"),
                    history_mb=history_mb, history_keeper=keeper, prompt_cache=cache, chat_template=chat_template)
    if parallel > 1:  # measured now, before any request: measuring decodes in the slots' own sequences
        try:
            engine.calibration()
        except BaseException:
            engine.close()
            raise
    return engine


def _prompt_cache(target: Model, draft: Model | None, ram_mb: float | None, disk_mb: float | None):
    """The engine's prompt cache (core.prefix.PrefixCache), both models attached, or None when both tiers are off."""
    from .core.prefix import PrefixCache
    from .store import memory, registry

    for name, v in (("prompt_cache_mb", ram_mb), ("prompt_cache_disk_mb", disk_mb)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 2 ** 40):
            raise ModelError(f"{name} must be a number of MB >= 0 (0 turns it off), got {v!r}")
    if ram_mb is None:
        free = memory.available_memory()
        ram_mb = 1024 if free is None else min(1024, free / 10 / 2 ** 20)
    root = registry.home() / "kv"  # (store.prefix.default_root())
    if disk_mb is None:
        from .store.prefix import default_disk_mb

        disk_mb = default_disk_mb(root)
    if not ram_mb and not disk_mb:
        return None
    cache = PrefixCache(int(ram_mb * 2 ** 20))
    for m in (target, draft):
        if m is not None:
            keeper = None
            if disk_mb:
                from .store.prefix import KvFiles
                from .store.prefix_key import fingerprint

                folder, meta = fingerprint(m)
                keeper = KvFiles(root, folder, int(disk_mb * 2 ** 20), meta)
            cache.attach(m, keeper)
    return cache
