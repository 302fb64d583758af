"""Prompts keyed with exactly the token ids vLLM computes (``router/render.py``).

The corpus (``loadtest/render_corpus.py``) holds about 280 requests: tools and tool calls, tool
results, ``chat_template_kwargs``, ``reasoning_effort``, ``documents``, ``continue_final_message``,
``developer`` messages, content parts, unicode and whitespace, token-id and batched completions.
``tests/fixtures/render/vllm-0.32.json`` holds the ids a real vLLM 0.32 replica of the tiny model
rendered for each (captured with ``python -m loadtest.render_corpus capture``); the ``vllm`` tests ask
a live replica again.
"""

from __future__ import annotations

import json

import pytest

from loadtest import tiny_model
from loadtest.render_corpus import FIXTURE, corpus, tokenizer_digest
from router.prefix import key_for, prompts_of
from router.chat_template import ChatTemplate
from router.render import Unkeyable, render_chat
from router.tokenizer import LocalTokenizer

CAPTURED = json.loads(FIXTURE.read_text())
CASES = {c["name"]: c for c in CAPTURED["cases"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenizer:
    folder = tiny_model.write_tokenizer(tmp_path_factory.mktemp("tiny"))
    assert tokenizer_digest(folder) == CAPTURED["tokenizer"], "the fixture was captured with another tokenizer"
    return LocalTokenizer(folder)


def test_the_fixture_holds_the_corpus_as_built_today():
    assert [(c["name"], c["path"], c["body"]) for c in CAPTURED["cases"]] == \
        [(c["name"], c["path"], c["body"]) for c in corpus()]
    assert len(CASES) >= 200


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "ids" in c["vllm"]])
def test_token_ids_equal_vllms(tiny, name):
    case = CASES[name]
    prompts, inexact = prompts_of(case["path"], case["body"], tiny)
    assert inexact is None
    assert [list(p) for p in prompts] == case["vllm"]["ids"]  # ids of a long text come as an array


def test_the_tiny_template_renders_plain_chats_as_before(tiny):
    """Every benchmark and test written for the plain template keys the same."""
    messages = [{"role": "system", "content": "alpha"}, {"role": "user", "content": "bravo"}]
    assert tiny.render_chat(messages) == "<s><|system|>\nalpha</s>\n<|user|>\nbravo</s>\n<|assistant|>\n"


# -- what the tiny model's template does not show ---------------------------------------------------


def test_a_template_that_loops_over_content_gets_content_parts():
    t = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}[{{ p['type'] }}:{{ p['text'] }}]"
                     "{% endfor %}{% endfor %}")
    assert t.content_format == "openai"
    body = {"messages": [{"role": "user", "content": "one"},
                         {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "3"}]}]}
    assert render_chat(t, body, {}) == "[text:one][text:two][text:3]"


def test_a_template_that_prints_content_gets_text_parts_joined_by_newlines():
    t = ChatTemplate("{% for m in messages %}{{ m.content }}|{% endfor %}")
    assert t.content_format == "string"
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}]}
    assert render_chat(t, body, {}) == "a\nb||"


def test_tojson_does_not_escape_html_and_keeps_key_order():
    t = ChatTemplate("{{ tools | tojson }}")
    body = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"z": "<b>&", "a": "ü"}}}]}
    assert render_chat(t, body, {}) == \
        '[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": "<b>&", "a": "ü"}}}]'


def test_generation_blocks_and_loop_controls_render():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert render_chat(t, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, {}) == "a"


def test_message_fields_read_as_attributes_render_as_hugging_faces_sandbox_renders_them():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = ("{% for m in messages %}{{ m.role }}|{{ m.name is defined }}|{{ m.name }}|{{ m.keys is string }}|"
              "{{ m.get('role') }}|{{ m.items is defined }}|{{ m.tool_calls is defined and m.tool_calls }};"
              "{% endfor %}")
    messages = [{"role": "user", "content": "a", "name": "ann"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c", "keys": "shadowed", "items": 1}]
    stock = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    assert ChatTemplate(source).render(messages=messages) == stock.render(messages=messages)


def test_a_field_a_message_lacks_fails_as_in_hugging_faces_sandbox_when_read_further():
    with pytest.raises(Exception, match="'dict object' has no attribute 'name'"):
        ChatTemplate("{% for m in messages %}{{ m.name.first }}{% endfor %}").render(
            messages=[{"role": "user", "content": "a"}])


def test_kwargs_the_template_does_not_read_are_not_given_to_it():
    t = ChatTemplate("{{ flag is defined }}/{{ bos_token }}")
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"other": 1}}
    assert render_chat(t, body, {"bos_token": "<s>"}) == "False/<s>"


def test_the_tool_use_template_is_picked_when_the_request_has_tools(tmp_path):
    folder = tiny_model.write_tokenizer(tmp_path)
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = LocalTokenizer(folder)
    messages = [{"role": "user", "content": "x"}]
    assert tok.render({"messages": messages}) == "plain"
    assert tok.render({"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}) == "tools"


@pytest.mark.parametrize("part, reason", [
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}, "multimodal"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "multimodal"),
    ({"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}}, "multimodal"),
    ({"type": "made_up", "text": "x"}, "invalid"),
])
def test_a_chat_whose_ids_cannot_be_known_is_keyed_by_bytes_with_the_reason(tiny, part, reason):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]}
    key = key_for("/v1/chat/completions", body, "tiny", tokenizer=tiny)
    assert key is not None and key.in_bytes and key.inexact == reason


@pytest.mark.parametrize("extra, reason", [
    ({"chat_template": "{{ messages }}"}, "request_chat_template"),
    ({"truncate_prompt_tokens": 10}, "truncated"),
    ({"chat_template_kwargs": {"tokenize": True}}, "invalid"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "invalid"),
])
def test_request_fields_that_change_the_ids_beyond_the_router_are_named(tiny, extra, reason):
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    assert key_for("/v1/chat/completions", body, "tiny", tokenizer=tiny).inexact == reason


def test_a_template_that_raises_is_a_template_error():
    t = ChatTemplate("{{ raise_exception('no tools here') if tools else 'ok' }}")
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
    with pytest.raises(Unkeyable) as e:
        render_chat(t, body, {})
    assert e.value.reason == "template_error"


def test_completions_prompt_embeds_are_not_keyed_as_tokens(tiny):
    key = key_for("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, "tiny", tokenizer=tiny)
    assert key.in_bytes and key.inexact == "prompt_embeds"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "status" in c["vllm"]])
def test_requests_vllm_refuses_are_counted_as_invalid(tiny, name):
    case = CASES[name]
    assert prompts_of(case["path"], case["body"], tiny)[1] == "invalid"
