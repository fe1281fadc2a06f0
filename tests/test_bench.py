"""`localspec bench`: llama-cpp-python's peers run with the engine's own settings, a peer that crashes is reported
and the bench goes on, sampling is compared with plain only where that means something, and bad input fails in
one line before any model loads. Real SmolLM2 (the session engine: exact, n_ctx 1024) and a scripted peer.
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import llama_cpp
import pytest

from localspec.apps import bench, cli
from localspec.core.model import ModelConfig, default_threads


def prompt(pid: str, text: str) -> dict:
    return {"id": pid, "kind": "chat", "messages": [{"role": "user", "content": text}]}


SHORT = prompt("short", "Repeat exactly: alpha beta gamma delta")
LONG = prompt("long", "Repeat this list exactly: " + ", ".join(f"item {i}" for i in range(110)))  # > 512 tokens
BROADCAST = "could not broadcast input array from shape (455808,) into shape (303872,)"


@pytest.fixture(scope="module")
def fast_engine(smol_path):
    """Not exact: 512-token physical batches prefill a long prompt quickly (the peer then uses them too)."""
    import localspec

    with localspec.load(target=smol_path, n_ctx=1024) as llm:
        yield llm


@pytest.fixture
def built(monkeypatch):
    """Every (real) llama_cpp.Llama the bench builds."""
    made = []

    class Spy(llama_cpp.Llama):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(llama_cpp, "Llama", Spy)
    return made


def test_peers_run_with_the_engines_threads_flash_attention_kv_types_and_exact(smol_engine, built):
    rows = bench.run(smol_engine, [SHORT], methods=("none", "peer-2", "peer-10"), max_tokens=8)
    (peer,) = built                                          # one Llama serves both peer methods
    cp, mp = peer.context_params, peer.model_params
    assert smol_engine.target.cfg.n_threads is None          # no --threads: the engine's own default
    assert cp.n_threads == cp.n_threads_batch == default_threads()
    # exact: the setting probed batch-invariant on this machine, whichever it is, and the peer gets the same
    assert cp.flash_attn_type == {"on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                  "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}[smol_engine.target.flash_attn]
    assert cp.type_k == cp.type_v == llama_cpp.GGML_TYPE_F16
    assert mp.use_extra_bufts is False and cp.n_ubatch == 32  # exact: no weight repacking, small batches
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts  # the defaults are put back
    assert all(rows[0].runs[m].tokens == 8 and rows[0].runs[m].failed is None for m in ("peer-2", "peer-10"))


def test_peer_settings_follow_a_plain_cpu_target():
    target = SimpleNamespace(cfg=ModelConfig(n_threads=3, type_k="q8_0"), flash_attn="off", extra_bufts=True)
    kw, fields = bench.peer_settings(target)
    assert kw["n_threads"] == kw["n_threads_batch"] == 3 and kw["flash_attn"] is False
    assert kw["type_k"] == llama_cpp.GGML_TYPE_Q8_0 and kw["type_v"] == llama_cpp.GGML_TYPE_F16
    assert kw["n_ubatch"] == 512 and fields == {}             # weight repacking stays on, as the engine's
    target.extra_bufts = False                                # a build whose AMX kernels crash: off for both
    assert bench.peer_settings(target)[1] == {"use_extra_bufts": False}


@pytest.mark.slow  # 9-10 s: in the slow tier, which CI runs, to keep the default run within 8 minutes
def test_a_prompt_past_512_tokens_does_not_crash_the_peer(fast_engine):
    # llama-cpp-python 0.3.36 keeps a draft model's logits in 512 rows unless logits_all: it used to raise
    # ValueError: could not broadcast ... as soon as the prompt passed 512 tokens.
    assert len(fast_engine.chat_tokens(LONG["messages"])) > 512
    run = bench.run(fast_engine, [LONG], methods=("none", "peer-2"), max_tokens=4)[0].runs["peer-2"]
    assert run.failed is None and run.tokens == 4


class CrashingPeer:
    """Stands in for llama_cpp.Llama: on its first prompt it streams a token, then fails as 0.3.36 did."""

    calls: list[dict] = []

    def __init__(self, path, **kw):
        self.draft_model = None

    def reset(self):
        pass

    def close(self):
        pass

    def create_completion(self, tokens, **kw):
        CrashingPeer.calls.append(kw)
        for i in range(kw["max_tokens"]):
            if i == 1 and len(CrashingPeer.calls) == 1:
                raise ValueError(BROADCAST)
            yield {"choices": [{"text": f" t{i}", "finish_reason": None}]}
        yield {"choices": [{"text": "", "finish_reason": "length"}]}


def test_a_peer_that_raises_is_reported_and_the_bench_goes_on(smol_engine, monkeypatch):
    monkeypatch.setattr(llama_cpp, "Llama", CrashingPeer)
    CrashingPeer.calls.clear()
    rows = bench.run(smol_engine, [prompt("first", "Name a colour."), SHORT], methods=("none", "ngram", "peer-2"),
                     max_tokens=6, temperature=0.7, seed=5)
    crashed, fine = rows[0].runs["peer-2"], rows[1].runs["peer-2"]
    assert crashed.failed == f"ValueError: {BROADCAST}" and fine.failed is None and fine.tokens == 6
    assert [(c["temperature"], c["seed"]) for c in CrashingPeer.calls] == [(0.7, 5)] * 2  # ours, for peers too
    text = bench.table(rows, temperature=0.7, seed=5)
    assert "| failed: ValueError: could not broadcast" in text
    assert bench.geomean(rows, "peer-2") == pytest.approx(fine.ratio)   # over the prompt it ran
    # with a seed our methods are compared with plain; a peer's own sampler never is
    assert isinstance(rows[1].runs["ngram"].same_as_plain, bool) and fine.same_as_plain is None
    assert "seed 5" in text and "not compared" in text
    assert json.loads(json.dumps(bench.to_json(rows, temperature=0.7, seed=5)))["prompts"][0]["methods"][
        "peer-2"]["failed"].startswith("ValueError")


def test_sampled_without_a_seed_compares_nothing(smol_engine):
    rows = bench.run(smol_engine, [SHORT], methods=("none", "ngram"), max_tokens=6, temperature=0.7)
    assert rows[0].runs["ngram"].same_as_plain is None
    text = bench.table(rows, temperature=0.7)
    assert "≠" not in text.split("\n\n")[0] and "without --seed" in text


# ---- the command: one-line errors (exit 2) before any model loads ----

def main(monkeypatch, capsys, *args) -> tuple[int, str]:
    """Run `localspec ARGS` in this process, through main() as the console script does: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["localspec", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code, capsys.readouterr().err


@pytest.fixture
def no_load(monkeypatch):
    def refuse(load_kw):
        raise AssertionError("models were loaded")

    monkeypatch.setattr(cli, "load_engine", refuse)


@pytest.mark.parametrize("args, says", [
    (["--plot", "out.png"], "--plot needs matplotlib"),
    (["--temperature", "-1"], "temperature=-1.0 is out of range"),
    (["--seed", "-1"], "seed must be a non-negative integer"),
])
def test_bad_flags_fail_before_loading(monkeypatch, capsys, smol_path, no_load, args, says):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # not installed
    code, err = main(monkeypatch, capsys, "bench", "--target", smol_path, *args)
    assert code == 2 and says in err and "Traceback" not in err


@pytest.mark.parametrize("line", ["not json", '["a list"]', '{"id": "x"}', '{"id": 1, "messages": []}',
                                  '{"id": "x", "messages": [{"role": "user"}]}'])
def test_a_bad_prompts_line_names_the_file_and_the_line(monkeypatch, capsys, tmp_path, smol_path, no_load, line):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(SHORT) + "\n" + line + "\n")
    code, err = main(monkeypatch, capsys, "bench", "--target", smol_path, "--prompts", path)
    assert code == 2 and err.startswith(f"error: {path}:2: ") and err.count("\n") == 1


