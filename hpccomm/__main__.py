"""The ``hpccomm`` command.

Each subcommand lives in its own module of :mod:`hpccomm.tools`, which defines
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches
(``python -m hpccomm <subcommand>`` is the same command).  Nothing in the library
imports the tools.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help).  Modules are imported only when used.
SUBCOMMANDS = {
    "info": ("hpccomm.tools.info", "diagnose: versions, MPI library, thread level, launcher, ranks, network, store port, options"),
    "bench": ("hpccomm.tools.bench", "collective benchmark (run under mpirun)"),
    "bench-gpu": ("hpccomm.tools.bench_gpu", "CUDA tensors' routes side by side (run under mpirun)"),
    "jobs": ("hpccomm.tools.jobs", "SLURM job templates: list, render, submit; preflight checks inside a job"),
    "demo": ("hpccomm.tools.demo", "a few collectives and a short DDP training, checked (run under mpirun)"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hpccomm", description="MPI backend for torch.distributed")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(args._module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
