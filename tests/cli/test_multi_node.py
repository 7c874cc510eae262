"""Multi-node jobs on loopback: one `hetrain run` per node, each with its own emulated devices, on
one c10d rendezvous. The job trains as one process would; a lost node's peers restart without it
and resume exactly, and a node that comes back is taken in; nodes with different torch builds, an
endpoint nobody answers and bad options are each one line, exit 2."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from clirun import hetrain_here
from hetrain.runtime.resilience.resume import read_sample_log
from node_launch import Node, finish, free_port, job_flags, wait_for
from resilient_reference import assert_samples_of_one_process, one_process
from run_here import hetrain_run_here

SCRIPT = str(Path(__file__).parent / "scripts" / "resilient_train.py")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "machines"
STEPS = 16


def train_args(tmp: Path, *, steps: int = STEPS, pause: float = 0.0) -> list[str]:
    return [SCRIPT, "--steps", str(steps), "--out", str(tmp / "out.pt"), "--ckpt", str(tmp / "ckpt"),
            "--pause", str(pause)]


def params(path: Path):
    return torch.load(path)["params"]


def assert_close(a, b, tol=1e-4):
    """fp32 AdamW over 16 steps: another split sums the batch in another order, and Adam's
    normalisation magnifies those roundings in near-zero gradients (up to 2.4e-5 measured here
    against one process); a wrong weighting of uneven shares is off by ~1e-2."""
    assert max((u - v).abs().max().item() for u, v in zip(a, b)) <= tol


def test_two_nodes_of_mixed_devices_train_as_one_process(tmp_path):
    port = free_port()
    flags = job_flags("2", port)
    b = Node("b", [*flags, "--node-rank", "1", "--node-name", "box-b", "--emulate", "rtx3090,t4",
                   *train_args(tmp_path)], tmp_path / "b.log")
    try:    # node a's launcher in this process (run_here.py): b's waits for its endpoint
        ran = hetrain_run_here(*flags, "--node-rank", "0", "--node-name", "box-a", "--emulate", "a100-80g",
                               *train_args(tmp_path), timeout=240)
    finally:
        code_b = finish([b], 240)[0]
    a = ran.stdout + ran.stderr
    assert [ran.returncode, code_b] == [0, 0], a[-3000:] + b.text()[-3000:]
    assert "job: 3 device(s) on 2 node(s)" in a
    assert "node 0 (box-a): rank 0 a100-80g#0" in a and "node 1 (box-b): rank 1 rtx3090#1" in a and "t4#2" in a
    assert "plan v0: global batch 16 over 3 device(s)" in a
    assert "hosts the rendezvous" in a and "joins it as node rank 1" in b.text()
    assert_close(params(tmp_path / "out.pt"), one_process(STEPS))
    assert_samples_of_one_process(tmp_path / "ckpt", STEPS)


def test_a_lost_node_is_survived_and_a_returning_node_taken_in(tmp_path):
    """3 nodes, elastic 2:3. Node c is lost (launcher and worker killed) after step 4: a and b
    restart, re-plan for 2 devices and resume from the last checkpoint. Then c starts again: every
    node restarts its workers at a saved step boundary, and the job re-plans for 3. The result
    equals one process's, and the sample log holds every sample once per epoch."""
    port = free_port()
    flags = job_flags("2:3", port, restarts=3, last_call=3) + ["--checkpoint-dir", str(tmp_path / "ckpt")]
    hold = tmp_path / "hold"       # while it exists, every rank waits after its step: c's return is not a race
    args = [*train_args(tmp_path, pause=0.3), "--hold", str(hold)]
    made = {name: [*flags, "--node-rank", str(i), "--node-name", name, "--emulate", dev, *args]
            for i, (name, dev) in enumerate((("a", "a100-80g"), ("b", "rtx3090"), ("c", "t4")))}
    nodes = [Node(name, made[name], tmp_path / f"{name}.log") for name in made]
    log = tmp_path / "ckpt" / "samples" / "rank0.jsonl"
    everything = lambda: "".join(n.text() for n in nodes)      # noqa: E731 — rank 0 may move between nodes
    try:
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 4, "step 4", nodes)
        nodes[2].lose()
        wait_for(lambda: "re-planned for 2 devices" in everything(), "the restart on 2 nodes", nodes[:2])
        hold.touch()
        # counted: a node late to the first round was taken in the same way, before c's return
        before = everything().count("a node is waiting to join")
        back = Node("c-again", made["c"], tmp_path / "c2.log")
        nodes.append(back)
        wait_for(lambda: everything().count("a node is waiting to join") > before, "c to ask to join", nodes)
        hold.unlink()
        codes = [n.wait(240) for n in (nodes[0], nodes[1], back)]
    finally:
        for n in nodes:
            n.stop()
    text = everything()
    assert codes == [0, 0, 0], text[-6000:]
    assert "a worker failed or a node was lost: restarting on the nodes present" in text
    assert "a peer left during a collective" in text and "GLHF" not in text     # one line, not gloo's traceback
    assert "a node is waiting to join" in text and "re-planned for 3 devices" in text
    assert "Traceback" not in nodes[0].text().split("re-planned for 2 devices")[-1], text[-4000:]
    assert_close(params(tmp_path / "out.pt"), one_process(STEPS))
    assert_samples_of_one_process(tmp_path / "ckpt", STEPS)
    samples = read_sample_log(str(tmp_path / "ckpt" / "samples"))
    assert sorted(samples) == list(range(STEPS))
    pairs = [pair for s in sorted(samples) for pair in samples[s]]
    assert len(pairs) == STEPS * 16 and max(Counter(pairs).values()) == 1


