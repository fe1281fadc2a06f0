"""Thinking spans (api/reasoning.py): tier 1, text only."""
from __future__ import annotations

import json
from dataclasses import replace
import random
from pathlib import Path

import pytest

from localspec.api.reasoning import HARMONY, THINK, Spans, markers_of, opens_in_prompt


def split(text: str, inside: bool = False, cuts: list[int] | None = None, markers=THINK) -> tuple[str, str]:
    """(reasoning, answer) of text fed in the pieces `cuts` makes (one piece when None)."""
    s, pieces, at = Spans(replace(markers, inside=inside)), [], 0
    for c in [*(cuts or []), len(text)]:
        pieces += s.feed(text[at:c])
        at = c
    pieces += s.finish()
    return "".join(t for r, t in pieces if r), "".join(t for r, t in pieces if not r)


CASES = [
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, ("\nweigh it\n", "The answer.")),
    ("\n<think>a</think>b", False, ("a", "b")),
    ("weigh it</think>\n\nThe answer.", True, ("weigh it", "The answer.")),
    ("<think>a</think>Use <think> tags: <think>x</think>", False, ("a", "Use <think> tags: <think>x</think>")),
    ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),  # a span only where the output starts
    ("  <thx and more", False, ("", "  <thx and more")),
    ("<think>never closed", False, ("never closed", "")),
    ("<think>a</thin", False, ("a</thin", "")),
    ("<thi", False, ("", "<thi")),
    ("</think>answer", True, ("", "answer")),
    ("", True, ("", "")),
    ("<think></think>", False, ("", "")),
]


@pytest.mark.parametrize("text, inside, want", CASES)
def test_spans_split_alike_however_the_text_is_streamed(text, inside, want):
    assert split(text, inside) == want
    assert split(text, inside, list(range(1, len(text)))) == want  # a character at a time
    rnd = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(0, 4)))) if len(text) > 1 else []
        assert split(text, inside, cuts) == want


# gpt-oss's output as its text comes (llama.cpp renders its channel tokens and <|end|> as text)
HARMONY_CASES = [
    ("<|channel|>analysis<|message|>Weigh it.<|end|><|start|>assistant<|channel|>final<|message|>The answer.", False,
     ("Weigh it.", "The answer.")),
    ("Weigh it.<|end|><|start|>assistant<|channel|>final<|message|>Yes", True, ("Weigh it.", "Yes")),
    ("<|channel|>analysis<|message|>cut short<|end|>", False, ("cut short<|end|>", "")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>Write <|channel|>analysis",
     False, ("a", "Write <|channel|>analysis")),
    ("<|channel|>final<|message|>Straight to it.", False, ("", "Straight to it.")),  # no analysis: all answer
    ("<|channel|>fin", False, ("", "<|channel|>fin")),  # only looked like a header
    ("Plain answer", False, ("", "Plain answer")),
]


@pytest.mark.parametrize("text, inside, want", HARMONY_CASES)
def test_gpt_oss_channels_split_alike_however_the_text_is_streamed(text, inside, want):
    assert split(text, inside, markers=HARMONY) == want
    assert split(text, inside, list(range(1, len(text))), markers=HARMONY) == want
    rnd = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rnd.sample(range(1, len(text)), rnd.randint(0, 4)))
        assert split(text, inside, cuts, markers=HARMONY) == want


def test_gpt_oss_header_tokens_count_in_their_part():
    s = Spans(HARMONY)
    for text in ["<|channel|>", "analysis", "<|message|>", "Hm", "<|end|>", "<|start|>", "assistant", "<|channel|>",
                 "final", "<|message|>", "Yes"]:
        s.token(text)
    assert s.counts["reasoning"]["tokens"] == 10 and s.counts["answer"]["tokens"] == 1  # markers: the span's
    direct = Spans(HARMONY)
    for text in ["<|channel|>", "final", "<|message|>", "Yes"]:
        direct.token(text)
    assert direct.counts["reasoning"]["tokens"] == 0 and direct.counts["answer"]["tokens"] == 4
    cut = Spans(HARMONY)  # the output ends on what only looked like the open marker's beginning: answer
    cut.token("<|channel|>", True)
    assert cut.counts["answer"]["tokens"] == 0
    cut.finish()
    assert cut.counts["answer"] == {"tokens": 1, "from_draft": 1}


