"""Debugging aids: :func:`hpccomm.explain`, what hpccomm would hand MPI for a
call, without making it; :func:`hpccomm.dump_flight_record`, this rank's last
ops written where torch's flight-recorder analyser reads them.

A supported debugging aid (and what the tests ask instead of patching the op
path): the op's checks run (a refusal raises as the call would), its plan (hpccomm._core.plan) is made and the form the call would
take is decided (hpccomm._ops.op_path.form), and both are described.
"""
from __future__ import annotations

from typing import NamedTuple

from . import _mpi
from ._core import flight, signatures
from ._core.plan import AFTER, ARGS, BEFORE, CALL, ICALL, NBYTES
from ._ops.op_path import form
from ._ops.registry import BY_NAME
from . import _compat as compat
from .errors import HpccommError


class Explained(NamedTuple):
    """What hpccomm would hand MPI for one call (returned by :func:`hpccomm.explain`).

    :param op: the op's name (``"all_reduce"``).
    :param where: ``"here"`` (blocking, in the calling thread), ``"posted"``
        (a nonblocking MPI call posted here, completed by its Work) or
        ``"queued"`` (on hpccomm's comm thread, in issue order).
    :param call: the MPI call it makes (``"Allreduce"``, ``"Iallreduce"``),
        or ``""`` where it makes several, in Python.
    :param buffers: each MPI buffer argument, ``"IN_PLACE"`` or
        ``(address, count)`` (the count as MPI is given it).
    :param before: a step runs before the MPI call (a strided or aliased
        tensor copied into a contiguous buffer, PREMUL_SUM's scaling).
    :param after: a step runs after it (a strided output's write-back,
        AVG's division, a list output copied out).
    :param nbytes: the bytes of this rank's input.
    :param compared: the ranks compare the call before it runs (its signature
        is new to the group, or debug mode is on: docs/troubleshooting.md).

    Example::

        Explained(op='all_reduce', where='here', call='Allreduce',
                  buffers=('IN_PLACE', (94006168942784, 4)), before=False, after=False, nbytes=16,
                  compared=False)
    """

    op: str
    where: str
    call: str
    buffers: tuple
    before: bool
    after: bool
    nbytes: int
    compared: bool = False


def explain(op: str, *args, group=None, async_op: bool = False) -> Explained:
    """What hpccomm would hand MPI for op ``op`` called with ``args`` on a
    group, without communicating: the op's checks run (a refusal raises, as
    the call would), and its plan is described.  A supported debugging aid:
    ask it whether a call is zero-copy, in place, or posted.

    :param op: the op's name, as hpccomm names it (``"all_reduce"``,
        ``"all_gather_into_tensor"``, ``"send"``; hpccomm._ops.registry lists them).
    :param args: the op's arguments as torch hands them to a backend:
        tensors in lists, ReduceOps, group ranks (``"all_reduce", [t],
        dist.ReduceOp.SUM``; ``"broadcast", [t], root``; ``"send", [t], peer, tag``).
    :param group: the torch process group (default: the default group); an
        hpccomm group.
    :param async_op: describe the call as ``async_op=True`` (the form it takes).
    :returns: an :class:`hpccomm.Explained`.
    :raises hpccomm.OpError: the call would be refused (the same message).
    :raises hpccomm.HpccommError: ``group`` is not an hpccomm group.
    :raises KeyError: ``op`` is not an op hpccomm runs.

    Example::

        e = hpccomm.explain("all_gather_into_tensor", out, out[rank * n:(rank + 1) * n])
        e.call, e.buffers[0]       # ('Allgather', 'IN_PLACE'): FSDP's layout, no copy
    """
    g = compat.group_of(compat.world_group() if group is None else group)
    if g is None:
        raise HpccommError(f"hpccomm.explain: {group!r} is not an hpccomm process group")
    info = BY_NAME[op]
    call = info.check(g, *args)  # (a refusal raises here, announced to no one: nothing was called)
    plan = info.plan(g, call, args)
    where, nonblocking = form(g, info, plan, async_op)
    made = plan[ICALL] if nonblocking else plan[CALL]
    buffers = tuple("IN_PLACE" if a is _mpi.IN_PLACE else (a[0].address, a[1]) for a in plan[ARGS]
                    if a is _mpi.IN_PLACE or (isinstance(a, list) and len(a) == 3))
    mpi_call = type(getattr(made, "__self__", None)).__module__ == "mpi4py.MPI"  # else Python making several
    return Explained(info.name, where, made.__name__ if mpi_call else "", buffers, plan[BEFORE] is not None,
                     plan[AFTER] is not None, plan[NBYTES],
                     not info.p2p and where != "posted" and signatures.compared(g, call))


def dump_flight_record() -> str:
    """Write this rank's flight record now: the last ops of each of its hpccomm
    groups (``HPCCOMM_FR_BUFFER_SIZE`` per group: name, element counts and
    dtypes, state, start time, op numbers), to the file torch's own backends
    write theirs to: ``TORCH_FR_DUMP_TEMP_FILE`` followed by this rank's world
    rank (unset: torch's default, ``$XDG_CACHE_HOME/torch/comm_lib_trace_rank_``,
    else ``~/.cache/torch/comm_lib_trace_rank_``), replacing the last one.
    hpccomm writes it by itself on a timeout, a mismatch, a failed rank and
    before it ends the job; call this on every rank (a hang you are looking
    into from another thread, say) and read them together with
    ``python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX``
    (docs/troubleshooting.md).

    :returns: the path written.
    :raises hpccomm.HpccommError: the recorder is off (``HPCCOMM_FR_BUFFER_SIZE=0``)
        or no hpccomm group exists.
    :raises OSError: the file could not be written.

    Example::

        path = hpccomm.dump_flight_record()   # '/home/me/.cache/torch/comm_lib_trace_rank_0'
    """
    return flight.write("on request (hpccomm.dump_flight_record)")
