"""Thinking spans (api/reasoning.py): tier 1, text only."""
from __future__ import annotations

import json
import random

import pytest

from localspec.api.reasoning import THINK, Spans, markers_of, opens_in_prompt


def split(text: str, inside: bool = False, cuts: list[int] | None = None) -> tuple[str, str]:
    """(reasoning, answer) of text fed in the pieces `cuts` makes (one piece when None)."""
    s, pieces, at = Spans(THINK, inside), [], 0
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
    inside = Spans(THINK, inside=True)
    for text in ["x", "</think>", "y"]:
        inside.token(text)
    assert inside.counts["reasoning"]["tokens"] == 2 and inside.counts["answer"]["tokens"] == 1


def test_markers_come_from_the_template():
    qwen3 = "{%- if enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{{ '<|im_start|>assistant\n' }}"
    assert markers_of(qwen3) == THINK
    assert markers_of("{{ messages[0].content }}<|im_start|>assistant\n") is None
    assert markers_of(None) is None
    assert markers_of("mentions <think> only") is None


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


# a Qwen3-style template for SmolLM2's ChatML tokens: the template opens the span (thinking on), or writes it
# empty and closed (enable_thinking false)
THINKING = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
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
