"""Tensor parallelism of Hugging Face GPT-2 and Llama (built from configs), evenly (DTensor, from
the plan the model declares; GPT-2's Conv1Ds and fused c_attn made Linears) and in proportion to
speed (whole key/value groups and MLP columns per rank, hand-written shards), on gloo with 2 ranks.

Reference: the untouched transformers model, built from the same seed, run whole in each rank's
process in float64: the logits and every gradient of one step (each rank's shard against the
same rows or columns of the reference's, GPT-2's Conv1D weights read transposed), and every
parameter after 3 AdamW steps through hetrain's loop (parallel='tp') on the sampler's batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from hetrain import Checkpoints, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

VOCAB, SEQ, N, BATCH, STEPS = 64, 8, 16, 8, 3
SPEEDS = [1.0, 0.6]


def make(kind: str, **over):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":   # grouped-query attention: 8 query heads share 4 key/value heads
        cfg = LlamaConfig(**{"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "attn_implementation": "sdpa",
                             **over})
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(**{"vocab_size": VOCAB, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 8,
                            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
                            "eos_token_id": 0, "attn_implementation": "sdpa", **over})
        model = GPT2LMHeadModel(cfg)
    model = model.double()
    with torch.no_grad():     # larger than HF's 0.02 init, norms and biases too: every part matters
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def data():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (N, SEQ), generator=g),
                                          torch.randint(0, VOCAB, (N, SEQ), generator=g))


def loss_fn(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def in_tp_layout(ref, values: dict) -> dict:
    """The reference's `values` (its parameters or their gradients, by name) by the sharded model's
    names and shapes: GPT-2's Conv1D (x @ W + b) weight is the Linear's transposed, c_attn's
    columns are [q | k | v]."""
    from transformers.pytorch_utils import Conv1D

    out = {}
    for mname, m in ref.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            if f"{mname}.{pname}" not in values:       # GPT-2's head: tied to the token embedding
                continue
            t = values[f"{mname}.{pname}"].detach()
            if isinstance(m, Conv1D) and mname.endswith("c_attn"):
                d = t.shape[-1] // 3
                for i, x in enumerate("qkv"):
                    part = t[..., i * d:(i + 1) * d]
                    out[f"{mname}.{x}.{pname}"] = part.t() if pname == "weight" else part
            else:
                out[f"{mname}.{pname}"] = t.t() if isinstance(m, Conv1D) and pname == "weight" else t
    return out


def params_of(model) -> dict:
    return dict(model.named_parameters())


def grads_of(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def local_errors(model, whole: dict, values: dict) -> float:
    """The largest difference between this rank's `values` (by name) and its part of `whole`."""
    from hetrain.runtime.layouts.tensor.uneven import ShardedLinear

    part = {}
    for mname, m in model.named_modules():
        if isinstance(m, ShardedLinear):
            part[f"{mname}.weight"] = (m.dim, m.start, m.stop)
            if m.bias is not None and m.dim == 0:
                part[f"{mname}.bias"] = (0, m.start, m.stop)
    worst = 0.0
    for name, v in values.items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        w = whole[name]
        if name in part:
            dim, a, b = part[name]
            w = w.narrow(dim, a, b - a)
        assert v.shape == w.shape, (name, v.shape, w.shape)
        worst = max(worst, (v.detach() - w.detach()).abs().max().item())
    return worst


def one_step(kind: str, speeds, **over):
    from hetrain.runtime.layouts.tensor.shard import shard

    x, y = data().tensors
    ref, model = make(kind, **over), make(kind, **over)
    done = shard(model, speeds=speeds)
    ref_logits = ref(x[:4]).logits
    loss_fn(ref(x[:4]), y[:4]).backward()
    logits = model(x[:4]).logits
    loss_fn(model(x[:4]), y[:4]).backward()
    return {"logits": (logits - ref_logits).abs().max().item(),
            "grads": local_errors(model, in_tp_layout(ref, grads_of(ref)), grads_of(model)),
            "split": done.describe(), "renamed": len(done.renamed), "model": model}


def refusal(fn) -> str:
    from hetrain.errors import UsageError

    try:
        fn()
    except UsageError as e:
        return str(e)
    return "no error"


