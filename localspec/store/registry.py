"""models.toml: named models and pairs, where their files live, and how they are fetched and verified.

A named model resolves: local copy -> huggingface-hub download -> PyPI mirror (only after the Hub fails).
localspec writes and deletes files only under $LOCALSPEC_HOME/models, where both downloads land (a
folder per repository, OWNER--NAME). A file already in the user's Hugging Face cache is used when it verifies
and otherwise ignored, never deleted: that cache is shared with other tools, and replacing a bad entry there
would mean overwriting it.

Trust comes only from the sha256 of the official Hub file, checked before a path is ever returned. A
successful check is remembered in $LOCALSPEC_HOME/verified.json by (path, size, mtime, inode), so a 1 GB file
is hashed once; a file that changed since is hashed again, and one of ours that fails is deleted and fetched
again. Interrupted downloads leave nothing trusted: a Hub download goes into FILE.SHA.download, moved into place
once its sha256 matches, and kept when the download stops (Ctrl-C, a network gone for good) so that the next
run resumes it; the mirror assembles into FILE.SHA.part, moved into place once size and sha256 match, and a
stopped assembly keeps the whole parts it had (FILE.SHA.parts says how many) for the next run.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import tomllib
import types
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import get_args, get_type_hints

from ..core.defaults import DRAFTERS
from ..core.errors import LocalspecError
from ..core.llama import ModelError

# Installed wheels carry models.toml inside the package; a source checkout has it at the repository root.
SHIPPED = next(p for p in (Path(__file__).parents[1] / "models.toml", Path(__file__).parents[2] / "models.toml")
               if p.is_file())


def home() -> Path:
    """Where localspec keeps models and calibration data: $LOCALSPEC_HOME or ~/.cache/localspec."""
    return Path(os.environ.get("LOCALSPEC_HOME") or "~/.cache/localspec").expanduser()


def scratch_home(prefix: str) -> Path:
    """A new LOCALSPEC_HOME of one's own (a temporary folder, removed at exit), for a test run or a benchmark:
    what localspec keeps there (prompt states, history) starts empty and stays out of the user's, while the
    models and this machine's measurements are the real home's (links), fetched and measured once."""
    import atexit
    import shutil

    real = home()
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    for name in ("models", "calibration"):
        (real / name).mkdir(parents=True, exist_ok=True)
        (scratch / name).symlink_to(real / name, target_is_directory=True)
    if (real / "verified.json").is_file():
        shutil.copy(real / "verified.json", scratch / "verified.json")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


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
    drafter: str = "auto"
    k: int | None = None  # None: the drafter's own default (defaults.py)
    p_min: float = 0.75
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
            hint = (f"; {name!r} is a model, not a pair: pass its file with --target (`localspec pull {name}` "
                    "fetches it and prints its path)" if name in self.models else "")
            raise RegistryError(f"unknown pair {name!r}; known pairs: {', '.join(sorted(self.pairs))}{hint}")
        return self.pairs[name]

    def specs(self, name: str | None = None) -> list[ModelSpec]:
        """The models `localspec pull NAME` fetches: a pair's target and draft, or one model (pairs win a tie)."""
        if name is None or name in self.pairs:
            pair = self.pair(name)
            return [self.models[n] for n in dict.fromkeys((pair.target, pair.draft))]
        if name in self.models:
            return [self.models[name]]
        raise RegistryError(f"unknown model or pair {name!r}; pairs: {', '.join(sorted(self.pairs))}; "
                            f"models: {', '.join(sorted(self.models))}")


def _check_type(value, expected, where: str, key: str) -> None:
    if isinstance(expected, types.UnionType):  # an optional field: checked as its type when present
        expected = next(a for a in get_args(expected) if a is not type(None))
    ok = isinstance(value, str) if expected is str else (
        isinstance(value, int if expected is int else (int, float)) and not isinstance(value, bool))
    if not ok:
        kind = {str: "a string", int: "an integer", float: "a number"}[expected]
        raise RegistryError(f"{where}: {key!r} must be {kind}, got {value!r}")


