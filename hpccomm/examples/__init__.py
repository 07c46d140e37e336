"""Example programs, each run as ``mpirun -n N python -m hpccomm.examples.<name>``.

- ``train_ddp``: DistributedDataParallel training on synthetic data, with a
  progress line, a final check that every rank holds identical weights, and
  ``--bench`` / ``--backend gloo`` to time hpccomm against torch's gloo.
- ``train_lightning``, ``train_accelerate``, ``train_transformers``: the same
  kind of training through Lightning's Trainer, Accelerate and the
  transformers Trainer (docs/frameworks.md; they need the ``frameworks``
  extra), each checking that hpccomm carried it and that the weights equal
  a one-process run on the world's batches.
- ``train_elastic``: DDP training that loses a rank mid-run (fault tolerance:
  ``mpirun --with-ft ulfm``) and finishes on the survivors with identical
  weights, printing how long the recovery took.
- The programs of the torch.distributed tutorial
  (https://pytorch.org/tutorials/intermediate/dist_tuto.html), for hpccomm:
  ``p2p_blocking``, ``p2p_nonblocking``, ``allreduce_group``,
  ``ring_allreduce`` and ``dist_sgd``.

Each checks its own result and exits non-zero, on every rank, if it is
wrong.  Nothing in the library imports these modules.
"""
