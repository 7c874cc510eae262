from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.runtime.devices.faults import FaultInjector, parse_faults


def test_parse_and_fire_once_in_its_attempt():
    faults = parse_faults("oom:rank=1,step=3,micro=-1,phase=backward; slow:rank=1,step=2,factor=3;"
                          " die:rank=0,step=4,phase=checkpoint,attempt=1")
    assert [f.kind for f in faults] == ["oom", "slow", "die"]
    one = FaultInjector(faults, rank=1, attempt=0)
    assert one.slowdown(1) == 1.0 and one.slowdown(2) == 3.0
    assert one.oom(3, 0, 2, "backward", escape=0) is None          # micro 0 of 2 is not the last
    assert one.oom(3, 1, 2, "backward", escape=0) is not None      # micro -1 == index 1 of 2
    assert one.oom(3, 1, 2, "backward", escape=0) is None          # fires once
    assert FaultInjector(faults, rank=0, attempt=0).faults[0].attempt == 1


def test_rank_minus_one_means_every_rank():
    (noise,) = parse_faults("noise:rank=-1,step=0,factor=0.1")
    for rank in (0, 3):
        assert FaultInjector((noise,), rank=rank, attempt=0).noise(5) == 0.1


@pytest.mark.parametrize("spec, words", [
    ("zap:rank=0,step=1", "unknown fault kind"),
    ("oom:rank=0", "needs rank= and step="),
    ("oom:rank=a,step=1", "is not a int"),
    ("oom:rank=0,step=1,colour=red", "unknown fault field"),
    ("die:rank=0,step=1,phase=forward", "die takes phase="),
    ("slow:rank=0,step=1,phase=backward", "slow takes no phase"),
    ("slow:rank=0,step=1,factor=1e9", r"factor in \(0.01, 100\]"),       # was: a near-endless sleep
    ("slow:rank=0,step=1,factor=inf", "out of range"),
    ("slow:rank=0,step=1,factor=nan", "out of range"),
    ("slow:rank=0,step=1,factor=0", "out of range"),
    ("noise:rank=0,step=1,factor=1.5", r"factor in \[0, 0.9\]"),
    ("die:rank=5000,step=1", "rank from -1 to 1023"),
    ("die:rank=-2,step=1", "rank from -1 to 1023"),
    ("die:rank=0,step=-1", "step from 0 to"),
    ("oom:rank=0,step=1,escape=7", "escape from 0 to 1"),
    ("die:rank=0,step=1,attempt=99999", "attempt from 0 to 1000"),
    ("slow:rank=0,step=1,factor=50; slow:rank=-1,step=2,factor=50", "multiply to 2500"),
])
def test_bad_specs(spec, words):
    with pytest.raises(UsageError, match=words):
        parse_faults(spec)


def test_bounds_are_inclusive_where_they_say():
    faults = parse_faults("slow:rank=1023,step=0,factor=100; slow:rank=0,step=1000000000,factor=10;"
                          " noise:rank=-1,step=0,factor=0.9; oom:rank=0,step=1,micro=-1024,escape=1")
    assert [f.factor for f in faults[:3]] == [100, 10, 0.9]
