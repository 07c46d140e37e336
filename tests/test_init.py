"""Start-up and shut-down, each in a fresh job: these tests launch their own
``mpirun`` (or a single process) from a plain pytest run, with a tiny worker
script written into the test's tmp_path.

Every launch runs under a timeout (coreutils ``timeout`` inside, the
subprocess timeout outside), with rank-tagged output, so a hang becomes a
failure that shows each rank's last words.  The launcher, its flags and the
tag format are those of the MPI family in use (tests/mpilaunch.py).  Workers
report results as ``HPCCOMM-TEST {json}`` lines on stdout.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cells import primary_only_but
from mpilaunch import MPI_ERROR_TEXT, require

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds per launch, start-up of torch on every rank included
SIZES = [1, 2, 3, 4]
#: The sizes the matrix's other cells (another MPI family) start these jobs at: the singleton and a job
#: with a middle rank check what a family changes (its launcher, its variables, its init and finalize);
#: the primary cell starts them at every size (tests/cells.py primary_only_but).
OTHER_SIZES = primary_only_but(SIZES, keep=(1, 3))

# What MPI or torch prints when a job ends badly at finalize.
BAD_STDERR = re.compile(MPI_ERROR_TEXT + r"|leak|finaliz|Traceback|Segmentation|core dumped|exited on signal",
                        re.IGNORECASE)

PRELUDE = '''\
import json, os, sys, traceback
def report(**kw):
    print("HPCCOMM-TEST " + json.dumps(kw), flush=True)
# the launcher's own variables for this MPI family (tests/mpilaunch.py)
RANK_VARIABLE, SIZE_VARIABLE = {rank!r}, {size!r}
LOCAL_RANK_VARIABLE, LOCAL_SIZE_VARIABLE = {local_rank!r}, {local_size!r}
'''





def _clean_env(**extra) -> dict:
    """The environment for a launch: none of this process's MPI, PMIx or
    SLURM variables (a launcher must not think it is nested), no HPCCOMM_*
    settings but those a test asks for, the MPI family's settings."""
    return require().env(**extra)


@dataclass
class Job:
    cmd: list
    rc: int
    stdout: str
    stderr: str
    reports: dict = field(default_factory=dict)  # rank -> merged report dicts

    def describe(self) -> str:
        return (f"$ {' '.join(self.cmd)}\nexit status {self.rc}\n--- stdout\n{self.stdout[-6000:]}\n"
                f"--- stderr\n{self.stderr[-6000:]}")

    def ok(self, n: int) -> "Job":
        """Exit status 0, every rank reported, and nothing alarming on stderr."""
        assert self.rc == 0, self.describe()
        assert sorted(self.reports) == list(range(n)), f"ranks that reported: {sorted(self.reports)}\n" \
                                                         + self.describe()
        bad = [line for line in self.stderr.splitlines() if BAD_STDERR.search(line)]
        assert not bad, "MPI/torch error text on stderr:\n" + "\n".join(bad) + "\n" + self.describe()
        return self


def _parse(stdout: str, single: bool) -> dict:
    reports: dict = {}
    lines = [(0, line) for line in stdout.splitlines()] if single else require().tagged(stdout)
    for rank, text in lines:
        if text.startswith("HPCCOMM-TEST "):
            reports.setdefault(rank, {}).update(json.loads(text[len("HPCCOMM-TEST "):]))
    return reports


def _run(cmd: list, env: dict, single: bool) -> Job:
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpirun and its ranks: the session this test started
        out, err = proc.communicate()
        pytest.fail(f"timed out after {TIMEOUT} s\n" + Job(cmd, -9, out, err).describe())
    return Job(cmd, proc.returncode, out, err, _parse(out, single))


def mpirun(n: int, script: Path, *args: str, **env) -> Job:
    """``script`` under the MPI family's launcher with ``n`` ranks
    (oversubscribed, rank-tagged output), ``env`` set on every rank."""
    cmd = ["timeout", "--kill-after=10", str(TIMEOUT - 15),
           *require().argv(n, sys.executable, str(script), *args, tag=True, pass_env=env)]
    return _run(cmd, _clean_env(**env), single=False)


def single(script: Path, *args: str, **env) -> Job:
    """``script`` as one plain process, no launcher."""
    cmd = ["timeout", "--kill-after=10", str(TIMEOUT - 15), sys.executable, str(script), *args]
    return _run(cmd, _clean_env(**env), single=True)


def worker(directory: Path, name: str, body: str) -> Path:
    launch = require()
    path = directory / f"{name}.py"
    path.write_text(PRELUDE.format(rank=launch.rank_variable, size=launch.size_variable,
                                   local_rank=launch.local_rank_variable, local_size=launch.local_size_variable)
                    + textwrap.dedent(body))
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sum_of_ranks_plus_one(n: int) -> float:
    return n * (n + 1) / 2


