"""At exit, wait until torch's gloo worker threads have let go of their last op.

A gloo group runs each op on one of its worker threads (named
``pt_gloo_runloop``).  When an op completes, the worker drops its own
reference to the op a moment later, and with it the op's tensors.  Since
torch 2.13 (``c10::intrusive_ptr``), dropping a C++ reference to a tensor that
Python also holds takes the GIL.  If the main thread has already begun to
finalize the interpreter, Python 3.11 ends any thread that asks for the GIL
(``PyThread_exit_thread``); the forced unwind runs into a ``noexcept``
destructor and the process aborts: ``terminate called without an active
exception``, exit status 134, after every result was right (torch issue
#190489; seen with plain gloo under torchrun, no hpccomm involved).  gloo joins
its workers only when a group's last reference goes away, which programs that
keep a group in a global, or use DDP, never do before exit.

So, while the interpreter is still fully alive (hpccomm's atexit hook, before
MPI is finalized), the main thread gives up the GIL until every gloo worker
thread of this process is parked on its empty queue, as the kernel reports
it: state ``S`` in an untimed futex wait (a thread waiting for the GIL waits
with a timeout; a thread with work is running or runnable).  Linux only;
elsewhere there is nothing to read and nothing is waited for.
"""
from __future__ import annotations

import os
import sys
import time

#: The name torch gives gloo's worker threads (torch 2.13, 2.14, 2.15).
GLOO_WORKER = "pt_gloo_runloop"
_FUTEX = "202"  # x86_64 and aarch64 differ; see _futex_syscall
_FUTEX_WAIT_BITSET = 9
_TASKS = "/proc/self/task"


def _futex_syscall() -> str:
    """The futex syscall number as /proc prints it, for this machine."""
    import platform

    return {"aarch64": "98", "arm64": "98", "ppc64le": "221", "riscv64": "98"}.get(platform.machine(), _FUTEX)


def parked(stat: str, syscall: str, futex: str = _FUTEX) -> bool:
    """Whether a thread is parked on an empty queue: ``stat`` and ``syscall``
    are the text of its ``/proc/.../task/TID/stat`` and ``syscall`` files.

    Parked means sleeping (state ``S``) in ``futex(FUTEX_WAIT_BITSET)`` with
    no timeout, which is how ``std::condition_variable::wait`` sleeps.
    Waiting for the GIL is a timed wait; running, runnable or any other
    syscall is not parked.

    Example::

        parked("12 (pt_gloo_runloop) S 1 ...", "202 0x55d 0x189 0x0 0x0 0x0 0xffffffff 0x7f 0x7f")  # True
    """
    try:
        state = stat[stat.rindex(")") + 2:].split()[0]
    except (ValueError, IndexError):
        return False
    fields = syscall.split()
    if state != "S" or len(fields) < 5 or fields[0] != futex:
        return False
    try:
        return int(fields[2], 16) & 0x7F == _FUTEX_WAIT_BITSET and int(fields[4], 16) == 0
    except ValueError:
        return False


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread is gone (or /proc is not there)
        return None


def busy_gloo_workers(tasks: str = _TASKS, futex: str | None = None) -> list[str]:
    """Thread ids of this process's gloo worker threads that are not parked."""
    futex = _futex_syscall() if futex is None else futex
    try:
        tids = os.listdir(tasks)
    except OSError:
        return []
    busy = []
    for tid in tids:
        if (_read(f"{tasks}/{tid}/comm") or "").strip() != GLOO_WORKER:
            continue
        stat, syscall = _read(f"{tasks}/{tid}/stat"), _read(f"{tasks}/{tid}/syscall")
        if stat is None or syscall is None:
            continue  # exited meanwhile
        if not parked(stat, syscall, futex):
            busy.append(tid)
    return busy


def wait_for_gloo_workers(limit: float = 10.0, tasks: str = _TASKS, stream=None) -> bool:
    """Give up the GIL until every gloo worker thread is parked (three looks
    in a row, 2 ms apart), at most ``limit`` seconds.  Returns True when they
    all are (or there are none); otherwise says so on ``stream`` (default
    stderr) and returns False: a gloo op still running at exit is one that a
    peer never joined.

    Example::

        wait_for_gloo_workers()   # at exit, before the interpreter finalizes
    """
    deadline = time.monotonic() + limit
    calm = 0
    futex = _futex_syscall()
    while True:
        busy = busy_gloo_workers(tasks, futex)
        calm = 0 if busy else calm + 1
        if calm >= 3:
            return True
        if time.monotonic() >= deadline:
            print(f"hpccomm: at exit, {len(busy)} gloo worker thread(s) still busy after {limit:g} s "
                  f"(thread ids {', '.join(busy)}): a gloo op still running, which a peer never joined? "
                  "Exiting anyway; the process may abort", file=stream or sys.stderr, flush=True)
            return False
        time.sleep(0.002)  # gives the GIL (and the core) to the worker that needs it


def register() -> None:
    """Run :func:`wait_for_gloo_workers` in hpccomm's exit hook, while the
    interpreter is still fully alive (before MPI_Finalize).  Called once MPI
    is up (hpccomm._start.bootstrap); calling it again adds nothing."""
    from .. import _mpi

    if all(fn is not wait_for_gloo_workers for _, fn in _mpi.at_exit):
        _mpi.at_exit.append((3, wait_for_gloo_workers))

