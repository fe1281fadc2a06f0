"""The CLI as a user runs it: a real process, real SmolLM2; bad input gets one line and exit code 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shared_calibration


def localspec(*args, stdin: str | None = None):
    env = dict(os.environ, NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "localspec", *map(str, args)], input=stdin,
                          capture_output=True, text=True, env=env, timeout=300)


def test_generate_streams_text_and_prints_stats(smol_path):
    r = localspec("generate", "--target", smol_path, "--draft", smol_path, "--chat", "What is 2+2?",
                  "--temperature", "0", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "lossless" in r.stderr and "drafter auto" in r.stderr


def test_a_sampled_run_says_its_seed_and_that_seed_gives_its_text_again(smol_path):
    """--seed's help said the stats show the seed a run used; the stats line did not (only --json had it)."""
    args = ("generate", "--target", smol_path, "--draft", smol_path, "Once upon a time", "--max-tokens", "12")
    first = localspec(*args)
    assert first.returncode == 0, first.stderr
    seed = int(first.stderr.split("\nseed ")[1].split()[0])
    again = localspec(*args, "--seed", seed)
    assert again.returncode == 0 and again.stdout == first.stdout and f"\nseed {seed} " in again.stderr
    greedy = localspec(*args, "--temperature", "0")
    assert greedy.returncode == 0 and "seed" not in greedy.stderr  # a greedy run's text has no seed in it


def test_generate_json_from_stdin(smol_path, tmp_path):
    r = localspec("generate", "-", "--target", smol_path, "--json", "--temperature", "0", "--max-tokens", "6",
                  "--drafter", "ngram", "--trace", tmp_path / "t.jsonl", stdin="The capital of France is")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "tokens", "from_draft", "finish_reason", "stats"}
    assert len(out["tokens"]) == len(out["from_draft"]) == 6 and out["finish_reason"] == "length"
    assert out["stats"]["drafter"] == "ngram" and out["stats"]["lossless"] is True
    rounds = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]  # --trace: a line a round
    assert len(rounds) == out["stats"]["rounds"] and sum(r["emitted"] for r in rounds) == 6


def test_stdin_prompt_loses_only_its_final_newline(smol_path):
    """A prompt piped in ends with the newline of its last line: that newline is not part of the prompt."""
    r = localspec("generate", "--target", smol_path, "--json", "--temperature", "0", "--max-tokens", "1",
                  "--drafter", "none", stdin="line one\nline two\n")
    arg = localspec("generate", "line one\nline two", "--target", smol_path, "--json", "--temperature", "0",
                    "--max-tokens", "1", "--drafter", "none")
    assert r.returncode == arg.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["prompt_tokens"] == json.loads(arg.stdout)["stats"]["prompt_tokens"]


def test_drafter_auto_is_a_choice_and_help_names_the_default():
    r = localspec("generate", "--help")
    assert "[auto|model|ngram|hybrid|none]" in r.stdout and "auto (the default" in " ".join(r.stdout.split())


def test_calibrate_shows_the_measured_curve(smol_path):
    r = localspec("calibrate", "--target", smol_path, "--draft", smol_path, "--n-ctx", "512")
    assert r.returncode == 0, r.stderr
    assert "batch" in r.stdout and "@256" in r.stdout and "draft:" in r.stdout and "llama.cpp:" in r.stdout


def test_threshold_is_reported_lossy(smol_path):
    r = localspec("generate", "hello", "--target", smol_path, "--draft", smol_path, "--accept", "threshold",
                  "--threshold", "0.3", "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["lossless"] is False


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, smol_path):
    d = tmp_path_factory.mktemp("bad")
    (d / "notgguf.gguf").write_bytes(b"this is not a model\n" * 10)
    with open(smol_path, "rb") as f:
        (d / "truncated.gguf").write_bytes(f.read(2_000_000))
    (d / "header.gguf").write_bytes(b"GGUF\x03\x00")  # cut inside the fixed header
    (d / "latin1.txt").write_bytes("café".encode("latin-1"))
    return d


