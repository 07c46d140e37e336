"""What the GPU routes say once per process.

A route, a staging warning or a rewrite for NCCL is logged the first time
it is taken in the process (hpccomm._gpu.agreement, hpccomm._gpu.dispatch),
not at every op: :func:`first` answers whether a line is new.  Tests that
read those lines start from a process that said nothing (:func:`forget`, a
supported hook).
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_said: set = set()  # the keys of the lines said in this process


def first(key) -> bool:
    """Whether the line of ``key`` (any hashable) is said for the first time
    in this process: True once per key, False afterwards.

    Example::

        if once.first(("staged",)):
            log.warning("hpccomm: CUDA collectives are staged ...")
    """
    if key in _said:
        return False
    with _lock:
        if key in _said:
            return False
        _said.add(key)
        return True


def forget() -> None:
    """Forget every line said, so each is said again when next taken (a
    supported test hook: a test that reads the log starts from a process that
    said nothing)."""
    with _lock:
        _said.clear()
