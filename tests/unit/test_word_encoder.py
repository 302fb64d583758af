"""Encoding word by word (``router/word_encoder.py``): where it answers, its ids are the tokenizer library's,
for GPT-2's word rule and for a Llama 3 style split; where it might not be, it does not answer."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest import tiny_model
from router import word_encoder
from router.tokenizer import LocalTokenizer
from router.word_encoder import NotEligible, WordEncoder, translate

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")

# what trips word rules: cases, contractions, digits of other scripts, marks, odd spaces, added tokens
EDGES = [
    "Hello  world\n\n  x", "It's I'M we'LL they'Ve", "naïve café 日本語 ½ ² Ⅻ ٣ e\u0301", "\x1c\x1d \u00a0\u3000 x",
    "tab\t\tend   ", "12345678 1,000.5 ٣٤٥ ๑๒", "<s>hi</s> <s>", "   leading", "trailing   ", "\r\n\r\n", "a" * 300,
    "ſ's 'S", "x_y__z", "€100 — “quoted” ‘single’", "Ǆ ǅ ǆ", "한국어 텍스트", "Ελληνικά κείμενο", "", " ", "\n",
]
ALPHABET = "ab Z9_'sSltvmdr\n\r\t.,!?-«»½²Ⅻ٣é\u0301\u00a0\u3000\x1c日本語한ſǅ<>/" + "\u2028\u0085"


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory):
    return LocalTokenizer(tiny_model.write_tokenizer(tmp_path_factory.mktemp("tiny")))._tok


def split_style(split: str):
    """A small byte-level BPE tokenizer that cuts words by ``split`` (as Llama 3's and Qwen 2's do)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|begin_of_text|>", "<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(EDGES * 20 + [" ".join(tiny_model.WORDS)] * 50, trainer)
    return tok


@pytest.fixture(scope="module")
def llama3_style():
    return split_style(LLAMA3_SPLIT)


@pytest.fixture(scope="module")
def qwen2_style():
    return split_style(word_encoder.QWEN2_PATTERN)


def library(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("style", ["gpt2_style", "llama3_style", "qwen2_style"])
def test_edge_cases_encode_as_the_library_does(style, request):
    tok = request.getfixturevalue(style)
    enc = WordEncoder.of(tok, style)
    assert enc is not None
    for text in EDGES:
        got = enc.encode(text)
        assert got is not None, text
        assert got[0] == library(tok, text), text


@pytest.mark.parametrize("style", ["gpt2_style", "llama3_style", "qwen2_style"])
def test_any_text_of_the_basic_plane_encodes_as_the_library_does(style, request):
    tok = request.getfixturevalue(style)
    enc = WordEncoder.of(tok, style)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.text(alphabet=ALPHABET, max_size=80) | st.text(max_size=40))
    def prop(text):
        got = enc.encode(text)
        if got is None:  # left to the library: only for what this module may not know
            assert any(ord(c) > 0xFFFF or 0xD800 <= ord(c) <= 0xDFFF or word_encoder.unicodedata.category(c) == "Cn"
                       for c in text)
            return
        assert got[0] == library(tok, text)
        assert len(got[1]) == len(got[0]) and got[1] == sorted(got[1])

    prop()


ASCII_EDGES = "aZ9 '\t\n\x0b\x0c\r.!\x1c\x00\x7fsStTrReEvVmMlLdD0123"


@pytest.mark.parametrize("style", ["gpt2_style", "llama3_style", "qwen2_style"])
def test_ascii_text_is_cut_in_c_into_the_words_re_cuts_it_into(style, request):
    """The C cut of ASCII text (router/_wordscan.c) against Python's re with the same expression: the same ids,
    each placed where the same word begins."""
    tok = request.getfixturevalue(style)
    native = WordEncoder.of(tok, style)
    assert native is not None and native.describe()["ascii_cut_in_c"]
    spec = word_encoder.json.loads(tok.to_str())
    by_re = WordEncoder(tok, word_encoder.word_pattern(spec), {}, native=False)

    @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.text(alphabet=ASCII_EDGES, max_size=60), st.integers(0, 10_000))
    def prop(text, at):
        assert native.encode(text, at) == by_re.encode(text, at)

    prop()


