"""What localspec finds out about this machine and keeps: the CPU's name, the key of measurements kept per machine
and build, reading and keeping them (JSON under $LOCALSPEC_HOME/calibration), and whether llama.cpp's AMX kernels
crash this build (found in a child process). core asks none of this itself: load() passes the answers in.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import llama_cpp as L

from ..core import llama
from ..core.llama import ModelConfig
from .registry import home


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ---- what is measured once per machine and build, kept under $LOCALSPEC_HOME/calibration ----
def machine_key(*parts) -> str:
    """Same CPU, build, library version and settings -> same answer."""
    key = [platform.machine(), cpu_name(), llama.system_info(), L.__version__, *parts]
    return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:24]


def read_kept(path: Path) -> dict | None:
    """A kept measurement, or None where there is none (or it is unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def keep(path: Path, data: dict) -> None:
    """Keep a measurement (atomically: a reader never sees half a file); where that fails (LOCALSPEC_HOME a file,
    a full disk) say so and go on: it is measured again next time, never lost this time."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(f"localspec: could not keep the measurement in {path.parent} ({e.strerror or e}); it is measured "
              "again next time (set LOCALSPEC_HOME to a writable folder)", file=sys.stderr)


# ---- llama.cpp's AMX kernels, which a build can hold broken ----
_amx_works: bool | None = None  # this process's verdict, once known
# A child process loads the model with its weights in AMX's layout and decodes one batch; verbose, llama.cpp
# names the AMX buffer it filled, which says the kernels were reached.
_AMX_CHILD = """
import sys
from localspec.core import llama
from localspec.core.model import Model, ModelConfig
llama.set_verbose(True)
m = Model(sys.argv[1], ModelConfig(n_ctx=128, kwargs={"use_extra_bufts": True}))
m.decode([100 + i for i in range(64)], logits="none")
"""


def amx_faults(path: Path) -> bool:
    """Whether llama.cpp's AMX kernels crash this process, so that models must load without llama.cpp's extra
    weight layouts (use_extra_bufts off: no AMX, no CPU repacking).

    A llama-cpp-python built on a CPU with AMX compiles them in, and built by GCC 12 (Debian 12's) they kill
    the process at the first batch of a few dozen tokens: GCC's _tile_loadconfig tells the compiler that the
    instruction reads 8 bytes of the 64-byte tile configuration, so the stores of the rest are dropped and
    ldtilecfg faults on whatever the stack held (a 2-vCPU Intel Xeon with AMX, 2026-12-05: every test that
    prefilled a prompt died with a segmentation fault). Found by decoding one batch of `path` with AMX weights
    in a child process, where a crash costs nothing; once per machine and build, kept in
    $LOCALSPEC_HOME/calibration. False where the build has no AMX, or where nothing could be found out (the
    model has no weights AMX takes, the child could not run): asked again for the next model then.
    """
    global _amx_works
    if _amx_works is None and "AMX_INT8 = 1" not in llama.system_info():
        _amx_works = True
    if _amx_works is not None:
        return not _amx_works
    lib = Path(L.__file__).with_name("lib")
    file = home() / "calibration" / "amx-{}.json".format(machine_key(
        "amx", sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in lib.glob("*ggml-cpu*"))))
    verdict = (read_kept(file) or {}).get("amx")
    if verdict in ("works", "faults"):
        _amx_works = verdict == "works"
        return not _amx_works
    sys.stderr.write("localspec: checking that llama.cpp's AMX kernels run on this machine (once)\n")
    try:
        r = subprocess.run([sys.executable, "-c", _AMX_CHILD, str(path)], capture_output=True, text=True,
                           errors="replace", timeout=600, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    if r.returncode < 0:
        _amx_works = False
    elif r.returncode == 0 and re.search(r"\bAMX\b.*buffer size", r.stderr):
        _amx_works = True
    else:
        return False
    keep(file, {"amx": "works" if _amx_works else "faults", "signal": -r.returncode})
    if not _amx_works:
        sys.stderr.write(
            f"localspec: llama.cpp's AMX kernels crash on this machine (signal {-r.returncode} in a test decode): "
            "this llama-cpp-python was built with AMX by a compiler that builds it wrong (GCC 12 does). Models "
            "load without llama.cpp's extra weight layouts (AMX and CPU repacking) instead. To keep the "
            "repacked layouts, rebuild without AMX: CMAKE_ARGS=\"-DCMAKE_C_FLAGS=-mno-amx-int8 "
            "-DCMAKE_CXX_FLAGS=-mno-amx-int8\" pip install --force-reinstall --no-cache-dir "
            "\"llama-cpp-python>=0.3.36,<0.4\"\n")
    return not _amx_works


def amx_safe(path: Path, cfg: ModelConfig) -> ModelConfig:
    """cfg for the model at `path`, with llama.cpp's extra weight layouts off (use_extra_bufts=False) where this
    build's AMX kernels crash (amx_faults); as it is where the caller chose (use_extra_bufts given) or exact mode
    turns them off anyway."""
    if cfg.exact or "use_extra_bufts" in cfg.kwargs or not amx_faults(path):
        return cfg
    return replace(cfg, kwargs={**cfg.kwargs, "use_extra_bufts": False})
