"""Fine-tuning in the planning model: only trainable parameters cost gradients and optimizer state."""

from __future__ import annotations

import math

import pytest

from hetrain.errors import UsageError
from hetrain.hardware import catalog
from hetrain.planning.cost import estimate_profile, fixed_bytes
from hetrain.planning.memory import state_bytes
from hetrain.planning.options import fit
from hetrain.planning.planner import PlanOptions, make_plan
from hetrain.planning.presets import PRESETS, fine_tuned, lora_params
from hetrain.planning.profile import ModelSpec


def test_frozen_parameters_are_weights_only():
    s = state_bytes(1000, trainable=10, frozen_param_bytes=2, optimizer="adamw")
    assert (s.params, s.grads, s.optimizer) == (990 * 2 + 10 * 4, 10 * 4, 10 * 8)
    assert state_bytes(1000).total == state_bytes(1000, trainable=1000).total == 16000


def test_lora_sizes_of_the_presets():
    # q,k,v,o at rank 16: 32 layers · 16 · (6·4096 + 2·1024) — the 13.6M PEFT reports for Llama 3 8B
    assert lora_params("llama-8b", 16) == lora_params("mistral-7b", 16) == 13_631_488
    spec = PRESETS["llama-8b-lora"]
    assert (spec.params, spec.trainable) == (8_030_261_248, 13_631_488)
    # fewer weight gradients: T·(4N + 2N_t) instead of T·6N (attention term the same)
    assert spec.flops_per_sample < PRESETS["llama-8b"].flops_per_sample
    # bf16 base (2 B) + 16 B per adapter parameter: ~15 GiB, where full training needs ~120 GiB
    state = fixed_bytes(spec.params, trainable=spec.trainable, precision="bf16")
    assert state == 2 * (spec.params - spec.trainable) + 16 * spec.trainable
    assert fine_tuned("mistral-7b", lora_rank=8).trainable == 32 * 8 * (6 * 4096 + 2 * 1024)   # rank 8: half


def test_bad_fine_tuning_input_is_one_usage_error():
    with pytest.raises(UsageError, match="more than its"):
        fine_tuned("llama-8b", trainable=9_000_000_000)
    with pytest.raises(UsageError, match="not known") as e:
        fine_tuned("resnet50", lora_rank=16)
    assert "--trainable-params" in e.value.fix
    with pytest.raises(UsageError, match="both given"):
        fine_tuned("llama-8b", trainable=10, lora_rank=16)


def llama_params(*, vocab, d, ffn, layers, kv):
    """A Llama's parameters from its config: untied embedding and head, q/o d×d, k/v d×kv, a gated
    MLP (3·d·ffn), two RMSNorms a layer and a final one."""
    return 2 * vocab * d + layers * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d) + d


def test_a_lora_llama_is_costed_as_frozen_weights_and_fits_a_micro_batch_full_training_cannot():
    # TinyLlama-1.1B's shape; LoRA r=8 on q_proj (d→d) and v_proj (d→kv): r·(in + out) each, a layer,
    # beside the base (PEFT adds the adapters: its "all params" counts both)
    base = llama_params(vocab=32000, d=2048, ffn=5632, layers=22, kv=256)
    lora = 22 * 8 * ((2048 + 2048) + (2048 + 256))
    total = base + lora
    assert (lora, total) == (1_126_400, 1_101_174_784)     # what PEFT's print_trainable_parameters says
    act = 2**30                                             # 1 GiB of bf16 activations a sample
    model = dict(name="tinyllama", params=total, flops_per_sample=6 * total * 2048, activation_bytes_per_sample=act)
    gpu = catalog.resolve("rtx3090")
    full = estimate_profile(ModelSpec(**model), gpu, label="3090", precision="bf16")
    tuned = estimate_profile(ModelSpec(**model, trainable_params=lora), gpu, label="3090", precision="bf16")
    # bf16 base: 2 B a frozen weight; an adapter (fp32) 4 B weight + 4 B gradient + 8 B AdamW moments
    assert tuned.fixed_bytes == 2 * base + 16 * lora == 2_218_119_168
    assert full.fixed_bytes == 16 * total == 17_618_796_544
    assert full.fixed_bytes > 7.9 * tuned.fixed_bytes
    # autocast's bf16 copy of the fp32 weights: of the adapters only, when the base is frozen in bf16
    assert (tuned.activation_fixed_bytes, full.activation_fixed_bytes) == (2 * lora, 2 * total)

    o = PlanOptions(global_batch=16)
    usable = gpu.memory_bytes * (1 - o.memory_margin)
    cap_full = math.floor((usable - 16 * total - 2 * total) / act)
    cap_lora = math.floor((usable - 2 * base - 16 * lora - 2 * lora) / act)
    assert (fit(full, o).memory_cap, fit(tuned, o).memory_cap) == (cap_full, cap_lora) == (3, 19)
    p_full, p_lora = make_plan([full], o).devices[0], make_plan([tuned], o).devices[0]
    assert (p_full.micro_batch, p_full.n_micro) == (3, 6)
    assert (p_lora.micro_batch, p_lora.n_micro) == (16, 1)            # the whole batch in one micro-batch
    # that micro-batch of 16 fits LoRA and would not fit the model fully trained
    assert p_lora.predicted_memory_bytes == 2 * base + 18 * lora + 16 * act <= usable
    assert 18 * total + 16 * act > usable
