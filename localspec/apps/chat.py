"""`localspec chat`: a terminal chat over Engine.stream.

The conversation is a list of OpenAI-style messages. Each turn renders all of it with the target's chat
template and hands the tokens to the engine, which prefills only what its caches do not already hold, so a
turn costs its new tokens, not the whole conversation. An interrupted reply stays in the conversation as
far as it got, marked `interrupted: true` beside role and content, never inside the text the model sees;
the oldest turns, once dropped to make room in n_ctx, stay in it marked `dropped: true` (/save keeps them).
"""
from __future__ import annotations

import contextlib
import difflib
import signal
import sys
from pathlib import Path
from typing import Callable

from ..core.chat_template import ChatError
from ..core.engine import Engine
from ..core.errors import LocalspecError
from ..core.request import Request, make_request
from ..core.thinking import Span
from ..api.reasoning import Spans, markers_of, span_for
from .terminal import Lines, Prompt, Screen
from .conversation import (plain, DoesNotFit, drop_oldest_turns, Conversation, Totals, stats_line)


HELP = """\
/help              this help
/stats             session totals: tokens/s, acceptance, prompt tokens prefilled and reused
/reset             forget the conversation (the system prompt stays)
/system [TEXT]     show the system prompt, or replace it
/set [KEY VALUE]   show the settings, or change one: {keys}
                   (k is the most draft tokens per round; under the auto drafter, its upper bound;
                   json_schema FILE makes every reply valid JSON for that schema, off frees them)
/draft on|off      colour the tokens that came from the draft
/think on|off      a reasoning model: let it think before it answers, or not (where its template can say so)
/think budget N|off  at most N thinking tokens per reply (then its end is forced and it answers)
/think show        unfold the last reply's thinking (also Ctrl-O at the prompt); shown folded, dimmed
/save FILE         write the conversation as JSON (OpenAI messages; turns dropped from the context
                   are kept, marked "dropped": leave those out to send the file to an OpenAI API)
/load FILE         read a conversation written by /save
/exit              leave (also Ctrl-D; Ctrl-C at an empty prompt before the first message)

Multi-line messages: end a line with \\ to go on to the next, or press Esc then Enter for a new line.
Ctrl-C during a reply stops it; the partial reply stays in the conversation.
Start a message with // to send a line that begins with /."""


def _seed(value: str) -> int | None:
    return None if value.lower() == "none" else int(value)


def _schema(value: str) -> str | None:
    """/set json_schema FILE (or a schema typed inline) | off."""
    if value.lower() in ("off", "none", ""):
        return None
    if value.lstrip().startswith("{"):
        return value
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {value}: {e.strerror or e}") from None


def _off(value: str) -> bool:
    return value.lower() in ("off", "none", "")


def _grammar(value: str) -> str | None:
    """/set grammar FILE (or a one-line GBNF or Lark grammar typed inline) | off."""
    if _off(value):
        return None
    if "::=" in value or value.startswith("start:"):
        return value
    return _schema(value)


def _on_off(value: str) -> bool | None:
    if value.lower() not in ("on", "off"):
        raise ValueError(value)
    return True if value.lower() == "on" else None


# /set KEY VALUE: how each value is read (the engine then validates it, as for the command-line flags)
SETTINGS: dict[str, tuple[Callable[[str], object], str]] = {
    "max_tokens": (int, "an integer"), "k": (int, "an integer"), "temperature": (float, "a number"),
    "top_k": (int, "an integer"), "top_p": (float, "a number"), "min_p": (float, "a number"),
    "repeat_penalty": (float, "a number"), "frequency_penalty": (float, "a number"),
    "presence_penalty": (float, "a number"), "penalty_last_n": (int, "an integer"),
    "seed": (_seed, "an integer or none"), "drafter": (str, "a drafter name"), "accept": (str, "a rule name"),
    "p_min": (float, "a number"), "threshold": (float, "a number"),
    "json_schema": (_schema, "a JSON Schema file (or the schema itself) or off"),
    "grammar": (_grammar, "a GBNF or Lark grammar file (or a one-line grammar) or off"),
    "regex": (lambda v: None if _off(v) else v, "a regular expression or off"),
    "json_object": (_on_off, "on or off"),
}
CONSTRAINTS = ("json_schema", "grammar", "regex", "json_object")  # at most one is on: setting one turns the rest off


def _show(key: str, value) -> str:
    if key in CONSTRAINTS:
        return "off" if not value else "on" if value is True else repr(value) if key == "regex" and len(value) <= 60 \
            else f"on ({len(value)} characters)"
    return "default" if value is None else str(value)