# --------------------------------------------------------------------------
# (a) hpccomm.init_process_group(), and what the same job shows:
# (e) a clean finalize, (i) local ranks, (j) the INFO log
# --------------------------------------------------------------------------

MAIN = '''
import torch, torch.distributed as dist
import hpccomm
from hpccomm.errors import InitError
try:
    hpccomm.local_rank()
    report(local_rank_before_init="no error")
except InitError as exc:
    report(local_rank_before_init=str(exc))
hpccomm.init_process_group()
from mpi4py import MPI
t = torch.full((5,), float(dist.get_rank() + 1))
dist.all_reduce(t)
report(rank=dist.get_rank(), size=dist.get_world_size(), backend=dist.get_backend(),
       mpi_rank=MPI.COMM_WORLD.Get_rank(), result=t.tolist(),
       local_rank=hpccomm.local_rank(), local_size=hpccomm.local_size(), node=hpccomm.node_index(),
       env_local_rank=os.environ.get(LOCAL_RANK_VARIABLE),
       env_local_size=os.environ.get(LOCAL_SIZE_VARIABLE),
       library=MPI.Get_library_version().replace("\\0", "").strip().splitlines()[0],
       thread_level=MPI.Query_thread())
dist.destroy_process_group()
'''


@pytest.fixture(scope="module", params=OTHER_SIZES, ids=[f"n{n}" for n in SIZES])
def main_job(request, tmp_path_factory):
    """One job per size running MAIN with HPCCOMM_LOG=INFO: ``(n, Job)``."""
    n = request.param
    script = worker(tmp_path_factory.mktemp(f"main{n}"), "main", MAIN)
    return n, mpirun(n, script, HPCCOMM_LOG="INFO")


def test_hpccomm_init_process_group(main_job):
    """(a) hpccomm.init_process_group(), then an all_reduce, at every size."""
    n, job = main_job
    job.ok(n)
    for r, rep in job.reports.items():
        assert (rep["rank"], rep["size"], rep["mpi_rank"]) == (r, n, r), rep
        assert rep["backend"] == "hpccomm"
        assert rep["result"] == [_sum_of_ranks_plus_one(n)] * 5, rep


def test_job_ends_cleanly(main_job):
    """(e) exit status 0 and no MPI error text (MPI_ERR, leak, finalize) on stderr."""
    n, job = main_job
    job.ok(n)  # ok() greps stderr
    assert not BAD_STDERR.search(job.stderr)


def test_local_rank_matches_launcher(main_job):
    """(i) local_size/node_index agree with the launcher's variables (one node
    here: node 0), local ranks are the launcher's 0..local_size-1, and before
    init they raise InitError."""
    n, job = main_job
    job.ok(n)
    ours = {r: rep["local_rank"] for r, rep in job.reports.items()}
    launcher = {r: int(rep["env_local_rank"]) for r, rep in job.reports.items()}
    assert sorted(ours.values()) == sorted(launcher.values()) == list(range(n)), (ours, launcher)
    for r, rep in job.reports.items():
        assert rep["local_size"] == int(rep["env_local_size"]) == n, rep
        assert rep["node"] == 0, rep
        assert "not initialised" in rep["local_rank_before_init"], rep
        assert "init_process_group" in rep["local_rank_before_init"], rep


def test_local_rank_equals_launcher_local_rank(main_job):
    """(i) hpccomm.local_rank() is the launcher's local rank (Open MPI's
    OMPI_COMM_WORLD_LOCAL_RANK, Hydra's MPI_LOCALRANKID),
    the number that binding and per-node device selection use."""
    n, job = main_job
    job.ok(n)
    for r, rep in job.reports.items():
        assert rep["local_rank"] == int(rep["env_local_rank"]), (r, rep["local_rank"], rep["env_local_rank"])


def test_info_log_names_mpi_library_and_thread_level(main_job):
    """(j) HPCCOMM_LOG=INFO: each rank logs the MPI library and thread level."""
    n, job = main_job
    job.ok(n)
    levels = ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")
    for r, rep in job.reports.items():
        pattern = (rf"^\[hpccomm rank {r}\] INFO MPI {re.escape(rep['library'])}\x00?, "
                   rf"thread level {levels[rep['thread_level']]}, world {n} ranks on 1 node\(s\), "
                   rf"local rank {rep['local_rank']}/{n}$")
        lines = require().lines_of(r, job.stderr)
        assert any(re.search(pattern, line) for line in lines), f"rank {r}: no line matching {pattern}\n" \
                                                                 + job.describe()


