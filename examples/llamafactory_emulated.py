"""LLaMA-Factory's own `llamafactory-cli train`, unedited, on hetrain across an emulated pair.

    python -m venv --system-site-packages /path/to/lf && /path/to/lf/bin/pip install --no-deps llamafactory
    /path/to/lf/bin/pip install "transformers>=4.55,<=4.57.6" "trl<=0.24" "peft<=0.18.1" "accelerate<=1.11" \
        "datasets<=4.0" "torchdata<=0.11" "tyro<0.9" fire omegaconf sentencepiece tiktoken einops modelscope av
    /path/to/lf/bin/python examples/llamafactory_emulated.py WORK_DIR

(LLaMA-Factory pins transformers <= 5.6, trl <= 0.24, peft <= 0.18.1 and accelerate <= 1.11, so it
runs in its own environment; `--no-deps` keeps that environment's torch the one already there,
where LLaMA-Factory's torchvision/torchaudio pins would pull another.)

Here, in WORK_DIR: a 2-layer Llama built from a config with a word-level tokenizer (nothing is
downloaded), a 64-example alpaca-style dataset, and LLaMA-Factory's own SFT recipe for them. Then
`hetrain run --emulate a100-80g,rtx3090 llamafactory-cli train sft.yaml`: hetrain's class swap
(integrations/swap.py) puts hetrain's Trainer under transformers' Seq2SeqTrainer before
LLaMA-Factory defines its CustomSeq2SeqTrainer on it (overriding compute_loss), so the run is
hetrain's loop with LLaMA-Factory's data, template, loss and callbacks, and nothing is edited.
LLaMA-Factory's collator returns a tokenizer's BatchEncoding, which hetrain's planning must call as
model(**batch) (its measurement of the model before training).
"""

import json
import os
import shutil
import subprocess
import sys

WORDS = ("the cat dog sat ran on a mat log red blue big small fast slow and or over under near far "
         "tree house bird fish sun moon star sky sea hill what is where who answer tell me").split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


def build(work: str) -> str:
    """The tiny model, its tokenizer and the data in `work`; returns the recipe's path."""
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir, data_dir = os.path.join(work, "tiny-llama"), os.path.join(work, "data")
    os.makedirs(data_dir, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    rng = random.Random(3)
    rows = [{"instruction": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))), "input": "",
             "output": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))} for _ in range(64)]
    with open(os.path.join(data_dir, "tiny.json"), "w") as f:
        json.dump(rows, f)
    with open(os.path.join(data_dir, "dataset_info.json"), "w") as f:
        json.dump({"tiny": {"file_name": "tiny.json"}}, f)
    recipe = os.path.join(work, "sft.yaml")
    with open(recipe, "w") as f:
        f.write(f"""model_name_or_path: {model_dir}
stage: sft
do_train: true
finetuning_type: full
dataset: tiny
dataset_dir: {data_dir}
template: default
cutoff_len: 64
overwrite_cache: true
preprocessing_num_workers: 1
output_dir: {os.path.join(work, "out")}
overwrite_output_dir: true
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
learning_rate: 1.0e-3
max_steps: 6
logging_steps: 1
save_strategy: "no"
report_to: none
bf16: false
""")
    return recipe


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    work = os.path.abspath(sys.argv[1])
    recipe = build(work)
    cli = shutil.which("llamafactory-cli", path=os.path.dirname(sys.executable)) or shutil.which("llamafactory-cli")
    if cli is None:
        print("llamafactory-cli is not installed in this environment (see the usage above)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "hetrain", "run", "--emulate", "a100-80g,rtx3090", cli, "train",
                            recipe], cwd=work)


if __name__ == "__main__":
    sys.exit(main())
