"""Fabric scripts under `hetrain run`, as `fabric run` runs them: the form of Lightning's
language_model example with only its import line changed (no fabric.launch(), a model(input,
target) forward, clip_gradients(clip_val=), a validation loader split across the ranks), after a
Fabric that asks for more devices than the job has (a usage error with the fix, leaving no job),
in one run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from clirun import hetrain
from hetrain.integrations.evaluation import batch_ranges

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason='needs pip install "hetrain[lightning]"')

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One `hetrain run` of Lightning's language_model example, after each rank's refused Fabric."""
    out = tmp_path_factory.mktemp("fabric")
    r = hetrain("run", "--emulate", "a100-80g,rtx3090", str(SCRIPTS / "fabric_refused_then_language_model.py"),
                str(out), env={"HETRAIN_CACHE": str(out / "cache")})
    return r, out


def test_a_script_written_for_fabric_run_runs_under_hetrain_run_unchanged_but_for_its_import(job):
    r, out = job
    assert r.returncode == 0, r.stdout + r.stderr
    assert "could not call the model (TypeError" in r.stdout + r.stderr      # planned from its own steps
    assert (r.stdout + r.stderr).count("val loss") == 2                       # fabric.print: rank 0, each epoch
    ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]
    assert all(x["world"] == 2 for x in ranks)
    # the 10 validation batches split by the plan's shares (10 : 6 from the catalog, unless the first steps
    # moved them), each rank its own run, none twice
    assert ranks[0]["shares"] == ranks[1]["shares"]
    assert [x["val_batches"] for x in ranks] == [len(r) for r in batch_ranges(10, ranks[0]["shares"])]


def test_fabric_asking_for_more_devices_than_the_job_has_is_a_usage_error_that_leaves_no_job(job):
    """Each rank's Fabric(devices=4) against the 2 processes torchrun started: a UsageError (exit 2)
    naming the fix, raised before joining, so the example's Fabric joins the job after it (the run
    above). Uncaught, it reaches hetrain's excepthook, which under `hetrain run` leaves the
    launcher's one line (test_malformed_inputs: errors raised before init())."""
    r, out = job
    for k in range(2):
        refused = json.loads((out / f"refused-rank{k}.json").read_text())
        assert refused["kind"] == "UsageError" and refused["exit_code"] == 2
        assert "Fabric(devices=4, num_nodes=1)" in refused["what"]
        assert "2 process(es) on this node" in refused["what"]
        assert "pass Fabric(devices=2" in refused["fix"]
        assert refused["hook"] == "hetrain.runtime.resilience.worker_errors"
    assert r.returncode == 0 and "hetrain: error" not in r.stderr, r.stderr
