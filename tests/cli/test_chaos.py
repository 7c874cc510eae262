"""benchmarks/chaos.py's fault schedule for every layout, checked without launching (the benchmark
itself launches; the launched path of each fault kind is tested elsewhere: kills, hangs and
truncated checkpoints in tests/cli/test_restart.py, OOMs in every layout in tests/dist/test_oom_*.py,
test_layouts.py and the seed's case). The schedule must be one the runtime can survive: faults
parse as the runtime reads them, each restart-causing fault fires in its own attempt, no kill
mid-backward under a pipeline (its backward runs in the schedule), OOMs within each group's halvings."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from hetrain.runtime.devices.faults import parse_faults

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["dp", "zero1", "fsdp", "capacity", "capacity-full", "pp", "dp-pp", "tp",
                                    "pp-resplit"])
def test_twenty_faults_per_layout_are_a_schedule_the_runtime_can_survive(layout):
    chaos = load_chaos()
    specs = chaos.schedule(20, 30, 3, 0, layout)
    faults = parse_faults(";".join(specs))
    assert len(faults) == 20
    kinds = Counter(f.kind for f in faults)
    assert kinds["die"] and kinds["stall"] and kinds["oom"]
    case = chaos.LAYOUTS[layout]
    # an OOM restarts the job where in-loop recovery is off (TP, capacity-full)
    restarts = sorted((f for f in faults if f.kind != "oom" or case.oom_restarts), key=lambda f: f.step)
    assert [f.attempt for f in restarts] == list(range(len(restarts)))     # one attempt each, in step order
    assert len({f.step for f in restarts}) == len(restarts)
    assert all(f.step % 3 == 0 for f in restarts if f.phase == "checkpoint")
    if case.resplit:        # the first attempt runs long enough to re-split
        assert min(f.step for f in restarts) >= chaos.RESPLIT_FROM
    if case.parallel in ("pp", "dp-pp"):
        assert all(f.phase != "backward" for f in faults if f.kind == "die")
    groups, budget = chaos.oom_budget(layout)
    for group in groups:       # each group's micro-batch can halve `budget` times before it is 1
        assert sum(1 for f in faults if f.kind == "oom" and f.rank in group) <= budget
    world = sum(len(g) for g in groups)
    assert all(0 <= f.rank < world for f in faults)


def test_a_reordered_gradient_sum_compares_equal_though_gpt2_key_biases_hold_rounding_alone():
    """Why TP's chaos run read 'max rel diff 1.0': an OOM halves the micro-batch, so each gradient
    is summed in another order, and GPT-2's key biases (one tensor each once TP splits c_attn into
    q, k, v: runtime/layouts/tensor/hf.py) get a zero gradient in exact arithmetic (softmax is unchanged
    by adding q·b to every key's score); they hold float64 rounding alone (~1e-21), which a
    reordered sum changes by ~100% of itself. The comparison floors each tensor's scale at a
    fraction of the model's, so that passes, and a lost sample still fails it."""
    pytest.importorskip("transformers")
    import copy

    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from hetrain.runtime.layouts.tensor.hf import gpt2_to_linears

    chaos = load_chaos()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=8, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).double()
    gpt2_to_linears(model)
    seq = torch.randint(0, 64, (16, 13), generator=torch.Generator().manual_seed(0))

    def stepped(chunks):
        """Parameters after 3 SGD steps on the mean token loss of `seq`, summed over `chunks`."""
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        for _ in range(3):
            for c in chunks:
                logits = m(seq[c, :-1]).logits
                F.cross_entropy(logits.flatten(0, 1), seq[c, 1:].flatten(), reduction="sum").div(seq[:, 1:].numel()).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    whole = stepped([slice(0, 16)])
    halves = stepped([slice(0, 8), slice(8, 16)])          # an OOM's halved micro-batches
    lost = stepped([slice(0, 15)])                         # one sample of 16 never trained on
    largest = max(t.abs().max().item() for t in whole.values())
    keys = [n for n in whole if n.endswith("attn.c_attn.k.bias")]
    assert len(keys) == 2 and all(whole[n].abs().max().item() < 1e-15 * largest for n in keys)
    equal, _, worst, _ = chaos.compare(halves, whole)
    assert equal, worst
    equal, _, worst, name = chaos.compare(lost, whole)
    assert not equal and worst > 1e-4 and not name.endswith("k.bias"), (worst, name)
