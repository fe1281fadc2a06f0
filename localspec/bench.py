"""`localspec bench`: every drafter against plain decoding, and llama-cpp-python's own prompt lookup, side by side.

Greedy, same threads, same max_tokens. Prompts are taken one at a time; on each, every method runs in turn
(interleaved, after a warm-up), with both KV caches cleared before each run so no method reuses another's
prompt. Speed is tokens/s from the first emitted token to the last, for every method alike (prompt
processing is excluded). Ratios are to plain decoding in the same run. Our methods are read through the
public Engine.stream, as users read it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PROMPTS = Path(__file__).with_name("prompts.jsonl")
OURS = ("none", "model", "ngram", "hybrid", "auto")
PEERS = {"peer-2": 2, "peer-10": 10}  # llama-cpp-python LlamaPromptLookupDecoding(num_pred_tokens=N)
METHODS = OURS + tuple(PEERS)


@dataclass
class Run:
    tps: float
    tokens: int
    text: str
    acceptance: float | None = None
    mean_accepted: float | None = None
    outside_decode: float | None = None  # share of wall time not inside llama_decode (either model)
    ratio: float = 0.0
    same_as_plain: bool = True


@dataclass
class Row:
    id: str
    kind: str
    runs: dict[str, Run] = field(default_factory=dict)


def load_prompts(path: str | Path | None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path or PROMPTS).read_text().splitlines() if line.strip()]
    for r in rows:
        if not {"id", "messages"} <= set(r):
            raise ValueError(f"{path}: each line needs 'id' and 'messages' (and optionally 'kind'): {r}")
    return rows


def _ours(llm, tokens: list[int], method: str, max_tokens: int) -> Run:
    models = [m for m in (llm.target, llm.draft) if m is not None]
    for m in models:
        m.truncate(0)
    stream = llm.stream(tokens, max_tokens=max_tokens, temperature=0, drafter=method)
    n, text, t_first = 0, [], None
    for ev in stream:
        if t_first is None:
            t_first = time.perf_counter()
            decode0 = sum(m.decode_s for m in models)
        n += 1
        text.append(ev.text)
    wall = time.perf_counter() - t_first if t_first else 0.0
    inside = sum(m.decode_s for m in models) - decode0 if t_first else 0.0
    s = stream.stats
    return Run((n - 1) / wall if wall > 0 else 0.0, n, "".join(text),
               s.acceptance_rate if s.drafted else None, s.mean_accepted if s.drafted else None,
               1.0 - inside / wall if wall > 0 else None)


def _peer(llama, tokens: list[int], max_tokens: int) -> Run:
    llama.reset()
    n, text, t_first = 0, [], None
    for chunk in llama.create_completion(tokens, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0,
                                         stream=True):
        if t_first is None:
            t_first = time.perf_counter()
        n += 1
        text.append(chunk["choices"][0]["text"])
    wall = time.perf_counter() - t_first if t_first else 0.0
    return Run((n - 1) / wall if wall > 0 else 0.0, n, "".join(text))


def run(llm, prompts: list[dict], *, methods=METHODS, max_tokens: int = 256, n_threads: int | None = None,
        repeat: int = 1, log: Callable[[str], None] = lambda s: None) -> list[Row]:
    """Run every method on every prompt; the plain run ('none') is always included as the baseline.

    With repeat > 1 the methods of a prompt run `repeat` times, in an order rotated each time (a method
    that heats the CPU does not always precede the same one), and each keeps its median speed, so a burst
    of other work on the machine does not decide a ratio.
    """
    methods = ("none",) + tuple(m for m in methods if m != "none")
    prompt_tokens = [llm.chat_tokens(p["messages"]) for p in prompts]
    peers = {}
    if any(m in PEERS for m in methods):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        n_ctx = max(len(t) for t in prompt_tokens) + max_tokens + 64
        threads = n_threads or llm.target.cfg.n_threads
        peers = {m: Llama(str(llm.target.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_gpu_layers=llm.target.cfg.n_gpu_layers, verbose=False,
                          draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PEERS[m]))
                 for m in methods if m in PEERS}
    if "auto" in methods:
        llm.auto_state()  # calibrate (once per machine and models) before anything is timed
    rows = []
    for p, tokens in zip(prompts, prompt_tokens):
        _ours(llm, tokens, "none", 8)  # warm-up
        row = Row(p["id"], p.get("kind", ""))
        tries: dict[str, list[Run]] = {m: [] for m in methods}
        for i in range(repeat):
            for m in methods[i % len(methods):] + methods[:i % len(methods)]:  # rotated each time
                r = _peer(peers[m], tokens, max_tokens) if m in PEERS else _ours(llm, tokens, m, max_tokens)
                tries[m].append(r)
                log(f"{p['id']:18s} {m:8s} {r.tps:6.1f} tok/s  {r.tokens} tokens")
        for m, rs in tries.items():
            row.runs[m] = sorted(rs, key=lambda r: r.tps)[len(rs) // 2]
        plain = row.runs["none"]
        for r in row.runs.values():
            r.ratio = r.tps / plain.tps if plain.tps else 0.0
            r.same_as_plain = r.text == plain.text
        rows.append(row)
    for peer in peers.values():
        peer.close()
    return rows


def geomean(rows: list[Row], method: str) -> float:
    return math.exp(sum(math.log(max(r.runs[method].ratio, 1e-9)) for r in rows) / len(rows))


def table(rows: list[Row]) -> str:
    """A Markdown table: tokens/s (ratio to plain) per prompt and method, acceptance, equality with plain."""
    methods = list(rows[0].runs)
    out = [f"| prompt | {' | '.join('plain' if m == 'none' else m for m in methods)} |",
           "|---" * (len(methods) + 1) + "|"]
    for row in rows:
        cells = []
        for m in methods:
            r = row.runs[m]
            cell = f"{r.tps:.1f}" if m == "none" else f"{r.tps:.1f} ({r.ratio:.2f}x)"
            if r.acceptance is not None:
                cell += f" {r.acceptance:.0%} {r.mean_accepted:.1f}/rd"
            if not r.same_as_plain:
                cell += " ≠"
            cells.append(cell)
        out.append(f"| {row.id} | {' | '.join(cells)} |")
    out.append(f"| geomean ratio | {' | '.join(f'{geomean(rows, m):.2f}x' for m in methods)} |")
    shares = {m: [r.runs[m].outside_decode for r in rows if r.runs[m].outside_decode is not None] for m in methods}
    out.append(f"| outside llama_decode | {' | '.join(f'{sum(v) / len(v):.1%}' if v else 'n/a' for v in shares.values())} |")
    out.append("\ntokens/s from first to last token; (ratio) to plain in this run; NN% = acceptance rate, "
               "N.N/rd = mean accepted draft tokens per drafting round; ≠ = output differs from plain's.")
    return "\n".join(out)


def to_json(rows: list[Row]) -> dict:
    methods = list(rows[0].runs)
    return {"prompts": [{"id": r.id, "kind": r.kind,
                         "methods": {m: {k: v for k, v in vars(run).items() if k != "text"}
                                     for m, run in r.runs.items()}} for r in rows],
            "geomean_ratio": {m: geomean(rows, m) for m in methods}}


def plot(rows: list[Row], path: str | Path) -> None:
    """Ratios to plain by prompt kind and method (needs matplotlib: pip install 'localspec[plot]')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in rows[0].runs if m != "none"]
    kinds = sorted({r.kind or r.id for r in rows})
    fig, ax = plt.subplots(figsize=(1.5 + 1.3 * len(kinds), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [math.exp(sum(math.log(r.runs[m].ratio) for r in rows if (r.kind or r.id) == k) /
                         sum(1 for r in rows if (r.kind or r.id) == k)) for k in kinds]
        ax.bar([j + i * width for j in range(len(kinds))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("speed / plain decoding")
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
