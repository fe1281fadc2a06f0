"""scripts/oracle_bound.py end to end on SmolLM2 (tier 2): record real outputs, draft proposals and this host's
costs, then replay them on every cost curve (and profile the draft model's proposals once). The ceiling is a
bound: with perfect foresight over the same candidates, no policy that drafts from them (auto, and auto with
learned statistics) may beat it.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "oracle_bound.py"
PROMPTS = [
    {"id": "repeat", "messages": [{"role": "user", "content": "Repeat exactly, twice: the quick brown fox jumps."}]},
    {"id": "json", "messages": [{"role": "user", "content": "Give a JSON object with the name Ada and age 36."}],
     "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]}},
]


def test_record_then_replay_bounds_every_policy(smol_path, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    rec = tmp_path / "rec.json"
    subprocess.run([sys.executable, str(SCRIPT), "record", "--target", str(smol_path), "--draft", str(smol_path),
                    "--prompts", str(prompts), "--max-tokens", "24", "--threads", "2", "--draft-proposals",
                    "--out", str(rec)], check=True, capture_output=True, text=True, timeout=600)
    data = json.loads(rec.read_text())
    assert [r["id"] for r in data["runs"]] == ["repeat", "json"]
    assert "draft" in data["runs"][0] and "draft" not in data["runs"][1]   # no proposals under a grammar
    out = subprocess.run([sys.executable, str(SCRIPT), "replay", str(rec), "--costs", "all"], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    assert out.count("## costs:") == 5   # host, amd1, amd2, intel, zen1
    # the draft model's profile, once (it does not depend on the curve): only for the run it drafted in
    profile = [line for line in out.split("## costs:")[0].splitlines() if line.startswith(("| repeat", "| json"))]
    assert len(profile) == 1 and profile[0].startswith("| repeat")
    shares = [int(x) for x in re.findall(r"(\d+)%", profile[0])]
    assert len(shares) == 5 and all(0 <= x <= 100 for x in shares)
    header = next(line for line in out.split("## costs:")[1].splitlines() if line.startswith("| prompt |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[:4] == ["prompt", "oracle", "auto", "auto-warm"] and "model4" in cols
    rows = [line for line in out.split("## costs:", 1)[1].splitlines() if line.startswith(("| repeat", "| json"))]
    assert len(rows) == 10
    for line in rows:
        ratio = dict(zip(cols[1:], (float(x) for x in re.findall(r"(\d+\.\d+)x", line))))
        assert ratio["none"] == 1.0
        assert ratio["oracle"] >= max(ratio["auto"], ratio["auto-warm"], 1.0) - 1e-9, line
    assert out.count("auto-warm (statistics learned from the output in advance) captures") == 5
    # the per-prompt hindsight pick among the fixed drafters: the geomean of each prompt's best fixed column
    fixed = [c for c in cols if c in ("none", "ngram4", "ngram16", "model4")]
    for section in out.split("## costs:")[1:]:
        best = [max(v for c, v in zip(cols[1:], map(float, re.findall(r"(\d+\.\d+)x", line))) if c in fixed)
                for line in section.splitlines() if line.startswith(("| repeat", "| json"))]
        pick = float(re.search(r"picked in hindsight: (\d+\.\d+)x", section).group(1))
        assert len(best) == 2 and abs(pick - math.sqrt(best[0] * best[1])) < 0.015, section
    bare = [float(x) for x in re.findall(r"the ceiling without the draft model: (\d+\.\d+)x", out)]
    ceilings = [float(x) for x in re.findall(r"\| \*\*geomean\*\* \| \*\*(\d+\.\d+)x\*\*", out)]
    assert len(bare) == len(ceilings) == 5
    assert all(1.0 <= b <= c + 0.005 for b, c in zip(bare, ceilings))   # fewer candidates, never a higher bound
    # with the history of the runs before each, per workload: the ceiling with it bounds auto with it
    out = subprocess.run([sys.executable, str(SCRIPT), "replay", str(rec), "--costs", "host", "--history"],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    table = out[out.index("| workload |"):].splitlines()
    assert [line.split("|")[1].strip() for line in table[2:4]] == ["repeat", "json"]
    for line in table[2:4]:
        auto, hist, gain, ceiling, ceiling_hist, most = map(float, re.findall(r"(\d+\.\d+)x", line))
        assert ceiling_hist >= hist - 1e-9 and most >= gain - 0.005 and abs(gain - hist / auto) < 0.01, line


def _ceiling_seconds(fill_ms: float | None) -> tuple[float, float]:
    """The ceiling's seconds, with and without the draft model, on a made-up run whose draft model is always
    right and whose output never repeats itself."""
    sys.path.insert(0, str(SCRIPT.parent))
    import oracle_bound as ob

    out = list(range(100, 140))
    run = {"prompt": [1, 2, 3], "out": out, "draft": [(out[t:t + 4], [1.0] * len(out[t:t + 4])) for t in range(40)]}
    costs = ob.curve({1: 50, 2: 60, 5: 80, 17: 200}, 10.0, fill_ms=fill_ms)
    return ob.replay_one(run, costs, "oracle"), ob.replay_one(run, costs, "oracle-no-model")


def test_the_ceiling_pays_the_draft_models_catch_up():
    """A draft-model round pays for catching the draft's cache up over the tokens since it last ran, as auto's
    rounds do in the replay: the dearer that is, the lower the ceiling, down to the ceiling without the model."""
    free, bare = _ceiling_seconds(0.0)
    some, _ = _ceiling_seconds(5.0)
    dear, _ = _ceiling_seconds(1000.0)
    assert free < some < bare == dear
    # at no catch-up cost: every round drafts 4 tokens that hold and emits 5 (the last round what is left)
    assert math.isclose(free, 8 * (0.080 + 0.040), rel_tol=1e-6), free


def test_the_history_of_earlier_runs_raises_the_ceiling_and_auto_takes_part_of_it():
    """replay --history: a run whose output an earlier run already gave can draft it from the history; the
    ceiling with it is far above plain (the output never repeats itself, so without it nothing is drafted), auto
    with it beats auto without it, and stays under its ceiling."""
    sys.path.insert(0, str(SCRIPT.parent))
    import oracle_bound as ob

    out = list(range(100, 160))
    runs = [{"prompt": [1, 2, 3, 4], "out": out}, {"prompt": [5, 6, 3, 4], "out": out}]
    costs = ob.curve({1: 50, 2: 55, 5: 70, 17: 150}, 10.0)
    assert ob.earlier(runs, 0).size == 0
    history = ob.earlier(runs, 1)
    plain = ob.replay_one(runs[1], costs, "none")
    assert ob.replay_one(runs[1], costs, "oracle") == plain
    ceiling = ob.replay_one(runs[1], costs, "oracle-hist", history=history)
    auto, auto_hist = (ob.replay_one(runs[1], costs, p, history=history) for p in ("auto", "auto-hist"))
    assert ceiling < plain / 2 and ceiling <= auto_hist < auto == plain
