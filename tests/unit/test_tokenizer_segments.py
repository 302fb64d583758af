"""Encoding long prompts piece by piece between a tokenizer's added tokens, with the pieces kept."""

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.small_tokenizer import SMALL_WORDS as WORDS
from support.small_tokenizer import small_tokenizer
from router import tokenizer as tokenizer_module
from router.tokenizer import LocalTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_tokenizer(tmp_path_factory.mktemp("tiny-model"))


def _whole(folder, text: str, special: bool) -> list[int]:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=special).ids


def _words(n: int, offset: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + offset) % len(WORDS)] for i in range(n))


# message text, often long enough to be kept as a piece, sometimes holding an added token itself
content = st.lists(st.sampled_from([*"ab xyz\n\t.,é中😀", " ", "  ", "\n\n", "<s>", "</s>", " </s> ", *WORDS]),
                   max_size=60).map(lambda parts: "".join(parts) * 6)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(system=content, turns=st.lists(content, min_size=1, max_size=4), special=st.booleans())
def test_a_prompt_encoded_by_pieces_has_the_ids_of_the_whole_prompt(model_dir, system, turns, special):
    tok = LocalTokenizer(model_dir)
    messages = [{"role": "system", "content": system}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    text = tok.render_chat(messages)
    for _ in range(2):  # kept pieces the second time
        assert tok.encode(text, add_special_tokens=special) == _whole(model_dir, text, special)
    assert tok.describe()["segments"] == "on"


def test_a_system_prompt_shared_by_requests_is_encoded_once(model_dir):
    tok = LocalTokenizer(model_dir)
    system = _words(600)
    for i in range(10):
        tok.encode(tok.render_chat([{"role": "system", "content": system},
                                    {"role": "user", "content": _words(5, offset=i)}]), add_special_tokens=False)
    seen = tok.describe()
    assert seen["misses"] == 1 and seen["hits"] == 9, seen


def test_the_kept_pieces_stay_within_their_token_bound(model_dir, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_CACHE_TOKENS", 2000)
    tok = LocalTokenizer(model_dir)
    for i in range(40):
        tok.encode(tok.render_chat([{"role": "system", "content": _words(300, offset=i)}]), add_special_tokens=False)
    seen = tok.describe()
    assert 0 < seen["cached_tokens"] <= 2000 and seen["cached_pieces"] < 40, seen


def test_a_tokenizer_whose_added_token_takes_the_spaces_beside_it_is_encoded_whole(tmp_path, caplog):
    folder = small_tokenizer(tmp_path / "tok", sep_takes_spaces=True)
    tok = LocalTokenizer(folder)
    text = _words(100) + "   </s>   " + _words(100, offset=3)
    with caplog.at_level(logging.WARNING, logger="kvroute.tokenizer"):
        assert tok.encode(text) == _whole(folder, text, True)
    assert tok.describe()["segments"].startswith("off")
    assert "encoded whole from now on" in caplog.text
    assert tok.encode(text) == _whole(folder, text, True)


def test_without_reuse_every_text_is_encoded_whole(model_dir):
    tok = LocalTokenizer(model_dir, reuse=False)
    text = tok.render_chat([{"role": "system", "content": _words(600)}])
    assert tok.encode(text, add_special_tokens=False) == _whole(model_dir, text, False)
    assert tok.describe() == {"segments": "off", "incremental": "off", "words": "off"}
