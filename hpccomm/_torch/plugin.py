"""How torch finds hpccomm, with or without ``import hpccomm``.

Two entry points (setup.cfg) and ``import hpccomm`` itself call into here;
the entry points go through ``_hpccomm_entry`` (a module beside the package,
which imports whatever state the package is in, and says what is wrong):

- ``torch.distributed.backends``: ``hpccomm = _hpccomm_entry:register``.
  torch >= 2.14 loads it the first time a backend string names ``hpccomm``,
  so ``dist.init_process_group("hpccomm")`` works without ``import hpccomm``.
- ``torch.backends``: ``hpccomm = _hpccomm_entry:autoload``.  torch loads
  these device-extension entry points at ``import torch`` (torch >= 2.5;
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns them off).  hpccomm uses it to
  register itself before torch's rendezvous runs: torch's default
  ``init_method`` is ``env://``, whose handler needs RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT before any backend is loaded.  Under an MPI
  launcher, when the rank or MASTER_ADDR/MASTER_PORT are missing, hpccomm's
  env:// handler takes rank, size and the key-value store from MPI instead
  (for any backend, and for ``torch.distributed.rpc.init_rpc``); with all of
  them set, it is torch's handler unchanged.  Without any launcher (a plain
  ``python train.py``), ``dist.init_process_group("hpccomm")`` gets a world
  of one from MPI, as ``hpccomm.init_process_group()`` does; other backends
  get torch's handler unchanged.

Everything here is cheap and never raises into ``import torch``: nothing is
imported beyond torch.distributed until a process group or a rendezvous is
actually made, and nothing of the package is imported when this module is
(an install made before ``_hpccomm_entry`` existed names :func:`autoload`
here directly, and must not fail where the package does not import).
"""
from __future__ import annotations

import os
import sys

_registering = [False]  # True while register() runs (it may import torch, whose autoload calls back)


def register() -> None:
    """Register the backend ``"hpccomm"`` and the ``mpi://`` rendezvous with
    torch, and let env:// take rank and size from MPI under an MPI launcher
    (see the module docstring).  Idempotent; MPI is not started."""
    _registering[0] = True
    try:
        if _stand_in() is not None:  # (autoload's line names the folder)
            raise ImportError("`import hpccomm` finds a folder named hpccomm, not the package")
        from .._about import BACKEND_NAME
        from .. import _compat as compat

        if not compat.distributed_available():
            return
        compat.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
        compat.register_rendezvous_handler("mpi", _mpi_rendezvous)
        compat.wrap_env_rendezvous(_env_or_mpi)
    finally:
        _registering[0] = False


def autoload() -> None:
    """torch's device-extension autoload calls this at ``import torch``
    (through ``_hpccomm_entry``): :func:`register`, never raising (a failure
    here would fail ``import torch``): what stops it is said once on stderr.
    When ``import hpccomm`` came first, its own registration is what imports
    torch: that one completes once torch is imported, so nothing is done here."""
    if _registering[0]:
        return
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - never break `import torch`
        if _said:
            return
        _said.append(True)
        print(_why_not(exc), file=sys.stderr, flush=True)


_said: list = []  # autoload's line is said once per process


def _stand_in():
    """The namespace package that ``import hpccomm`` found in this package's
    place (a folder named hpccomm without ``__init__.py``, such as a clone's
    folder seen from the folder holding it), or None."""
    package = sys.modules.get(__name__.split(".")[0])
    return package if package is not None and getattr(package, "__file__", None) is None else None


def _why_not(exc) -> str:
    """The line :func:`autoload` says when :func:`register` raised ``exc``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this package's folder
    package = _stand_in()
    if package is not None:
        folders = ", ".join(getattr(package, "__path__", None) or ["?"])
        return (f"hpccomm: `import hpccomm` here finds the folder {folders} (a folder named hpccomm without "
                f"__init__.py), not the hpccomm package ({here}); torch goes on without hpccomm. Run from another "
                f"folder, or install hpccomm again (pip install -e {os.path.dirname(here)}): an editable install "
                "made now puts the checkout itself on sys.path, where the package comes before such a folder")
    version = getattr(sys.modules.get("torch"), "__version__", "")
    return (f"hpccomm: could not register itself with torch {version} ({type(exc).__name__}: {exc}); "
            "torch goes on without hpccomm (`import hpccomm` raises the error)")


def _create(opts, backend_options=None):
    """The backend creator torch calls (see :func:`hpccomm._start.creator.create`);
    with it, recovery (:mod:`hpccomm.fault_tolerance`, which a Backend's
    ``shrink`` reaches) is loaded too."""
    from .. import fault_tolerance
    from .._start import creator

    made = creator.create(opts, backend_options)
    fault_tolerance.follow_mode()
    return made


def _mpi_rendezvous(url: str = "mpi://", **kwargs):
    """``init_method="mpi://"``: rank, size and the store from MPI."""
    from .._start.bootstrap import _mpi_rendezvous as rendezvous

    return rendezvous(url, **kwargs)


def _env_or_mpi(env_handler):
    """torch's env:// handler, or MPI's rendezvous when env:// lacks what it
    needs (the rank, or MASTER_ADDR/MASTER_PORT) and either an MPI launcher
    started this process (rank, size and the store then come from MPI; a
    rank or world size given anyway must agree with MPI's) or no launcher did
    and the backend asked for is hpccomm (a plain ``python train.py``: a
    world of one, as ``hpccomm.init_process_group()`` gives there)."""
    def handler(url: str, **kwargs):
        from urllib.parse import parse_qs, urlparse

        query = parse_qs(urlparse(url).query)
        rank = query.get("rank", [os.environ.get("RANK")])[0]
        complete = rank is not None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
        if complete or not (_mpi_launched() or _alone_asking_for_hpccomm()):
            return env_handler(url, **kwargs)
        from .._start.bootstrap import _mpi_rendezvous as rendezvous

        size = int(query.get("world_size", [os.environ.get("WORLD_SIZE", "-1")])[0])
        return rendezvous(url, expect_size=size if size > 0 else None,
                          expect_rank=int(rank) if rank is not None and int(rank) >= 0 else None, **kwargs)

    handler.hpccomm = True  # marks the wrapper, so it is installed once
    handler.wrapped = env_handler
    return handler


def _alone_asking_for_hpccomm() -> bool:
    """Whether no launcher started this process and the
    ``dist.init_process_group`` being run names the backend hpccomm."""
    from .. import launcher
    from .._about import BACKEND_NAME
    from .. import _compat as compat

    backend = compat.requested_backend()
    return launcher.detect().name == "single" and backend is not None and BACKEND_NAME in backend.lower()


def _mpi_launched() -> bool:
    """Whether an MPI launcher (mpirun, mpiexec, srun with a PMI plugin)
    started this process: pure environment parsing."""
    from .. import launcher

    launch = launcher.detect()
    return launch.name in ("openmpi", "mpich", "intelmpi", "srun") and bool(launch.size)
