"""All-to-all: all_to_all_single (even and uneven splits) and all_to_all (lists).

Each function here is one op's plan function (see :mod:`hpccomm._core.plan`).
"""
from __future__ import annotations

import itertools
import math

import torch

from .. import _mpi
from . import arguments, checks, staging


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
        checks.end_job(group, checks.OpValueError(op, group.where(), why,
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


def all_to_all_single(group, output, input, output_splits, input_splits, op: str = "all_to_all_single"):
    checks.check_pair(group, op, output, input)
    scounts = checks.split_counts(group, op, input, input_splits, "input")
    rcounts = checks.split_counts(group, op, output, output_splits, "output")
    _check_counts(group, op, scounts, rcounts)

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


def alltoall(group, outputs, inputs, op: str = "all_to_all"):
    arguments.alltoall(group, outputs, inputs, op)
    _check_counts(group, op, [t.numel() for t in inputs], [t.numel() for t in outputs])

    scounts = [t.numel() for t in inputs]
    rcounts = [t.numel() for t in outputs]
    send, before = staging.joined(inputs, sum(scounts), inputs[0])
    recv, after = staging.split(outputs, rcounts, inputs[0], send)

    def run():
        _alltoallv(group, send, scounts, recv, rcounts)

    return (run, (), None, outputs, (inputs, outputs, send, recv), before, after,
              sum(scounts) * send.element_size())
