"""The plan: what one call of an op needs, stated once by its op module.

A plan function (``hpccomm._ops.reduce.all_reduce(group, tensors, redop)``
...) checks every argument, then states the call's plan; every form the call
may take runs that plan: blocking in the calling thread or on the comm thread
(:func:`run`), posted as a nonblocking MPI call (hpccomm._core.record), or
through a GPU transport, which wraps it (hpccomm._gpu).  A plan function never
communicates: every refusal is raised before anything is sent.

A plan is a tuple of eight fields, in the order of :data:`FIELDS`, read by
name through the indexes :data:`CALL` ... :data:`NBYTES` (``plan[CALL]``).
A tuple, not a class: one plan is made per call, and on CPython 3.11 a tuple
literal costs 0.5k instructions where a NamedTuple costs 3.6k and any tuple
subclass 1.7k (docs/benchmarks.md), which a blocking op's budget does not
hold.  The fields:

``call``
    the MPI call of the blocking form, run as ``call(*args)``: a bound method
    of the group's communicator (``comm.Allreduce``), or a function making
    several calls (large messages in pieces, per-rank sends); None for
    point-to-point ops, which are always posted;
``args``
    its arguments: MPI buffers on the tensors' memory (zero copy when they
    are contiguous), ``MPI_IN_PLACE``, counts, roots, the MPI op;
``icall``
    the nonblocking MPI call taking the same ``args`` and returning the
    request (``comm.Iallreduce``, ``p2p.Isend``), or None where this call has
    no nonblocking form.  Whether it has one depends only on what is equal on
    every rank (the op, dtype, ReduceOp, counts): MPI never matches a
    nonblocking collective with a blocking one;
``outputs``
    the op's result, the value of the Work's future (DDP reads it);
``keep``
    what MPI reads or writes (the tensors, staging buffers): alive until the
    op completes (the buffers in ``args`` hold addresses, not tensors);
``before``, ``after``
    the op's steps around its MPI call, where it reads its inputs and once
    its data is in place: a strided tensor copied into a contiguous buffer
    and back, PREMUL_SUM's scaling, an aliased input copied apart, AVG's
    division (None: none).  Every form runs them: ``before``, the MPI call
    (``call``, or ``icall`` then the request's completion), ``after``;
``nbytes``
    the bytes of this rank's input (the posted form is taken up to
    ``hpccomm._ops.op_path.NONBLOCKING_MAX_BYTES``).

Example: a blocking all_reduce of a contiguous float32 tensor ``t`` has the
plan ``(comm.Allreduce, (MPI_IN_PLACE, [t's memory, n, MPI_FLOAT], MPI_SUM),
comm.Iallreduce, [t], (t, t, None), None, None, 4 * n)``.
"""
from __future__ import annotations

#: The fields of a plan, in order, and their indexes (see the module docstring).
FIELDS = ("call", "args", "icall", "outputs", "keep", "before", "after", "nbytes")
CALL, ARGS, ICALL, OUTPUTS, KEEP, BEFORE, AFTER, NBYTES = range(len(FIELDS))


def run(plan) -> None:
    """Run ``plan`` in its blocking form: ``before``, ``call(*args)``, ``after``."""
    before = plan[BEFORE]
    if before is not None:
        before()
    plan[CALL](*plan[ARGS])
    after = plan[AFTER]
    if after is not None:
        after()


class Waited:
    """A plan's blocking form made of its nonblocking one: ``icall`` posted
    and waited for (:func:`waited`)."""

    __slots__ = ("icall",)

    def __init__(self, icall) -> None:
        self.icall = icall

    def __call__(self, *args) -> None:
        self.icall(*args).Wait()


def waited(plan):
    """``plan`` with its blocking form made of its nonblocking one (an op that
    takes the nonblocking form on every rank, run in turn on the comm thread:
    MPI matches a nonblocking collective only with nonblocking ones).  Like
    the posted form, it is never first-call checked (hpccomm._core.execute)."""
    return (Waited(plan[ICALL]), *plan[ARGS:])


def steps(*fns):
    """One plan step doing ``fns`` in order (the Nones left out), or None."""
    todo = [f for f in fns if f is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def in_order():
        for f in todo:
            f()

    return in_order


def sequence(plans, outputs, before=None, after=None, nbytes: int = 0):
    """The plan of an op made of other ops' plans run one after the other (the
    coalesced forms), with steps of its own around them: blocking only."""
    plans = list(plans)

    def in_turn():
        for p in plans:
            run(p)

    return (in_turn, (), None, outputs, plans, before, after, nbytes)


def blocking(call, outputs, keep=None, nbytes: int = 0):
    """The plan of an op whose blocking form is ``call()`` (several MPI calls,
    or one chosen per rank, steps included), with no nonblocking form."""
    return (call, (), None, outputs, keep, None, None, nbytes)
