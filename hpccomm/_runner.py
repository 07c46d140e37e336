"""The op path: how every torch call becomes MPI calls, whichever adapter
(torch 2.13's ProcessGroup or torch >= 2.14's Backend) torch called.

:func:`run` takes the adapter's call (an op name, the op module's prepare
function, the op's arguments and torch's options) and returns a
:class:`hpccomm._work.Work`:

1. CUDA tensors are routed to the group's GPU transport (chosen once per
   group and device); the op module's checks run on every path.
2. The op module's ``prepare(group, *args)`` checks everything and raises
   :class:`hpccomm.errors.OpError` before any communication; it returns the
   function that communicates, or a posted point-to-point op (``Pending``).
3. Blocking collectives run here, in the calling thread; ``async_op=True``
   ones (and blocking ones queued behind them) run on the comm thread
   (:mod:`hpccomm._engine`), in issue order.
4. :func:`execute` numbers the collective (in the thread that runs it: see
   :mod:`hpccomm._group`), runs debug mode's cross-rank check, and runs the
   communication under the watchdog and the tracer; an MPI error becomes an
   :class:`hpccomm.errors.HpccommError` naming the op.

The plain cases (``run_allreduce``, ``run_broadcast``, ``run_all_gather_single``,
``run_reduce_scatter_single``, ``run_send``, ``run_recv``) come first for their
ops: the common case (dense contiguous CPU tensors of a type met before, valid
arguments) without the prepare, check and execute frames; anything else goes
to :func:`run`.
"""
from __future__ import annotations

import logging
import threading
import time

from . import _debug, _engine, _ft, _mpi, _status, _trace, _work
from ._compat import WorkBase as _WorkBase
from ._watchdog import watchdog
from .errors import HpccommError, OpError
from .gpu import dispatch as _gpu
from .ops._common import NotOnCPU, plain_buffer as _plain_one
from .ops import gather as _gather
from .ops import reduce as _reduce
from .ops import scatter as _scatter
from .ops import p2p as _p2p
from .ops.p2p import Pending as _Pending

_monotonic = time.monotonic
_last_group = _status.last_group
_Done = _work.Done
_Job = _engine.Job
_Work = _work.Work
_new_work = _Work.__new__
_work_init = _WorkBase.__init__
_allocate_lock = threading.Lock
_watch_ids = _status.ids
_watched = _status.watched
_get_ident = threading.get_ident
_DEBUG = logging.DEBUG

log = logging.getLogger("hpccomm")


def nbytes(args) -> int:
    """Bytes in the tensors among an op's arguments (for the trace)."""
    total = 0
    for a in args:
        if isinstance(a, (list, tuple)):
            total += nbytes(a)
        elif hasattr(a, "element_size") and hasattr(a, "numel"):
            total += a.numel() * a.element_size()
    return total