def test_a_stream_never_takes_back_what_it_showed():
    """Everything fed is shown as it comes except what may be the start of a marker."""
    s = Spans(THINK)
    assert s.feed("<think>abc") == [(True, "abc")]
    assert s.feed("de</th") == [(True, "de")]  # '</th' held: it may close the span
    assert s.feed("ink>\n") == []
    assert s.feed("Answer") == [(False, "Answer")]
    assert s.reasoning_chars == 5


def test_each_token_counts_in_its_span_markers_included():
    s = Spans(THINK)
    for text, drafted in [("<think>", False), ("a", True), ("b", True), ("</", False), ("think>", True),
                          ("\n\n", False), ("Yes", True)]:
        s.token(text, drafted)
    assert s.counts == {"reasoning": {"tokens": 5, "from_draft": 3}, "answer": {"tokens": 2, "from_draft": 1}}
    inside = Spans(replace(THINK, inside=True))
    for text in ["x", "</think>", "y"]:
        inside.token(text)
    assert inside.counts["reasoning"]["tokens"] == 2 and inside.counts["answer"]["tokens"] == 1


def test_markers_come_from_the_template():
    qwen3 = "{%- if enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{{ '<|im_start|>assistant\n' }}"
    assert markers_of(qwen3) == THINK
    assert markers_of("{{ messages[0].content }}<|im_start|>assistant\n") is None
    assert markers_of(None) is None
    assert markers_of("mentions <think> only") is None
    gpt_oss = ('{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}'
               '{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}'
               '{{- "Reasoning: " + reasoning_effort + "\\n\\n" }}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}')
    assert markers_of(gpt_oss) == HARMONY
    assert not opens_in_prompt("<|start|>user<|message|>Hi<|end|><|start|>assistant", HARMONY)
    assert opens_in_prompt("<|start|>assistant<|channel|>analysis<|message|>", HARMONY)


def test_a_prompt_that_opens_the_span():
    assert opens_in_prompt("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_in_prompt("<|im_start|>assistant\n", THINK)
    assert not opens_in_prompt("<think>\n\n</think>\n\n", THINK)  # thinking off: an empty span, closed
    assert not opens_in_prompt("earlier <think>x</think> turn<|im_start|>assistant\n", THINK)


class _Stats:
    finish_reason, prompt_tokens, generated, prompt_reused = "stop", 10, 5, 0
    accepted_prediction = drafted_prediction = 0

    def to_dict(self):
        return {}


def _events(text: str, size: int = 3):
    from types import SimpleNamespace

    return [SimpleNamespace(text=text[i:i + size], logprob=None, top_logprobs=None, token=0, from_draft=False)
            for i in range(0, len(text), size)]


def test_the_chat_shape_gives_the_span_under_both_names_and_the_answer_as_content():
    from localspec.api.shapes import Chat

    text = "<think>\nI weigh it.\n</think>\n\nYes: <think> is a tag."
    whole = Chat("m", spans=Spans(THINK))
    for ev in _events(text):
        whole.add(ev)
    message = whole.response(_Stats())["choices"][0]["message"]
    assert message["content"] == "Yes: <think> is a tag."
    assert message["reasoning_content"] == message["reasoning"] == "\nI weigh it.\n"

    streamed = Chat("m", spans=Spans(THINK), stop=["tag"])  # stop strings cut the answer, not the thinking
    deltas = [c["choices"][0]["delta"] for ev in _events(text) for c in streamed.chunks(ev)]
    deltas += [c["choices"][0]["delta"] for c in streamed.final_chunks(_Stats())]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nI weigh it.\n"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "Yes: <think> is a "

    plain = Chat("m")  # a model without a span: as before, no reasoning fields
    for ev in _events(text):
        plain.add(ev)
    message = plain.response(_Stats())["choices"][0]["message"]
    assert message["content"] == text and "reasoning_content" not in message


# a Qwen3-style template for SmolLM2's ChatML tokens (the one shipped for measuring): the template opens the span
# (thinking on), or writes it empty and closed (enable_thinking false)
THINKING = (Path(__file__).resolve().parents[1] / "scripts" / "templates" / "chatml_thinking.jinja").read_text()
ASK = [{"role": "user", "content": "Is the sky blue? Answer in a word."}]


@pytest.fixture
def thinking_client(smol_engine, monkeypatch):
    from starlette.testclient import TestClient

    from localspec.api.server import create_app

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: THINKING)
    with TestClient(create_app(smol_engine), base_url="http://127.0.0.1") as client:
        yield client


