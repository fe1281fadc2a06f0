"""Tier 1: the cross-request suffix store (core.history) on token lists written by hand."""
import time

import numpy as np

from localspec.core.history import BYTES_PER_TOKEN, NOTHING, PROMPT_TAIL, History, SuffixCache


def test_a_lookup_proposes_what_followed_the_longest_match():
    c = SuffixCache(1 << 20)
    c.add([1, 2, 3, 4, 5, 6, 7])
    c.add([9, 9, 3, 4, 5, 8, 8])
    found = c.lookup([0, 2, 3, 4, 5], 4)  # [2, 3, 4, 5] matches only the first: 4 deep
    assert (found.size, found.support, found.tokens) == (4, 1, [6, 7])  # and stops at its end
    found = c.lookup([7, 7, 3, 4, 5], 4)  # 3 deep in both: they part at once, the latest wins a tie
    assert (found.size, found.support, found.tokens, found.shares) == (3, 2, [8, 8], [0.5, 1.0])
    assert c.lookup([1, 2, 3, 4, 99], 4) == NOTHING and c.lookup([3, 4], 4) == NOTHING
    assert c.lookup([1, 2, 3], 0) == NOTHING


def test_the_majority_continuation_is_drafted_while_most_places_agree():
    c = SuffixCache(1 << 20)
    for tail in ([10, 11, 12], [10, 11, 12], [10, 11, 13], [20, 21, 22]):
        c.add([5, 6, 7, *tail])
    found = c.lookup([5, 6, 7], 8)
    assert found.support == 4 and found.tokens == [10, 11, 12]  # 3 of 4, then 3 of 3, then 2 of 3
    assert found.shares == [0.75, 1.0, 2 / 3]


def test_the_store_stays_under_its_cap_keeping_the_newest():
    cap = 200 * (4 + BYTES_PER_TOKEN)
    c = SuffixCache(cap)
    rng = np.random.default_rng(0)
    for i in range(50):
        c.add([1000 + i, *rng.integers(0, 500, 20).tolist(), 2000 + i])
        assert c.nbytes <= cap + c.tokens.nbytes
        assert c.size * (4 + BYTES_PER_TOKEN) <= cap
    assert c.lookup(c.tokens[c.starts[-1]:c.starts[-1] + 3].tolist(), 30).tokens[-1] == 2049  # the newest is kept
    first = c.tokens[:c.starts[1] - 1].tolist()
    assert first[0] > 1000  # the oldest went
    # the index was rebuilt over what is left: every stored window is found again
    assert c.lookup(first[:3], 30).tokens == first[3:]


def test_lookups_do_not_wait_for_an_eviction_to_index_the_store_anew():
    """At 64 MB indexing the kept outputs anew takes about a second: the store's requests draft from it as it
    was meanwhile (one scope's requests decoded together would each stall a round otherwise), then from the
    store without its oldest outputs."""
    import threading

    cap = 200 * (4 + BYTES_PER_TOKEN)
    c = SuffixCache(cap)
    for i in range(8):  # 8 outputs of 19 tokens: the 9th fills the store
        c.add([1000 + i, 7, 8, 9, 2000 + i, 3000 + i, *range(100 + 20 * i, 113 + 20 * i)])
    indexing, release = threading.Event(), threading.Event()
    evicted = c._evicted

    def slow():
        indexing.set()
        assert release.wait(30)
        return evicted()

    c._evicted = slow
    adder = threading.Thread(target=c.add, args=([1008, 7, 8, 9, 2008, 3008, *range(500, 513)],))
    adder.start()
    try:
        assert indexing.wait(30)
        found = []
        looker = threading.Thread(target=lambda: found.append(c.lookup([1000, 7, 8, 9], 4)))
        looker.start()
        looker.join(5)
        assert found and found[0].tokens == [2000, 3000, 100, 101]  # answered while indexing: the oldest still there
    finally:
        release.set()
        adder.join(30)
    assert c.lookup([1000, 7, 8, 9], 4).tokens == [] and c.lookup([1008, 7, 8, 9], 4).tokens == [2008, 3008, 500, 501]