def run(g, op: str, prepare, args, opts=None):
    """Check and run op ``op`` of group ``g``; see the module docstring."""
    if g.comm is None:
        raise HpccommError(f"hpccomm {op} (group '{g.name}'): the process group was destroyed")
    asynchronous = opts is not None and getattr(opts, "asyncOp", False)
    form = _NONBLOCKING.get(prepare) if asynchronous and g.nonblocking else None
    if form is not None:
        # HPCCOMM_ASYNC_NONBLOCKING: the four ops with a nonblocking form take it on every rank
        # alike (see hpccomm._engine's thread rule: MPI never matches a nonblocking collective
        # with a blocking one); fault tolerance, debug mode and device tensors keep the blocking
        # one.  The form runs the op's checks itself; None, or a tensor it does not take, leaves
        # the op to the path below (prepare raises a refusal with its own message there).
        engine = _engine.engine
        if (engine._usable or engine.usable()) and not (g.debug or _ft.state.enabled):
            try:
                posting = form(g, *args)
            except NotOnCPU:
                posting = None
            except OpError as exc:
                refused(g, op, args, exc)
                raise
            if posting is not None:
                return post_collective(g, op, posting, args)
    devices = None
    try:
        try:
            call = prepare(g, *args)  # raises OpError before any communication
        except NotOnCPU:  # a device tensor (its check is the only cost of this branch on the CPU path)
            device = _gpu.cuda_device(g, op, args)  # OpValueError when the call mixes devices
            if device is None:
                raise  # not a CUDA tensor: refused as it stands
            devices = _gpu.future_devices(device)
            transport = _gpu.transport(g, op, device)
            if transport.delegates:  # NCCL takes the whole op, after the op module's checks
                _gpu.check_only(g, op, prepare, args)
                return _gpu.delegated(transport, g, op, args, opts)
            call = transport.wrap(op, prepare)(g, *args)  # the op module's checks run inside
    except OpError as exc:
        refused(g, op, args, exc)  # the other ranks must not wait for this op
        raise
    if call.__class__ is _Pending:  # point-to-point: already posted, nonblocking
        return posted(g, op, call, args[0], devices)
    if asynchronous or g.queued:
        engine = _engine.engine
        if engine._usable or engine.usable():
            # On the comm thread (a callback of a finished op, such as a DDP hook) an op
            # runs at once: queuing it behind the thread's own work would deadlock.
            ident = _get_ident()  # engine.on_comm_thread(), without its call
            if ident != engine._ident and ident != engine._stealer:
                job = _Job(g, _run_job, op, call, args)
                job.asynchronous = asynchronous
                work = _Work(None, job, "", devices)
                job.work = work
                engine.submit(job)
                if not asynchronous:  # queued only to keep this group's issue order
                    work.wait()
                return work
        if asynchronous and g.debug:  # (run here; debug mode compares the async flag across ranks too)
            work = _Done()
            work._outputs = execute(op, g, call, args, None, True)
            work._devices = devices
            work._future = None
            return work
    # The blocking path (latency-bound): call directly, no closure.  Every
    # microsecond here costs several in front of a cache-hot shared-memory
    # collective (docs/benchmarks.md), so nothing is formatted unless needed,
    # and the finished Work is filled in here (no Python constructor frame).
    work = _Done()
    work._outputs = execute(op, g, call, args)  # the future's value; also keeps the tensors alive
    work._devices = devices
    work._future = None
    return work


# -- the blocking plain cases ----------------------------------------------------
# all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor, blocking, of dense
# contiguous CPU tensors (plain torch.Tensors) that hpccomm has met before (a dtype
# _mpi.host_buffer has moved; for the reductions a (dtype, ReduceOp) pair in
# hpccomm.ops.reduce.PLAIN: checked once, a predefined MPI op, no factor or division), within the
# size limits, all_gather's input this rank's slot of the output or apart from it and
# reduce_scatter's apart, on a group with no async op queued, outside debug mode, tracing and
# debug logging: numbered, marked running (the watchdog's and the SIGTERM reporter's record) and
# run on the tensors' memory by :func:`_plain`, with no prepare, check, execute or
# Work-constructor frame.  Anything else takes :func:`run`, which checks everything and raises the
# refusals with their messages.  Which branch an op takes changes nothing another rank sees: the
# same MPI call either way.

_PIECE = _reduce._ALLREDUCE_PIECE_BYTES
_plain_buffer = _plain_one
_plain_allreduce = _reduce.plain_allreduce_buffer
_plain_gather = _gather.plain_buffers
_plain_scatter = _reduce.plain_scatter_buffers


