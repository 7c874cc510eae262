"""Tensor parallelism (DTensor Colwise/Rowwise plans on the demo GPT's attention and MLP) gives
the single-process forward and gradients, on gloo CPU with 2 ranks.

Reference: the same GPT, built from the same seed, run whole in each rank's process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks

pytestmark = pytest.mark.dist


def make():
    from hetrain.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 32, (6, 8), generator=g), torch.randint(0, 32, (6, 8), generator=g)


def tp_worker(rank, world):
    import hetrain
    from hetrain.errors import UsageError
    from hetrain.parallel.tensor import full_grad, tensor_parallel

    ref, x, y = make()
    ref_logits = ref(x)
    F.cross_entropy(ref_logits.flatten(0, 1), y.flatten()).backward()
    ht = hetrain.init(global_batch=6, verbose=False)
    model = tensor_parallel(make()[0])
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    refs = dict(ref.named_parameters())
    grad_error = max((full_grad(p) - refs[n].grad).abs().max().item() for n, p in model.named_parameters())
    q = model.blocks[0].attn.q.weight
    out = {"logit_error": (logits - ref_logits).abs().max().item(), "grad_error": grad_error,
           "q_local_rows": q.to_local().shape[0], "q_rows": q.shape[0],
           "fc_local_rows": model.blocks[0].mlp.fc.weight.to_local().shape[0]}
    try:   # 3 heads cannot be split as whole heads over 2 ranks
        from hetrain.demo.gpt import GPT, GPTConfig
        tensor_parallel(GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=12, n_layers=1, n_heads=3)))
        out["bad"] = "no error"
    except UsageError as e:
        out["bad"] = str(e)
    ht.close()
    return out


def test_gpt_tensor_parallel_matches_single_process():
    for r in run_ranks(tp_worker, 2):
        assert r["logit_error"] < 1e-5, r
        assert r["grad_error"] < 1e-5, r
        assert (r["q_local_rows"], r["q_rows"], r["fc_local_rows"]) == (8, 16, 32)   # half the heads each
        assert "3 attention heads cannot be split over 2 ranks" in r["bad"]