# ---- the chat ----
@contextlib.contextmanager
def held_interrupts(*, drop: bool):
    """Ctrl-C inside the block waits until it is done; then it is dropped (drop=True: the reply it was meant
    for has already stopped) or raised. Only the main thread receives signals; elsewhere this does nothing."""
    got = []
    try:
        old = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    except ValueError:  # not the main thread
        old = False
    try:
        yield
    finally:
        if old is not False:  # None: a handler set outside Python, which cannot be put back; the default then
            signal.signal(signal.SIGINT, signal.default_int_handler if old is None else old)
    if got and not drop and old is not signal.SIG_IGN:
        raise KeyboardInterrupt


class Chat:
    """The conversation, the generation settings and the slash commands, over one engine."""

    def __init__(self, llm: Engine, options: dict, screen: Screen, *, system: str | None = None):
        self.llm, self.screen = llm, screen
        self.options = {k: v for k, v in options.items() if v is not None and v != []}
        self.conv, self.totals = Conversation(system), Totals()
        self.commands = {"help": self.help, "stats": self.stats, "reset": self.reset, "system": self.system,
                         "set": self.set, "draft": self.draft, "save": self.save, "load": self.load,
                         "think": self.think}
        # a reasoning model's thinking span (from its chat template), whether it may think, its budget, and the
        # last reply's thinking (shown folded; /think show unfolds it)
        self.markers = markers_of(llm.chat_template())
        self.thinking, self.budget, self.last_thought = True, None, ""

    def variables(self) -> dict | None:
        """The template variables of each turn: thinking turned off where the user asked."""
        return None if self.thinking or self.markers is None else {"enable_thinking": False}

    def tokens(self, messages: list[dict]) -> list[int]:
        return self.llm.chat_tokens(plain(messages), variables=self.variables())

    def span(self, messages: list[dict]) -> Span | None:
        """The reply's thinking span: whether the prompt opens it, and its budget (None: the model has none)."""
        return span_for(self.llm, plain(messages), variables=self.variables(), budget=self.budget)

    def request(self, options: dict | None = None) -> Request:
        return make_request(**(self.llm.defaults | (self.options if options is None else options)))

    def handle(self, line: str) -> bool:
        """Act on one input: a message or a slash command. False means leave."""
        if not line.strip():
            return True
        if line.startswith("/") and not line.startswith("//"):
            name, arg = (line[1:].split(None, 1) + ["", ""])[:2]
            if name in ("exit", "quit"):
                return False
            if name not in self.commands:
                close = difflib.get_close_matches(name, [*self.commands, "exit"], n=1)
                self.screen.hint(f"unknown command /{name}: {f'did you mean /{close[0]}? ' if close else ''}/help "
                                 "lists the commands (start a message with // to send a line beginning with /)")
            else:
                self.commands[name](arg.strip())
            return True
        self.ask(line[1:] if line.startswith("//") else line)
        return True

    def prompt(self, text: str) -> tuple[list[dict], int, list[int]]:
        """The conversation the model sees plus the new message, the turns dropped so it fits in n_ctx, and its
        tokens."""
        n_ctx = self.llm.target.n_ctx
        room = min(self.request().max_tokens, n_ctx // 2)  # kept free for the reply
        messages = self.conv.in_context() + [{"role": "user", "content": text}]

        def size(m: list[dict]) -> int:
            return len(self.tokens(m))

        try:
            # A trim drops down to half the prompt space, as llama.cpp's context shift does: trimming just
            # enough would drop one more turn every turn, and nothing past the system prompt would be reused.
            dropped = drop_oldest_turns(messages, lambda m: size(m) + room <= n_ctx,
                                        roomy=lambda m: size(m) <= (n_ctx - room) // 2)
        except DoesNotFit:
            raise DoesNotFit(f"this message and room for a {room}-token reply do not fit in n_ctx={n_ctx}: "
                             "shorten it, lower max_tokens (/set max_tokens N) or restart chat with a larger "
                             "--n-ctx") from None
        return messages, dropped, self.tokens(messages)

    def ask(self, text: str) -> None:
        """One turn: stream the reply; Ctrl-C stops it and keeps what came so far."""
        messages, dropped, tokens = self.prompt(text)
        span = self.span(messages)
        stream = self.llm.stream(tokens, **self.options, **({"span": span} if span is not None else {}))
        spans = Spans(span) if span is not None else None
        events = iter(stream)
        kept = {id(m) for m in messages}
        for m in self.conv.messages:
            if id(m) not in kept:
                m["dropped"] = True  # out of the model's context, still in the transcript
        self.conv.messages.append(messages[-1])
        if dropped:
            self.totals.dropped += dropped
            self.screen.hint(f"dropped the oldest {dropped} turn{'s' if dropped > 1 else ''} "
                             f"to fit n_ctx={self.llm.target.n_ctx}")
        parts, thought, interrupted = [], [], True
        try:
            for ev in events:
                for thinking, text in spans.token(ev.text, ev.from_draft) if spans else [(False, ev.text)]:
                    if thinking:
                        thought.append(text)
                        self.screen.thought(text, spans.counts["reasoning"]["tokens"])
                        continue
                    if thought and not parts:
                        self.screen.thought_done(spans.counts["reasoning"]["tokens"], True)
                    parts.append(text)
                    self.screen.piece(text, ev.from_draft)
            if spans is not None:
                for thinking, text in spans.finish():
                    (thought if thinking else parts).append(text)
                    if not thinking:
                        self.screen.piece(text, False)
            interrupted = False
        except KeyboardInterrupt:
            if not self.screen.interactive:
                raise
        finally:
            with held_interrupts(drop=self.screen.interactive):  # a second Ctrl-C must not cut the cleanup short
                events.close()  # the engine's cleanup puts both KV caches back in line with their token lists
                if thought and not parts:  # the reply ended inside its thinking
                    self.screen.thought_done(spans.counts["reasoning"]["tokens"], False)
                self.last_thought = "".join(thought)
                # the answer is what the conversation goes on from; the thinking is kept beside it (templates
                # leave earlier turns' thinking out of the prompt; /save keeps it)
                reply = ({"role": "assistant", "content": "".join(parts)}
                         | ({"reasoning_content": self.last_thought} if thought else {})
                         | ({"interrupted": True} if interrupted else {}))
                self.conv.messages.append(reply)
                self.screen.end_reply(reply["content"])
                if stream.stats is not None:
                    self.totals.add(stream.stats, interrupted=interrupted)
                    self.screen.note(stats_line(stream.stats, interrupted=interrupted,
                                                max_tokens=self.request().max_tokens, n_ctx=self.llm.target.n_ctx))

    # -- slash commands --
    def help(self, arg: str) -> None:
        self.screen.note(HELP.format(keys=", ".join(SETTINGS)), "")

    def stats(self, arg: str) -> None:
        seen = self.conv.in_context()  # what the next turn sends (the cache may hold more, for reuse)
        self.screen.note(self.totals.line(len(self.tokens(seen)) if seen else 0, self.llm.target.n_ctx), "")

    def reset(self, arg: str) -> None:
        self.conv.reset()
        self.screen.note("conversation cleared" + (" (the system prompt stays)" if self.conv.system else ""))

    def system(self, arg: str) -> None:
        if not arg:
            self.screen.note(f"system prompt: {self.conv.system}" if self.conv.system is not None
                             else "no system prompt (the chat template's default applies); /system TEXT sets one")
            return
        self.conv.set_system(arg)
        self.screen.note("system prompt set")

    def set(self, arg: str) -> None:
        key, _, value = arg.partition(" ")
        key, value = key.replace("-", "_"), value.strip()
        if not key:
            r = self.request()
            shown = {k: getattr(r.sampling, k) if hasattr(r.sampling, k) else getattr(r, k) for k in SETTINGS}
            self.screen.note(", ".join(f"{k}={_show(k, v)}" for k, v in shown.items()), "")
            return
        if key not in SETTINGS:
            self.screen.hint(f"unknown setting {key!r}: one of {', '.join(SETTINGS)}")
            return
        read, kind = SETTINGS[key]
        try:
            v = read(value)
        except ValueError as e:
            why = f" ({e})" if str(e).startswith("cannot read") else ""
            self.screen.hint(f"{key} takes {kind}, got {value!r}{why}: /set {key} VALUE")
            return
        if key == "drafter" and v in ("model", "hybrid") and self.llm.draft is None:
            self.screen.hint(f"drafter {v!r} needs a draft model: restart chat with --draft PATH")
            return
        options = {k: x for k, x in (self.options | {key: v}).items()
                   if x is not None and not (v is not None and key in CONSTRAINTS and k in CONSTRAINTS and k != key)}
        try:
            self.request(options)
        except LocalspecError as e:
            self.screen.hint(f"{e}; {key} unchanged")
            return
        self.options = options
        self.screen.note(f"{key} = {_show(key, v)}")

    def draft(self, arg: str) -> None:
        if arg not in ("on", "off"):
            self.screen.hint("usage: /draft on|off")
            return
        self.screen.show_draft = arg == "on"
        if self.screen.show_draft and not self.screen.colour:
            self.screen.hint("no colours here: output is not a terminal, or NO_COLOR is set")

    def think(self, arg: str) -> None:
        if self.markers is None:
            self.screen.hint("this model's chat template has no thinking span: /think does nothing here")
            return
        word, _, value = arg.partition(" ")
        if word == "show":
            self.screen.note(self.last_thought.strip() or "(the last reply did not think)")
        elif word in ("on", "off") and not value:
            if word == "off" and "enable_thinking" not in (self.llm.chat_template() or ""):
                self.screen.hint("this model's chat template cannot turn its thinking off (it reads no "
                                 "enable_thinking); /think budget 0 ends each span at once instead")
                return
            self.thinking = word == "on"
            self.screen.note(f"thinking {word}")
        elif word == "budget" and (value == "off" or value.isdigit()):
            self.budget = None if value == "off" else int(value)
            self.screen.note("no thinking budget" if self.budget is None else
                             f"at most {self.budget} thinking tokens per reply")
        else:
            self.screen.hint("usage: /think on|off|show, or /think budget N|off")

    def save(self, arg: str) -> None:
        if not arg:
            self.screen.hint("usage: /save FILE")
            return
        path = Path(arg).expanduser()
        try:
            self.conv.save(path)
        except OSError as e:
            self.screen.hint(f"cannot write {path}: {e.strerror or e}")
            return
        out = len(self.conv.messages) - len(self.conv.in_context())
        self.screen.note(f"saved {len(self.conv.messages)} messages to {path}"
                         + (f" ({out} dropped from the model's context earlier, marked \"dropped\")" if out else ""))

    def load(self, arg: str) -> None:
        if not arg:
            self.screen.hint("usage: /load FILE")
            return
        path = Path(arg).expanduser()
        try:
            self.conv.load(path)
        except OSError as e:
            self.screen.hint(f"cannot read {path}: {e.strerror or e}")
        except (ValueError, RecursionError, ChatError) as e:  # json.JSONDecodeError is a ValueError
            self.screen.hint(f"{path} is not a saved conversation: {e}")
        else:
            self.screen.note(f"loaded {len(self.conv.messages)} messages from {path} (in place of the conversation "
                             "so far)")


def run(llm: Engine, options: dict, *, system: str | None = None, show_draft: bool = False) -> None:
    """The chat loop: a REPL in a terminal, else one message per line of stdin with the replies on stdout."""
    from ..store.registry import home

    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        # Ctrl-C stops a reply. A process started in the background by a shell without job control (a script's
        # `cmd &`, nohup) inherits SIGINT ignored, and Python then leaves it ignored: take it back.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    screen = Screen(interactive=interactive, show_draft=show_draft)
    chat = Chat(llm, options, screen, system=system)
    if not interactive:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # a stream that is not a console's
            sys.stdin.reconfigure(encoding="utf-8", errors="strict")  # non-UTF-8 input is an error, not mojibake
    reader = Prompt(home() / "chat_history", lambda: chat.think("show")) if interactive else Lines(sys.stdin)
    if interactive:
        screen.note(f"localspec chat with {llm.name}: /help lists the commands, Ctrl-D leaves")
    while True:
        try:
            line = reader.read()
        except UnicodeDecodeError as e:
            raise ChatError(f"stdin is not UTF-8 text (byte {e.object[e.start]:#04x}); convert it, e.g. "
                            "iconv -f latin1 -t utf-8") from None
        except KeyboardInterrupt:  # Ctrl-C at an empty prompt
            if interactive and any(m["role"] != "system" for m in chat.conv.messages):  # one meant for a reply
                screen.hint("Ctrl-D or /exit leaves (/save FILE keeps the conversation)")
                continue
            return
        if line is None:
            return
        try:
            if not chat.handle(line):
                return
        except KeyboardInterrupt:
            if not interactive:
                raise
            screen.hint("interrupted")
        except LocalspecError as e:
            screen.hint(f"error: {e}")
        except Exception as e:  # a bug: say so, and keep the conversation
            if not interactive:
                raise
            screen.hint(f"error: {type(e).__name__}: {e} (the conversation is kept; /save FILE saves it)")
