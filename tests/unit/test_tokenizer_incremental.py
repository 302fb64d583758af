"""Incremental encoding (``router/incremental.py``): a long text that begins with text encoded before
encodes only what is new, and its ids always equal encoding it whole."""

from __future__ import annotations

import random

import pytest

from support.small_tokenizer import small_tokenizer
from loadtest import tiny_model
from router import incremental
from router.tokenizer import LocalTokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return LocalTokenizer(tiny_model.write_tokenizer(tmp_path_factory.mktemp("tiny")))


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(tiny_model.WORDS) for _ in range(n))


def whole(tok: LocalTokenizer, text: str, special: bool = True) -> list[int]:
    return tok._tok.encode(text, add_special_tokens=special).ids


def stats(tok: LocalTokenizer) -> dict:
    return tok.describe()["incremental"]


def chained(text: str) -> list[int]:
    import xxhash

    out, h, size = [], 0, incremental.BLOCK_CHARS
    for start in range(0, len(text) - size + 1, size):
        h = xxhash.xxh3_64_intdigest(text[start:start + size].encode("utf-8", "surrogatepass"), seed=h)
        out.append(h)
    return out


@pytest.mark.parametrize("alphabet", ["abc de", "abc dé 漢字 \U0001f600"])
def test_block_hashes_are_the_chain_over_every_block_whether_their_runs_were_seen_or_not(alphabet):
    rng = random.Random(len(alphabet))
    run = incremental.RUN_BLOCKS * incremental.BLOCK_CHARS
    head = "".join(rng.choice(alphabet) for _ in range(3 * run + 500))
    assert incremental.block_hashes(head) == chained(head)  # runs first seen
    for tail in ("", "x" * 5000, "y" * (run + 7)):
        assert incremental.block_hashes(head + tail) == chained(head + tail)  # runs seen before, then new text
    changed = head[:run + 10] + "Z" + head[run + 11:]  # parts inside the second run
    assert incremental.block_hashes(changed) == chained(changed)


def test_a_growing_conversation_encodes_only_each_new_turn(tok):
    history = ""
    fresh_per_turn = []
    for turn in range(20):
        history += f"<|user|>\nturn {turn}: " + words(400, seed=turn) + "</s>\n<|assistant|>\n"
        before = stats(tok)["encoded_tokens"]
        assert tok.encode(history, add_special_tokens=False) == whole(tok, history, special=False)
        fresh_per_turn.append(stats(tok)["encoded_tokens"] - before)
    total = len(whole(tok, history, special=False))
    # a turn encodes what it adds (total / 20) and at most a block and a margin again (~1,300 characters)
    assert max(fresh_per_turn[2:]) < total / 20 + 300, fresh_per_turn
    # encoding every turn whole would encode ~10 times the last one
    assert sum(fresh_per_turn) < 2 * total, fresh_per_turn


def test_words_of_several_tokens_join_where_an_earlier_text_left_off(tmp_path):
    """Where a word's tokens share its start, encoding again begins at the word's first token: every turn joins."""
    from loadtest.load import SYLLABLES
    tok = LocalTokenizer(tiny_model.write_tokenizer(tmp_path / "tiny"))
    rng = random.Random(3)
    history = ""
    for turn in range(8):
        history += "<|user|>\n" + " ".join(rng.choice(SYLLABLES) for _ in range(600)) + "</s>\n<|assistant|>\n"
        assert tok.encode(history, add_special_tokens=False) == whole(tok, history, special=False)
    assert stats(tok)["not_joined"] == 0 and stats(tok)["reused_tokens"] > 0


def test_a_new_text_that_parts_from_a_known_one_inside_a_word_equals_the_whole_encode(tok):
    base = words(2000, seed=1)
    cut = incremental.BLOCK_CHARS * 5
    while base[cut] == " ":
        cut += 1  # the known text ends inside a word
    known = base[:cut] + "alphabravo" + words(50, seed=2)
    tok.encode(known, add_special_tokens=True)
    for tail in ("", "x", "charlie delta", "🙂 ünï", " " * 40, "\n\n"):
        text = base[:cut] + tail + words(30, seed=3)
        assert tok.encode(text, add_special_tokens=True) == whole(tok, text)


