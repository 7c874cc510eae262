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
])
def test_bad_specs(spec, words):
    with pytest.raises(UsageError, match=words):
        parse_faults(spec)
