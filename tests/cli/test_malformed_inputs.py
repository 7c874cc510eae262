"""A sweep of malformed input across the `hetrain` command and the files it reads: every bad
input is one `hetrain: error:` line (plus at most a `  fix:` line), exit 2, no traceback, and
nothing written or deleted outside the job's own directories.

The command runs in this process (`hetrain.cli.main`) for speed, with the launcher replaced by a
guard: bad input must be caught before any process is started or anything is measured. The
errors a training script meets inside `hetrain.init()` need real workers: a few subprocesses at
the end.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from clirun import hetrain
from hetrain.cli import main
from hetrain.errors import UsageError
from hetrain.planning.memory import STATE_VALUES
from hetrain.planning.plan import DevicePlan, Plan
from hetrain.runtime.devices.faults import parse_faults
from hetrain.runtime.measure import profiler

ROOT = Path(tempfile.mkdtemp(prefix="hetrain-malformed-"))    # cwd, cache and temp dir of every case
atexit.register(shutil.rmtree, ROOT, ignore_errors=True)
SCRIPT = ROOT / "train.py"
SCRIPT.write_text("raise SystemExit('a malformed input was not caught before launching')\n")
(ROOT / "nomake.py").write_text("x = 1\n")
(ROOT / "a-dir").mkdir()
(ROOT / "junk.json").write_text("{not json")
(ROOT / "list.json").write_text("[1, 2]")
SWEEP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tree() -> dict[str, tuple[int, int]]:
    out = {}
    for path in ROOT.rglob("*"):
        st_ = path.lstat()
        out[str(path.relative_to(ROOT))] = (st_.st_size, st_.st_mtime_ns)
    return out


def _no_launch(*_args, **_kwargs):
    raise AssertionError("bad input reached the launcher: it must be caught before any process starts")


def run_cli(argv: list[str], env: dict | None = None) -> tuple[int, list[str], str]:
    """`hetrain ARGV` in this process, in ROOT (also HETRAIN_CACHE and the temp dir): the exit code,
    stderr's lines, stdout. Asserts that nothing under ROOT changed."""
    import hetrain.cli.train as train_cli
    import hetrain.launch as launch

    env = {"HETRAIN_CACHE": str(ROOT / "cache"), **(env or {})}
    saved = (os.getcwd(), {k: os.environ.get(k) for k in env}, tempfile.tempdir,
             train_cli.run_launch, launch.run_launch)
    before = _tree()
    err, out = io.StringIO(), io.StringIO()
    code = None
    try:
        os.chdir(ROOT)
        os.environ.update(env)
        tempfile.tempdir = str(ROOT)
        train_cli.run_launch = launch.run_launch = _no_launch
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(saved[0])
        for name, value in saved[1].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir, train_cli.run_launch, launch.run_launch = saved[2], saved[3], saved[4]
    assert _tree() == before, f"hetrain {argv} changed files under {ROOT}"
    return code, err.getvalue().splitlines(), out.getvalue()


def assert_one_error(argv: list[str], code: int = 2, env: dict | None = None) -> str:
    got, lines, _ = run_cli(argv, env)
    text = "\n".join(lines)
    assert "Traceback" not in text, f"hetrain {argv}:\n{text}"
    assert got == code, f"hetrain {argv} exited {got}:\n{text}"
    assert len(lines) in (1, 2) and lines[0].startswith("hetrain: error: "), f"hetrain {argv}:\n{text}"
    assert len(lines) == 1 or lines[1].startswith("  fix: "), f"hetrain {argv}:\n{text}"
    return lines[0]


BENCH_FACTORY = Path(__file__).parent / "scripts" / "bench_factory.py"


# -- what malformed input looks like ----------------------------------------------------------
GPUS = ("a100-80g", "rtx3090", "t4", "h100-sxm", "3090")
junk_text = st.text(alphabet=string.ascii_letters + string.digits + " :@,;=x*.-_/%é\t", min_size=0, max_size=24)
bad_speed = st.one_of(st.sampled_from(["0", "-1", "nan", "inf", "-inf", "fast", "", "1e-400", "0.01", "100.5",
                                       "1e9", "1,5"]),
                      st.floats(max_value=0.01).map(repr),
                      st.floats(min_value=100.001, allow_infinity=True).map(repr))
