"""Tier 2: real-model properties on SmolLM2-135M (its own draft)."""
import ctypes
import json

import llama_cpp as L
import numpy as np
import pytest

import localspec
from localspec.core import engine, llama
from localspec.core.loop import Round, speculate
from localspec.core.auto import NEWLINE, PUNCT, WORD, AutoDrafter
from localspec.core.drafters import ModelDrafter
from localspec.core.model import Model, ModelConfig, ModelError
from localspec.core.sampling import SamplingParams
from localspec.store import machine

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def test_self_draft_accepts_every_drafted_token(smol_engine, smol_path):
    """A draft that computes the target's very logits has every token accepted. exact=True makes only the
    target batch-invariant (with the flash-attention setting its probe chose on this machine); the draft gets
    the same setting and no weight repacking here, or a near-tie may go the other way (it did on a
    first-generation EPYC, where the probe chose flash attention on and the draft ran with it off)."""
    fa = smol_engine.target.flash_attn
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=1024, exact=True, flash_attn_draft=fa,
                        draft_kwargs={"use_extra_bufts": False, "n_ubatch": 32}) as llm:
        r = llm.generate(llm.chat_tokens(MESSAGES), max_tokens=48, temperature=0, drafter="model", k=4, p_min=0.0)
    s = r.stats
    assert s.drafted > 0 and s.accepted == s.drafted
    assert s.accepted_at[0] == s.drafting_rounds and s.accepted_at[-1] > 0


@pytest.fixture(scope="module")
def plain_reply(smol_engine):
    """Plain decoding's reply to MESSAGES (exact mode: the same however often it is asked)."""
    return smol_engine.generate(smol_engine.chat_tokens(MESSAGES), max_tokens=40, temperature=0, drafter="none")


@pytest.mark.parametrize("accept, drafter", [
    ("rejection", "model"), ("rejection", "ngram"), ("rejection", "hybrid"), ("greedy", "ngram"),
    pytest.param("greedy", "model", marks=pytest.mark.slow), pytest.param("greedy", "hybrid", marks=pytest.mark.slow)])
def test_speculative_greedy_equals_plain(smol_engine, drafter, accept, plain_reply):
    prompt = smol_engine.chat_tokens(MESSAGES)
    plain = plain_reply
    spec = smol_engine.generate(prompt, max_tokens=40, temperature=0, drafter=drafter, accept=accept, k=5, p_min=0)
    assert spec.tokens == plain.tokens
    assert spec.text == plain.text


def test_auto_never_makes_the_first_token_wait_for_the_draft_models_prompt(smol_engine, monkeypatch):
    """Where the draft model may pay (a GPU's costs), auto still leaves its cache alone until the time lost
    without it would pay for catching the prompt up: the first token never waits on the draft model, whose
    catch-up comes later in the answer; the text is plain decoding's."""
    from localspec.core.costs import Costs

    sizes = (1, 2, 4, 8, 17, 33)
    gpu = Costs(sizes, (256,), (tuple(0.010 + 0.0002 * n for n in sizes),), (0.002,), 0.0, (0.0003,))
    monkeypatch.setattr(smol_engine, "_costs", gpu)
    prompt = smol_engine.chat_tokens(MESSAGES)
    smol_engine.draft.truncate(0)
    rounds = []
    r = smol_engine.generate(prompt, max_tokens=96, temperature=0, drafter="auto", trace=rounds.append)
    sources = [row.get("source") for row in rounds]  # (the last round, with no room to draft, has none)
    assert r.stats.draft_prompt_prefilled == 0  # nothing before the first token
    # the first rounds decode plain while the lost time accrues; then the catch-up, and model drafts
    assert "model" not in sources[:2] and "model" in sources
    assert len(smol_engine.draft.tokens) > len(prompt) and r.stats.drafted > 0
    assert r.tokens == smol_engine.generate(prompt, max_tokens=96, temperature=0, drafter="none").tokens


def test_kv_cache_matches_token_list_after_every_round(smol_engine):
    t, d = smol_engine.target, smol_engine.draft
    params = SamplingParams(temperature=0.7)
    prompt = smol_engine.chat_tokens(MESSAGES)
    drafter = ModelDrafter(d, params, seed=3, p_min=0.2, prompt_len=len(prompt))
    checked = 0
    for fact in speculate(t, d, drafter, prompt, max_tokens=60, k=4, rule="rejection", params=params, seed=3):
        if type(fact) is Round:
            assert t.pos_max() == len(t.tokens) - 1
            assert d.pos_max() == len(d.tokens) - 1
            checked += 1
    assert checked > 5


