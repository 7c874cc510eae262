"""`hetrain run` with a precision a device cannot run: one line naming the device and the fix,
or, with --allow-fallback, the fallback named and the job run."""

from __future__ import annotations

import textwrap

from clirun import hetrain, hetrain_here

SCRIPT = textwrap.dedent("""
    import torch, hetrain
    ht = hetrain.init(global_batch=4, precision="bf16", max_steps=1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    model = torch.nn.Linear(3, 1)
    model, opt, batches = ht.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    for step in batches:
        for mb in step:
            with ht.autocast():
                loss = torch.nn.functional.mse_loss(model(mb.batch[0]).float(), mb.batch[1])
            ht.backward(loss)
        ht.step()
    ht.summary()
    ht.close()
""")


def test_bf16_on_a_v100_is_one_line_then_runs_with_allow_fallback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # refused: the script in the pair's forked ranks (tests/harness.py), not a launch; what `hetrain
    # run` makes of a UsageError raised there, one line and exit 2, test_train_cli's launches check
    from harness import run_ranks
    from init_errors import raise_case

    code = SCRIPT.replace('precision="bf16"', 'precision="bf16", emulation=Emulation(cluster="a100-80g,v100")')
    got = run_ranks(raise_case, 2, "from hetrain.emulation import Emulation\n" + code, str(tmp_path))
    assert len(set(got)) == 1 and got[0] is not None and got[0][0] == "UsageError", got      # agreed
    _, what, fix = got[0]
    assert "rank 1" in what and "compute capability 7.0" in what and "--allow-fallback" in fix, got
    assert "\n" not in what + fix, got

    # --verbose: the precision table ("job-wide" loss scale) is one of the reasons behind the plan
    ran = hetrain("run", "--verbose", "--allow-fallback", "--emulate", "a100-80g,v100", str(script))
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = ran.stdout + ran.stderr
    assert "bf16 -> fp16" in out and "job-wide" in out
    assert "memory per device" in out and "steps skipped" in out


def test_an_unknown_precision_is_one_line_listing_the_values_for_demo_run_and_plan(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for args, accepted in ((("demo", "--precision", "fp8"), "auto, fp32, bf16, fp16"),
                           (("run", "--precision", "fp8", "--emulate", "a100-80g", str(script)), "auto, fp32, bf16, fp16"),
                           (("plan", "--precision", "fp8", "--global-batch", "8", "--model", "gpt2-124m",
                             "--emulate", "a100-80g"), "fp32, bf16, fp16")):
        r = hetrain_here(*args)          # refused on the command line, before anything starts
        assert r.returncode == 2, (args, r.stderr[-2000:])
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "'fp8'" in lines[0] and accepted in lines[0]


def test_auto_on_a_slow_bf16_host_keeps_bf16_in_the_plan_and_computes_fp32_and_says_so(tmp_path):
    """The tests' recorded host is an AVX2 CPU (bf16 ~39x slower than fp32): under auto the
    emulated A100 and 3090 run bf16 on the real cards, fp32 here, and every output says so."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # --verbose: the launcher's host line, the precision table and the layout's reasons
    r = hetrain("run", "--verbose", "--precision", "auto", "--emulate", "a100-80g,rtx3090", str(script))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "host CPU: AMD EPYC" in out and "compute in fp32 here" in out           # the launcher's line
    assert "bf16 (computes fp32)" in out                                            # the precision table
    assert "bf16 on the real card" in out and "--precision bf16 forces bf16" in out
