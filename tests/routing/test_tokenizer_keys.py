"""Tokenizer mode: prompt keys from real token blocks of a local tokenizer and chat template."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.cluster import HTTP
from support.small_tokenizer import SMALL_TEMPLATE, SMALL_WORDS, small_tokenizer
from support.state import prompt_keys, wait_keyed_by_tokens
from router.prefix import key_for
from router.tokenizer import LocalTokenizer

TEMPLATE, WORDS = SMALL_TEMPLATE, SMALL_WORDS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_tokenizer(tmp_path_factory.mktemp("tiny-model"))


def test_completion_prompts_are_keyed_by_tokens_with_bos(model_dir):
    tok = LocalTokenizer(model_dir)
    key = key_for("/v1/completions", {"prompt": "the quick brown fox"}, "m", tokenizer=tok)
    ids = key.prompts[0]
    assert isinstance(ids, list) and ids[0] == tok.encode("<s>", add_special_tokens=False)[0]
    assert key.prompt_tokens() == [len(tok.encode("the quick brown fox"))]


def test_chat_is_rendered_with_the_template_and_encoded_once(model_dir):
    tok = LocalTokenizer(model_dir)
    messages = [{"role": "user", "content": "the lazy dog"}]
    key = key_for("/v1/chat/completions", {"messages": messages}, "m", tokenizer=tok)
    rendered = "<s><|user|>\nthe lazy dog</s>\n<|assistant|>\n"
    assert tok.render_chat(messages) == rendered
    assert key.prompts[0] == tok.encode(rendered, add_special_tokens=False)


def test_a_folder_or_its_tokenizer_json_load_alike(model_dir):
    a, b = LocalTokenizer(model_dir), LocalTokenizer(model_dir / "tokenizer.json")
    assert a.encode("seven wizards") == b.encode("seven wizards")
    assert a.has_chat_template and b.has_chat_template  # tokenizer_config.json sits beside tokenizer.json


def test_missing_tokenizer_stops_start_up_naming_the_field(tmp_path):
    p = subprocess.run([sys.executable, "-m", "router", "serve", "--replica", "http://127.0.0.1:1", "--set",
                        f"prefix.tokenizer={tmp_path}/nothing"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "prefix.tokenizer" in p.stderr


sentences = st.lists(st.sampled_from(WORDS), min_size=1, max_size=60).map(" ".join)


@settings(max_examples=30, deadline=None)
@given(system=sentences, exchanges=st.lists(st.tuples(sentences, sentences), min_size=2, max_size=4))
def test_chat_turn_n_plus_1_extends_turn_n_but_for_the_last_block(model_dir, system, exchanges):
    """Turn n ends with a user message and the generation prompt; turn n+1 adds the assistant's reply after
    that prompt and a new user message. Only the block holding the end of turn n may differ (a BPE merge
    across that boundary)."""
    tok = LocalTokenizer(model_dir)
    turns, conversation = [], [{"role": "system", "content": system}]
    for question, answer in exchanges:
        conversation.append({"role": "user", "content": question})
        turns.append(list(conversation))
        conversation.append({"role": "assistant", "content": answer})
    for before, after in zip(turns, turns[1:]):
        shorter = key_for("/v1/chat/completions", {"messages": before}, "m", tokenizer=tok).chains(4)[0]
        longer = key_for("/v1/chat/completions", {"messages": after}, "m", tokenizer=tok).chains(4)[0]
        assert len(shorter) >= 1 and longer[:len(shorter) - 1] == shorter[:-1]


CODE = """
import json, sys
from router.prefix import key_for
from router.tokenizer import LocalTokenizer
folder, cases = json.loads(sys.stdin.read())
tok = LocalTokenizer(folder)
print(json.dumps([key_for(p, b, "m", tokenizer=tok).chains(4) for p, b in cases]))
"""


@settings(max_examples=5, deadline=None)
@given(prompt=sentences, user=sentences)
def test_tokenizer_mode_keys_are_the_same_in_every_process(model_dir, prompt, user):
    tok = LocalTokenizer(model_dir)
    cases = [("/v1/completions", {"prompt": prompt}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": user}]})]
    here = [key_for(p, b, "m", tokenizer=tok).chains(4) for p, b in cases]
    out = subprocess.run([sys.executable, "-c", CODE], input=json.dumps([str(model_dir), cases]),
                         capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "random", "PATH": ""})
    assert json.loads(out.stdout) == here


def test_router_with_a_tokenizer_predicts_cached_tokens_in_whole_blocks(cluster, model_dir):
    from support.state import replicas_view
    from support.waiting import wait_until
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "1", "--block-size", "16")
    rt = cluster.router([], config={"replicas": [{"name": "a", "url": sim.url}],
                                    "prefix": {"tokenizer": str(model_dir)}})
    wait_until(lambda: replicas_view(rt)[sim.url]["block_size"] == 16, timeout=5)
    system = " ".join(WORDS * 30)
    tok = LocalTokenizer(model_dir)
    cached = []
    for q in ("the fox", "the dog"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        r = HTTP.post(rt.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1})
        assert r.status_code == 200
        cached.append(int(r.headers["x-kvroute-cached-tokens"]))
    shared = len(tok.encode(tok.render_chat([{"role": "system", "content": system}]), add_special_tokens=False))
    assert cached[0] == 0
    assert cached[1] % 16 == 0 and shared - 32 <= cached[1] <= shared + 16


# -- prefix.tokenizer: auto (the default) ------------------------------------------------------


def test_a_models_root_folder_on_this_host_has_its_tokenizer(model_dir):
    from router.tokenizer import find_local
    folder, where = find_local(str(model_dir), "tiny")
    assert folder == model_dir and "folder" in where


def test_a_hub_name_is_looked_up_in_the_local_hugging_face_cache(model_dir, tmp_path, monkeypatch):
    import shutil

    from router.tokenizer import find_local
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-chat"
    for rev in ("old", "pinned"):
        (repo / "snapshots" / rev).mkdir(parents=True)
        shutil.copy(model_dir / "tokenizer.json", repo / "snapshots" / rev / "tokenizer.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("pinned")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert find_local("acme/tiny-chat", "served")[0] == repo / "snapshots" / "pinned"
    assert find_local("/models/elsewhere", "acme/tiny-chat")[0] == repo / "snapshots" / "pinned"  # the served name
    assert find_local("/models/elsewhere", "tiny") is None


def test_with_no_configuration_the_router_keys_by_the_tokenizer_the_replica_names(cluster, model_dir):
    from support.waiting import wait_until
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "1", "--root", str(model_dir))
    rt = cluster.router([sim])
    wait_keyed_by_tokens(rt, timeout=5)
    assert str(model_dir) in prompt_keys(rt)["tiny"]["tokenizer"]
    wait_until(lambda: "its tokenizer from the model's folder" in rt.log_tail(20000), timeout=5)


def test_in_byte_mode_bytes_per_token_is_learned_from_the_replicas_answers(cluster):
    from support.waiting import wait_until
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "1", "--bytes-per-token", "6")  # its root is not on this host
    rt = cluster.router([sim])
    wait_until(lambda: "set prefix.tokenizers.tiny to the model's folder" in rt.log_tail(20000).lower(), timeout=5)
    for i in range(24):
        r = HTTP.post(rt.url + "/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": " ".join(WORDS[: 5 + i % 11]) * (3 + i), "max_tokens": 1})
        assert r.status_code == 200
    keys = HTTP.get(rt.url + "/admin/replicas", timeout=2).json()["prompt_keys"]["tiny"]
    assert keys["mode"] == "bytes" and 5.7 <= keys["bytes_per_token"] <= 6.3, keys


def test_a_lora_adapter_is_keyed_with_its_base_models_tokenizer_without_a_search_of_its_own(cluster, model_dir):
    from support.state import set_faults
    from support.waiting import wait_until
    sim = cluster.sim("--ttft-ms", "1", "--itl-ms", "1", "--root", str(model_dir))
    set_faults(sim, extra_models=2, models_tag="sql")  # two adapters of "tiny", their roots not on this host
    rt = cluster.router([sim])
    wait_keyed_by_tokens(rt, timeout=5)
    wait_until(lambda: "adapter-sql-1" in prompt_keys(rt), timeout=5)
    adapter = prompt_keys(rt)["adapter-sql-1"]
    assert adapter["mode"] == "tokens" and adapter["keyed_as"] == "tiny", adapter
    r = HTTP.post(rt.url + "/v1/completions", timeout=10, json={
        "model": "adapter-sql-1", "prompt": " ".join(WORDS[:40]), "max_tokens": 1})
    assert r.status_code == 200 and "no tokenizer on this host" not in rt.log_tail(20000)
    keyed = HTTP.get(rt.url + "/metrics", timeout=2).text
    assert 'kvroute_prompt_keys_total{mode="tokens",reason=""} 1.0' in keyed
