"""Fabric scripts under `hetrain run`, as `fabric run` runs them: the form of Lightning's
language_model example with only its import line changed (no fabric.launch(), a model(input,
target) forward, clip_gradients(clip_val=), a validation loader split across the ranks), and a
script that asks Fabric for more devices than the job has (one line with the fix, exit 2)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from clirun import hetrain, one_line_error
from hetrain.integrations.evaluation import batch_ranges

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason='needs pip install "hetrain[lightning]"')

SCRIPTS = Path(__file__).parent / "scripts"


def test_a_script_written_for_fabric_run_runs_under_hetrain_run_unchanged_but_for_its_import(tmp_path):
    r = hetrain("run", "--emulate", "a100-80g,rtx3090", str(SCRIPTS / "fabric_language_model.py"), str(tmp_path),
                env={"HETRAIN_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "could not call the model (TypeError" in r.stdout + r.stderr      # planned from its own steps
    assert (r.stdout + r.stderr).count("val loss") == 2                       # fabric.print: rank 0, each epoch
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert all(x["world"] == 2 for x in ranks)
    # the 10 validation batches split by the plan's shares (10 : 6 from the catalog, unless the first steps
    # moved them), each rank its own run, none twice
    assert ranks[0]["shares"] == ranks[1]["shares"]
    assert [x["val_batches"] for x in ranks] == [len(r) for r in batch_ranges(10, ranks[0]["shares"])]


def test_fabric_asking_for_more_devices_than_the_job_has_is_one_line_and_exit_2(tmp_path):
    r = hetrain("run", "--emulate", "a100-80g,rtx3090", str(SCRIPTS / "fabric_too_many_devices.py"),
                env={"HETRAIN_CACHE": str(tmp_path / "cache")})
    one_line_error(r, "Fabric(devices=4, num_nodes=1)", "2 process(es) on this node", "pass Fabric(devices=2")
