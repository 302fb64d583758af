"""Prompt keys: properties that must hold for any prompt."""

import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix import chain_bytes, chain_tokens, chat_bytes, key_for, root_seed

B = 16  # bytes per block in these tests
SEED = root_seed("m")

blobs = st.binary(min_size=0, max_size=400)


@given(prefix=blobs, a=blobs, b=blobs)
def test_equal_prefixes_give_equal_chains(prefix, a, b):
    full = len(prefix) // B
    assert chain_bytes(prefix + a, B, SEED)[:full] == chain_bytes(prefix + b, B, SEED)[:full]


@given(data=st.binary(min_size=B, max_size=400), k=st.integers(min_value=0), flip=st.integers(1, 255))
def test_changing_block_k_changes_only_hashes_from_k_on(data, k, flip):
    blocks = len(data) // B
    k = k % blocks
    changed = bytearray(data)
    changed[k * B] ^= flip
    before, after = chain_bytes(data, B, SEED), chain_bytes(bytes(changed), B, SEED)
    assert before[:k] == after[:k]
    assert all(x != y for x, y in zip(before[k:], after[k:]))


messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": st.one_of(st.text(max_size=120), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=60)}), max_size=3)),
}), min_size=1, max_size=6)


@given(conversation=messages)
def test_chat_turn_n_plus_1_extends_turn_n(conversation):
    for n in range(1, len(conversation)):
        shorter = chain_bytes(chat_bytes(conversation[:n]), B, SEED)
        longer = chain_bytes(chat_bytes(conversation[:n + 1]), B, SEED)
        assert longer[:len(shorter)] == shorter


@given(conversation=messages)
def test_role_is_part_of_the_key(conversation):
    swapped = [{**m, "role": "user" if m["role"] != "user" else "assistant"} for m in conversation]
    assert chat_bytes(conversation) != chat_bytes(swapped)


@given(ids=st.lists(st.integers(0, 2**31), max_size=200), extra=st.lists(st.integers(0, 2**31), max_size=50))
def test_token_chains_share_full_blocks_of_a_common_prefix(ids, extra):
    full = len(ids) // 8
    assert chain_tokens(ids + extra, 8, SEED)[:full] == chain_tokens(ids, 8, SEED)[:full]


def test_model_lora_and_salt_separate_equal_prompts():
    body = {"prompt": "x" * 1000}
    chains = {key_for("/v1/completions", {**body, **extra}, model).chains(16)[0][0]
              for model, extra in [("m", {}), ("n", {}), ("m", {"cache_salt": "s"}), ("m", {"lora_name": "l"})]}
    assert len(chains) == 4


def test_a_list_of_prompts_gives_one_chain_per_prompt():
    key = key_for("/v1/completions", {"prompt": ["a" * 200, "b" * 200]}, "m")
    assert len(key.chains(16)) == 2 and key.prompt_tokens() == [50, 50]
    ids = key_for("/v1/completions", {"prompt": list(range(64))}, "m")
    assert ids.prompt_tokens() == [64] and len(ids.chains(16)[0]) == 4


CODE = """
import json, sys
from router.prefix import key_for
print(json.dumps([key_for(p, b, "m").chains(16) for p, b in json.loads(sys.stdin.read())]))
"""


@settings(max_examples=5, deadline=None)
@given(prompt=st.text(min_size=100, max_size=600), conversation=messages)
def test_keys_are_the_same_in_every_process(prompt, conversation):
    cases = [("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": conversation})]
    here = [key_for(p, b, "m").chains(16) for p, b in cases]
    out = subprocess.run([sys.executable, "-c", CODE], input=json.dumps(cases), capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "random", "PATH": ""}, cwd=sys.path[0] or ".")
    assert json.loads(out.stdout) == here


def _block_by_block(data: bytes, block: int, seed: int) -> list[int]:
    import xxhash
    out, h = [], seed
    for start in range(0, len(data) - block + 1, block):
        h = xxhash.xxh3_64_intdigest(data[start:start + block], seed=h)
        out.append(h)
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=9000), block=st.sampled_from([1, 7, 16, 64, 512]), cut=st.integers(0, 9000))
def test_long_prompts_hashed_run_by_run_equal_block_by_block(data, block, cut):
    """Runs of blocks named before give their hashes at once: the same hashes, first time or again, whole or cut."""
    for _ in range(2):
        assert chain_bytes(data, block, SEED, remember=True) == _block_by_block(data, block, SEED)
    assert chain_bytes(data[:cut], block, SEED, remember=True) == _block_by_block(data[:cut], block, SEED)
    assert chain_bytes(data, block, SEED + 1, remember=True) == _block_by_block(data, block, SEED + 1)


def test_the_runs_kept_are_bounded(monkeypatch):
    import os
    from router import prefix
    monkeypatch.setattr(prefix._runs, "kept", 10)
    for _ in range(30):
        chain_bytes(os.urandom(8192), 16, SEED, remember=True)
    assert len(prefix._runs) <= 10


def test_chains_not_to_be_remembered_keep_nothing():
    import os
    from router import prefix
    prefix._runs.clear()
    chain_bytes(os.urandom(8192), 16, SEED)
    assert not prefix._runs


@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=2000))
def test_token_ids_in_an_array_chain_as_in_a_list(ids):
    from array import array
    assert chain_tokens(array("I", ids), 16, SEED) == chain_tokens(ids, 16, SEED)
