"""Constrained output (llguidance) under speculation: lossless, drafts what it forces, bad specs refused.

Tier 1 on synthetic distributions, tier 2 on SmolLM2-135M (its own draft, exact mode).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localspec import RequestError
from localspec.core.acceptance import accept_rejection
from localspec.core import grammar as grammar_module
from localspec.core.grammar import Grammar, GrammarError, compile_spec
from localspec.core.sampling import SamplingParams, dist

from test_acceptance import assert_distributed_as, emitted, run

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give the person as JSON (name, age, city): Maria Lopez, 34, lives in Lisbon."}]
DRAFTERS = ["model", "ngram", "hybrid", "auto"]


# ---- tier 1 ----
def test_rejection_on_a_masked_distribution_emits_the_masked_target():
    """Masking p and q the same way keeps rejection sampling exact for the constrained distribution."""
    rng = np.random.default_rng(20)
    V = 8
    allowed = np.array([1, 0, 1, 1, 0, 1, 1, 0], dtype=bool)
    logits = 2 * rng.standard_normal((3, V))
    masked = np.where(allowed, logits, -np.inf)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p = [dist(row, params) for row in masked]
    q = [dist(np.where(allowed, row + 0.8 * rng.standard_normal(V), -np.inf), params) for row in logits[:2]]
    target = np.array([row.dense(V) for row in p])

    def step():
        draft = [q[0].sample(rng), q[1].sample(rng)]
        return emitted(*accept_rejection(p, q, draft, [rng] * 3), draft)

    positions = run(step)
    for j in range(3):
        assert all(allowed[t] for t in positions[j])
        assert_distributed_as(positions[j], target[j])


@pytest.mark.parametrize("field, value, message", [
    ("json_schema", "{not json", "json_schema is not valid JSON"),
    ("json_schema", {"type": "strin"}, "json_schema is invalid: .*strin"),
    ("json_schema", [1, 2], "must be a JSON object"),
    ("regex", "[a-", "regex is invalid: .*unclosed character class"),
    ("grammar", "start: foo", "grammar is invalid: .*unknown name"),
    ("grammar", "root ::= \"yes\" (", "grammar is invalid"),
    ("json_schema", {"type": "string", "pattern": "a" * (1 << 20)}, "json_schema is .* characters; at most"),
])
def test_bad_specs_are_refused_with_llguidances_message(field, value, message):
    with pytest.raises(GrammarError, match=message):
        compile_spec(**{field: value})


def test_one_constraint_at_most():
    with pytest.raises(GrammarError, match="not json_schema and regex"):
        compile_spec(json_schema=PERSON, regex="a+")
    assert compile_spec() is None
    assert compile_spec(grammar='root ::= "yes" | "no"')  # llama.cpp GBNF is converted


def test_a_schema_past_the_parser_limits_is_refused_not_compiled_forever():
    props = {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}
    huge = {"type": "object", "properties": {f"p{i}": props for i in range(8000)}}  # under 1 MiB of text
    with pytest.raises(GrammarError, match="json_schema is invalid: schema too large"):
        compile_spec(json_schema=huge)


def test_a_constraint_compiles_once_per_process():
    schema = {"type": "object", "properties": {"once": {"type": "string"}}}
    before = grammar_module._cached.cache_info()
    g = compile_spec(json_schema=schema)
    assert compile_spec(json_schema=json.dumps(schema)) == g and compile_spec(json_schema=dict(schema)) == g
    after = grammar_module._cached.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 2
    # the order of a schema's keys is the order of the output's: another order is another grammar
    assert compile_spec(json_schema={"properties": schema["properties"], "type": "object"}) != g
    assert compile_spec(regex=" ") and compile_spec(regex="a+")  # a regex of one space is a regex


def catalog(n: int) -> dict:
    """A schema of n $defs as an API's generated models have them: records with ids, enums, nested objects, a
    reference to the record before (a chain n long) and to another."""
    defs = {}
    for i in range(n):
        defs[f"Record{i}"] = {
            "type": "object", "description": f"Record {i}: one entry of the catalog (generated from the API's models).",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z0-9-]{8,36}$"},
                "name": {"type": "string", "maxLength": 80},
                "kind": {"enum": ["alpha", "beta", "gamma", "delta", f"kind{i}"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "parent": {"$ref": f"#/$defs/Record{i - 1}"} if i else {"type": "null"},
                "links": {"type": "array", "items": {"$ref": f"#/$defs/Record{i * 7 % n}"}},
                "meta": {"type": "object", "properties": {"created": {"type": "string", "format": "date-time"},
                                                          "count": {"type": "integer", "minimum": 0}}}},
            "required": ["id", "name", "kind"], "additionalProperties": False}
    return {"$defs": defs, "type": "object", "required": ["items"],
            "properties": {"items": {"type": "array", "items": {"$ref": f"#/$defs/Record{n - 1}"}}}}


def tool_parameters(kb: int) -> dict:
    """A tool's parameters of about kb KB: many documented fields, some arrays of objects."""
    props: dict = {}
    while len(json.dumps(props)) < kb * 1000:
        i = len(props)
        props[f"field_{i}"] = ({"type": "array", "items": {"type": "object", "required": ["key"], "properties": {
                                   "key": {"type": "string"}, "value": {"type": "string"}}}} if i % 5 == 0 else
                               {"type": ["string", "integer", "boolean", "number"][i % 4],
                                "description": f"Field {i} of the request (what the tool does with it; see the docs)."})
    return {"type": "object", "properties": props, "required": list(props)[:10], "additionalProperties": False}