def direct_worker(rank, world):
    import torch.distributed as dist

    from hetrain.runtime.layouts.tensor.shard import tensor_parallel

    dist.init_process_group("gloo")
    out = {}
    for kind in ("llama", "gpt2"):
        for name, speeds in (("even", None), ("speed", SPEEDS)):
            r = one_step(kind, speeds)
            attn = r["model"].get_submodule("model.layers.0.self_attn" if kind == "llama" else "transformer.h.0.attn")
            q = attn.q_proj.weight if kind == "llama" else attn.c_attn.q.weight
            local = q.to_local() if hasattr(q, "to_local") else q
            out[kind, name] = {"logits": r["logits"], "grads": r["grads"], "split": r["split"],
                               "renamed": r["renamed"], "q_rows": local.shape[0],
                               "split_size": getattr(attn, "split_size", None)}
    # Multi-query attention: one key/value head cannot be given whole to each of 2 ranks
    out["mqa_speed"] = refusal(lambda: tensor_parallel(make("llama", num_key_value_heads=1), speeds=SPEEDS))
    out["mqa_even"] = refusal(lambda: tensor_parallel(make("llama", num_key_value_heads=1)))
    out["speeds_length"] = refusal(lambda: tensor_parallel(make("llama"), speeds=[1.0]))
    out["dropout"] = refusal(lambda: tensor_parallel(make("gpt2", resid_pdrop=0.1)))
    # 3 heads over 2 ranks: not whole heads evenly (the error names the split by speed), 2/1 by it
    odd = {"n_head": 3, "n_embd": 24}
    out["odd_even"] = refusal(lambda: tensor_parallel(make("gpt2", **odd)))
    r = one_step("gpt2", [1.0, 1.0], **odd)
    out["odd_speed"] = {k: r[k] for k in ("logits", "grads", "split")}
    dist.barrier()           # both ranks raised and are here: none was left inside a collective
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def direct():
    return run_ranks(direct_worker, 2)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("split", ["even", "speed"])
def test_one_step_matches_the_single_process_model_in_float64(direct, kind, split):
    for r in direct:
        got = r[kind, split]
        assert got["logits"] < 1e-12 and got["grads"] < 1e-12, got


def test_heads_and_mlp_columns_split_by_speed_as_whole_units(direct):
    for rank, r in enumerate(direct):
        # Llama: 4 key/value groups of 2 query heads by 1 : 0.6 -> 3/1 groups (6/2 query heads of 4
        # features: q rows 24/8), 40 MLP columns -> 25/15; evenly 2/2 groups (q rows 16)
        assert r["llama", "speed"]["split"] == "key/value heads 3/1 (query heads 6/2), MLP columns 25/15"
        assert r["llama", "speed"]["q_rows"] == (24, 8)[rank]
        assert r["llama", "even"]["q_rows"] == 16
        # GPT-2: 8 heads -> 5/3 (20/12 q rows, GPT-2's split_size localized), 128 MLP columns -> 80/48
        assert r["gpt2", "speed"]["split"] == "heads 5/3, MLP columns 80/48"
        assert r["gpt2", "speed"]["q_rows"] == r["gpt2", "speed"]["split_size"] == (20, 12)[rank]
        assert r["gpt2", "even"]["q_rows"] == r["gpt2", "even"]["split_size"] == 16
        assert r["gpt2", "even"]["renamed"] == 4    # c_attn's weight and bias of 2 layers became q, k, v


def test_a_split_that_cannot_be_whole_heads_is_one_usage_error_on_every_rank(direct):
    for r in direct:
        assert "1 key/value heads cannot give each of 2 ranks a whole one" in r["mqa_speed"], r["mqa_speed"]
        assert "use at most 1 rank for tensor parallelism" in r["mqa_speed"]
        assert "1 key/value heads cannot be split over 2 ranks as whole heads" in r["mqa_even"], r["mqa_even"]
        assert "speeds= takes one relative speed per rank" in r["speeds_length"]
        assert "GPT2Config(resid_pdrop=0.0" in r["dropout"]


def test_heads_that_do_not_divide_are_refused_evenly_naming_the_split_by_speed_which_runs_them(direct):
    for r in direct:
        assert "3 attention heads cannot be split over 2 ranks as whole heads" in r["odd_even"], r["odd_even"]
        assert "fix: use a tensor-parallel size that divides every count: 3" in r["odd_even"]
        assert "split='speed'" in r["odd_even"]
        got = r["odd_speed"]    # equal speeds, 3 heads: 2/1, 96 MLP columns 48/48; exact all the same
        assert got["split"] == "heads 2/1, MLP columns 48/48", got
        assert got["logits"] < 1e-12 and got["grads"] < 1e-12, got


def test_a_bad_split_names_the_fix_and_tp_split_in_config_names_the_layout():
    import hetrain
    from hetrain.errors import UsageError
    from hetrain.runtime.config import make_config

    with pytest.raises(UsageError, match="split='fast'") as bad:
        hetrain.TensorParallel(split="fast")
    assert "speed" in bad.value.fix and "even" in bad.value.fix
    with pytest.raises(UsageError, match="tp_split= is not a keyword of hetrain.Config; it is TensorParallel") as old:
        make_config({"global_batch": 8, "tp_split": "speed"})
    assert "parallel=hetrain.TensorParallel(split='speed')" in old.value.fix


# -- through hetrain's loop --------------------------------------------------------------------
def reference(kind: str, steps: int = STEPS) -> dict:
    """The whole model in one process: AdamW over each step's global batch, in the sampler's order."""
    from hetrain.runtime.loop.sampler import GlobalCursorSampler

    model, ds = make(kind), data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = GlobalCursorSampler(len(ds), BATCH, seed=0)
    for _ in range(steps):
        x, y = ds[list(sampler.next_step().indices)]
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return in_tp_layout(model, params_of(model))


