"""A collective's plan run in its blocking form, in the thread that runs it.

The one place that runs a collective blocking, in the calling thread or on
the comm thread (a queued op, hpccomm._core.record): it is numbered and
recorded as running while it communicates (hpccomm._core.state: the watchdog
and the SIGTERM reporter read it), and an MPI error raises naming the op.
The first call of each signature (op and size) on a group is compared across
its ranks first (hpccomm._core.signatures: a mismatch raises on every rank);
debug mode, the tracer and per-op debug logging add their steps around it
(``group.instrumented``: one attribute test when all are off).
"""
from __future__ import annotations

import logging
import time

from .. import _mpi
from ..errors import HpccommError
from . import debug_mode, failures, signatures, state, trace
from .comm_thread import THREAD_NAME
from .plan import AFTER, ARGS, BEFORE, CALL, NBYTES, OUTPUTS, Waited

log = logging.getLogger("hpccomm")


def execute(g, name: str, plan, args, record=None, asynchronous: bool = False, io=None):
    """Run a checked collective's ``plan`` (op ``name`` of group ``g``,
    called with torch's ``args``) blocking, here; its outputs.  ``record``:
    the queued op it runs for (hpccomm._core.record), told its number;
    ``asynchronous``: the call's ``async_op`` (debug mode compares it);
    ``io``: its sizes and dtypes for the flight recorder (hpccomm._core.state.start;
    None: not recorded).

    With ``g.instrumented``: debug mode first compares the op across ranks
    (an exchange numbered as the op, under its own label, and timed as any
    collective); the tracer draws it (a queued op on the comm thread's track,
    whichever thread ran it); debug logging gives its duration."""
    observed = g.instrumented
    try:
        if observed and g.debug:
            seq = state.start(g, name, None, io)  # (in the flight record as the op: a mismatch found is there)
            state.relabel(g, name + " (debug-mode fingerprint check)")
            if record is not None:
                record.running(seq)
            _fingerprints(g, name, args, seq, record, asynchronous)
            state.relabel(g, name)
        else:
            seq = state.start(g, name, None, io)
            if record is not None:
                record.running(seq)
            agreed = g.checks.agreed
            if agreed is not None and plan[NBYTES] not in agreed[name] and plan[CALL].__class__ is not Waited:
                _first_call(g, name, plan, args, seq)  # compared across ranks first (not the nonblocking form)
        if observed:
            tracer, logged = trace.active(), log.isEnabledFor(logging.DEBUG)
            began, t0 = trace.now_ns() if tracer else 0, time.perf_counter()
        try:  # the plan's blocking form (hpccomm._core.plan.run written out: a call frame fewer on every op)
            if plan[BEFORE] is not None:
                plan[BEFORE]()
            plan[CALL](*plan[ARGS])
            if plan[AFTER] is not None:
                plan[AFTER]()
        except _mpi.mpi().Exception as exc:
            raise failures.mpi_error(f"{name} ({g.where(seq)})", exc) from exc
        finally:
            if observed and tracer:
                tracer.record(name, g.name, seq, nbytes(args), began, trace.now_ns(),
                              None if record is None else THREAD_NAME)
        if observed and logged:
            log.debug("%s (%s): %.1f us", name, g.where(seq), (time.perf_counter() - t0) * 1e6)
    finally:
        state.finished(g)
    return plan[OUTPUTS]


def _first_call(g, name: str, plan, args, seq: int) -> None:
    """The first-call signature check of op ``seq`` (hpccomm._core.signatures)."""
    try:
        signatures.check(g, name, plan[NBYTES], args, seq)
    except _mpi.mpi().Exception as exc:
        raise failures.mpi_error(f"{name}{signatures.LABEL} ({g.where(seq)})", exc) from exc


def nbytes(args) -> int:
    """Bytes in the tensors among an op's arguments (for the trace)."""
    total = 0
    for a in args:
        if isinstance(a, (list, tuple)):
            total += nbytes(a)
        elif hasattr(a, "element_size") and hasattr(a, "numel"):
            total += a.numel() * a.element_size()
    return total


def _fingerprints(g, name: str, args, seq: int, record, asynchronous: bool) -> None:
    """Debug mode's cross-rank comparison of collective ``seq`` (hpccomm._core.debug_mode)."""
    try:
        # (compared only where it decides the MPI form: HPCCOMM_ASYNC_NONBLOCKING; torch's own
        # DDP Join passes async_op=True on some ranks and False on others)
        flag = bool(asynchronous) if g.nonblocking else None
        debug_mode.check(g, name, args, seq, asynchronous=flag)
    except _mpi.mpi().Exception as exc:
        raise failures.mpi_error(f"{name} (debug-mode fingerprint check) ({g.where(seq)})", exc) from exc
    except HpccommError:
        raise
    except Exception as exc:  # a message that does not unpickle: a rank died in the exchange?
        if not state.failures.tolerant:
            raise
        failure = failures.damaged(f"{name} (debug-mode fingerprint check) ({g.where(seq)})", exc)
        if failure is None:
            raise
        raise failure from exc

