"""Time to first token on a prompt whose head repeats: `localspec serve`'s prompt cache beside llama-server's
--cache-ram and llama-cpp-python's LlamaRAMCache / LlamaDiskCache, on one machine, in one run (issue 63).

    python scripts/bench_prefix.py [--pair NAME | --target PATH] [--sizes 500,2000,4000]
        [--systems ours,llama-server,llamacpp-ram,llamacpp-disk] [--kinds agent,document,conversation]
        [--repeats 3] [--llama-server PATH] [--out results.json]

Prefixes of each size (tokens of the target's tokenizer, the largest not over it) and three kinds, built
deterministically from this repository's own files: `agent`, a system prompt of tool definitions (JSON, one
per documented function of localspec/ and scripts/); `document`, files of the repo to answer questions about;
`conversation`, many turns about those functions. Each is rendered once with the target's chat template and
tokenized once; every system is sent the same token ids (/v1/completions, streamed, temperature 0, --max-tokens
tokens), each request's own question after the prefix. For each system, size and kind, in fresh processes
whose prompt caches start empty (ours: an empty $LOCALSPEC_HOME/kv in a temporary LOCALSPEC_HOME with the models
and calibration linked from the real one), time to the first streamed text:
  cold     the prefix's first request (after a warm-up, "Hello, world." as plain text: each process start gets
           one, so no time here is a process's first decode)
  warm     the same prefix again in the same process, a new question
  A/B      prefix B (another of the same size), then A again with a new question, at one slot
  restart  the server stopped and started again (its disk tier kept), A with a new question
and the ratios A/B / cold and restart / cold (done when both are <= 1/10 at 2,000 and 4,000 tokens).
llama-server and LlamaRAMCache keep nothing across a restart: cold by construction. LlamaDiskCache takes the
entry sharing the most tokens with a prompt out of its cache whether it loads it or not, and B shares the chat
template's first tokens with A: B's lookup takes A's state away, so its A after B is cold too. Then `no match` (ours
only): a new prefix every request, sent to a server with the default prompt cache and to one with
--no-prompt-cache, in alternating order, --repeats per size: their time to first token and total time (the
cache's keep at the end of a request is before the stream ends, so it is in the total; the disk write that
follows is on a writer thread, waited for before the next request and reported as `landed`). Last, `caps`
(ours only): --prompt-cache-mb / --prompt-cache-disk-mb small enough that states are evicted (default: 1.75
and 2.6 of the largest prompt's measured state), four new prefixes of the largest size and one of them again
(restored from disk), the server's VmRSS and the size of its kv folder sampled every 20 ms: peaks against the
caps (RSS growth over the no-match pass's --no-prompt-cache server's, which holds no states).

Peers: llama-server -np 1 --cache-ram 8192 (its default) -b 512 -ub 512, our -c, threads and flash attention
(-fa off on a CPU), built by scripts/build_llama_server.sh from the llama.cpp llama-cpp-python carries;
llama_cpp.Llama with LlamaRAMCache / LlamaDiskCache at their default capacities, our threads (n_threads and
n_threads_batch), flash attention and KV types, n_batch and n_ubatch 512, n_ctx ours, in a process of their own
(this script's --harness) so a restart is real. Ours: --parallel 1, its default threads and flash attention
(auto: off on a CPU; under those its measured costs are kept, else its server measures them first), --drafter
none by default (the first token is the prefill's whatever drafts after it; auto does not prefill the draft
model before it either). A restored state read from disk just
after it was written comes from the OS's page cache. Server logs go to $TMPDIR/bench_prefix.log. With the
default Qwen pair and the default sizes the run takes about an hour on 2 cores.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_concurrency import complete, free_port, wait_ready  # noqa: E402

from localspec.store import registry  # noqa: E402

KINDS = ("agent", "document", "conversation")
SYSTEMS = ("ours", "llama-server", "llamacpp-ram", "llamacpp-disk")
# a request's question after the prefix: each differs from the others at its first word
QUESTIONS = ("Summarise the above in one sentence.", "Which part of it would you read first, and why?",
             "Name one function mentioned above.", "What could go wrong here? One line.",
             "Give two keywords for it.")
COLD, WARM, AB, RESTART, B = 0, 1, 2, 3, 4  # which question each measurement asks
HOLE = "@@QUESTION@@"  # where the question goes in a rendered prompt (rendering once is most of the time)
BLOCK = 64  # two prefixes that must not match part within this many tokens (core.prefix.BLOCK)
GAP_S = 0.3  # between requests of the no-match and caps passes (after any disk write landed)


# ---- prompts ----
@dataclass(frozen=True)
class Function:
    path: str
    name: str
    args: tuple[str, ...]
    doc: str


def functions(root: Path = ROOT) -> list[Function]:
    """Every documented function of localspec/ and scripts/, in file and definition order."""
    out = []
    for path in sorted((root / "localspec").rglob("*.py")) + sorted((root / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                args = tuple(a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls"))
                out.append(Function(path.relative_to(root).as_posix(), node.name, args,
                                    " ".join(ast.get_docstring(node).split())))
    return out


def documents(root: Path = ROOT) -> list[tuple[str, str]]:
    """(path, text) of the repo's README, docs and code."""
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "localspec").rglob("*.py"))]
    return [(p.relative_to(root).as_posix(), p.read_text()) for p in paths if p.is_file()]


