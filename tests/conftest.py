"""Test-wide settings: profiles measured by the runtime go to a throwaway cache, not ~/.cache."""

import os
import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _profile_cache():
    with tempfile.TemporaryDirectory(prefix="hetrain-test-cache-") as d:
        old = os.environ.get("HETRAIN_CACHE")
        os.environ["HETRAIN_CACHE"] = d      # inherited by every spawned rank and CLI run
        yield
        if old is None:
            os.environ.pop("HETRAIN_CACHE", None)
        else:
            os.environ["HETRAIN_CACHE"] = old


@pytest.fixture(autouse=True, scope="session")
def _bytecode_cached():
    """The suite starts a few hundred Python processes (ranks, launchers, CLI runs), each importing
    hetrain's ~150 modules: with PYTHONDONTWRITEBYTECODE set (some CI images set it) every one of
    them compiled the source again (~0.3 s of CPU each). Processes started by the tests may write
    bytecode under __pycache__ (ignored by git), so the first one compiles and the rest read it."""
    old = os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    yield
    if old is not None:
        os.environ["PYTHONDONTWRITEBYTECODE"] = old


@pytest.fixture(autouse=True, scope="session")
def _recorded_host():
    """Every test sees the same host: an AVX2-only CPU (bf16/fp16 ~40x slower than fp32), recorded.
    So under precision='auto' emulated devices compute in fp32 whatever CPU runs the tests, and no
    result depends on this host's bf16 speed (tests of the measurement itself unset it)."""
    from hetrain.hardware.host import HOST_FACTS_ENV

    path = os.path.join(os.path.dirname(__file__), "fixtures", "hosts", "epyc-zen3-avx2.json")
    old = os.environ.get(HOST_FACTS_ENV)
    os.environ[HOST_FACTS_ENV] = path        # inherited by every spawned rank and CLI run
    yield
    if old is None:
        os.environ.pop(HOST_FACTS_ENV, None)
    else:
        os.environ[HOST_FACTS_ENV] = old


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_over():
    """A test file that joins a default process group in the pytest process (an in-process init(),
    a world of one) and leaves it would make the next file in this worker fail to join its own:
    whatever is left is destroyed when the file ends. torch is not imported for files that never did."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
