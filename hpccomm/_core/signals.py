"""A rank ended by the launcher says why, in one line.

When one rank dies (killed, crashed, aborted), the launcher (Open MPI's
prterun, srun with ``--kill-on-bad-exit``) ends the others with SIGTERM.
Without help they vanish silently, mid-collective.  hpccomm installs a
SIGTERM handler at init (only if the user has none) and a wakeup pipe, so
that a small ``hpccomm-signals`` thread hears the signal even while the main
thread sits inside a blocking MPI call with the GIL released (a Python-level
handler would only run after that call returns, which it never does).  The
thread prints one line and exits the process with status 143 (128 + SIGTERM):

    hpccomm: rank 0 of 3 ended by SIGTERM (the launcher ends the job) while in
    all_reduce (op #2 on group 'WORLD', for 0.3 s); rank 2 (pid 4242 on node1)
    is dead

Which rank failed (:mod:`hpccomm._core.state`) is known three ways: a rank that raised or timed out
records itself in the world group's key-value store before aborting; ranks
on this node are checked by pid (``/proc``); a rank on another node that was
killed outright cannot say, and the line says so (the launcher's own message
names it).  ``HPCCOMM_SIGNAL_REPORT=0`` leaves SIGTERM alone.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from .. import _mpi, config
from . import flight, state
from .watchdog import current

_installed = False
_lock = threading.Lock()
_reported = False


def install(comm, store) -> None:
    """Called once on every rank when the world group is made (collective:
    the ranks exchange host names and pids)."""
    global _installed
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        state.set_world(rank, size, store, [(socket.gethostname(), os.getpid())])
        return
    # collective, so before any per-rank decision (settings may differ between ranks)
    state.set_world(rank, size, store, comm.allgather((socket.gethostname(), os.getpid())))
    if all(hook is not _program_ends for _, hook in _mpi.at_exit):
        _mpi.at_exit.append((_AT_EXIT_ORDER, _program_ends))
    if _installed or not config.get("HPCCOMM_SIGNAL_REPORT"):
        return
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return  # the user's own handler stays in charge
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_fd)
        os.close(write_fd)
        return
    if previous != -1:  # someone (asyncio) owns the wakeup fd: keep theirs, use the handler alone
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
    else:
        threading.Thread(target=_listen, args=(read_fd,), name="hpccomm-signals", daemon=True).start()
    signal.signal(signal.SIGTERM, _handler)
    _installed = True


_AT_EXIT_ORDER = 0.5  # once the ops still queued have run (hpccomm._mpi.at_exit)


def _program_ends() -> None:
    """At exit: this rank's program ended; a rank still waiting for it in an
    op will say so when the op times out (hpccomm._core.state.record_leaving)."""
    state.record_leaving("ended its program" + ("" if state.has_left() else f" ({state.last_op_text()})"))


def _handler(signum, frame) -> None:
    """The Python-level handler: runs on the main thread when it gets the
    chance (it was outside MPI, or no wakeup pipe could be used)."""
    _report_and_exit()


def _listen(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is _handler:
            _report_and_exit()


def _report_and_exit() -> None:
    global _reported
    with _lock:
        if _reported:
            return
        _reported = True
        try:
            flight.dump_quietly("ended by SIGTERM (the launcher ends the job)")  # (the store may be gone)
            print(report_line(), file=sys.__stderr__, flush=True)
            # The launcher drops output that arrives after it sees the process exit: give it
            # a moment to read the line (it sends SIGKILL later if it will not wait).
            time.sleep(0.5)
        finally:
            os._exit(128 + signal.SIGTERM)


def report_line() -> str:
    running = current()
    start = None if running is None else running.start
    if start is not None:
        label = "p2p op" if running.kind == "p2p" else "op"
        where = (f"while in {running.name} ({label} #{running.seq} on group '{running.group.name}', "
                 f"for {time.monotonic() - start:.1f} s)")
    else:  # (or it completed as it was read)
        where = "outside any hpccomm op"
    with quiet_stderr():  # the store may be gone with rank 0: torch's C++ warning and stack add nothing
        who = state.who_failed()
    return (f"hpccomm: rank {state.world.rank} of {state.world.size} ended by SIGTERM (the launcher ends the "
            f"job) {where}; {who}")


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 goes to /dev/null meanwhile.  For a store call made
    while the job ends: when rank 0 (the store's host) is gone, torch's
    TCPStore prints a warning with a 25-frame C++ stack trace
    (``recvValue failed ... frame #0 ...``) straight to the descriptor, which
    would bury the lines that say what happened; the call's own exception
    still says it (``the key-value store on rank 0 does not answer``)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
