"""Lightning's Trainer on hpccomm: ``DDPStrategy(process_group_backend="hpccomm")``.

    mpirun -n 4 python -m hpccomm.examples.train_lightning

Needs Lightning (hpccomm's ``frameworks`` extra: the versions tested).
Lightning finds the ranks itself under ``mpirun``: its ``MPIEnvironment``
(chosen when mpi4py reports more than one process) gives rank, size and the
rank's place on its node, and the strategy then calls
``torch.distributed.init_process_group("hpccomm")`` with them.  What Lightning
cannot find is how many ranks share a node: ``devices`` (processes per node
on CPU) and ``num_nodes`` must be given, here from ``hpccomm.launcher()``
(the launcher's variables, nothing started).  Without ``devices`` every rank
but the first stops with ``IndexError: list index out of range`` in
``root_device``; a wrong ``num_nodes`` gives the data sampler the wrong
number of replicas.

Trains a small MLP one epoch on synthetic data and checks, on every rank: the
backend (the default group's and DDP's) is hpccomm, the cluster environment
is MPIEnvironment, Lightning's world size is the job's, the weights equal a
one-process run on the world's batches and are identical on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import hpccomm

from ._common import output_is_terminal, run
from ._frameworks import BATCH, LR, mlp, reference_mlp, regression_data, verify


def main() -> int:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    class KeepDDP(L.Callback):
        """The model as the strategy wrapped it for training (it unwraps it at the end)."""

        def on_train_start(self, trainer, pl_module) -> None:
            self.ddp = trainer.strategy.model

    launch = hpccomm.launcher()  # ranks per node and nodes, from the launcher's variables
    nodes = launch.size // launch.local_size
    trainer = L.Trainer(accelerator="cpu", devices=launch.local_size, num_nodes=nodes,
                        strategy=DDPStrategy(process_group_backend="hpccomm"),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=output_is_terminal(),  # no carriage-return bar in a batch log
                        callbacks=[keep := KeepDDP()])
    module = Regression()
    size = launch.size
    data = torch.utils.data.TensorDataset(*regression_data(size))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))

    # Lightning shuffles a training set with a DistributedSampler (seed 0, epoch 0) and hands each rank every
    # size-th sample of that order; its order does not depend on the number of replicas
    order = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    environment = type(trainer.strategy.cluster_environment).__name__
    return verify("train_lightning", f"lightning {L.__version__}", module.net, reference_mlp(size, order),
                  keep.ddp, trainer.world_size, extra=[
                      (environment == "MPIEnvironment", f"Lightning's cluster environment is {environment}, "
                                                        "not MPIEnvironment"),
                      (trainer.strategy.process_group_backend == "hpccomm",
                       f"the strategy's backend is {trainer.strategy.process_group_backend!r}"),
                      (trainer.global_step == len(data) // (BATCH * size),
                       f"{trainer.global_step} steps, expected {len(data) // (BATCH * size)}"),
                      (dist.get_rank() == trainer.global_rank, "Lightning's rank is not torch's")])


if __name__ == "__main__":
    run(main)
