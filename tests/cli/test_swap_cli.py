"""`hetrain run` of stock scripts with no edit (zero-change mode, integrations/swap.py): a framework's
Seq2SeqTrainer subclass that overrides compute_loss (as LLaMA-Factory, axolotl and ms-swift define
theirs) trains on hetrain's loop across two emulated devices; an Accelerate script's
dataloader_config that hetrain cannot honour is one line naming the fix, exit 2. Both in one
launch: the framework's training, then, in the same processes, the Accelerate script's refusal."""

from __future__ import annotations

import importlib.util

import pytest

from clirun import hetrain

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                or importlib.util.find_spec("accelerate") is None, reason='needs pip install "hetrain[hf]"')

FRAMEWORK_SCRIPT = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Seq2SeqTrainer, Seq2SeqTrainingArguments


class CustomSeq2SeqTrainer(Seq2SeqTrainer):            # a fine-tuning framework's own trainer
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.losses_computed = getattr(self, "losses_computed", 0) + 1
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.arange(8) * (i + 1) % 64
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
args = Seq2SeqTrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=2, report_to=[],
                                save_strategy="no", logging_steps=1, use_cpu=True)
trainer = CustomSeq2SeqTrainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
if trainer.is_world_process_zero():
    print("MRO", [c.__module__ for c in type(trainer).__mro__])
    print("RAN", trainer.hetrain_summary is not None, trainer.losses_computed > 0)
'''

DISPATCH_SCRIPT = '''
import torch                                  # a stock Accelerate script: the swap makes it hetrain's
from accelerate import Accelerator, DataLoaderConfiguration

accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 4)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
'''


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One `hetrain run` of the framework's script followed by the Accelerate script."""
    tmp = tmp_path_factory.mktemp("swap")
    script = tmp / "train.py"
    script.write_text(FRAMEWORK_SCRIPT + DISPATCH_SCRIPT)
    return hetrain("run", "--emulate", "a100-80g,rtx3090", str(script), cwd=str(tmp), timeout=600)


def test_a_frameworks_seq2seq_trainer_subclass_trains_on_hetrains_loop_with_no_edit(job):
    out = job.stdout + job.stderr
    # train() returned on rank 0, and the job's only error is the Accelerate script's after it (below)
    assert "RAN True True" in out, out[-3000:]                    # hetrain's train() ran, with its compute_loss
    errors = [line for line in job.stderr.splitlines() if line.startswith("hetrain: error")]
    assert len(errors) == 1 and "dispatch_batches=True" in errors[0] and "Traceback" not in out, out[-3000:]
    mro = next(line for line in out.splitlines() if line.startswith("MRO"))
    assert mro.index("__main__") < mro.index("transformers.trainer_seq2seq") < mro.index("hetrain.integrations.hf")
    swapped = [line for line in out.splitlines() if "is hetrain's Trainer" in line]
    assert len(swapped) == 1 and "--no-swap" in swapped[0]        # one line, from rank 0


def test_dispatch_batches_with_uneven_shares_is_one_line_naming_the_fix_exit_2(job):
    done = job
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if "error: DataLoaderConfiguration(dispatch_batches=True)" in line]
    assert len(said) == 1 and "uneven shares" in lines[said[0]], done.stderr
    assert "fix: use DataLoaderConfiguration(dispatch_batches=False)" in lines[said[0] + 1]
    assert "Traceback" not in done.stderr
