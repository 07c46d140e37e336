"""Capability probes for the GPU transports, asked at run time (never at import).

Each probe answers a :class:`Finding`: a value and how it was determined, so
``hpccomm info`` and the selection log can say why.  The decision functions
(:func:`mpi_cuda_support`) are pure: their inputs (the MPI library's version
string, its info keys, a symbol lookup in the loaded MPI library, the
environment) are gathered by :func:`probe_mpi_cuda` and can be injected by
tests.

How CUDA-awareness is asked, by library:

- any MPI 4.1 library that reports ``mpi_memory_alloc_kinds`` on
  ``MPI_COMM_WORLD``'s info: CUDA-aware when it lists ``cuda:device``;
- Open MPI (and MVAPICH2 >= 2.3.4): ``MPIX_Query_cuda_support()``, an
  extension exported by libmpi (mpi4py 4.1 does not wrap it, so it is called
  through ctypes in the library mpi4py loaded);
- MPICH >= 4 (and MPICH-based libraries that export it):
  ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``;
  ``MPIR_CVAR_ENABLE_GPU=0`` turns GPU support off;
- Cray MPICH: ``MPICH_GPU_SUPPORT_ENABLED=1`` is required;
- Intel MPI: device buffers are accepted only with ``I_MPI_OFFLOAD>=1``;
- MVAPICH2 without the query: ``MV2_USE_CUDA=1``.

Anything else is "unknown" (None), which ``auto`` treats as not CUDA-aware.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional


@dataclass(frozen=True)
class Finding:
    """A probe's answer: ``value`` (True, False, None = unknown, or a number)
    and ``how`` it was determined (one sentence, for logs and ``hpccomm info``)."""

    value: Any
    how: str

    def word(self) -> str:
        if self.value is None:
            return "unknown"
        if isinstance(self.value, bool):
            return "yes" if self.value else "no"
        return str(self.value)


#: MPIX_GPU_SUPPORT_CUDA in MPICH's mpi.h (enum MPIX_GPU_type_t).
MPIX_GPU_SUPPORT_CUDA = 0


def library_family(version: str) -> str:
    """"openmpi", "mvapich", "intel", "cray", "mpich" or "other" from
    ``MPI_Get_library_version``'s text (it chooses which query to ask, not
    the answer)."""
    text = version.lower()
    if "open mpi" in text:
        return "openmpi"
    if "mvapich" in text:
        return "mvapich"
    if "intel" in text:
        return "intel"
    if "cray" in text:
        return "cray"
    if "mpich" in text:
        return "mpich"
    return "other"


def _flag(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return 1 if raw.lower() in ("yes", "true", "on", "enable") else 0


def mpi_cuda_support(library: str, alloc_kinds: Optional[str], symbol: Callable[[str], Optional[Callable]],
                     env: Mapping[str, str]) -> Finding:
    """Whether the MPI library accepts CUDA device memory, and how that was
    determined.

    ``library``: ``MPI_Get_library_version()``.  ``alloc_kinds``: the value of
    the ``mpi_memory_alloc_kinds`` info key of ``MPI_COMM_WORLD`` (None if
    absent).  ``symbol(name)``: a Python callable for an extension function
    of the loaded MPI library, or None; ``MPIX_Query_cuda_support`` takes no
    argument and returns an int, ``MPIX_GPU_query_support`` takes the GPU type
    and returns the flag.  ``env``: the environment.

    Example::

        >>> mpi_cuda_support("Open MPI v5.0.3", None, lambda n: (lambda: 1), {}).how
        'MPIX_Query_cuda_support() returned 1 (Open MPI extension)'
    """
    family = library_family(library)
    name = library.strip().splitlines()[0][:60] if library.strip() else "this MPI library"
    if alloc_kinds is not None:
        kinds = [k.strip() for k in alloc_kinds.split(",") if k.strip()]
        has = any(k == "cuda:device" or k.startswith("cuda:device:") for k in kinds)
        return Finding(has, f"MPI_COMM_WORLD info mpi_memory_alloc_kinds={alloc_kinds!r} "
                            f"{'lists' if has else 'does not list'} cuda:device (MPI 4.1)")
    if family == "intel":
        level = _flag(env, "I_MPI_OFFLOAD")
        if level:
            return Finding(True, f"Intel MPI with I_MPI_OFFLOAD={env['I_MPI_OFFLOAD']}")
        return Finding(False, "Intel MPI accepts device buffers only with I_MPI_OFFLOAD=1 (it is "
                              f"{'unset' if level is None else env['I_MPI_OFFLOAD']})")
    if family in ("mpich", "cray", "mvapich") and _flag(env, "MPIR_CVAR_ENABLE_GPU") == 0:
        return Finding(False, "MPIR_CVAR_ENABLE_GPU=0 turns GPU support off")
    if family == "cray" and _flag(env, "MPICH_GPU_SUPPORT_ENABLED") != 1:
        return Finding(False, "Cray MPICH accepts device buffers only with MPICH_GPU_SUPPORT_ENABLED=1")
    query = symbol("MPIX_Query_cuda_support")
    if query is not None:
        answer = int(query())
        if family == "mvapich" and answer and _flag(env, "MV2_USE_CUDA") != 1:
            return Finding(False, f"MPIX_Query_cuda_support() returned {answer} but MVAPICH2 uses device "
                                  "buffers only with MV2_USE_CUDA=1")
        return Finding(bool(answer), f"MPIX_Query_cuda_support() returned {answer} "
                                     f"({'MVAPICH2' if family == 'mvapich' else 'Open MPI'} extension)")
    query = symbol("MPIX_GPU_query_support")
    if query is not None:
        answer = int(query(MPIX_GPU_SUPPORT_CUDA))
        return Finding(bool(answer), f"MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) set the flag to {answer} "
                                     "(MPICH extension)")
    if family == "mvapich":
        on = _flag(env, "MV2_USE_CUDA") == 1
        return Finding(on, f"MVAPICH2 without MPIX_Query_cuda_support: MV2_USE_CUDA is "
                           f"{env.get('MV2_USE_CUDA') or 'unset'}")
    return Finding(None, f"{name} offers no CUDA-awareness query hpccomm knows "
                         "(no mpi_memory_alloc_kinds info key, no MPIX_Query_cuda_support, "
                         "no MPIX_GPU_query_support)")


# --------------------------------------------------------------------------
# gathering the real inputs
# --------------------------------------------------------------------------

def loaded_libmpi() -> Optional[str]:
    """The path of the MPI library loaded in this process (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                base = os.path.basename(path)
                if base.startswith(("libmpi.so", "libmpich.so", "libmpi_ibm.so", "libmpi_cray.so")):
                    return path
    except OSError:
        pass
    return None


def ctypes_symbol(path: Optional[str]) -> Callable[[str], Optional[Callable]]:
    """``symbol(name)`` over the library at ``path`` (already loaded by mpi4py),
    adapting the two C signatures to the forms :func:`mpi_cuda_support` calls."""
    import ctypes

    lib = None
    if path:
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1))
        except OSError:
            lib = None

    def symbol(name: str):
        fn = getattr(lib, name, None) if lib is not None else None
        if fn is None:
            return None
        if name == "MPIX_GPU_query_support":
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]

            def gpu_query(kind: int) -> int:
                flag = ctypes.c_int(0)
                if fn(kind, ctypes.byref(flag)) != 0:  # not MPI_SUCCESS: no answer
                    return 0
                return flag.value

            return gpu_query
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn

    return symbol