def _plain(g, op: str, outputs, call, *args):
    """The Work of blocking op ``op`` run as ``call(*args)`` (an MPI call on
    the tensors' memory), or None where the plain case does not apply to the
    call (this group's async ops queued, debug mode, tracing, debug logging):
    the caller then takes :func:`run`.  (``async_op=True`` never comes here:
    the callers test it first, before making buffers.)"""
    if g.queued or g.debug or _trace._tracer or log.isEnabledFor(_DEBUG):
        return None
    g.seq = seq = next(g._seqs)  # (execute's bookkeeping, inline)
    g.running = g.last = (op, seq, _monotonic())
    _last_group[0] = g
    try:
        call(*args)
    except _mpi.mpi().Exception as exc:
        raise mpi_error(op, g, seq, exc) from exc
    finally:
        g.running = None
    work = _Done()
    work._outputs = outputs
    work._devices = work._future = None
    return work


def run_allreduce(g, tensors, redop, opts=None):
    """``allreduce``: its blocking plain case (above; the buffer:
    hpccomm.ops.reduce.plain_allreduce_buffer), else :func:`run`."""
    plain = None if opts is not None and getattr(opts, "asyncOp", False) else _plain_allreduce(g, tensors, redop)
    if plain is not None and plain[0][0].nbytes <= _PIECE and g.comm is not None:
        work = _plain(g, "all_reduce", tensors, g.comm.Allreduce, _mpi.IN_PLACE, plain[0], plain[1])
        if work is not None:
            return work
    return run(g, "all_reduce", _reduce.allreduce_or_sparse, (tensors, redop), opts)


def run_broadcast(g, tensors, root, opts=None):
    """``broadcast``: its blocking plain case (above; the buffer:
    hpccomm.ops._common.plain_buffer), else :func:`run`."""
    plain = None if (opts is not None and getattr(opts, "asyncOp", False)) or not (
        root.__class__ is int and 0 <= root < g.size) else _plain_buffer(g, tensors)
    if plain is not None and g.comm is not None:
        work = _plain(g, "broadcast", tensors, g.comm.Bcast, plain, root)
        if work is not None:
            return work
    return run(g, "broadcast", _scatter.broadcast, (tensors, root), opts)


def run_all_gather_single(g, output, input, opts=None):
    """``all_gather_single`` (all_gather_into_tensor): its blocking plain case
    (above; the buffers: hpccomm.ops.gather.plain_buffers), else :func:`run`."""
    plain = None if opts is not None and getattr(opts, "asyncOp", False) else _plain_gather(g, output, input)
    if plain is not None and g.comm is not None:
        work = _plain(g, "all_gather_into_tensor", [output], g.comm.Allgather, plain[0], plain[1])
        if work is not None:
            return work
    return run(g, "all_gather_into_tensor", _gather.all_gather_single, (output, input), opts)


def run_reduce_scatter_single(g, output, input, redop, opts=None):
    """``reduce_scatter_single`` (reduce_scatter_tensor): its blocking plain
    case (above; the buffers: hpccomm.ops.reduce.plain_scatter_buffers), else
    :func:`run`."""
    plain = None if opts is not None and getattr(opts, "asyncOp", False) else _plain_scatter(g, output, input, redop)
    if plain is not None and g.comm is not None:
        work = _plain(g, "reduce_scatter_tensor", [output], g.comm.Reduce_scatter_block, plain[0], plain[1],
                      plain[2])
        if work is not None:
            return work
    return run(g, "reduce_scatter_tensor", _reduce.reduce_scatter_single, (output, input, redop), opts)


# send and recv (torch's blocking send/recv and isend/irecv alike: both post and return a pending
# Work) of a dense contiguous CPU tensor of a dtype hpccomm has moved, within the count limit, to or
# from a named rank in range with a tag in range: posted on the tensor's memory and numbered, watched
# and collected (torch's coalescing window) as :func:`posted` does, with no prepare, check, Pending- or
# Work-constructor frame.  Anything else (any source, a tensor to stage, a bad argument) takes
# :func:`run`, which checks everything and refuses with its messages.  Either way the same
# MPI_Isend/MPI_Irecv on the group's p2p communicator, completed by the Work (hpccomm._work).

