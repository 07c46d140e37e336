"""Helpers for the data-moving ops' tests (gather, scatter, broadcast,
all-to-all): per-rank inputs, bit-exact comparison, and a recorder that shows
which MPI calls an op made.

Moving data needs no tolerance: results are compared byte for byte, so
float8, bfloat16 and NaN payloads are checked as exactly as integers.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from helpers import hgroup, fill

#: dtypes torch's gloo backend moves (checked on torch 2.13): hpccomm is compared with it on these.
GLOO_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
               torch.int32, torch.int64, torch.bool, torch.complex64]


def data(shape, dtype, rank: int, k: int = 0) -> torch.Tensor:
    """What group rank ``rank`` contributes (``k`` tells its pieces apart).

    ``helpers.fill`` with a rank-dependent salt, so that even bool tensors
    differ from rank to rank (fill's bool pattern alone does not)."""
    return fill(tuple(shape), dtype, rank, salt=7 * rank + 3 * k)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in logical (row-major) order, as uint8."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "result") -> None:
    """``actual`` has ``expected``'s dtype, shape and bytes."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    a, e = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().reshape(-1)
        raise AssertionError(f"{what}: {bad.numel()} of {a.numel()} bytes differ, first at byte {bad[0].item()}; "
                             f"got {a[:48].tolist()}, expected {e[:48].tolist()}")


def all_bytes(ts) -> torch.Tensor:
    """One uint8 tensor holding the bytes of every tensor in ``ts`` (for same_on_all_ranks)."""
    parts = [as_bytes(t) for t in ts]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class CallLog:
    """Stands in for a group's communicator and records every MPI call made on
    it (name and arguments), so a test can tell which code path an op took."""

    def __init__(self, comm) -> None:
        self._comm = comm
        self.calls = []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr) or not name[:1].isupper():
            return attr

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return attr(*args, **kwargs)

        return call

    def names(self) -> list:
        return [name for name, _, _ in self.calls]

    def clear(self) -> None:
        self.calls.clear()


@contextlib.contextmanager
def count_limit(limit: int, group=None):
    """Lower ``group``'s (default the world's) per-call MPI count limit to
    ``limit`` (as a 2**31-element message would meet it) and record its MPI calls.

    Yields the :class:`CallLog`; every member must enter it together.  (The
    group's ``calls``, the MPI calls its plans hand over, bound once per group,
    are bound to the log meanwhile too; the group's checked calls, whose plans
    are bound to the limit and calls of their first call, are dropped on the
    way in and out.)"""
    from hpccomm._core.group import MPICalls

    g = hgroup(dist.group.WORLD if group is None else group)
    old_limit, old_comm, old_calls = g.max_count, g.comm, g.calls
    log = CallLog(old_comm)
    g.max_count, g.comm, g.calls = limit, log, MPICalls(log, g.p2p)
    g.checked.clear()  # (a checked call's plan is bound to the limit and calls of its first call: Op.bind)
    try:
        yield log
    finally:
        g.max_count, g.comm, g.calls = old_limit, old_comm, old_calls
        g.checked.clear()


class Checks:
    """Collects failed checks while a test communicates and raises them together
    at the end (:meth:`done`), so a rank whose check fails still makes every
    collective the other ranks make: no hang, and the next test starts in step."""

    def __init__(self) -> None:
        self.failures = []

    def same(self, actual: torch.Tensor, expected: torch.Tensor, what: str = "result") -> None:
        """:func:`assert_same`, deferred."""
        try:
            assert_same(actual, expected, what)
        except AssertionError as exc:
            self.failures.append(str(exc))

    def true(self, condition, what: str) -> None:
        if not condition:
            self.failures.append(what)

    def done(self) -> None:
        if self.failures:
            shown = " | ".join(self.failures[:4])
            more = f" (and {len(self.failures) - 4} more)" if len(self.failures) > 4 else ""
            raise AssertionError(f"{len(self.failures)} check(s) failed: {shown}{more}")
