"""The op path: how every torch call becomes MPI calls, whichever adapter
(torch 2.13's ProcessGroup or torch >= 2.14's Backend) torch called.

:func:`run` takes the adapter's call (an op of :mod:`hpccomm._ops.table`, its
arguments and torch's options) and returns the op's Work (hpccomm._core.work):

1. the op's plan function checks every argument and returns its plan
   (:mod:`hpccomm._core.plan`); a refusal raises
   :class:`hpccomm.errors.OpError` before any communication, and the other
   ranks, which may be waiting in the op, learn of it (:func:`refused`).  A
   CUDA tensor sends the call to the route its group takes for that device
   and op family, which wraps the plan or hands the call to NCCL
   (:mod:`hpccomm._gpu.dispatch`);
2. :func:`form` decides, in one place, where the plan runs: blocking in the
   calling thread (hpccomm._core.execute), queued on the comm thread, or
   posted as a nonblocking MPI call (the last two through the op's record,
   hpccomm._core.record, which the Work waits on).
"""
from __future__ import annotations

from .._core import comm_thread, debug_mode, flight, state
from .._core.execute import execute
from .._core.plan import ICALL, NBYTES, OUTPUTS, waited
from .._core.record import OpRecord
from .._core import work
from .._gpu import dispatch
from ..errors import HpccommError, OpError
from .checks import NotOnCPU, check_root

#: The largest ``async_op=True`` collective (bytes of this rank's input) that is
#: posted in its nonblocking form (with ``HPCCOMM_ASYNC_NONBLOCKING=1``).  Larger
#: ones keep the blocking form on the comm thread: with Open MPI nothing progresses
#: a posted collective until someone tests or waits, and even with the comm thread
#: waiting on it, a posted 64 MiB all_reduce overlapped compute far worse (280 ms
#: for 100 ms of communication and 60 ms of compute) than the blocking call on the
#: comm thread (110 ms): docs/benchmarks.md.  The size is equal on every rank, so
#: the form is too.
NONBLOCKING_MAX_BYTES = 64 << 10

#: Where a call runs (:func:`form`).
HERE, POSTED, QUEUED = "here", "posted", "queued"
_BLOCKING_HERE, _POSTED = (HERE, False), (POSTED, True)


def run(g, op, args, opts=None, plan=None, devices=None):
    """Check and run ``op`` (an entry of hpccomm._ops.table) of group ``g``,
    called with ``args`` (torch's arguments after the group) and torch's
    options ``opts``; returns its Work (see the module docstring).
    ``plan``: the plan a GPU transport made of the call (checked), with
    ``devices`` the CUDA devices its Work's future names; else the op's plan
    function makes it here."""
    if plan is None:
        if g.comm is None:
            raise HpccommError(f"hpccomm {op.name} (group '{g.name}'): the process group was destroyed")
        try:
            plan = op.plan(g, *args)  # raises OpError before any communication
        except NotOnCPU as exc:  # a device tensor (the CPU path pays only for this except clause)
            not_cpu = exc
        except OpError as exc:
            refused(g, op, args, exc)  # the other ranks must not wait for this op
            raise
        if plan is None:  # (outside the except clause: a device error carries no unrelated context)
            return _on_device(g, op, args, opts, not_cpu)
    asynchronous = opts is not None and getattr(opts, "asyncOp", False)
    io = None if g.flight is None else flight.tensors_io(op.first, args)  # (what the flight recorder keeps)
    if not (asynchronous or g.queued or op.p2p):  # form()'s first answer, without its call frame
        return work.finished(execute(g, op.name, plan, args, None, False, io), devices)
    where, nonblocking = form(g, op, plan, asynchronous)
    if nonblocking:
        if where is POSTED:
            record = OpRecord(g, op.name, plan, "p2p" if op.p2p else "collective", args[1] if op.p2p else None,
                              devices, io)
            record.post()
            return work.pending(record, plan[OUTPUTS])
        plan = waited(plan)  # posted and waited for where it runs
    if where is HERE:  # the latency-bound case: blocking, here
        return work.finished(execute(g, op.name, plan, args, None, asynchronous, io), devices)
    record = OpRecord(g, op.name, plan, "collective", None, devices, io)
    queued = work.pending(record, plan[OUTPUTS])  # (made first: its waiter more often finds the op not taken yet)
    record.queue(args, asynchronous)
    if not asynchronous:  # queued only to keep this group's issue order
        queued.wait()
    return queued


