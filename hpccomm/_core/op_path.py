"""The op path: how every torch call becomes MPI calls, whichever adapter
(torch 2.13's ProcessGroup or torch >= 2.14's Backend) torch called.

:func:`run` takes the adapter's call (an op of :mod:`hpccomm._ops.table`, its
arguments and torch's options) and returns the op's Work (hpccomm._core.work):

1. the op's plan function checks every argument and returns its plan
   (:mod:`hpccomm._ops.plan`); a refusal raises
   :class:`hpccomm.errors.OpError` before any communication, and the other
   ranks, which may be waiting in the op, learn of it (:func:`refused`).  A
   CUDA tensor sends the call to the route its group takes for that device
   and op family, which wraps the plan or hands the call to NCCL
   (:mod:`hpccomm._gpu.dispatch`);
2. the plan runs in the form the call takes (:func:`form`): blocking in the
   calling thread (:func:`execute`); queued on the comm thread
   (``async_op=True``, or behind such ops: hpccomm._core.comm_thread); or posted as a
   nonblocking MPI call (point-to-point ops; small ``async_op=True``
   collectives with ``HPCCOMM_ASYNC_NONBLOCKING=1``), a pending Work
   completing it;
3. :func:`execute` numbers the collective and records it as running
   (hpccomm._core.state), compares it across ranks in debug mode, or when
   its signature is new to the group (hpccomm._core.signatures), runs the plan
   under the tracer, and turns an MPI error into an
   :class:`hpccomm.errors.HpccommError` naming the op.
"""
from __future__ import annotations

import logging
import time

from .. import _mpi
from .._gpu import dispatch
from .._ops.checks import NotOnCPU, check_root
from .._ops.plan import ARGS, BEFORE, CALL, ICALL, NBYTES, OUTPUTS, with_steps
from ..errors import HpccommError, OpError
from . import comm_thread, debug_mode, failures, signatures, state, trace
from .work import AllOf, Request, Work, done

log = logging.getLogger("hpccomm")

#: The largest ``async_op=True`` collective (bytes of this rank's input) that is
#: posted in its nonblocking form (with ``HPCCOMM_ASYNC_NONBLOCKING=1``).  Larger
#: ones keep the blocking form on the comm thread: with Open MPI nothing progresses
#: a posted collective until someone tests or waits, and even with the comm thread
#: waiting on it, a posted 64 MiB all_reduce overlapped compute far worse (280 ms
#: for 100 ms of communication and 60 ms of compute) than the blocking call on the
#: comm thread (110 ms): docs/benchmarks.md.  The size is equal on every rank, so
#: the form is too.
NONBLOCKING_MAX_BYTES = 64 << 10


def nbytes(args) -> int:
    """Bytes in the tensors among an op's arguments (for the trace)."""
    total = 0
    for a in args:
        if isinstance(a, (list, tuple)):
            total += nbytes(a)
        elif hasattr(a, "element_size") and hasattr(a, "numel"):
            total += a.numel() * a.element_size()
    return total


def run(g, op, args, opts=None):
    """Check and run ``op`` (an entry of hpccomm._ops.table) of group ``g``,
    called with ``args`` (torch's arguments after the group) and torch's
    options ``opts``; returns its Work (see the module docstring)."""
    if g.comm is None:
        raise HpccommError(f"hpccomm {op.name} (group '{g.name}'): the process group was destroyed")
    try:
        plan = op.plan(g, *args)  # raises OpError before any communication
    except NotOnCPU as exc:  # a device tensor (the CPU path pays only for this except clause)
        plan, not_cpu = None, exc
    except OpError as exc:
        refused(g, op, args, exc)  # the other ranks must not wait for this op
        raise
    if plan is None:  # (outside the except clause: a device error carries no unrelated context)
        return _on_device(g, op, args, opts, not_cpu)
    if op.p2p:  # always posted (form)
        return _post(g, op, plan, args[1], None)
    asynchronous = opts is not None and getattr(opts, "asyncOp", False)
    if asynchronous or g.queued:
        return start(g, op, plan, args, asynchronous)
    return done(execute(g, op.name, plan, args))  # the latency-bound case: blocking, here (form: "here")


