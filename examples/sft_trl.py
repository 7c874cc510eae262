"""A TRL SFT script across mixed devices: the import is the one changed line.

    hetrain run --emulate a100-80g,rtx3090 examples/sft_trl.py     # no GPU: an emulated pair
    hetrain run examples/sft_trl.py                                 # one process per GPU

A tiny Llama (built from a config: nothing is downloaded) is fine-tuned on the paragraphs of
Python's own documentation, packed into sequences of 128 tokens (TRL's best-fit packing, padding
free), with a word-level tokenizer built here from the same text. The global batch is TRL's on this
many equal GPUs, per_device_train_batch_size x gradient_accumulation_steps x devices = 8 x 2 x 2 =
32 packed sequences a step; hetrain gives the A100 the larger share, runs each share in micro-batches
that fit the card, and weights each micro-batch by its tokens, so the step's gradient is stock
SFT's: the summed token losses of all 32 over their tokens.
"""

import collections
import re

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig

from hetrain.integrations.trl import SFTTrainer            # was: from trl import SFTTrainer


def paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 4]


def word_tokenizer(texts: list[str], size: int = 2000) -> PreTrainedTokenizerFast:
    """The `size` most frequent words, the rest <unk>: a vocabulary made here, not downloaded."""
    counts = collections.Counter(w for t in texts for w in t.split())
    vocab = {w: i for i, w in enumerate(["<pad>", "<bos>", "<eos>", "<unk>"] + [w for w, _ in counts.most_common(size)])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


texts = paragraphs()
tokenizer = word_tokenizer(texts)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                     max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2))
args = SFTConfig(
    output_dir="out/sft_trl",
    packing=True,
    max_length=128,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,
    max_steps=30,
    learning_rate=3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=3,
    logging_steps=10,
    save_strategy="no",
    bf16=False,         # TRL's default is bf16; hetrain={"precision": "auto"} gives each device its own
    report_to="none",
)
trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                     processing_class=tokenizer)
result = trainer.train()
if trainer.is_world_process_zero():
    plan = trainer.hetrain_plan
    shares = ", ".join(f"{d.device} {d.share} in micro-batches of {d.micro_batch}" for d in plan.devices)
    print(f"global batch {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} x "
          f"{len(plan.devices)} = {plan.global_batch} packed sequences: {shares}")
    print(f"trained {result.global_step} steps, loss {result.training_loss:.3f} (weighted by "
          f"{trainer.hetrain['loss_weighting']}, as stock SFT normalises)")