def test_info_log_is_plain_text(main_job):
    """(j) the INFO lines are printable text (no NUL or control bytes)."""
    n, job = main_job
    job.ok(n)
    lines = [line for line in job.stderr.splitlines() if "[hpccomm rank" in line]
    assert len(lines) >= n, job.describe()
    for line in lines:
        assert line.isprintable(), repr(line)


# --------------------------------------------------------------------------
# (b) init_method="mpi://"
# --------------------------------------------------------------------------

MPI_URL = '''
import torch, torch.distributed as dist
import hpccomm
dist.init_process_group(backend="hpccomm", init_method="mpi://")
from mpi4py import MPI
t = torch.full((3,), float(dist.get_rank() + 1), dtype=torch.float64)
dist.all_reduce(t)
report(rank=dist.get_rank(), size=dist.get_world_size(), mpi_rank=MPI.COMM_WORLD.Get_rank(),
       backend=dist.get_backend(), result=t.tolist())
dist.destroy_process_group()
'''


@pytest.mark.parametrize("n", OTHER_SIZES)
def test_init_method_mpi_url(tmp_path, n):
    """(b) dist.init_process_group(backend="hpccomm", init_method="mpi://"); no
    HPCCOMM_LOG: hpccomm says nothing on stderr."""
    job = mpirun(n, worker(tmp_path, "mpi_url", MPI_URL)).ok(n)
    for r, rep in job.reports.items():
        assert (rep["rank"], rep["size"], rep["mpi_rank"], rep["backend"]) == (r, n, r, "hpccomm"), rep
        assert rep["result"] == [_sum_of_ranks_plus_one(n)] * 3, rep
    assert "[hpccomm rank" not in job.stderr, job.describe()


# --------------------------------------------------------------------------
# (c) env:// and (c') a RANK that disagrees with MPI
# --------------------------------------------------------------------------

ENV_URL = '''
import torch, torch.distributed as dist
import hpccomm
from hpccomm.errors import InitError
mpi_rank = int(os.environ[RANK_VARIABLE])
size = int(os.environ["WORLD_SIZE"])
shift = int(sys.argv[1])
os.environ["RANK"] = str((mpi_rank + shift) % size)
try:
    dist.init_process_group(backend="hpccomm")
except InitError as exc:
    report(error=type(exc).__name__, message=str(exc))
    sys.exit(0)
from mpi4py import MPI
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
report(rank=dist.get_rank(), size=dist.get_world_size(), mpi_rank=MPI.COMM_WORLD.Get_rank(), result=t.tolist())
dist.destroy_process_group()
'''


@pytest.mark.parametrize("n", OTHER_SIZES)
def test_env_rendezvous(tmp_path, n):
    """(c) dist.init_process_group(backend="hpccomm") with env:// (RANK from
    the launcher's rank variable, MASTER_ADDR/MASTER_PORT/WORLD_SIZE from the test)."""
    job = mpirun(n, worker(tmp_path, "env_url", ENV_URL), "0",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=n).ok(n)
    for r, rep in job.reports.items():
        assert "error" not in rep, rep
        assert (rep["rank"], rep["size"], rep["mpi_rank"]) == (r, n, r), rep
        assert rep["result"] == [_sum_of_ranks_plus_one(n)] * 4, rep


