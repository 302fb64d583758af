"""What a continuation is made of: which requests qualify, the request sent, and the stream spliced on."""

from __future__ import annotations

import json

import orjson
from hypothesis import given, settings, strategies as st

from router.stream_failover import Splice, Transcript, continuation, transcript_for, why_not
from support import paths

FIXTURES = paths.FIXTURES / "vllm-0.32"
CHAT_SSE = (FIXTURES / "chat-stream.sse").read_bytes()
COMPLETIONS_SSE = (FIXTURES / "completions-stream.sse").read_bytes()
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def test_plain_chat_and_completions_qualify():
    assert why_not(CHAT, {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert why_not(COMPLETIONS, {"prompt": "hi", "n": 1, "response_format": {"type": "text"}}) is None
    assert why_not(COMPLETIONS, {"prompt": ["hi"]}) is None


def test_requests_whose_continuation_would_be_another_generation_do_not():
    assert why_not(COMPLETIONS, {"prompt": "x", "n": 2}) == "several_choices"
    assert why_not(COMPLETIONS, {"prompt": "x", "logprobs": 0}) == "logprobs"
    assert why_not(CHAT, {"messages": [], "logprobs": True}) == "logprobs"
    assert why_not(CHAT, {"messages": [], "response_format": {"type": "json_object"}}) == "response_format"
    assert why_not(CHAT, {"messages": [], "structured_outputs": {"json": {}}}) == "structured_outputs"
    assert why_not(COMPLETIONS, {"prompt": [1, 2, 3]}) == "prompt_not_text"
    assert why_not(COMPLETIONS, {"prompt": ["a", "b"]}) == "prompt_not_text"
    assert why_not("/v1/embeddings", {"input": "x"}) == "endpoint"


def test_the_transcript_reads_the_chat_fixture_without_its_role_chunk():
    t = transcript_for(CHAT, {"messages": [], "stream_options": {"include_usage": True}})
    assert t is not None
    t.feed(CHAT_SSE)
    assert (t.tokens, t.text, t.finished, t.usage_sent) == (4, "vedvedvedved", True, True)
    assert t.id == "chatcmpl-b0810aef97817126" and t.model == "tiny" and t.resumable()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(COMPLETIONS_SSE)), max_size=12))
def test_the_transcript_is_the_same_however_the_stream_is_cut_into_reads(cuts):
    whole = Transcript(chat=False, include_usage=False)
    whole.feed(COMPLETIONS_SSE)
    pieces = Transcript(chat=False, include_usage=False)
    bounds = [0, *sorted(cuts), len(COMPLETIONS_SSE)]
    passed = b"".join(pieces.feed(COMPLETIONS_SSE[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert (pieces.tokens, pieces.text, pieces.id, pieces.finished) == (whole.tokens, whole.text, whole.id, True)
    assert passed + pieces.flush() == COMPLETIONS_SSE  # every byte goes on, whole events at a time


def test_a_half_event_is_held_until_it_is_whole():
    t = Transcript(chat=False, include_usage=False)
    first, second = COMPLETIONS_SSE.split(b"\n\n", 1)
    assert t.feed(first[:40]) == b"" and t.feed(first[40:] + b"\n\n" + second[:10]) == first + b"\n\n"
    assert t.tokens == 1


def test_tool_calls_make_a_chat_stream_unusable():
    t = Transcript(chat=True, include_usage=False)
    t.feed(b'data: {"id":"c","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    assert not t.resumable() and t.unusable == "tool_calls"


def test_a_completion_continues_from_the_prompt_and_the_text_so_far():
    t = Transcript(chat=False, include_usage=False)
    t.parts, t.tokens = ["ved", " the"], 2
    body = orjson.dumps({"prompt": ["Once"], "max_tokens": 10, "min_tokens": 1, "echo": True, "seed": 3})
    assert json.loads(continuation(COMPLETIONS, body, t)) == {
        "prompt": "Onceved the", "max_tokens": 8, "min_tokens": 0, "echo": False, "seed": 3}


def test_a_chat_continues_as_the_final_assistant_message():
    t = Transcript(chat=True, include_usage=False)
    t.parts, t.tokens = ["Hel", "lo"], 2
    msgs = [{"role": "user", "content": "hi"}]
    sent = json.loads(continuation(CHAT, orjson.dumps({"messages": msgs, "max_completion_tokens": 5}), t))
    assert sent == {"messages": [*msgs, {"role": "assistant", "content": "Hello"}], "max_completion_tokens": 3,
                    "continue_final_message": True, "add_generation_prompt": False}
    # a client that asked to continue its own assistant message: the text is added to it
    own = [*msgs, {"role": "assistant", "content": "Say: "}]
    body = orjson.dumps({"messages": own, "continue_final_message": True, "add_generation_prompt": False})
    assert json.loads(continuation(CHAT, body, t))["messages"][-1] == {"role": "assistant", "content": "Say: Hello"}


def test_the_splice_gives_the_continuation_the_first_parts_id_and_adds_up_usage():
    first = Transcript(chat=True, include_usage=True)
    first.feed(CHAT_SSE.split(b"\n\n")[0] + b"\n\n" + CHAT_SSE.split(b"\n\n")[1] + b"\n\n")  # role + one token
    second = CHAT_SSE.replace(b"chatcmpl-b0810aef97817126", b"chatcmpl-other").replace(b"1795945979", b"1795945999")
    out = Splice(first).feed(second)
    events = [e[6:] for e in out.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-b0810aef97817126"} and {c["created"] for c in chunks} == {1795945979}
    assert not any("role" in c["choices"][0]["delta"] for c in chunks if c["choices"])
    # the continuation's 819 prompt tokens held the one token sent before it; 4 more were generated
    assert chunks[-1]["usage"]["prompt_tokens"] == 818 and chunks[-1]["usage"]["completion_tokens"] == 5
    assert first.tokens == 5 and first.text == "ved" * 5


def test_a_stream_broken_before_its_first_chunk_is_asked_again_and_keeps_the_continuations_role_chunk():
    t = Transcript(chat=True, include_usage=False)
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert continuation(CHAT, body, t) == body
    out = Splice(t).feed(CHAT_SSE)
    chunks = [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {c["id"] for c in chunks} == {"chatcmpl-b0810aef97817126"}