BAD = {
    "missing file": (["--target", "/nonexistent/model.gguf", "hi"], "not found"),
    "a pair's name as a path": (["--target", "smollm2-self", "hi"], "is a pair in models.toml: pass --pair smollm2-self"),
    "not GGUF": (["--target", "{bad}/notgguf.gguf", "hi"], "not a GGUF file"),
    "truncated GGUF": (["--target", "{bad}/truncated.gguf", "hi"], "truncated or corrupt"),
    "incompatible pair": (["--target", "{smol}", "--draft", "{qwen_draft}", "hi"], "incompatible"),
    "empty prompt": (["--target", "{smol}", ""], "prompt is empty"),
    "prompt longer than n_ctx": (["--target", "{smol}", "--n-ctx", "256", "word " * 400], "n_ctx"),
    "k < 1": (["--target", "{smol}", "-k", "0", "hi"], "k (draft tokens per round) must be at least 1"),
    "temperature < 0": (["--target", "{smol}", "--temperature", "-1", "hi"], "temperature"),
    "top_p > 1": (["--target", "{smol}", "--top-p", "1.5", "hi"], "top_p"),
    "top_p = 0": (["--target", "{smol}", "--top-p", "0", "hi"], "top_p"),
    "model drafter without draft": (["--target", "{smol}", "--drafter", "model", "hi"], "needs a draft model"),
    "unknown llama.cpp setting": (["--target", "{smol}", "--target-kwarg", "n_gpu_layerz=1", "hi"],
                                  "unknown llama.cpp setting 'n_gpu_layerz'"),
    "llama.cpp setting not a number": (["--target", "{smol}", "--target-kwarg", "foo=bar", "hi"],
                                       "'foo=bar': 'bar' is not a number or true/false (KEY is a llama_model_params"),
    "--n-gpu-layers below -1": (["--target", "{smol}", "--n-gpu-layers", "-5", "hi"], "-5 is not in the range x>=-1"),
    "--system without --chat": (["--target", "{smol}", "--system", "be brief", "hi"], "--system needs --chat"),
    "GGUF cut in its header": (["--target", "{bad}/header.gguf", "hi"], "GGUF header is truncated (6 bytes)"),
    "llama.cpp setting of the wrong type": (["--target", "{smol}", "--target-kwarg", "n_ubatch=-1", "hi"],
                                            "n_ubatch=-1 does not fit its C type"),
    "n_batch 0 (llama.cpp aborted)": (["--target", "{smol}", "--target-kwarg", "n_batch=0", "hi"],
                                      "n_batch must be at least 1"),
    "prediction not UTF-8": (["--target", "{smol}", "--prediction", "{bad}/latin1.txt", "hi"], "is not UTF-8 text"),
    "grammar not UTF-8": (["--target", "{smol}", "--grammar", "{bad}/latin1.txt", "hi"], "is not UTF-8 text"),
    "trace into a missing folder": (["--target", "{smol}", "--trace", "{bad}/no/such/dir/t.jsonl", "hi"],
                                    "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2(case, bad_files, smol_path, qwen_paths):
    args, expect = BAD[case]
    args = [a.format(bad=bad_files, smol=smol_path, qwen_draft=qwen_paths[1]) for a in args]
    r = localspec("generate", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert any(expect in line for line in lines), r.stderr
    assert len(lines) <= 3  # one error line (click usage errors add a usage and a hint line)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_stdin_that_is_not_utf8_is_one_clear_error(command, smol_path):
    r = subprocess.run([sys.executable, "-m", "localspec", command, "--target", str(smol_path), "--max-tokens",
                        "2"], input="café\n".encode("latin-1"), capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and "stdin is not UTF-8 text (byte 0xe9" in err and "Traceback" not in err, err


def test_help_explains_flags():
    r = localspec("generate", "--help")
    assert r.returncode == 0
    for flag in ("--drafter", "--accept", "-k", "--p-min", "--threshold", "--temperature", "--top-p", "--top-k",
                 "--min-p", "--repeat-penalty", "--seed", "--max-tokens", "--n-ctx", "--threads",
                 "--n-gpu-layers", "--exact", "--chat", "--json", "--flash-attn", "--type-k", "--type-v",
                 "--n-ctx-draft", "--threads-draft", "--n-gpu-layers-draft", "--flash-attn-draft", "--type-k-draft",
                 "--type-v-draft", "--target-kwarg", "--draft-kwarg", "--pair", "--no-memory-check"):
        assert flag in r.stdout


def test_check_compatible_and_incompatible_pairs(smol_path, qwen_paths):
    good = localspec("check", *qwen_paths)
    assert good.returncode == 0, good.stderr
    assert good.stdout.count("pass ") == 5 and "compatible" in good.stdout
    bad = localspec("check", qwen_paths[0], smol_path)
    assert bad.returncode == 1
    assert "FAIL  vocab size difference <= 128" in bad.stdout
    assert "first difference at token 5" in bad.stdout
    named = localspec("check", "--target", qwen_paths[0], "--draft", smol_path)  # as the other commands take them
    assert named.returncode == 1 and named.stdout == bad.stdout
    both = localspec("check", qwen_paths[0], "--target", qwen_paths[0], smol_path)
    assert both.returncode == 2 and "not both" in both.stderr


def test_named_pair_loads_with_its_recommended_settings(smol_path):
    import localspec as ls

    with ls.load(pair="smollm2-self") as llm:
        assert llm.name == "smollm2-self"
        r = llm.generate("The capital of France is", max_tokens=8, temperature=0)
        assert r.stats.drafter == "auto" and r.stats.k == 16
        assert llm.target.n_ctx == 2048


def test_memory_check_refuses_what_cannot_fit(smol_path):
    r = localspec("generate", "hi", "--target", smol_path, "--n-ctx", "4000000")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--n-ctx" in r.stderr and "--no-memory-check" in r.stderr


@pytest.mark.slow  # the slow tier (CI runs it): the default run stays within minutes
def test_bench_end_to_end_json(smol_path, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "kind": k, "messages": [{"role": "user", "content": c}]})
                                 for i, (k, c) in enumerate([("generate", "Write a haiku about the sea."),
                                                             ("edit", "Repeat exactly: alpha beta gamma delta")])))
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "localspec", "bench", "--target", str(smol_path), "--draft",
                        str(smol_path), "--prompts", str(prompts), "--max-tokens", "16", "--json", str(out),
                        "--n-ctx", "1024"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LOCALSPEC_HOME=str(shared_calibration(tmp_path / "home"))))
    assert r.returncode == 0, r.stderr
    assert "| prompt | plain | model | ngram | hybrid | auto | peer-2 | peer-10 |" in r.stdout
    data = json.loads(out.read_text())
    assert [p["id"] for p in data["prompts"]] == ["p0", "p1"]
    for p in data["prompts"]:
        assert set(p["methods"]) == {"none", "model", "ngram", "hybrid", "auto", "peer-2", "peer-10"}
        for m in p["methods"].values():
            assert {"tps", "ratio", "acceptance", "mean_accepted", "same_as_plain", "outside_decode"} <= set(m)
        assert p["methods"]["none"]["ratio"] == 1.0
    assert set(data["geomean_ratio"]) == set(data["prompts"][0]["methods"])


