"""Minimal reproducers for the cases where torch's DistributedTest passes on
gloo and fails on hpccomm (docs/torch-suite.md).  Each makes the same call on
a gloo group and on hpccomm's default group, over the same 3 MPI ranks, and
compares with what gloo does::

    mpirun -n 3 --oversubscribe python tests/torch_suite/repro.py all_gather_coalesced
    mpirun -n 3 --oversubscribe python tests/torch_suite/repro.py sparse_all_reduce
    mpirun -n 3 --oversubscribe python tests/torch_suite/repro.py ddp_sparse_embedding
    mpirun -n 3 --oversubscribe python tests/torch_suite/repro.py group_monitored_barrier

Rank 0 prints ``gloo: ...`` and ``hpccomm: ...`` (the result, or the first
line of the error); the exit status is 0 when hpccomm does what gloo does, 1
when it does not.
"""
from __future__ import annotations

import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import hpccomm


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def all_gather_coalesced(group):
    """torch's layout: output_tensor_lists[r][i] is input i of rank r
    (len(output_tensor_lists) == world size; each inner list as long as the inputs)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs = [torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank)]
    outputs = [[torch.empty(2), torch.empty(3)] for _ in range(size)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the function, still ships it
        dist.all_gather_coalesced(outputs, inputs, group=group)
    expected = [[torch.full((2,), float(r)), torch.full((3,), 10.0 + r)] for r in range(size)]
    ok = all(torch.equal(o, e) for os_, es in zip(outputs, expected) for o, e in zip(os_, es))
    return f"{'right' if ok else 'WRONG'}: {[[t.tolist() for t in os_] for os_ in outputs]}", ok


def sparse_all_reduce(group):
    """A sparse COO all_reduce (SUM): every rank gets the sum, coalesced."""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.sparse_coo_tensor([[rank, 4]], [1.0, float(rank)], (5,), check_invariants=True)
    dist.all_reduce(t, group=group)
    expected = torch.zeros(5)
    for r in range(size):
        expected[r] += 1.0
        expected[4] += r
    ok = t.is_sparse and torch.equal(t.to_dense(), expected)
    return f"{'right' if ok else 'WRONG'}: layout {t.layout}, coalesced {t.is_coalesced()}, {t.to_dense().tolist()}", ok


def ddp_sparse_embedding(group):
    """DDP over nn.Embedding(sparse=True): sparse gradients, averaged like dense ones."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Embedding(8, 2, sparse=True), process_group=group)
    model(torch.tensor([rank, 7])).sum().backward()
    grad = model.module.weight.grad
    expected = torch.zeros(8, 2)
    for r in range(size):
        expected[r] += 1.0 / size
        expected[7] += 1.0 / size
    ok = grad.is_sparse and torch.allclose(grad.to_dense(), expected)
    return f"{'right' if ok else 'WRONG'}: sparse grad {grad.is_sparse}, rows {grad.to_dense().sum(1).tolist()}", ok


def group_monitored_barrier(group):
    """ProcessGroup.monitored_barrier (the method; torch's dist.monitored_barrier refuses non-gloo by name)."""
    group.monitored_barrier(timedelta(seconds=30))
    return "returned", True


CASES = {f.__name__: f for f in (all_gather_coalesced, sparse_all_reduce, ddp_sparse_embedding,
                                 group_monitored_barrier)}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print(f"usage: mpirun -n 3 python {sys.argv[0]} {{{','.join(CASES)}}}", file=sys.stderr)
        return 2
    case = CASES[sys.argv[1]]
    hpccomm.init_process_group()
    gloo = dist.new_group(backend="gloo")
    verdicts = {}
    for name, group in (("gloo", gloo), ("hpccomm", dist.group.WORLD)):
        try:
            text, ok = case(group)
        except Exception as exc:  # noqa: BLE001 - the error is the finding
            text, ok = "raised " + _first_line(exc), False
        verdicts[name] = ok
        if dist.get_rank() == 0:
            print(f"{case.__name__} on {name}: {text}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    del gloo  # its last reference: gloo joins its threads now, not during exit (docs/migrating.md)
    return 0 if verdicts["hpccomm"] == verdicts["gloo"] else 1


if __name__ == "__main__":
    sys.exit(main())
