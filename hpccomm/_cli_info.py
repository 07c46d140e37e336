"""``hpccomm info``: what hpccomm sees on this rank."""
from __future__ import annotations

import json


def info() -> dict:
    import torch

    from . import __version__, _mpi, config

    MPI = _mpi.mpi()
    return {
        "hpccomm": __version__,
        "torch": torch.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "mpi_library": _mpi.library_version(),
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "thread_level": _mpi.thread_level(),
        "rank": MPI.COMM_WORLD.Get_rank(),
        "size": MPI.COMM_WORLD.Get_size(),
        "processor": MPI.Get_processor_name(),
        "options": {name: opt.get() for name, opt in config.OPTIONS.items()},
    }


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    report = info()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:14s} {value}")
    return 0