bad_memory = st.one_of(st.sampled_from(["0", "0GiB", "2zz", "1", "1023", "-5GiB", "", "2PiB", "1e30TiB", "lots"]),
                       st.integers(-10**6, 1023).map(str))
bad_count = st.one_of(st.sampled_from(["0", "1025", "1000000000", "9" * 50, "00"]),
                      st.integers(1025, 10**30).map(str))
unknown_gpu = st.text(alphabet="qwzjv", min_size=1, max_size=8).map(lambda s: "zz" + s)


@st.composite
def bad_cluster(draw) -> str:
    """A cluster spec with at least one bad item, mixed with good ones."""
    good = draw(st.lists(st.sampled_from(GPUS), max_size=2))
    gpu = draw(st.sampled_from(GPUS))
    bad = draw(st.one_of(
        bad_speed.map(lambda s: f"{gpu}:{s}"),
        bad_memory.map(lambda m: f"{gpu}@{m}"),
        bad_count.map(lambda c: f"{c}x{gpu}"),
        unknown_gpu,
        st.sampled_from(["", " ", ",", f"{gpu},,{gpu}", f"{gpu},", f"{gpu}:1:2", f"{gpu}@1GiB@2GiB", "x", ":1",
                         "@1GiB", "1000x" + gpu + ",30x" + gpu]),
    ))
    items = good + [bad]
    draw(st.randoms()).shuffle(items)
    return ",".join(items)


bad_int = st.one_of(st.integers(max_value=0).map(str), st.sampled_from(["abc", "1.5", "", "1e3", "--", "0x10"]))
bad_fraction = st.one_of(st.sampled_from(["nan", "inf", "-0.1", "1", "1.5", "x"]),
                         st.floats(min_value=1, allow_nan=False).map(repr))
bad_positive = st.one_of(st.sampled_from(["0", "-1", "nan", "-inf", "x"]), st.floats(max_value=0).map(repr))
VALID_CHOICES = {"auto", "fp32", "bf16", "fp16", "plan", "all", "none", "spec", "peak", *STATE_VALUES}
bad_choice = st.one_of(junk_text.filter(lambda s: s not in VALID_CHOICES and not s.startswith("-")),
                       st.sampled_from(["FP32 ", "bf-16", "float32"]))
bad_out = st.sampled_from(["a-dir", "no-such-dir/plan.json", "train.py/x.json", str(ROOT / "missing" / "p.json")])
bad_number = st.one_of(st.sampled_from(["0", "-1", "nan", "inf", "1e", "lots", "", "1.5"]),
                       st.floats(max_value=0).map(repr))


# --faults for `run --emulate a100-80g` (one device): junk, no fault at all, or a rank it does not have.
bad_faults = st.sampled_from(["", ";", " ; ", "boom:rank=0,step=1", "die:step=1", "oom:rank=0,step=x",
                              "die:rank=0,step=1,phase=forward", "oom:rank=1,step=1", "die:rank=-2,step=1",
                              "die:rank=0,step=1;stall:rank=3,step=2"])


def _flag(name: str, values) -> st.SearchStrategy[list[str]]:
    return values.map(lambda v: [name, v])


