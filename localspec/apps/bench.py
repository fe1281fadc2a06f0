"""`localspec bench`: every drafter against plain decoding, and llama-cpp-python's own prompt lookup, side by side.

Same max_tokens, temperature (greedy by default) and seed for every method. llama-cpp-python's peers run
with the engine's target settings: its threads, GPU layers, flash attention, KV types and `exact` (no
weight repacking, 32-token physical batches); other --target-kwarg settings are not carried over. Prompts
are taken one at a time; on each, every method runs in turn (interleaved, after a warm-up), with both KV
caches cleared before each run so no method reuses another's prompt. Speed is tokens/s from the first
emitted token to the last, for every method alike (prompt processing is excluded). Ratios are to plain
decoding in the same run. Our methods are read through the public Engine.stream, as users read it. A peer
that raises is reported as failed for that prompt, and the bench goes on.

A prompt line may carry a JSON Schema (`schema`): every method then runs constrained to it — ours through
json_schema=, llama-cpp-python's through its own grammar sampler (LlamaGrammar.from_json_schema, what its
create_chat_completion(response_format={"type": "json_object", "schema": ...}) uses), on the same prompt
tokens — and each output is validated against the schema (with `jsonschema`, when installed).

A prompt line may carry a `prediction` (Predicted Outputs: the text it expects back, e.g. the file being
edited): the method `auto-pred` is `auto` given it; every other method runs without it.

The method `auto-hist` is `auto` with a history (Engine history_mb) holding the plain outputs of the prompts
before it in the file, as an app's earlier requests would leave it: the `history` set is a workload that
repeats itself across requests. Every other method runs without a history.
"""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import re
import statistics
import time

from pathlib import Path
from typing import Callable, Sequence

from ..api.reasoning import span_for
from ..core.errors import LocalspecError
from ..core.grammar import GrammarError
from ..core.history import History, Learned
from ..core.model import KV_TYPES, default_threads
from ..core.sampling import SamplingParams
from ..store.memory import CTX_PAD
from .report import WITHIN_WINDOW, Row, Run, geomean, plot, spread, table  # noqa: F401 - the report, as bench.* read

PROMPTS = Path(__file__).with_name("prompts.jsonl")
STRUCTURED = Path(__file__).with_name("structured_prompts.jsonl")
EDITS = Path(__file__).with_name("edit_prompts.jsonl")
HISTORY = Path(__file__).with_name("history_prompts.jsonl")
SETS = {"structured": STRUCTURED, "edit": EDITS, "history": HISTORY}  # --prompts NAME for a shipped set
SET_METHODS = {"edit": ["auto-pred"], "history": ["auto-hist"]}  # what a set is for, added to the default methods
# auto-hist: auto drafting also from the outputs of the prompts before this one in the file (their plain runs),
# as an app's earlier requests (Engine history_mb); every other method runs without a history
OURS = ("none", "model", "ngram", "hybrid", "auto", "auto-pred", "auto-hist")
HISTORY_MB = 64
# llama-cpp-python: plain decoding ("peer"), and LlamaPromptLookupDecoding(num_pred_tokens=N)
PEERS = {"peer": 0, "peer-2": 2, "peer-10": 10}
METHODS = OURS + tuple(PEERS)
NEED_DRAFT = ("model", "hybrid")


class BenchError(LocalspecError):
    """A prompts file is malformed, or a method cannot run with the models loaded."""


def _is_prompt(r: object) -> bool:
    msgs = r.get("messages") if isinstance(r, dict) else None
    return (isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("kind", ""), str)
            and isinstance(r.get("schema", {}), dict) and isinstance(r.get("prediction", ""), str)
            and isinstance(msgs, list) and bool(msgs)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs))


def load_prompts(path: str | Path | None) -> list[dict]:
    """Prompts from a JSONL file (default: the shipped set): per line, an object with id, messages and kind."""
    path = Path(path or PROMPTS)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read {path}: {e}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError as e:
            raise BenchError(f"{path}:{n}: not JSON ({e})") from None
        if not _is_prompt(r):
            raise BenchError(f"{path}:{n}: expected an object with 'id' (a string), 'messages' (a list of "
                             f"{{role, content}} strings) and optionally 'kind' and 'schema' (a JSON Schema "
                             f"object), got {line.strip()[:60]}")
        rows.append(r)
    if not rows:
        raise BenchError(f"{path}: no prompts in it")
    return rows