def test_each_token_is_placed_where_its_word_begins(gpt2_style):
    enc = WordEncoder.of(gpt2_style, "tiny")
    text = "alpha  zzqx<s>bravo"
    ids, starts = enc.encode(text)
    words = ["alpha", " ", " zzqx", "<s>", "bravo"]
    at = [text.index(w, sum(map(len, words[:i]))) for i, w in enumerate(words)]
    assert set(starts) == set(at)
    assert starts[ids.index(gpt2_style.token_to_id("<s>"))] == text.index("<s>")


def word_starts(tok, text: str) -> list[int]:
    """Where each token's word begins, from the library's own word cut and token offsets."""
    words = [span[0] for _, span in tok.pre_tokenizer.pre_tokenize_str(text)]
    return [max(w for w in words if w <= start) for start, _ in tok.encode(text, add_special_tokens=False).offsets]


@pytest.mark.parametrize("text", [
    " ".join(tiny_model.WORDS),  # a token per word
    " ".join(tiny_model.WORDS) + " qzxj " + " ".join(tiny_model.WORDS) + " vkwq",  # a few words of several tokens
    " ".join(["qzxj vk"] * 40),  # mostly words of several tokens
])
def test_each_token_is_placed_where_the_library_cuts_its_word(gpt2_style, text):
    enc = WordEncoder.of(gpt2_style, "tiny")
    ids, starts = enc.encode(text, at=100)
    assert ids == library(gpt2_style, text)
    assert starts == [s + 100 for s in word_starts(gpt2_style, text)]


def test_text_past_the_basic_plane_is_left_to_the_library(gpt2_style):
    enc = WordEncoder.of(gpt2_style, "tiny")
    assert enc.encode("emoji 😀 here") is None
    assert enc.encode("a lone \ud800 surrogate") is None


def test_a_tokenizer_that_cuts_words_otherwise_is_not_encoded_this_way(caplog):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with caplog.at_level(logging.INFO, logger="kvroute.tokenizer"):
        assert WordEncoder.of(tok, "wordlevel") is None
    assert "its model is WordLevel, not BPE" in caplog.text
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert WordEncoder.of(bpe, "normalized") is None


def test_an_added_token_that_takes_the_spaces_beside_it_is_not_encoded_this_way(tmp_path):
    from support.small_tokenizer import small_tokenizer
    tok = LocalTokenizer(small_tokenizer(tmp_path / "t", sep_takes_spaces=True))._tok
    assert WordEncoder.of(tok, "lstrip") is None


@pytest.mark.parametrize("construct", [r"\d+", r"\w+", r"\p{Lu}+", r"[[a-z]]", r"\bx"])
def test_an_expression_with_a_construct_of_another_meaning_is_refused(construct):
    with pytest.raises(NotEligible):
        translate(construct)


def test_the_word_table_is_bounded(gpt2_style, monkeypatch):
    monkeypatch.setattr(word_encoder, "MAX_WORDS", 50)
    enc = WordEncoder.of(gpt2_style, "tiny")
    text = " ".join(f"w{i}x" for i in range(500))
    assert enc.encode(text)[0] == library(gpt2_style, text)
    assert enc.describe()["kept_words"] <= 50


def test_a_long_word_is_encoded_but_not_kept(gpt2_style):
    enc = WordEncoder.of(gpt2_style, "tiny")
    word = "q" * (word_encoder.MAX_WORD_CHARS + 1)
    assert enc.encode(word)[0] == library(gpt2_style, word)
    assert enc.describe()["kept_words"] == 0


def test_a_word_of_many_tokens_is_encoded_but_not_kept(gpt2_style):
    enc = WordEncoder.of(gpt2_style, "tiny")
    word = "qzxjqvkwqzxj"  # letters the tiny vocabulary does not join: a token each
    assert len(library(gpt2_style, word)) > word_encoder.MAX_WORD_TOKENS
    assert enc.encode(word)[0] == library(gpt2_style, word)
    assert enc.describe()["kept_words"] == 0


def test_the_router_tokenizer_encodes_word_by_word_and_checks_it(tmp_path):
    tok = LocalTokenizer(tiny_model.write_tokenizer(tmp_path / "tiny"))
    text = " ".join(tiny_model.WORDS) * 3
    assert tok.encode(text) == tok._tok.encode(text).ids
    words = tok.describe()["words"]
    assert words["state"] == "on" and words["encodes"] == 1 and words["checked_against_whole"] == 1
