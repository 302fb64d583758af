"""Builds a tiny randomly initialised Llama for real vLLM CPU replicas, with no download.

    python loadtest/tiny_model.py OUT_DIR     (run with the vLLM environment's python)

The tokenizer is a byte-level BPE trained here on a fixed, seeded corpus over the words the
benchmark workloads use, with a BOS token added to plain prompts and a chat template, so token
counts are exact and the same on every machine. The model's weights are random: its output is
gibberish, but vLLM's scheduler, prefix cache, metrics and KV events are the real ones.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

# The corpus: the workloads' words (loadtest/workloads.py) plus digits and prompt punctuation,
# so frequent words become single tokens and everything else still encodes byte by byte.
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu group turn user system "
         "assistant the a of and to in is you that it for").split()
VOCAB_SIZE = 1024
MAX_POSITIONS = 32768  # long enough for generations that outlast a scheduler stall in the tests
# Renders what agent traffic sends (tools, tool calls and results, reasoning, documents, enable_thinking) the
# way public tool-calling templates do; plain chats render as "<s><|role|>\ncontent</s>\n...<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% if documents %}<|documents|>\n{% for d in documents %}{{ d | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}{% if m.name is defined and m.name %}:{{ m.name }}{% endif %}|>\n"
    "{% if m.tool_call_id is defined and m.tool_call_id %}[{{ m.tool_call_id }}] {% endif %}"
    "{% if m.reasoning_content is defined and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}"
    "{% if m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{% endif %}"
    "</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}{% endif %}")


def corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 24))]
        out.append(f"q{i % 97}: group {i % 31}: " + " ".join(words) + rng.choice([".", "?", "!", ","]))
    return out


def train() -> "Any":
    """The tokenizer (a ``tokenizers.Tokenizer``), trained on the fixed corpus: the same everywhere."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def write_tokenizer(out: Path) -> Path:
    """Only the tokenizer and chat template, as the model folder has them (no transformers needed): what
    a stand-in replica and the router need to key prompts by the tiny model's tokens."""
    out.mkdir(parents=True, exist_ok=True)
    train().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def build(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    import torch

    out.mkdir(parents=True, exist_ok=True)
    tok = train()
    bos = tok.token_to_id("<s>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # Older and newer transformers put the template in different files; keep it in both places
    # the router and vLLM read.
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(cfg, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=MAX_POSITIONS, bos_token_id=bos, eos_token_id=tok.token_to_id("</s>"),
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(str(out))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py OUT_DIR")
    build(Path(sys.argv[1]))
