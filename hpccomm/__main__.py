"""The ``hpccomm`` command.

Each subcommand lives in its own module, which defines ``add_arguments(parser)``
and ``run(args) -> int``; this file only dispatches.  Nothing in hpccomm
imports the command-line modules.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help).  Modules are imported only when used.
SUBCOMMANDS = {
    "info": ("hpccomm._cli_info", "diagnose: versions, MPI library, thread level, launcher, ranks, network, store port, options"),
    "bench": ("hpccomm.bench", "collective benchmark (run under mpirun)"),
    "jobs": ("hpccomm.jobs", "SLURM job templates: list, render, submit; preflight checks inside a job"),
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