def _record(cls, data: object, where: str, **extra):
    """Build a frozen record from a TOML table; unknown keys, missing fields and wrong types are errors naming them."""
    if not isinstance(data, dict):
        raise RegistryError(f"{where}: must be a table, got {data!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)} - set(extra)
    unknown = sorted(set(data) - names)
    if unknown:
        raise RegistryError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(names))})")
    required = {f.name for f in fields(cls) if f.default is MISSING} - set(extra)
    missing = sorted(n for n in required if n not in data)
    if missing:
        raise RegistryError(f"{where}: missing field {missing[0]!r}")
    for key, value in data.items():
        _check_type(value, hints[key], where, key)
    record = cls(**data, **extra)
    for key, rule, says in _RULES.get(cls, ()):
        if not rule(getattr(record, key)):
            raise RegistryError(f"{where}: {key!r} {says}, got {getattr(record, key)!r}")
    return record


def _relative_file(v: str) -> bool:
    # `file` becomes a path under $LOCALSPEC_HOME/models, which a mismatch deletes: it must not point elsewhere.
    parts = v.split("/")
    return bool(v) and "\\" not in v and ":" not in parts[0] and all(p not in ("", ".", "..") for p in parts)


_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"


def _repo_id(v: str) -> bool:
    # OWNER/NAME by the Hub's rule (huggingface_hub's validate_repo_id): each part 1-96 letters, digits, '-', '_',
    # '.', neither starting nor ending with '-' or '.'; no '--' or '..'; not ending '.git'. The owner is required
    # here (the Hub still resolves a few old ids without one): the repository's own folder under
    # $LOCALSPEC_HOME/models, OWNER--NAME, then always holds '--', which no file path an earlier localspec kept
    # there (models/FILE) is likely to start with.
    return (re.fullmatch(f"{_REPO_PART}/{_REPO_PART}", v) is not None and "--" not in v and ".." not in v
            and not v.endswith(".git"))


def _formats(v: str) -> bool:
    try:
        v.format(n=1)
        return True
    except (KeyError, IndexError, ValueError, AttributeError):
        return False


_RULES = {
    ModelSpec: [("repo", _repo_id, "must be a Hugging Face repository id, OWNER/NAME (each of letters, digits, "
                 "'-', '_' and '.', at most 96, neither starting nor ending with '-' or '.'; no '--' or '..')"),
                ("file", _relative_file, "must be a relative path inside the repository (no '..', '.', empty "
                 "parts, leading '/', drive or backslash)"),
                ("size", lambda v: v > 0, "must be positive"),
                ("sha256", lambda v: len(v) == 64 and all(c in "0123456789abcdef" for c in v),
                 "must be 64 lowercase hex digits")],
    Mirror: [("parts", lambda v: v >= 1, "must be at least 1"),
             ("package", lambda v: _formats(v), "may hold no placeholder but {n} (the part number)"),
             ("member", lambda v: _formats(v), "may hold no placeholder but {n} (the part number)")],
    PairSpec: [("drafter", lambda v: v in DRAFTERS, f"must be one of {', '.join(DRAFTERS)}"),
                 ("k", lambda v: v is None or v >= 1, "must be at least 1"),
                 ("p_min", lambda v: 0.0 <= v <= 1.0, "must be between 0 and 1"),
                 ("n_ctx", lambda v: v > 0, "must be positive")],
}


def _parse(path: Path, reg: Registry | None) -> Registry:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"{path}: not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RegistryError(f"{path}: cannot read it: {e}") from None
    models = dict(reg.models) if reg else {}
    pairs = dict(reg.pairs) if reg else {}
    default = reg.default_pair if reg else None
    unknown = sorted(set(data) - {"models", "pairs", "default_pair"})
    if unknown:
        raise RegistryError(f"{path}: unknown key {unknown[0]!r} (allowed: default_pair, models, pairs)")
    for section in ("models", "pairs"):
        if not isinstance(data.get(section, {}), dict):
            raise RegistryError(f"{path}: {section!r} must be a table of tables ([{section}.NAME])")
    for name, table in data.get("models", {}).items():
        if not isinstance(table, dict):
            raise RegistryError(f"{path}: [models.{name}] must be a table, got {table!r}")
        table = dict(table)
        mirror = table.pop("mirror", None)
        m = _record(Mirror, mirror, f"{path}: [models.{name}.mirror]") if mirror is not None else None
        models[name] = _record(ModelSpec, table, f"{path}: [models.{name}]", name=name, mirror=m)
    for name, table in data.get("pairs", {}).items():
        pairs[name] = _record(PairSpec, table, f"{path}: [pairs.{name}]", name=name)
    if "default_pair" in data:
        _check_type(data["default_pair"], str, str(path), "default_pair")
        default = data["default_pair"]
    for p in pairs.values():
        for role in ("target", "draft"):
            if getattr(p, role) not in models:
                raise RegistryError(f"{path}: pair {p.name!r} names unknown {role} model {getattr(p, role)!r}")
    if default is not None and default not in pairs:
        raise RegistryError(f"{path}: default_pair {default!r} is not a pair (pairs: {', '.join(sorted(pairs))})")
    return Registry(models, pairs, default)