def chain(kind: str, n: int) -> dict:
    """A constraint whose definitions each refer to the next, n long: the shapes llguidance recurses deepest on."""
    if kind == "schema":  # objects whose property is the next object (the security probe's schema)
        defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
        return {"json_schema": {"$defs": defs | {f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}}
    if kind == "lark":  # each rule is the next one
        return {"grammar": "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'}
    if kind == "lark groups":  # each rule is the next one inside 20 groups: 1.8 KB of stack a group
        return {"grammar": "start: r0\n" + "".join(f"r{i}: {'(' * 20}r{i + 1}{')' * 20}\n" for i in range(n))
                           + f'r{n}: "x"\n'}
    raise ValueError(kind)


# ---- tier 2 ----
def free_and_constrained(llm, drafter, **spec):
    prompt = llm.chat_tokens(ASK)
    return llm.generate(prompt, max_tokens=48, temperature=0, drafter=drafter, k=6, p_min=0, **spec)


def test_json_schema_output_is_valid_and_ends_when_complete(smol_engine):
    r = free_and_constrained(smol_engine, "none", json_schema=PERSON)
    obj = json.loads(r.text)
    assert set(obj) == {"name", "age", "city"} and isinstance(obj["age"], int)
    assert r.finish_reason == "stop" and r.text.startswith('{"name": "')  # one-line JSON by default


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_constrained_speculation_equals_constrained_plain(smol_engine, drafter):
    plain = free_and_constrained(smol_engine, "none", json_schema=PERSON)
    spec = free_and_constrained(smol_engine, drafter, json_schema=PERSON)
    assert spec.tokens == plain.tokens
    if drafter != "model":
        assert spec.stats.drafted_forced > 0 and spec.stats.accepted_forced > 0


def test_the_rest_of_the_forced_bytes_is_spelled_as_a_guess(smol_engine):
    """After a key the grammar forces '": "'; llguidance's forced tokens stop at '":' (' "' could open a longer
    token): the tokenizer's spelling of the rest is offered as a guess, which auto drafts while it holds."""
    g = Grammar(smol_engine.target, compile_spec(json_schema=PERSON))
    forced = g.forced()
    guess = g.spelled(forced)
    assert smol_engine.target.detokenize(forced) == '{"name":'
    assert smol_engine.target.detokenize(guess) == ' "' and len(guess) == 1
    g.consume(forced + guess)
    assert g.forced() == [] and g.spelled([]) == []  # inside the value: nothing forced


def test_a_guess_the_tokenizer_would_never_write_is_not_offered(smol_engine):
    """' [' opening an array of objects always merges with what follows (' [{'), ' ' before true or false too
    (' true'): a model writes its tokenizer's spelling, so those guesses would only fail. ' ' before a number
    and ' "' before a string are how the tokenizer writes them, and are offered."""
    m = smol_engine.target
    item = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": item}, "ok": {"type": "boolean"},
                                               "age": {"type": "integer"}, "name": {"type": "string"}},
              "required": ["tags", "ok", "age", "name"], "additionalProperties": False}
    g = Grammar(m, compile_spec(json_schema=schema))
    guesses = {}
    for t in m.tokenize('{"tags": [{"n": 1}], "ok": true, "age": 5, "name": "x"}', add_special=False):
        key = bytes(g.matcher.compute_ff_bytes()).decode().strip(' ,{"').split('"')[0]  # the key being forced
        if key in schema["properties"] and key not in guesses:
            guesses[key] = m.detokenize(g.spelled(g.forced()))
        g.consume([t])
    assert guesses == {"tags": "", "ok": "", "age": " ", "name": ' "'}


def test_forbidden_drafts_never_reach_the_target(smol_engine, monkeypatch):
    """validate_tokens cuts a draft first: every draft verified is a valid continuation of what was emitted."""
    import localspec.core.loop as engine

    seen = []
    real = engine.verify

    def spy(target, pending, draft):
        seen.append(list(draft.tokens))
        return real(target, pending, draft)

    monkeypatch.setattr(engine, "verify", spy)
    prompt = smol_engine.chat_tokens(ASK)
    r = smol_engine.generate(prompt, max_tokens=48, temperature=0.9, seed=3, drafter="hybrid", k=8, p_min=0,
                             json_schema=PERSON)
    assert r.stats.drafted > 0
    check = Grammar(smol_engine.target, compile_spec(json_schema=PERSON))
    done = 0
    for draft in seen:
        assert check.validate(draft) == len(draft)
        n = next((i for i, (a, b) in enumerate(zip(draft, r.tokens[done:])) if a != b), len(draft))
        check.consume(r.tokens[done:done + n + 1])
        done += n + 1
    json.loads(r.text)


