"""The class swap of `hetrain run` (integrations/swap.py) in one process: the subclass patterns of
the fine-tuning frameworks inherit hetrain's classes, the Trainer's own Accelerator stays stock's,
a subclass hetrain's loop would bypass is refused, a sitecustomize the swap's hides still runs,
and `--no-swap` launches without it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src"
needs_hf = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate", "trl")),
                              reason='needs pip install "hetrain[hf]"')

PATTERNS = '''
import os
from hetrain.integrations.swap import install
install()

import accelerate, accelerate.accelerator, transformers.trainer
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer
from trl import SFTTrainer
from hetrain.errors import UsageError
from hetrain.integrations.hf.trainer import Trainer as Hetrain
from hetrain.integrations.trl_parts.trainers import TrlLoop


class FrameworkSeq2Seq(Seq2SeqTrainer):          # LLaMA-Factory's CustomSeq2SeqTrainer, say
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class FrameworkTrainer(Trainer):                  # axolotl's / ms-swift's own Trainer subclass
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class FrameworkSFT(SFTTrainer):
    pass


class OwnStep(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch)


print("SEQ2SEQ", issubclass(FrameworkSeq2Seq, Hetrain), FrameworkSeq2Seq.__mro__.index(Hetrain) > 1)
print("TRAINER", issubclass(FrameworkTrainer, Hetrain))
print("SFT", issubclass(FrameworkSFT, Hetrain) and issubclass(FrameworkSFT, TrlLoop))
print("ACCELERATE", Accelerator.__module__, issubclass(Accelerator, accelerate.accelerator.Accelerator))
print("TRAINERS_OWN", transformers.trainer.Accelerator is accelerate.accelerator.Accelerator)
model = GPT2LMHeadModel(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8, bos_token_id=0,
                                   eos_token_id=0))
args = Seq2SeqTrainingArguments(output_dir=os.environ["OUT"], report_to=[], use_cpu=True)
trainer = FrameworkSeq2Seq(model=model, args=args)
print("BUILT", type(trainer.accelerator).__module__)
try:
    OwnStep(model=model, args=args)
except UsageError as e:
    print("REFUSED", e.what)
'''


def run(code: str, tmp_path, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                               "OUT": str(tmp_path / "out"), **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@needs_hf
def test_the_frameworks_subclass_patterns_inherit_hetrains_classes(tmp_path):
    out = run(PATTERNS, tmp_path)
    assert "SEQ2SEQ True True" in out          # Seq2SeqTrainer's own code stays between the subclass and hetrain's
    assert "TRAINER True" in out and "SFT True" in out
    assert "ACCELERATE hetrain.integrations.accel.accelerator True" in out
    assert "TRAINERS_OWN True" in out            # the Trainer's inner Accelerator: stock's (it runs its own job)
    assert "BUILT accelerate.accelerator" in out
    assert "REFUSED" in out and "OwnStep overrides training_step" in out
    assert out.count("is hetrain's Trainer") == 1 and out.count("is hetrain's Accelerator") == 1


def test_a_sitecustomize_the_swap_hides_still_runs(tmp_path):
    from hetrain.integrations.swap import SITE, SITE_NAME

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    (ours / SITE_NAME).write_text(SITE)
    (theirs / SITE_NAME).write_text("import builtins\nbuiltins.THEIRS_RAN = True\n")
    out = run("import builtins, sys\nprint('CHAIN', getattr(builtins, 'THEIRS_RAN', False), "
              "any(type(f).__name__ == 'SwapFinder' for f in sys.meta_path))", tmp_path,
              PYTHONPATH=os.pathsep.join([str(ours), str(SRC), str(theirs)]))
    assert "CHAIN True True" in out


def test_hetrain_run_swaps_unless_no_swap(tmp_path):
    from hetrain.integrations.swap import SITE_NAME
    from hetrain.launch import build_launch

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    swapped = build_launch(target=str(script), nproc=1, run_dir=str(tmp_path / "a"), swap=True)
    folder = swapped.env["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(folder) / SITE_NAME).is_file() and folder.startswith(str(tmp_path / "a"))
    swapped.lock.release()
    stock = build_launch(target=str(script), nproc=1, run_dir=str(tmp_path / "b"), swap=False)
    assert "PYTHONPATH" not in stock.env
    stock.lock.release()