def user_models_path() -> Path:
    """The user's models file: $LOCALSPEC_MODELS or ~/.config/localspec/models.toml."""
    if os.environ.get("LOCALSPEC_MODELS"):
        return Path(os.environ["LOCALSPEC_MODELS"]).expanduser()
    return Path("~/.config/localspec/models.toml").expanduser()


def load_registry() -> Registry:
    """The shipped models.toml, overridden entry by entry by the user's file when it exists."""
    reg = _parse(SHIPPED, None)
    user = user_models_path()
    if user.is_file():
        reg = _parse(user, reg)
    elif os.environ.get("LOCALSPEC_MODELS"):
        raise RegistryError(f"LOCALSPEC_MODELS names {user}, which is not a file")
    by_file: dict[str, ModelSpec] = {}
    for m in reg.models.values():  # each is kept at $LOCALSPEC_HOME/models/REPO/FILE: two would delete each other's
        # (macOS and Windows disks ignore case: Qwen/X and qwen/x share a folder there)
        other = by_file.setdefault(f"{m.repo}/{m.file}".casefold(), m)
        if other is not m and (other.sha256, other.size) != (m.sha256, m.size):
            raise RegistryError(f"{user}: models {other.name!r} and {m.name!r} pin different bytes (revisions) of "
                                f"{m.repo}/{m.file}, and localspec keeps one copy of a repository's file in "
                                f"{home() / 'models'} (each download would delete the other): keep one of them")
    return reg


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface-hub itself reads it once, when first imported)."""
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return True
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> Path:
    """The Hub cache huggingface-hub uses, read now with the library's own precedence of variables."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- integrity: sha256, remembered by (path, size, mtime, inode) so a 1 GB file is hashed once ----

def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _verify_log() -> Path:
    return home() / "verified.json"


