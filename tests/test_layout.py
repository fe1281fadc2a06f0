"""The package's layout is its architecture: core <- store <- api <- apps, one way (see each sub-package's
docstring). Every import is checked, those inside functions too, and the module graph has no circle."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import localspec

ROOT = Path(localspec.__file__).parent
LAYERS = ("core", "store", "api", "apps")
# what each part may import of localspec (besides itself); "localspec" is the package root (load(), the public names)
ALLOWED = {"core": set(), "store": {"core"}, "api": {"core", "store"},
           "apps": {"core", "store", "api", "localspec"}, "localspec": {"core", "store", "api"}}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def part(module: str) -> str:
    """'localspec.core.loop' -> 'core'; the root and its __main__ -> 'localspec'."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 and bits[1] in LAYERS else "localspec"


def imports(module: str, path: Path) -> set[str]:
    """Every localspec module `module` imports, at the top or inside a function, as absolute names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "localspec"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "localspec":
                continue
            found.add(target)
            # `from . import registry` names modules too
            found |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules()}
    return found


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, path in sorted(modules().items()):
        if module in ("localspec.__main__", "localspec.cli"):  # the command line: `python -m localspec`, and the
            continue                                             # entry point of installs from before the layout
        mine = part(module)
        for target in sorted(imports(module, path)):
            theirs = part(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} imports {target} ({mine} may import only {sorted(ALLOWED[mine]) or 'itself'})")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    graph = {m: {t for t in imports(m, p) if t in modules() and t != m} for m, p in modules().items()}
    # a package's __init__ importing its own modules is how Python packages work: not a circle through them
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state, circles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


def test_the_core_imports_alone():
    """Importing every core module loads nothing of store, api or apps (and the same one layer up)."""
    for layer, above in (("core", ("store", "api", "apps")), ("store", ("api", "apps")), ("api", ("apps",))):
        names = sorted(m for m in modules() if part(m) == layer)
        code = (f"import sys, importlib\nfor m in {names!r}: importlib.import_module(m)\n"
                f"print(sorted(m for m in sys.modules if m.split('.')[1:2] and m.split('.')[1] in {above!r}))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "[]", (layer, r.stdout)


def test_modules_stay_small():
    big = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > 500}
    assert not big, big


def test_the_entry_point_of_installs_from_before_the_layout_still_runs_the_command():
    """A checkout installed with `pip install -e .` before the layout has a `localspec` script that imports
    localspec.cli:main; after updating the checkout it failed with ModuleNotFoundError until reinstalled."""
    from localspec.apps import cli
    from localspec.cli import main

    assert main is cli.main


# core does no file I/O and starts no process: what it needs from files ($LOCALSPEC_HOME's measurements, a model
# file's magic, the probe's text) store reads and passes in (see core/__init__.py)
_NO_IMPORT = {"subprocess", "tempfile", "shutil", "multiprocessing"}
_OS_CALLS = {"open", "fdopen", "replace", "remove", "unlink", "rename", "renames", "mkdir", "makedirs", "rmdir",
             "removedirs", "system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "startfile"}
_PATH_CALLS = {"read_text", "write_text", "read_bytes", "write_bytes", "open", "mkdir", "unlink", "touch", "rmdir",
               "symlink_to", "hardlink_to"}  # a Path's, by name


def _io_calls(path: Path) -> list[str]:
    """Where a module opens a file, changes the file system or starts a process (as far as its text says)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in _NO_IMPORT]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            mod = node.module.split(".")[0]
            if mod in _NO_IMPORT or (mod in ("os", "io") and {a.name for a in node.names} & (_OS_CALLS | {"open"})):
                found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "open":
                found.append(f"{where} calls open()")
            elif isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else None
                if owner == "io" and f.attr in ("open", "open_code"):
                    found.append(f"{where} calls io.{f.attr}()")
                elif owner == "os" and (f.attr in _OS_CALLS or f.attr.startswith(("exec", "spawn"))):
                    found.append(f"{where} calls os.{f.attr}()")
                # (a Path's touch takes no positional argument; a store keeper's touch(scope, name) is a call back)
                elif f.attr in _PATH_CALLS and not (f.attr == "touch" and node.args):
                    found.append(f"{where} calls .{f.attr}()")
                # Path.rename/replace take one argument; str.replace two or three
                elif f.attr in ("rename", "replace") and owner != "dataclasses" and \
                        len(node.args) + len(node.keywords) == 1:
                    found.append(f"{where} calls .{f.attr}() (a Path's?)")
    return found


