"""Every layout through the same loop (runtime/layouts/), resilient: real gloo groups, emulated devices.

Reference: the same model and samples in one process, the plain big-batch loss (mean over samples,
or over tokens), SGD in float64 — independent of stages, padding, weighting and redone steps.
Cases: out-of-memory errors on either stage, in forward and backward, redone to the same result
with every sample once; one checkpoint carried pp (2) -> DP×PP (4) -> tp (2) -> dp (2) under a
token-weighted loss (the demo GPT, its tied embedding/head on both ends of each pipeline); one loss scale across a bf16 and an
fp16 stage, an overflow on one stage skipping the step on both; parallel='auto' choosing a pipeline
when the model does not fit the small device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nets import Residual

from harness import run_ranks
from hetrain import Checkpoints, Reporting
from hetrain.emulation import Emulation

pytestmark = pytest.mark.dist

VOCAB, SEQ, N = 16, 6, 48
PAIR = "a100-80g,rtx3090:1.0"      # the plans are given: at speed 1 no emulated device sleeps


def gpt():
    from hetrain.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=8, n_layers=4, n_heads=2)).double()


def tokens_data():
    """Token targets with ~30% ignored (-100), unevenly per sample: token weighting matters."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    y[torch.rand(N, SEQ, generator=g) < 0.3] = -100
    return torch.utils.data.TensorDataset(x, y)


def token_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


def stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Residual(6) for _ in range(4))).double()


def stack_data():
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(torch.randn(N, 6, generator=g).double(), torch.randn(N, 6, generator=g).double())


MODELS = {"gpt": (gpt, tokens_data, token_loss), "stack": (stack, stack_data, F.mse_loss)}


