"""`hetrain run --slurm`: the rendezvous from a Slurm job step's environment (no Slurm needed),
the host list forms, and each bad input's one-line message."""

import re
import stat
import subprocess
from pathlib import Path

import pytest

from hetrain.errors import UsageError
from hetrain.launching.slurm import SlurmRendezvous, from_slurm, hostnames

SBATCH = Path(__file__).resolve().parents[2] / "examples" / "slurm_multinode.sbatch"
NO_SCONTROL = "/nonexistent"       # PATH without scontrol: hetrain expands the host list itself


def step(**over):
    """Node 1 of a 2-node srun step of job 4242, one task per node (what srun sets, trimmed)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
           "SLURM_NTASKS_PER_NODE": "1", "PATH": NO_SCONTROL}
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def usage_error(environ) -> UsageError:
    with pytest.raises(UsageError) as e:
        from_slurm(environ)
    assert "\n" not in str(e.value) and e.value.fix
    return e.value


def test_a_step_maps_to_the_rendezvous_with_a_reason_per_value():
    r = from_slurm(step())
    assert (r.nnodes, r.node_rank, r.endpoint, r.rdzv_id) == (2, 1, "gpu07:29742", "4242")
    assert (r.host, r.port) == ("gpu07", 29742)
    assert r.reasons == (
        "--nnodes 2: SLURM_STEP_NUM_NODES=2",
        "--node-rank 1: SLURM_NODEID=1",
        "--rdzv-endpoint gpu07:29742: the first host of SLURM_STEP_NODELIST=gpu[07-08], expanded by hetrain "
        "(no scontrol on PATH); port 29500 + SLURM_JOB_ID % 1000 (set HETRAIN_RDZV_PORT to choose another)",
        "--rdzv-id 4242: SLURM_JOB_ID (the same on every node and on a requeue)")
    assert r.flags() == ("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "gpu07:29742", "--rdzv-id", "4242")


def test_the_batch_environment_without_step_variables():
    env = step(SLURM_STEP_NUM_NODES=None, SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None,
               SLURM_NNODES=None, SLURM_JOB_NODELIST=None, SLURM_NODEID="0", SLURM_JOB_ID="123456")
    r = from_slurm(env)
    assert (r.nnodes, r.node_rank, r.endpoint) == (2, 0, "gpu07:29956")
    assert r.reasons[0] == "--nnodes 2: SLURM_JOB_NUM_NODES=2" and "SLURM_NODELIST=gpu[07-08]" in r.reasons[2]


def test_a_step_on_part_of_the_job_uses_the_steps_own_nodes():
    r = from_slurm(step(SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="gpu[02,04]", SLURM_JOB_NODELIST="gpu[01-04]",
                        SLURM_NNODES="4"))
    assert r.endpoint == "gpu02:29742"


def test_the_port_comes_from_hetrain_rdzv_port_when_set():
    r = from_slurm(step(HETRAIN_RDZV_PORT="31000"))
    assert r.port == 31000 and "port 31000 from HETRAIN_RDZV_PORT" in r.reasons[2]
    e = usage_error(step(HETRAIN_RDZV_PORT="70000"))
    assert e.what == "HETRAIN_RDZV_PORT='70000' is not a TCP port"


@pytest.mark.parametrize("nodelist,hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-04]", ["gpu01", "gpu02", "gpu03", "gpu04"]),
    ("gpu[01,03-05],cpu7", ["gpu01", "gpu03", "gpu04", "gpu05", "cpu7"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[098-100]", ["node098", "node099", "node100"]),
    ("rack1-n[1-2].cluster", ["rack1-n1.cluster", "rack1-n2.cluster"]),
])
def test_host_list_forms(nodelist, hosts):
    assert list(hostnames(nodelist)) == hosts


def test_the_first_host_of_a_mixed_list_is_the_endpoint():
    r = from_slurm(step(SLURM_STEP_NODELIST="a100-[3,5],rtx3090-1", SLURM_STEP_NUM_NODES="3", SLURM_NODEID="2",
                        SLURM_STEP_TASKS_PER_NODE="1(x3)"))
    assert r.endpoint == "a100-3:29742" and r.nnodes == 3


def _fake_scontrol(tmp_path, script):
    exe = tmp_path / "scontrol"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(tmp_path)


def test_scontrol_expands_the_host_list_when_on_path(tmp_path):
    path = _fake_scontrol(tmp_path, '[ "$1 $2" = "show hostnames" ] || exit 2\necho head-node\necho second\n')
    r = from_slurm(step(PATH=path, SLURM_STEP_NODELIST="weird{syntax}"))     # only scontrol understands it
    assert r.endpoint == "head-node:29742" and "as `scontrol show hostnames` expands it" in r.reasons[2]


def test_a_failing_scontrol_falls_back_to_expanding_here(tmp_path):
    path = _fake_scontrol(tmp_path, "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2\nexit 1\n")
    r = from_slurm(step(PATH=path))
    assert r.endpoint == "gpu07:29742" and "expanded by hetrain (scontrol failed)" in r.reasons[2]


@pytest.mark.parametrize("over,what", [
    (dict(SLURM_JOB_ID=None, SLURM_JOBID=None), "--slurm: SLURM_JOB_ID is not set: not inside a Slurm job"),
    (dict(SLURM_JOB_ID="abc"), "SLURM_JOB_ID='abc' is not a Slurm job id (a number)"),
    (dict(SLURM_STEP_NUM_NODES="two"), "SLURM_STEP_NUM_NODES='two' is not a whole number of at least 1"),
    (dict(SLURM_STEP_NUM_NODES=None, SLURM_NNODES="0"), "SLURM_NNODES='0' is not a whole number of at least 1"),
    (dict(SLURM_STEP_NUM_NODES=None, SLURM_NNODES=None, SLURM_JOB_NUM_NODES=None),
     "SLURM_NNODES / SLURM_JOB_NUM_NODES is not set: not inside a Slurm job"),
    (dict(SLURM_NODEID=None), "SLURM_NODEID is not set: not inside a Slurm job"),
    (dict(SLURM_NODEID="-1"), "SLURM_NODEID='-1' is not a whole number of at least 0"),
    (dict(SLURM_NODEID="2"), "SLURM_NODEID=2 is not below SLURM_STEP_NUM_NODES=2"),
    (dict(SLURM_STEP_NODELIST=None), "SLURM_STEP_NODELIST is not set: no host list for the rendezvous"),
    (dict(SLURM_STEP_NODELIST="gpu[07-"), "SLURM_STEP_NODELIST='gpu[07-' is not a Slurm host list"),
    (dict(SLURM_STEP_NODELIST="gpu[x-y]"), "SLURM_STEP_NODELIST='gpu[x-y]': 'x-y' in [x-y] is not a number or a range lo-hi"),
    (dict(SLURM_STEP_NODELIST="gpu[08-07]"), "SLURM_STEP_NODELIST='gpu[08-07]': '08-07' in [08-07] is not a number or a range lo-hi"),
    (dict(SLURM_STEP_NODELIST="gpu 7"), "SLURM_STEP_NODELIST='gpu 7': 'gpu 7' is not a host name"),
    (dict(SLURM_STEP_NODELIST="gpu[07-09]"), "SLURM_STEP_NODELIST='gpu[07-09]' lists 3 host(s) but SLURM_STEP_NUM_NODES=2"),
])
def test_missing_or_junk_variables_name_the_variable_and_the_fix(over, what):
    e = usage_error(step(**over))
    assert e.what == what
    assert "pass --nnodes/--node-rank/--rdzv-endpoint yourself" in e.fix


@pytest.mark.parametrize("over,var", [
    (dict(SLURM_STEP_TASKS_PER_NODE="2(x2)"), "SLURM_STEP_TASKS_PER_NODE=2(x2)"),
    (dict(SLURM_STEP_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="4"), "SLURM_NTASKS_PER_NODE=4"),
    (dict(SLURM_STEP_TASKS_PER_NODE="1,3"), "SLURM_STEP_TASKS_PER_NODE=1,3"),
])
def test_more_than_one_task_per_node_is_refused_with_the_srun_fix(over, var):
    e = usage_error(step(**over))
    assert e.what.startswith(f"{var}: ") and "hetrain launchers on one node" in e.what
    assert e.fix.startswith("srun --ntasks-per-node=1")


def test_the_steps_tasks_per_node_wins_over_the_jobs():
    # sbatch --ntasks-per-node=8 for other steps, then `srun --ntasks-per-node=1 hetrain run --slurm`
    assert from_slurm(step(SLURM_NTASKS_PER_NODE="8", SLURM_STEP_TASKS_PER_NODE="1(x2)")).nnodes == 2


def test_the_record_is_validated():
    with pytest.raises(UsageError, match="node_rank 2 is not in 0..1"):
        SlurmRendezvous(nnodes=2, node_rank=2, endpoint="h:1", rdzv_id="1")
    with pytest.raises(UsageError, match="is not HOST:PORT"):
        SlurmRendezvous(nnodes=2, node_rank=0, endpoint="h", rdzv_id="1")


def test_the_sbatch_example_runs_one_launcher_per_node_with_the_flags_it_documents():
    text = SBATCH.read_text()
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    assert re.search(r"^#SBATCH --nodes=2$", text, re.M) and re.search(r"^#SBATCH --ntasks-per-node=1\b", text, re.M)
    run = re.search(r"^srun (.*\\\n)*.*$", text, re.M)[0]
    assert "--ntasks-per-node=1" in run
    assert 'hetrain run --slurm --max-restarts 3 --checkpoint-dir "$SHARED/ckpt" examples/minimal.py' in run
    # the comment's explicit flags are what from_slurm gives for the job it describes
    r = from_slurm(step(SLURM_JOB_ID="4242"))
    assert "hetrain run " + " ".join(r.flags()) + " ..." in text
    assert "shared" in text.lower()
