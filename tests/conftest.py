"""Shared fixtures: real model files (fetched by scripts/fetch_models.py) and fake models for tier 1."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

# Exact mode turns ggml's tiled matmul off for the process, but only where no model has run yet (ggml reads the
# setting once): the suite loads plain models before exact ones, so it is off for the whole session.
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

# A run started in the background (`... &` in a script, nohup) inherits SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler, in this process or in those the tests start (an ignored signal stays ignored across
# exec): the Ctrl-C tests would fail for want of a Ctrl-C, not for anything of ours. A terminal's Ctrl-C is taken.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from localspec.store import registry  # noqa: E402


# the suite's own LOCALSPEC_HOME: prompt states and history start empty; models and measurements are shared
os.environ["LOCALSPEC_HOME"] = str(registry.scratch_home("localspec-tests-"))


def _shipped(name: str) -> Path:
    """Where scripts/fetch_models.py put a shipped model: under $LOCALSPEC_HOME/models (registry.py decides)."""
    spec = registry._parse(registry.SHIPPED, None).models[name]
    return registry.local_path(spec) or registry.own_path(spec)


SMOL = _shipped("smollm2-135m-instruct-q4_1")
QWEN_TARGET = _shipped("qwen2.5-coder-1.5b-instruct-q4_k_m")
QWEN_DRAFT = _shipped("qwen2.5-coder-0.5b-instruct-q4_k_m")
PROMPTS = Path(__file__).resolve().parents[1] / "localspec" / "apps" / "prompts.jsonl"


def _need(path: Path) -> Path:
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `python scripts/fetch_models.py` first")
    return path


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return _need(SMOL)


@pytest.fixture(scope="session")
def qwen_paths() -> tuple[Path, Path]:
    return _need(QWEN_TARGET), _need(QWEN_DRAFT)


@pytest.fixture(scope="session")
def smol_engine(smol_path):
    import localspec

    with localspec.load(target=smol_path, draft=smol_path, n_ctx=1024, exact=True) as llm:
        yield llm


class FakeModel:
    """A scripted stand-in for localspec.core.model.Model: logits are a function of the token before.

    `table[t]` is the logit row that follows token t; the KV cache is the `tokens` list itself, and every
    decode is recorded so tests can count them.
    """

    def __init__(self, table: dict[int, np.ndarray], n_vocab: int, *, n_ctx: int = 64, eog: int = -1):
        self.table, self.n_vocab, self.n_ctx, self.eog = table, n_vocab, n_ctx, eog
        self.tokens: list[int] = []
        self.decodes: list[list[int]] = []
        self.version, self.n_batch = 0, 512
        self.last_restore = (0, "")  # nothing kept: a fake has no prompt cache

    def check_open(self) -> None:  # as Model's: a fake is never closed
        pass

    def row(self, t: int) -> np.ndarray:
        return self.table.get(t, np.zeros(self.n_vocab, dtype=np.float32))

    def decode(self, tokens, *, logits="last"):
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise AssertionError("decode past n_ctx")
        if tokens:
            self.decodes.append(list(tokens))
        self.tokens.extend(tokens)
        self.version += 1
        if logits == "none" or not tokens:
            return None
        rows = np.stack([self.row(t) for t in tokens])
        return rows if logits == "all" else rows[-1:]

    def truncate(self, n):
        del self.tokens[n:]
        self.version += 1

    def sync(self, tokens, *, logits=False, cancel=None):
        keep = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            keep += 1
        if logits:
            keep = min(keep, len(tokens) - 1)
        self.truncate(keep)
        return keep, self.decode(list(tokens[keep:]), logits="last" if logits else "none")

    def is_eog(self, t):
        return t == self.eog

    def piece(self, t):
        return f"<{t}>".encode()


def until(condition, timeout: float = 60, what: str = "the condition") -> None:
    """Wait for condition() with a deadline (a test that waits on another thread never hangs the run)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.001)


def onehot(n_vocab: int, t: int, scale: float = 10.0) -> np.ndarray:
    row = np.zeros(n_vocab, dtype=np.float32)
    row[t] = scale
    return row


def pytest_report_header(config):
    from localspec.core.llama import system_info

    if "LLAMAFILE = 1" in system_info():
        return ("llama-cpp-python was built with llamafile's sgemm: on many CPUs exact mode is then refused and the "
                "exactness tests fail; build it as the README's test section says (CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\")")


def shared_calibration(home: Path) -> Path:
    """A fresh LOCALSPEC_HOME whose calibration folder is this machine's own (a link): a test that isolates its
    files still finds the costs and exact-mode verdicts measured once per machine (a minute or more each)."""
    home.mkdir(parents=True, exist_ok=True)
    shared = registry.home() / "calibration"
    shared.mkdir(parents=True, exist_ok=True)
    (home / "calibration").symlink_to(shared, target_is_directory=True)
    return home