def test_a_scope_read_from_its_file_keeps_no_other_scope_waiting():
    """A scope's first request reads its file (up to the cap: seconds at 64 MB); another key's requests meanwhile
    get their own store at once, and the scope's outputs come after those of its file."""
    import threading

    from localspec.core.history import History

    reading, release = threading.Event(), threading.Event()

    class Keeper:
        def load(self, scope):
            if scope == "slow":
                reading.set()
                assert release.wait(30)
                return [np.array([1, 2, 3, 4, 5], dtype=np.int32)]
            return []

        def save(self, scope, seqs):
            pass

    h = History(1, keeper=Keeper())
    loader, later = threading.Thread(target=h.cache, args=("slow",)), None
    loader.start()
    try:
        assert reading.wait(30)
        other = threading.Thread(target=h.record, args=("fast", [9, 9], [6, 7, 8, 9]))
        other.start()
        other.join(5)
        assert not other.is_alive() and h.cache("fast").size
        later = threading.Thread(target=h.record, args=("slow", [], [1, 2, 3, 4, 6]))
        later.start()
    finally:
        release.set()
        loader.join(30)
        if later is not None:
            later.join(30)
    slow = h.cache("slow")
    assert slow.tokens[:slow.size].tolist() == [1, 2, 3, 4, 5, -1, 1, 2, 3, 4, 6, -1]


def test_a_lookup_costs_under_a_millisecond_in_a_full_64_mb_store():
    c = SuffixCache(64 << 20)
    rng = np.random.default_rng(1)
    shape = [30, 31, 32, 33, 34, 35]  # a JSON skeleton every output repeats
    while c.nbytes < (60 << 20):
        c.add([*shape, *rng.integers(0, 3000, 200).tolist(), *shape])
    t = time.perf_counter()
    for _ in range(200):
        found = c.lookup([7, 8, *shape[:3]], 16)
    per = (time.perf_counter() - t) / 200
    assert found.tokens[:3] == shape[3:] and found.support == 64  # the latest CANDIDATES places
    assert per < 1e-3, per


def test_scopes_never_see_each_other():
    h = History(1, scopes=2)
    h.record("key-a", [1, 2, 3], [4, 5, 6, 7])
    assert h.cache("key-a").lookup([2, 3, 4], 4).tokens == [5, 6, 7]
    assert h.cache("key-b").lookup([2, 3, 4], 4) == NOTHING
    h.cache("key-c")  # a third scope: the least recently used one (key-a) is forgotten
    assert "key-a" not in h._caches and set(h._caches) == {"key-b", "key-c"}
    h.record("", list(range(100, 100 + 2 * PROMPT_TAIL)), [7, 8])
    assert h.cache("").starts == [0] and h.cache("").size == PROMPT_TAIL + 2 + 1  # the prompt's tail only


def test_the_estimate_of_its_size_is_not_below_what_it_allocates():
    import tracemalloc

    rng = np.random.default_rng(2)
    for vocab in (50, 150_000):  # windows that repeat a lot, and windows that are all new
        tracemalloc.start()
        c = SuffixCache(1 << 40)
        for _ in range(100):
            c.add(rng.integers(0, vocab, 200).tolist())
        allocated = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert allocated <= c.nbytes, (vocab, allocated / c.size)


# ---- tier 2: SmolLM2 through the engine ----
FIB = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
OTHER = [{"role": "user", "content": "Write a Python function that returns the n-th prime number."}]


def test_an_answer_asked_again_is_drafted_from_history_and_stays_plains(smol_engine, monkeypatch):
    """Exact mode: what history drafts is verified like any draft, so the text equals plain decoding; a
    request that opts out neither drafts from it nor adds to it; another scope sees nothing."""
    monkeypatch.setattr(smol_engine, "history", History(4))
    prompt = smol_engine.chat_tokens(FIB)
    plain = smol_engine.generate(prompt, max_tokens=48, temperature=0, drafter="none")  # kept: history is on
    assert plain.stats.drafted_history == 0
    again = smol_engine.generate(prompt, max_tokens=48, temperature=0, drafter="auto")
    assert again.tokens == plain.tokens
    s = again.stats
    assert s.drafted_history > 32 and s.accepted_history == s.drafted_history  # the same answer, drafted whole
    assert "history" in s.line()
    off = smol_engine.generate(prompt, max_tokens=48, temperature=0, drafter="auto", history=False)
    assert off.tokens == plain.tokens and off.stats.drafted_history == 0
    other = smol_engine.generate(prompt, max_tokens=48, temperature=0, drafter="auto", scope="someone-else")
    assert other.tokens == plain.tokens and other.stats.drafted_history == 0
    # a different question whose answer shares a shape: drafted where it repeats, and still plain's text
    plain2 = smol_engine.generate(smol_engine.chat_tokens(OTHER), max_tokens=48, temperature=0, drafter="none",
                                  history=False)
    spec2 = smol_engine.generate(smol_engine.chat_tokens(OTHER), max_tokens=48, temperature=0, drafter="auto")
    assert spec2.tokens == plain2.tokens


