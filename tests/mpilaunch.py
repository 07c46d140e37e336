"""How the tests start MPI jobs, for the MPI family in use: the one place
that knows each family's launcher, flags and output format.

The family is the one of the MPI library mpi4py loads in this Python (found
without starting MPI: hpccomm._mpi.library.family()), or ``HPCCOMM_TEST_MPI``
(``openmpi``, ``mpich`` or ``impi``) when set, which must then match it.
The launcher is the family's own, beside the library (a pip-installed MPI
wheel puts it in the venv's bin/), else the first on PATH.

    from mpilaunch import LAUNCH
    cmd = LAUNCH.argv(3, sys.executable, "job.py", tag=True)   # [.../mpirun, -n, 3, --oversubscribe, ...]
    subprocess.run(cmd, env=LAUNCH.env(HPCCOMM_LOG="INFO"))
    for rank, text in LAUNCH.tagged(stdout): ...

tests/run.sh asks this module for the same launch (``python tests/mpilaunch.py
shell``), so the suite and the jobs the tests start use one launcher.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cells import SUITES, suite_files  # noqa: E402,F401  (the suites: tests/cells.py; named here as before)
from hpccomm._mpi import library  # noqa: E402
from hpccomm.launcher import FAMILIES  # noqa: E402

#: HPCCOMM_TEST_MPI's values (the names of hpccomm's pip extras) -> family names.
CHOICES = {"openmpi": "openmpi", "mpich": "mpich", "impi": "intelmpi"}

#: Launcher and process-manager variables a launch must not inherit (a launcher
#: that sees them thinks it is nested in another job).
LAUNCH_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "HYDI_", "HYDRA_", "MPI_LOCAL", "I_MPI_HYDRA_UUID",
                   "I_MPI_MPIRUN", "I_MPI_PIN_MAPPING", "I_MPI_INFO_", "TORCHELASTIC_", "MASTER_")
#: Variables of the test run itself (or of torchrun) that a launched job must not inherit.
TEST_VARIABLES = ("HPCCOMM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_")

#: What each family needs to run the tests here (root, oversubscribed 2-core machines):
#: Open MPI refuses root without the two variables and spins unless told to yield; Intel
#: MPI pins every rank to a core by default (ranks sharing a core then spin against each
#: other: off), on one node needs only its shared-memory transport (no network provider
#: is looked for), and busy-polls unless told to sleep while it waits (I_MPI_THREAD_YIELD=3:
#: a 1 KiB all_reduce at 4 ranks on 2 busy cores took 4-7 ms without it, 0.25 ms with it;
#: MPICH 0.1-0.4 ms).  MPICH waits with sched_yield, which on oversubscribed cores left the
#: 4-rank MPI phase taking 136 to 667 s (test_large's 2 GiB all_reduce alone 18 to 425 s); with
#: MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (nanosleep instead) it took 79 s, test_large 20 s.
#: Open MPI's wheel: the libfabric its OFI BTL loads probes the network interfaces and then sleeps a
#: full second (a clock_nanosleep of 1 s under strace) in every rank's MPI_Init, on a machine without
#: a fabric as on one with; OMPI_MCA_btl=^ofi leaves that BTL out (self, sm and tcp remain: what one
#: node uses), and MPI_Init takes 0.07 s instead of 1.08 s.  The tests launch some hundreds of jobs:
#: tests/test_init.py and tests/test_failures.py took 344 s with that second, 280 s without
#: (docs/troubleshooting.md says it to users).
SETTINGS = {
    "openmpi": {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl": "^ofi"},
    "mpich": {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"},
    "intelmpi": {"I_MPI_PIN": "0", "I_MPI_FABRICS": "shm", "I_MPI_THREAD_YIELD": "3"},
}

#: What MPI libraries print when a job goes wrong, for every family (Open MPI: MPI_ERR_*,
#: PRTE; MPICH and Intel MPI: "Fatal error in", "error stack", BAD TERMINATION).
MPI_ERROR_TEXT = (r"MPI_ERR|PRTE has lost|MPI_ABORT|Fatal error in|error stack|BAD TERMINATION|"
                  r"application called MPI_Abort")

#: MPICH's and Intel MPI's one line per rank that called MPI_Abort (the launcher's report, as Open MPI's block).
_ABORT_NOTICE = re.compile(r"Abort\(\d+\) on node \d+ \(rank \d+ in comm \d+\): application called MPI_Abort")
_TAGS = {
    "openmpi": re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>: ?(.*)$"),  # --output tag
    "hydra": re.compile(r"^\[(\d+)\] ?(.*)$"),                            # -prepend-rank
}


class FamilyMismatch(RuntimeError):
    pass


def family_name(env=None) -> str:
    """The family of the MPI library mpi4py loads; HPCCOMM_TEST_MPI, when set, must agree."""
    env = os.environ if env is None else env
    found = library.family()
    wanted = env.get("HPCCOMM_TEST_MPI", "").strip()
    if wanted:
        if wanted not in CHOICES:
            raise FamilyMismatch(f"HPCCOMM_TEST_MPI={wanted!r}: expected one of {', '.join(CHOICES)}")
        if found is None or found.name != CHOICES[wanted]:
            probe = library.probe()
            raise FamilyMismatch(
                f"HPCCOMM_TEST_MPI={wanted} but mpi4py in {sys.executable} loads "
                f"{probe.library or 'no MPI library'} ({probe.path or probe.reason}): install hpccomm with the "
                f"'{wanted}' extra in this venv, or point MPI4PY_LIBMPI at that family's libmpi")
        return CHOICES[wanted]
    if found is None:
        probe = library.probe()
        raise FamilyMismatch(f"the MPI library mpi4py loads is not Open MPI, MPICH or Intel MPI: "
                             f"{probe.library or probe.reason}")
    return found.name


@dataclass
class Launch:
    """The launch of one MPI family, as the tests use it."""

    family: str
    launcher: str
    settings: dict = field(default_factory=dict)

    @property
    def spec(self):
        return FAMILIES[self.family]

    @property
    def hydra(self) -> bool:
        return self.family in ("mpich", "intelmpi")

    @property
    def rank_variable(self) -> str:
        """The variable that holds a rank's own rank under this launcher."""
        return "OMPI_COMM_WORLD_RANK" if self.family == "openmpi" else "PMI_RANK"

    @property
    def size_variable(self) -> str:
        return "OMPI_COMM_WORLD_SIZE" if self.family == "openmpi" else "PMI_SIZE"

    @property
    def local_rank_variable(self) -> str:
        return "OMPI_COMM_WORLD_LOCAL_RANK" if self.family == "openmpi" else "MPI_LOCALRANKID"

    @property
    def local_size_variable(self) -> str:
        return "OMPI_COMM_WORLD_LOCAL_SIZE" if self.family == "openmpi" else "MPI_LOCALNRANKS"

    @property
    def command_name(self) -> str:
        """What hpccomm.launcher() calls this launcher (Launch.command)."""
        return Path(self.launcher).name

    def argv(self, n: int, *command: str, tag: bool = False, pass_env=()) -> list:
        """``[launcher, -n, n, <oversubscribe>, <rank tags>, <env>, *command]``:
        ``n`` ranks (more than cores is fine), each output line prefixed with its
        rank when ``tag``, the variables ``pass_env`` forwarded to every rank
        (Hydra forwards the whole environment anyway)."""
        cmd = [self.launcher, "-n", str(n), *self.spec.oversubscribe]
        if tag:
            cmd += self.spec.rank_output
        if not self.hydra:
            for name in pass_env:
                cmd += ["-x", name]
        return cmd + list(command)

    def env(self, base=None, **extra) -> dict:
        """The environment of a launch: ``base`` (default os.environ) without
        launcher, SLURM or test-run variables, plus the family's settings, this
        checkout first on PYTHONPATH, unbuffered Python (not under Hydra), and
        ``extra``.  PATH is left alone: the launcher is called by its full path
        and finds its helpers itself (Intel's ``mpirun`` script would need its
        folder on PATH, which is one reason the tests run Intel's ``mpiexec``)."""
        base = os.environ if base is None else base
        env = {k: v for k, v in base.items() if not k.startswith(LAUNCH_PREFIXES + TEST_VARIABLES)}
        env.update(self.settings)
        env.update(PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR",
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        env.update({k: str(v) for k, v in extra.items()})
        if self.hydra:
            # Hydra's -prepend-rank prefixes every write, not every line: an unbuffered
            # Python writes a print's text and its newline separately, and two ranks'
            # lines then run together.  Buffered, a print(..., flush=True) is one write
            # (and stderr is line-buffered).
            env.pop("PYTHONUNBUFFERED", None)
        return env

    def survivors_get_sigterm(self, env=None) -> bool:
        """Whether the launcher ends the other ranks of a failed job with SIGTERM
        first, so hpccomm's handler on each survivor can say where it was: Open
        MPI (SIGTERM, then SIGKILL); Intel MPI only with I_MPI_JOB_ABORT_SIGNAL=15
        in ``env`` (the launch's extra variables).  Hydra otherwise sends
        SIGKILL, which no process can catch."""
        env = {} if env is None else env
        return self.family == "openmpi" or (self.family == "intelmpi" and env.get("I_MPI_JOB_ABORT_SIGNAL") == "15")

    def names_killed_rank(self, output: str, rank: int, pid: int) -> bool:
        """Whether the launcher's own report (``output``: stdout and stderr)
        says that rank ``rank`` (process ``pid``) was killed by SIGKILL: Open
        MPI "process rank 2 with PID 123 ... signal 9"; Intel MPI "RANK 2 PID
        123 RUNNING AT ... KILLED BY SIGNAL: 9".  MPICH's Hydra names neither
        the rank nor, reliably, the process (it printed the PID of another
        rank here), only "EXIT STRING: Killed (signal 9)"."""
        text = " ".join(output.split())
        if self.family == "openmpi":
            return f"rank {rank} with PID {pid} " in text and "signal 9" in text
        if self.family == "intelmpi":
            return f"RANK {rank} PID {pid} RUNNING AT" in text and "KILLED BY SIGNAL: 9" in text
        return "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in text and "Killed (signal 9)" in text

    def after_hpccomm(self, output: str) -> list:
        """The lines of a failed job's ``output`` after hpccomm's last line
        (``hpccomm: ...``, or an ``hpccomm.errors...`` exception line), with
        the launcher's own closing report left out: Open MPI's blocks between
        dashed lines (``MPI_ABORT was invoked ...``, ``prterun has exited
        ...``), Hydra's between lines of ``=`` and MPICH's and Intel MPI's
        ``Abort(3) on node 0 ...: application called MPI_Abort ...``.  What is left came from torch,
        MPI or Python after hpccomm said what happened (a stack trace, a
        warning): a failed job should leave nothing there."""
        lines = output.splitlines()
        last = max((i for i, x in enumerate(lines) if x.startswith(("hpccomm: ", "hpccomm.errors."))), default=-1)
        assert last >= 0, f"no line of hpccomm's in:\n{output}"
        left, inside = [], False
        for line in lines[last + 1:]:
            rule = line.strip().strip("\x00").strip()  # (prterun ends its report with a NUL byte)
            if rule and set(rule) <= {"-"} or rule and set(rule) <= {"="}:
                inside = not inside
                continue
            if not inside and rule and not _ABORT_NOTICE.match(rule):
                left.append(line)
        return left

    def tagged(self, output: str) -> list:
        """``(rank, text)`` for every rank-tagged line of a launch's stdout or stderr."""
        pattern = _TAGS["hydra" if self.hydra else "openmpi"]
        return [(int(m.group(1)), m.group(2)) for m in map(pattern.match, output.splitlines()) if m]

    def lines_of(self, rank: int, output: str) -> list:
        return [text for r, text in self.tagged(output) if r == rank]


def current(env=None) -> Launch:
    """The launch for the MPI library mpi4py loads in this Python."""
    name = family_name(env)
    fam = FAMILIES[name]
    where = library.launcher_path(fam)
    if where is None:
        raise FamilyMismatch(f"no {fam.launcher} for {fam.title} beside {library.probe().path} or on PATH")
    return Launch(name, where, dict(SETTINGS[name]))


def shell(launch: Launch) -> str:
    """Bash lines for tests/run.sh: the family, the launcher, its flags, its settings."""
    lines = [f"MPI_FAMILY={launch.family}", f"MPI_LAUNCHER={shlex.quote(launch.launcher)}",
             f"MPI_FLAGS=({' '.join(shlex.quote(f) for f in launch.spec.oversubscribe)})"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in launch.settings.items()]
    return "\n".join(lines)


try:
    LAUNCH = current()
    WHY_NOT = ""
except FamilyMismatch as exc:  # reported by the tests that launch, and by run.sh
    LAUNCH = None
    WHY_NOT = str(exc)


def require() -> Launch:
    """LAUNCH, or fail the calling test with the reason there is none."""
    if LAUNCH is None:
        import pytest

        pytest.fail(f"cannot launch MPI jobs: {WHY_NOT}")
    return LAUNCH


if __name__ == "__main__":
    if sys.argv[1:2] == ["files"]:
        try:
            print(" ".join(suite_files(sys.argv[2:])))
        except KeyError as exc:
            sys.exit(f"tests/mpilaunch.py: {exc.args[0]}")
    elif sys.argv[1:] == ["suites"]:
        print(" ".join(SUITES))
    elif sys.argv[1:] == ["shell"]:
        if LAUNCH is None:
            sys.exit(f"tests/mpilaunch.py: {WHY_NOT}")
        print(shell(LAUNCH))
    else:
        sys.exit("usage: python tests/mpilaunch.py shell | suites | files SUITE...")


def no_orphans(tmp_path) -> bool:
    """No process of a test's job is left once its launcher returned (matched
    by the job script's unique path, ``tmp_path / "job.py"``).  The launcher
    reaps its children right after it exits; there is nothing to wait on for
    that from here, so this polls pgrep for at most 5 s."""
    script = str(tmp_path / "job.py")
    deadline = time.monotonic() + 5
    while True:
        out = subprocess.run(["pgrep", "-f", script], capture_output=True, text=True).stdout.split()
        left = [p for p in out if int(p) != os.getpid()]
        if not left or time.monotonic() > deadline:
            return not left
        time.sleep(0.2)