@pytest.mark.parametrize("n", primary_only_but([2, 3, 4], keep=(3,)))
def test_env_rendezvous_rank_mismatch(tmp_path, n):
    """(c') RANK shifted by one against MPI's rank (a permutation: the store
    rendezvous itself succeeds) gives InitError on every rank, naming RANK and MPI."""
    job = mpirun(n, worker(tmp_path, "env_url", ENV_URL), "1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=n).ok(n)
    for r, rep in job.reports.items():
        assert rep.get("error") == "InitError", rep
        msg = rep["message"]
        assert f"rank {(r + 1) % n} of {n}" in msg and f"MPI says rank {r} of {n}" in msg, msg
        assert "RANK" in msg and "WORLD_SIZE" in msg and "mpi://" in msg, msg


# --------------------------------------------------------------------------
# (d) destroy, then init again in the same process
# --------------------------------------------------------------------------

REINIT = '''
import torch, torch.distributed as dist
import hpccomm
from hpccomm.errors import InitError
from mpi4py import MPI
n = int(os.environ[SIZE_VARIABLE])
results = []
for round in range(3):
    if round == 1:
        dist.init_process_group(backend="hpccomm", init_method="mpi://")
    else:
        hpccomm.init_process_group()
    try:
        hpccomm.init_process_group()
        report(**{f"double_init_{round}": "no error"})
    except InitError as exc:
        report(**{f"double_init_{round}": str(exc)})
    world = dist.group.WORLD
    sub = dist.new_group(list(range(n)))
    groups = [hpccomm._compat.group_of(world), hpccomm._compat.group_of(sub)]  # hpccomm's side of each
    comms = [hpccomm.mpi_comm(world), groups[0].p2p, hpccomm.mpi_comm(sub), groups[1].p2p]
    handles = [c.py2f() for c in comms]
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    u = torch.ones(2)
    dist.all_reduce(u, group=sub)
    dist.destroy_process_group()
    results.append(dict(sum=t.tolist(), sub=u.tolist(), handles=handles,
                        freed=[c == MPI.COMM_NULL for c in comms],
                        mpi_comm_after=[repr(g.comm) for g in groups],
                        initialized_after=dist.is_initialized()))
report(rounds=results, pending=repr((hpccomm._start.bootstrap.started.world_comm, hpccomm._start.bootstrap.started.sub_comm)))
'''


@pytest.mark.parametrize("n", [1, 3])
def test_destroy_then_init_again(tmp_path, n):
    """(d) destroy_process_group() frees the groups' MPI communicators (the
    mpi4py handles become COMM_NULL, mpi_comm is None) and a second and third
    init in the same process work; init while initialised is an InitError."""
    job = mpirun(n, worker(tmp_path, "reinit", REINIT)).ok(n)
    for r, rep in job.reports.items():
        assert len(rep["rounds"]) == 3, rep
        for i, rnd in enumerate(rep["rounds"]):
            assert rnd["sum"] == [_sum_of_ranks_plus_one(n)] * 2, (i, rnd)
            assert rnd["sub"] == [float(n)] * 2, (i, rnd)
            assert rnd["freed"] == [True] * 4, (i, rnd)
            assert rnd["mpi_comm_after"] == ["None", "None"], (i, rnd)
            assert rnd["initialized_after"] is False, (i, rnd)
            assert "already initialised" in rep[f"double_init_{i}"], rep
        assert rep["pending"] == "(None, None)", rep


# --------------------------------------------------------------------------
# (e) a busy job ends cleanly, with or without destroy_process_group
# --------------------------------------------------------------------------

BUSY = '''
import torch, torch.distributed as dist
import hpccomm
from mpi4py import MPI
hpccomm.init_process_group()
r, n = dist.get_rank(), dist.get_world_size()
for dtype in (torch.float16, torch.bfloat16, torch.float32):   # user-defined MPI ops for 16-bit floats
    t = torch.ones(8, dtype=dtype)
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
odd = dist.new_group([k for k in range(n) if k % 2])
mine = hpccomm.from_mpi4py(MPI.COMM_WORLD.Split(r % 2, r))
if n > 1:
    x = torch.arange(4.0)
    reqs = [dist.isend(x, dst=(r + 1) % n), dist.irecv(torch.empty(4), src=(r - 1) % n)]
    for q in reqs:
        q.wait()
dist.barrier()
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
report(done=True)
'''


@pytest.mark.parametrize("how", ["destroy", "no-destroy"])
@pytest.mark.parametrize("n", primary_only_but([2, 4], keep=(4,)))
def test_busy_job_finalizes_cleanly(tmp_path, n, how):
    """(e) after collectives, user MPI ops, subgroups (new_group and
    from_mpi4py) and point-to-point, the job exits 0 with no MPI error text,
    whether or not the script calls destroy_process_group()."""
    mpirun(n, worker(tmp_path, "busy", BUSY), how).ok(n)


# --------------------------------------------------------------------------
# (f) a gloo group beside the hpccomm world
# --------------------------------------------------------------------------

GLOO = '''
import torch, torch.distributed as dist
import hpccomm
hpccomm.init_process_group()
r, n = dist.get_rank(), dist.get_world_size()
everyone = dist.new_group(backend="gloo")
evens = dist.new_group([k for k in range(n) if k % 2 == 0], backend="gloo")
t = torch.full((3,), float(r + 1))
dist.all_reduce(t, group=everyone)
u = torch.full((3,), float(r + 1))
dist.all_reduce(u)  # the hpccomm world, interleaved with gloo
v = None
if r % 2 == 0:
    v = torch.full((2,), float(r))
    dist.all_reduce(v, group=evens)
    v = v.tolist()
report(gloo=t.tolist(), world=u.tolist(), evens=v, backends=[dist.get_backend(everyone), dist.get_backend()])
dist.destroy_process_group()
# Drop the last references so the gloo groups' threads are joined now: a gloo
# thread still alive at interpreter exit can abort the process (torch, not hpccomm).
del everyone, evens
'''


@pytest.mark.parametrize("n", primary_only_but([2, 3], keep=(3,)))
def test_gloo_group_beside_hpccomm_world(tmp_path, n):
    """(f) new_group(backend="gloo") works beside the hpccomm world (the
    store made over MPI is shared by both)."""
    job = mpirun(n, worker(tmp_path, "gloo", GLOO)).ok(n)
    total = _sum_of_ranks_plus_one(n)
    even_sum = float(sum(k for k in range(n) if k % 2 == 0))
    for r, rep in job.reports.items():
        assert rep["backends"] == ["gloo", "hpccomm"], rep
        assert rep["gloo"] == [total] * 3 and rep["world"] == [total] * 3, rep
        assert rep["evens"] == ([even_sum] * 2 if r % 2 == 0 else None), rep


# --------------------------------------------------------------------------
# (g) the silent-singleton trap
# --------------------------------------------------------------------------

SINGLETON = '''
import torch, torch.distributed as dist
import hpccomm
from hpccomm.errors import InitError
how = sys.argv[1]
try:
    if how == "hpccomm":
        hpccomm.init_process_group()
    elif how == "mpi-url":
        dist.init_process_group(backend="hpccomm", init_method="mpi://")
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
        dist.init_process_group(backend="hpccomm")
except InitError as exc:
    report(error=type(exc).__name__, message=str(exc))
else:
    report(error=None, size=dist.get_world_size())
    dist.destroy_process_group()
'''


@pytest.mark.parametrize("how", ["hpccomm", "mpi-url", "env-url"])
def test_srun_without_pmi_plugin_is_refused(tmp_path, how):
    """(g) one process that SLURM says is one of 4 tasks of a job step (srun
    without the MPI family's plugin, --mpi=pmix for Open MPI, --mpi=pmi2 for
    MPICH and Intel MPI: every task would see an MPI world of 1) is refused
    with InitError naming the fix for the family in use, on every init path."""
    job = single(worker(tmp_path, "singleton", SINGLETON), how, str(free_port()),
                 SLURM_NTASKS=4, SLURM_STEP_ID=0, SLURM_PROCID=0).ok(1)
    rep = job.reports[0]
    assert rep["error"] == "InitError", rep
    assert "srun started 4 processes (SLURM_NTASKS=4)" in rep["message"], rep
    plugin = require().spec.srun_mpi
    assert f"Launch with srun --mpi={plugin}: the MPI library in use is " in rep["message"], rep
    assert "world of 1" in rep["message"], rep


def test_batch_script_single_process_is_allowed(tmp_path):
    """(g) the same SLURM_NTASKS outside a job step (a batch script running
    one python) is a legitimate world of 1."""
    job = single(worker(tmp_path, "singleton", SINGLETON), "hpccomm", "0", SLURM_NTASKS=4).ok(1)
    assert job.reports[0] == {"error": None, "size": 1}, job.describe()


def test_mpiexec_variable_without_mpi_world_is_refused(tmp_path):
    """(g) PMI_SIZE (Hydra's mpiexec) > 1 with an MPI world of 1: the wrong
    MPI library's launcher."""
    job = single(worker(tmp_path, "singleton", SINGLETON), "hpccomm", "0", PMI_SIZE=3).ok(1)
    rep = job.reports[0]
    assert rep["error"] == "InitError" and "mpiexec started 3 processes (PMI_SIZE=3)" in rep["message"], rep


# --------------------------------------------------------------------------
# (h) import is cheap
# --------------------------------------------------------------------------

IMPORT = '''
import threading
before = set(sys.modules)
import hpccomm
import torch.distributed as dist
import importlib
rdzv = importlib.import_module("torch.distributed.rendezvous")
mpi_initialized = None
if "mpi4py.MPI" in sys.modules:
    mpi_initialized = sys.modules["mpi4py.MPI"].Is_initialized()
report(mpi4py_MPI_imported="mpi4py.MPI" in sys.modules, mpi_initialized=mpi_initialized,
       mpi4py_imported="mpi4py" in sys.modules, threads=threading.active_count(),
       backend=str(dist.Backend("hpccomm")), rendezvous="mpi" in rdzv._rendezvous_handlers,
       available=hpccomm.is_available(), mpi4py_MPI_after_is_available="mpi4py.MPI" in sys.modules)
'''


def test_import_does_not_start_mpi(tmp_path):
    """(h) ``import hpccomm`` registers the backend and mpi:// but neither
    imports mpi4py.MPI (which would initialise MPI) nor starts threads."""
    job = single(worker(tmp_path, "imp", IMPORT)).ok(1)
    rep = job.reports[0]
    assert rep["mpi4py_MPI_imported"] is False and rep["mpi_initialized"] is None, rep
    assert rep["mpi4py_MPI_after_is_available"] is False, rep
    assert rep["threads"] == 1, rep
    assert rep["backend"] == "hpccomm" and rep["rendezvous"] is True and rep["available"] is True, rep


# --------------------------------------------------------------------------
# (k) no `import hpccomm`: torch finds it (entry points) and, under an MPI
#     launcher with RANK unset, env:// takes rank, size and the store from MPI
# --------------------------------------------------------------------------

NO_IMPORT = '''
import torch, torch.distributed as dist
backend = sys.argv[1]
dist.init_process_group(backend)      # no import hpccomm, no MASTER_ADDR/PORT, RANK or WORLD_SIZE
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
from mpi4py import MPI   # started by the rendezvous
report(backend=str(dist.get_backend()), rank=dist.get_rank(), size=dist.get_world_size(), result=t.tolist(),
       mpi_rank=MPI.COMM_WORLD.Get_rank(), env=[k for k in ("RANK", "MASTER_ADDR") if k in os.environ],
       hpccomm_loaded="hpccomm" in sys.modules)
dist.destroy_process_group()
'''


@pytest.mark.parametrize("n", [1, 3])
def test_init_without_import_or_settings(tmp_path, n):
    """(k) An unchanged training script, but for the backend name, under
    mpirun with nothing set: torch imports hpccomm through its entry points
    (torch.distributed.backends on torch >= 2.14; the autoload entry point
    on every torch) and the rendezvous comes from MPI."""
    job = mpirun(n, worker(tmp_path, "no_import", NO_IMPORT), "hpccomm").ok(n)
    for r, rep in job.reports.items():
        assert (rep["backend"], rep["rank"], rep["size"], rep["mpi_rank"]) == ("hpccomm", r, n, r), rep
        assert rep["result"] == [_sum_of_ranks_plus_one(n)] * 3 and rep["env"] == [], rep
        assert rep["hpccomm_loaded"] is True, rep


def test_env_rendezvous_from_mpi_serves_any_backend(tmp_path):
    """(k) The MPI rendezvous behind env:// is the launch's, not hpccomm's
    backend's: gloo under mpirun with nothing set works too."""
    job = mpirun(3, worker(tmp_path, "no_import", NO_IMPORT), "gloo").ok(3)
    for r, rep in job.reports.items():
        assert (rep["backend"], rep["rank"], rep["size"], rep["mpi_rank"]) == ("gloo", r, 3, r), rep
        assert rep["result"] == [_sum_of_ranks_plus_one(3)] * 3, rep


THREE_WAYS = '''
import torch, torch.distributed as dist
way = sys.argv[1]
if way != "backend":
    import hpccomm
if way == "hpccomm":
    hpccomm.init_process_group()
elif way == "init_method":
    dist.init_process_group("hpccomm", init_method="mpi://")
else:
    try:
        dist.init_process_group("hpccomm" if way == "backend" else way)   # env:// with nothing set, no launcher
    except ValueError as exc:
        report(way=way, error=str(exc).splitlines()[0])
        sys.exit(0)
t = torch.ones(3)
dist.all_reduce(t)
report(way=way, backend=str(dist.get_backend()), rank=dist.get_rank(), size=dist.get_world_size(), result=t.tolist())
dist.destroy_process_group()
'''


@pytest.mark.parametrize("way", ["hpccomm", "init_method", "backend"])   # (an id "mpi" reads as pytest-mpi's mark)
def test_three_ways_in_alike_under_plain_python(tmp_path, way):
    """(k) The README's three ways in, run as ``python train.py`` with no
    launcher and nothing set, all give a world of one: hpccomm's init,
    ``init_method="mpi://"``, and ``dist.init_process_group("hpccomm")``
    (env://, which alone would want RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT), even without ``import hpccomm``."""
    job = single(worker(tmp_path, "three", THREE_WAYS), way).ok(1)
    assert job.reports[0] == {"way": way, "backend": "hpccomm", "rank": 0, "size": 1, "result": [1.0] * 3}, \
        job.describe()


def test_other_backends_keep_torchs_env_rendezvous(tmp_path):
    """(k) Only a process group of hpccomm's gets a world of one from MPI
    without a launcher: gloo there still gets torch's own env:// error."""
    job = single(worker(tmp_path, "three", THREE_WAYS), "gloo").ok(1)
    assert job.reports[0] == {"way": "gloo", "error": "Error initializing torch.distributed using env:// rendezvous: "
                                                      "environment variable RANK expected, but not set"}, job.describe()


ENTRY_POINT = '''
import torch, torch.distributed as dist
# the launcher's own variables (Open MPI's; Hydra's, for MPICH and Intel MPI): no `import hpccomm` here
os.environ["RANK"] = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ["PMI_RANK"]
os.environ["WORLD_SIZE"] = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ["PMI_SIZE"]
try:
    dist.init_process_group("hpccomm")   # env://, as torchrun-style scripts do; torch's autoload is off
except Exception as exc:
    report(error=type(exc).__name__, message=str(exc).splitlines()[0], hpccomm_loaded="hpccomm" in sys.modules)
    sys.exit(0)
t = torch.ones(2)
dist.all_reduce(t)
report(result=t.tolist(), backend=str(dist.get_backend()), hpccomm_loaded="hpccomm" in sys.modules)
dist.destroy_process_group()
'''


def test_backend_entry_point_alone(tmp_path):
    """(k) With torch's device autoload off (TORCH_DEVICE_BACKEND_AUTOLOAD=0)
    and env:// set up by the script: torch >= 2.14 loads hpccomm through its
    torch.distributed.backends entry point; torch 2.13 has no such entry
    point group and refuses the name (there, `import hpccomm` is needed)."""
    import torch

    from hpccomm import _compat as compat

    job = mpirun(2, worker(tmp_path, "entry_point", ENTRY_POINT), TORCH_DEVICE_BACKEND_AUTOLOAD=0,
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()).ok(2)
    entry_points = hasattr(torch.distributed.Backend, "_ensure_backend_registered")
    assert entry_points == compat.py_backend(), "torch's entry points and its Python Backend came together"
    for rep in job.reports.values():
        if entry_points:
            assert rep.get("result") == [2.0, 2.0] and rep["backend"] == "hpccomm", rep
        else:
            assert rep.get("error") and "hpccomm" in rep["message"] and not rep["hpccomm_loaded"], rep


RPC = '''
import torch, torch.distributed.rpc as rpc, torch.distributed.autograd as dist_autograd
import hpccomm
launch = hpccomm.launcher()
me, n = launch.rank, launch.size
rpc.init_rpc(f"worker{me}", rank=me, world_size=n)   # no MASTER_ADDR/MASTER_PORT: the store comes from MPI
nxt = f"worker{(me + 1) % n}"
remote = rpc.rpc_sync(nxt, torch.add, args=(torch.ones(2), float(me)))
with dist_autograd.context() as ctx:
    x = torch.full((2,), float(me + 1), requires_grad=True)
    y = rpc.rpc_sync(nxt, torch.mul, args=(x, float(me + 3)))
    dist_autograd.backward(ctx, [(y * y).sum()])
    grad = dist_autograd.get_gradients(ctx)[x]
report(id=rpc.get_worker_info().id, remote=remote.tolist(), grad=grad.tolist())
rpc.shutdown()
'''


@pytest.mark.parametrize("n", primary_only_but([2, 3], keep=(3,)))
def test_rpc_and_distributed_autograd_under_mpirun(tmp_path, n):
    """(k) torch.distributed.rpc.init_rpc under mpirun with no MASTER_ADDR or
    MASTER_PORT takes its rendezvous from MPI (rank and world size are
    init_rpc's own arguments, which torch requires: hpccomm.launcher() gives
    them before init): a remote call, and a distributed autograd backward
    through one (d/dx sum((c x)^2) = 2 c^2 x)."""
    job = mpirun(n, worker(tmp_path, "rpc", RPC)).ok(n)
    for r, rep in job.reports.items():
        c = r + 3
        assert rep["id"] == r and rep["remote"] == [1.0 + r] * 2, rep
        assert rep["grad"] == [2.0 * c * c * (r + 1)] * 2, rep


# --------------------------------------------------------------------------
# (g) the key-value store cannot be opened: every rank raises, quickly
# --------------------------------------------------------------------------

STORE_FAIL = '''
import time
import hpccomm
t0 = time.monotonic()
try:
    hpccomm.init_process_group()
    report(error=None)
except hpccomm.InitError as exc:
    report(error="InitError", message=str(exc), took=time.monotonic() - t0)
'''


@pytest.mark.parametrize("case", ["unresolvable", "busy-port"])
def test_store_failure_raises_on_every_rank(tmp_path, case):
    env = {"HPCCOMM_STORE_ADDR": "no-such-host.invalid"} if case == "unresolvable" else {}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        if case == "busy-port":
            env["HPCCOMM_STORE_PORT"] = busy.getsockname()[1]
        job = mpirun(2, worker(tmp_path, "store_fail", STORE_FAIL), **env)
    assert sorted(job.reports) == [0, 1], job.describe()
    for rep in job.reports.values():
        assert rep["error"] == "InitError", rep
        msg = rep["message"]
        assert msg.startswith("hpccomm init: rank 0 could not open the key-value store on "), msg
        assert msg.endswith(". Set HPCCOMM_STORE_ADDR / HPCCOMM_STORE_PORT") and ".." not in msg, msg
        assert ("no-such-host.invalid" in msg) if case == "unresolvable" else ("EADDRINUSE" in msg), msg
        assert rep["took"] < 30, rep  # not the 30-minute default timeout


SHARED_SETTING = '''
import time
import hpccomm
from hpccomm.errors import ConfigError
name, value, other = sys.argv[1:4]
os.environ[name] = value if int(os.environ[RANK_VARIABLE]) == 0 else other
t0 = time.monotonic()
try:
    hpccomm.init_process_group()
    report(error=None)
except ConfigError as exc:
    report(error="ConfigError", message=str(exc), setting=exc.variable, took=time.monotonic() - t0)
'''


# Outside the primary cell one setting: the refusal and how the job ends are one code path for every setting
# (what each setting's comparison is, is unit-tested); the MPI family's part is that path.
@pytest.mark.parametrize("name, value, other", primary_only_but([("HPCCOMM_MISMATCH_CHECK", "first", "every"),
                                                                 ("HPCCOMM_ASYNC_NONBLOCKING", "1", "0"),
                                                                 ("HPCCOMM_DEBUG", "DETAIL", "OFF")],
                                                                keep=[("HPCCOMM_MISMATCH_CHECK", "first", "every")]))
def test_ranks_that_differ_in_a_shared_setting_are_refused(tmp_path, name, value, other):
    """A setting that decides how every collective runs, different on rank 0
    than on the others: init raises ConfigError on every rank, naming the
    setting and each rank's value (ranks that differ would wait for each
    other in different calls)."""
    n = 3
    job = mpirun(n, worker(tmp_path, "shared", SHARED_SETTING), name, value, other)
    assert sorted(job.reports) == list(range(n)), job.describe()
    for rep in job.reports.values():
        assert rep["error"] == "ConfigError", rep
        assert rep["setting"] == name, rep
        msg = rep["message"]
        assert msg.startswith(f"hpccomm init: the ranks disagree on {name} (rank 0: "), msg
        assert msg.endswith(f"set {name} alike on every rank"), msg
        assert rep["took"] < 30, rep


@pytest.mark.parametrize("first", ["import hpccomm; import torch", "import torch; import hpccomm", "import torch"])
def test_registration_in_any_import_order_warns_nothing(first):
    """(h) hpccomm registers with torch whichever comes first, `import
    hpccomm` or `import torch` (whose autoload entry point imports hpccomm
    and, when hpccomm came first, calls back into it mid-import), with no
    warning; `import torch` alone registers it too (the autoload)."""
    code = (f"{first}\nimport torch.distributed as dist, sys\n"
            "assert 'HPCCOMM' in dist.Backend._plugins, 'not registered'\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI started'\n")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                         env=_clean_env(), timeout=TIMEOUT)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