def test_the_core_opens_no_file_and_starts_no_process():
    found = [line for m, p in sorted(modules().items()) if part(m) == "core" for line in _io_calls(p)]
    assert not found, "\n".join(found)


_GUARDED = """
import builtins, io, os, subprocess, importlib
import numpy, llama_cpp  # (what they read as they load is theirs)
def refuse(what):
    def call(*a, **k):
        raise AssertionError(f"core called {{what}}{{a[:1]}}")
    return call
builtins.open = io.open = refuse("open")
for name in ("open", "replace", "remove", "unlink", "rename", "mkdir", "makedirs", "system", "popen"):
    setattr(os, name, refuse("os." + name))
subprocess.Popen = refuse("subprocess.Popen")
for m in {names!r}:
    importlib.import_module(m)
from core_run import run
run({model!r})
print("ok")
"""


def test_the_core_runs_without_opening_a_file(tmp_path):
    """Every core module imported, a short generation through the loop with a fake model and the n-gram and auto
    drafters, and a real model loaded and decoding (where the suite's small model is fetched), with open(), the
    file-changing os calls and subprocess.Popen made to fail."""
    from conftest import SMOL

    (tmp_path / "core_run.py").write_text(_FAKE_RUN)
    names = sorted(m for m in modules() if part(m) == "core")
    code = _GUARDED.format(names=names, model=str(SMOL) if SMOL.is_file() else None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT.parent}"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


_FAKE_RUN = """
import numpy as np

from localspec.core.auto import AutoDrafter
from localspec.core.costs import Costs
from localspec.core.drafters import NgramDrafter
from localspec.core.loop import Token, speculate
from localspec.core.sampling import SamplingParams


class Fake:
    '''A target that writes t+1 after t (mod 10), its cache the token list itself.'''
    n_vocab, n_ctx, n_batch, version, last_restore = 10, 256, 512, 0, (0, "")

    def __init__(self):
        self.tokens = []

    def check_open(self):
        pass

    def decode(self, tokens, *, logits="last"):
        self.tokens.extend(tokens)
        self.version += 1
        rows = np.stack([np.eye(10, dtype=np.float32)[(t + 1) % 10] * 10 for t in tokens])
        return None if logits == "none" else rows if logits == "all" else rows[-1:]

    def truncate(self, n):
        del self.tokens[n:]
        self.version += 1

    def sync(self, tokens, *, logits=False, cancel=None):
        self.truncate(0)
        return 0, self.decode(list(tokens), logits="last" if logits else "none")

    def is_eog(self, t):
        return False

    def piece(self, t):
        return str(t).encode()


def run(model_path):
    if model_path is not None:  # llama.cpp reads the file itself; the Model around it reads nothing
        from localspec.core.model import Model, ModelConfig

        m = Model(model_path, ModelConfig(n_ctx=64, kwargs={"use_extra_bufts": False}))  # (safe where AMX is not)
        assert m.decode(m.tokenize("Hello"), logits="last").shape == (1, m.n_vocab)
        m.close()
    sizes = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 24, 33)
    costs = Costs(sizes, (256,), (tuple(0.01 + 0.001 * n for n in sizes),), (0.002,), 0.0)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)):
        for drafter in (NgramDrafter(), AutoDrafter(costs, NgramDrafter(n_min=1), None)):
            facts = speculate(Fake(), None, drafter, [1, 2, 3, 1, 2], max_tokens=40, k=8, rule="rejection",
                              params=params, seed=1)
            assert sum(type(f) is Token for f in facts) == 40
"""