def test_a_first_seen_text_longer_than_a_window_is_encoded_in_windows_alike(tok):
    text = words(incremental.WINDOW_CHARS // 2, seed=4)  # ~3 windows
    assert len(text) > 2 * incremental.WINDOW_CHARS
    assert tok.encode(text, add_special_tokens=True) == whole(tok, text)


@pytest.mark.parametrize("odd", ["🙂👍🏽" * 300, "日本語" * 700, " " * 3000, "a" * 5000, "</s>" * 600, "\r\n\t" * 900])
def test_odd_runs_across_blocks_and_windows_equal_the_whole_encode(tok, odd):
    text = words(300, seed=5) + odd + words(300, seed=6)
    assert tok.encode(text, add_special_tokens=True) == whole(tok, text)
    again = text + words(100, seed=7)
    assert tok.encode(again, add_special_tokens=True) == whole(tok, again)


def test_a_tokenizer_whose_added_token_takes_the_spaces_beside_it_still_gets_its_own_ids(tmp_path):
    tok = LocalTokenizer(small_tokenizer(tmp_path, sep_takes_spaces=True))
    rng = random.Random(8)
    base = " </s> ".join(" ".join(rng.choice(("the", "quick", "fox", "lazy", "dog")) for _ in range(30))
                         for _ in range(60))
    for n in range(5):
        text = base + " </s> " * n + "quick brown fox" * n
        assert tok.encode(text, add_special_tokens=True) == whole(tok, text)


def test_kept_ids_stay_within_their_bound(tok, monkeypatch):
    monkeypatch.setattr(incremental, "CACHE_TOKENS", 5000)
    for seed in range(10, 20):
        tok.encode(words(3000, seed=seed), add_special_tokens=True)
    assert stats(tok)["kept_tokens"] <= 5000


def test_the_first_checks_against_a_whole_encode_stop_once_they_covered_160000_characters(tok):
    check = incremental.WholeCheck(tok._tok, "tiny", "testing")
    texts = [words(12_000, seed) for seed in range(5)]  # ~70,000 characters each
    for text in texts:
        check(text, False, whole(tok, text, False))
    assert check.encodes == 5 and check.checked == 3  # 0, 70k, 140k characters checked before each of the three


def test_short_texts_are_checked_for_their_first_32_encodes(tok):
    check = incremental.WholeCheck(tok._tok, "tiny", "testing")
    for seed in range(40):
        text = words(50, seed)
        check(text, False, whole(tok, text, False))
    assert check.checked == 32


def test_after_the_first_checks_texts_encoded_whole_are_checked_one_in_256(tok):
    check = incremental.WholeCheck(tok._tok, "tiny", "testing")
    text = words(50, 1)
    ids = whole(tok, text, False)
    for _ in range(32 + 512):
        check(text, False, ids)
    assert check.checked == 32 + 2


def test_a_text_mostly_reused_is_checked_as_many_times_less_often_as_it_encoded_less_of_itself(tok):
    check = incremental.WholeCheck(tok._tok, "tiny", "testing")
    text = words(50, 2)
    text = text[:len(text) - len(text) % 4]
    ids = whole(tok, text, False)
    for _ in range(32):
        check(text, False, ids)
    for _ in range(4 * 256 - 1):  # each encode computed a quarter of its text: one check per 1,024
        check(text, False, ids, encoded=len(text) // 4)
    assert check.checked == 32
    check(text, False, ids, encoded=len(text) // 4)
    assert check.checked == 33


def settled(tmp_path, head: str) -> LocalTokenizer:
    """A tokenizer past its first checks against whole encodes, that has seen ``head``."""
    fresh = LocalTokenizer(tiny_model.write_tokenizer(tmp_path / "tiny"))
    for seed in range(3):  # ~210,000 characters checked: the first checks are over
        fresh.encode(head + words(50, seed=100 + seed), add_special_tokens=True)
    return fresh


def test_with_a_budget_a_long_text_mostly_seen_before_is_encoded_in_place(tmp_path):
    head = words(12_000, seed=9)
    fresh = settled(tmp_path, head)
    text = head + words(300, seed=10)
    assert fresh.ids(text, add_special_tokens=True, budget=8192).tolist() == whole(fresh, text)


def test_with_a_budget_a_first_seen_long_text_is_left_to_the_caller(tmp_path):
    fresh = settled(tmp_path, words(12_000, seed=9))
    with pytest.raises(incremental.OverBudget):
        fresh.ids(words(3_000, seed=11), add_special_tokens=True, budget=8192)


def test_with_a_budget_an_encode_due_a_whole_text_check_is_left_to_the_caller(tmp_path):
    head = words(12_000, seed=9)
    fresh = LocalTokenizer(tiny_model.write_tokenizer(tmp_path / "tiny"))
    fresh.encode(head, add_special_tokens=True)  # one of the first checks: more are due
    with pytest.raises(incremental.OverBudget):
        fresh.ids(head + words(30, seed=12), add_special_tokens=True, budget=8192)


def test_a_check_due_where_it_may_not_run_is_made_by_the_next_encode_that_may(tok):
    check = incremental.WholeCheck(tok._tok, "tiny", "testing")
    text = words(50, 13)
    ids = whole(tok, text, False)
    assert check.due(len(text), len(text))
    check(text, False, ids, may_check=False)
    assert check.checked == 0 and check.due(len(text), len(text))
    check(text, False, ids)
    assert check.checked == 1


def test_with_a_budget_a_batch_of_prompts_is_left_to_the_caller_where_they_are_long_together(tok):
    from router.prefix import key_for
    batch = [words(400, seed) for seed in range(20, 26)]  # each under the budget, all together over it
    assert all(len(p) < 8192 for p in batch) and sum(map(len, batch)) > 8192
    with pytest.raises(incremental.OverBudget):
        key_for("/v1/completions", {"prompt": batch}, "m", tokenizer=tok, budget=8192)
    assert key_for("/v1/completions", {"prompt": batch[:2]}, "m", tokenizer=tok, budget=8192) is not None


def test_a_chat_left_to_the_caller_is_rendered_once_and_its_rest_gives_the_ids_of_a_whole_encode(tmp_path,
                                                                                                monkeypatch):
    from router.chat_template import ChatTemplate
    from router.prefix import key_for
    fresh = settled(tmp_path, words(12_000, seed=9))
    body = {"messages": [{"role": "system", "content": words(2_000, seed=30)},
                         {"role": "user", "content": words(1_000, seed=31)}]}
    renders = []
    render = ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, **kw: renders.append(1) or render(self, **kw))
    with pytest.raises(incremental.OverBudget) as raised:
        key_for("/v1/chat/completions", body, "m", tokenizer=fresh, budget=8192)
    assert raised.value.rest is not None
    key = raised.value.rest()
    assert len(renders) == 1
    assert [list(p) for p in key.prompts] == [whole(fresh, fresh.render(body), special=False)]
    assert key.seed == key_for("/v1/chat/completions", body, "m", tokenizer=fresh).seed
