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