def test_prefix_reuse_prefills_only_the_new_suffix(smol_engine):
    first = smol_engine.chat_tokens(MESSAGES)
    smol_engine.generate(first, max_tokens=8, temperature=0, drafter="model")
    longer = smol_engine.chat_tokens(MESSAGES + [{"role": "assistant", "content": "Sure."},
                                                 {"role": "user", "content": "Now in Rust."}])
    r = smol_engine.generate(longer, max_tokens=8, temperature=0, drafter="model")
    assert longer[:len(first)] == first
    assert r.stats.prompt_reused >= len(first) - 1
    assert r.stats.prompt_prefilled == len(longer) - r.stats.prompt_reused == r.stats.prompt_tokens - r.stats.prompt_reused
    again = smol_engine.generate(longer, max_tokens=2, temperature=0, drafter="model").stats
    assert (again.prompt_prefilled, again.prompt_tps) == (1, 0.0)  # nothing timed in prefill: no speed, not 10^4
    assert r.stats.draft_prompt_reused >= len(first) - 1


def test_stop_string_is_not_emitted(smol_engine):
    prompt = smol_engine.chat_tokens(MESSAGES)
    plain = smol_engine.generate(prompt, max_tokens=40, temperature=0, drafter="none")
    stop = plain.text[10:14]
    r = smol_engine.generate(prompt, max_tokens=40, temperature=0, drafter="model", stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == plain.text[:plain.text.index(stop)]
    assert smol_engine.target.pos_max() == len(smol_engine.target.tokens) - 1


def test_interrupted_stream_leaves_both_caches_consistent(smol_engine):
    s = smol_engine.stream(smol_engine.chat_tokens(MESSAGES), max_tokens=60, temperature=0, drafter="model")
    it = iter(s)
    for _ in range(7):
        next(it)
    it.close()
    for m in (smol_engine.target, smol_engine.draft):
        assert m.pos_max() == len(m.tokens) - 1
    assert s.stats.generated == 7


def test_sampling_is_reproducible_with_a_seed(smol_engine):
    prompt = smol_engine.chat_tokens(MESSAGES)
    a = smol_engine.generate(prompt, max_tokens=30, temperature=0.9, seed=42, drafter="model")
    b = smol_engine.generate(prompt, max_tokens=30, temperature=0.9, seed=42, drafter="model")
    assert a.tokens == b.tokens


def test_eos_and_length_finish_reasons(smol_engine):
    r = smol_engine.generate(smol_engine.chat_tokens([{"role": "user", "content": "Say OK."}]), max_tokens=200,
                             temperature=0)
    assert r.finish_reason == "stop" and r.stats.generated < 200
    assert smol_engine.generate("Once upon a time", max_tokens=5, temperature=0).finish_reason == "length"


def test_context_full_ends_with_length(smol_path):
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=64) as llm:  # llama.cpp makes it 256 cells
        count = llm.tokenize("Count: " + ", ".join(map(str, range(1, 200))))  # the prompt fills most of it
        count = count[:llm.target.n_ctx - 24]
        r = llm.generate(count, max_tokens=500, temperature=0, drafter="model")
        assert r.finish_reason == "length"
        assert len(llm.target.tokens) <= llm.target.n_ctx and 0 < r.stats.generated <= 25  # (the last, never read)