_new_pending = _Pending.__new__


def _posted_p2p(g, op: str, req, tensors, t, peer, expect=None):
    """The pending Work of point-to-point op ``op`` just posted as ``req`` on
    ``t``'s memory (:func:`posted`'s work; ``expect``: a receive's
    ``(elements, MPI datatype)``, checked against what arrives)."""
    pending = _new_pending(_Pending)
    pending.req = req
    pending.keep = (t, t)  # alive until done (the Pending's contract)
    pending.op = pending.name = op
    pending.peer = peer
    if expect is not None:
        pending.is_recv = True
        pending.expect = expect
        pending.status = _mpi._MPI.Status()
    return posted(g, op, pending, tensors, None)


def _p2p_buffer(g, tensors, peer, tag):
    """The plain case's message of a send to, or a receive from, group rank
    ``peer`` (hpccomm.ops._common.plain_buffer), or None."""
    if peer.__class__ is int and 0 <= peer < g.size and tag.__class__ is int and 0 <= tag <= g.tag_ub \
            and g.p2p is not None:
        return _plain_buffer(g, tensors)
    return None


def run_send(g, tensors, dst, tag):
    """``send``: its plain case (above), else :func:`run`."""
    message = _p2p_buffer(g, tensors, dst, tag)
    if message is not None:
        return _posted_p2p(g, "send", g.p2p.Isend(message, dst, tag), tensors, tensors[0], dst)
    return run(g, "send", _p2p.send, (tensors, dst, tag))


def run_recv(g, tensors, src, tag):
    """``recv`` from rank ``src`` (None: any source): its plain case (above), else :func:`run`."""
    message = _p2p_buffer(g, tensors, src, tag)
    if message is not None:
        return _posted_p2p(g, "recv", g.p2p.Irecv(message, src, tag), tensors, tensors[0], src,
                           (message[1], message[2]))
    return run(g, "recv", _p2p.recv, (tensors, src, tag))


def _run_job(job):
    """What the comm thread runs for a queued op (``hpccomm._engine.Job.run``)."""
    return execute(job.op, job.group, job.call, job.args, job)


#: The ops with a nonblocking form for ``async_op=True``, by the op module's
#: prepare function.  :func:`run` calls the form in place of prepare: it runs
#: the op's checks and returns a posted-to-be
#: :class:`hpccomm.ops._common.Posted`, or None to keep the blocking form.
_NONBLOCKING = {
    _reduce.allreduce_or_sparse: _reduce.iallreduce,
    _reduce.reduce_scatter_single: _reduce.ireduce_scatter_single,
    _gather.all_gather_single: _gather.iall_gather_single,
    _scatter.broadcast: _scatter.ibroadcast,
}


def post_collective(g, op: str, posting, args):
    """An ``async_op=True`` collective in its nonblocking form (``posting``, a
    :class:`hpccomm.ops._common.Posted`): posted here and returned as a
    pending Work, unless

    - the group has queued ops: then it queues behind them, and the comm
      thread posts it and waits in its turn (the same MPI calls, in issue order);
    - the caller is the comm thread (a callback of a completed op): posted and
      waited at once, as every op issued there runs.

    (Large ops never come here: past ``NONBLOCKING_MAX_BYTES`` they keep the
    blocking form on the comm thread, which overlaps compute better.)

    A Work only ``wait()``-ed completes in its waiter; asking for its future
    hands it to the comm thread (hpccomm._work.Work.get_future), so callbacks
    run there, at a fixed point of the op order on every rank."""
    engine = _engine.engine
    ident = _get_ident()
    if g.queued or ident == engine._ident or ident == engine._stealer:
        return _post_in_turn(g, op, posting, args)
    # The latency-bound case, posted here: Group.next_seq without its call, the
    # watch and the Work in _watched_work (docs/benchmarks.md, the posted form).
    g.seq = seq = next(g._seqs)
    posting.group = g
    posting.seq = seq
    posting.start = start = _monotonic()
    g.last = (op, seq, start)
    _last_group[0] = g
    if _trace._tracer:
        posting.traced = _trace.now_ns()
    try:
        posting.req = posting._start()
    except _mpi.mpi().Exception as exc:
        raise mpi_error(op, g, seq, exc) from exc
    return _watched_work(g, posting, start, posting.outputs)