def _stream(client, body):
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")]


def test_a_span_the_template_opens_is_reasoning_in_whole_and_streamed_replies(thinking_client):
    body = {"messages": ASK, "max_tokens": 12, "temperature": 0}
    r = thinking_client.post("/v1/chat/completions", json=body)
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert message["content"] == ""  # the span is never closed: all of the output is thinking
    used = r.json()["usage"]
    assert used["completion_tokens_details"]["reasoning_tokens"] == used["completion_tokens"] > 0
    assert r.json()["localspec"]["spans"]["reasoning"]["tokens"] == used["completion_tokens"]
    deltas = _stream(thinking_client, body)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == ""


@pytest.mark.parametrize("off", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_off_through_the_template(thinking_client, off):
    body = {"messages": ASK, "max_tokens": 8, "temperature": 0}
    message = thinking_client.post("/v1/chat/completions", json=body | off).json()["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"] is None and message["reasoning"] is None


@pytest.mark.parametrize("field, value", [("reasoning_effort", "maximal"), ("chat_template_kwargs", ["x"]),
                                          ("chat_template_kwargs", {"messages": []}),
                                          ("chat_template_kwargs", {"not a name": 1})])
def test_template_fields_a_request_cannot_use_are_a_400_naming_them(thinking_client, field, value):
    r = thinking_client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field)


def test_thinking_that_the_template_cannot_turn_off_is_refused(smol_engine, monkeypatch):
    from starlette.testclient import TestClient

    from localspec.api.server import create_app

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: THINKING.replace("enable_thinking", "x_think"))
    with TestClient(create_app(smol_engine), base_url="http://127.0.0.1") as client:
        r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "reasoning_effort": "none"})
    assert r.status_code == 400 and "cannot turn its thinking off" in r.json()["error"]["message"]


def test_a_model_without_a_span_answers_as_before(smol_engine):
    from starlette.testclient import TestClient

    from localspec.api.server import create_app

    with TestClient(create_app(smol_engine), base_url="http://127.0.0.1") as client:
        r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "reasoning_effort": "none"})
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and message["content"] and "reasoning_content" not in message


# ---- the budget, and the answer's grammar after the span (core/thinking.py through the engine and server) ----
PROMPT = "<|im_start|>user\nIs the sky blue? Answer in a word.<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_the_budget_forces_the_end_and_the_output_is_the_same_whatever_drafts_it(smol_engine):
    """Exact mode: the text with speculation equals plain decoding's token for token, across the forced end."""
    from localspec.core.thinking import Span

    span = Span(inside=True, budget=6)
    runs = {d: smol_engine.generate(PROMPT, max_tokens=24, temperature=0, drafter=d, span=span)
            for d in ("none", "ngram", "model", "auto")}
    plain = runs.pop("none")
    end = smol_engine.tokenize(span.transition(), add_special=False)
    assert plain.tokens[6:6 + len(end)] == end  # six thinking tokens, then the forced transition
    assert "\n</think>\n\n" in plain.text
    for name, r in runs.items():
        assert r.tokens == plain.tokens, name