def test_chat_completion_shape(smol_engine):
    out = smol_engine.create_chat_completion(MESSAGES, max_tokens=8, temperature=0)
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == out["localspec"]["generated"]
    chunks = list(smol_engine.create_chat_completion(MESSAGES, max_tokens=8, temperature=0, stream=True))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == out["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_build_whose_amx_kernels_crash_loads_models_without_extra_layouts(smol_path, tmp_path, monkeypatch,
                                                                             capsys):
    """On a Xeon with AMX, llama-cpp-python built by GCC 12 killed the process at its first prompt (ldtilecfg on
    a tile configuration the compiler had not finished writing). A child process finds that once per machine
    and build (store.machine); load() then loads models without llama.cpp's extra weight layouts, and it says how
    to rebuild."""
    monkeypatch.setattr(machine, "_amx_works", None)
    monkeypatch.setattr(llama, "system_info", lambda: "CPU : AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |")
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "a"))
    monkeypatch.setattr(machine, "_AMX_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert machine.amx_faults(smol_path) is True
    assert "AMX kernels crash on this machine (signal 11" in capsys.readouterr().err
    (kept,) = (tmp_path / "a" / "calibration").glob("amx-*.json")
    assert json.loads(kept.read_text())["amx"] == "faults"
    with localspec.load(target=smol_path, n_ctx=128) as llm:
        assert llm.target.extra_bufts is False
        assert llm.target.decode(list(range(100, 164)), logits="all").shape == (64, llm.target.n_vocab)
    # the caller's own choice stands, and exact mode has them off anyway
    mine = ModelConfig(kwargs={"use_extra_bufts": True})
    assert machine.amx_safe(smol_path, mine) is mine
    assert machine.amx_safe(smol_path, ModelConfig(exact=True)).kwargs == {}
    # the next process reads the verdict: a child that would say otherwise is not run
    monkeypatch.setattr(machine, "_amx_works", None)
    monkeypatch.setattr(machine, "_AMX_CHILD", "import sys; sys.stderr.write('AMX model buffer size = 1 MiB')")
    assert machine.amx_faults(smol_path) is True and capsys.readouterr().err == ""
    # elsewhere the kernels run: said by llama.cpp's AMX buffer in the child's log, kept, silent
    monkeypatch.setattr(machine, "_amx_works", None)
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "b"))
    assert machine.amx_faults(smol_path) is False and "crash" not in capsys.readouterr().err
    (kept,) = (tmp_path / "b" / "calibration").glob("amx-*.json")
    assert json.loads(kept.read_text())["amx"] == "works"
    # a child that never reached the AMX kernels (no weights of their types) settles nothing
    monkeypatch.setattr(machine, "_amx_works", None)
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "c"))
    monkeypatch.setattr(machine, "_AMX_CHILD", "print('no AMX buffer')")
    assert machine.amx_faults(smol_path) is False and machine._amx_works is None
    assert not (tmp_path / "c" / "calibration").exists() or not list((tmp_path / "c" / "calibration").iterdir())
    # a build without AMX never runs a child
    monkeypatch.setattr(llama, "system_info", lambda: "CPU : AVX512 = 1 | OPENMP = 1 |")
    monkeypatch.setattr(machine, "_AMX_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert machine.amx_faults(smol_path) is False and machine._amx_works is True


def test_settings_reach_llama_cpp(smol_path, monkeypatch):
    seen = {}
    real_load, real_init = L.llama_model_load_from_file, L.llama_init_from_model

    def load(path, mp):
        seen["model"] = {f: getattr(mp, f) for f in ("n_gpu_layers", "use_extra_bufts", "check_tensors")}
        return real_load(path, mp)

    def init(model, cp):
        seen["ctx"] = {f: getattr(cp, f) for f in ("n_ctx", "n_threads", "flash_attn_type", "type_k", "type_v",
                                                   "offload_kqv")}
        return real_init(model, cp)

    monkeypatch.setattr(L, "llama_model_load_from_file", load)
    monkeypatch.setattr(L, "llama_init_from_model", init)
    m = Model(smol_path, ModelConfig(n_ctx=256, n_threads=1, n_gpu_layers=7, flash_attn="on", type_k="q8_0",
                                     type_v="q8_0", exact=True, kwargs={"check_tensors": True, "offload_kqv": False}))
    m.close()
    assert seen["model"] == {"n_gpu_layers": 7, "use_extra_bufts": False, "check_tensors": True}
    assert seen["ctx"] == {"n_ctx": 256, "n_threads": 1, "flash_attn_type": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                           "type_k": L.GGML_TYPE_Q8_0, "type_v": L.GGML_TYPE_Q8_0, "offload_kqv": False}
    default = Model(smol_path, ModelConfig(n_ctx=256))
    default.close()
    # the fast default keeps weight repacking (load() turns it off where this build's AMX kernels crash: amx_safe)
    assert seen["model"]["use_extra_bufts"] is default.extra_bufts is True
    # flash attention 'auto': off on the CPU alone (slower there), llama.cpp's auto once layers are offloaded
    # or when a quantized V cache or exact mode needs it
    assert seen["ctx"]["flash_attn_type"] == L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    for cfg in (ModelConfig(n_ctx=256, n_gpu_layers=99), ModelConfig(n_ctx=256, type_v="q8_0"),
                ModelConfig(n_ctx=256, exact=True)):
        Model(smol_path, cfg).close()
        assert seen["ctx"]["flash_attn_type"] == L.LLAMA_FLASH_ATTN_TYPE_AUTO


def test_unknown_llama_setting_is_an_error_naming_it(smol_path):
    with pytest.raises(ModelError, match="unknown llama.cpp setting 'n_gpu_layerz'"):
        localspec.load(target=smol_path, target_kwargs={"n_gpu_layerz": 1})


@pytest.mark.parametrize("settings, message", [
    ({"target_kwargs": {"n_ctx": 64}}, "n_ctx has its own option here: n_ctx"),  # aborted in calibration
    ({"target_kwargs": {"vocab_only": True}}, "vocab_only cannot be set here"),  # aborted at load
    ({"target_kwargs": {"n_outputs_max": 1}}, "a verify needs a logit row"),
    ({"draft_kwargs": {"progress_callback": 1}}, "draft_kwargs: .*progress_callback .*a pointer or a callback"),
    ({"n_ctx": "512"}, "n_ctx must be an integer, got '512'"),  # a TypeError from deep inside
    ({"n_ctx_draft": 5}, "n_ctx_draft must be at least 16"),  # named n_ctx: the target's
    ({"n_threads_draft": 0}, "n_threads_draft must be at least 1"),  # 0 meant the target's count
])
def test_settings_that_would_crash_or_mislead_are_errors_naming_the_setting(smol_path, settings, message):
    with pytest.raises(ModelError, match=message):
        localspec.load(target=smol_path, draft=smol_path, **({"n_ctx": 512} | settings))


def test_n_batch_from_kwargs_is_what_the_loop_uses(smol_path):
    with localspec.load(target=smol_path, n_ctx=512, target_kwargs={"n_batch": 16}) as llm:
        assert llm.target.n_batch == 16
        r = llm.generate("1, 2, 3, 4, 5, 6,", max_tokens=24, temperature=0, drafter="ngram", k=30)
        assert r.stats.generated == 24 and any("clamped to 15 (n_batch=16)" in n for n in r.stats.notes)


def test_a_context_llama_cpp_refuses_names_the_real_fix(smol_path):
    """A quantized V cache without flash attention: the error says that, not "a smaller n_ctx", and never
    suggests the quantized cache that is already set."""
    with pytest.raises(ModelError) as e:
        Model(smol_path, ModelConfig(n_ctx=256, type_v="q8_0", flash_attn="off"))
    msg = str(e.value)
    assert "needs flash attention: --flash-attn on, or type_v f16" in msg
    assert "smaller n_ctx" not in msg and "quantized KV cache (type_k" not in msg


def test_recurrent_models_are_refused(smol_path, monkeypatch):
    monkeypatch.setattr(L, "llama_model_is_recurrent", lambda model: True)
    with pytest.raises(ModelError, match="recurrent or hybrid"):
        Model(smol_path, ModelConfig(n_ctx=128))


def test_vocab_check_passes_for_identical_models(smol_engine):
    checks = localspec.compare_vocab(smol_engine.target, smol_engine.draft)
    assert [c.rule for c in checks] == ["vocab type", "add_bos and BOS id", "add_eos and EOS id",
                                        "vocab size difference <= 128", "token text from id 5 on"]
    assert all(c.ok for c in checks)


def test_one_target_decode_per_round_with_k_plus_1_logit_rows(smol_engine, monkeypatch):
    import localspec.core.model as lm

    t = smol_engine.target
    calls = []
    real = lm.L.llama_decode

    def counting(ctx, batch):
        if ctx == t._ctx:
            flags = [batch.logits[i] for i in range(batch.n_tokens)]
            calls.append((batch.n_tokens, sum(1 for f in flags if f)))
        return real(ctx, batch)

    monkeypatch.setattr(lm.L, "llama_decode", counting)
    prompt = smol_engine.chat_tokens(MESSAGES)
    t.truncate(0)
    s = smol_engine.stream(prompt, max_tokens=40, temperature=0, drafter="model", k=4, p_min=0.0)
    list(s)
    verify_calls = calls[1:]  # calls[0] is the prefill, which asks for no logits
    assert calls[0][1] == 0
    assert len(verify_calls) == s.stats.rounds
    assert all(n_tokens == n_logits for n_tokens, n_logits in verify_calls)  # k+1 tokens, k+1 rows
    assert max(n for n, _ in verify_calls) == 5


def test_auto_reads_each_tokens_kind_from_the_targets_vocabulary(smol_engine, monkeypatch):
    kinds = smol_engine.token_kinds()
    assert len(kinds) == smol_engine.target.n_vocab and smol_engine.token_kinds() is kinds  # built once
    word, comma, newline = (smol_engine.tokenize(t, add_special=False)[0] for t in ("Hello", ",", "\n"))
    assert (kinds[word], kinds[comma], kinds[newline]) == (WORD, PUNCT, NEWLINE)
    # read off the whole vocabulary at once, as each token's bytes say one by one
    def kind(b: bytes) -> int:
        return NEWLINE if b"\n" in b else WORD if any(c.isalnum() for c in b.decode("utf-8", "ignore")) else PUNCT
    assert kinds.tolist() == [kind(smol_engine.target.piece(t)) for t in range(smol_engine.target.n_vocab)]
    seen = []
    monkeypatch.setattr(engine, "AutoDrafter", lambda *a, **kw: seen.append(kw["kinds"]) or AutoDrafter(*a, **kw))
    smol_engine.generate("Once upon a time", max_tokens=4, drafter="auto")
    assert seen and seen[0] is kinds


def test_exact_mode_makes_the_draft_exact_or_says_why_not(smol_path, monkeypatch, capfd):
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=512, exact=True) as llm:
        assert llm.target.cfg.exact and llm.draft.cfg.exact
    import localspec.store.calibration as cal
    real = cal.exact_flash_attn

    def draft_cannot(path, cfg, cache_dir, **kw):
        if getattr(draft_cannot, "called", False):
            raise localspec.ModelError("exact mode cannot be honoured on this machine: they differ; rebuild")
        draft_cannot.called = True
        return real(path, cfg, cache_dir, **kw)

    monkeypatch.setattr(cal, "exact_flash_attn", draft_cannot)
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=512, exact=True) as llm:
        assert llm.target.cfg.exact and not llm.draft.cfg.exact
        assert llm.generate("Hi", max_tokens=4, drafter="model").stats.generated == 4
    assert "the draft model runs without exactness" in capfd.readouterr().err