def one_line(result_code: int, text: str, *words):
    assert result_code == 2, (result_code, text[-3000:])
    assert "Traceback" not in text
    assert sum(line.startswith("hetrain: error") for line in text.splitlines()) == 1, text[-3000:]
    for w in words:
        assert w in text, text[-3000:]


def test_nodes_with_different_torch_builds_are_one_error_naming_the_odd_node(tmp_path):
    port = free_port()
    flags = job_flags("2", port)
    old = str(FIXTURES / "5090_old_torch.json")      # a recorded machine with another torch build
    b = Node("b", [*flags, "--node-rank", "1", "--node-name", "old-box", "--emulate", "rtx3090",
                   *train_args(tmp_path)], tmp_path / "b.log", env={"HETRAIN_MACHINE": old})
    try:    # node a's launcher in this process (run_here.py)
        a = hetrain_run_here(*flags, "--node-rank", "0", "--emulate", "a100-80g", *train_args(tmp_path), timeout=120)
    finally:
        code_b = finish([b], 120)[0]
    one_line(a.returncode, a.stdout + a.stderr, "node 1 'old-box'", "torch")
    assert code_b == 2 and "node 1 'old-box'" in b.text()


# The launcher polls the endpoint before it starts anything (launching/nodes.py check_reachable),
# so these two run `hetrain run` in this process.
def test_an_endpoint_nobody_answers_is_an_error_within_the_timeout(tmp_path):
    port = free_port()
    result = hetrain_here("run", *job_flags("2", port), "--node-rank", "1", "--rdzv-timeout", "2",
                          "--emulate", "rtx3090", *train_args(tmp_path))
    one_line(result.returncode, result.stderr, f"127.0.0.1:{port}", "within 2 s", "start node rank 0")


def test_slurm_variables_become_the_rendezvous(tmp_path, monkeypatch):
    port = free_port()
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "localhost,ghost-node",
           "SLURM_NTASKS_PER_NODE": "1", "HETRAIN_RDZV_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = hetrain_here("run", "--slurm", "--rdzv-timeout", "1", "--emulate", "rtx3090", *train_args(tmp_path))
    one_line(result.returncode, result.stderr, f"localhost:{port}", "could not be reached")
    assert "SLURM_NODEID" in result.stderr          # where each value came from is said


@pytest.mark.parametrize("flags, words", [
    (["--nnodes", "0", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "0"], ["--nnodes '0'", "at least 1"]),
    (["--nnodes", "3:1", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "0"], ["MIN 3 is more than MAX 1"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "2"], ["--node-rank 2 is out of range"]),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "1", "--emulate", "a100-80g,h9000"],
     ["h9000"]),
])
def test_bad_multi_node_options_are_one_line(tmp_path, flags, words):
    """Refused before anything starts, so `hetrain run` is called in this process."""
    result = hetrain_here("run", *flags, *train_args(tmp_path))
    one_line(result.returncode, result.stderr, *words)
