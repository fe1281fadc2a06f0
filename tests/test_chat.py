"""`localspec chat` as a user meets it: the real program in a real pseudo-terminal, real SmolLM2 at T = 0.

A correct reply is the one a fresh engine gives for the same conversation; the stats line says how much of
each prompt was prefilled and how much came from the cache.
"""
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

import localspec
from localspec.apps.chat import Chat, Screen
from localspec.apps.conversation import DoesNotFit, drop_oldest_turns, parse_messages

from conftest import shared_calibration

N = 16  # max tokens per reply
ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-B]|[=>])")
STATS = re.compile(r"(\d+) tokens, [\d.]+ tok/s; .*?prompt (\d+) prefilled, (\d+) reused[^\r\n]*")
PROMPT = ">>>"  # prompt_toolkit draws the trailing space as a cursor move

# --exact makes a cached conversation answer exactly as a fresh engine does: besides turning off weight
# repacking it keeps physical batches under 64 tokens, where llama.cpp's CPU kernels change path.


def chat_args(smol, *extra, n_ctx=1024, max_tokens=N):
    return ["-m", "localspec", "chat", "--target", str(smol), "--draft", str(smol), "--drafter", "model",
            "--exact", "--n-ctx", str(n_ctx),
            "--temperature", "0", "--max-tokens", str(max_tokens), *extra]


_REFERENCE: dict[int, localspec.Engine] = {}  # per n_ctx: an engine without a prompt cache, emptied before each use


