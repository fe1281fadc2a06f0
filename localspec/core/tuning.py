"""Every number auto was tuned with, in one table: its value, what it trades, and what chose it.

"Replayed" means scripts/oracle_bound.py replay over recorded greedy outputs (the 8 shipped and 15 held-out
prompts, 23 in all; the structured and history sets where said) priced with the kept cost curves (this host's
and the built-in amd1, amd2, intel, zen1): the replay that chose a number is the evidence, since the same
prompts and curves are then reported in docs/performance.md. "Hand-set" numbers were never fitted: they are
a reasonable guess that no replay has moved. `auto.AutoDrafter` reads them as `self.tuning.<name>`; a test or
an experiment passes another table with dataclasses.replace(TUNING, name=value).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType


def _n(value, trades: str, chosen_by: str):
    meta = {"trades": trades, "chosen_by": chosen_by}
    if isinstance(value, dict):  # read-only, one per table
        return field(default_factory=lambda: MappingProxyType(dict(value)), metadata=meta)
    return field(default=value, metadata=meta)


@dataclass(frozen=True)
class Tuning:
    # -- the chooser --
    margin: float = _n(
        1.02, "a draft must be expected to beat plain decoding by this factor: estimates are noisy and a failed "
              "draft costs more than a held one gains",
        "replayed, 23 prompts x 5 curves, with the account (caution): sum of log geomeans 1.3164 at 1.02 against "
        "1.3025 at 1.05 and 1.3154 at 1.0; 7 prompts trailing a fixed drafter by > 0.02 against 9 and 8")
    caution: float = _n(
        0.05, "the margin grows by this much per plain step a request's drafts have lost so far",
        "replayed, 23 prompts x 5 curves: 0.05 lifted the worst prompt and the geomeans a little; 0.1 and more "
        "cost the slowest-verifying host 1-3%")
    # -- the draft model --
    may_win_factor: float = _n(
        1.25, "the draft model is tried at all only if, always right, it would beat plain decoding by this",
        "hand-set (a probe pays a catch-up of the draft's cache, so a marginal model is never worth one)")
    may_win_every: int = _n(32, "tokens of context between two may-win decisions (costs move slowly with depth)",
                            "hand-set")
    probe_every: int = _n(64, "rounds between probes of the draft model (doubling each time a probe loses)",
                          "hand-set")
    probe_every_max: int = _n(4096, "the longest gap between probes", "hand-set")
    probe_lag: int = _n(8, "probe the draft model only while its cache lacks at most this many tokens",
                        "hand-set (a probe after a long gap pays a long catch-up for one round's answer)")
    model_prior: float = _n(0.7, "the draft model's per-token acceptance before it has drafted",
                            "hand-set; learned per request from its first probe")
    # -- grammar-forced tokens --
    forced_prior: float = _n(0.95, "acceptance of a grammar-forced token (a model may spell the same bytes "
                                   "otherwise)", "hand-set; learned per request")
    guess_prior: float = _n(0.7, "how often the model writes the token spelling the rest of the forced bytes",
                            "hand-set; learned per token")
    guess_min: float = _n(0.5, "that token is drafted only while its rate is at least this", "hand-set")
    # -- n-gram guesses (NgramDrafter): a guess's first token, by the size of its match --
    ngram_first: dict = _n(
        {1: 0.1, 2: 0.25, 3: 0.35, 4: 0.45, 6: 0.55},
        "the first token's acceptance by match size (1, 2, 3, 4-5, 6+) outside a copy run: longer predicts better",
        "measured on recorded outputs of the shipped prompts (a 3-4 token match copied from the prompt was "
        "followed ~85% of the time, repeated from the output ~60%), set below them")
    short_run_prior: float = _n(
        0.3, "the first token's prior inside a short copy run (1-3 tokens held)",
        "replayed with continue_prior in place: 0.3 instead of 0.4 kept the worst prompt at 0.98x of plain on "
        "every curve (0.6 -> 0.4 was the same trade before)")
    long_run_prior: float = _n(0.85, "the first token's prior inside a long copy run (4+ held)",
                               "measured: quoting is bursty; a copy under way tends to go on")
    split_prior: float = _n(0.1, "a match whose earlier occurrences went on differently (any size)",
                            "measured on recorded outputs: ~15% at any size, set below it")
    continue_prior: dict = _n(
        {"prompt": 0.8, "output": 0.6, "split": 0.4},
        "a guess's tokens after its first, by origin (the first has its own priors)",
        "measured in replayed rounds of the 8 shipped prompts: 63-100% per position for a copy from the prompt, "
        "49-83% from the output, ~45% after a split; replayed on an Intel host's outputs, 5 curves x 2 sets: "
        "geomeans up on 7 of 10 pairs (by up to 1.7 points), down by 0.002 at most on two")
    cap: dict = _n(
        {"prompt": 0.94, "output": 0.88, "split": 0.88},
        "no n-gram token is priced above this however well guesses did: copy runs end somewhere",
        "measured: inside long copy runs the next token held 93-94% (prompt) and 80-87% (output); replayed, "
        "23 prompts x 5 curves: this host's worst prompt 0.95x -> 0.99x of plain, no geomean fell")
    # -- under a grammar (JSON extraction copies its values from the prompt) --
    grammar_prompt_prior: float = _n(
        0.65, "a prompt copy's first token under a grammar, before a copy run",
        "measured on scripts/holdout_structured.jsonl: 72% of 216 guesses (44-100% by match size), set below it")
    grammar_short_run_prior: float = _n(0.4, "the first token's prior in a short copy run under a grammar",
                                        "replayed on the structured sets (the shape lost 1% on AMD curves)")
    grammar_kind_rates: dict = _n(
        {"prompt": (0.92, 0.46, 0.05), "output": (0.70, 0.97, None), "split": (0.29, 0.78, None)},
        "starting rates by token kind (word, punctuation, line break) and origin under a grammar",
        "measured on the plain outputs of scripts/holdout_structured.jsonl (the shipped ones judge it)")
    # -- a prediction (the client's guess at the output), by copy run (0, 1-3, 4+) --
    prediction_prior: tuple = _n((0.5, 0.7, 0.9), "acceptance of a prediction's tokens by copy run level",
                                 "hand-set: aligned with it, the output tends to follow it")
    # -- history (earlier requests' outputs): prior = min(base + step * (size // 2) + support_step * support, max)
    history_base: float = _n(0.15, "history guess prior, its base", "hand-set; learned across a scope's requests")
    history_size_step: float = _n(0.1, "history prior per match size step (3, 4-5, 6+)", "hand-set")
    history_support_step: float = _n(0.1, "history prior per support level (1, 2-3, 4+ places agreeing)", "hand-set")
    history_max: float = _n(0.7, "the highest history prior", "hand-set")
    # -- how statistics learn (AcceptanceStats, KindOdds) --
    stats_weight: float = _n(2.0, "pseudo-observations a prior is worth", "hand-set")
    stats_decay: float = _n(0.99, "forgetting per settled guess, so estimates follow the text", "hand-set")
    kind_weight: float = _n(8.0, "pseudo-guesses a token kind's prior is worth (pooled, so a few guesses teach "
                                 "it)", "hand-set")
    kind_decay: float = _n(0.99, "forgetting per settled guess of the kind odds", "hand-set")


TUNING = Tuning()


def table(tuning: Tuning = TUNING) -> list[tuple[str, object, str, str]]:
    """(name, value, what it trades, what chose it) for every number, in the table's order."""
    return [(f.name, getattr(tuning, f.name), f.metadata["trades"], f.metadata["chosen_by"]) for f in fields(tuning)]
