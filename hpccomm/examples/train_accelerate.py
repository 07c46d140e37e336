"""Accelerate on hpccomm: hpccomm's process group first, then ``Accelerator(cpu=True)``.

    mpirun -n 4 python -m hpccomm.examples.train_accelerate

Needs Accelerate (hpccomm's ``frameworks`` extra: the versions tested).
Accelerate cannot be given the backend's name: on CPU it replaces every name
but ``mpi`` with ``gloo``, and ``PartialState(backend="hpccomm")`` raises
``ValueError: Your assigned backend hpccomm is not available, please use
gloo``.  It does use a process group that is already there, so
``hpccomm.init_process_group()`` comes first and ``Accelerator(cpu=True)``
then trains over hpccomm (Accelerate's own ``state.backend`` still says
``gloo``: ``torch.distributed.get_backend()`` says what runs).  Without
``cpu=True`` on a machine without GPUs, Accelerate sets up no distributed
training at all and every rank trains alone, silently.

Trains a small MLP one epoch on synthetic data and checks, on every rank: the
backend (the default group's and DDP's) is hpccomm, Accelerate counts the
job's processes, the weights equal a one-process run on the world's batches
and are identical on every rank.
"""
from __future__ import annotations

import torch
from torch import nn

import hpccomm

from ._common import run
from ._frameworks import BATCH, LR, mlp, reference_mlp, regression_data, verify


def main() -> int:
    import accelerate
    from accelerate import Accelerator

    hpccomm.init_process_group()            # before Accelerate looks for a process group
    accelerator = Accelerator(cpu=True)     # cpu=True: else no distributed training without GPUs
    size = accelerator.num_processes
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = torch.utils.data.TensorDataset(*regression_data(torch.distributed.get_world_size()))
    # no shuffle: Accelerate hands each rank every size-th batch
    ddp, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=BATCH))
    steps = 0
    for x, y in loader:
        opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(ddp(x), y))
        opt.step()
        steps += 1
    expected = len(data) // (BATCH * torch.distributed.get_world_size())
    return verify("train_accelerate", f"accelerate {accelerate.__version__}", accelerator.unwrap_model(ddp),
                  reference_mlp(torch.distributed.get_world_size()), ddp, size,
                  extra=[(steps == expected, f"{steps} steps, expected {expected}")])


if __name__ == "__main__":
    run(main)
