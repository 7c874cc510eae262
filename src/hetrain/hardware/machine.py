"""A `Machine`: the machine description plus the Device and Link records built from it.

Three ways to get one: this machine (`live`), a recorded description (`recorded`, what tests and
`--machine FILE` use), or a planned cluster from a spec (`planned`: catalog facts only,
no driver asked, so the checks that need drivers report themselves skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import driver
from .cluster import parse_cluster
from .devices import Device, devices_from_facts
from .topology import Link, links


@dataclass(frozen=True, kw_only=True)
class Machine:
    facts: dict
    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    planned: bool = False                # from a cluster spec: no drivers were asked

    @property
    def gpus(self) -> tuple[Device, ...]:
        """The GPUs a job can use (visible to torch, or named by the cluster spec)."""
        return tuple(d for d in self.devices if d.is_gpu and d.visible)

    @property
    def all_gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.is_gpu)

    @property
    def env(self) -> dict[str, str]:
        return self.facts.get("env", {})

    @property
    def source(self) -> str:
        return self.facts.get("source", "live")


def from_facts(facts: dict) -> Machine:
    devices = devices_from_facts(facts)
    return Machine(facts=facts, devices=devices, links=links(devices, facts))


def live(*, measure: bool = False) -> Machine:
    return from_facts(driver.query_machine(measure=measure))


def recorded(path: str) -> Machine:
    return from_facts(driver.load_machine(path))


def planned(spec: str) -> Machine:
    """A cluster spec ('a100-80g,rtx3090') as a machine: catalog facts only."""
    devices = tuple(d.to_device() for d in parse_cluster(spec))
    facts = {"schema": driver.SCHEMA, "source": f"planned cluster {spec!r} (catalog facts, no drivers)",
             "host": {}, "versions": {}, "torch": {}, "nvml": {"ok": False, "error": "planned cluster"},
             "gpus": [], "pairs": [], "env": driver.relevant_env()}
    return Machine(facts=facts, devices=devices, links=(), planned=True)
