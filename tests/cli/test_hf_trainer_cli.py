"""A Trainer script under `hetrain run`, as a user runs it: it trains on the emulated pair with one
main process writing the Trainer's checkpoints, and a TrainingArguments setting that conflicts with
hetrain's global batch is one line naming the fix (exit 2, no traceback)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from clirun import hetrain

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason='needs pip install "hetrain[hf]"')

SCRIPT = textwrap.dedent("""
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    from hetrain.integrations.transformers import Trainer

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            x = torch.arange(i, i + 8) % 32
            return {"input_ids": x, "labels": x}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=3, save_steps=3,
                             report_to="none", disable_tqdm=True, auto_find_batch_size=sys.argv[2] == "auto")
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    out = trainer.train()
    if trainer.is_world_process_zero():
        print("TRAINED", out.global_step, [d.share for d in trainer.hetrain_plan.devices])
""")


def test_a_trainer_script_trains_under_hetrain_run_with_one_main_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = hetrain("run", "--emulate", "a100-80g,rtx3090", str(script), str(tmp_path / "out"), "fixed", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    trained = [line for line in r.stdout.splitlines() if line.startswith("TRAINED")]
    assert len(trained) == 1, r.stdout                        # printed by rank 0 alone
    step, shares = trained[0].split(" ", 2)[1:]
    assert step == "3" and sum(eval(shares)) == 4 * 2         # the Trainer's global batch: 4 x 1 x 2 devices
    assert (tmp_path / "out" / "checkpoint-3" / "hetrain.json").exists()
    # hetrain owns the process group by design: transformers' warning that it is not DISTRIBUTED would mislead
    assert "parallel_mode != ParallelMode.DISTRIBUTED" not in r.stdout + r.stderr


def test_a_conflicting_training_argument_is_one_line_naming_the_fix(tmp_path):
    """The script in the pair's forked ranks (tests/harness.py, transformers imported once by its
    server), not a launch: every rank raises the same UsageError, one line and its fix. What `hetrain
    run` makes of a UsageError raised there, one line and exit 2, test_train_cli's launches check."""
    from harness import run_ranks
    from init_errors import raise_case

    got = run_ranks(raise_case, 2, SCRIPT, str(tmp_path), (str(tmp_path / "out"), "auto"))
    assert len(set(got)) == 1 and got[0] is not None and got[0][0] == "UsageError", got      # agreed
    _, what, fix = got[0]
    assert "auto_find_batch_size=True" in what and "remove auto_find_batch_size=True" in fix, got
    assert "\n" not in what + fix, got