def _on_device(g, op, args, opts, not_cpu: NotOnCPU):
    """:func:`run` for a call with CUDA tensors: the route its group takes for
    that device and op family (chosen once, hpccomm._gpu.dispatch) delegates
    the call to NCCL, rewritten into what NCCL takes, or wraps the op's plan
    (CUDA-aware MPI, staged)."""
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
    return start(g, op, plan, args, opts is not None and getattr(opts, "asyncOp", False),
                 dispatch.future_devices(device))


def form(g, op, plan, asynchronous: bool):
    """How a call of ``op`` with ``plan`` runs: ``(where, nonblocking)``.

    ``where`` is ``"here"`` (in the calling thread, now), ``"posted"``
    (posted here as a nonblocking MPI call, completed by its Work) or
    ``"queued"`` (on the comm thread, in issue order; a blocking call waits
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
        return "posted", True
    engine = comm_thread.engine
    if not (asynchronous or g.queued) or not engine.usable():
        return "here", False
    nonblocking = (asynchronous and op.nonblocking and g.nonblocking and plan[ICALL] is not None
                   and plan[NBYTES] <= NONBLOCKING_MAX_BYTES and not (g.debug or state.failures.tolerant))
    if engine.on_comm_thread():
        return "here", nonblocking
    if nonblocking and not g.queued:
        return "posted", True
    return "queued", nonblocking


def start(g, op, plan, args, asynchronous: bool = False, devices=None):
    """Run ``plan`` (op ``op`` of group ``g``, checked) in its :func:`form`;
    its Work.  ``devices``: the CUDA devices of its tensors (the Work's
    future names them)."""
    where, nonblocking = form(g, op, plan, asynchronous)
    if where == "posted":
        return _post(g, op, plan, args[1] if op.p2p else None, devices)
    if nonblocking:
        plan = _waited(plan)
    if where == "here":
        return done(execute(g, op.name, plan, args, None, asynchronous), devices)
    job = comm_thread.Job(g, op.name, _run_queued, plan, args, asynchronous)
    work = Work(plan[OUTPUTS], job, "", devices)
    job.work = work
    comm_thread.engine.submit(job)
    if not asynchronous:  # queued only to keep this group's issue order
        work.wait()
    return work


def _waited(plan):
    """``plan`` with its blocking form made of its nonblocking one, posted and
    waited for (an op that takes the nonblocking form on every rank, run in
    turn on the comm thread)."""
    icall = plan[ICALL]

    def post_and_wait(*args):
        icall(*args).Wait()

    return with_steps(post_and_wait, *plan[ARGS:])


def _run_queued(job):
    """What the comm thread (or the job's waiter in its place) runs for a queued op."""
    return execute(job.group, job.op, job.plan, job.args, job, job.asynchronous)


def _post(g, op, plan, peer, devices):
    """Post ``plan`` in its nonblocking form here: numbered, watched until it
    completes (its Request is its own record in hpccomm._core.state), its Work
    pending on it; a point-to-point op joins torch's coalescing window."""
    request = Request(g, op.name, op.p2p, plan, peer)
    state.start(g, op.name, request)
    if g.instrumented and not op.p2p and trace.active():
        request.traced = trace.now_ns()
    before = plan[BEFORE]
    try:
        if before is not None:
            before()
        request.req = plan[ICALL](*plan[ARGS])
    except _mpi.mpi().Exception as exc:
        state.end(request.token)
        failure = failures.failure(request.describe(), exc) if state.failures.tolerant else None
        raise (failure or HpccommError(f"hpccomm {request.describe()}: MPI failed: {exc}")) from exc
    work = Work(plan[OUTPUTS], request, devices=devices)
    if op.p2p and g.coalescing is not None:
        g.coalescing.append(work)
    return work


def execute(g, op: str, plan, args, job=None, asynchronous: bool = False):
    """Run a checked collective's plan blocking in this thread: numbered and
    recorded as running while it communicates (hpccomm._core.state: the watchdog
    and the SIGTERM reporter read it); an MPI error raises naming the op.
    Its outputs.  ``job``: the queued op it runs for; ``asynchronous``: the
    call's ``async_op`` (debug mode compares it across ranks)."""
    if g.instrumented:
        return _instrumented(g, op, plan, args, job, asynchronous)
    seq = state.start(g, op)
    if job is not None:
        job.seq = seq
    agreed = g.checks.agreed
    try:
        if agreed is not None and plan[NBYTES] not in agreed[op]:  # compared across ranks first (signatures)
            signatures.check(g, op, plan[NBYTES], args, seq)
        plan[CALL](*plan[ARGS])
    except _mpi.mpi().Exception as exc:
        raise mpi_error(op, g, seq, exc) from exc
    finally:
        state.finished(g)
    return plan[OUTPUTS]


def _instrumented(g, op: str, plan, args, job, asynchronous: bool):
    """:func:`execute` in debug mode (the op compared across ranks first),
    with the tracer on, or with debug logging."""
    try:
        if g.debug:  # the fingerprint exchange is itself a collective: the timeout covers it
            seq = state.start(g, op + " (debug-mode fingerprint check)")
            if job is not None:
                job.seq = seq
            _fingerprints(g, op, args, seq, job, asynchronous)
            state.relabel(g, op)
        else:
            seq = state.start(g, op)
            if job is not None:
                job.seq = seq
            agreed = g.checks.agreed
            if agreed is not None and plan[NBYTES] not in agreed[op]:
                try:
                    signatures.check(g, op, plan[NBYTES], args, seq)
                except _mpi.mpi().Exception as exc:
                    raise mpi_error(op + signatures.LABEL, g, seq, exc) from exc
        logged = log.isEnabledFor(logging.DEBUG)
        t0 = time.perf_counter() if logged else 0.0
        tracer = trace.active()
        began = trace.now_ns() if tracer else 0
        try:
            plan[CALL](*plan[ARGS])
        except _mpi.mpi().Exception as exc:
            raise mpi_error(op, g, seq, exc) from exc
        finally:
            if tracer:  # a queued op on the comm thread's track, whichever thread ran it (Engine.steal)
                tracer.record(op, g.name, seq, nbytes(args), began, trace.now_ns(),
                              None if job is None else comm_thread.THREAD_NAME)
        if logged:
            log.debug("%s (%s): %.1f us", op, g.where(seq), (time.perf_counter() - t0) * 1e6)
        return plan[OUTPUTS]
    finally:
        state.finished(g)


def _fingerprints(g, op: str, args, seq: int, job, asynchronous: bool) -> None:
    """Debug mode's cross-rank comparison of collective ``seq`` (hpccomm._core.debug_mode)."""
    try:
        # (compared only where it decides the MPI form: HPCCOMM_ASYNC_NONBLOCKING; torch's own
        # DDP Join passes async_op=True on some ranks and False on others)
        flag = bool(asynchronous or (job is not None and job.asynchronous)) if g.nonblocking else None
        debug_mode.check(g, op, args, seq, asynchronous=flag)
    except _mpi.mpi().Exception as exc:
        raise mpi_error(op + " (debug-mode fingerprint check)", g, seq, exc) from exc
    except HpccommError:
        raise
    except Exception as exc:  # a message that does not unpickle: a rank died in the exchange?
        if not state.failures.tolerant:
            raise
        failure = failures.damaged(f"{op} (debug-mode fingerprint check) ({g.where(seq)})", exc)
        if failure is None:
            raise
        raise failure from exc


def mpi_error(op: str, g, seq: int, exc) -> HpccommError:
    """What MPI error ``exc`` in collective ``op`` (number ``seq`` of group
    ``g``) raises: :class:`hpccomm.RankFailure` when a rank died and fault
    tolerance is on (hpccomm.fault_tolerance); else the job ends, the likely
    cause said (hpccomm._core.signatures.mpi_failed)."""
    failure = failures.failure(f"{op} ({g.where(seq)})", exc) if state.failures.tolerant else None
    if failure is not None:
        return failure
    return signatures.mpi_failed(f"{op} ({g.where(seq)})", exc)


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
            engine = comm_thread.engine
            if not engine.on_comm_thread():
                engine.flush(g)  # the comparison runs in issue order, like the op would have
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
    works, g.coalescing = g.coalescing or [], None
    return Work(None, AllOf(works, f"batch of {len(works)} point-to-point op(s) ({g.where_p2p()})"))
