"""Run every command the README shows, so the README cannot drift from what localspec does.

Each ```bash block runs as a bash script and each ```python block as Python, in a scratch folder that sees the
repository's files (localspec/, scripts/, models.toml) and the default pair (fetched first, as the README's
setup does). A block must exit 0 and print no traceback. What cannot run here as written is checked another way,
and said:
- the setup and test commands (venv, pip, the llama-cpp-python build, fetch_models, pytest) are what CI itself
  runs: each must appear in .ci/run (the same requirement, extras and CMAKE_ARGS);
- `localspec serve` runs in the background until the Python blocks that talk to it (they use `client`) are done;
- `localspec chat` gets one message on stdin (a pipe: each line is a message);
- `localspec bench` runs on one shipped prompt, 16 tokens, one repeat (its full run takes most of an hour).

    python scripts/check_readme.py [--readme README.md] [--only WORD]
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = ("python3 -m venv", "pip install", "CMAKE_ARGS=", "python scripts/fetch_models.py", "python -m pytest")


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def check_setup(code: str, ci: str) -> list[str]:
    """The setup block's commands, each as CI runs it: the same program, requirement, extras and build flags."""
    problems = []
    for line in code.splitlines():
        for part in (p.strip() for p in line.split("&&")):
            if not part:
                continue
            words = shlex.split(part)
            wanted = [w for w in words if w.startswith(("CMAKE_ARGS=", ".[", "llama-cpp-python", "scripts/", "-m"))]
            if part.startswith(". "):
                wanted = [part]
            missing = [w for w in wanted if w not in ci and shlex.quote(w) not in ci and f'"{w}"' not in ci
                       and w.replace("CMAKE_ARGS=", 'CMAKE_ARGS="') + '"' not in ci]
            if missing:
                problems.append(f"{part!r}: {missing} not in .ci/run")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(kind: str, code: str, cwd: Path, env: dict, *, stdin: str | None = None, timeout: int = 900):
    t = time.monotonic()
    cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout)
    ok = r.returncode == 0 and "Traceback" not in r.stderr + r.stdout
    return ok, time.monotonic() - t, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--only", help="run only the blocks that contain this text")
    a = ap.parse_args()
    text = Path(a.readme).read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    work = Path(tempfile.mkdtemp(prefix="localspec-readme-"))
    for name in ("localspec", "scripts", "models.toml"):
        (work / name).symlink_to(ROOT / name)
    env = dict(os.environ, NO_COLOR="1")
    failures, server = [], None
    port = free_port()
    todo = [(k, c) for k, c in blocks(text) if k in ("bash", "python") and (not a.only or a.only in c)]
    try:
        for kind, code in todo:
            if kind == "bash":
                setup = [line for line in code.splitlines() if line.strip().startswith(SETUP)]
                if setup:
                    problems = check_setup("\n".join(setup), ci)
                    for line in setup:
                        print(f"{'ok  ' if not problems else 'FAIL'} [CI runs it] {line.strip()[:70]}")
                    failures += problems
                code = "\n".join(line for line in code.splitlines() if not line.strip().startswith(SETUP))
                if not code.strip():
                    continue
            first = code.strip().splitlines()[0][:70]
            stdin = None
            if kind == "bash" and "localspec serve" in code:
                cmd = code.strip().replace("--port 8080", f"--port {port}")
                server = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=work, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
                deadline = time.monotonic() + 900
                import httpx
                while True:
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if server.poll() is not None or time.monotonic() > deadline:
                        failures.append(f"{first}: the server did not come up:\n{server.stdout.read()[-2000:]}")
                        break
                    time.sleep(0.5)
                print(f"ok   [in the background] {first}")
                continue
            if kind == "python" and "client." in code:
                if server is None:
                    failures.append(f"{first}: uses the server, which no block before it started")
                    continue
                code = code.replace("http://127.0.0.1:8080", f"http://127.0.0.1:{port}")
                if "client = " not in code:  # a later block reuses the first one's client
                    code = (f'from openai import OpenAI\nclient = OpenAI(base_url="http://127.0.0.1:{port}/v1", '
                            f'api_key="unused")\n') + code
            note = ""
            if kind == "bash" and "localspec chat" in code:
                stdin, note = "Say hi.\n", " [one message on stdin]"
            if kind == "bash" and "localspec bench" in code:
                one = work / "one_prompt.jsonl"
                one.write_text((ROOT / "localspec" / "apps" / "prompts.jsonl").read_text().splitlines()[0] + "\n")
                code = code.rstrip() + f" --prompts {one} --max-tokens 16 --repeat 1"
                note = " [one prompt, 16 tokens, one repeat]"
            if kind == "python" and "localspec.load" in code and server is not None:
                stop(server)
                server = None
            ok, seconds, r = run(kind, code, work, env, stdin=stdin)
            print(f"{'ok  ' if ok else 'FAIL'} {seconds:5.0f} s  {first}{note}")
            if not ok:
                failures.append(f"{first} (exit {r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    finally:
        if server is not None:
            stop(server)
    for f in failures:
        print(f"\n{f}", file=sys.stderr)
    print(f"{len(todo)} blocks, {len(failures)} failed")
    return 1 if failures else 0


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
    sys.exit(main())
