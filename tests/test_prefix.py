"""Tier 2: prompts that repeat start at once (the prompt cache, core.prefix with store.prefix's disk tier), with the
real SmolLM2-135M. In exact mode a prompt restored from a kept state gives the very text a fresh prefill gives, from
memory and from disk (a restart), at several prefix lengths; a damaged state is said, skipped and recomputed; one
scope's states never serve another's; a request can opt out; the RAM tier stays under its cap."""
from __future__ import annotations

import numpy as np
import pytest

import localspec
from localspec.core import prefix

from conftest import shared_calibration

WORDS, KEPT = 110, 130  # a document of ~150 tokens (past what is worth keeping: 128), and how much of it comes back
DOC = ("The lighthouse keeper climbed the stairs every evening, lit the lamp, wrote the weather in the log, and "
       "watched the ships pass the rocks until morning. ")


def prompt(llm, words: int, question: str) -> list[int]:
    """A document of about `words` words, then a question about it (as an app sends a file with a request)."""
    doc = " ".join((DOC * (words // 20 + 1)).split()[:words])
    return llm.chat_tokens([{"role": "system", "content": f"Answer from this document.\n\n{doc}"},
                            {"role": "user", "content": question}])


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty kv folder (and history), this machine's measurements."""
    h = shared_calibration(tmp_path / "home")
    monkeypatch.setenv("LOCALSPEC_HOME", str(h))
    return h


@pytest.fixture(scope="module")
def fresh(smol_path):
    """Exact mode without a prompt cache: every prompt prefilled anew."""
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=1024, exact=True, prompt_cache_mb=0,
                        prompt_cache_disk_mb=0) as llm:
        yield llm


def load(path, **kw):
    return localspec.load(target=path, draft=path, n_ctx=1024, exact=True, **kw)


LENGTHS = ((120, "none"), (350, "auto"), (600, "model"))  # a short head, a document, most of the context


@pytest.mark.parametrize("tier, lengths", [pytest.param("ram", LENGTHS, marks=pytest.mark.slow, id="ram"),
                                           pytest.param("disk", ((120, "auto"),), id="disk"),  # the rest: slow tier
                                           pytest.param("disk", LENGTHS, marks=pytest.mark.slow, id="disk-all")])
def test_a_restored_prompt_gives_the_text_a_fresh_prefill_gives(smol_path, fresh, home, tier, lengths):
    """A kept state restored at several prefix lengths (a short head, a document, most of the context), from
    memory in the same process or from disk after a restart: token for token the text of a fresh prefill
    (exact mode), with every drafter, and the stats say how much came from where."""
    cache = dict(prompt_cache_mb=256, prompt_cache_disk_mb=0) if tier == "ram" else \
        dict(prompt_cache_mb=0, prompt_cache_disk_mb=256)
    llm = load(smol_path, **cache)
    try:
        for words, drafter in lengths:
            first = prompt(llm, words, "Who climbed the stairs?")
            llm.generate(first, max_tokens=8, temperature=0, drafter="none")  # kept as it ends
            if tier == "disk":  # a restart: nothing left in memory
                assert llm.prompt_cache.ram_used == 0
                llm.prompt_cache.close()  # (its write done)
                llm.close()
                llm = load(smol_path, **cache)
            else:
                llm.target.truncate(0)  # the sequence's own cache no longer holds it
            second = prompt(llm, words, "What did the keeper write in the log?")
            got = llm.generate(second, max_tokens=24, temperature=0, drafter=drafter)
            want = fresh.generate(second, max_tokens=24, temperature=0, drafter=drafter)
            common = prefix.agree(np.array(first), np.array(second))
            assert got.tokens == want.tokens, (words, drafter)
            assert got.stats.prompt_restored_from == tier and common - 1 <= got.stats.prompt_restored <= common
            assert got.stats.prompt_reused == got.stats.prompt_restored
            assert f"cached ({tier})" in got.stats.line()
            assert want.stats.prompt_restored == 0
    finally:
        llm.close()


def test_a_damaged_state_is_said_skipped_and_recomputed(smol_path, fresh, home, capfd):
    p = prompt(fresh, WORDS, "Who climbed the stairs?")
    with load(smol_path, prompt_cache_mb=0) as llm:
        llm.generate(p, max_tokens=4, temperature=0, drafter="none")
    files = list((home / "kv").rglob("*.kv"))
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[-100] ^= 0xFF  # one bit of the K/V rows
    files[0].write_bytes(bytes(data))
    with load(smol_path, prompt_cache_mb=0) as llm:
        r = llm.generate(p, max_tokens=16, temperature=0, drafter="none")
    assert r.stats.prompt_restored == 0 and r.tokens == fresh.generate(p, max_tokens=16, temperature=0).tokens
    assert capfd.readouterr().err.count(" is damaged ") == 1 and not files[0].exists()


def test_one_scopes_states_never_serve_another(smol_path, home):
    """The server keeps a scope per API key: a state kept for one key restores nothing for another, from memory or
    from disk."""
    with load(smol_path) as llm:
        p = prompt(llm, WORDS, "Who climbed the stairs?")
        llm.generate(p, max_tokens=4, temperature=0, drafter="none", scope="key-a")
        llm.target.truncate(0)
        other = llm.generate(p, max_tokens=4, temperature=0, drafter="none", scope="key-b")
        llm.target.truncate(0)
        same = llm.generate(p, max_tokens=4, temperature=0, drafter="none", scope="key-a")
    assert other.stats.prompt_reused == 0 and same.stats.prompt_restored > KEPT
    with load(smol_path, prompt_cache_mb=0) as llm:  # a restart: from disk, scoped alike
        assert llm.generate(p, max_tokens=4, temperature=0, drafter="none", scope="key-c").stats.prompt_reused == 0
        llm.target.truncate(0)
        assert llm.generate(p, max_tokens=4, temperature=0, drafter="none", scope="key-b").stats.prompt_restored > KEPT


def test_a_request_opts_out_and_a_repeated_head_is_kept_once(smol_path, home):
    """prompt_cache=False: nothing restored, nothing kept. A system prompt followed by many questions keeps one
    state (the first request's): each later one adds too little to be worth a copy of the head."""
    with load(smol_path, prompt_cache_disk_mb=0) as llm:
        p = prompt(llm, WORDS, "Who climbed the stairs?")
        llm.generate(p, max_tokens=4, temperature=0, drafter="none", prompt_cache=False)
        assert llm.prompt_cache.ram_used == 0
        for q in ("Who climbed the stairs?", "What did he light?", "When did he stop?", "What passed the rocks?"):
            llm.target.truncate(0)
            r = llm.generate(prompt(llm, WORDS, q), max_tokens=4, temperature=0, drafter="none")
        assert r.stats.prompt_restored > KEPT
        kept = [e for s in llm.prompt_cache._scopes.values() for e in s.entries.values()]
        assert len(kept) == 1
        llm.target.truncate(0)
        r = llm.generate(p, max_tokens=4, temperature=0, drafter="none", prompt_cache=False)
        assert r.stats.prompt_reused == 0


@pytest.mark.slow  # the slow tier (CI runs it): the default run stays within minutes
def test_the_ram_tier_stays_under_its_cap(smol_path, home):
    """Many different long prompts: the states held in memory (their real bytes) stay under the cap, the least
    recently used dropped first; the latest is kept."""
    cap_mb = 30  # about three 450-token states of this model (~23 KB a token)
    with load(smol_path, prompt_cache_mb=cap_mb, prompt_cache_disk_mb=0) as llm:
        prompts = [prompt(llm, 300, f"Question {i}: who climbed the stairs?") for i in range(6)]
        for i, p in enumerate(prompts):
            llm.generate([100 + i] + p, max_tokens=2, temperature=0, drafter="none")  # apart from the first token
            assert llm.prompt_cache.ram_used <= cap_mb * 2 ** 20
        held = [e for s in llm.prompt_cache._scopes.values() for e in s.entries.values()]
        assert 1 <= len(held) < 6 and sum(len(e.blob) for e in held) == llm.prompt_cache.ram_used
        llm.target.truncate(0)
        assert llm.generate([105] + prompts[5], max_tokens=2, temperature=0).stats.prompt_restored > 250


def test_memory_stays_under_the_cap_while_a_state_is_taken_read_or_written(smol_path, home, monkeypatch):
    """The bench's caps pass: memory grew one state past --prompt-cache-mb, the copy being taken (or read from
    disk) before room was made, and states waiting for the disk writer held after RAM let them go. Room is now
    made first, and pending writes count: at the moment each state is copied or read, the states in memory plus
    it fit the cap."""
    from localspec.core.model import Seq
    from localspec.store.prefix import KvFiles

    seen = []
    with load(smol_path, prompt_cache_mb=11, prompt_cache_disk_mb=256) as llm:
        cache = llm.prompt_cache
        taken, read = Seq.state, KvFiles.read

        def state(self):
            blob = taken(self)
            seen.append(("taken", cache._in_memory() + len(blob)))
            return blob

        def read_state(self, scope, name):
            blob = read(self, scope, name)
            seen.append(("read", cache._in_memory() + (len(blob) if blob is not None else 0)))
            return blob

        monkeypatch.setattr(Seq, "state", state)
        monkeypatch.setattr(KvFiles, "read", read_state)
        prompts = [prompt(llm, WORDS, f"Question {i}: who climbed the stairs?") for i in range(4)]
        for i, p in enumerate(prompts):
            llm.generate([100 + i] + p, max_tokens=2, temperature=0, drafter="none")
        for keeper in cache._keepers.values():
            keeper.flush()
        llm.target.truncate(0)
        assert llm.generate([100] + prompts[0], max_tokens=2, temperature=0).stats.prompt_restored_from == "disk"
    assert [k for k, _ in seen].count("taken") >= 4 and "read" in [k for k, _ in seen]
    assert max(n for _, n in seen) <= 11 * 2 ** 20, seen


def test_parallel_slots_restore_from_the_cache(smol_path, home):
    """A request in a parallel slot restores its prompt from a state another slot's request kept."""
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=1024, parallel=2, prompt_cache_disk_mb=0) as llm:
        p = prompt(llm, WORDS, "Who climbed the stairs?")
        llm.generate(p, max_tokens=4, temperature=0, drafter="none")
        for seq in llm.target.seqs:
            seq.clear()
        r = llm.generate(prompt(llm, WORDS, "What did he light?"), max_tokens=4, temperature=0, drafter="none")
        assert r.stats.prompt_restored > KEPT and r.stats.prompt_restored_from == "ram"


def test_the_server_restores_after_a_restart_and_counts_it_as_cached(smol_path, home, tmp_path):
    """`localspec serve` keeps prompt states on disk: after a restart the same head is restored, and the reply's
    usage.prompt_tokens_details.cached_tokens counts the restored tokens; "localspec": {"prompt_cache": false}
    opts a request out."""
    import httpx

    from test_server import Server

    doc = " ".join((DOC * 20).split()[:WORDS])
    body = {"messages": [{"role": "system", "content": f"Answer from this document.\n\n{doc}"},
                         {"role": "user", "content": "Who climbed the stairs?"}], "max_tokens": 4, "temperature": 0}
    usage = []
    for run, asks in enumerate(([{"localspec": {"prompt_cache": False}}, {}], [{}])):
        s = Server(smol_path, tmp_path / f"server{run}.log")
        try:
            for extra in asks:
                r = httpx.post(s.url + "/v1/chat/completions", json=body | extra, timeout=120)
                assert r.status_code == 200, r.text
                usage.append(r.json()["usage"])
        finally:
            s.stop()
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    # opted out: nothing restored (and nothing kept); then the slot's own cache (and kept as it ends); after the
    # restart, from disk
    assert cached[0] == 0 and cached[1] > KEPT and cached[2] > KEPT, cached
    assert "cached (disk)" in (tmp_path / "server1.log").read_text()