def test_a_json_schema_holds_for_the_answer_after_the_span_not_for_the_thinking(smol_engine):
    from localspec.core.thinking import Span

    schema = {"type": "object", "properties": {"blue": {"type": "boolean"}}, "required": ["blue"]}
    for drafter in ("none", "auto"):
        r = smol_engine.generate(PROMPT, max_tokens=40, temperature=0, drafter=drafter, json_schema=schema,
                                 span=Span(inside=True, budget=8))
        thinking, _, answer = r.text.partition("</think>")
        assert thinking.strip() and not thinking.lstrip().startswith("{")
        assert isinstance(json.loads(answer)["blue"], bool), r.text


@pytest.mark.parametrize("cap, asked, most", [(None, 5, 5), (3, 10, 3), (3, None, 3), (None, -1, None)])
def test_a_request_budget_capped_by_the_server_counts_the_thinking_tokens(smol_engine, monkeypatch, cap, asked, most):
    from starlette.testclient import TestClient

    from localspec.api.server import create_app

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: THINKING)
    forced = smol_engine.tokenize("\n</think>\n\n", add_special=False)
    # the forced tokens that are the span's: up to the one that completes its end marker
    close = next(i + 1 for i in range(len(forced)) if "</think>" in smol_engine.detokenize(forced[:i + 1]))
    body = {"messages": ASK, "max_tokens": 30, "temperature": 0} | ({"reasoning_budget": asked} if asked else {})
    with TestClient(create_app(smol_engine, reasoning_budget=cap), base_url="http://127.0.0.1") as client:
        r = client.post("/v1/chat/completions", json=body).json()
        deltas = _stream(client, body)
    used, message = r["usage"], r["choices"][0]["message"]
    reasoning = used["completion_tokens_details"]["reasoning_tokens"]
    if most is None:  # no limit: this model ends its output inside the span it was opened (7 tokens), unforced
        assert reasoning == used["completion_tokens"] > 5 and message["content"] == ""
    else:  # (the answer may write </think> again: a literal marker in the answer stays answer)
        assert reasoning == most + close and message["content"], r
        assert message["reasoning_content"] == message["reasoning"] and "</think>" not in message["reasoning_content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (message["reasoning_content"] or "")
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    # usage gives each span's accepted drafts as well (a draft of the same model: most tokens are drafted)
    details, spans = used["completion_tokens_details"], r["localspec"]["spans"]
    accepted = [details["reasoning_accepted_draft_tokens"], details["answer_accepted_draft_tokens"]]
    assert accepted == [spans["reasoning"]["from_draft"], spans["answer"]["from_draft"]]
    assert sum(accepted) == r["localspec"]["accepted"] and accepted[0] <= reasoning
    assert most is None or sum(accepted) > 0  # (unforced, the 7-token output is over before auto drafts)


@pytest.mark.parametrize("value", [-2, 1.5, "10", True])
def test_a_budget_that_is_no_count_of_tokens_is_a_400(thinking_client, value):
    r = thinking_client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "reasoning_budget": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_budget"


# a thinking template that also offers tools (Hermes-style <tool_call>, as Qwen3's)
THINKING_TOOLS = ("{%- if tools %}{{ '<|im_start|>system\\nYou may call one of these functions. Reply with '"
                  "'<tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call>.\\n' }}"
                  "{%- for t in tools %}{{ t | tojson }}{{ '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
                  + THINKING)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_the_openai_client_reads_the_thinking_under_both_names_and_calls_a_tool_after_it(smol_engine, monkeypatch):
    import openai
    from starlette.testclient import TestClient

    from localspec.api.server import create_app

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: THINKING_TOOLS)
    with TestClient(create_app(smol_engine, reasoning_budget=6), base_url="http://127.0.0.1") as http:
        client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        r = client.chat.completions.create(model="any", messages=ASK, max_tokens=30, temperature=0)
        m = r.choices[0].message
        assert _extra(m, "reasoning_content") and _extra(m, "reasoning") == _extra(m, "reasoning_content")
        assert m.content and "</think>" not in m.content
        assert r.usage.completion_tokens_details.reasoning_tokens > 0
        for name in ("reasoning_accepted_draft_tokens", "answer_accepted_draft_tokens"):  # kept as extra fields
            assert isinstance(_extra(r.usage.completion_tokens_details, name), int)
        chunks = list(client.chat.completions.create(model="any", messages=ASK, max_tokens=30, temperature=0,
                                                     stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(_extra(d, "reasoning_content") or "" for d in deltas) == _extra(m, "reasoning_content")
        assert "".join(_extra(d, "reasoning") or "" for d in deltas) == _extra(m, "reasoning")
        assert "".join(d.content or "" for d in deltas) == m.content

        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model="any", messages=ask, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
        choice = r.choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)
        assert _extra(choice.message, "reasoning_content")  # it thought first, then called


def test_the_python_api_splits_the_thinking_and_keeps_its_budget(smol_engine, monkeypatch):
    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: THINKING)
    r = smol_engine.create_chat_completion(ASK, max_tokens=30, temperature=0, reasoning_budget=4)
    m, used = r["choices"][0]["message"], r["usage"]
    assert m["reasoning_content"] == m["reasoning"] and m["content"]
    forced = len(smol_engine.tokenize("\n</think>\n\n", add_special=False))
    assert 4 < used["completion_tokens_details"]["reasoning_tokens"] <= 4 + forced
    chunks = list(smol_engine.create_chat_completion(ASK, max_tokens=30, temperature=0, reasoning_budget=4, stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == m["reasoning_content"]
    off = smol_engine.create_chat_completion(ASK, max_tokens=8, temperature=0, reasoning_effort="none")
    assert off["choices"][0]["message"]["content"] and off["choices"][0]["message"]["reasoning_content"] is None


def test_stats_count_each_span_apart(smol_engine):
    from localspec.core.thinking import Span

    r = smol_engine.generate(PROMPT, max_tokens=20, temperature=0, drafter="ngram", span=Span(inside=True, budget=5))
    spans = r.stats.spans
    assert set(spans) == {"thinking", "answer"}
    assert spans["thinking"]["tokens"] + spans["answer"]["tokens"] == r.stats.generated
    assert sum(p["drafted"] for p in spans.values()) == r.stats.drafted
    assert sum(p["accepted"] for p in spans.values()) == r.stats.accepted
    assert "thinking" in r.stats.line() and "answer" in r.stats.line()


def test_the_bench_reports_each_span_apart(smol_engine, monkeypatch):
    from localspec.apps import bench

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: THINKING)
    rows = bench.run(smol_engine, [{"id": "sky", "kind": "chat", "messages": ASK}], methods=("none", "ngram"),
                     max_tokens=16, reasoning_budget=3)
    forced = len(smol_engine.tokenize("\n</think>\n\n", add_special=False))
    for name, run in rows[0].runs.items():
        assert 3 < run.spans["thinking"]["tokens"] <= 3 + forced and run.spans["thinking"]["tps"] > 0, name
        assert run.spans["thinking"]["tokens"] + run.spans["answer"]["tokens"] == run.tokens, name
    assert rows[0].runs["none"].spans["thinking"]["drafted"] == 0
    table = bench.table(rows)
    assert "| thinking | " in table and "| answer | " in table


def test_chat_folds_the_thinking_keeps_the_answer_and_think_commands(smol_engine, monkeypatch, capsys):
    from localspec.apps.chat import Chat, Screen

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: THINKING)
    chat = Chat(smol_engine, {"max_tokens": 24, "temperature": 0, "drafter": "none"},
                Screen(interactive=False, show_draft=False))
    chat.handle("/think budget 4")
    chat.handle("Is the sky blue? Answer in a word.")
    out, err = capsys.readouterr()
    reply = chat.conv.messages[-1]
    assert reply["content"] and reply["reasoning_content"] and "</think>" not in reply["content"]
    assert reply["reasoning_content"] not in out and reply["content"].strip() in out  # folded: only the answer
    assert "thought for" in err and "thinking 4" not in out
    chat.handle("/think show")
    assert reply["reasoning_content"].strip() in capsys.readouterr().err
    chat.handle("/think off")
    chat.handle("And the grass?")
    assert "reasoning_content" not in chat.conv.messages[-1] and chat.conv.messages[-1]["content"]
    chat.handle("/think maybe")
    assert "usage: /think" in capsys.readouterr().err


