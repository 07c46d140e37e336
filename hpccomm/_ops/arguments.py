"""Each op's argument checks on their own: what a transport that runs a call
itself (NCCL: hpccomm._gpu.nccl_wire) checks first, so that what hpccomm's CPU
path refuses it refuses alike, with the same messages, before anything is
allocated or sent.

The plan functions (hpccomm._ops.reduce, gather, scatter, alltoall, p2p) run
the same checks inline, interleaved with building the plan: on the CPU path,
where every op pays for every call frame, that is a frame fewer.
tests/test_gpu_unit.py holds the two to the same verdict, message for message,
on a bank of bad calls of every op.  What only MPI needs (its int count limit
on all_to_all's displacements) stays the plans' own: NCCL has no such limit.
"""
from __future__ import annotations

import torch

from . import checks


def all_reduce(group, tensors, redop, op: str = "all_reduce"):
    try:
        t = checks.single(group, op, tensors)
    except checks.OpTypeError:  # (as the plan: a sparse COO tensor is the sparse all_reduce's)
        t = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else None
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            checks.sparse_sum(group, op, tensors, redop)
            return
        raise
    checks.reduction(group, op, t.dtype, redop)


def all_reduce_coalesced(group, tensors, redop, op: str = "all_reduce_coalesced"):
    if not isinstance(tensors, (list, tuple)):
        checks.check_list(group, op, tensors, 0, "tensors")
    checks.check_tensors(group, op, tensors)
    for t in tensors:
        checks.reduction(group, op, t.dtype, redop)


def reduce(group, tensors, root: int, redop, op: str = "reduce"):
    t = checks.single(group, op, tensors)
    checks.check_root(group, op, root, "dst")
    checks.reduction(group, op, t.dtype, redop)


def reduce_scatter_tensor(group, output, input, redop, op: str = "reduce_scatter_tensor"):
    checks.check_pair(group, op, output, input, "input")
    checks.reduction(group, op, input.dtype, redop)


def reduce_scatter(group, outputs, input_lists, redop, op: str = "reduce_scatter"):
    output = checks.single(group, op, outputs, "output_tensors", "output")
    checks.per_rank(group, op, input_lists, "input_tensor_lists", "input_list", output, "output",
                    "Every input must have the output's size")
    checks.reduction(group, op, output.dtype, redop)


def reduce_scatter_tensor_coalesced(group, outputs, inputs, redop, op: str = "reduce_scatter_tensor_coalesced"):
    checks.check_list(group, op, inputs, len(outputs), "inputs")
    for o, i in zip(outputs, inputs):
        reduce_scatter_tensor(group, o, i, redop, op)


def broadcast(group, tensors, root: int, op: str = "broadcast"):
    checks.single(group, op, tensors)
    checks.check_root(group, op, root, "src")


def scatter(group, outputs, input_lists, root: int, op: str = "scatter"):
    output = checks.single(group, op, outputs, "output_tensors", "output")
    checks.rooted(group, op, root, "src", input_lists, "input_tensor_lists", "scatter_list", output,
                  "the output", "scatter needs tensors of the output's size")


def all_gather_into_tensor(group, output, input, op: str = "all_gather_into_tensor"):
    checks.check_pair(group, op, output, input, "output")


def all_gather(group, output_lists, inputs, op: str = "all_gather"):
    input = checks.single(group, op, inputs, "input_tensors", "input")
    outputs = checks.per_rank(group, op, output_lists, "output_tensor_lists", "tensor_list", input)
    checks.check_own_slot(group, op, outputs, input)


def all_gather_coalesced(group, output_lists, inputs, op: str = "all_gather_coalesced"):
    checks.check_list(group, op, inputs, len(inputs), "input_tensor_list")
    checks.check_list(group, op, output_lists, group.size, "output_tensor_lists")
    for r, outs in enumerate(output_lists):
        checks.check_list(group, op, outs, len(inputs), f"output_tensor_lists[{r}]")
    for i, inp in enumerate(inputs):
        all_gather(group, [[outs[i] for outs in output_lists]], [inp], op)


def all_gather_into_tensor_coalesced(group, outputs, inputs, op: str = "all_gather_into_tensor_coalesced"):
    checks.check_list(group, op, inputs, len(outputs), "inputs")
    for o, i in zip(outputs, inputs):
        all_gather_into_tensor(group, o, i, op)


def gather(group, output_lists, inputs, root: int, op: str = "gather"):
    input = checks.single(group, op, inputs, "input_tensors", "input")
    checks.rooted(group, op, root, "dst", output_lists, "output_tensor_lists", "gather_list", input,
                  "the input", "gather needs tensors of one size on every rank")


def gather_single(group, output, input, root: int, op: str = "gather_single"):
    checks.check_tensor(group, op, input, "input")
    checks.check_root(group, op, root, "dst")
    if group.rank == root:
        checks.check_pair(group, op, output, input, "output")


def all_to_all_single(group, output, input, output_splits, input_splits, op: str = "all_to_all_single"):
    checks.check_pair(group, op, output, input)
    checks.split_counts(group, op, input, input_splits, "input")
    checks.split_counts(group, op, output, output_splits, "output")


def alltoall(group, outputs, inputs, op: str = "all_to_all"):
    """(The plan function runs these checks through this function: one definition.)"""
    checks.check_list(group, op, outputs, group.size, "output_tensor_list")
    checks.check_list(group, op, inputs, group.size, "input_tensor_list")
    checks.check_tensors(group, op, inputs, "input_tensor_list")
    checks.check_tensors(group, op, outputs, "output_tensor_list")
    dtype = inputs[0].dtype
    checks.check_same_dtype(group, op, inputs, dtype, "input_tensor_list")
    checks.check_same_dtype(group, op, outputs, dtype, "output_tensor_list")


def send(group, tensors, dst: int, tag: int, op: str = "send"):
    checks.message(group, op, tensors, dst, "dst", tag)


def recv(group, tensors, src, tag: int, op: str = "recv"):
    checks.message(group, op, tensors, src, "src", tag)


def barrier(group, op: str = "barrier"):
    """Nothing to check (no arguments)."""
