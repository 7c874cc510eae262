"""PEFT LoRA across mixed devices: a small Llama's q/v adapters trained on uneven shares.

    hetrain run --emulate a100-80g,rtx3090 examples/lora_llama.py     # no GPU: an emulated pair
    hetrain run examples/lora_llama.py                                 # one process per GPU

A Llama built from its config (no download) is wrapped by `peft.get_peft_model`: its base weights
are frozen (requires_grad=False) and only the rank-8 adapters on q_proj and v_proj train. Nothing
about PEFT is special to hetrain: ht.prepare measures the model as it is, so the frozen base is
costed as weights only (no gradients, no optimizer state) and DDP syncs the adapters' gradients
only. The A100 gets the larger share of each global batch; the step's gradient is still the one
big batch's. The adapters are saved at the end with PEFT's own save_pretrained.
"""

import os
import warnings

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import hetrain
from hetrain.demo.text import ByteWindows, pydoc_bytes, split
from hetrain.hardware.units import format_bytes

GLOBAL_BATCH, SEQ_LEN, STEPS = 32, 64, 30
ht = hetrain.init(global_batch=GLOBAL_BATCH, max_steps=STEPS, precision="fp32")   # fp32: the byte figures below exact

# The base model: a tiny Llama over bytes, as a pretrained one would arrive (frozen by PEFT below).
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")  # peft 0.21 asks transformers 5 by an old name
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN,
                     use_cache=False)
model = get_peft_model(LlamaForCausalLM(config),
                       LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))

trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
total = sum(p.numel() for p in model.parameters())
ht.print(f"LoRA: {trainable:,} of {total:,} parameters train ({100 * trainable / total:.1f}%): r=8 on q_proj "
         f"and v_proj of {config.num_hidden_layers} layers = {config.num_hidden_layers} x 2 x 8 x "
         f"({config.hidden_size} + {config.hidden_size})")
# AdamW as fp32 training holds it: 4 B weight + 4 B gradient + 8 B moments per trainable parameter,
# 4 B per frozen one. What fully training the same model would hold: 16 B for every parameter.
lora_state, full_state = 4 * (total - trainable) + 16 * trainable, 16 * total
ht.print(f"model state per device: {lora_state:,} B as LoRA (frozen base as weights only) against "
         f"{full_state:,} B fully trained (x{full_state / lora_state:.1f} less)")
base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

train_bytes, _ = split(pydoc_bytes())
train = ByteWindows(train_bytes, SEQ_LEN)
# Only the adapters in the optimizer: the frozen base has no gradient and gets no state.
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def logits_of(model, batch):
    return model(input_ids=batch[0]).logits


model, opt, batches = ht.prepare(model, opt, train, forward=logits_of)

first = None
for step in batches:
    for mb in step:                      # this device's share of the 32, in micro-batches
        with mb:
            x, y = mb.batch
            with ht.autocast():
                loss = F.cross_entropy(logits_of(model, mb.batch).flatten(0, 1), y.flatten())
            ht.backward(loss)            # weighted by the micro-batch's size: big-batch math
    ht.step()
    first = step.loss if first is None else first
    if step.index % 10 == 0 or step.index == STEPS - 1:
        ht.print(f"step {step.index:2d}  loss {step.loss:.4f}  (rank 0's share: {len(step.indices)} of "
                 f"{GLOBAL_BATCH} samples)")

summary = ht.summary()
for row in summary["memory"]:
    ht.print(f"{row['device']}: planned model state {row['planned_state']:,.0f} B (derived above: {lora_state:,} B); "
             f"held {row['held_state']:,.0f} B (the meter's count of the tensors held, rotary buffers included)")
untouched = all(torch.equal(p, base[n]) for n, p in model.module.named_parameters() if n in base)
ht.print(f"loss {first:.4f} -> {step.loss:.4f} in {STEPS} steps; rank 0's {len(base)} frozen base tensors "
         f"{'bit-identical to the start' if untouched else 'CHANGED'}")
if ht.is_main:
    out = "lora_llama_adapters"
    model.module.save_pretrained(out)        # PEFT's adapters only: the base is the config's
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    ht.print(f"adapters saved to ./{out}: {format_bytes(size)} ({', '.join(sorted(os.listdir(out)))})")
ht.close()
