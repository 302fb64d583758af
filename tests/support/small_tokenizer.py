"""A small word-level tokenizer with a chat template, trained on the spot."""

from __future__ import annotations

import json

# A tokenizer trained here in a moment (byte-level BPE, <s> and </s>), with a chat template: no download.
SMALL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


SMALL_WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex a jovial mob".split()


def small_tokenizer(folder, sep_takes_spaces: bool = False):
    """``folder`` holding that tokenizer (``tokenizer.json``, ``tokenizer_config.json``); with
    ``sep_takes_spaces`` its ``</s>`` takes the spaces on either side of it, as some added tokens do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", AddedToken("</s>", lstrip=sep_takes_spaces, rstrip=sep_takes_spaces, special=True)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = SMALL_WORDS
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": SMALL_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    return folder