def peer_settings(target) -> tuple[dict, dict]:
    """(llama_cpp.Llama keywords, llama_model_params fields Llama has no keyword for) that give a peer the
    settings localspec's target runs with."""
    cfg = target.cfg
    threads = cfg.kwargs.get("n_threads") or cfg.n_threads or default_threads()  # as Model resolves them
    kw = dict(n_threads=threads, n_threads_batch=cfg.kwargs.get("n_threads_batch") or threads,
              n_gpu_layers=cfg.n_gpu_layers, type_k=KV_TYPES[cfg.type_k], type_v=KV_TYPES[cfg.type_v],
              n_ubatch=32 if cfg.exact else 512,
              # Llama takes a bool (enabled/disabled); llama.cpp's auto enables it wherever it is supported
              flash_attn=target.flash_attn != "off")
    # llama.cpp's extra weight layouts as the target loaded (off in exact mode, or where AMX crashes the build)
    return kw, {} if target.extra_bufts else {"use_extra_bufts": False}


@contextlib.contextmanager
def _model_defaults(**fields):
    """While a peer loads, llama_model_default_params() (where Llama starts from) also sets these fields."""
    import llama_cpp.llama_cpp as C

    default = C.llama_model_default_params

    def params():
        mp = default()
        for key, value in fields.items():
            setattr(mp, key, value)
        return mp

    C.llama_model_default_params = params
    try:
        yield
    finally:
        C.llama_model_default_params = default


