"""The torchrun variables a rank reads: junk is a UsageError naming the variable, raised after the
error hook is installed (one line); the hook itself reads them leniently."""

from __future__ import annotations

import pytest

from hetrain.errors import UsageError
from hetrain.runtime.ranks.dist import env_rank, init_distributed


@pytest.mark.parametrize("env, words", [
    ({"RANK": "junk"}, "RANK='junk'"),
    ({"RANK": "-1"}, "RANK='-1'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    ({"LOCAL_RANK": "1.5"}, "LOCAL_RANK='1.5'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK must be below WORLD_SIZE"),
    ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT"),
])
def test_junk_in_the_environment_is_a_usage_error(monkeypatch, env, words):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as e:
        init_distributed(timeout_s=5, use_cuda=False)
    assert words in e.value.what and e.value.fix


def test_the_hook_reads_the_rank_leniently(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env_rank() == (3, 4)
    monkeypatch.setenv("RANK", "three")
    assert env_rank() == (0, 1)