def probe_mpi_cuda(MPI) -> Finding:
    """:func:`mpi_cuda_support` for the running MPI library (``MPI``: mpi4py.MPI, initialised)."""
    library = MPI.Get_library_version().replace("\x00", "")
    alloc_kinds = None
    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            alloc_kinds = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except Exception:  # noqa: BLE001 - an MPI without the call: the key is absent
        alloc_kinds = None
    path = loaded_libmpi()
    found = mpi_cuda_support(library, alloc_kinds, ctypes_symbol(path), os.environ)
    return found


def probe_nccl_torch(nccl_available: Callable[[], bool]) -> Finding:
    """NCCL through torch (``torch.distributed.is_nccl_available()``) and its version."""
    if not nccl_available():
        return Finding(False, "torch.distributed.is_nccl_available() is False (this torch has no NCCL)")
    version = ""
    try:
        import torch

        version = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - the version is extra information
        pass
    return Finding(True, "torch.distributed.is_nccl_available() is True" + (f" (NCCL {version})" if version else ""))


def probe_nccl_cupy(importer: Callable[[str], Any] = None) -> Finding:
    """NCCL through CuPy (``cupy.cuda.nccl``, the ``cuda`` extra)."""
    import importlib
    import importlib.util

    if importer is None:
        if importlib.util.find_spec("cupy") is None:
            return Finding(False, "cupy is not installed (pip install 'hpccomm[cuda]')")
        importer = importlib.import_module
    try:
        nccl = importer("cupy.cuda.nccl")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable", said how
        return Finding(False, f"importing cupy.cuda.nccl failed: {type(exc).__name__}: {exc}")
    if not getattr(nccl, "available", True):
        return Finding(False, "cupy.cuda.nccl imported but reports NCCL unavailable")
    version = ""
    try:
        version = f" (NCCL {nccl.get_version()})"
    except Exception:  # noqa: BLE001
        pass
    return Finding(True, "cupy.cuda.nccl imported" + version)


def probe_gpu_count() -> Finding:
    """CUDA devices this process sees (``torch.cuda.device_count()``)."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        return Finding(0, "torch.cuda.is_available() is False" + ("" if built else " (a CPU-only torch)"))
    return Finding(torch.cuda.device_count(), f"torch.cuda.device_count() (CUDA {torch.version.cuda})")
