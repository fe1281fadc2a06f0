"""Whether a draft model can draft for a target: llama.cpp's draft/target compatibility rules."""
from __future__ import annotations

from dataclasses import dataclass

import llama_cpp as L

from .model import Model


@dataclass(frozen=True)
class Check:
    rule: str
    ok: bool
    detail: str


def compare_vocab(target: Model, draft: Model) -> list[Check]:
    """llama.cpp's draft/target compatibility rules (common/speculative.cpp), one Check per rule."""
    tv, dv = target.vocab, draft.vocab

    def same(rule: str, a, b) -> Check:
        return Check(rule, a == b, f"target {a!r}, draft {b!r}")

    checks = [same("vocab type", L.llama_vocab_type(tv), L.llama_vocab_type(dv))]
    for name, add, tok in (("BOS", L.llama_vocab_get_add_bos, L.llama_vocab_bos),
                           ("EOS", L.llama_vocab_get_add_eos, L.llama_vocab_eos)):
        ta, da = bool(add(tv)), bool(add(dv))
        ok = ta == da and (not ta or tok(tv) == tok(dv))
        checks.append(Check(f"add_{name.lower()} and {name} id", ok,
                            f"target add={ta} id={tok(tv)}, draft add={da} id={tok(dv)}"))
    diff = abs(target.n_vocab - draft.n_vocab)
    checks.append(Check("vocab size difference <= 128", diff <= 128,
                        f"target {target.n_vocab}, draft {draft.n_vocab} (difference {diff})"))
    first = next((i for i in range(5, min(target.n_vocab, draft.n_vocab))
                  if target.token_text(i) != draft.token_text(i)), None)
    if first is None:
        checks.append(Check("token text from id 5 on", True, f"ids 5..{min(target.n_vocab, draft.n_vocab) - 1} identical"))
    else:
        checks.append(Check("token text from id 5 on", False,
                            f"first difference at token {first}: {target.token_text(first).decode(errors='replace')!r} "
                            f"vs {draft.token_text(first).decode(errors='replace')!r}"))
    return checks