def test_methods_that_need_a_draft(monkeypatch, capsys, tmp_path, smol_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(SHORT) + "\n")
    code, err = main(monkeypatch, capsys, "bench", "--target", smol_path, "--prompts", path, "--methods", "none,model")
    assert code == 2 and "error: method 'model' needs a draft model" in err   # asked for by name: refused

    asked = []

    def fake_run(llm, prompts, *, methods, **kw):
        asked.append(methods)
        return [bench.Row("short", "chat", {"none": bench.Run(10.0, 2, "x", ratio=1.0)})]

    monkeypatch.setattr(bench, "run", fake_run)
    code, err = main(monkeypatch, capsys, "bench", "--target", smol_path, "--prompts", path)
    assert code == 0 and "skipping model, hybrid (give --draft" in err      # the default list: said, then run
    assert asked == [["none", "ngram", "auto", "peer-2", "peer-10"]]


def test_structured_prompts_run_constrained_and_are_validated(smol_engine):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    p = prompt("person", "Describe a fictional person as JSON with name and age.") | {"schema": schema}
    (row,) = bench.run(smol_engine, [p], methods=("none", "auto", "peer"), max_tokens=48)
    for m in ("none", "auto", "peer"):
        assert row.runs[m].valid is True, (m, row.runs[m].text)
    out = bench.table([row])
    assert "| valid JSON | 1/1 | 1/1 | 1/1 |" in out and "INVALID" not in out