def reference(kind: str, steps: int, batch: int, *, tokens: bool) -> dict:
    """The whole model in one process over each step's global batch, in the sampler's order."""
    from hetrain.runtime.loop.sampler import GlobalCursorSampler

    make, data, loss_fn = MODELS[kind]
    model, ds = make(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = GlobalCursorSampler(len(ds), batch, seed=0)
    for _ in range(steps):
        x, y = ds[list(sampler.next_step().indices)]
        loss_fn(model(x), y).backward()      # the mean over tokens (ignore_index) or samples: the big batch
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def as_layout(spec):
    """The spec's layout: its given Plan (nothing measured), or its micro_batches make a
    hetrain.Pipeline of parallel='pp'."""
    import hetrain

    if spec.get("plan") is not None:
        return spec["plan"]
    if spec.get("micro_batches") is not None and spec["parallel"] == "pp":
        return hetrain.Pipeline(micro_batches=spec["micro_batches"])
    return spec["parallel"]


def worker(rank, world, spec):
    import hetrain

    make, data, loss_fn = MODELS[spec["model"]]
    ht = hetrain.init(global_batch=spec["batch"], max_steps=spec["steps"],
                      emulation=Emulation(cluster=spec.get("emulate", PAIR), faults=spec.get("faults")),
                      checkpoints=Checkpoints(dir=spec.get("ckpt"), every=1),
                      reporting=Reporting(sample_log=spec.get("samples"), verbose=False),
                      loss_weighting="tokens" if spec.get("tokens") else "samples",
                      precision=spec.get("precision", "fp32"))
    warnings = []
    ht.log.warn = ht.log.warn_job = warnings.append
    net = make()
    model, opt, batches = ht.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), data(),
                                     parallel=as_layout(spec), loss_fn=loss_fn)
    out = {"losses": [], "scales": [], "sums": [], "layout": ht.plan.layout, "group": ht.plan.group,
           "warnings": warnings}
    for step in batches:
        for mb in step:
            with mb:
                tokens = int((mb.batch[1] != -100).sum()) if spec.get("tokens") else None
                ht.backward(ht.loss(mb), tokens=tokens)
        if spec.get("overflow_at") == step.index and rank == 1:   # this stage only sees an overflow
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        ht.step()
        out["losses"].append(step.loss)
        out["sums"].append(sum(float(p.detach().abs().sum()) for p in model.parameters()))
        if ht.job.precision.scaler is not None:
            out["scales"].append(ht.job.precision.scaler.get_scale())
    held = {id(p) for p in model.parameters()}
    out["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in model.module.named_parameters() if id(p) in held}
    out["summary"] = ht.summary()
    out["plan_version"] = ht.plan.version
    ht.close()
    return out


def gathered(results) -> dict:
    """Every rank's held parameters, by whole-model name (a stage holds its blocks; the tied
    weight is held by both ends, equal)."""
    out = {}
    for r in results:
        for name, p in r["params"].items():
            if name in out:
                assert torch.equal(out[name], p), name
            out[name] = p
    return out


def assert_equal_to(ref: dict, got: dict, tol: float = 1e-10) -> None:
    assert set(got) == set(ref), set(ref) ^ set(got)
    for name in ref:
        assert torch.allclose(got[name], ref[name], atol=tol, rtol=0), (name, (got[name] - ref[name]).abs().max())


def cases_worker(rank, world, specs: dict):
    """Each spec's job in one process group, one after the other: {name: worker's result}."""
    from pipeline_runs import join_group

    join_group()
    return {name: worker(rank, world, spec) for name, spec in specs.items()}


def run_cases(world: int, specs: dict) -> dict:
    """{name: [rank 0's result, rank 1's, ...]} of cases_worker."""
    results = run_ranks(cases_worker, world, specs, timeout=300)
    return {name: [r[name] for r in results] for name in specs}


def auto_spec() -> dict:
    """~1.9 KiB of parameters, ~7.7 KiB of training state: it fits 80 KiB, not 24 KiB even
    sharded (FSDP's even split needs more than 24/80 of it)... scaled 80:24 like the seed case."""
    from hetrain.planning.memory import state_factor

    model = stack()
    state = state_factor("sgd") * sum(p.numel() * p.element_size() for p in model.parameters())
    big, small = int(state * 1.6), int(state * 1.6 * 24 / 80)
    return {"model": "stack", "batch": 12, "steps": 1, "parallel": "auto",
            "emulate": f"a100-80g@{big}B,rtx3090@{small}B"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The two-device cases, in one process group: the out-of-memory redo, the loss scale over a
    bf16 and an fp16 stage, parallel='auto', and the first leg (pp) of the checkpoint's journey."""
    from pipeline_runs import pipeline_plan

    root = tmp_path_factory.mktemp("layouts")
    faults = "oom:rank=1,step=1,micro=0,phase=forward;oom:rank=0,step=2,micro=1,phase=backward"
    specs = {
        "oom": {"model": "stack", "batch": 24, "steps": 4, "parallel": "pp", "faults": faults,
                "samples": str(root / "samples"),     # 3 micro-batches of 8
                "plan": pipeline_plan("pp", blocks=(2, 2), schedule="1f1b", shares=(24,), micro=(8,), world=2)},
        "scale": {"model": "stack", "batch": 12, "steps": 3, "parallel": "pp", "emulate": "a100-80g,v100-32g:1.0",
                  "precision": "auto", "overflow_at": 1,
                  "plan": pipeline_plan("pp", blocks=(2, 2), schedule="1f1b", shares=(12,), micro=(6,), world=2)},
        "auto": auto_spec(),
        "pp": {**ckpt_common(root), "steps": 1, "parallel": "pp", "plan": pipeline_plan(
            "pp", blocks=(2, 2), schedule="1f1b", shares=(12,), micro=(3,), world=2)},
    }
    return root, run_cases(2, specs)


def ckpt_common(root) -> dict:
    return {"model": "gpt", "batch": 12, "ckpt": str(root / "ckpt"), "tokens": True}


def test_out_of_memory_on_either_stage_is_redone_with_the_same_result_and_every_sample_once(pair):
    from hetrain.runtime.resilience.resume import read_sample_log

    root, runs = pair
    results = runs["oom"]
    assert_equal_to(reference("stack", 4, 24, tokens=False), gathered(results))
    ooms = [row["ooms"] for row in results[0]["summary"]["ranks"]]
    assert ooms == [1, 1], ooms
    assert results[0]["plan_version"] == 2           # micro-batch 8 -> 4 -> 2, for both stages each time
    steps = read_sample_log(str(root / "samples"))
    assert sorted(steps) == [0, 1, 2, 3]
    used = sorted(pair for s in steps.values() for pair in s)      # (epoch, index): 4 × 24 = two epochs of 48
    assert used == [(e, i) for e in (0, 1) for i in range(N)]


def test_a_checkpoint_moves_between_layouts_and_device_counts(pair):
    """One run, four launches: pp on 2 devices, DP×PP on 4, tp on 2, dp on 2 — each resuming the
    previous one's checkpoint (DCP reshards by whole-model name); the result is 4 uninterrupted steps.
    The model is the demo GPT (its tied embedding and head on the two ends of each pipeline) with a
    token-weighted loss (~30% of the targets ignored, unevenly per sample) in micro-batches of 3-4
    rows: each leg equals one device's token-mean big batch. Each leg runs a given Plan: what is
    carried is the checkpoint, not a measurement. The pp leg ran with the other two-device cases
    (`pair`); tp and dp, one after the other, share a process group too."""
    from pipeline_runs import pipeline_plan
    from plans import data_plan, tp_plan

    root, runs = pair
    common = ckpt_common(root)
    pp = runs["pp"]
    assert [r["layout"] for r in pp] == ["pp", "pp"] and pp[0]["losses"] == pp[1]["losses"]
    assert_equal_to(reference("gpt", 1, 12, tokens=True), gathered(pp))
    hybrid = run_ranks(worker, 4, {**common, "steps": 2, "parallel": "dp-pp", "emulate": f"{PAIR},{PAIR}",
                                   "plan": pipeline_plan("dp-pp", blocks=(2, 2), schedule="1f1b", shares=(7, 5),
                                                         micro=(4, 3), world=4)})
    assert [(r["layout"], r["group"]) for r in hybrid] == [("dp-pp", 2)] * 4
    last = run_cases(2, {"tp": {**common, "steps": 3, "parallel": "tp", "plan": tp_plan(12, (1.0, 1.0), micro=4)},
                         "dp": {**common, "steps": 4, "parallel": "dp", "plan": data_plan((7, 5), (4, 3))}})
    tp, dp = last["tp"], last["dp"]
    assert [r["layout"] for r in tp] == ["tp", "tp"]
    assert_equal_to(reference("gpt", 2, 12, tokens=True), gathered(hybrid))
    assert_equal_to(reference("gpt", 3, 12, tokens=True), gathered(tp))
    assert_equal_to(reference("gpt", 4, 12, tokens=True), gathered(dp))


def test_one_loss_scale_over_a_bf16_and_an_fp16_stage_and_an_overflow_on_one_skips_both(pair):
    r0, r1 = pair[1]["scale"]
    precision = r0["summary"]["precision"]
    assert precision["per_rank"] == ["bf16", "fp16"]
    assert r0["scales"] == r1["scales"] == [65536.0, 32768.0, 32768.0]
    for r in (r0, r1):
        assert r["summary"]["precision"]["skipped_steps"] == 1
    for r in (r0, r1):   # each stage: step 1 changed nothing, steps 0 and 2 did
        assert r["sums"][1] == r["sums"][0] != r["sums"][2]


def test_auto_chooses_a_pipeline_when_the_model_does_not_fit_the_small_device(pair):
    r0, r1 = pair[1]["auto"]
    assert r0["layout"] == r1["layout"] == "pp"