def _watched_work(g, pending, start, outputs):
    """The pending Work of ``pending`` (a posted collective or point-to-point
    op, posted at ``start``): its deadline set and the watchdog running, the
    pending the watchdog's record until the Work completes
    (hpccomm._status.watch), and the Work made as ``Work(outputs, pending)``
    makes it, without the constructor's frame."""
    seconds = g.timeout_s
    if seconds:
        pending.deadline = start + seconds
        if watchdog._thread is None:
            watchdog.start()
    pending.token = token = next(_watch_ids)
    _watched[token] = pending
    work = _new_work(_Work)
    _work_init(work)
    work._outputs = outputs  # the future's value; the pending keeps the buffers alive
    work._pending = pending
    work._done = work._engine_completes = False  # completed by whoever waits or tests, until handed on
    work._source = -1
    work._lock = _allocate_lock()
    return work


def _post_in_turn(g, op: str, posting, args):
    """:func:`post_collective` behind this group's queued ops (the comm thread
    posts it and waits in its turn), or on the comm thread (a callback of a
    completed op): posted and waited for at once."""
    if not _engine.engine.on_comm_thread():
        job = _Job(g, _run_job, op, posting.run, args)
        job.asynchronous = True
        work = _Work(None, job, "", None)
        job.work = work
        _engine.engine.submit(job)
        return work
    work = _Done()
    work._outputs = execute(op, g, posting.run, args)
    work._devices = None
    work._future = None
    return work


#: Point-to-point ops, whose peer waits for this rank.
_P2P = ("send", "recv")


def refused(g, op: str, args, exc: OpError) -> None:
    """This rank's checks refused op ``op`` (``exc``, which the caller
    raises); the other ranks may call it correctly and wait.  Make sure they
    learn of it: in debug mode every rank raises it together (the refusal
    joins the cross-rank comparison, which raises here too); otherwise it is
    announced in the group's store, where a waiting rank's watchdog finds it
    within a second or two and ends the job with this message
    (hpccomm._watchdog) instead of waiting for the timeout."""
    if g.size > 1 and g.store is not None:
        if op not in _P2P and g.debug:
            engine = _engine.engine
            if not engine.on_comm_thread():
                engine.flush(g)  # the comparison runs in issue order, like the op would have
            seq = g.next_seq()
            token = watchdog.begin(g, op + " (debug-mode fingerprint check)", seq)
            try:
                _debug.check(g, op, args, seq, refused=exc)
            finally:
                watchdog.end(token)
        else:
            announce_refusal(g, op, args, exc)


def announce_refusal(g, op: str, args, exc: OpError) -> None:
    """Record in the group's store that this rank refused op ``op`` (see :func:`refused`)."""
    from ._watchdog import refusal_key

    me = g.global_ranks[g.rank]
    try:
        if op in _P2P:  # the peer waits in the matching receive or send
            peer = args[1] if len(args) > 1 and isinstance(args[1], int) else None
            if peer is not None and 0 <= peer < g.size:
                g.store.set(refusal_key(g, "p2p", from_rank=me, to_rank=g.global_ranks[peer]), str(exc))
        else:
            g.store.set(refusal_key(g, "collective", seq=g.seq + 1), f"rank {me}: {exc}")
    except Exception:  # noqa: BLE001 - the refusal itself is raised either way
        pass


