"""The prompt cache's disk tier (store.prefix.KvFiles) and `localspec cache`: tier 1, random states, no model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from localspec.core.llama import ModelConfig
from localspec.store import prefix, prefix_key, prefix_listing
from localspec.store.prefix import HEADER, KvFiles

FP = "0123456789abcdef0123456789abcdef"


def state(seed: int, n_tokens: int = 200, n_bytes: int = 50_000) -> tuple[np.ndarray, bytearray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, n_tokens, dtype=np.int32), bytearray(rng.bytes(n_bytes))


def files(root: Path, pattern: str = "*.kv") -> list[Path]:
    return sorted(root.rglob(pattern))


def disk_bytes(root: Path) -> int:
    return sum(os.stat(p).st_size for p in root.rglob("*") if p.is_file())


def kept(root: Path, fp: str = FP, cap: int = 1 << 30, **kw) -> KvFiles:
    said = []
    kv = KvFiles(root, fp, cap, {"model": "m.gguf"}, say=said.append, **kw)
    kv.said = said
    return kv


def test_a_written_state_is_let_go_once_on_disk(tmp_path):
    """The writer holds a state only until it is written: the RAM tier may have let it go meanwhile (the bench's
    caps pass saw one state too many in memory while the writer thread waited for the next write)."""
    import sys

    kv = kept(tmp_path / "kv")
    tokens, blob = state(1)
    alone = sys.getrefcount(blob)
    kv.write("", "aa", tokens, blob)
    assert kv.flush() and kv.held() == []
    assert sys.getrefcount(blob) == alone
    got = kv.read("", "aa")
    assert bytes(got) == bytes(blob) and sys.getrefcount(got) == alone  # a read is the caller's alone
    kv.close()


def test_written_states_are_listed_and_read_back_whole(tmp_path):
    kv = kept(tmp_path / "kv")
    a, b = state(1), state(2, n_tokens=129, n_bytes=10)
    kv.write("", "aa", *a)
    kv.write("key-0123abcd", "bb", *b)
    assert kv.flush()
    assert [(n, t.tolist()) for n, t in kv.stored("")] == [("aa", a[0].tolist())]
    assert [n for n, _ in kv.stored("key-0123abcd")] == ["bb"]
    assert kv.stored("other") == []
    got = kv.read("", "aa")
    assert not memoryview(got).readonly and bytes(got) == bytes(a[1])  # writable: llama.cpp is handed it
    assert bytes(kv.read("key-0123abcd", "bb")) == bytes(b[1])
    assert kv.read("", "missing") is None and not kv.said
    model = tmp_path / "kv" / FP
    assert sorted(p.name for p in model.iterdir()) == ["default", "key-0123abcd", "meta.json"]
    assert json.loads((model / "meta.json").read_text()) == {"model": "m.gguf", "fingerprint": FP}
    for folder in (tmp_path / "kv", model, model / "default"):  # they hold users' prompts
        assert folder.stat().st_mode & 0o777 == 0o700
    assert (model / "default" / "aa.kv").stat().st_size == HEADER.size + 4 * 200 + 50_000
    kv.close()


def test_a_scope_that_is_no_folder_name_is_hashed(tmp_path):
    assert prefix.scope_folder("") == "default"
    assert prefix.scope_folder("key-0123abcd") == "key-0123abcd"
    odd = {prefix.scope_folder(s) for s in ("../x", "a/b", "default", "é", "x" * 65)}
    assert len(odd) == 5 and all(n.startswith("scope-") and "/" not in n for n in odd)


def test_a_write_cut_short_leaves_no_visible_state_and_its_temp_file_goes_once_stale(tmp_path):
    kv = kept(tmp_path / "kv")
    kv.write("", "aa", *state(1))
    assert kv.flush()
    folder = tmp_path / "kv" / FP / "default"
    stale, young = folder / ".bb.x1.tmp", folder / ".cc.x2.tmp"  # a crashed writer's, and one being written now
    for p in (stale, young):
        p.write_bytes(b"LSKV" + b"\0" * 100)
    old = time.time() - 2 * prefix.STALE_TEMP_S
    os.utime(stale, (old, old))
    assert [n for n, _ in kv.stored("")] == ["aa"]
    assert kv.read("", "bb") is None and not kv.said
    kv.write("", "dd", *state(2))  # each write ends with the eviction pass, which removes stale temp files
    assert kv.flush()
    assert not stale.exists() and young.exists()
    kv.close()


def test_the_writer_replaces_a_file_whole(tmp_path, monkeypatch):
    kv = kept(tmp_path / "kv")
    replaced = []
    real = os.replace
    monkeypatch.setattr(prefix.os, "replace", lambda a, b: (replaced.append((Path(a), Path(b))), real(a, b)))
    kv.write("", "aa", *state(1))
    assert kv.flush()
    (tmp, dest), = [(t, d) for t, d in replaced if d.suffix == ".kv"]  # meta.json is written the same way
    assert tmp.parent == dest.parent and tmp.name.startswith(".aa.") and tmp.name.endswith(".tmp")
    assert dest.name == "aa.kv"
    kv.close()


@pytest.mark.parametrize("damage", ["flip a state byte", "flip a token byte", "truncate", "append",
                                    "empty", "other magic"])
def test_a_damaged_file_is_not_used_said_once_and_removed(tmp_path, damage):
    kv = kept(tmp_path / "kv")
    tokens, blob = state(3)
    kv.write("", "aa", tokens, blob)
    kv.write("", "bb", *state(4))
    assert kv.flush()
    path = tmp_path / "kv" / FP / "default" / "aa.kv"
    raw = bytearray(path.read_bytes())
    if damage == "flip a state byte":
        raw[-1000] ^= 0x10
    elif damage == "flip a token byte":
        raw[HEADER.size + 17] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "append":
        raw += b"\0"
    elif damage == "empty":
        raw = b""
    else:
        raw[:4] = b"GGUF"
    path.write_bytes(raw)
    got = kv.read("", "aa")
    assert got is None
    assert not path.exists()
    assert len(kv.said) == 1 and "is damaged" in kv.said[0] and "removed and the prompt prefilled" in kv.said[0]
    assert kv.read("", "aa") is None and len(kv.said) == 1
    assert [n for n, _ in kv.stored("")] == ["bb"]
    assert bytes(kv.read("", "bb")) == bytes(state(4)[1])
    kv.close()


def test_damage_found_by_a_listing_is_said_once(tmp_path):
    writer = kept(tmp_path / "kv")
    writer.write("", "aa", *state(3))
    assert writer.flush()
    path = tmp_path / "kv" / FP / "default" / "aa.kv"
    raw = bytearray(path.read_bytes())
    raw[HEADER.size] ^= 0xFF  # a token: the listing's checksum catches it
    path.write_bytes(raw)
    kv = kept(tmp_path / "kv")
    assert kv.stored("") == [] and kv.stored("") == []
    assert len(kv.said) == 1 and not path.exists()


def test_a_state_written_for_another_fingerprint_is_never_read(tmp_path):
    other = kept(tmp_path / "kv", fp="f" * 32)
    tokens, blob = state(5)
    other.write("", "aa", tokens, blob)
    assert other.flush()
    mine = tmp_path / "kv" / FP / "default"
    mine.mkdir(parents=True)
    (mine / "aa.kv").write_bytes((tmp_path / "kv" / ("f" * 32) / "default" / "aa.kv").read_bytes())
    kv = kept(tmp_path / "kv")
    assert kv.read("", "aa") is None
    assert kv.stored("") == []
    assert "another model or other settings" in kv.said[0]
    assert bytes(other.read("", "aa")) == bytes(blob)  # its own folder's copy is untouched


def test_the_least_recently_used_go_first_across_models_and_the_total_stays_under_the_cap(tmp_path):
    root = tmp_path / "kv"
    size = HEADER.size + 4 * 200 + 50_000
    cap = 3 * size + 2_000  # three states and the two meta.json files
    a, b = kept(root, cap=cap), kept(root, fp="b" * 32, cap=cap)
    for i, (kv, name) in enumerate([(a, "a0"), (a, "a1"), (b, "b0")]):
        kv.write("", name, *state(i))
        assert kv.flush()
        past = time.time() - 100 + i  # a clear order, whatever the file system's clock granularity
        os.utime(root / kv.fingerprint / "default" / f"{name}.kv", (past, past))
    a.touch("", "a0")  # used now: the newest
    b.write("", "b1", *state(9))
    assert b.flush()
    assert {p.stem for p in files(root)} == {"a0", "b0", "b1"}
    assert disk_bytes(root) <= cap
    assert bytes(a.read("", "a0")) == bytes(state(0)[1])
    a.write("", "a2", *state(10))
    assert a.flush()
    assert {p.stem for p in files(root)} == {"a0", "b1", "a2"}  # a0's read was a use too
    assert disk_bytes(root) <= cap
    assert [n for n, _ in b.stored("")] == ["b1"]


def test_the_folder_never_holds_more_than_the_cap_while_a_state_is_written(tmp_path, monkeypatch):
    """Room is made before a state's file is written, not after: measured at the moment each file lands (the
    bench's caps pass saw a 4,000-token state written over a full folder reach 324 MB under a 286 MB cap)."""
    root = tmp_path / "kv"
    size = HEADER.size + 4 * 200 + 50_000
    cap = 2 * size + 1_000  # two states and meta.json
    kv = kept(root, cap=cap)
    peaks, replace = [], os.replace

    def landing(src, dst):
        replace(src, dst)
        peaks.append(disk_bytes(root))

    monkeypatch.setattr(prefix.os, "replace", landing)
    for i in range(5):
        kv.write("", f"s{i}", *state(i))
        assert kv.flush()
    assert len(peaks) >= 5 and max(peaks) <= cap, peaks
    assert {p.stem for p in files(root)} == {"s3", "s4"}