def load_peer(llm, n_ctx: int):
    """One llama_cpp.Llama for every peer method (each run sets its draft_model), with the engine's settings."""
    from llama_cpp import Llama

    kw, fields = peer_settings(llm.target)
    # With a draft model, Llama writes every position's logits into `scores`, which has n_batch (512) rows
    # unless logits_all: past 512 tokens it overflows (ValueError: could not broadcast input array ...).
    # It also sizes input_ids by the n_ctx asked for but clips drafts by llama.cpp's, padded to CTX_PAD.
    with _model_defaults(**fields):
        return Llama(str(llm.target.path), n_ctx=-(-n_ctx // CTX_PAD) * CTX_PAD, logits_all=True, verbose=False,
                     **kw)


def _ours(llm, tokens: list[int], method: str, max_tokens: int, temperature: float = 0.0,
          seed: int | None = None, schema: dict | None = None, prediction: str | None = None,
          trace: Callable[[dict], None] | None = None, span=None) -> Run:
    models = [m for m in (llm.target, llm.draft) if m is not None]
    for m in models:
        m.truncate(0)
    stream = llm.stream(tokens, max_tokens=max_tokens, temperature=temperature, seed=seed,
                        drafter="auto" if method in ("auto-pred", "auto-hist") else method, json_schema=schema,
                        prediction=prediction if method == "auto-pred" else None, trace=trace,
                        prompt_cache=False,  # each run prefills afresh, as the peers' do
                        **({"span": span} if span is not None else {}))
    n, text, t_first = 0, [], None
    try:
        for ev in stream:
            if t_first is None:
                t_first = time.perf_counter()
                decode0 = sum(m.decode_s for m in models)
            n += 1
            text.append(ev.text)
    except GrammarError as e:  # a schema past llguidance's limits ends this run, not the bench
        return Run(0.0, n, "".join(text), same_as_plain=None, failed=f"GrammarError: {' '.join(str(e).split())}")
    wall = time.perf_counter() - t_first if t_first else 0.0
    inside = sum(m.decode_s for m in models) - decode0 if t_first else 0.0
    s = stream.stats
    return Run((n - 1) / wall if wall > 0 else 0.0, n, "".join(text),
               s.acceptance_rate if s.drafted else None, s.mean_accepted if s.drafted else None,
               1.0 - inside / wall if wall > 0 else None,
               prediction=(s.accepted_prediction, s.drafted_prediction - s.accepted_prediction)
               if prediction is not None and method == "auto-pred" else None,
               spans={k: {"tps": p["tokens"] / p["seconds"] if p["seconds"] > 0 else 0.0, "tokens": p["tokens"],
                          "drafted": p["drafted"], "accepted": p["accepted"]} for k, p in s.spans.items()}
               if s.spans else None)




def within_run(rounds: list[dict], window: int = WITHIN_WINDOW) -> float | None:
    """A run's speed against plain decoding, priced inside the run itself (rounds: engine.trace_row dicts):
    the seconds its tokens would have taken decoded one at a time, over the seconds its rounds took (drafting
    and verifying). A round that drafted nothing is a plain decode, its own price; a drafting round's tokens
    are priced at the median decode of the `window` plain rounds nearest it in the run, so the machine's
    speed at that moment cancels out. Between separate runs a shared machine drifts by more than the ratios
    being measured (see spread); this figure is free of that drift, and assumes what the trace confirms, that
    a method's single-token decodes cost what plain's do. 1.0 for a run that never drafted; None for one with
    fewer than `window` plain rounds to price by."""
    single = [(i, r["verify_s"]) for i, r in enumerate(rounds) if r["drafted"] == 0]
    if len(single) < window:
        return None
    at = [i for i, _ in single]
    plain = spent = 0.0
    for i, r in enumerate(rounds):
        spent += r["draft_s"] + r["verify_s"]
        if r["drafted"] == 0:
            plain += r["verify_s"]
        else:
            lo = min(max(bisect.bisect(at, i) - window // 2, 0), len(single) - window)
            plain += r["emitted"] * statistics.median(s for _, s in single[lo:lo + window])
    return plain / spent if spent > 0 else None


def _peer(llama, tokens: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None,
          schema: dict | None = None) -> Run:
    llama.reset()
    s = SamplingParams(temperature=temperature)  # the engine's defaults for the rest
    n, text, t_first = 0, [], None
    try:
        grammar = None
        if schema is not None:
            from llama_cpp import LlamaGrammar

            grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        for chunk in llama.create_completion(tokens, max_tokens=max_tokens, temperature=s.temperature,
                                             top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, grammar=grammar,
                                             repeat_penalty=s.repeat_penalty, seed=seed, stream=True):
            if t_first is None:
                t_first = time.perf_counter()
            n += chunk["choices"][0]["finish_reason"] is None  # the last chunk only says why it ended
            text.append(chunk["choices"][0]["text"])
    except Exception as e:  # noqa: BLE001 - a peer's own bug ends its run, not the bench
        return Run(0.0, n, "".join(text), same_as_plain=None, failed=f"{type(e).__name__}: {' '.join(str(e).split())}")
    wall = time.perf_counter() - t_first if t_first else 0.0
    return Run((n - 1) / wall if wall > 0 else 0.0, n, "".join(text))


def run(llm, prompts: list[dict], *, methods=METHODS, max_tokens: int = 256, temperature: float = 0.0,
        seed: int | None = None, repeat: int = 1, log: Callable[[str], None] = lambda s: None,
        done: Sequence[Row] = (), on_row: Callable[[list[Row]], None] = lambda rows: None,
        trace_dir: str | Path | None = None, reasoning_budget: int | None = None) -> list[Row]:
    """Run every method on every prompt; the plain run ('none') is always included as the baseline.

    Rows in `done` (a saved run being resumed) are kept for their prompts, which are not run again; after
    each prompt, `on_row` gets the rows so far (kept and new, in prompt order), so a caller can save them.
    Each run of our methods is also priced inside itself (Run.within, within_run; with repeats the median).
    With `trace_dir`, each run of our methods writes its rounds there (trace_path; one engine.trace_row per
    line), after the run, so the writing is not timed. A reasoning model's thinking and answer are measured
    apart (Run.spans), its thinking cut at `reasoning_budget` tokens where given.

    With repeat > 1 the methods of a prompt run `repeat` times, in an order rotated each time (a method
    that heats the CPU does not always precede the same one), and each keeps its median speed, so a burst
    of other work on the machine does not decide a ratio; each run's speed is kept too (Run.tries), so the
    table can show how far repeats of the same run move (spread). At temperature > 0 every method samples,
    peers too, with `seed` when given; outputs are compared with plain's only where that means something
    (T = 0, or our methods with a seed).
    """
    methods = ("none",) + tuple(m for m in methods if m != "none")
    kept = {r.id: r for r in done}
    if llm.draft is None and (need := [m for m in methods if m in NEED_DRAFT]):
        raise BenchError(f"method {need[0]!r} needs a draft model: load one (--draft) or leave it out of --methods")
    prompt_tokens = [llm.chat_tokens(p["messages"]) for p in prompts]
    spans = [span_for(llm, p["messages"], budget=reasoning_budget) for p in prompts]  # each span measured apart
    peer = None
    if any(m in PEERS for m in methods):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        peer = load_peer(llm, max(len(t) for t in prompt_tokens) + max_tokens + max(PEERS.values()) + 1)
    if "auto" in methods:
        llm.calibration()  # calibrate (once per machine and models) before anything is timed
    rows, earlier = [], []  # earlier: (prompt tokens, plain output) of the prompts before, for auto-hist
    learned = Learned()  # what auto-hist learned of drafting from the history, carried on as a scope's is
    own_history = llm.history
    for p, tokens, span in zip(prompts, prompt_tokens, spans):
        if p["id"] in kept:
            rows.append(kept[p["id"]])
            earlier.append((tokens, llm.tokenize(kept[p["id"]].runs["none"].text, add_special=False,
                                                 parse_special=False)))
            continue
        _ours(llm, tokens, "none", 8)  # warm-up
        row = Row(p["id"], p.get("kind", ""))
        tries: dict[str, list[Run]] = {m: [] for m in methods}
        for i in range(repeat):
            for m in methods[i % len(methods):] + methods[:i % len(methods)]:  # rotated each time
                schema = p.get("schema")
                if m in PEERS:
                    peer.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=PEERS[m]) if PEERS[m] else None
                    r = _peer(peer, tokens, max_tokens, temperature, seed, schema)
                else:
                    rounds = []
                    llm.history = _history(earlier, learned) if m == "auto-hist" else None  # its own run is not kept
                    try:
                        r = _ours(llm, tokens, m, max_tokens, temperature, seed, schema, p.get("prediction"),
                                  rounds.append, span)
                    finally:
                        llm.history = own_history
                    r.within = within_run(rounds)
                    if trace_dir is not None:
                        trace_path(trace_dir, p["id"], m, i).write_text(
                            "".join(json.dumps(x) + "\n" for x in rounds), encoding="utf-8")
                if schema is not None and not r.failed:
                    r.valid = valid(r.text, schema)
                tries[m].append(r)
                log(f"{p['id']:18s} {m:8s} " + (f"failed: {r.failed}" if r.failed else
                                                 f"{r.tps:6.1f} tok/s  {r.tokens} tokens"))
        for m, rs in tries.items():
            row.runs[m] = next((r for r in rs if r.failed), None) or sorted(rs, key=lambda r: r.tps)[len(rs) // 2]
            row.runs[m].tries = [r.tps for r in rs] if repeat > 1 else None
            inside = [r.within for r in rs if r.within is not None]
            row.runs[m].within = statistics.median(inside) if inside else None
        plain = row.runs["none"]
        earlier.append((tokens, llm.tokenize(plain.text, add_special=False, parse_special=False)))
        for m, r in row.runs.items():
            r.ratio = r.tps / plain.tps if plain.tps else 0.0
            # a sample is comparable only when it is no sample (T = 0) or when our seed drew it
            comparable = not r.failed and (temperature == 0 or (seed is not None and m not in PEERS))
            r.same_as_plain = r.text == plain.text if comparable else None
        rows.append(row)
        on_row(rows)
    if peer is not None:
        peer.close()
    return rows


def _history(earlier: list[tuple[list[int], list[int]]], learned: Learned):
    """A history holding the plain outputs of the prompts run before (what an app's earlier requests left), and
    what drafting from it was worth in the auto-hist runs before (SuffixCache.learned)."""
    h = History(HISTORY_MB)
    for prompt, output in earlier:
        h.record("", prompt, output)
    h.cache("").learned = learned
    return h


def trace_path(trace_dir: str | Path, prompt_id: str, method: str, i: int) -> Path:
    """DIR/PROMPT.METHOD.I.jsonl, the prompt id reduced to characters safe in a file name."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", prompt_id)[:80]
    return Path(trace_dir) / f"{safe}.{method}.{i + 1}.jsonl"


def valid(text: str, schema: dict) -> bool | None:
    """Whether text is JSON valid for the schema; None when jsonschema is not installed."""
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def setup(llm, *, methods, max_tokens: int, temperature: float, seed: int | None, repeat: int) -> dict:
    """What a run's figures depend on. A resumed run must match it: the same CPU, llama.cpp build, model
    files and their settings (threads, flash attention, ...; one key, as calibration keys its cache), and
    the same bench settings."""
    from ..store.machine import cpu_name as _cpu_name
    from ..store.calibration import cache_key

    return {"cpu": _cpu_name(), "models": cache_key(llm.target, llm.draft), "methods": list(methods),
            "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "repeat": repeat}


def prompt_key(p: dict) -> str:
    """A prompt's id and content: a saved row counts for a resumed run only if its prompt is unchanged."""
    return p["id"] + ":" + hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()[:16]


def to_json(rows: list[Row], *, temperature: float = 0.0, seed: int | None = None, settings: dict | None = None,
            keys: dict[str, str] | None = None) -> dict:
    """The results (without output texts). `settings` (setup()) and `keys` (prompt id -> prompt_key) make
    the file resumable."""
    methods = list(rows[0].runs) if rows else []
    return {"temperature": temperature, "seed": seed, "setup": settings,
            "prompts": [{"id": r.id, "kind": r.kind, "key": (keys or {}).get(r.id),
                         "methods": {m: {k: v for k, v in vars(run).items() if k != "text"}
                                     for m, run in r.runs.items()}} for r in rows],
            "geomean_ratio": {m: geomean(rows, m) for m in methods}}


def resumable(path: str | Path, settings: dict, prompts: list[dict]) -> list[Row]:
    """The rows of a run saved in `path` (to_json) that this run can keep: every prompt whose content is
    unchanged. Raises BenchError when the file is not a saved run or was measured differently."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        saved = data["setup"]
        entries = data["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"{path}: not a run saved by 'localspec bench --json' ({type(e).__name__}: {e}); "
                         "give another --json file, or delete this one to start over") from None
    if not isinstance(saved, dict):
        raise BenchError(f"{path}: saved without its settings (by an older localspec), so it cannot be resumed; "
                         "give another --json file")
    differ = [k for k in settings if saved.get(k) != settings[k]]
    if differ:
        what = ", ".join(f"{k} {saved.get(k)!r} then, {settings[k]!r} now" if k != "models" else
                         "models, their settings, the llama.cpp build or the host" for k in differ)
        raise BenchError(f"{path} was measured differently ({what}): its ratios cannot be mixed with this run's; "
                         "give the same settings, or another --json file to start a new run")
    keys = {prompt_key(p) for p in prompts}
    try:
        return [Row(e["id"], e["kind"], {m: Run(**{**v, "text": "", "prediction": tuple(v["prediction"])
                                                   if v.get("prediction") else None})
                                         for m, v in e["methods"].items()})
                for e in entries if e.get("key") in keys]
    except (KeyError, TypeError) as e:
        raise BenchError(f"{path}: a saved prompt is malformed ({type(e).__name__}: {e}); "
                         "give another --json file") from None


def saved_prompts(path: str | Path) -> int:
    """How many prompts a run saved in `path` holds (0: no such file, or not a saved run)."""
    try:
        prompts = json.loads(Path(path).read_text(encoding="utf-8")).get("prompts")
    except (OSError, ValueError, AttributeError):
        return 0
    return len(prompts) if isinstance(prompts, list) else 0


def save(path: str | Path, data: dict) -> None:
    """Write atomically: an interrupted write leaves the previous file whole (through a symlink, the file it
    points to)."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)