def execute(op: str, g, call, args, job=None, asynchronous=False):
    """Run a checked collective's communication ``call()`` (in the thread
    that runs it): number it, compare it across ranks in debug mode (the
    async flag too: ``asynchronous``, or the job's), and run it while
    ``g.running`` says so (the watchdog and the SIGTERM reporter read it:
    hpccomm._status) and under the tracer."""
    g.seq = seq = next(g._seqs)  # Group.next_seq, without its call
    if job is not None:
        job.seq = seq
    if g.debug:  # the fingerprint exchange is itself a collective: the timeout covers it
        token = watchdog.begin(g, op + " (debug-mode fingerprint check)", seq)
        try:
            # (compared only where it decides the MPI form: HPCCOMM_ASYNC_NONBLOCKING; torch's own
            # DDP Join passes async_op=True on some ranks and False on others)
            flag = None
            if g.nonblocking:
                flag = bool(asynchronous or (job is not None and job.asynchronous))
            _debug.check(g, op, args, seq, asynchronous=flag)
        except _mpi.mpi().Exception as exc:
            raise mpi_error(op + " (debug-mode fingerprint check)", g, seq, exc) from exc
        except HpccommError:
            raise
        except Exception as exc:  # a message that does not unpickle: a rank died in the exchange?
            if not _ft.state.enabled:
                raise
            failure = _ft.damaged(f"{op} (debug-mode fingerprint check) ({g.where(seq)})", exc)
            if failure is None:
                raise
            raise failure from exc
        finally:
            watchdog.end(token)
    debug = log.isEnabledFor(_DEBUG)
    t0 = time.perf_counter() if debug else 0.0
    tracer = _trace._tracer
    start = _trace.now_ns() if tracer else 0
    g.running = g.last = (op, seq, _monotonic())
    _last_group[0] = g
    try:
        result = call()
    except OpError:
        raise
    except _mpi.mpi().Exception as exc:
        raise mpi_error(op, g, seq, exc) from exc
    finally:
        g.running = None
        if tracer:  # a queued op on the comm thread's track, whichever thread ran it (Engine.steal)
            tracer.record(op, g.name, seq, nbytes(args), start, _trace.now_ns(),
                          None if job is None else _engine.THREAD_NAME)
    if debug:
        log.debug("%s (%s): %.1f us", op, g.where(seq), (time.perf_counter() - t0) * 1e6)
    return result


def mpi_error(op: str, g, seq: int, exc) -> HpccommError:
    """What MPI error ``exc`` in collective ``op`` (number ``seq`` of group
    ``g``) raises: :class:`hpccomm.RankFailure` when a rank died and fault
    tolerance is on (hpccomm._ft), else :class:`HpccommError` naming the op."""
    failure = _ft.failure(f"{op} ({g.where(seq)})", exc) if _ft.state.enabled else None
    if failure is not None:
        return failure
    return HpccommError(f"hpccomm {op} ({g.where(seq)}): MPI failed: {exc}")


def posted(g, op: str, pending, tensor, devices):
    """The Work of a posted point-to-point op: numbered, watched by the
    watchdog until it completes (the Pending is its own record in
    :mod:`hpccomm._status`), and collected when torch coalesces.
    (Group.next_p2p_seq without its call; the plain case comes here too.)"""
    g.p2p_seq = pending.seq = next(g._p2p_seqs)
    pending.group = g
    pending.start = start = _monotonic()
    work = _watched_work(g, pending, start, tensor)
    if devices:
        work._devices = devices
    if g.coalescing is not None:
        g.coalescing.append(work)
    return work


def start_coalescing(g) -> None:
    """torch's coalescing window opens (``batch_isend_irecv``): collect the
    point-to-point ops posted until :func:`end_coalescing`."""
    g.coalescing = []


def end_coalescing(g):
    """The Work completing when every op posted since :func:`start_coalescing` has."""
    works, g.coalescing = g.coalescing or [], None
    return _work.Work(None, _work.AllOf(works), f"batch of {len(works)} point-to-point op(s) ({g.where_p2p()})")