def test_a_state_larger_than_the_cap_is_not_written(tmp_path):
    kv = kept(tmp_path / "kv", cap=10_000)
    kv.write("", "aa", *state(1))
    kv.write("", "bb", *state(2))
    assert kv.flush() and files(tmp_path) == []
    assert len(kv.said) == 1 and "larger than the prompt cache's disk cap" in kv.said[0]


CHILD = """
import sys, numpy as np
from pathlib import Path
from localspec.store.prefix import KvFiles
root, who, cap = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kvs = [KvFiles(root, fp, cap, {"model": "m.gguf"}) for fp in sys.argv[4:6]]  # one folder shared, one its own
rng = np.random.default_rng(who)
for k in range(40):
    shared = k % 3 == 0  # both processes write these names, with the same bytes
    kv = kvs[0] if shared or k % 2 else kvs[1]
    seed = 1000 + k if shared else who * 100 + k
    r = np.random.default_rng(seed)
    tokens = r.integers(0, 50000, int(r.integers(1, 300)), dtype=np.int32)
    kv.write("", f"s{k}" if shared else f"p{who}-{k}", tokens, bytearray(r.bytes(int(r.integers(10_000, 120_000)))))
    for name, _ in kv.stored(""):
        if rng.random() < 0.3:
            kv.read("", name)  # None where the other process evicted it meanwhile: fine
    kv.flush()
for kv in kvs:
    kv.close()
"""