@pytest.mark.parametrize("path", [None, Path(__file__).resolve().parents[1] / "scripts" / "holdout_prompts.jsonl"])
def test_bench_prompt_sets_are_well_formed(path):
    from localspec.apps.bench import load_prompts

    rows = load_prompts(path)
    assert len({r["id"] for r in rows}) == len(rows) >= 8
    assert {r["kind"] for r in rows} == {"generate", "edit", "explain", "extract", "chat"}
    for r in rows:
        assert r["messages"][-1]["role"] == "user" and all(m["content"] for m in r["messages"])


def test_generate_with_a_prediction_file(smol_path, tmp_path):
    plain = localspec("generate", "1, 2, 3, 4,", "--target", smol_path, "--json", "--temperature", "0",
                      "--max-tokens", "16", "--drafter", "none")
    text = json.loads(plain.stdout)["text"]
    (tmp_path / "pred.txt").write_text(text)
    r = localspec("generate", "1, 2, 3, 4,", "--target", smol_path, "--json", "--temperature", "0",
                  "--max-tokens", "16", "--drafter", "ngram", "--prediction", tmp_path / "pred.txt")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == text and out["stats"]["accepted_prediction"] > 0
    r = localspec("generate", "1, 2, 3, 4,", "--target", smol_path, "--temperature", "0",
                  "--max-tokens", "16", "--drafter", "ngram", "--prediction", tmp_path / "pred.txt")
    st = out["stats"]
    assert f"(prediction {st['accepted_prediction']}/{st['drafted_prediction']})" in r.stderr, r.stderr
