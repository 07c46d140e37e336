"""hvd.init's forms, each in the same 3-rank job (tests/test_horovod.py launches it).

Every rank prints ``init_forms: all checks passed`` and exits 0, or prints
what was wrong and exits 1."""
import os
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

import hpccomm.horovod as hvd

world = MPI.COMM_WORLD
me = world.Get_rank()
problems = []


def expect(ok, what):
    if not ok:
        problems.append(str(what))


def raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - checked by the caller
        return exc
    return None


os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
# The order matters: hpccomm caches the world's peers at its first init (see the
# lead's note on hpccomm._core.signals), so the first init here spans every rank.

# 1. bad arguments, then the default form mixed with plain torch.distributed calls
exc = raised(lambda: hvd.init(comm="world"))
expect(isinstance(exc, ValueError) and "Invalid type of argument comm" in str(exc), exc)
exc = raised(lambda: hvd.init(process_sets="static"))
expect(isinstance(exc, ValueError) and "expected a list of hvd.ProcessSet or 'dynamic'" in str(exc), exc)
exc = raised(lambda: hvd.init(process_sets=[hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 0])]))
expect(isinstance(exc, ValueError) and "process_sets entry number 1 is a duplicate" in str(exc), exc)
expect(not hvd.is_initialized() and not dist.is_initialized(), "a failed init left Horovod initialised")
exc = raised(lambda: hvd.init(process_sets=["evens"]))
expect(isinstance(exc, ValueError) and "process_sets entry number 0 is a str, not an hvd.ProcessSet" in str(exc), exc)
exc = raised(lambda: hvd.init(process_sets=[hvd.ProcessSet([0, 7])]))
expect(isinstance(exc, ValueError) and "names rank(s) [7] outside the world of size 3" in str(exc), exc)
exc = raised(lambda: hvd.init(comm=[0, 5]))
expect(isinstance(exc, ValueError) and "every entry must be a rank of MPI_COMM_WORLD (0..2)" in str(exc), exc)
hvd.init()
exc = raised(lambda: hvd.add_process_set([0]))
expect(isinstance(exc, ValueError) and "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding" in str(exc), exc)
exc = raised(lambda: hvd.remove_process_set(hvd.global_process_set))
expect(isinstance(exc, ValueError) and "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing" in str(exc), exc)
model = torch.nn.Linear(2, 1)
stale = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
hvd.shutdown()
hvd.init()
model(torch.ones(1, 2)).sum().backward()
exc = raised(stale.step)
expect(isinstance(exc, ValueError) and "this optimizer was made before hvd.shutdown()" in str(exc), exc)
hvd.shutdown()
# torch.distributed initialised by the program: hvd.init() uses it, and refuses a communicator
import hpccomm  # noqa: E402

hpccomm.init_process_group()
exc = raised(lambda: hvd.init(comm=MPI.COMM_WORLD))
expect(isinstance(exc, ValueError) and "torch.distributed is already initialised, so its default group is "
       "Horovod's world" in str(exc), exc)
hvd.init()
expect(hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 3.0, "hvd on the program's group")
hvd.shutdown()
expect(dist.is_initialized(), "hvd.shutdown ended a torch.distributed it did not start")
dist.destroy_process_group()
hvd.init(process_sets="dynamic")
t = torch.ones(3)
dist.all_reduce(t)
expect(t.tolist() == [3.0] * 3, t)
expect(hvd.allreduce(t, op=hvd.Sum).tolist() == [9.0] * 3, "hvd after dist")
dist.barrier()
hvd.init()  # a no-op
pair = hvd.add_process_set([0, 1])
if pair.included():
    expect(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair).item() == 2.0, "dynamic set")
expect(hvd.remove_process_set(pair), "remove")
hvd.shutdown()
expect(not hvd.is_initialized() and not dist.is_initialized(), "shutdown after init() should end torch.distributed")
world.Barrier()

# 2. a list of MPI_COMM_WORLD ranks: only those ranks call init
if me in (0, 2):
    hvd.init(comm=[0, 2])
    expect(hvd.size() == 2 and hvd.rank() == (0 if me == 0 else 1), (hvd.size(), hvd.rank()))
    expect(hvd.allgather(torch.tensor([me])).tolist() == [0, 2], "allgather over [0, 2]")
    hvd.shutdown()
else:
    exc = raised(lambda: hvd.init(comm=[0, 2]))
    expect(isinstance(exc, ValueError) and "rank 1 of MPI_COMM_WORLD is not in the list" in str(exc), exc)
world.Barrier()

# 3. an mpi4py communicator: ranks {0, 1} and {2} each form their own Horovod world;
#    a process set made from a communicator (COMM_SELF: each rank alone) at init
sub = world.Split(color=0 if me < 2 else 1, key=me)
alone = hvd.ProcessSet(MPI.COMM_SELF)
hvd.init(comm=sub, process_sets=[alone])
expect(hvd.size() == sub.Get_size() and hvd.rank() == sub.Get_rank(), (hvd.size(), hvd.rank()))
expect(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(sub.Get_size())] * 2, "allreduce on comm")
expect(alone.ranks == [hvd.rank()] and alone.size() == 1 and alone.included(), str(alone))
expect(hvd.allreduce(torch.full((1,), 5.0), op=hvd.Sum, process_set=alone).item() == 5.0, "allreduce on COMM_SELF set")
hvd.shutdown()
expect(not hvd.is_initialized() and not dist.is_initialized(), "shutdown left something initialised")
sub.Free()
world.Barrier()

verdicts = world.allgather(problems)
for r, ps in enumerate(verdicts):
    for p in ps:
        print(f"init_forms: WRONG on rank {r}: {p}", flush=True)
if any(verdicts):
    sys.exit(1)
print("init_forms: all checks passed", flush=True)