# Each command's base (valid on its own, or needing the flag to be complete) and its bad flags.
COMMANDS = {
    "demo": ([], [_flag("--steps", bad_int), _flag("--global-batch", bad_int), _flag("--precision", bad_choice),
                  _flag("--emulate", bad_cluster()), _flag("--json", bad_out)]),
    "run": (["--emulate", "a100-80g"], [_flag("--emulate", bad_cluster()), _flag("--nproc", bad_int),
                                        _flag("--max-restarts", st.sampled_from(["-1", "-5", "x"])),
                                        _flag("--precision", bad_choice), _flag("--nproc", st.just("3")),
                                        _flag("--run-dir", st.sampled_from(["train.py", "junk.json/sub"])),
                                        _flag("--faults", bad_faults)]),
    "simulate": (["--cluster", "a100-80g,rtx3090", "--model", "gpt2-124m"],
                 [_flag("--cluster", bad_cluster()), _flag("--model", unknown_gpu),
                  _flag("--global-batch", bad_int), _flag("--precision", bad_choice),
                  _flag("--efficiency", st.one_of(bad_positive, st.sampled_from(["1.01", "2", "inf"]))),
                  _flag("--ratios", bad_choice), _flag("--optimizer", bad_choice),
                  _flag("--link-gbs", bad_positive), _flag("--memory-margin", bad_fraction),
                  st.builds(lambda p: ["--model", "", "--params", p, "--flops-per-sample", "1e9",
                                       "--activation-bytes", "1MiB"], bad_number)]),
    "plan": (["--model", "gpt2-124m", "--emulate", "a100-80g,rtx3090", "--global-batch", "8"],
             [_flag("--emulate", bad_cluster()), _flag("--global-batch", bad_int), _flag("--precision", bad_choice),
              _flag("--micro-batch", bad_int), _flag("--memory-margin", bad_fraction),
              _flag("--checkpointing", bad_choice), _flag("--link-gbs", bad_positive), _flag("--blocks", bad_int),
              _flag("--out", bad_out), _flag("--model", unknown_gpu),
              _flag("--measurements", st.just("m.json")),
              st.builds(lambda f: ["--model", "", "--model-factory", f],
                        st.sampled_from(["nofunc", ":make", "x.py:", "missing.py:make", ".rel:make", "a b:make",
                                         "nonexistent_hetrain_module:make", "nomake.py:make", "a-dir:make"]))]),
    "bench": (["--model-factory", f"{BENCH_FACTORY}:make", "--emulate", "a100-80g,rtx3090"],
              [_flag("--steps", bad_int), _flag("--warmup", st.sampled_from(["-1", "-5", "x"])),
               _flag("--global-batch", bad_int), _flag("--precision", bad_choice), _flag("--emulate", bad_cluster()),
               _flag("--json", bad_out), _flag("--png", bad_out),
               _flag("--model-factory", st.sampled_from(["nofunc", "missing.py:make", f"{BENCH_FACTORY}:nomake"]))]),
    "doctor": (["--cluster", "a100-80g"], [_flag("--psu-watts", bad_positive), _flag("--precision", bad_choice),
                                           _flag("--cluster", bad_cluster()),
                                           _flag("--machine", st.sampled_from(["junk.json", "list.json", "nope.json",
                                                                               "a-dir"])),
                                           st.just(["--measure"])]),
    "env": (["--cluster", "a100-80g"], [_flag("--cluster", bad_cluster()),
                                        _flag("--machine", st.sampled_from(["junk.json", "list.json", "nope.json"]))]),
}


@st.composite
def bad_command(draw) -> list[str]:
    name = draw(st.sampled_from(sorted(COMMANDS)))
    base, flags = COMMANDS[name]
    bad = draw(st.one_of(*flags))
    if name == "run":
        return [name, *base, *bad, "train.py"]
    if name == "plan" and bad[:2] == ["--model", ""]:     # --model-factory instead of the preset
        return [name, "--emulate", "a100-80g", "--global-batch", "8", *bad[2:]]
    if name == "simulate" and bad[:2] == ["--model", ""]:
        return [name, "--cluster", "a100-80g", *bad[2:]]
    return [name, *base, *bad]


@settings(SWEEP, max_examples=300)
@given(argv=bad_command())
def test_every_command_answers_bad_flags_with_one_line_and_exit_2(argv):
    assert_one_error(argv)


@pytest.mark.parametrize("argv", [
    ["nosuchcommand"], ["simulate", "--bogus"], ["simulate", "--cluster"], ["run"], ["demo", "--steps", "abc"],
    ["simulate", "--cluster", "a100-80g"], ["plan", "--model", "gpt2-124m", "--emulate", "a100-80g"],
    ["doctor", "--machine", "junk.json", "--cluster", "a100-80g"], ["run", "missing.py"],
    ["run", "--nproc", "0", "train.py"], ["run", "-m", "no_such_hetrain_module"], ["run", "-m", ".rel"],
    ["run", "-m", "no_such_hetrain_pkg.sub"], ["run", "-m", ""], ["run", "--faults", "die:rank=0,step=1", "train.py"], ["plan", "--global-batch", "8", "--model-factory", "x.py:make",
                                            "--model", "gpt2-124m"],
])
def test_parse_errors_and_missing_inputs_are_one_line_too(argv):
    assert_one_error(argv)