def test_a_chat_template_given_at_load_replaces_the_gguf_one_and_a_broken_one_is_refused(smol_path, tmp_path):
    import localspec
    from localspec.core.chat_template import ChatError

    with localspec.load(target=smol_path, n_ctx=512, chat_template=THINKING, prompt_cache_mb=0,
                        prompt_cache_disk_mb=0) as llm:
        assert llm.chat_template() == THINKING
        assert llm.render_chat(ASK).endswith("<|im_start|>assistant\n<think>\n")
    with pytest.raises(ChatError, match="line 1"):
        localspec.load(target=smol_path, n_ctx=512, chat_template="{% if %}")


def test_generate_chat_json_gives_the_reasoning_and_the_content(smol_path, tmp_path):
    from click.testing import CliRunner

    from localspec.apps.cli import cli

    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING, encoding="utf-8")
    r = CliRunner().invoke(cli, ["generate", "--target", str(smol_path), "--n-ctx", "512", "--chat", "--json",
                                 "--chat-template-file", str(template), "--reasoning-budget", "4", "--max-tokens",
                                 "24", "--temperature", "0", "--drafter", "none", "--no-prompt-cache",
                                 "Is the sky blue? Answer in a word."])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["reasoning"] and out["content"] and out["text"].startswith(out["reasoning"])
    assert set(out["stats"]["spans"]) == {"thinking", "answer"}