def test_history_under_a_json_schema_drafts_and_stays_the_constrained_text(smol_engine, monkeypatch):
    """Under a grammar, history's guesses are cut where the grammar refuses them (then drafted like any other):
    exact mode, the constrained text asked again equals constrained plain decoding and was drafted from history."""
    monkeypatch.setattr(smol_engine, "history", History(4))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "legs": {"type": "integer"}}, "required": ["name", "legs"]}
    prompt = smol_engine.chat_tokens([{"role": "user", "content": "Describe a cat as JSON."}])
    plain = smol_engine.generate(prompt, max_tokens=48, temperature=0, drafter="none", json_schema=schema)
    again = smol_engine.generate(prompt, max_tokens=48, temperature=0, drafter="auto", json_schema=schema)
    assert again.tokens == plain.tokens and again.stats.drafted_history > 0


def test_history_is_sampled_exactly_under_rejection_sampling(smol_engine, monkeypatch):
    """History drafts are point masses: at T > 0 a seeded request gives plain's tokens whatever was drafted."""
    monkeypatch.setattr(smol_engine, "history", History(4))
    prompt = smol_engine.chat_tokens(FIB)
    opts = dict(max_tokens=48, temperature=0.7, seed=11)
    plain = smol_engine.generate(prompt, drafter="none", **opts)
    spec = smol_engine.generate(prompt, drafter="auto", **opts)
    assert spec.tokens == plain.tokens and spec.stats.drafted_history > 0


def test_the_option_is_checked_and_the_server_takes_it(smol_engine):
    import pytest

    from localspec.api.request import ApiError, parse_options
    from localspec.core.request import RequestError

    with pytest.raises(RequestError, match="history must be true or false"):
        smol_engine.generate("hi", max_tokens=2, history="no")
    options, names = parse_options({"localspec": {"history": False}}, chat=False, defaults={})
    assert options["history"] is False and names["history"] == "localspec.history"
    with pytest.raises(ApiError, match="localspec.history must be true or false"):
        parse_options({"localspec": {"history": 0}}, chat=False, defaults={})