@pytest.mark.parametrize("argv", [["doctor", "--cluster", "a100-80g"], ["env", "--cluster", "a100-80g"]])
def test_a_junk_rank_is_one_line(argv):
    assert "RANK='x1'" in assert_one_error(argv, env={"RANK": "x1"})


def test_the_malformed_inputs_the_new_user_reported():
    assert "--steps -5" in assert_one_error(["demo", "--steps", "-5"])
    assert "--global-batch 0" in assert_one_error(["demo", "--global-batch", "0"])
    assert "from 1 to 1024" in assert_one_error(["run", "--emulate", "1000000000xa100-80g", "train.py"])
    assert "/nonexistent-dir" in assert_one_error(["demo", "--json", "/nonexistent-dir/x.json"])
    assert "/nonexistent-dir" in assert_one_error(["plan", "--out", "/nonexistent-dir/plan.json", "--model",
                                                   "gpt2-124m", "--emulate", "a100-80g", "--global-batch", "8"])


# -- the files hetrain reads -------------------------------------------------------------------
@SWEEP
@example(spec="noise:rank=0,step=0")      # found by the sweep: without factor=, noise got slow's default 2.0
@given(spec=st.one_of(
    junk_text,
    st.builds(lambda kind, fields: f"{kind}:{fields}",
              st.sampled_from(["slow", "noise", "oom", "die", "stall", "boom", ""]),
              st.lists(st.builds(lambda k, v: f"{k}={v}",
                                 st.sampled_from(["rank", "step", "micro", "factor", "attempt", "phase", "escape",
                                                  "speed"]),
                                 st.one_of(st.integers(-10**12, 10**12).map(str),
                                           st.sampled_from(["nan", "inf", "1e300", "-1", "x", "", "forward",
                                                            "0.001", "1e-9", "1000"]))),
                       max_size=5).map(",".join))))
def test_fault_specs_are_parsed_or_refused_with_a_usage_error(spec):
    try:
        faults = parse_faults(spec)
    except UsageError as e:
        assert e.what and e.fix
        return
    for f in faults:         # what is accepted is bounded: no endless sleep, no overflow
        assert -1 <= f.rank <= 1023 and 0 <= f.step <= 10**9
        assert 0.01 < f.factor <= 100 if f.kind == "slow" else True
        assert 0 <= f.factor <= 0.9 if f.kind == "noise" else True


def _plan_dict() -> dict:
    plan = Plan(global_batch=8, devices=(DevicePlan(rank=0, device="a", speed=1.0, share=5, micro_batch=5),
                                         DevicePlan(rank=1, device="b", speed=0.6, share=3, micro_batch=3)))
    return json.loads(plan.to_json())


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3),
                           max_leaves=8)


@st.composite
def broken_plan(draw) -> str:
    """A plan file that is not a plan: any JSON value, or a real plan with one field broken."""
    if draw(st.booleans()):
        return json.dumps(draw(json_values))
    data = _plan_dict()
    where = draw(st.sampled_from(["top", "device", "excluded"]))
    target = data if where == "top" else data["devices"][draw(st.integers(0, 1))] if where == "device" else None
    if target is None:
        data["excluded"] = draw(st.one_of(st.just("x"), st.lists(json_values, min_size=1, max_size=2)))
    else:
        key = draw(st.sampled_from(sorted(target) + ["bogus"]))
        bad = draw(json_values.filter(lambda v: type(v) is not type(target.get(key))))
        if key in ("share", "micro_batch", "global_batch") and draw(st.booleans()):
            bad = float(target[key]) + 0.5 if draw(st.booleans()) else float(target[key])    # float shares
        target[key] = bad
    return json.dumps(data)


@SWEEP
@given(text=st.one_of(broken_plan(), st.sampled_from(['"hello"', "null", "[]", "{", "", "[" * 5000, "1e999"])))
def test_plan_files_that_are_not_plans_are_a_value_error(text):
    """A ValueError (init(plan=...) makes it one UsageError line), never an AttributeError or a
    TypeError, and never a plan with a float share."""
    try:
        plan = Plan.from_json(text)
    except ValueError:
        return
    assert all(isinstance(d.share, int) and isinstance(d.micro_batch, int) for d in plan.devices)