# a stand-in for gpt-oss's template (harmony format) on SmolLM2: it opens the analysis channel in the prompt
HARMONY_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
                    "{#- earlier turns: <|start|>assistant<|channel|>final<|message|> #}"
                    "{%- if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{%- endif %}")


def test_gpt_oss_channels_through_the_server_with_a_budget_and_reasoning_effort(smol_engine, monkeypatch):
    """The analysis channel is the reasoning, the final channel the content; the budget forces harmony's own
    end (<|end|>, then the final channel's header), the same whatever drafts it; effort reaches the template."""
    from starlette.testclient import TestClient

    from localspec.api.server import create_app
    from localspec.core.thinking import Span

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: HARMONY_TEMPLATE)
    assert "Reasoning: low" in smol_engine.render_chat(ASK, variables={"reasoning_effort": "low"})
    forced = smol_engine.tokenize(HARMONY.end, add_special=False)
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "reasoning_effort": "low"}
    with TestClient(create_app(smol_engine, reasoning_budget=5), base_url="http://127.0.0.1") as client:
        r = client.post("/v1/chat/completions", json=body).json()
        deltas = _stream(client, body)
        tools = client.post("/v1/chat/completions", json=body | {"tools": [WEATHER]})  # its calls: not read yet
        assert tools.status_code == 400 and "no tool-call format localspec knows" in tools.json()["error"]["message"]
    message, used = r["choices"][0]["message"], r["usage"]
    assert used["completion_tokens_details"]["reasoning_tokens"] == 5 + len(forced)
    assert message["reasoning_content"] and "<|" not in message["reasoning_content"]
    assert message["content"] and "<|channel|>" not in message["content"] and "<|message|>" not in message["content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    prompt = smol_engine.render_chat(ASK, variables={"reasoning_effort": "low"})
    span = Span(HARMONY.open, HARMONY.close, True, 5, HARMONY.end)
    runs = {d: smol_engine.generate(prompt, max_tokens=len(forced) + 12, temperature=0, drafter=d, span=span)
            for d in ("none", "model", "auto")}
    assert runs["none"].tokens[5:5 + len(forced)] == forced
    assert runs["model"].tokens == runs["none"].tokens == runs["auto"].tokens