def loop_job(kind, split, steps=STEPS, ckpt=None, parallel="tp"):
    """One job through hetrain's loop on a given Plan (nothing measured: the split is the plan's
    speeds, 1 : 0.6), its parameters against the single-process reference."""
    import hetrain
    from plans import speed_plan, tp_plan

    plan = tp_plan(BATCH, tuple(SPEEDS), split) if parallel == "tp" else speed_plan(BATCH, tuple(SPEEDS))
    ht = hetrain.init(global_batch=BATCH, max_steps=steps,
                      emulation=Emulation(cluster="a100-80g:1.0,rtx3090:0.6", sample_s=0.002),
                      reporting=Reporting(verbose=False), checkpoints=Checkpoints(dir=ckpt, every=1))
    net = make(kind)
    model, _, batches = ht.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.01), data(),
                                     parallel=plan, loss_fn=loss_fn)
    resumed_at = ht.steps_done
    for step in batches:
        for mb in step:
            with mb:
                ht.backward(ht.loss(mb))
        ht.step()
    out = {"error": local_errors(model.module, reference(kind, steps), params_of(model.module)),
           "speeds": [d.speed for d in ht.plan.devices], "layout": ht.plan.layout,
           "sample_s": ht.emulated.throttle.sample_s, "resumed_at": resumed_at}
    ht.close()
    return out


def loop_worker(rank, world, root):
    """Every loop case in one process group, one job after another (a case's key names it)."""
    import shutil

    import torch.distributed as dist

    from hetrain.errors import UsageError
    from pipeline_runs import join_group

    join_group()
    out = {("loop", "gpt2", "even"): loop_job("gpt2", "even"), ("loop", "llama", "speed"): loop_job("llama", "speed")}
    # a checkpoint of the split by speed: resumed by it, and by data parallelism from a copy
    a, b, c = (f"{root}/{x}" for x in "abc")
    out["speed first"] = loop_job("llama", "speed", 2, a)
    if rank == 0:
        shutil.copytree(a, b)
    dist.barrier()
    out["speed again"] = loop_job("llama", "speed", 3, a)
    out["speed dp"] = loop_job("llama", "even", 3, b, "dp")
    # GPT-2's even split: resumed split by speed; refused by data parallelism (every rank raises)
    out["gpt2 first"] = loop_job("gpt2", "even", 2, c)
    out["gpt2 again"] = loop_job("gpt2", "speed", 3, c)
    try:
        loop_job("gpt2", "even", 4, c, "dp")
    except UsageError as e:
        out["gpt2 dp"] = str(e)
    else:
        out["gpt2 dp"] = "accepted"
    return out


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    return run_ranks(loop_worker, 2, str(tmp_path_factory.mktemp("tp_loops")), timeout=400)


@pytest.mark.parametrize("kind, split", [("gpt2", "even"), ("llama", "speed")])
def test_adamw_steps_through_the_loop_match_the_single_process_model(loops, kind, split):
    ranks = [r["loop", kind, split] for r in loops]
    for r in ranks:
        assert r["layout"] == "tp" and r["error"] < 1e-10, r
    fast, slow = (r["sample_s"] for r in ranks)
    if split == "speed":     # the clock times each rank's part of the model (the head is whole on both)
        assert fast > slow
    else:
        assert fast == pytest.approx(slow)


def test_a_checkpoint_of_the_split_by_speed_resumes_it_and_loads_into_data_parallelism(loops):
    first = [r["speed first"] for r in loops]
    assert all(r["error"] < 1e-10 for r in first), first
    # the same split resumes from step 2 (each rank takes its rows back from the whole entries) ...
    again = [r["speed again"] for r in loops]
    # ... and plain data parallelism loads it too: the entries are the whole model's, by its names
    dp = [r["speed dp"] for r in loops]
    for r in again + dp:
        assert r["resumed_at"] == 2 and r["error"] < 1e-10, r
    assert [r["layout"] for r in dp] == ["dp", "dp"]


def test_a_gpt2_checkpoint_of_the_even_split_resumes_split_by_speed_and_data_parallelism_refuses_it(loops):
    """Its entries are the Linears' (parallel/tensor_hf.py), on every split: TP resumes them; DP
    and pipelines, which hold the Conv1Ds, get a UsageError naming the missing entry."""
    first = [r["gpt2 first"] for r in loops]
    assert all(r["error"] < 1e-10 for r in first), first
    again = [r["gpt2 again"] for r in loops]
    for r in again:
        assert r["resumed_at"] == 2 and r["error"] < 1e-10, r
    for r in loops:             # on every rank
        text = r["gpt2 dp"]
        assert "cannot be loaded into this job's layout" in text and "attn.c_attn.weight" in text, text[-2000:]