@SWEEP
@given(text=st.one_of(json_values.map(json.dumps), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                      st.just("[" * 5000)))
def test_a_corrupt_profile_cache_is_measured_again_with_a_note(text):
    path = ROOT / "cache-case.json"
    path.write_text(text)
    try:
        profile, note = profiler.read_cache(path, "cpu X x1 threads")
    finally:
        path.unlink()
    assert profile is None and "measured again" in note


def test_a_profile_cache_from_another_host_is_measured_again():
    from hetrain.planning.profile import DeviceProfile

    path = ROOT / "other-host.json"
    theirs = DeviceProfile(device="cpu Other CPU x1 threads", source="measured on cpu Other CPU x1 threads",
                           overhead_s=0.001, per_sample_s=0.001, fixed_bytes=10, activation_bytes_per_sample=1)
    path.write_text(theirs.to_json())
    try:
        assert profiler.read_cache(path, "cpu Other CPU x1 threads") == (theirs, None)
        profile, note = profiler.read_cache(path, "cpu This CPU x1 threads")
    finally:
        path.unlink()
    assert profile is None and "Other CPU" in note and "measured again" in note
    assert profiler.read_cache(ROOT / "absent.json", "k") == (None, None)


# -- inside the workers: hetrain.init() in a script ----------------------------------------------
SCRIPT_CASES = {
    "negative global batch": ("import hetrain.emulation\n"
                              "hetrain.init(global_batch=-1, emulation=hetrain.emulation.Emulation(cluster='a100-80g,rtx3090'))",
                              "global_batch=-1"),
    "unknown keyword": ("hetrain.init(global_batch=8, bogus_keyword=1)", "'bogus_keyword'"),
    "checkpoint_dir in init": ("hetrain.init(global_batch=8, checkpoint_dir='ck')",
                               "checkpoint_dir= is not a keyword of hetrain.Config; it is checkpoints=Checkpoints(dir=...)"),
    "checkpoint_every": ("hetrain.init(global_batch=8, checkpoints=hetrain.Checkpoints(every=-3))",
                         "Checkpoints(every=-3"),
    "junk rank": ("hetrain.init(global_batch=8)", "RANK='junk'"),
    "plan file": ("hetrain.init(global_batch=8, plan='hello.json')", "hello.json"),
    "impossible stages": ("ht = hetrain.init(global_batch=8)\nhetrain.Pipeline(stages=0)",
                          "Pipeline(stages=0): a pipeline needs 2 or more stages"),
    "stages beyond the job": ("import torch\nht = hetrain.init(global_batch=8)\nm = torch.nn.Sequential("
                              "torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))\nht.prepare(m, torch.optim.SGD("
                              "m.parameters(), lr=0.1), torch.utils.data.TensorDataset(torch.randn(16, 2), "
                              "torch.randn(16, 2)), parallel=hetrain.Pipeline(stages=4), loss_fn=torch.nn.functional"
                              ".mse_loss)", "4 stages need 4 devices, this job has 2"),
    "stages beyond the blocks": ("import torch\nht = hetrain.init(global_batch=8)\nm = torch.nn.Sequential("
                                 "torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))\nht.prepare(m, torch.optim.SGD("
                                 "m.parameters(), lr=0.1), torch.utils.data.TensorDataset(torch.randn(16, 2), "
                                 "torch.randn(16, 2)), parallel=hetrain.Pipeline(stages=99), "
                                 "loss_fn=torch.nn.functional.mse_loss)", "99 stages need 99 devices, this job has 2"),
    "bogus sharding": ("import torch\nht = hetrain.init(global_batch=8)\nm = torch.nn.Linear(2, 2)\n"
                       "ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), [], "
                       "parallel=hetrain.DataParallel(sharding='bogus'))",
                       "DataParallel(sharding='bogus') is not a sharding"),
    "sharding in Config": ("hetrain.Config(global_batch=8, sharding='fsdp')",
                           "it is DataParallel(sharding=...) in prepare(parallel=...)"),
    "plan for another layout": ("import torch\nht = hetrain.init(global_batch=8, plan='dp.json')\n"
                                "m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))\n"
                                "ht.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), "
                                "torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randn(16, 2)), "
                                "parallel=hetrain.Pipeline(), loss_fn=torch.nn.functional.mse_loss)",
                                "the plan is for DataParallel() but prepare(parallel=Pipeline(stages=None"),
}


