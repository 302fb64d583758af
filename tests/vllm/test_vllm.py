"""kvroute in front of real vLLM CPU replicas (marker ``vllm``: ``./tests/run.sh -m vllm``).

Two replicas of the project's tiny Llama (``deploy/setup-vllm.sh`` builds it once and caches it),
with KV caches of different sizes so that what the router learns from ``/metrics`` is visibly
per replica. The tests in this module share the replicas; the one that kills a replica runs last.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from support.processes import Cluster
from loadtest.cluster import HTTP
from support.state import replicas_view, wait_keyed_by_tokens
from support.traffic import openai_streams_through_a_kill, run_with_bypass
from support.waiting import wait_until
from loadtest import render_corpus, vllm_cluster
from loadtest.cluster import Proc
from router.prefix import prompts_of
from router.tokenizer import LocalTokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCKS = (136, 160)  # --num-gpu-blocks-override of replica 0 and 1 (block size 128 tokens)
MAX_MODEL_LEN = 16384


@pytest.fixture(scope="module")
def home() -> Path:
    return vllm_cluster.setup()


@pytest.fixture(scope="module")
def replicas(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    log_dir = tmp_path_factory.mktemp("vllm")
    procs = vllm_cluster.start([vllm_cluster.replica(home, num_gpu_blocks=n, log_dir=log_dir, name=f"vllm-{i}",
                                                     max_model_len=MAX_MODEL_LEN,
                                                     extra=(*vllm_cluster.kv_events_args(), "--enable-prompt-tokens-details",
                                                            *vllm_cluster.RENDER_ARGS),
                                                     dev_mode=True, store_responses=True)
                                for i, n in enumerate(BLOCKS)])
    yield procs
    for p in procs:
        p.stop(timeout=15)
    for p in procs:
        assert p.popen is not None and p.popen.poll() is not None


@pytest.fixture(scope="module")
def gateway(replicas: list[Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A router with no configuration but the replicas' URLs."""
    c = Cluster(tmp_path_factory.mktemp("router"))
    rt = c.router(replicas, wait_ready=False)
    rt.wait_http("/ready", timeout=30)
    yield rt
    c.stop_all()


def client(rt: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=60)


def replica_of(rt: Proc, name: str, replicas: list[Proc]) -> Proc:
    return next(p for p in replicas if f"127.0.0.1:{p.port}" == name)


MESSAGES = [{"role": "system", "content": "alpha bravo charlie delta echo"},
            {"role": "user", "content": "foxtrot golf hotel?"}]


def test_chat_through_the_gateway_is_well_formed(gateway, replicas):
    raw = client(gateway).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=8)
    out = raw.parse()
    assert raw.headers["x-kvroute-replica"].startswith("127.0.0.1:")
    assert out.object == "chat.completion" and out.model == "tiny"
    assert out.choices[0].message.role == "assistant" and isinstance(out.choices[0].message.content, str)
    assert out.choices[0].finish_reason in ("length", "stop")
    tok = HTTP.post(replicas[0].url + "/tokenize", json={"model": "tiny", "messages": MESSAGES}, timeout=10).json()
    assert out.usage.prompt_tokens == tok["count"] > 0
    assert 0 < out.usage.completion_tokens <= 8


