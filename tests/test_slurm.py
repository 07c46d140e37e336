"""The jobs/ templates submitted for real to a two-node SLURM cluster.

A session fixture starts the cluster with tests/slurm/cluster.sh (installing
Debian's SLURM, munge and PMIx when missing): munged, slurmctld and two
slurmd's (nodes n1 and n2) on this machine.  Each CPU template is rendered by
``hpccomm jobs render``, submitted with sbatch, and runs tests/slurm/check_job.py
(or the test suite, or the resumable training); the test polls ``scontrol show
job`` and checks the exit status and what the job printed.  The GPU template is
checked with ``sbatch --test-only`` and its preflight (the nodes have stand-in
GPUs, no real ones).

Skipped, with the reason, only where SLURM cannot be started: not root, or
SLURM missing and no apt-get.  Where it can, a failure to start is a failure.
The daemons are stopped (by PID) at the end.

The jobs run with this Python and its MPI family: the templates' MPI_PLUGIN=auto
picks srun's plugin (pmix for Open MPI, pmi2 for MPICH and Intel MPI) and
cpu-mpirun.sbatch runs that family's mpirun, so running this file in an MPICH
or Intel MPI venv checks the templates with that family.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpilaunch import require

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
CHECK = ROOT / "tests" / "slurm" / "check_job.py"
TRAIN = ROOT / "jobs" / "train_resumable.py"
SLURM_DIR = os.environ.get("HPCCOMM_TEST_SLURM_DIR", "/tmp/hpccomm-slurm")
JOB_TIMEOUT = 240  # seconds a job may take, queueing included (2 busy cores)
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _cannot_start() -> str:
    """Why SLURM cannot be started here ('' when it can)."""
    if sys.platform != "linux":
        return "SLURM test cluster: Linux only"
    if os.geteuid() != 0:
        return "SLURM test cluster: needs root (slurmd runs jobs as their user)"
    if not shutil.which("slurmd") and not shutil.which("apt-get"):
        return "SLURM test cluster: SLURM is not installed and there is no apt-get to install it"
    return ""


@pytest.fixture(scope="session")
def slurm():
    """The environment for SLURM commands and jobs on the started test cluster."""
    reason = _cannot_start()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ)
    env.update({
        "HPCCOMM_TEST_SLURM_DIR": SLURM_DIR,
        "SLURM_CONF": f"{SLURM_DIR}/slurm.conf",
        # sbatch passes the submitter's environment on: jobs find this Python and this hpccomm.
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "OMPI_MCA_mpi_yield_when_idle": "1",  # 16 processes on 2 cores: yield instead of spinning
        "OMPI_MCA_btl": "^ofi",  # no second's sleep in each rank's MPI_Init (tests/mpilaunch.py SETTINGS)
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PMIX_MCA_psec": "native",  # the Open MPI wheel under srun: no "psec munge" notice per rank
    })
    if (Path(sys.prefix) / "bin" / "prted").exists():
        env["OPAL_PREFIX"] = sys.prefix  # the pip Open MPI wheel finds its help texts and prted
    if require().family == "mpich":
        # What the templates tell pip-MPICH users under srun --mpi=pmi2: the wheel's UCX netmod puts a
        # padded address buffer (its padding uninitialised memory) into SLURM's key-value store in
        # segments whose PMI-1 requests often pass the 1024 bytes SLURM 22.05's pmi2 plugin reads at
        # once, and MPI_Init hangs ("mpi/pmi2: value not properly terminated in client request"; 3 of 3
        # jobs here, UCX_TLS=self,sm,tcp too). The OFI netmod's address is 16 bytes: one short request.
        env.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
    for var in [v for v in env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
        del env[var]  # run from inside a job: do not leak its allocation into the test's jobs
    proc = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"the SLURM test cluster did not start (this machine can run it):\n{proc.stderr}")
    yield env
    subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, text=True, timeout=120)


def render(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "hpccomm", "jobs", "render", name, *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def sbatch(env, script: str, workdir: Path, *options: str) -> str:
    path = workdir / "job.sbatch"
    path.write_text(script)
    proc = subprocess.run(["sbatch", "--parsable", *options, str(path)], env=env, cwd=workdir,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_info(env, job: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(env, job: str, until=lambda info: info.get("JobState") in FINAL, timeout: float = JOB_TIMEOUT) -> dict:
    """Poll ``scontrol show job`` (sbatch --wait polls every 32 s) until ``until``."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(env, job)
        if until(info):
            return info
        if time.monotonic() > deadline:
            state = f"{info.get('JobState')} {info.get('Reason')}"
            seen = stuck_job_report(env, job, info)  # before scancel: what the job's processes are doing
            subprocess.run(["scancel", job], env=env, timeout=30)
            pytest.fail(f"job {job} not done after {timeout}s: {state}\n{seen}")
        time.sleep(0.3)


