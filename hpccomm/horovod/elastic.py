"""Horovod's elastic training (``hvd.elastic``) is not part of hpccomm.horovod.

Importing this module raises ImportError saying so: an MPI job's set of ranks
is fixed when it starts, and hpccomm has no rendezvous that adds or removes
workers.  Restarting a failed job from a checkpoint (``jobs/preempt.sbatch``
requeues) is the MPI way.
"""
raise ImportError(
    "hpccomm.horovod.elastic: Horovod's elastic mode (hvd.elastic.run, hvd.elastic.TorchState, "
    "ElasticSampler) is not supported by hpccomm.horovod: an MPI job keeps the ranks it started with. "
    "Checkpoint and requeue the job instead (see docs/horovod.md)")
