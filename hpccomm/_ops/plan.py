"""The plan: what one call of an op needs, stated once by its op module.

A plan is what one call of an op needs, stated once by its op module's plan
function (``reduce.all_reduce(group, tensors, redop)`` ...) after every check
passed, and executed by :mod:`hpccomm._core.op_path` in whichever form the call
takes: blocking in the calling thread, on the comm thread (``async_op=True``),
posted as a nonblocking MPI call, or through a GPU transport, which wraps it
(:mod:`hpccomm._gpu`).  A plan function never communicates: every refusal is
raised before anything is sent.  A plan is a tuple (one is made per call, and
a tuple costs a fraction of an object's constructor), its fields in the order
of :data:`FIELDS` (indexes :data:`CALL` ... :data:`NBYTES`):

``call``
    the blocking form, run as ``call(*args)``: the MPI call (a bound method of
    the group's communicator, such as ``comm.Allreduce``), or a function that
    makes it with the op's steps around it (:func:`with_steps`), or several;
    None for point-to-point ops, which are always posted;
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
    division (None: none).  ``call`` runs them; the posted form runs them
    around ``icall`` and the request's completion;
``nbytes``
    the bytes of this rank's input (the posted form is taken up to
    ``hpccomm._core.op_path.NONBLOCKING_MAX_BYTES``).

Example: a blocking all_reduce of a contiguous float32 tensor ``t`` has the
plan ``(comm.Allreduce, (MPI_IN_PLACE, [t's memory, n, MPI_FLOAT], MPI_SUM),
comm.Iallreduce, [t], t, None, None, 4 * n)``.

The parts of a plan that depend only on the dtype and the ReduceOp (the same
on every rank), the MPI op and datatype and whether the reduction has a
nonblocking form, are computed once per pair and cached
(:func:`hpccomm._ops.checks.reduction`).
"""
from __future__ import annotations


#: The fields of a plan, in order, and their indexes (see the module docstring).
FIELDS = ("call", "args", "icall", "outputs", "keep", "before", "after", "nbytes")
CALL, ARGS, ICALL, OUTPUTS, KEEP, BEFORE, AFTER, NBYTES = range(len(FIELDS))


class Stepped:
    """The blocking form of a plan whose MPI call (or function) ``call`` has
    steps around it: ``before()``, ``call(*args)``, ``after()`` (either step
    may be None).  A GPU transport reaches ``call`` to put its own steps in
    between (hpccomm._gpu.cuda_mpi)."""

    __slots__ = ("before", "call", "after")

    def __init__(self, before, call, after) -> None:
        self.before, self.call, self.after = before, call, after

    def __call__(self, *args) -> None:
        if self.before is not None:
            self.before()
        self.call(*args)
        if self.after is not None:
            self.after()


def with_steps(call, args, icall, outputs, keep, before, after, nbytes: int):
    """The plan of an MPI call (or function) ``call`` with steps around it
    (``before``, ``after``, either may be None): its blocking form runs them
    around the call (:class:`Stepped`)."""
    if before is None and after is None:
        return (call, args, icall, outputs, keep, None, None, nbytes)
    return (Stepped(before, call, after), args, icall, outputs, keep, before, after, nbytes)


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


def sequence(plans, outputs, nbytes: int = 0):
    """The plan of an op made of other ops' plans run one after the other (the
    coalesced forms): blocking only."""
    plans = list(plans)

    def run():
        for p in plans:
            p[CALL](*p[ARGS])

    return (run, (), None, outputs, plans, None, None, nbytes)


def blocking(run, outputs, keep=None, nbytes: int = 0):
    """The plan of an op whose blocking form is ``run()`` (several MPI calls,
    or one chosen per rank, steps included), with no nonblocking form."""
    return (run, (), None, outputs, keep, None, None, nbytes)