INIT_HANGS = '''
import importlib.abc, importlib.machinery, threading
from datetime import timedelta

class NeverReturns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """mpi4py.MPI's import is MPI_Init: this one blocks for good, as MPI_Init does
    when a rank never comes or the launcher's PMI exchange breaks."""
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "mpi4py.MPI" else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        report(stage="in MPI_Init")
        threading.Event().wait()

import sys
sys.meta_path.insert(0, NeverReturns())
import hpccomm
hpccomm.init_process_group(timeout=timedelta(seconds=float(sys.argv[1])))
report(stage="init returned")
'''


@pytest.mark.parametrize("n", [1, 2])
def test_init_that_never_returns_ends_with_a_message(tmp_path, n):
    """MPI_Init that never returns (stood in for by an mpi4py.MPI import that
    blocks) ends every process after init_process_group's timeout, with a
    message naming MPI_Init, the timeout and what to check; not a silent hang."""
    script = worker(tmp_path, "init_hangs", INIT_HANGS)
    job = single(script, "4") if n == 1 else mpirun(n, script, "4")
    assert job.rc != 0, job.describe()
    assert sorted(job.reports) == list(range(n)), job.describe()
    assert all(r["stage"] == "in MPI_Init" for r in job.reports.values()), job.describe()
    said = [line for line in job.stderr.splitlines() if "hpccomm: MPI_Init has not returned after 4 s" in line]
    # every process has its own watch; under a launcher the first to end makes it end the others
    assert 1 <= len(said) <= n, job.describe()
    assert all("ending this process" in line and "MPIR_CVAR_CH4_NETMOD=ofi" in line for line in said), said