# Cases whose job has the two emulated devices (the rest: one process on this host's CPU)
TWO_DEVICES = ("negative global batch", "impossible stages", "stages beyond the job", "stages beyond the blocks",
               "plan for another layout")
LAUNCHED = ("checkpoint_dir in init", "stages beyond the job")      # one job of each size, raised in init / prepare


def case_files(tmp: Path, case: str) -> None:
    call, _ = SCRIPT_CASES[case]
    (tmp / "hello.json").write_text('"hello"')
    (tmp / "dp.json").write_text(Plan(global_batch=8, devices=tuple(     # a data-parallel plan, 2 devices
        DevicePlan(rank=r, device=f"d{r}", speed=1.0, share=4, micro_batch=4) for r in range(2))).to_json())
    (tmp / "s.py").write_text(f"import hetrain\n{call}\n")


@pytest.mark.parametrize("case", LAUNCHED)
def test_init_errors_under_hetrain_run_are_one_line_from_the_launcher(tmp_path, case):
    case_files(tmp_path, case)
    emulate = ["--emulate", "a100-80g,rtx3090"] if case in TWO_DEVICES else []
    r = hetrain("run", *emulate, "s.py", cwd=str(tmp_path), env={"HETRAIN_CACHE": str(tmp_path / "cache")})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hetrain: error")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and SCRIPT_CASES[case][1] in " ".join(r.stderr.splitlines()), r.stderr


def test_every_init_error_is_one_agreed_usage_error_in_the_jobs_ranks(tmp_path):
    """Each case's script in the ranks of a job of its size (tests/harness.py's forked ranks, not a
    launch each; the cases of one size one after another in one group: init_cases.py): every rank
    raises a UsageError, the same on each (agreed: printed once), one line and its fix, saying the
    case's words. What `hetrain run` and plain python make of a UsageError raised there, one line
    and exit 2, the launched tests here check."""
    from harness import run_ranks
    from init_cases import raise_cases

    cases = {}
    for case in SCRIPT_CASES:
        if case == "junk rank":      # the rank's own environment: the plain-python test below
            continue
        tmp = tmp_path / case.replace(" ", "-")
        tmp.mkdir()
        case_files(tmp, case)
        code = (tmp / "s.py").read_text()
        if case in TWO_DEVICES and "Emulation(" not in code:      # as `hetrain run --emulate` gives it
            code = code.replace("hetrain.init(global_batch=8",
                                "hetrain.init(global_batch=8, emulation=hetrain.emulation.Emulation("
                                "cluster='a100-80g,rtx3090')")
            code = "import hetrain.emulation\n" + code
        cases[case] = (code, str(tmp), {"HETRAIN_CACHE": str(tmp / "cache")})
    got = {}
    for world in (1, 2):
        names = [case for case in cases if (case in TWO_DEVICES) == (world == 2)]
        ranks = run_ranks(raise_cases, world, [cases[case] for case in names])
        got.update({case: [answers[i] for answers in ranks] for i, case in enumerate(names)})
    assert set(got) == set(cases)
    for case, answers in got.items():
        assert len(set(answers)) == 1, (case, answers)                       # agreed
        kind, what, fix = answers[0] if answers[0] else (None, "", None)
        assert kind == "UsageError" and fix, (case, answers[0])
        assert "\n" not in what and "\n" not in fix, (case, answers[0])
        words = SCRIPT_CASES[case][1]
        assert words in what or words in fix, (case, words, answers[0])


@pytest.mark.parametrize("case, env", [("checkpoint_every", {}), ("junk rank", {"RANK": "junk"})])
def test_init_errors_under_plain_python_are_one_line(tmp_path, case, env):
    """Plain `python script.py` (a group of one): the same one line; a junk RANK is one too."""
    import subprocess
    import sys

    from clirun import SRC

    call, words = SCRIPT_CASES[case]
    (tmp_path / "s.py").write_text(f"import hetrain\n{call}\n")
    r = subprocess.run([sys.executable, "s.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(SRC), "HETRAIN_CACHE": str(tmp_path / "c"), **env})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hetrain: error")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and words in errors[0], r.stderr
