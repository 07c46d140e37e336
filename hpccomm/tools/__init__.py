"""The tools, apart from the library: what the ``hpccomm`` command runs.

- :mod:`~hpccomm.tools.info`: ``hpccomm info``, what each rank sees and what is wrong;
- :mod:`~hpccomm.tools.bench`: ``hpccomm bench``, an nccl-tests-style sweep of every collective,
  side by side with gloo, raw mpi4py and the floor;
- :mod:`~hpccomm.tools.bench_gpu`: ``hpccomm bench-gpu``, CUDA tensors' routes side by side;
- :mod:`~hpccomm.tools.jobs`: ``hpccomm jobs``, the SLURM templates and the preflight inside a job;
- :mod:`~hpccomm.tools.demo`: ``hpccomm demo``, a short checked demonstration.

Each module has ``add_arguments(parser)`` and ``run(args) -> int`` (``hpccomm.__main__``
dispatches); ``python -m hpccomm <tool>`` is the same as the ``hpccomm`` command.  Like any user,
a tool may import anything of the library; nothing in the library imports a tool
(tests/test_layers.py).
"""