def test_ctrl_c_while_a_model_loads_is_raised_once_it_has_loaded(smol_path):
    """A Ctrl-C during llama.cpp's load landed in its log callback: ctypes printed a traceback, dropped the
    KeyboardInterrupt, and `localspec generate` went on to answer with exit 0. It now stops the load at its next
    step (llama.cpp's progress callback) and is raised once the load returns, and Ctrl-C works as before after."""
    import subprocess
    import sys

    script = f"""
import ctypes, signal
import llama_cpp as L
import localspec.core.model as lm
real, done, steps = L.llama_model_load_from_file, [], []

def load(path, params):  # Ctrl-C arrives inside llama.cpp's load, at its first progress step
    ours = L.llama_progress_callback(ctypes.cast(params.progress_callback, ctypes.c_void_p).value)  # localspec's

    def step(progress, data):
        steps.append(progress)
        if len(steps) == 1:
            signal.raise_signal(signal.SIGINT)  # its Python handler runs before this returns: no race
        return ours(progress, data)

    params.progress_callback = cb = L.llama_progress_callback(step)
    out = real(path, params)
    done.append(bool(out))  # NULL: the load stopped early
    return out

lm.L.llama_model_load_from_file = load
try:
    lm.Model({str(smol_path)!r}, lm.ModelConfig(n_ctx=256))
    print("loaded: the interrupt was lost")
except KeyboardInterrupt:
    print(f"interrupted after the load (loaded: {{done[0]}}, inside it: {{bool(steps)}})" if done else "interrupted inside the load")
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
lm.L.llama_model_load_from_file = real
m = lm.Model({str(smol_path)!r}, lm.ModelConfig(n_ctx=256))
print("loads again", m.n_vocab > 0)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["interrupted after the load (loaded: False, inside it: True)", "loads again True"], r.stdout
    assert "Exception ignored" not in r.stderr