HOLDOUT_STRUCTURED = Path(__file__).resolve().parents[1] / "scripts" / "holdout_structured.jsonl"


@pytest.mark.parametrize("path", [bench.STRUCTURED, HOLDOUT_STRUCTURED], ids=["shipped", "holdout"])
def test_the_structured_sets_are_well_formed_and_apart(path):
    rows = bench.load_prompts(path)
    assert len(rows) >= 6 and len({r["id"] for r in rows}) == len(rows)
    assert all(r["kind"] in ("extract", "classify") and r["schema"]["type"] == "object" for r in rows)
    assert bench.valid("{}", {"type": "object", "required": ["a"]}) is False
    shipped = {r["id"] for r in bench.load_prompts(bench.STRUCTURED)}
    assert path == bench.STRUCTURED or not shipped & {r["id"] for r in rows}  # auto's rates come from the holdout


def test_an_interrupted_run_keeps_finished_prompts_and_resumes(monkeypatch, capsys, tmp_path, smol_engine):
    """--json is written after every prompt; Ctrl-C says how to finish; --resume runs only what is missing,
    and refuses a file measured with other settings or not saved by bench."""
    import contextlib

    monkeypatch.setattr(cli, "load_engine", lambda kw: contextlib.nullcontext(smol_engine))
    prompts, out = tmp_path / "p.jsonl", tmp_path / "run.json"
    prompts.write_text(json.dumps(SHORT) + "\n" + json.dumps(prompt("second", "Count: one two three")) + "\n")
    args = ["bench", "--target", "unused.gguf", "--prompts", prompts, "--methods", "none,ngram",
            "--max-tokens", "8", "--json", out]
    real, calls = bench._ours, []

    def ours(llm, tokens, method, *a, **kw):
        calls.append(method)
        if len(calls) == 4:               # a warm-up, none, ngram for the first prompt; then Ctrl-C
            raise KeyboardInterrupt
        return real(llm, tokens, method, *a, **kw)

    monkeypatch.setattr(bench, "_ours", ours)
    code, err = main(monkeypatch, capsys, *args)
    saved = json.loads(out.read_text())
    assert code == 130 and f"the prompts finished are in {out}; run the same command with --resume" in err
    assert [p["id"] for p in saved["prompts"]] == ["short"] and saved["setup"]["max_tokens"] == 8
    first = saved["prompts"][0]

    calls.clear()
    monkeypatch.setattr(bench, "_ours", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    code, err = main(monkeypatch, capsys, *args, "--resume")
    saved = json.loads(out.read_text())
    assert code == 0 and "resuming" in err and "1 of 2 prompts kept" in err
    assert calls == ["none", "none", "ngram"]                # only the second prompt ran (warm-up, then both)
    assert [p["id"] for p in saved["prompts"]] == ["short", "second"] and saved["prompts"][0] == first
    assert saved["geomean_ratio"]["none"] == 1.0

    # the same file again without --resume: refused, so a finished part is never overwritten by mistake
    code, err = main(monkeypatch, capsys, *args)
    assert code == 2 and f"{out} holds a run with 2 prompts measured: give --resume" in err
    assert json.loads(out.read_text()) == saved
    # the same file with other settings, or a changed prompt
    code, err = main(monkeypatch, capsys, *args[:-4], "--max-tokens", "9", "--json", out, "--resume")
    assert code == 2 and "measured differently (max_tokens 8 then, 9 now)" in err and "Traceback" not in err
    prompts.write_text(json.dumps(SHORT) + "\n" + json.dumps(prompt("second", "Count: four five")) + "\n")
    calls.clear()
    code, err = main(monkeypatch, capsys, *args, "--resume")
    assert code == 0 and "1 of 2 prompts kept" in err and calls == ["none", "none", "ngram"]
    out.write_text('{"prompts": []}')
    code, err = main(monkeypatch, capsys, *args, "--resume")
    assert code == 2 and "not a run saved by 'localspec bench --json'" in err


def test_resume_needs_the_json_file(monkeypatch, capsys, smol_path, no_load):
    code, err = main(monkeypatch, capsys, "bench", "--target", smol_path, "--resume")
    assert code == 2 and "--resume continues the run saved in --json FILE: give --json too" in err


def test_trace_writes_each_run_of_our_methods(smol_engine, tmp_path):
    odd = prompt("a/b c", "Repeat exactly: alpha beta gamma delta")     # an id that is no file name
    (row,) = bench.run(smol_engine, [odd], methods=("none", "auto", "peer-2"), max_tokens=12, repeat=2,
                       trace_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"a_b_c.{m}.{i}.jsonl" for m in ("auto", "none")
                                                          for i in (1, 2)]     # our methods only, each repeat
    for m in ("none", "auto", "peer-2"):  # each repeat's speed is kept, the median (of 2: the faster) shown
        assert len(row.runs[m].tries) == 2 and row.runs[m].tps == max(row.runs[m].tries)
    for i in (1, 2):
        rounds = [json.loads(x) for x in (tmp_path / f"a_b_c.auto.{i}.jsonl").read_text().splitlines()]
        assert sum(r["emitted"] for r in rounds) == row.runs["auto"].tokens
        assert all(r["source"] in ("none", "ngram", "model") for r in rounds[:-1])  # the last: room for 1 token


def test_the_table_shows_how_far_repeats_move_and_the_file_keeps_each_run(tmp_path):
    """Spread: the fastest repeat over the slowest, per method, as the median over prompts and the largest;
    saved with the run and read back by --resume; absent without repeats (or in a file saved before)."""
    def row(pid, plain, auto):
        return bench.Row(pid, "chat", {"none": bench.Run(sorted(plain)[1], 9, "", tries=plain, ratio=1.0),
                                       "auto": bench.Run(sorted(auto)[1], 9, "", tries=auto, ratio=1.0)})

    rows = [row("a", [8.0, 8.4, 8.2], [9.0, 9.0, 9.9]), row("b", [8.0, 8.0, 8.8], [9.0, 9.0, 9.0]),
            row("c", [8.0, 8.16, 8.1], [9.0, 9.45, 9.0])]
    assert bench.spread(rows[0].runs["none"]) == pytest.approx(0.05)
    text = bench.table(rows)
    assert "| spread of repeats | 5% (≤ 10%) | 5% (≤ 10%) |" in text and "the noise under every ratio" in text
    settings = {"cpu": "x", "models": "y", "methods": ["none", "auto"], "max_tokens": 9, "temperature": 0.0,
                "seed": None, "repeat": 3}
    path, prompts = tmp_path / "run.json", [prompt(r.id, "Say hi") for r in rows]
    bench.save(path, bench.to_json(rows, settings=settings, keys={p["id"]: bench.prompt_key(p) for p in prompts}))
    back = bench.resumable(path, settings, prompts)
    assert [r.runs["none"].tries for r in back] == [[8.0, 8.4, 8.2], [8.0, 8.0, 8.8], [8.0, 8.16, 8.1]]
    assert bench.table(back) == text
    single = [bench.Row("a", "chat", {"none": bench.Run(8.0, 9, "", ratio=1.0)})]
    assert "spread" not in bench.table(single)


def test_within_the_run_prices_drafting_rounds_at_the_single_decodes_around_them():
    """A drafting round's tokens cost what the nearest single-token decodes did, so a machine that slows
    down halfway through a run does not move the figure; the draft time is charged, never priced as plain."""
    def single(s):
        return {"drafted": 0, "accepted": 0, "emitted": 1, "draft_s": 0.001, "verify_s": s}

    def drafted(s, emitted):
        return {"drafted": 4, "accepted": emitted - 1, "emitted": emitted, "draft_s": 0.002, "verify_s": s}

    assert bench.within_run([single(0.1)] * 20) == pytest.approx(2.0 / 2.02)  # never drafted: its own price
    # a round of 3 tokens in 0.2 s among 0.1 s decodes (plain: 0.3 s); then the machine halves its speed, and a
    # round of 3 tokens in 0.4 s among 0.2 s decodes (plain: 0.6 s): each priced by its own neighbours
    fast, slow = [single(0.1)] * 16, [single(0.2)] * 16
    rounds = fast + [drafted(0.2, 3)] + fast + slow + [drafted(0.4, 3)] + slow
    plain, spent = 3.2 + 0.3 + 6.4 + 0.6, 3.2 + 0.202 + 6.4 + 0.402 + 64 * 0.001
    assert bench.within_run(rounds) == pytest.approx(plain / spent)
    assert bench.within_run([single(0.1)] * 15 + [drafted(0.2, 3)]) is None  # too few decodes to price by


def test_each_run_of_our_methods_is_priced_within_itself(smol_engine, tmp_path):
    """Plain prices at its own speed; a drafter's figure is the one its written trace gives; peers have none
    (no rounds to read); the table shows the row."""
    listing = prompt("list", "Write a Python function that checks whether a number is prime, with a docstring and "
                             "two tests.")  # some rounds drafted, most plain (16 at least, to price by)
    (row,) = bench.run(smol_engine, [listing], methods=("none", "ngram", "peer-2"), max_tokens=48, trace_dir=tmp_path)
    assert row.runs["none"].within == pytest.approx(1.0, abs=1e-3) and row.runs["peer-2"].within is None
    rounds = [json.loads(x) for x in (tmp_path / "list.ngram.1.jsonl").read_text().splitlines()]
    assert sum(r["drafted"] > 0 for r in rounds) > 0 and sum(r["drafted"] == 0 for r in rounds) >= 16
    assert row.runs["ngram"].within == bench.within_run(rounds) > 0
    assert "| within the run | 1.00x (≥ 1.00x) |" in bench.table([row])


def test_a_schema_past_llguidance_limits_fails_its_runs_and_the_bench_goes_on(smol_engine, monkeypatch):
    from llguidance import LLParserLimits

    from localspec.core import grammar

    monkeypatch.setattr(grammar, "_limits", lambda: LLParserLimits(max_lexer_states=40))
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    structured = prompt("person", "Describe a fictional person as JSON with name and age.") | {"schema": person}
    rows = bench.run(smol_engine, [structured, SHORT], methods=("none", "ngram"), max_tokens=16)
    assert all(rows[0].runs[m].failed.startswith("GrammarError: the constraint failed") for m in ("none", "ngram"))
    assert rows[1].runs["ngram"].failed is None and rows[1].runs["ngram"].tokens > 0
    assert "failed: GrammarError" in bench.table(rows, temperature=0.0, seed=None)


def test_auto_hist_drafts_from_the_prompts_before_it_and_only_those(smol_engine):
    """auto-hist is auto with the plain outputs of the earlier prompts as its history: nothing for the first
    prompt, the first's answer for the same question asked again; the engine's own history is left as it was."""
    ask = prompt("a", "Write a Python function that returns the n-th Fibonacci number.")
    rows = bench.run(smol_engine, [ask, ask | {"id": "b"}], methods=("none", "auto-hist"), max_tokens=48)
    first, again = (r.runs["auto-hist"] for r in rows)
    assert again.same_as_plain and first.same_as_plain
    assert again.acceptance and again.mean_accepted > (first.mean_accepted or 0.0)
    assert smol_engine.history is None


def test_the_first_token_floor_takes_prompts_that_arrive_together_shortest_first():
    """scripts/bench_concurrency.py's floor under the worst client's time to first token against alone."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_concurrency.py"
    spec = importlib.util.spec_from_file_location("bench_concurrency", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.ttft_floor([1.0]) == 1.0
    assert mod.ttft_floor([2.0, 2.0]) == 2.0  # one of two equal prompts waits for the other
    # 0.46 first (1x), 0.49 after it (1.94x), 0.81 after both (2.17x), 2.06 last (1.85x)
    assert mod.ttft_floor([0.81, 0.49, 0.46, 2.06]) == (0.46 + 0.49 + 0.81) / 0.81


def test_bench_prefix_builds_the_same_prompts_of_each_size_every_time(smol_engine, monkeypatch):
    """scripts/bench_prefix.py's prompts (not its timings): each kind's prefix is at most its size and close to
    it, built again it is the same, and two variants part within a block (neither matches the other's state)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_prefix.py"
    spec = importlib.util.spec_from_file_location("bench_prefix", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_prefix", mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    prompts = mod.Prompts(smol_engine.render_chat, smol_engine.tokenize)
    again = mod.Prompts(smol_engine.render_chat, smol_engine.tokenize)
    for kind in mod.KINDS:
        for size in (200, 500):
            a = prompts.prefix(kind, 0, size)
            assert 0.85 * size <= a.tokens <= size
        ids = [prompts.prompt(a, q) for q in range(len(mod.QUESTIONS))]
        assert all(mod.agree(ids[0], other) == a.tokens for other in ids[1:])  # the questions part right after it
        b = prompts.prefix(kind, 1, 200)
        assert 0.85 * 200 <= b.tokens <= 200 and mod.agree(prompts.prompt(b, mod.COLD), ids[0]) < mod.BLOCK
        assert again.prompt(again.prefix(kind, 1, 200), mod.COLD) == prompts.prompt(b, mod.COLD)