def test_two_processes_writing_and_evicting_in_one_root_leave_every_file_whole_and_the_total_under_the_cap(tmp_path):
    root, cap = tmp_path / "kv", 600_000
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(who), str(cap), FP, "ef"[who] * 32],
                              env=env, stderr=subprocess.PIPE, text=True) for who in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "damaged" not in err and "could not keep" not in err, err
    assert disk_bytes(root) <= cap
    left = files(root)
    assert left and not files(root, ".*.tmp")
    for fp in {p.parent.parent.name for p in left}:
        kv = kept(root, fp=fp)
        listed = kv.stored("")
        assert {n for n, _ in listed} == {p.stem for p in left if p.parent.parent.name == fp}
        for name, tokens in listed:
            blob = kv.read("", name)
            assert blob is not None
            seed = 1000 + int(name[1:]) if name.startswith("s") else int(name.split("-")[0][1:]) * 100 + int(
                name.split("-")[1])
            r = np.random.default_rng(seed)
            assert tokens.tolist() == r.integers(0, 50000, int(r.integers(1, 300)), dtype=np.int32).tolist()
            assert bytes(blob) == r.bytes(int(r.integers(10_000, 120_000)))
        assert not kv.said


def test_a_listing_opens_only_files_it_has_not_seen(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    writer = kept(root)
    for i in range(3):
        writer.write("", f"n{i}", *state(i))
    assert writer.flush()
    kv = kept(root)
    opened = []
    real_open = open
    monkeypatch.setattr(prefix, "open", lambda *a, **k: (opened.append(Path(a[0]).name), real_open(*a, **k))[1],
                        raising=False)
    assert len(kv.stored("")) == 3 and len(opened) == 3
    for _ in range(5):
        assert len(kv.stored("")) == 3
    assert len(opened) == 3
    writer.write("", "n3", *state(3))  # another writer (process): only its new file is opened
    writer.forget("", "n0")
    assert writer.flush()
    assert sorted(n for n, _ in kv.stored("")) == ["n1", "n2", "n3"]
    assert opened[3:] == ["n3.kv"]
    kv.write("", "n4", *state(4))  # its own write: known without opening it
    assert kv.flush()
    assert sorted(n for n, _ in kv.stored("")) == ["n1", "n2", "n3", "n4"] and len(opened) == 4

    folder = root / FP / "default"
    hour_ago = time.time() - 3600
    os.utime(folder, (hour_ago, hour_ago))  # a change long past: one listing is then trusted while it stays
    listed = []
    real_scandir = os.scandir
    monkeypatch.setattr(prefix.os, "scandir", lambda p: (listed.append(p), real_scandir(p))[1])
    kv.stored("")
    for _ in range(5):
        assert len(kv.stored("")) == 4
    assert len(listed) == 1 and len(opened) == 4


def test_a_change_within_the_folder_mtime_s_tick_is_still_seen(tmp_path):
    root = tmp_path / "kv"
    writer, kv = kept(root), kept(root)
    writer.write("", "n0", *state(0))
    assert writer.flush()
    folder = root / FP / "default"
    assert [n for n, _ in kv.stored("")] == ["n0"]
    before = folder.stat().st_mtime_ns
    writer.write("", "n1", *state(1))
    assert writer.flush()
    os.utime(folder, ns=(before, before))  # a coarse clock: the folder's mtime did not move
    assert sorted(n for n, _ in kv.stored("")) == ["n0", "n1"]


def test_a_state_forgotten_while_it_is_being_written_never_appears(tmp_path, monkeypatch):
    import threading

    kv = kept(tmp_path / "kv")
    started, go = threading.Event(), threading.Event()
    real = prefix.tempfile.mkstemp

    def slow_mkstemp(**kw):
        out = real(**kw)
        if kw.get("suffix") == ".tmp" and kw.get("prefix", "").startswith(".aa."):
            started.set()
            assert go.wait(30)
        return out

    monkeypatch.setattr(prefix.tempfile, "mkstemp", slow_mkstemp)
    kv.write("", "aa", *state(1))
    assert started.wait(30)
    kv.forget("", "aa")
    assert kv.stored("") == [] and kv.read("", "aa") is None  # forgotten at once, though its write is under way
    go.set()
    assert kv.flush()
    assert files(tmp_path) == [] and not files(tmp_path, ".*.tmp") and kv.stored("") == []
    kv.write("", "aa", *state(1))  # written again later: kept
    assert kv.flush() and [n for n, _ in kv.stored("")] == ["aa"]


def test_a_write_to_an_unwritable_root_is_said_once_and_never_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    kv = kept(blocker / "kv")
    for i in range(3):
        kv.write("", f"n{i}", *state(i))
        assert kv.flush()
    assert len(kv.said) == 1 and "could not keep a prompt state" in kv.said[0]
    assert kv.stored("") == [] and kv.read("", "n0") is None
    kv.close()


def test_a_long_queue_drops_its_oldest_writes(tmp_path):
    kv = kept(tmp_path / "kv")
    with kv._lock:  # the writer thread waits: everything queues
        for i in range(7):
            kv.write("", f"n{i}", *state(i, n_bytes=1000))
        assert len(kv._pending) == prefix.MAX_PENDING and kv.dropped == 3
    assert kv.flush()
    assert {p.stem for p in files(tmp_path)} == {"n3", "n4", "n5", "n6"}
    big = kept(tmp_path / "kv2", cap=10_000)
    with big._lock:
        for i in range(3):
            big.write("", f"n{i}", *state(i, n_tokens=10, n_bytes=3000))  # more than half the cap pending
        assert [w.name for w in big._pending] == ["n2"] and big.dropped == 2
    big.close()


def test_a_state_waiting_for_the_writer_is_listed_and_read_from_memory(tmp_path):
    kv = kept(tmp_path / "kv")
    kv.write("", "aa", *state(1))
    assert kv.flush()
    tokens, blob = state(2)
    with kv._lock:  # the writer thread waits
        kv.write("", "bb", tokens, blob)
        assert sorted(n for n, _ in kv.stored("")) == ["aa", "bb"] and not files(tmp_path, "bb.kv")
        assert kv.read("", "bb") is blob
        kv.forget("", "bb")
        assert [n for n, _ in kv.stored("")] == ["aa"] and kv.read("", "bb") is None
        kv.write("", "bb", tokens, blob)
    assert kv.flush()
    assert sorted(n for n, _ in kv.stored("")) == ["aa", "bb"] and bytes(kv.read("", "bb")) == bytes(blob)
    kv.close()


def test_forget_removes_the_file_and_a_write_still_waiting(tmp_path):
    kv = kept(tmp_path / "kv")
    kv.write("", "aa", *state(1))
    assert kv.flush()
    with kv._lock:
        kv.write("", "bb", *state(2))
        kv.forget("", "bb")
        kv.forget("", "aa")
    assert kv.flush()
    assert files(tmp_path) == [] and kv.stored("") == []
    kv.forget("", "never-written")
    kv.close()
    kv.write("", "cc", *state(3))  # after close: ignored
    assert files(tmp_path) == []


class FakeModel(SimpleNamespace):
    """What fingerprint() reads of a core.model.Model."""


def fake_model(path: Path, **cfg) -> FakeModel:
    c = ModelConfig(**cfg)
    return FakeModel(path=path, cfg=c, n_ctx=c.n_ctx, flash_attn="off" if c.flash_attn == "auto" else c.flash_attn,
                     extra_bufts=not c.exact)


def test_fingerprint_changes_with_everything_that_shapes_the_bytes_and_only_that(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + os.urandom(10 << 20))
    base, meta = prefix_key.fingerprint(fake_model(path))
    assert len(base) == 32 and meta["model"] == "m.gguf" and meta["settings"]["n_ctx"] == 4096
    assert set(meta["file"]) == {"size", "mtime_ns", "head_tail_sha256"}
    json.dumps(meta)
    same = [fake_model(path, n_threads=3), fake_model(path, n_seq=4)]
    assert all(prefix_key.fingerprint(m)[0] == base for m in same)
    differ = [fake_model(path, n_ctx=2048), fake_model(path, type_k="q8_0"), fake_model(path, type_v="q8_0"),
              fake_model(path, flash_attn="on"), fake_model(path, exact=True), fake_model(path, n_gpu_layers=99),
              fake_model(path, kwargs={"n_ubatch": 64})]
    names = {prefix_key.fingerprint(m)[0] for m in differ}
    assert len(names) == len(differ) and base not in names
    m = fake_model(path)
    m.extra_bufts = False
    assert prefix_key.fingerprint(m)[0] != base
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    assert prefix_key.fingerprint(fake_model(path))[0] != base
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE")
    with open(path, "r+b") as f:  # the same size, another byte in the last 4 MiB
        f.seek(-10, os.SEEK_END)
        f.write(b"x" * 10)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, meta["file"]["mtime_ns"]))
    assert prefix_key.fingerprint(fake_model(path))[0] != base


