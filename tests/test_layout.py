"""The package's layout is its architecture: core <- store <- api <- apps, one way (see each sub-package's
docstring). Every import is checked, those inside functions too, and the module graph has no circle."""
from __future__ import annotations

import ast
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
