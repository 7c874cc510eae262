"""Fine-tuning in the planning model: only trainable parameters cost gradients and optimizer state."""

from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.planning.cost import fixed_bytes
from hetrain.planning.memory import state_bytes
from hetrain.planning.presets import PRESETS, fine_tuned, lora_params


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
