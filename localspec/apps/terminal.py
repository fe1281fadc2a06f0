"""The terminal side of `localspec chat`: the screen replies and notes go to (colours, a reasoning model's
thinking folded to one line), and the input: prompt_toolkit line editing in a terminal, one message per line
elsewhere."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, TextIO

PROMPT, MORE = ">>> ", "... "
DIM, DRAFT, WARN, RESET = "\x1b[2m", "\x1b[32m", "\x1b[33m", "\x1b[0m"

def _colour(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


class Screen:
    """Replies go to stdout; notes (stats, notices, hints) too in a terminal, else to stderr."""

    def __init__(self, *, interactive: bool, show_draft: bool):
        self.interactive, self.show_draft = interactive, show_draft
        self.out, self.notes = sys.stdout, sys.stdout if interactive else sys.stderr
        self.colour, self.notes_colour = _colour(self.out), _colour(self.notes)

    def thought(self, text: str, tokens: int) -> None:
        """Thinking as it streams: folded to one dim line that counts it (in a terminal), nothing elsewhere."""
        if self.interactive and self.colour:
            self.out.write(f"\r{DIM}thinking... {tokens} tokens{RESET}\x1b[K")
            self.out.flush()

    def thought_done(self, tokens: int, answered: bool) -> None:
        """The span ended (or the reply did): the fold's last word."""
        if not tokens:
            return
        line = f"thought for {tokens} tokens" + (" (Ctrl-O or /think show unfolds)" if self.interactive else "")
        if self.interactive and self.colour:
            self.out.write(f"\r{DIM}{line}{RESET}\x1b[K\n")
            self.out.flush()
        else:
            self.note(f"({line})")

    def piece(self, text: str, from_draft: bool) -> None:
        if text and from_draft and self.show_draft and self.colour:
            text = DRAFT + text + RESET
        self.out.write(text)
        self.out.flush()

    def end_reply(self, text: str) -> None:
        if not text.endswith("\n"):
            self.out.write("\n")
        self.out.flush()

    def note(self, text: str, style: str = DIM) -> None:
        print(style + text + RESET if style and self.notes_colour else text, file=self.notes, flush=True)

    def hint(self, text: str) -> None:
        self.note(text, WARN)


class Prompt:
    """Interactive input: prompt_toolkit line editing, history under LOCALSPEC_HOME, multi-line messages."""

    def __init__(self, history: Path, unfold: Callable[[], None] | None = None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.application import run_in_terminal
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings

        kb = KeyBindings()

        @kb.add("enter")
        def _enter(event):
            buf = event.current_buffer
            if buf.document.text_before_cursor.endswith("\\"):  # a trailing backslash continues the message
                buf.delete_before_cursor(1)
                buf.insert_text("\n")
            else:
                buf.validate_and_handle()

        @kb.add("escape", "enter")
        def _newline(event):
            event.current_buffer.insert_text("\n")

        @kb.add("c-o")
        def _unfold(event):  # the last reply's thinking, unfolded above the prompt
            if unfold is not None:
                run_in_terminal(unfold)

        @kb.add("c-c")
        def _clear_or_quit(event):  # Ctrl-C clears a half-typed message; at an empty prompt it quits
            if event.current_buffer.text:
                event.current_buffer.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

        self.session = PromptSession(history=_history(history), key_bindings=kb, multiline=True,
                                     prompt_continuation=MORE)

    def read(self) -> str | None:
        try:
            return self.session.prompt(PROMPT)
        except EOFError:
            return None


def _history(path: Path):
    """The input history, kept in `path` while it can be written; else in memory, with a word: a history file
    that cannot be written (a directory there, a full disk, a file left by a sudo run) never ends the chat."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    class Kept(FileHistory):
        def load_history_strings(self):
            try:
                yield from super().load_history_strings()
            except OSError:
                pass  # said when the first line is stored

        def store_string(self, string: str) -> None:
            try:
                super().store_string(string)
            except OSError as e:
                self.store_string = lambda s: None
                print(f"\n(input history not saved to {path}: {e.strerror or e})", file=sys.stderr)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return Kept(str(path))
    except OSError as e:
        print(f"(input history kept in memory only: {path.parent}: {e.strerror or e})", file=sys.stderr)
        return InMemoryHistory()


class Lines:
    """Input that is not a terminal: one message per line (a trailing backslash continues it)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def read(self) -> str | None:
        parts = []
        while line := self.stream.readline():
            line = line.rstrip("\r\n")
            if not line.endswith("\\"):
                return "\n".join([*parts, line])
            parts.append(line[:-1])
        return "\n".join(parts) if parts else None
