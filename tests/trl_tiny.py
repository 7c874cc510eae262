"""A tiny Llama, an in-memory tokenizer and text data, as the TRL tests (SFT, DPO) train them: no hub.

The tokenizer is a word-level vocabulary over WORDS (the `tokenizers` library, wrapped in
PreTrainedTokenizerFast), so every text here tokenizes to one id a word, plus the special tokens.
The documents have uneven lengths, so packing puts a different number of them in each packed
sequence and every micro-batch holds a different number of counted tokens.
"""

from __future__ import annotations

import random

import torch

WORDS = ("the cat dog sat ran on a mat log red blue big small fast slow and or over under near far "
         "tree house bird fish sun moon star sky sea hill").split()
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def vocab_size() -> int:
    return len(SPECIAL) + len(WORDS)


def documents(n: int, *, seed: int = 3, shortest: int = 3, longest: int = 14) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest))) for _ in range(n)]


def text_dataset(n: int):
    """SFT's language-modeling data: {"text": ...} rows."""
    from datasets import Dataset

    return Dataset.from_dict({"text": documents(n)})


def preference_dataset(n: int):
    """DPO's data: prompt, chosen and rejected completions, of uneven lengths."""
    from datasets import Dataset

    prompts = documents(n, seed=7, longest=6)
    chosen, rejected = ([" " + d for d in documents(n, seed=s)] for s in (8, 9))   # a word boundary after the prompt
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def llama(dtype=torch.float64):
    """A 2-layer Llama (hidden 32) from its config, seeded: every process builds the same one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=vocab_size(), max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype)