def stuck_job_report(env, job: str, info: dict) -> str:
    """What a job that outlived its test's wait left to see: its output so far,
    its steps, the processes on this machine that belong to it (state and
    kernel wait channel) and the tail of each slurmd's log."""
    parts = []
    work = info.get("WorkDir", "")
    out = info.get("StdOut", "")
    if out and os.path.exists(out):
        parts.append(f"-- its output ({out}):\n{Path(out).read_text(errors='replace')[-4000:]}")
    else:
        parts.append(f"-- no output file yet (StdOut={out!r}, WorkDir={work!r})")
    steps = subprocess.run(["squeue", "-s", "-j", job, "-o", "%i %j %M %N"], env=env, capture_output=True,
                           text=True, timeout=30).stdout
    parts.append(f"-- its steps:\n{steps}")
    ps = subprocess.run(["ps", "-eo", "pid,ppid,etimes,pcpu,stat,wchan:24,args"], capture_output=True, text=True,
                        timeout=30).stdout.splitlines()
    keep = [line for line in ps[1:] if any(k in line for k in ("slurmstepd", "srun", "python", "hydra", "mpiexec"))]
    parts.append("-- processes:\n" + "\n".join([ps[0], *keep][:60]))
    for node in ("n1", "n2"):
        log = Path(SLURM_DIR) / "log" / f"slurmd-{node}.log"
        if log.exists():
            parts.append(f"-- {log} (tail):\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def output(workdir: Path, prefix: str, job: str) -> str:
    path = workdir / f"{prefix}-{job}.out"  # the templates' --output=%x-%j.out
    return path.read_text() if path.exists() else f"(no {path})"


def finished_ok(env, workdir: Path, name: str, job: str) -> str:
    info = wait_for(env, job)
    text = output(workdir, f"hpccomm-{name}", job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"job {job}: {info['JobState']} " \
        f"exit {info['ExitCode']}; its output:\n{text}"
    return text


def check_result(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("CHECK_JOB ")]
    assert len(lines) == 1, text
    return json.loads(lines[0][len("CHECK_JOB "):])


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    """The 2-node x 2-rank CPU jobs, submitted together (they run side by side)."""
    submitted = {}
    for name, args in (
        ("cpu", ["--", sys.executable, str(CHECK)]),
        ("cpu-mpirun", ["--", sys.executable, str(CHECK)]),
        ("torchrun", ["--cpus-per-task", "2", "--", str(CHECK), "--backend", "gloo"]),
    ):
        workdir = tmp_path_factory.mktemp(name)
        if name == "torchrun":  # `hpccomm jobs submit`: render and sbatch in one, printing the job id
            proc = subprocess.run([sys.executable, "-m", "hpccomm", "jobs", "submit", name, "--nodes", "2",
                                   "--ntasks-per-node", "2", "--time", "10", *args], env=slurm, cwd=workdir,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0 and proc.stdout.strip().isdigit(), proc
            submitted[name] = (workdir, proc.stdout.strip())
            continue
        script = render(name, "--nodes", "2", "--ntasks-per-node", "2", "--time", "10", *args)
        submitted[name] = (workdir, sbatch(slurm, script, workdir))
    return submitted


def spans_two_nodes(result: dict) -> None:
    """Four ranks, two on each SLURM node, and a sum over all of them.  Nodes by
    SLURM_NODEID: Intel MPI's mpirun inside a batch job hands the batch script's
    SLURMD_NODENAME (n1) to every rank, on either node."""
    views = result["views"]
    assert [v["rank"] for v in views] == [0, 1, 2, 3] and {v["size"] for v in views} == {4}
    by_node = {}
    for v in views:
        by_node.setdefault(v["slurm_nodeid"], []).append(v["rank"])
    assert sorted(by_node) == ["0", "1"] and all(len(r) == 2 for r in by_node.values()), by_node
    assert result["all_reduce"] == 1 + 2 + 3 + 4


def layout_matches_slurm(result: dict) -> None:
    """hpccomm's (or torchrun's) local rank, local size and node index agree with
    where SLURM put each rank; a group of one rank per node sums across nodes."""
    views = result["views"]
    layout = [{k: v[k] for k in ("rank", "slurm_nodeid", "node", "local_rank", "local_size")} for v in views]
    assert {v["local_size"] for v in views} == {2}, layout
    # One node index per SLURM node (torchrun numbers nodes in rendezvous order, not SLURM's).
    index = {v["slurm_nodeid"]: v["node"] for v in views}
    assert sorted(index.values()) == [0, 1] and all(index[v["slurm_nodeid"]] == v["node"] for v in views), layout
    assert sorted((v["node"], v["local_rank"]) for v in views) == [(0, 0), (0, 1), (1, 0), (1, 1)], layout
    assert len(result["leaders"]) == 2 and result["across_nodes"] == [1.0 + 2.0] * 2, result


def test_cpu_srun_spans_two_nodes(slurm, jobs):
    workdir, job = jobs["cpu"]
    text = finished_ok(slurm, workdir, "cpu", job)
    assert f"(srun --mpi={require().spec.srun_mpi})" in text, text  # MPI_PLUGIN=auto: the family's plugin
    assert "hpccomm preflight ok: 4 ranks, 2 node(s)" in text
    spans_two_nodes(check_result(text))


def test_cpu_srun_node_layout(slurm, jobs):
    workdir, job = jobs["cpu"]
    layout_matches_slurm(check_result(finished_ok(slurm, workdir, "cpu", job)))


def test_cpu_mpirun_spans_two_nodes(slurm, jobs):
    workdir, job = jobs["cpu-mpirun"]
    text = finished_ok(slurm, workdir, "cpu-mpirun", job)
    assert text.count("hpccomm preflight ok: 4 ranks, 2 node(s)") == 1, text
    result = check_result(text)
    spans_two_nodes(result)
    layout_matches_slurm(result)


def test_torchrun_one_task_per_node(slurm, jobs):
    workdir, job = jobs["torchrun"]
    text = finished_ok(slurm, workdir, "torchrun", job)
    assert "hpccomm preflight ok: 2 node(s), rendezvous " in text
    result = check_result(text)
    spans_two_nodes(result)
    layout_matches_slurm(result)


@pytest.mark.one_cell  # the template's srun --mpi=<family> launch is the cpu job's (test_cpu_srun_spans_two_nodes)
def test_tests_template_runs_pytest_mpi(slurm, tmp_path):
    script = render("tests", "--nodes", "2", "--ntasks-per-node", "2", "--time", "10", "--", sys.executable, "-m",
                    "pytest", "--with-mpi", "-m", "mpi", "-q", "-p", "no:cacheprovider", "tests/test_reduce.py",
                    "-k", "all_reduce_matrix and float32-SUM")  # the template's run of pytest-mpi: two tests do
    # The job runs in the repository (tests/ and tests/logs/ are relative); its log goes to tmp_path.
    job = sbatch(slurm, script, tmp_path, f"--chdir={ROOT}", f"--output={tmp_path}/hpccomm-tests-%j.out")
    text = finished_ok(slurm, tmp_path, "tests", job)
    assert re.search(r"^2 passed", text, re.M) and "failed" not in text, text


@pytest.mark.one_cell  # SLURM's signal and requeue and the program's checkpoint; srun --mpi=<family> is the cpu job's
def test_preempt_checkpoints_requeues_and_resumes(slurm, tmp_path):
    steps = 40
    script = render("preempt", "--nodes", "2", "--ntasks-per-node", "2", "--time", "10", "--", sys.executable,
                    str(TRAIN), "--steps", str(steps), "--step-seconds", "0.2", "--checkpoint", "ckpt.pt",
                    "--timeout", "60")  # a hang in an op ends the job with hpccomm's diagnosis in its output
    job = sbatch(slurm, script, tmp_path)
    log = tmp_path / f"hpccomm-preempt-{job}.out"
    info = wait_for(slurm, job, until=lambda info: log.exists() and "\nstep 10\n" in log.read_text()
                    or info.get("JobState") in FINAL)
    assert info.get("JobState") not in FINAL, \
        f"the job ended before step 10 ({info.get('JobState')} {info.get('ExitCode')}):\n" \
        f"{stuck_job_report(slurm, job, info)}"
    # What SLURM does at --signal=B:USR2@120, now: signal the batch script only.
    subprocess.run(["scancel", "--signal=USR2", "--batch", job], env=slurm, check=True, timeout=30)
    info = wait_for(slurm, job, until=lambda info: info.get("Restarts") == "1" or info.get("JobState") in FINAL)
    assert info.get("Restarts") == "1", \
        f"not requeued: {info.get('JobState')}\n{output(tmp_path, 'hpccomm-preempt', job)}"
    # SLURM holds a requeued job for about two minutes before it may start again: not in a test.
    # But not in the second of the requeue either: slurmd refuses a credential made in the same
    # second as the old one's revocation ("Job credential revoked") and the job fails.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True, timeout=30)
    text = finished_ok(slurm, tmp_path, "preempt", job)
    stopped = re.search(r"^checkpointed at step (\d+); exiting for requeue$", text, re.M)
    resumed = re.search(r"^resumed from step (\d+)$", text, re.M)
    assert stopped and resumed and stopped.group(1) == resumed.group(1), text
    assert 10 <= int(resumed.group(1)) < steps, text
    assert "USR2: asking the ranks to checkpoint, then requeueing job" in text
    assert re.search(rf"^done: {steps} steps, weight .*: OK$", text, re.M), text
    assert "(restart 1)" in text


@pytest.mark.one_cell
def test_gpu_template_is_accepted_by_sbatch_test_only(slurm):
    ok = subprocess.run([sys.executable, "-m", "hpccomm", "jobs", "submit", "--test-only", "gpu", "--nodes", "2",
                         "--ntasks-per-node", "2", "--gpus-per-node", "2", "--cpus-per-task", "1", "--time", "10",
                         "--", "python", "train.py"], env=slurm, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and re.search(r"Job \d+ to start at .* on nodes n\[1-2\]", ok.stdout), ok
    too_many = subprocess.run([sys.executable, "-m", "hpccomm", "jobs", "submit", "--test-only", "gpu", "--nodes",
                               "2", "--ntasks-per-node", "2", "--gpus-per-node", "4", "--", "python", "train.py"],
                              env=slurm, capture_output=True, text=True, timeout=60)
    assert too_many.returncode == 2 and "sbatch refused the job" in too_many.stderr, too_many


@pytest.mark.one_cell
def test_preflight_stops_a_gpu_job_with_fewer_gpus_than_ranks(slurm, tmp_path):
    script = render("gpu", "--nodes", "2", "--ntasks-per-node", "2", "--gpus-per-node", "1", "--cpus-per-task", "1",
                    "--time", "10", "--", sys.executable, "-c", "raise SystemExit('the preflight let this run')")
    job = sbatch(slurm, script, tmp_path)
    info = wait_for(slurm, job)
    text = output(tmp_path, "hpccomm-gpu", job)
    assert info["JobState"] == "FAILED", text
    for node in ("n1", "n2"):
        assert text.count(f"hpccomm preflight: node {node}: 2 rank(s) but 1 GPU(s): one rank per GPU") == 1, text
    assert "the preflight let this run" not in text


def test_preflight_names_the_mpi_plugin(slurm, tmp_path):
    """The silent-singleton trap: the wrong srun plugin for the MPI family in
    use (Open MPI under --mpi=pmi2; MPICH and Intel MPI under --mpi=none, since
    --mpi=pmix makes them abort rather than run alone) leaves every rank a
    world of 1; the preflight stops the job, naming the family's plugin."""
    mpi = require()
    wrong = "pmi2" if mpi.spec.srun_mpi == "pmix" else "none"
    script = render("cpu", "--nodes", "2", "--ntasks-per-node", "2", "--time", "10", "--mpi-plugin", wrong, "--",
                    sys.executable, "-c", "raise SystemExit('the preflight let this run')")
    job = sbatch(slurm, script, tmp_path)
    info = wait_for(slurm, job)
    text = output(tmp_path, "hpccomm-cpu", job)
    assert info["JobState"] == "FAILED", text
    assert "srun started 4 tasks (SLURM_NTASKS=4) but MPI sees a world of 1" in text, text
    assert f"this is {mpi.spec.title}: use srun --mpi={mpi.spec.srun_mpi} (" in text, text
    assert "the preflight let this run" not in text