def test_sampled_constrained_output_is_always_valid(smol_engine):
    prompt = smol_engine.chat_tokens(ASK)
    for seed in range(4):
        r = smol_engine.generate(prompt, max_tokens=64, temperature=1.0, seed=seed, drafter="auto", json_schema=PERSON)
        if r.finish_reason == "stop":
            assert set(json.loads(r.text)) == {"name", "age", "city"}


def test_regex_gbnf_lark_and_json_object(smol_engine):
    prompt = smol_engine.chat_tokens([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    assert smol_engine.generate(prompt, max_tokens=8, temperature=0, regex="(yes|no)").text in ("yes", "no")
    assert smol_engine.generate(prompt, max_tokens=8, temperature=0,
                                grammar='root ::= "Yes" | "No"').text in ("Yes", "No")
    assert smol_engine.generate(prompt, max_tokens=8, temperature=0,
                                grammar='start: "YES" | "NO"').text in ("YES", "NO")
    r = smol_engine.generate(prompt, max_tokens=64, temperature=0, json_object=True)
    assert r.finish_reason == "length" or isinstance(json.loads(r.text), dict)


def test_whitespace_opt_out_through_x_guidance(smol_engine):
    flexible = PERSON | {"x-guidance": {"whitespace_flexible": True}}
    compact = free_and_constrained(smol_engine, "none", json_schema=PERSON)
    loose = free_and_constrained(smol_engine, "none", json_schema=flexible)
    assert json.loads(compact.text) and json.loads(loose.text)
    assert compact.stats.generated <= loose.stats.generated


def test_a_grammar_that_cannot_finish_ends_with_length(smol_engine):
    r = smol_engine.generate("Count:", max_tokens=12, temperature=0, regex="[0-9 ]{200}")
    assert r.finish_reason == "length" and r.stats.generated == 12 and set(r.text) <= set("0123456789 ")


def test_bad_spec_through_the_api_is_a_request_error(smol_engine):
    with pytest.raises(GrammarError, match="regex is invalid"):
        smol_engine.generate("hi", max_tokens=4, regex="(")
    assert issubclass(GrammarError, type(RequestError("x")).__mro__[1])  # a LocalspecError: the CLI's exit 2


def test_a_constraint_that_outgrows_llguidance_limits_raises_instead_of_ending_early(smol_engine, monkeypatch):
    """Past max_lexer_states llguidance's mask allows only the end of generation: the output stopped at
    '{"name":' with finish_reason 'stop', as if complete."""
    from llguidance import LLParserLimits

    monkeypatch.setattr(grammar_module, "_limits", lambda: LLParserLimits(max_lexer_states=40))
    stream = smol_engine.stream(smol_engine.chat_tokens(ASK), max_tokens=64, temperature=0, json_schema=PERSON)
    with pytest.raises(GrammarError, match="too many states.*simpler schema"):  # built, then failed midway
        list(stream)
    monkeypatch.undo()
    assert json.loads(smol_engine.generate(smol_engine.chat_tokens(ASK), max_tokens=64, temperature=0,
                                           json_schema=PERSON).text)


# A chain of ~1,000 objects (75 KB of schema) or ~2,700 Lark rules overflowed an 8 MB thread stack inside
# llguidance (SIGSEGV, the server gone): each is compiled and its matcher built in a child process, so that a
# crash fails the test instead of ending pytest.
DEEP = """
import json, sys
from localspec.core.grammar import Grammar, GrammarError, compile_spec
from localspec.core.model import Model
try:
    Grammar(Model(sys.argv[1], vocab_only=True), compile_spec(**json.loads(sys.stdin.read()))).allowed()
    print("compiled")
except GrammarError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("kind, n, outcome", [
    ("schema", 1_000, "compiled"),  # 75 KB: crashed on an 8 MB stack
    ("schema", 12_000, "refused: the constraint failed"),  # 900 KB: crashed; now past llguidance's symbol limit
    ("lark", 3_000, "compiled"),  # crashed on an 8 MB stack
    ("lark groups", 14_000, r"refused: grammar has 294,\d{3} .* at most 50,000"),  # 760 KB: overflows 512 MiB too
])
def test_deep_constraints_are_compiled_or_refused_never_crash(smol_path, kind, n, outcome):
    root = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", DEEP, str(smol_path)], input=json.dumps(chain(kind, n)),
                       capture_output=True, text=True, timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert re.match(outcome, r.stdout), r.stdout


def test_big_real_schemas_still_compile(smol_engine):
    """300 $defs that refer to each other (200 KB, 5,700 of MAX_UNITS) and a tool's 50 KB of parameters."""
    for schema in (catalog(300), tool_parameters(50)):
        Grammar(smol_engine.target, compile_spec(json_schema=schema)).allowed()