# ---- kept across runs (store.history) ----
def test_kept_outputs_merge_across_processes_and_the_newest_fit(tmp_path):
    import subprocess
    import sys

    from localspec.store.history import HistoryFiles

    where = tmp_path / "h"
    code = ("import sys; from pathlib import Path; from localspec.store.history import HistoryFiles\n"
            "f = HistoryFiles(Path(sys.argv[1]), 1 << 20)\n"
            "for i in range(40): f.save('', [[int(sys.argv[2]), i, 7, 8, 9]])\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(where), str(w)]) for w in (1, 2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    kept = HistoryFiles(where, 1 << 20).load("")
    assert sorted((int(s[0]), int(s[1])) for s in kept) == [(w, i) for w in (1, 2) for i in range(40)]  # none lost
    small = HistoryFiles(where, 10 * 6 * (4 + BYTES_PER_TOKEN))  # room for 10 of them
    small.save("", [[3, 0, 7, 8, 9]])
    assert len(small.load("")) == 10 and small.load("")[-1].tolist() == [3, 0, 7, 8, 9]  # the newest
    assert small.load("other scope") == []


def test_an_unreadable_file_is_said_and_started_afresh(tmp_path, capsys):
    from localspec.store.history import HistoryFiles

    f = HistoryFiles(tmp_path, 1 << 20)
    f.path("").write_bytes(b"not numpy")
    assert f.load("") == [] and "ignoring the unreadable history file" in capsys.readouterr().err
    f.save("", [[1, 2, 3, 4]])
    assert [s.tolist() for s in f.load("")] == [[1, 2, 3, 4]]


def test_a_file_of_other_ids_is_said_and_started_afresh(tmp_path, capsys):
    """A readable file that is not this model's store (ids past its vocabulary, which would reach llama_decode
    as drafts, or no int32 ids at all) is ignored, said, and replaced by the next save; the folder kept by the
    user alone (it holds every output)."""
    import numpy as np

    from localspec.store.history import HistoryFiles

    f = HistoryFiles(tmp_path / "history" / "model", 1 << 20, n_vocab=1000)
    f.save("", [[1, 2, 3, 4]])
    assert (tmp_path / "history").stat().st_mode & 0o077 == 0
    for bad in (np.array([5, 6, 7, 5000, -1], dtype=np.int32), np.array([5, 6, -7, -1], dtype=np.int32),
                np.array([1.5, 2.5]), np.zeros((2, 2), dtype=np.int32)):
        np.save(f.path(""), bad)
        assert f.load("") == [] and "ignoring the history file" in capsys.readouterr().err
    f.save("", [[1, 2, 3, 4]])
    assert [s.tolist() for s in f.load("")] == [[1, 2, 3, 4]]


def test_a_history_outlives_the_engine_and_can_be_kept_in_memory_only(smol_path, tmp_path, monkeypatch):
    import localspec
    from conftest import shared_calibration

    monkeypatch.setenv("LOCALSPEC_HOME", str(shared_calibration(tmp_path / "home")))
    with localspec.load(target=smol_path, n_ctx=512, exact=True, history_mb=1) as llm:
        prompt = llm.chat_tokens(FIB)
        plain = llm.generate(prompt, max_tokens=48, temperature=0, drafter="none")
    assert list((tmp_path / "home" / "history").rglob("*.npy"))  # kept when the engine closed
    with localspec.load(target=smol_path, n_ctx=512, exact=True, history_mb=1) as llm:
        again = llm.generate(prompt, max_tokens=48, temperature=0, drafter="auto")
    assert again.tokens == plain.tokens and again.stats.drafted_history > 24
    with localspec.load(target=smol_path, n_ctx=512, exact=True, history_mb=1, history_file=False) as llm:
        assert llm.generate(prompt, max_tokens=48, temperature=0, drafter="auto").stats.drafted_history == 0


# ---- from a review ----
def test_a_longer_match_at_the_end_of_an_output_does_not_hide_one_that_goes_on():
    c = SuffixCache(1 << 20)
    c.add([9, 1, 2, 3, 4])  # the longest match, but nothing follows it
    c.add([7, 2, 3, 4, 5, 6, 7])
    assert c.lookup([9, 1, 2, 3, 4], 4).tokens == [5, 6, 7]


def test_a_cap_too_small_for_any_output_keeps_none():
    c = SuffixCache(200)
    c.add(list(range(5000)))
    assert c.size == 0 and c.nbytes <= 200 + c.tokens.nbytes


def test_one_output_longer_than_the_cap_keeps_its_end_and_an_empty_file_breaks_nothing(tmp_path, capsys):
    from localspec.store.history import HistoryFiles

    f = HistoryFiles(tmp_path, 100 * (4 + BYTES_PER_TOKEN))
    f.save("", [[1, 2, 3, 4]] * 10)
    f.save("", [list(range(9000))])
    (kept,) = f.load("")
    assert kept.tolist() == list(range(9000))[-99:]  # not an emptied file
    f.path("").write_bytes(b"")  # what a power loss leaves
    h = History(1, keeper=f)
    assert h.cache("").size == 0 and "ignoring the unreadable history file" in capsys.readouterr().err
    h.record("", [1, 2, 3], [4, 5, 6])
    h.save()
    assert [s.tolist() for s in f.load("")] == [[1, 2, 3, 4, 5, 6]]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_passphrase_in_the_environment_is_one_key(monkeypatch):
    from localspec.apps.options import api_keys

    monkeypatch.setenv("LOCALSPEC_API_KEY", "correct horse battery staple")
    assert api_keys(()) == ("correct horse battery staple",)
    assert api_keys(("a", "b")) == ("a", "b")
    monkeypatch.delenv("LOCALSPEC_API_KEY")
    assert api_keys(()) == ()