def fresh(smol, messages, *, max_tokens=N, n_ctx=1024):
    """(reply, prompt tokens) of a fresh engine for this conversation: one loaded for the module, without a prompt
    cache, its contexts emptied first (in exact mode its text is a freshly loaded engine's), decoding plain (in
    exact mode a drafted reply is plain decoding's)."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    llm = _REFERENCE.get(n_ctx)
    if llm is None:
        llm = _REFERENCE[n_ctx] = localspec.load(target=smol, draft=smol, n_ctx=n_ctx, exact=True, prompt_cache_mb=0,
                                                 prompt_cache_disk_mb=0)
    llm.target.truncate(0)
    llm.draft.truncate(0)
    tokens = llm.chat_tokens(msgs)
    return llm.generate(tokens, temperature=0, max_tokens=max_tokens, drafter="none").text, len(tokens)


@pytest.fixture(scope="module", autouse=True)
def _close_the_reference():
    yield
    while _REFERENCE:
        _REFERENCE.popitem()[1].close()


def norm(text: str) -> str:
    return " ".join(ANSI.sub("", text).replace("\r", "").split())


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", NO_COLOR="1", TERM="xterm",
                LOCALSPEC_HOME=str(shared_calibration(tmp_path / "home")))


def spawn(smol, env, *extra, preexec_fn=None, **kw):
    child = pexpect.spawn(sys.executable, chat_args(smol, *extra, **kw), env=env, encoding="utf-8",
                          timeout=90, dimensions=(50, 250), preexec_fn=preexec_fn)
    child.logfile_read = io.StringIO()
    child.expect_exact(PROMPT)
    return child


def ask(child, text):
    """Send a message; (what the terminal showed before the stats line, prefilled, reused)."""
    child.sendline(text)
    child.expect(STATS)
    shown, m = child.before, child.match
    child.expect_exact(PROMPT)
    return shown, int(m.group(2)), int(m.group(3))


def command(child, line):
    """Send a line; what the terminal showed between its echo and the next prompt."""
    child.sendline(line)
    child.expect_exact("\r\n")  # prompt_toolkit redraws the prompt while echoing, then accepts the line
    child.expect_exact(PROMPT)
    return ANSI.sub("", child.before)


def quit_with(child, key):
    child.sendcontrol(key)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.logfile_read.getvalue()[-2000:]
    assert "Traceback" not in child.logfile_read.getvalue()


def test_replies_equal_a_fresh_engine_and_the_second_turn_reuses_the_cache(smol_path, env):
    child = spawn(smol_path, env)
    u1 = {"role": "user", "content": "What is the capital of France?"}
    shown, p1, r1 = ask(child, u1["content"])
    a1, n1 = fresh(smol_path, [u1])
    assert norm(shown).endswith(norm(a1))
    assert (p1, r1) == (n1, 0)  # the whole prompt is prefilled, nothing cached yet

    u2 = {"role": "user", "content": "And of Italy?"}
    shown, p2, r2 = ask(child, u2["content"])
    a2, n2 = fresh(smol_path, [u1, {"role": "assistant", "content": a1}, u2])
    assert norm(shown).endswith(norm(a2))
    assert p2 + r2 == n2 and r2 >= n1 - 1 and p2 <= n2 - n1  # only the new turn is prefilled

    out = command(child, "/stats")
    assert "2 replies (0 interrupted)" in out and f"prompt {p1 + p2} prefilled, {r2} reused" in out
    assert re.search(r"conversation \d+/1024 tokens of context", out)
    assert "conversation 0/1024" in command(child, "/reset") + command(child, "/stats")  # the reset counts
    quit_with(child, "d")


def test_ctrl_c_keeps_the_partial_reply_and_the_chat_goes_on(smol_path, env, tmp_path):
    # started with SIGINT ignored, as a script's `cmd &` or nohup starts it (CI did): Ctrl-C still stops a reply
    child = spawn(smol_path, env, max_tokens=400, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    u1 = {"role": "user", "content": "Write a long story about a brave knight and a dragon."}
    start = fresh(smol_path, [u1], max_tokens=6)[0].strip().splitlines()[0][:10]
    child.sendline(u1["content"])
    child.expect_exact(start)  # the reply is streaming
    child.sendcontrol("c")
    child.expect(STATS)
    assert "interrupted" in child.match.group(0)
    generated = int(child.match.group(1))
    assert generated < 400
    child.expect_exact(PROMPT)
    assert "max_tokens = 24" in command(child, "/set max_tokens 24")

    u2 = {"role": "user", "content": "What is the knight's name?"}
    shown, p2, r2 = ask(child, u2["content"])
    assert r2 > 0
    saved = tmp_path / "conv.json"
    command(child, f"/save {saved}")
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    partial = messages[1]
    assert partial["interrupted"] is True and set(partial) == {"role", "content", "interrupted"}
    # the partial reply is what the model said up to the interrupt, with no marker in the text
    assert partial["content"].lstrip().startswith(start)
    assert fresh(smol_path, [u1], max_tokens=generated)[0].startswith(partial["content"])
    assert "interrupted" not in messages[3]

    a2, _ = fresh(smol_path, messages[:3], max_tokens=24)  # as /set made it
    assert messages[3]["content"] == a2 and norm(shown).endswith(norm(a2))
    assert "1 interrupted" in command(child, "/stats")
    child.sendcontrol("c")  # at an empty prompt, with a conversation: a hint, not the end of it
    child.expect_exact("Ctrl-D or /exit leaves")
    child.expect_exact(PROMPT)
    quit_with(child, "d")


def test_save_load_round_trip_draft_colours_and_hints(smol_path, env, tmp_path):
    del env["NO_COLOR"]
    child = spawn(smol_path, env, "--show-draft")
    assert "system prompt set" in command(child, "/system You answer in one short sentence.")
    u1 = "Name a primary colour."
    shown, _, _ = ask(child, u1)
    assert "\x1b[32m" in shown  # draft tokens are coloured (the target drafts for itself: nearly all)

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert "saved 3 messages" in command(child, f"/save {a}")
    command(child, "/reset")
    assert "loaded 3 messages" in command(child, f"/load {a}")
    command(child, f"/save {b}")
    saved = json.loads(a.read_text())
    assert saved == json.loads(b.read_text())
    assert [m["role"] for m in saved] == ["system", "user", "assistant"] and saved[1]["content"] == u1
    assert parse_messages(saved) == saved
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in saved]  # OpenAI's content parts
    assert parse_messages({"messages": parts}) == saved

    u2 = {"role": "user", "content": "Another one?"}
    shown, _, reused = ask(child, u2["content"])
    assert norm(shown).endswith(norm(fresh(smol_path, saved + [u2])[0])) and reused > 0

    (tmp_path / "bad.json").write_text('[{"role": "robot"}]')
    (tmp_path / "notjson.json").write_text("{")
    hints = {
        "/frobnicate": "unknown command /frobnicate: /help",
        "/set k abc": "k takes an integer",
        "/set temperature -1": "temperature",
        "/set nosuch 3": "unknown setting 'nosuch'",
        "/set drafter psychic": "drafter must be one of",
        "/draft maybe": "usage: /draft on|off",
        "/save": "usage: /save FILE",
        "/load /nonexistent/conv.json": "cannot read",
        f"/load {tmp_path / 'bad.json'}": "message 0 must be an object with role",
        f"/load {tmp_path / 'notjson.json'}": "is not a saved conversation",
    }
    for line, hint in hints.items():
        assert hint in command(child, line), line
    assert "temperature = 0.5" in command(child, "/set temperature 0.5")
    assert "Esc then Enter" in command(child, "/help")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.logfile_read.getvalue()


def test_multi_line_message_with_a_trailing_backslash(smol_path, env, tmp_path):
    child = spawn(smol_path, env, max_tokens=4)
    child.send("First line\\\r")
    child.expect_exact("...")  # the continuation prompt
    child.send("second line\r")
    child.expect(STATS)
    child.expect_exact(PROMPT)
    command(child, f"/save {tmp_path / 'm.json'}")
    assert json.loads((tmp_path / "m.json").read_text())[0]["content"] == "First line\nsecond line"
    quit_with(child, "d")


def test_non_interactive_one_message_per_line(smol_path):
    u1, u2 = "What is 2+2?", "And 3+3?"
    r = subprocess.run([sys.executable, *chat_args(smol_path, "--show-draft")], input=f"{u1}\n\n{u2}\n",
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, TERM="xterm"))
    assert r.returncode == 0, r.stderr
    a1, _ = fresh(smol_path, [{"role": "user", "content": u1}])
    a2, _ = fresh(smol_path, [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                              {"role": "user", "content": u2}])
    assert r.stdout == f"{a1}\n{a2}\n"  # replies only, no colour codes: stdout is not a terminal
    assert len(STATS.findall(r.stderr)) == 2 and "\x1b" not in r.stderr


@pytest.mark.slow  # the slow tier (CI runs it): the default run stays within minutes
def test_long_conversations_drop_the_oldest_turns(smol_path, tmp_path):
    questions = [f"Tell me a fact about the number {i}." for i in range(1, 8)]
    saved = tmp_path / "long.json"
    r = subprocess.run([sys.executable, *chat_args(smol_path, "--system", "Be brief.", n_ctx=256, max_tokens=24)],
                       input="\n".join(questions + ["word " * 300, f"/save {saved}"]) + "\n", capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, NO_COLOR="1"))
    assert r.returncode == 0, r.stderr
    assert "dropped the oldest" in r.stderr and len(STATS.findall(r.stderr)) == len(questions)
    assert "do not fit in n_ctx=256" in r.stderr and "Traceback" not in r.stderr  # too long even alone: skipped
    messages = json.loads(saved.read_text())  # the whole conversation: the dropped turns are marked, not lost
    assert messages[0] == {"role": "system", "content": "Be brief."} and "dropped from the model's context" in r.stderr
    assert [m["content"] for m in messages if m["role"] == "user"] == questions
    seen = [m for m in messages if not m.get("dropped")]
    assert seen[0] == messages[0] and seen[1]["role"] == "user" and len(seen) < len(messages)
    assert seen[-1]["content"] == fresh(smol_path, seen[:-1], n_ctx=256, max_tokens=24)[0]
    assert parse_messages(messages) == messages  # /load brings back the same context


def test_drop_oldest_turns_keeps_the_system_prompt_and_the_new_message():
    def conv(*roles):
        return [{"role": r, "content": str(i)} for i, r in enumerate(roles)]

    m = conv("system", "user", "assistant", "user", "assistant", "user")
    assert drop_oldest_turns(m, lambda x: len(x) <= 4) == 1
    assert [x["content"] for x in m] == ["0", "3", "4", "5"]
    m = conv("assistant", "user", "assistant", "user")  # a loaded conversation may start anywhere
    assert drop_oldest_turns(m, lambda x: len(x) <= 1) == 2 and [x["content"] for x in m] == ["3"]
    m = conv("system", *["user", "assistant"] * 4, "user")  # once some must go, down to `roomy` (slack)
    assert drop_oldest_turns(m, lambda x: len(x) <= 8, roomy=lambda x: len(x) <= 4) == 3
    assert [x["content"] for x in m] == ["0", "7", "8", "9"]
    m = conv("system", "user", "assistant", "user")       # slack stops at the newest message
    assert drop_oldest_turns(m, lambda x: len(x) <= 3, roomy=lambda x: False) == 1 and len(m) == 2
    assert drop_oldest_turns(conv("system", "user", "assistant", "user"), lambda x: True, roomy=lambda x: False) == 0
    m = conv("system", "user")
    with pytest.raises(DoesNotFit):
        drop_oldest_turns(m, lambda x: False)
    assert drop_oldest_turns(conv("user"), lambda x: True) == 0


def test_after_a_trim_the_next_turns_reuse_the_cached_conversation(smol_path):
    system = {"role": "system", "content": "Be brief."}
    with localspec.load(target=smol_path, n_ctx=256) as llm:   # a small context fills in a few turns
        chat = Chat(llm, {"max_tokens": 8, "temperature": 0, "drafter": "none"},
                    Screen(interactive=False, show_draft=False), system=system["content"])
        n_ctx = llm.target.n_ctx
        reused, prompt, trimmed_at = [], [], None
        for i in range(30):
            before = chat.totals.reused, chat.totals.prefilled
            chat.ask(f"Fact {i}: " + "the quick brown fox jumps over the lazy dog " * 3)
            reused.append(chat.totals.reused - before[0])
            prompt.append(reused[-1] + chat.totals.prefilled - before[1])
            if trimmed_at is None and chat.totals.dropped:
                trimmed_at, kept = i, len(llm.chat_tokens(chat.conv.in_context()))
            if trimmed_at is not None and i == trimmed_at + 2:
                break
    assert trimmed_at is not None, "the conversation never filled n_ctx"
    assert chat.totals.dropped > 1  # the trim dropped several turns at once
    for j in (trimmed_at + 1, trimmed_at + 2):  # the whole previous prompt comes from the cache
        assert reused[j] >= prompt[j - 1] - 1 > n_ctx // 4, (reused, prompt)
    assert kept < 0.6 * n_ctx  # trimmed with slack, to about half of n_ctx
    assert chat.conv.messages[0] == system


def test_set_json_schema_constrains_the_next_replies_and_off_frees_them(smol_path, tmp_path):
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}},
                                  "required": ["answer"], "additionalProperties": False}))
    lines = [f"/set json_schema {schema}", "What is 2+2?", "/set", "/set json_schema off", "What is 3+3?",
             "/set json_schema /nonexistent.json"]
    r = subprocess.run([sys.executable, *chat_args(smol_path, max_tokens=32)], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, TERM="xterm"))
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert set(json.loads(first)) == {"answer"}
    free, _ = fresh(smol_path, [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": first},
                                {"role": "user", "content": "What is 3+3?"}], max_tokens=32)
    assert second == free.split("\n")[0]  # the reply a free engine gives
    assert "json_schema = on (" in r.stderr and "json_schema=on (" in r.stderr and "json_schema = off" in r.stderr
    assert "cannot read /nonexistent.json" in r.stderr


def test_every_kind_of_constraint_can_be_shown_set_and_turned_off(smol_path):
    """Started with --regex, /set showed only json_schema and nothing turned the regex off."""
    lines = ["/set", "Give a number.", "/set json_object on", "/set", "Give an object.",
             '/set grammar root ::= "yes" | "no"', "/set", "Yes or no?", "/set grammar off", "/set"]
    r = subprocess.run([sys.executable, *chat_args(smol_path, "--regex", "[0-9]+", max_tokens=12)],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TERM="xterm"))
    assert r.returncode == 0, r.stderr
    number, obj, answer = r.stdout.splitlines()[:3]
    assert number.isdigit() and obj.startswith("{") and answer in ("yes", "no")
    shown = [line for line in r.stderr.splitlines() if line.startswith("max_tokens=")]
    assert "regex='[0-9]+', json_object=off" in shown[0]
    assert "regex=off, json_object=on" in shown[1]  # setting one constraint turns the others off
    assert "grammar=on (21 characters), regex=off, json_object=off" in shown[2]
    assert "json_schema=off, grammar=off, regex=off, json_object=off" in shown[3]


def test_an_unwritable_history_never_ends_the_chat_and_ctrl_c_leaves_only_before_the_first_message(smol_path, env):
    (Path(env["LOCALSPEC_HOME"]) / "chat_history").mkdir(parents=True)  # a directory where the file goes
    child = spawn(smol_path, env)
    child.sendcontrol("c")  # nothing said yet: Ctrl-C at the prompt leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    child = spawn(smol_path, env)
    shown, _, _ = ask(child, "Hello")
    assert "input history not saved" in child.logfile_read.getvalue()
    ask(child, "And again")
    quit_with(child, "d")


def test_a_reply_cut_by_a_full_context_says_so_not_max_tokens(smol_path, capsys):
    with localspec.load(target=smol_path, n_ctx=256) as llm:
        chat = Chat(llm, {"max_tokens": 1000, "temperature": 0, "drafter": "none"},
                    Screen(interactive=False, show_draft=False))
        chat.ask("Count from 1 to 1000, separated by commas.")
        assert "cut where the context filled up (n_ctx=256)" in capsys.readouterr().err
        chat.options["max_tokens"] = 4
        chat.ask("Again.")
        assert "cut at max_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("interactive", [True, False])
def test_a_second_ctrl_c_while_a_reply_is_put_away_keeps_it(smol_path, interactive, capsys):
    """Ctrl-C during the cleanup after a reply (caches rolled back, reply kept, stats) waited for it; in a
    terminal it is then dropped, from a pipe it still ends the program, after the cleanup."""
    handler = signal.getsignal(signal.SIGINT)
    with localspec.load(target=smol_path, n_ctx=512) as llm:
        chat = Chat(llm, {"max_tokens": 6, "temperature": 0, "drafter": "none"},
                    Screen(interactive=interactive, show_draft=False))
        end_reply = chat.screen.end_reply

        def interrupted_end_reply(text):
            # delivered here, as a key press would be: raise_signal runs the Python handler before it returns
            # (os.kill may land on one of llama.cpp's threads, and the main thread see it later)
            signal.raise_signal(signal.SIGINT)
            end_reply(text)

        chat.screen.end_reply = interrupted_end_reply
        if interactive:
            chat.ask("Say hi.")
        else:
            with pytest.raises(KeyboardInterrupt):
                chat.ask("Say hi.")
        assert [m["role"] for m in chat.conv.messages] == ["user", "assistant"]
        assert chat.totals.replies == 1 and "6 tokens" in "".join(capsys.readouterr())
        assert signal.getsignal(signal.SIGINT) is handler
        chat.screen.end_reply = end_reply
        chat.ask("Again.")  # the caches are in line: the next turn works
        assert len(chat.conv.messages) == 4
