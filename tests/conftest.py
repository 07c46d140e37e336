"""Test harness for running the suite under ``mpirun -n N python -m pytest --with-mpi``.

- The hpccomm world group is initialised once per session on first use
  (fixture ``world``), and the shared test groups once (fixture ``groups``).
- tests/run.sh sends ranks other than 0 to tests/logs/ (rank_output.sh), so
  the terminal shows one report; a failure on any rank fails the test on every
  rank (the verdict is gathered), naming the ranks that failed.
"""
from __future__ import annotations

import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The flight records hpccomm writes when a test makes ranks disagree (tests/test_mismatch.py ...) go
# to a folder of the test run's, not to the user's ~/.cache/torch (tests that read them set their own).
os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(tempfile.gettempdir(),
                                                              f"hpccomm-tests-{os.getuid()}", "flight_rank_"))

import helpers  # noqa: E402


def _under_mpi(config) -> bool:
    return bool(config.getoption("--with-mpi", default=False))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    if not _under_mpi(item.config) or item.get_closest_marker("mpi") is None:
        return
    excinfo = outcome.excinfo
    failed = excinfo is not None and not isinstance(excinfo[1], pytest.skip.Exception)
    message = f"{excinfo[0].__name__}: {excinfo[1]}"[:400] if failed else ""
    verdicts = helpers.verdict_comm().allgather((failed, message))
    bad = [(r, m) for r, (f, m) in enumerate(verdicts) if f]
    if bad and not failed:
        first_rank, first_msg = bad[0]
        outcome.force_exception(AssertionError(
            f"failed on rank(s) {[r for r, _ in bad]} (this rank passed); rank {first_rank}: {first_msg}"))


@pytest.fixture(scope="session")
def world():
    """The hpccomm default group, initialised once: ``(rank, size)``."""
    return helpers.init_world()


@pytest.fixture(scope="session")
def groups(world):
    """Test process groups, made once on every rank (see helpers.make_groups)."""
    return helpers.make_groups()