def _stamp(path: Path) -> tuple[str, list[int]]:
    real = path.resolve()
    st = real.stat()
    return str(real), [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_verify_log() -> dict:
    try:
        data = json.loads(_verify_log().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def known_sha256(path: Path) -> str | None:
    """The sha256 this registry verified path's bytes to have, where it did and the file has not changed since
    (same size, mtime and inode); None otherwise. Never hashes."""
    try:
        key, stamp = _stamp(Path(path))
    except OSError:
        return None
    seen = _read_verify_log().get(key)
    if isinstance(seen, dict) and seen.get("stamp") == stamp and isinstance(seen.get("sha256"), str):
        return seen["sha256"]
    return None


def _write_json(path: Path, obj) -> None:
    """Replace path with obj as JSON, atomically: a reader sees the old record or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=0)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_verify_log(entries: dict) -> None:
    """Atomically replace the log (a lost update between two processes only costs a re-hash later)."""
    log = _verify_log()
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        _write_json(log, {k: v for k, v in entries.items() if os.path.exists(k)})
    except OSError:
        pass  # a read-only home only means hashing again next time


def _remember(path: Path, sha256: str) -> None:
    key, stamp = _stamp(path)
    entries = _read_verify_log()
    entries[key] = {"stamp": stamp, "sha256": sha256}
    _write_verify_log(entries)


def _forget(path: Path) -> None:
    entries = _read_verify_log()
    if entries.pop(str(path.resolve()), None) is not None:
        _write_verify_log(entries)


def verified(path: Path, spec: ModelSpec) -> bool:
    """True when path holds exactly the bytes spec pins: size first (free), then sha256, hashed only when the
    file is new or changed since it was last verified (a different size, mtime or inode)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size != spec.size:
        return False
    key, stamp = _stamp(path)
    seen = _read_verify_log().get(key)
    if isinstance(seen, dict) and seen.get("stamp") == stamp and seen.get("sha256") == spec.sha256:
        return True
    if sha256_file(path) != spec.sha256:
        _forget(path)
        return False
    _remember(path, spec.sha256)
    return True


# ---- where a model's file may already be ----

def own_path(spec: ModelSpec) -> Path:
    """Where localspec keeps spec's file, downloaded or assembled from the mirror:
    $LOCALSPEC_HOME/models/OWNER--NAME/FILE, a folder per repository (as the Hub's own cache has), so two
    repositories' files of the same name (model.gguf) are both kept. The Hub allows no '--' in a repository id:
    no two share a folder."""
    return _under_models(spec, Path(spec.repo.replace("/", "--")) / spec.file)


def _legacy_path(spec: ModelSpec) -> Path | None:
    """Where localspec kept spec's file before the folder per repository, $LOCALSPEC_HOME/models/FILE: only
    read (used when it verifies), never written or deleted, as it may hold another repository's file. None
    where that would lead out of $LOCALSPEC_HOME/models (a symlinked folder): no copy there to read."""
    try:
        return _under_models(spec, Path(spec.file))
    except RegistryError:
        return None


def _under_models(spec: ModelSpec, relative: Path) -> Path:
    root = home() / "models"
    path = root / relative
    # models.toml is checked at load; this also catches a symlinked folder leading out. The file itself may be a
    # symlink: unlinking or replacing it never touches what it points to.
    if not path.parent.resolve().is_relative_to(root.resolve()):
        raise RegistryError(f"{spec.name}: its file's folder {path.parent} resolves to {path.parent.resolve()}, "
                            f"outside {root}")
    return path


def _hub_cached(spec: ModelSpec) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    found = try_to_load_from_cache(spec.repo, spec.file, cache_dir=hub_cache(), revision=spec.revision)
    return Path(found) if isinstance(found, str) else None


def local_path(spec: ModelSpec) -> Path | None:
    """The local copy of spec's file with the right size (ours, an earlier localspec's or the Hub cache's), or
    None. No hashing, no network: for listings. resolve_model() is what verifies."""
    for path in (own_path(spec), _legacy_path(spec), _hub_cached(spec)):
        if path is not None and path.is_file() and path.stat().st_size == spec.size:
            return path
    return None


def local_copy(spec: ModelSpec, log=_stderr) -> Path | None:
    """A verified local copy. Ours, when it fails verification, is removed so it is fetched again; the user's
    Hub cache and what an earlier localspec kept at $LOCALSPEC_HOME/models/FILE are only read."""
    mine = own_path(spec)
    if mine.exists():
        if verified(mine, spec):
            return mine
        log(f"{mine} does not match the sha256 of {spec.name}; removing it")
        mine.unlink()
    legacy = _legacy_path(spec)
    if legacy is not None and verified(legacy, spec):  # an earlier localspec's download
        return legacy
    cached = _hub_cached(spec)
    if cached is not None:
        if verified(cached, spec):
            return cached
        log(f"{cached} in the Hugging Face cache does not match the sha256 of {spec.name}; ignoring it "
            f"(it is left as it is) and downloading to {mine}")
    return None


def name_hint(text: str) -> str:
    """For a model path that is really a models.toml name: how to use the name ('' otherwise)."""
    try:
        reg = load_registry()
    except LocalspecError:
        return ""
    if text in reg.pairs:
        return f"; {text!r} is a pair in models.toml: pass --pair {text} (pair={text!r} in Python)"
    if text in reg.models:
        return (f"; {text!r} is a model in models.toml: `localspec pull {text}` fetches it and prints its path, "
                "or pass a pair's name with --pair (`localspec models` lists them)")
    return ""


def check_gguf(path: str | os.PathLike) -> Path:
    """Fail early, with the fix, on paths llama.cpp would reject with a bare NULL."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                         "convert it with llama.cpp's convert_hf_to_gguf.py or download a .gguf build")
    return p


def check_model_path(path) -> Path:
    """check_gguf's check of a GGUF path (exists, a file, GGUF magic), naming how to use a models.toml name that
    was passed as a path."""
    try:
        return check_gguf(path)
    except ModelError as e:
        if Path(path).expanduser().exists():
            raise
        raise ModelError(f"{e}{name_hint(str(path))}") from None
