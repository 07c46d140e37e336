"""All-to-all: all_to_all_single (even and uneven splits) and all_to_all
(lists); each op's whole story here (checks, signature, plan, NCCL form) and
its declaration (:class:`~hpccomm._ops.op.Op`) at the end.

Their signatures carry what must fit together rather than be equal: what
this rank sends to each peer and expects from each (``Signature.pairs``):
rank i's send to j must be what j expects from i.
"""
from __future__ import annotations

import itertools
import math

import torch

from .. import _mpi
from .._core import failures
from . import checks, staging
from .op import Call, Op, Signature


def _layout(counts):
    return list(counts), [0, *itertools.accumulate(counts)][:-1]


def _unit(counts, displs, limit: int) -> int:
    """The block of elements (1: one element) in which ``counts`` and their
    offsets ``displs`` are described to MPI within ``limit``: past MPI's int
    counts, the gcd of them all; 0 when none brings them under it."""
    top = max([*counts, *displs, 0])
    if top <= limit:
        return 1
    g = math.gcd(*counts, *displs)
    return g if g and top // g <= limit else 0


def _fits(counts, limit: int) -> str:
    """Why ``counts`` (laid end to end) cannot be described to MPI within
    ``limit`` (empty: they can)."""
    counts, displs = _layout(counts)
    if _unit(counts, displs, limit):
        return ""
    return (f"a count or offset of {max([*counts, *displs, 0])} elements is past the MPI count limit {limit}, "
            "and the counts and offsets (in elements) share no common block size that brings them under it")


def _check_counts(group, op: str, scounts, rcounts) -> None:
    """Counts MPI cannot be given, found before any communication.  Only a
    rank with peers can meet them (one count always has a block: itself),
    and its peers (what it sends they receive: their counts are past the
    limit too) may have found a block and be inside MPI already: so the job
    ends with the reason rather than leaving them waiting."""
    why = _fits(scounts, group.max_count) or _fits(rcounts, group.max_count)
    if why:
        failures.refused_alone(group, checks.OpValueError(op, group.where(), why,
                                                          "Use split sizes with a common factor, such as a row length"))


def _spec(t: torch.Tensor, counts, displs, limit: int):
    """``[memory, (counts, displs), datatype]``; past MPI's int counts the unit
    becomes a contiguous block of g elements (g = gcd of counts and displs;
    :func:`_check_counts` refused counts that have none).  Each rank picks its
    own unit: MPI matches type signatures, not datatypes.  Also the committed
    block datatype to free afterwards, or None."""
    spec = _mpi.buffer(t)
    g = _unit(counts, displs, limit)
    if g == 1:
        spec[1] = (counts, displs)
        return spec, None
    unit = spec[2] = spec[2].Create_contiguous(g).Commit()
    spec[1] = ([k // g for k in counts], [d // g for d in displs])
    return spec, unit


def _alltoallv(group, send, scounts, recv, rcounts):
    units = []  # committed block datatypes, freed even when the receive side is refused
    try:
        sspec, unit = _spec(send, *_layout(scounts), group.max_count)
        units.append(unit)
        rspec, unit = _spec(recv, *_layout(rcounts), group.max_count)
        units.append(unit)
        group.comm.Alltoallv(sspec, rspec)
    finally:
        for t in units:
            if t is not None:
                t.Free()


def _signature(op: str, dtype, scounts, rcounts) -> Signature:
    return Signature(op, (), (("dtype", str(dtype).replace("torch.", "")),), (tuple(scounts), tuple(rcounts)))


# ----------------------------------------------------------------------------
# all_to_all_single
# ----------------------------------------------------------------------------

def check_all_to_all_single(group, output, input, output_splits, input_splits, op: str = "all_to_all_single") -> Call:
    """Two tensors of one dtype; each cut into one part per rank by its split
    sizes (rows of dim 0) or evenly."""
    checks.check_pair(group, op, output, input)
    scounts = checks.split_counts(group, op, input, input_splits, "input")
    rcounts = checks.split_counts(group, op, output, output_splits, "output")
    return Call(_signature(op, input.dtype, scounts, rcounts), (scounts, rcounts))


def plan_all_to_all_single(group, call: Call, args):
    """all_to_all_single's plan: MPI_Alltoallv on the tensors' memory (copies
    where strided or aliased); counts past MPI's int limit in blocks."""
    output, input, output_splits, input_splits = args
    scounts, rcounts = call.facts
    _check_counts(group, call.signature.op, scounts, rcounts)  # (MPI's limit: NCCL has none)
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    if input.is_contiguous() and not staging.overlaps(input, out):
        send, before = input, None
    else:  # strided, or aliased with the output: MPI forbids aliased buffers
        send, before = staging.copy_in(input)

    def run():
        _alltoallv(group, send, scounts, out, rcounts)

    return (run, (), None, [output], (input, output, send, out), before, after,
            input.numel() * input.element_size())


def _nccl_all_to_all_single(b, a, o, options):
    return b.alltoall_base(a[0], a[1], list(a[2] or []), list(a[3] or []), options("alltoall", o))


# ----------------------------------------------------------------------------
# all_to_all (lists)
# ----------------------------------------------------------------------------

def check_all_to_all(group, outputs, inputs, op: str = "all_to_all") -> Call:
    """One input and one output per rank, every tensor of one dtype."""
    checks.check_list(group, op, outputs, group.size, "output_tensor_list")
    checks.check_list(group, op, inputs, group.size, "input_tensor_list")
    checks.check_tensors(group, op, inputs, "input_tensor_list")
    checks.check_tensors(group, op, outputs, "output_tensor_list")
    dtype = inputs[0].dtype
    checks.check_same_dtype(group, op, inputs, dtype, "input_tensor_list")
    checks.check_same_dtype(group, op, outputs, dtype, "output_tensor_list")
    scounts, rcounts = [t.numel() for t in inputs], [t.numel() for t in outputs]
    return Call(_signature(op, dtype, scounts, rcounts), (scounts, rcounts))


def plan_all_to_all(group, call: Call, args):
    """all_to_all's plan: MPI_Alltoallv, read in place when the inputs are laid
    end to end in one storage (else joined), received likewise."""
    outputs, inputs = args
    scounts, rcounts = call.facts
    _check_counts(group, call.signature.op, scounts, rcounts)  # (MPI's limit: NCCL has none)
    send, before = staging.joined(inputs, sum(scounts), inputs[0])
    recv, after = staging.split(outputs, rcounts, inputs[0], send)

    def run():
        _alltoallv(group, send, scounts, recv, rcounts)

    return (run, (), None, outputs, (inputs, outputs, send, recv), before, after,
            sum(scounts) * send.element_size())


def _nccl_all_to_all(b, a, o, options):
    return b.alltoall(a[0], a[1], options("alltoall", o))


# ----------------------------------------------------------------------------
# the declarations
# ----------------------------------------------------------------------------

ALL_TO_ALL_SINGLE = Op(
    "all_to_all_single", methods=("all_to_all_single",),
    legacy=("alltoall_base",), check=check_all_to_all_single, plan=plan_all_to_all_single,
    nccl=_nccl_all_to_all_single, recorded_as="all_to_all")
ALL_TO_ALL = Op(
    "all_to_all", methods=("alltoall",), check=check_all_to_all, plan=plan_all_to_all,
    nccl=_nccl_all_to_all, stacked=(True, True))

OPS = (ALL_TO_ALL_SINGLE, ALL_TO_ALL)