def test_streaming_chat_through_the_gateway_is_well_formed(gateway):
    chunks = list(client(gateway).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1


def test_completions_through_the_gateway_are_well_formed(gateway):
    out = client(gateway).completions.create(model="tiny", prompt="alpha bravo charlie", max_tokens=6)
    assert out.object == "text_completion" and isinstance(out.choices[0].text, str)
    assert out.usage.completion_tokens <= 6 and out.usage.prompt_tokens > 0
    chunks = list(client(gateway).completions.create(model="tiny", prompt="alpha bravo charlie", max_tokens=6,
                                                      stream=True))
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1


def test_router_learns_block_size_and_kv_capacity_from_metrics(gateway, replicas):
    # the router is ready once a replica's health check passed; its first scrape of each may come a moment later
    wait_until(lambda: all(replicas_view(gateway)[p.url]["num_gpu_blocks"] == n for p, n in zip(replicas, BLOCKS)),
               timeout=10, interval=0.2)
    view = replicas_view(gateway)
    for proc, blocks in zip(replicas, BLOCKS):
        assert view[proc.url]["block_size"] == 128
        assert view[proc.url]["num_gpu_blocks"] == blocks


def settled_metrics(url: str, *counters: str) -> dict[str, float]:
    """The replica's /metrics once nothing runs there and ``counters`` and its generated tokens stopped moving:
    vLLM counts a request a little after its answer ended, so an earlier test's may still be on its way."""
    keys = (*counters, "vllm:generation_tokens_total")
    seen: list[dict[str, float]] = [vllm_cluster.metrics(url)]

    def still() -> bool:
        seen.append(vllm_cluster.metrics(url))
        a, b = seen[-2:]
        return b["vllm:num_requests_running"] == 0 and all(a.get(k) == b.get(k) for k in keys)

    wait_until(still, timeout=30, interval=0.5)
    return seen[-1]


def test_client_disconnect_mid_stream_makes_vllm_abort(gateway, replicas):
    # The tiny model streams 500-1500 tokens/s, so the request asks for 10-30 s of tokens: ample time
    # for the router to see the client leave and close the upstream request, after which vLLM stops
    # generating, short of max_tokens (vLLM 0.32 does not count such aborts in request_success_total).
    # A busy CPU replica answers /metrics only after a hot stream, so the request is seen running by
    # its own stream.
    max_tokens = MAX_MODEL_LEN - 16
    finished = 'vllm:request_success_total{finished_reason="length"}'
    body = {"model": "tiny", "prompt": "alpha bravo", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    before = {p.url: settled_metrics(p.url, finished) for p in replicas}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", gateway.url + "/v1/completions", json=body) as r:
            target = replica_of(gateway, r.headers["x-kvroute-replica"], replicas)
            lines = r.iter_lines()
            events = [line for line in (next(lines) for _ in range(10)) if line.startswith("data: {")]
            assert len(events) >= 4  # vLLM is generating for this client
        # the client is gone: the stream is closed here
    start = before[target.url]
    wait_until(lambda: vllm_cluster.metrics(target.url)["vllm:num_requests_running"] == 0, timeout=60, interval=0.1)
    generated = vllm_cluster.metrics(target.url)["vllm:generation_tokens_total"]
    time.sleep(1.0)  # a request still running would add hundreds of tokens meanwhile
    after = vllm_cluster.metrics(target.url)
    assert after["vllm:generation_tokens_total"] == generated, "vLLM kept generating after the client left"
    assert after[finished] == start[finished], "the request ran to max_tokens"
    assert generated - start["vllm:generation_tokens_total"] < max_tokens, gateway.log_tail(1000)


@pytest.mark.parametrize("tokenizer", ["found by itself", "configured"])
def test_with_the_models_tokenizer_predicted_cached_tokens_match_vllms_hits(replicas, home, tmp_path, tokenizer):
    """By default the router finds the tokenizer in the folder vLLM reports as the model's root."""
    c = Cluster(tmp_path)
    extra = ["--set", f"prefix.tokenizer={vllm_cluster.model_dir(home)}"] if tokenizer == "configured" else []
    rt = c.router(replicas, *extra, wait_ready=False)
    try:
        rt.wait_http("/ready", timeout=30)
        wait_keyed_by_tokens(rt, timeout=10)
        before = {p.url: vllm_cluster.metrics(p.url)["vllm:prefix_cache_hits_total"] for p in replicas}
        # prompts of this case only, from the first token on: the replicas' caches outlive each case's router
        systems = [f"{tokenizer} case, group {g}: " + " ".join(["alpha bravo charlie delta echo foxtrot"] * 60)
                   for g in range(2)]
        predicted = 0
        with httpx.Client(timeout=60) as http:
            for i in range(12):
                body = {"model": "tiny", "max_tokens": 2, "messages": [
                    {"role": "system", "content": systems[i % 2]},
                    {"role": "user", "content": f"question {i}: golf hotel india"}]}
                r = http.post(rt.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200
                predicted += int(r.headers["x-kvroute-cached-tokens"])
        hits = sum(vllm_cluster.metrics(p.url)["vllm:prefix_cache_hits_total"] - before[p.url] for p in replicas)
        assert hits > 0, "the requests of a group should have hit vLLM's prefix cache"
        assert abs(predicted - hits) <= 0.05 * hits, (predicted, hits)
        encoding = HTTP.get(rt.url + "/admin/replicas").json()["prompt_keys"]["tiny"]["encoding"]
        assert encoding["segments"] == "on" and encoding["hits"] >= 10, encoding  # system prompts encoded once
    finally:
        c.stop_all()


def test_every_corpus_request_is_keyed_with_the_ids_vllm_renders(replicas, home):
    """The rendering corpus (tools, tool results, chat_template_kwargs, continue_final_message, documents,
    developer messages, content parts, unicode, token-id and batched completions) asked of the live replica."""
    tok = LocalTokenizer(vllm_cluster.model_dir(home))
    checked, refused, wrong = 0, 0, []
    with httpx.Client(timeout=60) as http:
        for case in render_corpus.corpus():
            want = render_corpus.ask(http, replicas[0].url, case)
            ids, inexact = prompts_of(case["path"], case["body"], tok)
            if "status" in want:
                refused += 1
                assert inexact == "invalid", case["name"]
                continue
            checked += 1
            if inexact is not None or ids is None or [list(p) for p in ids] != want["ids"]:  # long texts: arrays
                wrong.append(case["name"])
    print(f"{checked} requests keyed exactly as vLLM renders them, {refused} refused by vLLM, wrong: {wrong}")
    assert checked >= 200 and not wrong


def tool_turns(conversations: int, turns: int, tag: str) -> list[list[dict]]:
    """Each conversation's requests, turn by turn: a long tool list shared by all, then user questions, the
    assistant's tool calls and the tools' results growing the history."""
    tools = [{"type": "function", "function": {
        "name": f"lookup_{k}", "description": " ".join(["alpha bravo charlie delta echo foxtrot"] * 12),
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}} for k in range(4)]
    out = []
    for c in range(conversations):
        messages: list[dict] = [{"role": "system", "content": f"{tag} agent {c}: " + "golf hotel india " * 20}]
        bodies = []
        for t in range(turns):
            messages.append({"role": "user", "content": f"turn {t}: juliet kilo lima mike " * 8})
            bodies.append({"model": "tiny", "max_tokens": 2, "tools": tools, "messages": list(messages)})
            call = {"id": f"call_{c}_{t}", "type": "function",
                    "function": {"name": f"lookup_{t % 4}", "arguments": json.dumps({"city": f"november {t}"})}}
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "oscar papa quebec " * 10}]
        out.append(bodies)
    return out


def test_predicted_cached_tokens_match_vllms_hits_on_tool_calling_conversations(replicas, tmp_path):
    """Agent traffic (tools, tool calls, tool results) over several turns: the router's prediction of each
    request's cached tokens, summed, is within 5% of what the replicas found in their caches."""
    c = Cluster(tmp_path)
    rt = c.router(replicas, wait_ready=False)
    try:
        rt.wait_http("/ready", timeout=30)
        wait_keyed_by_tokens(rt, timeout=10)
        wait_until(lambda: all(r["index"]["mode"] == "precise" for r in replicas_view(rt).values()), 30)
        before = {p.url: vllm_cluster.metrics(p.url)["vllm:prefix_cache_hits_total"] for p in replicas}
        predicted = 0
        with httpx.Client(timeout=60) as http:
            for bodies in zip(*tool_turns(3, 5, tag=f"run {time.time_ns()}")):  # turn by turn, conversations interleaved
                for body in bodies:
                    r = http.post(rt.url + "/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    predicted += int(r.headers["x-kvroute-cached-tokens"])
                applied_quietly(rt, replicas)
        hits = sum(vllm_cluster.metrics(p.url)["vllm:prefix_cache_hits_total"] - before[p.url] for p in replicas)
        keyed = HTTP.get(rt.url + "/metrics").text
        print(f"predicted {predicted} cached tokens, vLLM hit {hits}")
        assert 'kvroute_prompt_keys_total{mode="tokens",reason=""}' in keyed and 'mode="bytes"' not in keyed
        assert hits > 0 and abs(predicted - hits) <= 0.05 * hits, (predicted, hits)
    finally:
        c.stop_all()


def test_chained_responses_reach_the_replica_that_stored_each_one(replicas, tmp_path):
    """Round robin would alternate between the replicas: every follow-up still reaches the one holding its
    previous response (any other answers 404), streamed or not, and can be retrieved there."""
    c = Cluster(tmp_path)
    rt = c.router(replicas, "--policy", "round-robin", wait_ready=False)
    try:
        rt.wait_http("/ready", timeout=30)
        oa = client(rt)
        previous = None
        for i in range(12):
            if i % 3 == 2:
                events = list(oa.responses.create(model="tiny", input=f"turn {i}: alpha bravo", max_output_tokens=3,
                                                  previous_response_id=previous, stream=True))
                assert events[-1].type == "response.completed"
                previous = events[-1].response.id
            else:
                out = oa.responses.create(model="tiny", input=f"turn {i}: alpha bravo", max_output_tokens=3,
                                          previous_response_id=previous)
                assert out.previous_response_id == previous
                previous = out.id
        assert oa.responses.retrieve(previous).id == previous
        fresh = {oa.responses.with_raw_response.create(model="tiny", input=f"new {i}", max_output_tokens=2)
                 .headers["x-kvroute-replica"] for i in range(4)}
        assert len(fresh) == 2  # new conversations still spread
    finally:
        c.stop_all()


def applied_quietly(rt: Proc, replicas: list[Proc], quiet_s: float = 0.2, timeout: float = 5.0) -> None:
    """Until the router applied no new event batch for ``quiet_s``: what a request straight to a replica
    stored has reached the index (vLLM publishes a step's events right after the step)."""
    def seqs() -> list:
        view = replicas_view(rt)
        return [[s["last_seq"] for s in view[p.url]["index"]["events"]["sources"]] for p in replicas]
    deadline = time.monotonic() + timeout
    last, since = seqs(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.02)
        now = seqs()
        if now != last:
            last, since = now, time.monotonic()


def test_precise_index_predicts_vllms_cached_tokens_exactly_while_a_client_bypasses_the_router(replicas, tmp_path):
    """No configuration: the router finds the events (/kv_event_sources) and the tokenizer (the model's root).
    30% of the requests go straight to a replica; with the events every routed prediction is exact, without
    them (the approximate index, same workload shape) it is not."""
    c = Cluster(tmp_path)
    precise = c.router(replicas, wait_ready=False)
    approximate = c.router(replicas, "--set", "kv_events.enabled=false", wait_ready=False)
    try:
        for rt in (precise, approximate):
            rt.wait_http("/ready", timeout=30)
        wait_until(lambda: all(r["index"]["mode"] == "precise" for r in replicas_view(precise).values()), 30)
        # the same requests, in the same order, bypassing the same way, from empty caches each time
        shape = {"n": 8, "turns": 5, "system_words": 240, "user_words": 80, "reply_words": 60}
        for p in replicas:
            HTTP.post(p.url + "/reset_prefix_cache", timeout=10).raise_for_status()
        exact = run_with_bypass(precise, replicas, seed=11, settle=lambda: applied_quietly(precise, replicas), **shape)
        for p in replicas:
            HTTP.post(p.url + "/reset_prefix_cache", timeout=10).raise_for_status()
        guessed = run_with_bypass(approximate, replicas, seed=11, settle=lambda: time.sleep(0.2), **shape)
        hits = (sum(a for _, a in exact), sum(a for _, a in guessed))
        wrong = [(p, a) for p, a in guessed if p != a]
        print(f"precise: {exact}\napproximate: {guessed}\ncached tokens {hits}, approximate wrong {len(wrong)}")
        assert hits[0] > 0
        assert [p for p, _ in exact] == [a for _, a in exact]
        # without the events some predictions are wrong; which run hits more on 40 requests depends on
        # placement (13,568 / 13,824 and 13,696 / 13,312 approximate / precise in two runs), not asserted
        assert wrong, (hits, guessed)
    finally:
        c.stop_all()


# per stream in the kill test: long enough that the kill lands while some are generating (with 128, a replica
# that no longer spins could send every token before the kill, and no stream was left to continue)
TOKENS = 512


def test_streams_on_a_killed_replica_complete_on_the_other_with_every_token(gateway, replicas):
    """Two replicas, 16 clients streaming through the openai client; one replica is killed. Every stream,
    started or not, completes without an error and with the requested number of tokens. The streams are long
    (512 tokens), so that some are still being generated when the replica dies; streams sent after the kill go
    to the other replica."""
    victim = replicas[0]
    results, killed = openai_streams_through_a_kill(gateway, victim, clients=16, max_tokens=TOKENS)
    victim_name = f"127.0.0.1:{victim.port}"
    failed = [(round(s - killed, 2), rep, err) for s, rep, _, _, err in results if err is not None]
    assert not failed, f"streams that failed: {failed}"
    short = [(rep, tokens) for _, rep, _, tokens, _ in results if tokens != TOKENS]
    assert not short, f"streams without {TOKENS} tokens in all: {short}"
    continued = [r for r in results if r[1] == victim_name and r[0] < killed]
    assert continued, "some streams must have been running on the killed replica"
    metrics = HTTP.get(gateway.url + "/metrics").text
    merged = sum(1 for _, _, chunks, tokens, _ in results if chunks < tokens)  # vLLM sent several tokens in a chunk
    failovers = " ".join(line for line in metrics.splitlines() if line.startswith("kvroute_stream_failovers"))
    print(f"{len(results)} streams, all with {TOKENS} tokens ({merged} with fewer content chunks than tokens), "
          f"{len(continued)} of them sent to the killed replica before it died; {failovers}")
    assert 'kvroute_stream_failovers_total{outcome="completed"}' in metrics, "no stream was continued"
    assert 'kvroute_stream_failovers_total{outcome="failed"}' not in metrics
    assert 'kvroute_stream_failovers_total{outcome="not_resumable"}' not in metrics
    after = [r for r in results if r[0] > killed + 0.5]
    assert after and all(rep != victim_name for _, rep, _, _, _ in after)