def _on_device(g, op, args, opts, not_cpu: NotOnCPU):
    """:func:`run` for a call with CUDA tensors: the route its group takes for
    that device and op family (chosen once, hpccomm._gpu.dispatch) hands the
    call to NCCL, rewritten into what NCCL takes, or wraps the op's plan
    (CUDA-aware MPI, composed, staged), which runs as any."""
    try:
        device = dispatch.cuda_device(g, op.name, args)  # OpValueError when the call mixes devices
        if device is None:
            raise not_cpu  # not a CUDA tensor: refused as it stands
        transport, wire = dispatch.route(g, op, device, args)
        if wire is not None:  # NCCL takes the call, after the op's checks
            return dispatch.delegated(transport, g, op.name, wire, opts)
        plan = transport.plan(op, g, args)  # the op's checks run inside
    except OpError as refusal:
        refused(g, op, args, refusal)
        raise
    return run(g, op, args, opts, plan, dispatch.future_devices(device))


def form(g, op, plan, asynchronous: bool):
    """How a call of ``op`` with ``plan`` runs: ``(where, nonblocking)``.

    ``where`` is :data:`HERE` (in the calling thread, now), :data:`POSTED`
    (posted here as a nonblocking MPI call, completed through its record) or
    :data:`QUEUED` (on the comm thread, in issue order; a blocking call waits
    for it); ``nonblocking``: the op takes its nonblocking MPI form (posted,
    or posted and waited for where it runs).  Point-to-point ops are always
    posted (a peer may be anywhere in its program).  A collective takes the
    nonblocking form only for ``async_op=True`` with HPCCOMM_ASYNC_NONBLOCKING
    on, a plan that has one, at most NONBLOCKING_MAX_BYTES, outside debug
    mode and fault tolerance: all equal on every rank, since MPI never
    matches a nonblocking collective with a blocking one.  It is queued when
    it is async or its group has queued ops (so ops on one communicator run
    in issue order on every rank, MPI's rule), except on the comm thread (a
    callback of a completed op, such as a DDP hook: queuing behind the
    thread's own work would deadlock, it runs at once) and below
    MPI_THREAD_MULTIPLE (only the calling thread calls MPI)."""
    if op.p2p:
        return _POSTED
    if not (asynchronous or g.queued) or not comm_thread.usable():
        return _BLOCKING_HERE
    nonblocking = (asynchronous and op.nonblocking and g.nonblocking and plan[ICALL] is not None
                   and plan[NBYTES] <= NONBLOCKING_MAX_BYTES and not (g.debug or state.failures.tolerant))
    if comm_thread.on_it():
        return HERE, nonblocking
    if nonblocking and not g.queued:
        return _POSTED
    return QUEUED, nonblocking


def refused(g, op, args, exc: OpError) -> None:
    """This rank's checks refused ``op`` (``exc``, which the caller raises);
    the other ranks may call it correctly and wait.  Make sure they learn of
    it: in debug mode every rank raises it together (the refusal joins the
    cross-rank comparison, which raises here too); otherwise it is announced
    in the group's store, where a waiting rank's watchdog finds it within a
    second or two and ends the job with this message (hpccomm._core.watchdog)
    instead of waiting for the timeout."""
    if g.size > 1 and g.store is not None:
        if not op.p2p and g.debug:
            if not comm_thread.on_it():
                comm_thread.flush(g)  # the comparison runs in issue order, like the op would have
            seq = state.start(g, op.name + " (debug-mode fingerprint check)")
            try:
                debug_mode.check(g, op.name, args, seq, refused=exc)
            finally:
                state.finished(g)
        else:
            announce_refusal(g, op, args, exc)


def announce_refusal(g, op, args, exc: OpError) -> None:
    """Record in the group's store that this rank refused ``op`` (see :func:`refused`)."""
    me = g.global_ranks[g.rank]
    try:
        if op.p2p:  # the peer waits in the matching receive or send
            peer = args[1] if len(args) > 1 else None
            check_root(g, op.name, peer)  # raises (and nothing is announced) unless a rank of the group
            g.store.set(state.refusal_key(g, "p2p", from_rank=me, to_rank=g.global_ranks[peer]), str(exc))
        else:
            g.store.set(state.refusal_key(g, "collective", seq=g.seq + 1), f"rank {me}: {exc}")
    except Exception:  # noqa: BLE001 - the refusal itself is raised either way
        pass


def start_coalescing(g) -> None:
    """torch's coalescing window opens (``batch_isend_irecv``): collect the
    point-to-point ops posted until :func:`end_coalescing`."""
    g.coalescing = []


def end_coalescing(g):
    """The Work completing when every op posted since :func:`start_coalescing` has."""
    records, g.coalescing = g.coalescing or [], None
    return work.pending(OpRecord.batch(g, records, f"batch of {len(records)} point-to-point op(s) ({g.where_p2p()})"))
