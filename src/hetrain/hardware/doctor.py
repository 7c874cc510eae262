"""`hetrain doctor`: run every check on a Machine and collect findings; the environment fixes
they recommend, for the launcher.

A check that cannot run (no NVML, no GPU, a planned cluster) reports itself `skipped` with the
reason; a check that fails unexpectedly becomes a `skipped` finding naming the exception, so the
doctor itself never crashes on a strange machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from . import checks_hardware, checks_network, checks_software
from .findings import LEVELS, DoctorOptions, EnvFix, Finding, skipped
from .machine import Machine

CHECKS = (checks_software.CHECKS[:2] + checks_hardware.CHECKS + checks_software.CHECKS[2:]
          + checks_network.CHECKS)
__all__ = ["CHECKS", "EnvFix", "counts", "env_fixes", "exit_code", "launch_env_fixes", "run_checks"]
log = logging.getLogger(__name__)


def run_checks(machine: Machine, options: DoctorOptions | None = None) -> list[Finding]:
    options = options or DoctorOptions()
    findings: list[Finding] = []
    for check in CHECKS:
        name = check.__name__.removeprefix("check_").replace("_", "-")
        try:
            findings += check(machine, options)
        except Exception as e:     # a bug or an odd machine must not hide the other checks
            findings.append(skipped(name, f"the check failed: {type(e).__name__}: {e}",
                                    "please report this with `hetrain env` output"))
    return findings


def counts(findings: list[Finding]) -> dict[str, int]:
    return {level: sum(f.level == level for f in findings) for level in LEVELS}


def exit_code(findings: list[Finding]) -> int:
    """1 when any finding is an error, else 0."""
    return 1 if any(f.level == "error" for f in findings) else 0


def env_fixes(findings: list[Finding], environ: Mapping[str, str]) -> list[EnvFix]:
    """The environment the findings recommend, once per variable. A variable already set in
    `environ` is the user's choice (an opt-out such as NCCL_P2P_DISABLE=0) and is kept."""
    out: dict[str, EnvFix] = {}
    for f in findings:
        if f.level not in ("warn", "error"):
            continue
        for var, value in f.env:
            if var in out:
                continue
            if var in environ:
                out[var] = EnvFix(var, environ[var], f"{var}={environ[var]}: kept as you set it "
                                  f"(doctor would set {value}: {f.message})")
            else:
                out[var] = EnvFix(var, value, f"{var}={value}: doctor [{f.check}] {f.message}")
    return list(out.values())


def launch_env_fixes(env: Mapping[str, str] | None = None) -> list[EnvFix]:
    """The doctor's environment fixes for a job about to start on this machine's GPUs.

    `env`: the environment the job will run with (default: this process's). The machine is
    queried in a short-lived child process, so the launcher holds no CUDA context afterwards.
    Never raises: if the query fails the launch goes ahead without fixes (logged).
    """
    from . import driver, machine

    environ = dict(os.environ if env is None else env)
    try:
        facts = driver.query_machine_in_subprocess(environ=environ)
    except Exception as e:
        log.warning("hetrain: machine checks skipped before launch (%s: %s)", type(e).__name__, e)
        return []
    return env_fixes(run_checks(machine.from_facts(facts)), environ)
