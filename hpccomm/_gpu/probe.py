"""Capability probes for the GPU transports, asked at run time (never at import).

Each probe answers a :class:`Finding`: a value, how it was determined, and,
where the answer is "no", what would change it (``advice``), so ``hpccomm
info`` and the selection log can say why and what to do.  The decision
functions (:func:`mpi_cuda_support`, :func:`device_reductions`) are pure:
their inputs (the MPI library's version string, its info keys, a symbol
lookup in the loaded MPI library, the files beside it, the environment) are
gathered by :func:`probe_mpi_cuda` and can be injected by tests.  Which
family a library is, and what makes it CUDA-aware, come from the one table of
MPI families (:data:`hpccomm.launcher.FAMILIES`).

How CUDA-awareness is asked, by library:

- any MPI 4.1 library that reports ``mpi_memory_alloc_kinds`` on
  ``MPI_COMM_WORLD``'s info: CUDA-aware when it lists the kind ``cuda``
  with the restrictor ``device``, or without restrictors (MPI 4.1: a kind
  named alone means all of its restrictors; Intel MPI with offload on reads
  ``mpi,system,cuda``).  A list without ``cuda`` is not taken as "no": MPI
  4.1 lists the kinds the user asked for at launch, so the library's own
  query decides then;
- Open MPI (and MVAPICH2 >= 2.3.4): ``MPIX_Query_cuda_support()``, an
  extension exported by libmpi (mpi4py 4.1 does not wrap it, so it is called
  through ctypes in the library mpi4py loaded); built with CUDA but off
  (conda-forge's build) until ``OMPI_MCA_opal_cuda_support=true``;
- MPICH >= 4 (and MPICH-based libraries that export it):
  ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``;
  ``MPIR_CVAR_ENABLE_GPU=0`` turns GPU support off;
- Cray MPICH: ``MPICH_GPU_SUPPORT_ENABLED=1`` is required;
- Intel MPI: device buffers are accepted only with ``I_MPI_OFFLOAD>=1`` and
  ``I_MPI_OFFLOAD_MODE=cuda`` (set before launch; hpccomm does not set them:
  with them the library initialises CUDA in every rank at MPI start, CPU jobs
  included, and on a node without a GPU every process crashes there);
- MVAPICH2 without the query: ``MV2_USE_CUDA=1``.

Anything else is "unknown" (None), which ``auto`` treats as not CUDA-aware.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ..launcher import library_family


@dataclass(frozen=True)
class Finding:
    """A probe's answer: ``value`` (True, False, None = unknown, or a number),
    ``how`` it was determined (one sentence, for logs and ``hpccomm info``)
    and, where the answer is not yes, ``advice``: what would change it (empty
    when nothing is known to)."""

    value: Any
    how: str
    advice: str = ""

    def word(self) -> str:
        if self.value is None:
            return "unknown"
        if isinstance(self.value, bool):
            return "yes" if self.value else "no"
        return str(self.value)


#: MPIX_GPU_SUPPORT_CUDA in MPICH's mpi.h (enum MPIX_GPU_type_t).
MPIX_GPU_SUPPORT_CUDA = 0

def _flag(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return 1 if raw.lower() in ("yes", "true", "on", "enable") else 0


def device_kinds(alloc_kinds: str) -> Optional[str]:
    """The entry of an ``mpi_memory_alloc_kinds`` value that says device
    memory of CUDA is accepted (``cuda`` alone: every restrictor, MPI 4.1;
    or ``cuda`` with the restrictor ``device``), or None.

    Example::

        >>> device_kinds("mpi,system,cuda"), device_kinds("mpi,cuda:host")
        ('cuda', None)
    """
    for entry in alloc_kinds.split(","):
        kind, *restrictors = [part.strip() for part in entry.strip().split(":")]
        if kind == "cuda" and (not restrictors or "device" in restrictors):
            return entry.strip()
    return None


def mpi_cuda_support(library: str, alloc_kinds: Optional[str], symbol: Callable[[str], Optional[Callable]],
                     env: Mapping[str, str], files: Callable[[str], bool] = lambda name: False) -> Finding:
    """Whether the MPI library accepts CUDA device memory, how that was
    determined, and (when not) what would make it.

    ``library``: ``MPI_Get_library_version()``.  ``alloc_kinds``: the value of
    the ``mpi_memory_alloc_kinds`` info key of ``MPI_COMM_WORLD`` (None if
    absent).  ``symbol(name)``: a Python callable for an extension function
    of the loaded MPI library, or None; ``MPIX_Query_cuda_support`` takes no
    argument and returns an int, ``MPIX_GPU_query_support`` takes the GPU type
    and returns the flag.  ``env``: the environment.  ``files(name)``: whether
    a file of that name lies beside the library (Open MPI's CUDA component).

    Example::

        >>> mpi_cuda_support("Open MPI v5.0.3", None, lambda n: (lambda: 1), {}).how
        'MPIX_Query_cuda_support() returned 1 (Open MPI extension)'
    """
    found = library_family(library)  # (the one table of MPI families: hpccomm.launcher.FAMILIES)
    family = found.name if found is not None else None
    name = library.strip().splitlines()[0][:60] if library.strip() else "this MPI library"
    advice = found.cuda_advice if found is not None else ""
    if alloc_kinds is not None:
        entry = device_kinds(alloc_kinds)
        if entry is not None:
            return Finding(True, f"MPI_COMM_WORLD info mpi_memory_alloc_kinds={alloc_kinds!r} lists {entry!r}: "
                                 f"CUDA device memory (MPI 4.1 memory kinds)")
    kinds = "" if alloc_kinds is None else f"mpi_memory_alloc_kinds={alloc_kinds!r} lists no CUDA device kind; "
    if family == "intelmpi":
        level, mode = _flag(env, "I_MPI_OFFLOAD"), env.get("I_MPI_OFFLOAD_MODE", "").strip().lower()
        if level and mode in ("", "cuda"):
            return Finding(True, f"{kinds}Intel MPI with I_MPI_OFFLOAD={env['I_MPI_OFFLOAD']}"
                                 + (f" and I_MPI_OFFLOAD_MODE={mode}" if mode else ""))
        said = "unset" if level is None else env["I_MPI_OFFLOAD"]
        return Finding(False, f"{kinds}Intel MPI takes device buffers only with offload on (I_MPI_OFFLOAD is "
                              f"{said}, I_MPI_OFFLOAD_MODE is {mode or 'unset'})", advice)
    if family in ("mpich", "cray", "mvapich") and _flag(env, "MPIR_CVAR_ENABLE_GPU") == 0:
        return Finding(False, f"{kinds}MPIR_CVAR_ENABLE_GPU=0 turns GPU support off",
                       "unset MPIR_CVAR_ENABLE_GPU (or set it to 1)")
    if family == "cray" and _flag(env, "MPICH_GPU_SUPPORT_ENABLED") != 1:
        return Finding(False, f"{kinds}Cray MPICH takes device buffers only with MPICH_GPU_SUPPORT_ENABLED=1",
                       advice)
    query = symbol("MPIX_Query_cuda_support")
    if query is not None:
        answer = int(query())
        if family == "mvapich" and answer and _flag(env, "MV2_USE_CUDA") != 1:
            return Finding(False, f"{kinds}MPIX_Query_cuda_support() returned {answer} but MVAPICH2 uses device "
                                  "buffers only with MV2_USE_CUDA=1", "set MV2_USE_CUDA=1")
        how = (f"{kinds}MPIX_Query_cuda_support() returned {answer} "
               f"({'MVAPICH2' if family == 'mvapich' else 'Open MPI'} extension)")
        if answer or family != "openmpi":
            return Finding(bool(answer), how, "" if answer else advice)
        for component in OPENMPI_CUDA_COMPONENTS:
            if files(component):
                return Finding(False, f"{how}; this Open MPI has CUDA support built in ({component} beside "
                                      "libmpi) but off", "set OMPI_MCA_opal_cuda_support=true before launch")
        return Finding(False, f"{how}; no CUDA component beside libmpi: built without CUDA", advice)
    query = symbol("MPIX_GPU_query_support")
    if query is not None:
        answer = int(query(MPIX_GPU_SUPPORT_CUDA))
        return Finding(bool(answer), f"{kinds}MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) set the flag to "
                                     f"{answer} (MPICH extension)", "" if answer else advice)
    if family == "mvapich":
        on = _flag(env, "MV2_USE_CUDA") == 1
        return Finding(on, f"{kinds}MVAPICH2 without MPIX_Query_cuda_support: MV2_USE_CUDA is "
                           f"{env.get('MV2_USE_CUDA') or 'unset'}", "" if on else advice)
    if alloc_kinds is not None:
        return Finding(False, f"{kinds.rstrip('; ')} and {name} offers no other CUDA query", advice)
    return Finding(None, f"{name} offers no CUDA-awareness query hpccomm knows "
                         "(no mpi_memory_alloc_kinds info key, no MPIX_Query_cuda_support, "
                         "no MPIX_GPU_query_support)", advice)


#: Files whose presence beside Open MPI's libmpi (in its component folder) says
#: it was built with CUDA support: Open MPI 5's accelerator component, 4.x's
#: common CUDA library.
OPENMPI_CUDA_COMPONENTS = ("mca_accelerator_cuda.so", "libmca_common_cuda.so")


#: What was measured of CUDA-aware MPI libraries on device memory (docs/gpu.md), by
#: (what, the family's name in hpccomm.launcher.FAMILIES): whether it is fast (True) or slow (False), and the
#: figures.
MEASURED = {
    ("movement", "openmpi"): (True, "Open MPI moves device memory through CUDA IPC (4.1.4 with CUDA, broadcast of "
                                    "64 MiB at 2 ranks on one H100: 0.36-0.45 ms, 160-187 GB/s)"),
    ("movement", "intelmpi"): (False, "Intel MPI moves device memory slowly (broadcast of 64 MiB at 2 ranks on one "
                                   "H100: 12.7 ms, 5.3 GB/s; all_gather 0.85 GB/s)"),
    ("reductions", "intelmpi"): (True, "Intel MPI with offload reduces on the device (all_reduce of 64 MiB at 2 ranks "
                                    "on one H100: 1.05 ms, 64 GB/s bus bandwidth)"),
    ("reduce_scatter", "intelmpi"): (False, "Intel MPI's own reduce_scatter of device memory is slow at large "
                                            "sizes though its all_reduce is fast (64 MiB at 2 ranks on one H200: "
                                            "52 ms, 0.64 GB/s bus; hpccomm's composition 1.0 ms, 33 GB/s)"),
    ("reductions", "openmpi"): (False, "Open MPI reduces device buffers on the host (4.1.4 with CUDA, all_reduce of "
                                       "64 MiB at 2 ranks on one H100: 90-105 ms, 0.7 GB/s)"),
}


def _measured(what: str, library: str, cuda_aware: Finding) -> Finding:
    if cuda_aware.value is not True:
        return Finding(None, "not CUDA-aware")
    found = library_family(library)
    family = found.name if found is not None else "a library hpccomm does not know"
    value, figures = MEASURED.get((what, family), (None, f"not measured for this library ({family})"))
    return Finding(value, figures)


def device_movement(library: str, cuda_aware: Finding) -> Finding:
    """Whether a CUDA-aware MPI library moves device memory fast (True: at
    the GPU's speed, CUDA IPC within a node), slowly (False), or unknown
    (None); from what was measured (:data:`MEASURED`).  ``auto`` sends data
    movement to NCCL, where NCCL can serve, when this says False."""
    return _measured("movement", library, cuda_aware)


def device_reduce_scatter(library: str, cuda_aware: Finding) -> Finding:
    """Whether a CUDA-aware MPI library that reduces on the device also runs
    reduce_scatter at that speed (True), far slower (False), or unknown
    (None); from what was measured (:data:`MEASURED`).  ``auto`` sends the
    reduce_scatter ops to hpccomm's composition when this says False."""
    return _measured("reduce_scatter", library, cuda_aware)


def device_reductions(library: str, cuda_aware: Finding) -> Finding:
    """Whether a CUDA-aware MPI library reduces device buffers on the device
    (True), on the host (False: each reduction copies to host memory and
    back, far slower than NCCL), or unknown (None); from what was measured
    (:data:`MEASURED`).  ``auto`` sends reductions to NCCL, where NCCL can
    serve, unless this says True."""
    return _measured("reductions", library, cuda_aware)


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
    return mpi_cuda_support(library, alloc_kinds, ctypes_symbol(path), os.environ, beside(path))


def probe_device_speed(MPI, cuda_aware: Finding) -> tuple:
    """``(device_reductions, device_movement, device_reduce_scatter)`` findings for the running MPI library."""
    library = MPI.Get_library_version().replace("\x00", "")
    return (device_reductions(library, cuda_aware), device_movement(library, cuda_aware),
            device_reduce_scatter(library, cuda_aware))


def beside(path: Optional[str]) -> Callable[[str], bool]:
    """``files(name)`` for :func:`mpi_cuda_support`: whether ``name`` lies in
    the library's folder or in its component folder (``openmpi/``)."""
    folder = os.path.dirname(path) if path else ""

    def files(name: str) -> bool:
        return bool(folder) and any(os.path.exists(os.path.join(folder, sub, name)) for sub in ("", "openmpi"))

    return files


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