def test_fingerprint_uses_the_sha256_the_registry_verified(tmp_path, monkeypatch):
    from localspec.store import registry

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + os.urandom(1000))
    registry._remember(path, "ab" * 32)
    assert prefix_key.file_identity(path) == {"sha256": "ab" * 32}
    os.utime(path, ns=(1, 1))  # changed since: hashed again (head and tail)
    assert "sha256" not in prefix_key.file_identity(path)


def test_fingerprint_of_a_real_model_file(smol_path, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    name, meta = prefix_key.fingerprint(fake_model(smol_path, n_ctx=1024))
    assert prefix_key.fingerprint(fake_model(smol_path, n_ctx=1024))[0] == name
    assert meta["model"] == smol_path.name and meta["file"]["size"] == smol_path.stat().st_size
    assert meta["build"]["state_seq_version"] >= 1


def test_cache_command_lists_and_clears(tmp_path, monkeypatch):
    from localspec.apps.cli import cli

    home = tmp_path / "home"
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    path = tmp_path / "smol.gguf"
    path.write_bytes(b"GGUF" + os.urandom(1000))
    for m in (fake_model(path, n_ctx=2048), fake_model(path, exact=True)):
        fp, meta = prefix_key.fingerprint(m)
        kv = KvFiles(prefix.default_root(), fp, prefix.CAP_BYTES, meta)
        for i in range(2 if m.cfg.exact else 1):
            kv.write("", f"n{i}", *state(i, n_tokens=300 + i))
        kv.close()
    rows = sorted(prefix_listing.summary(home / "kv"), key=lambda r: r["files"])
    assert [(r["model"], r["files"], r["tokens"], r["scopes"]) for r in rows] == [("smol.gguf", 1, 300, 1),
                                                                                ("smol.gguf", 2, 601, 1)]
    assert sum(r["bytes"] for r in rows) == disk_bytes(home / "kv") == prefix_listing.total_bytes(home / "kv")
    runner = CliRunner()
    out = runner.invoke(cli, ["cache"], catch_exceptions=False).output
    lines = out.splitlines()
    assert lines[0].split() == ["model", "settings", "states", "tokens", "MB", "last", "used"]
    assert any("n_ctx 2048" in s and " 1 " in s and " 300 " in s for s in lines)
    assert any("exact" in s and " 2 " in s and " 601 " in s for s in lines)
    assert str(home / "kv") in out and "capped at 4096 MB" in out
    assert "$LOCALSPEC_HOME/kv" in runner.invoke(cli, ["cache", "--help"]).output
    out = runner.invoke(cli, ["cache", "--clear", "--model", "other.gguf"], catch_exceptions=False).output
    assert "no prompt states kept" in out and len(files(home)) == 3
    before = disk_bytes(home / "kv")
    out = runner.invoke(cli, ["cache", "--clear", "--model", str(path)], catch_exceptions=False).output
    assert f"removed {before / 2 ** 20:.1f} MB" in out
    assert files(home) == [] and not any((home / "kv").iterdir())
    assert "no prompt states kept" in runner.invoke(cli, ["cache"], catch_exceptions=False).output
