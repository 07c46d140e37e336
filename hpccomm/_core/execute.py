"""A collective's plan run in its blocking form, in the thread that runs it.

The one place that runs a collective blocking, in the calling thread or on
the comm thread (a queued op, hpccomm._core.record): it is numbered and
recorded as running while it communicates, in its group's own in-flight
record (hpccomm._core.state.InFlight: the watchdog and the SIGTERM reporter
read it), and an MPI error raises naming the op.
Every call (or the first of each signature, ``HPCCOMM_MISMATCH_CHECK``) is
compared across the group's ranks first (hpccomm._core.signatures: a
mismatch raises on every rank); debug mode, the tracer and per-op debug
logging add their steps around it (``group.instrumented``: one attribute
test when all are off).
"""
from __future__ import annotations

import logging
import time

from .. import _mpi
from ..errors import HpccommError
from . import debug_mode, failures, signatures, state, trace
from .comm_thread import THREAD_NAME
from .plan import ARGS, CALL, NBYTES, OUTPUTS, Waited
from .plan import run as run_plan

log = logging.getLogger("hpccomm")


def execute(g, op, call, plan, record=None, asynchronous: bool = False, io=None):
    """Run checked ``call``'s ``plan`` (a call of ``op``, a declaration of
    hpccomm._ops.op, on group ``g``) blocking, here; its outputs.  ``record``:
    the queued op it runs for (hpccomm._core.record), told its number;
    ``asynchronous``: the call's ``async_op`` (debug mode compares it);
    ``io``: its sizes and dtypes for the flight recorder
    (hpccomm._core.state.start; None: not recorded).

    With ``g.instrumented``: debug mode first compares the op across ranks
    (an exchange numbered as the op, under its own label, and timed as any
    collective); the tracer draws it (a queued op on the comm thread's track,
    whichever thread ran it); debug logging gives its duration."""
    name = op.name
    observed = g.instrumented
    try:
        if observed and g.debug:
            seq = state.start(g, name, None, io)  # (in the flight record as the op: a mismatch found is there)
            state.relabel(g, name + " (debug-mode fingerprint check)")
            if record is not None:
                record.running(seq)
            _fingerprints(g, call, seq, asynchronous)
            state.relabel(g, name)
        else:
            seq = state.start(g, name, None, io)
            if record is not None:
                record.running(seq)
            checks = g.checks
            if checks.every:  # every call, compared across ranks first (hpccomm._core.signatures)
                try:
                    signatures.compare(g, call, seq)
                except _mpi.mpi().Exception as exc:
                    raise failures.mpi_error(f"{name}{signatures.LABEL} ({g.where(seq)})", exc) from exc
            elif not call.agreed and checks.agreed is not None and plan[CALL].__class__ is not Waited:
                _first_call(g, call, seq)  # its signature's first call, compared first (not the nonblocking form)
        if observed:
            tracer, logged = trace.active(), log.isEnabledFor(logging.DEBUG)
            began, t0 = trace.now_ns() if tracer else 0, time.perf_counter()
        try:
            run_plan(plan)
        except _mpi.mpi().Exception as exc:
            raise failures.mpi_error(f"{name} ({g.where(seq)})", exc) from exc
        finally:
            if observed and tracer:
                tracer.record(name, g.name, seq, plan[NBYTES], began, trace.now_ns(),
                              None if record is None else THREAD_NAME)
        if observed and logged:
            log.debug("%s (%s): %.1f us", name, g.where(seq), (time.perf_counter() - t0) * 1e6)
    finally:
        state.finished(g)
    return plan[OUTPUTS]


def execute_bound(g, op, call, plan):
    """:func:`execute` of a cached call's bound plan (hpccomm._ops.op.Op
    ``bind``: no steps around its MPI call) on a group with nothing
    instrumented, no record, and no first-call check to make: the op path's
    fast path (hpccomm._ops.op_path.run).  The same steps in the same order:
    numbered and recorded as running (and in the flight record: the cached
    call keeps its sizes, ``call.io``), compared across ranks first (the
    every-call check), the MPI call, an MPI error named after the op."""
    seq = state.start(g, op.name, None, call.io if g.flight is not None else None)
    try:
        if g.checks.every:
            try:
                signatures.compare(g, call, seq)
            except _mpi.mpi().Exception as exc:
                raise failures.mpi_error(f"{op.name}{signatures.LABEL} ({g.where(seq)})", exc) from exc
        try:
            plan[CALL](*plan[ARGS])
        except _mpi.mpi().Exception as exc:
            raise failures.mpi_error(f"{op.name} ({g.where(seq)})", exc) from exc
    finally:
        state.finished(g)
    return plan[OUTPUTS]


def _first_call(g, call, seq: int) -> None:
    """The first-call signature check of op ``seq`` (hpccomm._core.signatures)."""
    try:
        signatures.first_call(g, call, seq)
    except _mpi.mpi().Exception as exc:
        raise failures.mpi_error(f"{call.signature.op}{signatures.LABEL} ({g.where(seq)})", exc) from exc


def _fingerprints(g, call, seq: int, asynchronous: bool) -> None:
    """Debug mode's cross-rank comparison of collective ``seq`` (hpccomm._core.debug_mode)."""
    label = f"{call.signature.op} (debug-mode fingerprint check) ({g.where(seq)})"
    try:
        # (compared only where it decides the MPI form: HPCCOMM_ASYNC_NONBLOCKING; torch's own
        # DDP Join passes async_op=True on some ranks and False on others)
        flag = bool(asynchronous) if g.nonblocking else None
        debug_mode.compare(g, call.signature, seq, asynchronous=flag)
    except _mpi.mpi().Exception as exc:
        raise failures.mpi_error(label, exc) from exc
    except HpccommError:
        raise
    except Exception as exc:  # a message that does not unpickle: a rank died in the exchange?
        if not state.failures.tolerant:
            raise
        failure = failures.damaged(label, exc)
        if failure is None:
            raise
        raise failure from exc
