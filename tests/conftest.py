"""Fixtures shared by several test modules."""

import pytest

from fedrun import SLOW, run_fedddp


@pytest.fixture(scope="session")
def slow_reference(tmp_path_factory):
    """SLOW run uninterrupted, on one process (any world size gives the bitwise-same model)."""
    out = tmp_path_factory.mktemp("slow_reference")
    run_fedddp(SLOW + [f"run.out_dir={out}"])
    return out