def _turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


class Corpus:
    """The repo's text, and each kind's messages for a variant: its units (tools, files, turns) and `chars`
    characters of filler after them. Variants start at different places, so two differ from their first
    words on."""

    def __init__(self, root: Path = ROOT):
        self.fns, self.docs = functions(root), documents(root)

    def _fns(self, start: int, n: int) -> list[Function]:
        return [self.fns[(start + i) % len(self.fns)] for i in range(n)]

    def _text(self, start: int) -> str:
        return "\n\n".join(f"# {p}\n{t}" for p, t in self.docs[start:] + self.docs[:start])

    def messages(self, kind: str, variant: int, n: int, chars: int) -> list[dict]:
        if kind == "agent":
            tools = [json.dumps({"type": "function", "function": {
                "name": f.name, "description": f.doc[:200],
                "parameters": {"type": "object", "properties": {a: {"type": "string"} for a in f.args[:6]}}}})
                for f in self._fns(variant * 29, n)]
            notes = self._text(variant % len(self.docs))[:chars]
            head = f"Tools of {self._fns(variant * 29, 1)[0].path} and more, for a coding agent."
            return [_turn("system", f"{head} Call one by answering with its JSON arguments.\n\n# Tools\n"
                            + "\n".join(tools) + (f"\n\n# Notes\n{notes}" if notes else ""))]
        if kind == "document":
            docs = self.docs[variant % len(self.docs):] + self.docs[:variant % len(self.docs)]
            parts = [f"# {p}\n{t}" for p, t in docs[:n]] + [f"# {docs[n % len(docs)][0]}\n"
                                                           f"{docs[n % len(docs)][1][:chars]}"] * (chars > 0)
            return [_turn("system", f"{docs[0][0]}, and files after it, to answer questions about.\n\n"
                          + "\n\n".join(parts))]
        if kind == "conversation":
            fns = self._fns(variant * 29 + len(self.fns) // 2, n + 1)
            msgs = [_turn("system", f"You help a developer read {fns[0].path}, one function at a time.")]
            for f in fns[:n]:
                msgs += [_turn("user", f"What does `{f.name}` in {f.path} do?"), _turn("assistant", f.doc[:600])]
            if chars:
                msgs += [_turn("user", f"Show me the start of {fns[n].path}."),
                         _turn("assistant", self._text(variant % len(self.docs))[:chars])]
            return msgs
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")


def agree(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Prefix:
    kind: str
    variant: int
    size: int  # asked for
    messages: list
    tokens: int  # the prompt tokens every question after it shares


class Prompts:
    """Prefixes of a size, and their prompts (token ids), with one tokenizer and chat template:
    render(messages) -> text, tokenize(text) -> ids."""

    def __init__(self, render: Callable[[list], str], tokenize: Callable[[str], list[int]], root: Path = ROOT):
        self.render, self.tokenize, self.corpus = render, tokenize, Corpus(root)

    def ids(self, messages: list, question: int | tuple[int, ...]) -> list[int] | list[list[int]]:
        """The prompt's token ids with that question after the messages (a list of them for a tuple: the
        template rendered once, each question put in its place)."""
        text = self.render(messages + [_turn("user", HOLE)])
        ids = [self.tokenize(text.replace(HOLE, QUESTIONS[q])) for q in (question if isinstance(question, tuple)
                                                                          else (question,))]
        return ids if isinstance(question, tuple) else ids[0]

    def measure(self, messages: list) -> int:
        return agree(*self.ids(messages, (0, 1)))

    def prefix(self, kind: str, variant: int, size: int) -> Prefix:
        """The kind's variant with the most units, then filler characters, whose prefix is not over `size`."""
        make = lambda n, chars: self.corpus.messages(kind, variant, n, chars)  # noqa: E731
        if self.measure(make(0, 0)) > size:
            raise ValueError(f"{size} tokens is too small for a {kind} prefix")
        lo, hi = 0, 1
        while self.measure(make(hi, 0)) <= size:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.measure(make(mid, 0)) <= size else (lo, mid)
        n, c_lo, c_hi = lo, 0, 8 * (size - self.measure(make(lo, 0))) + 16
        while c_hi - c_lo > 1:
            mid = (c_lo + c_hi) // 2
            c_lo, c_hi = (mid, c_hi) if self.measure(make(n, mid)) <= size else (c_lo, mid)
        msgs = make(n, c_lo)
        return Prefix(kind, variant, size, msgs, self.measure(msgs))

    def prompt(self, p: Prefix, question: int) -> list[int]:
        return self.ids(p.messages, question)


def check_apart(prompts: list[list[int]]) -> None:
    """Prompts that must not match each other part within BLOCK tokens."""
    for i, a in enumerate(prompts):
        for b in prompts[i + 1:]:
            if agree(a, b) >= BLOCK:
                raise SystemExit(f"two prefixes share {agree(a, b)} tokens: the corpus gave two variants alike")


# ---- systems ----
def mem(pid: int) -> dict:
    """VmRSS, VmHWM and RssAnon of a process, bytes (/proc: psutil is not needed)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def folder_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, f)).st_size
    return total


def kv_files(path: Path) -> set[str]:
    return {str(p) for p in path.rglob("*.kv")} if path.exists() else set()


class Server:
    """`localspec serve` or llama-server on a free port; streamed /v1/completions."""

    def __init__(self, argv: Callable[[int], list[str]], env: dict, log: Path):
        self.port = free_port()
        self.proc = subprocess.Popen(argv(self.port), stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT)
        try:
            wait_ready(self.port, self.proc)
        except BaseException:
            self.close()
            raise

    def request(self, ids: list[int], max_tokens: int) -> dict:
        r = complete(self.port, ids, max_tokens, timeout=1800)
        out = {"ttft": r["ttft"], "seconds": r["seconds"]}
        if r.get("usage"):
            u = r["usage"]
            out |= {"prompt_tokens": u.get("prompt_tokens"),
                    "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}
        if r.get("timings"):  # llama-server's: tokens its cache held (slot or --cache-ram)
            out["cached"] = r["timings"].get("cache_n", out.get("cached"))
        if r.get("localspec"):  # ours: where a restored state came from
            s = r["localspec"]
            out["tier"] = (s.get("prompt_restored_from") or ("kept" if s.get("prompt_reused") else ""))
        return out

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Harness:
    """llama_cpp.Llama with LlamaRAMCache or LlamaDiskCache in a process of its own (this script's --harness)."""

    def __init__(self, settings: dict, env: dict, log: Path):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--harness", json.dumps(settings)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "ab"), env=env,
                                     cwd=ROOT, text=True)
        if not json.loads(self.proc.stdout.readline() or "{}").get("ready"):
            self.close()
            raise SystemExit(f"the llama-cpp-python harness did not start (see {log})")

    def request(self, ids: list[int], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the llama-cpp-python harness died")
        return json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def harness(settings: dict) -> None:
    """--harness: load Llama with the cache, answer {"prompt", "max_tokens"} lines with time lines (and how much
    of the prompt its live context held, or a state its cache restored held)."""
    from llama_cpp import Llama, LlamaDiskCache, LlamaRAMCache

    from localspec.apps.bench import _model_defaults

    with _model_defaults(**settings["fields"]):
        llm = Llama(model_path=settings["model"], n_ctx=settings["n_ctx"], n_batch=512, verbose=False,
                    **settings["kw"])
    llm.set_cache(LlamaRAMCache() if settings["cache"] == "ram" else LlamaDiskCache(cache_dir=settings["cache_dir"]))
    loaded, load_state = [], llm.load_state
    llm.load_state = lambda state: (loaded.append(state.input_ids.tolist()), load_state(state))[1]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        live = agree(llm.input_ids.tolist(), req["prompt"])
        loaded.clear()
        t0 = time.perf_counter()
        first = None
        # read to the end: the cache keeps the state when the generator finishes
        for chunk in llm.create_completion(req["prompt"], max_tokens=req["max_tokens"], temperature=0.0,
                                           stream=True):
            if first is None and chunk["choices"][0]["text"]:
                first = time.perf_counter()
        end = time.perf_counter()
        cached, tier = (agree(loaded[-1], req["prompt"]), settings["cache"]) if loaded else (live, "kept" * (live > 0))
        print(json.dumps({"ttft": (first or end) - t0, "seconds": end - t0, "prompt_tokens": len(req["prompt"]),
                          "cached": cached, "tier": tier}), flush=True)


@dataclass
class System:
    name: str
    start: Callable[[], object]  # -> a running Server or Harness
    store: Path | None  # what it keeps across a restart (emptied before each cold start)

    def empty(self) -> None:
        if self.store is not None:
            shutil.rmtree(self.store, ignore_errors=True)


class Sampler:
    """Peaks of processes' VmRSS and of folders' sizes, every 20 ms, while it runs."""

    def __init__(self, pids: dict[str, int], folders: dict[str, Path]):
        self.pids, self.folders = pids, folders
        self.peak = {k: 0 for k in [*pids, *folders]}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.sample()

    def sample(self) -> None:
        for k, pid in self.pids.items():
            self.peak[k] = max(self.peak[k], mem(pid).get("VmRSS", 0))
        for k, path in self.folders.items():
            self.peak[k] = max(self.peak[k], folder_bytes(path))

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        self.sample()
        return self.peak


def landed(kv: Path, before: set[str], timeout: float = 30) -> float | None:
    """Seconds until a new state file is in kv and no write is half done (None: none came)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if kv_files(kv) - before and not any(p.name.endswith(".tmp") for p in kv.rglob("*")):
            return time.perf_counter() - t0
        time.sleep(0.01)
    return None


# ---- the passes ----
STEPS = (("cold", COLD), ("warm", WARM), ("b", B), ("ab", AB))  # in one process; then "restart" in the next


def cycle(system: System, ids: dict[str, list[int]], max_tokens: int, warm_up: list[int]) -> dict:
    """cold, warm, B and A after B in one process (its store emptied first), then A after a restart."""
    system.empty()
    out = {}
    for steps in ([s for s, _ in STEPS], ["restart"]):
        s = system.start()
        try:
            s.request(warm_up, 4)
            for step in steps:
                out[step] = s.request(ids[step], max_tokens) | {"sent": len(ids[step])}
        finally:
            s.close()
    return out


def no_match(on: System, off: System, prompts: list[tuple[int, list[int]]], kv: Path, max_tokens: int,
             warm_up: list[int]) -> dict:
    """A new prefix every request, to ours with the prompt cache and without, alternately first."""
    on.empty()
    servers = {"on": on.start(), "off": None}
    try:
        servers["off"] = off.start()
        base = {}
        for k, s in servers.items():
            s.request(warm_up, 4)
            base[k] = mem(s.pid).get("VmRSS", 0)
        sampler = Sampler({k: s.pid for k, s in servers.items()}, {"kv": kv})
        rows = []
        for i, (size, ids) in enumerate(prompts):
            row = {"size": size, "tokens": len(ids)}
            for k in ("on", "off") if i % 2 == 0 else ("off", "on"):
                before = kv_files(kv)
                row[k] = servers[k].request(ids, max_tokens)
                if k == "on":
                    row[k]["landed"] = landed(kv, before)
                time.sleep(GAP_S)
            rows.append(row)
        peak = sampler.stop()
        growth = {k: peak[k] - base[k] for k in servers}
    finally:
        for s in servers.values():
            if s is not None:
                s.close()
    return {"rows": rows, "rss_growth": growth, "kv_peak": peak["kv"]}


def caps(system: System, prompts: list[list[int]], again: list[int], kv: Path, max_tokens: int,
         warm_up: list[int]) -> dict:
    """New prefixes past the caps, then one of them again; peaks of RSS and of the kv folder."""
    system.empty()
    s = system.start()
    try:
        s.request(warm_up, 4)
        base = mem(s.pid).get("VmRSS", 0)
        sampler = Sampler({"rss": s.pid}, {"kv": kv})
        rows = []
        for ids in [*prompts, again]:
            before = kv_files(kv)
            r = s.request(ids, max_tokens)
            r["landed"] = landed(kv, before, timeout=5)
            r["kv_bytes"], r["rss"] = folder_bytes(kv), mem(s.pid).get("VmRSS", 0)  # settled, between requests
            rows.append(r)
            time.sleep(GAP_S)
        peak = sampler.stop()
        hwm = mem(s.pid).get("VmHWM", 0)
    finally:
        s.close()
    return {"rows": rows, "rss_base": base, "rss_peak": peak["rss"], "rss_hwm": hwm, "kv_peak": peak["kv"],
            "kv_final": folder_bytes(kv)}


# ---- the run ----
def machine() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def version(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except OSError as e:
        return f"unknown ({e})"
    return " ".join(line.strip() for line in (r.stdout + r.stderr).splitlines() if "version" in line) or "unknown"


def _s(v: float | None) -> str:
    return f"{v:7.2f}s" if v is not None else f"{'-':>8}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--harness", help=argparse.SUPPRESS)
    ap.add_argument("--pair", default=None, help="a pair from models.toml (default: the default pair)")
    ap.add_argument("--target", default=None, help="one GGUF file instead of a pair (no draft model)")
    ap.add_argument("--sizes", default="500,2000,4000")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=3, help="new prefixes per size in the no-match pass (0: skip)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=None, help="default: the pair's, else 4096 (raised to fit)")
    ap.add_argument("--drafter", default="none", help="ours: --drafter (none or auto; the first token is the same)")
    ap.add_argument("--cap-ram-mb", type=float, default=None, help="the caps pass's --prompt-cache-mb")
    ap.add_argument("--cap-disk-mb", type=float, default=None, help="the caps pass's --prompt-cache-disk-mb")
    ap.add_argument("--no-caps", action="store_true", help="skip the caps pass")
    ap.add_argument("--no-cycles", action="store_true", help="skip the cold/warm/A-B/restart cycles (the no-match "
                    "and caps passes alone)")
    ap.add_argument("--llama-server", default=None, help="the peer's binary (default: scripts/build_llama_server.sh's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.harness:
        return harness(json.loads(args.harness))
    # stopped (timeout, kill): through the finally blocks, which stop the servers this run started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import llama_cpp

    import localspec
    from localspec.apps.bench import peer_settings
    from localspec.core.llama import default_threads
    from localspec.store.download import resolve_pair

    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    systems = args.systems.split(",")
    for name in systems:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r}: one of {', '.join(SYSTEMS)}")
    threads = args.threads or default_threads()
    if args.target:
        target, draft, n_ctx = Path(args.target), None, args.n_ctx or 4096
    else:
        spec, target, draft = resolve_pair(args.pair)
        n_ctx = args.n_ctx or spec.n_ctx or 4096
    peer = args.llama_server
    if "llama-server" in systems and peer is None:
        peer = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_server.sh"), sys.executable],
                              check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    home = registry.scratch_home("localspec-bench-prefix-")
    os.environ["LOCALSPEC_HOME"] = str(home)
    kv = home / "kv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_prefix.log"

    # prompts, token ids and the settings the peers copy, with our own load of the target
    with localspec.load(target=target, n_ctx=n_ctx, n_threads=args.threads, prompt_cache_mb=0,
                        prompt_cache_disk_mb=0) as llm:
        prompts = Prompts(llm.render_chat, llm.tokenize)
        # plain text: it shares no first token with the prompts (LlamaDiskCache takes the entry sharing most with a
        # prompt out of the cache, used or not: a templated warm-up would take A's state before A's restart)
        warm_up = llm.tokenize("Hello, world.", add_special=False)
        pairs = {(k, n): (prompts.prefix(k, 0, n), prompts.prefix(k, 1, n)) for n in sizes for k in kinds}
        asked = {key: {step: prompts.prompt(b if step == "b" else a, q) for step, q in (*STEPS, ("restart", RESTART))}
                 for key, (a, b) in pairs.items()}
        fresh = [(n, prompts.prompt(prompts.prefix(kinds[i % len(kinds)], 2 + i, n), COLD))
                 for i, n in enumerate(n for n in sizes for _ in range(args.repeats))]
        big = [prompts.prompt(prompts.prefix(kinds[j % len(kinds)], 2 + j, max(sizes)), COLD) for j in range(4)]
        again = prompts.prompt(prompts.prefix(kinds[2 % len(kinds)], 4, max(sizes)), WARM)
        for a in asked.values():  # each (kind, size) runs in processes of its own: only A and B must part
            check_apart([a["cold"], a["b"]])
        check_apart([ids for _, ids in fresh])
        check_apart(big)
        longest = max([len(p) for a in asked.values() for p in a.values()] + [len(ids) for _, ids in fresh]
                      + [len(ids) for ids in big] + [len(again)])
        # a state's bytes: two tokens decoded, their per-token growth (what the caps pass's defaults scale by)
        seq = llm.target.seqs[0]
        seq.decode(warm_up[:1], logits="none")
        one = len(seq.state())
        seq.decode(warm_up[1:2], logits="none")
        per_token = len(seq.state()) - one
        seq.truncate(0)
        kw, fields = peer_settings(llm.target)
    state_mb = (one + per_token * (longest + args.max_tokens)) / 2 ** 20
    if longest + args.max_tokens + 8 > n_ctx:
        n_ctx = -(-(longest + args.max_tokens + 8) // 256) * 256
    digest = hashlib.sha256(json.dumps([[p.messages for p in ab] for ab in pairs.values()]).encode()).hexdigest()

    models = ["--target", str(target), *(["--draft", str(draft)] if draft else []), "--n-ctx", str(n_ctx),
              *(["--threads", str(threads)] if args.threads else [])]
    ours = [sys.executable, "-m", "localspec", "serve", *models, "--parallel", "1", "--drafter", args.drafter]
    # the peers get what ours resolved (its default threads; flash attention auto is off on a CPU): ours keeps
    # its default flags, under which its measured costs are kept (else its server measures them first, minutes)
    fa = "on" if kw["flash_attn"] else "off"
    repack = [] if fields.get("use_extra_bufts", True) else ["--no-repack"]

    def server(extra: list[str]) -> Callable[[], Server]:
        return lambda: Server(lambda port: ours + extra + ["--port", str(port)], env, log)

    def llama(cache: str, store: Path | None) -> Callable[[], Harness]:
        settings = {"model": str(target), "n_ctx": n_ctx, "kw": kw, "fields": fields, "cache": cache,
                    "cache_dir": str(store)}
        return lambda: Harness(settings, env, log)

    disk_store = home / "llamacpp-disk"
    table = {
        "ours": System("ours", server([]), kv),
        "llama-server": System("llama-server", lambda: Server(
            lambda port: [peer, "-m", str(target), "-c", str(n_ctx), "-np", "1", "-t", str(threads), "-tb",
                          str(threads), "-fa", fa, "-b", "512", "-ub", "512", "--cache-ram", "8192",
                          "--port", str(port), "--no-webui", *repack], env, log), None),
        "llamacpp-ram": System("llamacpp-ram", llama("ram", None), None),
        "llamacpp-disk": System("llamacpp-disk", llama("disk", disk_store), disk_store),
    }
    info = {"cpu": machine(), "cores": os.cpu_count(), "threads": threads, "llama_cpp_python": llama_cpp.__version__,
            "llama_server": version([peer, "--version"]) if peer else None,
            "localspec": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
            "target": str(target), "draft": str(draft) if draft else None, "drafter": args.drafter, "n_ctx": n_ctx,
            "n_batch": 512, "n_ubatch": 512, "flash_attn": fa, "max_tokens": args.max_tokens,
            "loadavg_start": os.getloadavg(), "prompts_sha256": digest}
    print(f"{info['cpu']} ({info['cores']} cores), threads {threads}; llama-cpp-python {info['llama_cpp_python']}, "
          f"llama-server {info['llama_server']}; localspec {info['localspec']}; target {target.name}"
          f"{f', draft {draft.name}' if draft else ''}, drafter {args.drafter}; n_ctx {n_ctx}, batch 512/512, "
          f"flash attention {fa}; {args.max_tokens} tokens a request; logs in {log}", file=sys.stderr, flush=True)

    if "ours" in systems:  # its server measures its costs before it answers: once per machine, not in a timeout
        print("ours: its speculation costs, measured first where not kept (once per machine and settings, minutes)",
              file=sys.stderr, flush=True)
        with open(log, "ab") as f:
            subprocess.run([sys.executable, "-m", "localspec", "calibrate", *models], env=env, cwd=ROOT, stdout=f,
                           stderr=subprocess.STDOUT, check=True)
    cycles, nm, cap = [], None, None

    def save() -> None:  # after every step: a run stopped half-way keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps({"info": info, "sizes": sizes, "kinds": kinds, "systems": systems,
                                                  "cycles": cycles, "no_match": nm, "caps": cap}, indent=1))

    for n in [] if args.no_cycles else sizes:
        for k in kinds:
            a, b = pairs[k, n]
            for name in systems:
                r = cycle(table[name], asked[k, n], args.max_tokens, warm_up)
                cycles.append({"system": name, "size": n, "kind": k, "tokens": a.tokens, "b_tokens": b.tokens, **r})
                save()
                print(f"  {name:>13} {n:>5} {k:<12} cold {r['cold']['ttft']:.2f}s warm {r['warm']['ttft']:.2f}s "
                      f"A/B {r['ab']['ttft']:.2f}s restart {r['restart']['ttft']:.2f}s", file=sys.stderr, flush=True)

    if "ours" in systems and args.repeats > 0:
        off = System("ours-off", server(["--no-prompt-cache"]), None)
        nm = no_match(table["ours"], off, fresh, kv, args.max_tokens, warm_up)
        save()
    if "ours" in systems and not args.no_caps:
        ram_mb = args.cap_ram_mb or round(1.75 * state_mb, 1)
        disk_mb = args.cap_disk_mb or round(2.6 * state_mb, 1)
        capped = System("ours-capped", server(["--prompt-cache-mb", str(ram_mb), "--prompt-cache-disk-mb",
                                               str(disk_mb)]), kv)
        cap = caps(capped, big, again, kv, args.max_tokens, warm_up) | {"ram_cap_mb": ram_mb, "disk_cap_mb": disk_mb,
                                                                        "state_mb": state_mb}
    info["loadavg_end"] = os.getloadavg()
    save()
    report(info, cycles, nm, cap, sizes, kinds, systems)


def report(info: dict, cycles: list[dict], nm: dict | None, cap: dict | None, sizes, kinds, systems) -> None:
    print(f"\n{info['cpu']}, threads {info['threads']}; llama-cpp-python {info['llama_cpp_python']}; "
          f"llama-server {info['llama_server']}; load average {info['loadavg_start'][0]:.2f} at the start, "
          f"{info['loadavg_end'][0]:.2f} at the end")
    print(f"\n{'system':>13} {'size':>5} {'kind':<12} {'tokens':>6} {'cold':>8} {'warm':>8} {'A/B':>8} "
          f"{'restart':>8} {'A/B÷cold':>9} {'rst÷cold':>9}  cached (tier): warm, A/B, restart")
    for c in cycles:
        cold = c["cold"]["ttft"]
        how = ", ".join(("-" if c[m].get("cached") is None else str(c[m]["cached"]))
                        + (f" ({c[m]['tier']})" if c[m].get("tier") else "") for m in ("warm", "ab", "restart"))
        print(f"{c['system']:>13} {c['size']:>5} {c['kind']:<12} {c['tokens']:>6} {_s(cold)} {_s(c['warm']['ttft'])} "
              f"{_s(c['ab']['ttft'])} {_s(c['restart']['ttft'])} {c['ab']['ttft'] / cold:>9.3f} "
              f"{c['restart']['ttft'] / cold:>9.3f}  {how}")
    odd = [f"{c['system']} {c['size']} {c['kind']} {step}: {c[step]['prompt_tokens']} of {c[step]['sent']}"
           for c in cycles for step in ("cold", "warm", "b", "ab", "restart")
           if c[step].get("prompt_tokens") not in (None, c[step]["sent"])]
    if odd:
        print("prompt tokens a system counted differ from those sent: " + "; ".join(odd))
    print("\nworst ratio over the kinds (done: A/B and restart each <= 0.10 of cold at 2,000 and 4,000 tokens)")
    for name in systems:
        parts = []
        for n in sizes:
            rows = [c for c in cycles if c["system"] == name and c["size"] == n]
            if not rows:
                continue
            ab = max(c["ab"]["ttft"] / c["cold"]["ttft"] for c in rows)
            rs = max(c["restart"]["ttft"] / c["cold"]["ttft"] for c in rows)
            verdict = "" if n < 2000 else " (done)" if max(ab, rs) <= 0.1 else " (NOT done)"
            parts.append(f"{n}: A/B {ab:.3f}, restart {rs:.3f}{verdict}")
        print(f"{name:>13}  " + "; ".join(parts))
    if nm:
        print("\nno match (ours, a new prefix each request; prompt cache on vs --no-prompt-cache, alternating)")
        print(f"{'size':>5} {'n':>3} {'TTFT on':>9} {'off':>8} {'over':>7} {'total on':>9} {'off':>8} {'over':>7} "
              f"{'landed':>8}")
        for n in [*sizes, None]:
            rows = [r for r in nm["rows"] if n is None or r["size"] == n]
            if not rows:
                continue
            t = {k: sum(r[k]["ttft"] for r in rows) for k in ("on", "off")}
            s = {k: sum(r[k]["seconds"] for r in rows) for k in ("on", "off")}
            land = [r["on"]["landed"] for r in rows if r["on"].get("landed") is not None]
            print(f"{'all' if n is None else n:>5} {len(rows):>3} {_s(t['on'] / len(rows))} {_s(t['off'] / len(rows))} "
                  f"{t['on'] / t['off'] - 1:>+7.1%} {_s(s['on'] / len(rows))} {_s(s['off'] / len(rows))} "
                  f"{s['on'] / s['off'] - 1:>+7.1%} {_s(statistics.mean(land) if land else None)}")
        t = sum(r["on"]["ttft"] for r in nm["rows"]) / sum(r["off"]["ttft"] for r in nm["rows"]) - 1
        s = sum(r["on"]["seconds"] for r in nm["rows"]) / sum(r["off"]["seconds"] for r in nm["rows"]) - 1
        print(f"the prompt cache's cost with no match: TTFT {t:+.1%}, total {s:+.1%} "
              f"({'done' if max(t, s) < 0.02 else 'NOT done'}: < 2%)")
        g = nm["rss_growth"]
        print(f"RSS growth: on {g['on'] / 2**20:.0f} MB (default caps), off {g['off'] / 2**20:.0f} MB; "
              f"kv folder peak {nm['kv_peak'] / 2**20:.0f} MB")
    if cap:
        grown = (cap["rss_peak"] - cap["rss_base"]) / 2 ** 20
        off = nm["rss_growth"]["off"] / 2 ** 20 if nm else None
        share = (f", {grown - off:.0f} MB over the no-cache server's growth: "
                 f"{'under' if grown - off <= cap['ram_cap_mb'] else 'OVER'} the cap (a state being taken, restored "
                 "or written counts in it)" if off is not None else "")
        print(f"\ncaps (ours, {len(cap['rows']) - 1} new prefixes of {max(sizes)} tokens, then the third again; "
              f"a state ~{cap['state_mb']:.0f} MB)")
        settled = (max(r["rss"] for r in cap["rows"]) - cap["rss_base"]) / 2 ** 20
        print(f"RAM  cap {cap['ram_cap_mb']:.0f} MB: RSS grew {grown:.0f} MB at its peak{share}; {settled:.0f} MB "
              f"between requests at most (VmHWM {cap['rss_hwm'] / 2**20:.0f} MB, base "
              f"{cap['rss_base'] / 2**20:.0f} MB)")
        print(f"disk cap {cap['disk_cap_mb']:.0f} MB: kv folder peak {cap['kv_peak'] / 2**20:.0f} MB "
              f"({'under' if cap['kv_peak'] <= cap['disk_cap_mb'] * 2**20 else 'OVER'} the cap), "
              f"{cap['kv_final'] / 2**20:.0f} MB at the end")
        print("requests: " + ", ".join(f"{r['ttft']:.2f}s cached {r.get('cached')} ({r.get('tier') or 'none'})"
                                       for r in cap["rows"]))


if __name__ == "__main__":
    main()
