"""The sbatch templates in jobs/ and `hpccomm jobs` (no SLURM needed here; the
templates run for real on a two-node SLURM in tests/test_slurm.py).

Each template's rendering is compared line by line with a checked-in reference
in tests/data/jobs/; every template and rendering passes `bash -n`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpccomm.tools import jobs

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "jobs"
NAMES = ["cpu", "cpu-ft", "cpu-mpirun", "gpu", "preempt", "tests", "torchrun"]

#: The parameters of each reference rendering (cpu.sbatch's names srun's plugin; the other srun
#: templates keep MPI_PLUGIN=auto).
REFERENCE = {
    name: ({"nodes": 3, "ntasks-per-node": 3, "time": "01:30:00", "partition": "batch", "cpus-per-task": 2,
            **({"gpus-per-node": 3} if name == "gpu" else {}), **({"mpi-plugin": "pmi2"} if name == "cpu" else {})},
           ["python", "train.py", "--data", "/scratch/my data"] if name != "torchrun" else ["train.py", "--lr", "0.1"])
    for name in NAMES
}


def _cli(*args, check=False):
    return subprocess.run([sys.executable, "-m", "hpccomm", "jobs", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=check, timeout=120)


@pytest.mark.one_cell
def test_the_templates_are_the_expected_ones():
    assert sorted(jobs.templates()) == sorted(NAMES)


@pytest.mark.one_cell
@pytest.mark.parametrize("name", NAMES)
def test_template_and_rendering_pass_bash_n(name, tmp_path):
    values, command = REFERENCE[name]
    rendered = tmp_path / f"{name}.sbatch"
    rendered.write_text(jobs.render(name, values, command))
    for path in (ROOT / "jobs" / f"{name}.sbatch", rendered):
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, (path, proc.stderr)


@pytest.mark.one_cell
@pytest.mark.parametrize("name", NAMES)
def test_rendering_matches_the_reference(name):
    values, command = REFERENCE[name]
    got = jobs.render(name, values, command).splitlines()
    want = (DATA / f"{name}.sbatch").read_text().splitlines()
    for number, (g, w) in enumerate(zip(got, want), 1):
        assert g == w, f"{name}.sbatch line {number}: rendered {g!r}, reference {w!r}"
    assert len(got) == len(want), f"{name}.sbatch: {len(got)} lines rendered, {len(want)} in the reference"


@pytest.mark.one_cell
@pytest.mark.parametrize("name", NAMES)
def test_rendering_changes_only_the_value_lines(name):
    """Everything but the parameter lines and COMMAND is the template's own text."""
    values, command = REFERENCE[name]
    template = (ROOT / "jobs" / f"{name}.sbatch").read_text().splitlines()
    got = jobs.render(name, values, command).splitlines()
    changed = [(t, g) for t, g in zip(template, got) if t != g]
    assert len(template) == len(got)
    assert len(changed) == len(values) + 1, changed  # one line per value, and COMMAND
    for t, g in changed:
        assert g.startswith(("#SBATCH --", "COMMAND=(", "NPROC_PER_NODE=", "MPI_PLUGIN=")), g


@pytest.mark.one_cell
def test_command_words_are_quoted():
    out = jobs.render("cpu", {"nodes": 1, "ntasks-per-node": 1}, ["python", "a b.py", "$HOME", "it's"])
    assert "COMMAND=(python 'a b.py' '$HOME' 'it'\"'\"'s')" in out.splitlines()


@pytest.mark.one_cell
def test_torchrun_takes_workers_per_node_not_tasks():
    out = jobs.render("torchrun", {"nodes": 2, "ntasks-per-node": 8}, ["train.py"]).splitlines()
    assert "NPROC_PER_NODE=8" in out and "#SBATCH --ntasks-per-node=1" in out


@pytest.mark.one_cell
@pytest.mark.parametrize("name,values,command,message", [
    ("nope", {"nodes": 1, "ntasks-per-node": 1}, ["x"], r"^no template 'nope'; templates: .*cpu"),
    ("cpu", {"ntasks-per-node": 1}, ["x"], r"^template 'cpu' needs --nodes$"),
    ("cpu", {"nodes": 1}, ["x"], r"^template 'cpu' needs --ntasks-per-node$"),
    ("cpu", {"nodes": 1, "ntasks-per-node": 1}, [], r"^template 'cpu' needs the command to run, after -- "),
    ("gpu", {"nodes": 1, "ntasks-per-node": 1}, ["x"], r"^template 'gpu' needs --gpus-per-node$"),
    ("cpu", {"nodes": 1, "ntasks-per-node": 1, "gpus-per-node": 2}, ["x"],
     r"^template 'cpu' has no --gpus-per-node \(no line matching"),
    ("cpu", {"nodes": 1, "ntasks-per-node": 1, "mem": "4G"}, ["x"], r"^unknown parameter\(s\) --mem; known: --nodes"),
    ("cpu", {"nodes": "0", "ntasks-per-node": 1}, ["x"], r"^--nodes must be a positive integer, not '0'$"),
    ("cpu", {"nodes": 1, "ntasks-per-node": 1, "time": "1h"}, ["x"], r"^--time '1h' is not a SLURM time"),
    ("cpu", {"nodes": 1, "ntasks-per-node": 1, "partition": "a b"}, ["x"], r"^--partition 'a b' is not a partition"),
    ("cpu", {"nodes": 1, "ntasks-per-node": 1, "mpi-plugin": "pmi 2"}, ["x"],
     r"^--mpi-plugin 'pmi 2' is not an srun MPI plugin name \(auto, pmix, pmi2, \.\.\.\)$"),
    ("cpu-mpirun", {"nodes": 1, "ntasks-per-node": 1, "mpi-plugin": "pmi2"}, ["x"],
     r"^template 'cpu-mpirun' has no --mpi-plugin \(no line matching"),
])
def test_render_refuses(name, values, command, message):
    with pytest.raises(jobs.JobsError, match=message) as info:
        jobs.render(name, values, command)
    assert "  " not in str(info.value)


@pytest.mark.one_cell
def test_a_template_with_two_lines_for_a_value_is_refused(tmp_path):
    text = (ROOT / "jobs" / "cpu.sbatch").read_text()
    text = text.replace("#SBATCH --nodes=2", "#SBATCH --nodes=2\n#SBATCH --nodes=3")
    (tmp_path / "cpu.sbatch").write_text(text)
    with pytest.raises(jobs.JobsError, match=r"^template 'cpu' has 2 lines for --nodes \(lines 9, 10\)"):
        jobs.render("cpu", {"nodes": 1, "ntasks-per-node": 1}, ["x"], tmp_path)


@pytest.mark.one_cell
def test_cli_list_and_render():
    proc = _cli("list", check=True)
    assert [line.split()[0] for line in proc.stdout.splitlines()] == sorted(NAMES, key=lambda n: n + ".sbatch")
    values, command = REFERENCE["cpu"]
    # options before and after NAME
    proc = _cli("render", "--nodes", "3", "cpu", "--ntasks-per-node", "3", "--time", "01:30:00", "--partition",
                "batch", "--cpus-per-task", "2", "--mpi-plugin", "pmi2", "--", *command, check=True)
    assert proc.stdout == (DATA / "cpu.sbatch").read_text()


@pytest.mark.one_cell
@pytest.mark.parametrize("name", ["cpu", "gpu", "preempt", "tests"])
def test_srun_templates_ask_the_mpi_library_for_the_plugin(name):
    """MPI_PLUGIN=auto (the default) is replaced in the job by what
    ``python -m hpccomm jobs mpi-plugin`` says, before the first srun."""
    lines = (ROOT / "jobs" / f"{name}.sbatch").read_text().splitlines()
    assert "MPI_PLUGIN=auto" in lines
    ask = lines.index('if [ "$MPI_PLUGIN" = auto ]; then MPI_PLUGIN=$(python -m hpccomm jobs mpi-plugin) || exit 1; fi')
    first_srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert ask < first_srun


def test_cli_mpi_plugin_names_the_family_plugin():
    """pmix for Open MPI, pmi2 for MPICH and Intel MPI: the library mpi4py loads here."""
    from mpilaunch import require

    proc = _cli("mpi-plugin")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, require().spec.srun_mpi + "\n", ""), proc


@pytest.mark.one_cell
def test_cli_mpi_plugin_without_a_library_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPI4PY_LIBMPI": str(tmp_path / "libnothing.so")}
    proc = subprocess.run([sys.executable, "-m", "hpccomm", "jobs", "mpi-plugin"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith("hpccomm jobs mpi-plugin: error: no usable MPI library: no MPI library could be "
                                  "loaded: cannot load MPI library"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.one_cell
@pytest.mark.parametrize("library,expected", [
    ("Open MPI v5.0.11", "this is Open MPI: use srun --mpi=pmix (--mpi=pmi2 and none leave every rank alone)"),
    ("MPICH Version:      5.0.2", "this is MPICH: use srun --mpi=pmi2 (--mpi=pmix aborts, none leaves every rank "
                                  "alone)"),
    ("Intel(R) MPI Library 2021.18.1 for Linux* OS", "this is Intel MPI: use srun --mpi=pmi2 (--mpi=pmix works "
                                                     "too, none leaves every rank alone)"),
    ("Some MPI 1.0", "use srun --mpi=pmix for Open MPI, --mpi=pmi2 for MPICH and Intel MPI (srun --mpi=list shows "
                     "them)"),
])
def test_preflight_plugin_hint_per_family(library, expected):
    assert jobs._mpi_plugin_hint(library) == expected


@pytest.mark.one_cell
@pytest.mark.parametrize("args,message", [
    (["render", "cpu", "--nodes", "1", "--", "x"], "template 'cpu' needs --ntasks-per-node"),
    (["render", "cpu", "--nodes", "1", "--ntasks-per-node", "1", "python", "x"], "unexpected argument(s) python x"),
    (["render", "cpu", "--nodes", "1", "--ntasks-per-node", "1", "--mem", "3", "--", "x"],
     "unexpected argument(s) --mem 3"),
    (["render", "gpu", "--nodes", "1", "--ntasks-per-node", "1", "--", "x"], "template 'gpu' needs --gpus-per-node"),
])
def test_cli_user_mistakes_exit_2_without_traceback(args, message):
    proc = _cli(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"hpccomm jobs render: error: {message}" + proc.stderr[len("hpccomm jobs render: error: ")
                                                                              + len(message):]
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.one_cell
@pytest.mark.parametrize("args", [["--help"], ["list", "--help"], ["render", "--help"], ["submit", "--help"],
                                  ["preflight", "--help"], ["mpi-plugin", "--help"]])
def test_cli_help(args):
    proc = _cli(*args)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: hpccomm jobs"), proc.stderr


@pytest.mark.one_cell
def test_submit_without_sbatch_says_so(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "hpccomm", "jobs", "submit", "cpu", "--nodes", "1",
                           "--ntasks-per-node", "1", "--", "x"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "sbatch not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.one_cell
@pytest.mark.parametrize("spec,expected", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2", [1, 2])])
def test_tasks_per_node(spec, expected):
    assert jobs.tasks_per_node(spec) == expected


@pytest.mark.one_cell
@pytest.mark.parametrize("env,tasks,problem", [
    ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURMD_NODENAME": "g1"}, 2, None),
    ({"SLURM_GPUS_ON_NODE": "4", "SLURMD_NODENAME": "g1"}, 4, None),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURMD_NODENAME": "g1"}, 4, "node g1: 4 rank(s) but 2 GPU(s)"),
    ({"SLURMD_NODENAME": "g1"}, 2, "node g1: 2 rank(s) but no GPU allocated"),
    ({"CUDA_VISIBLE_DEVICES": "", "SLURMD_NODENAME": "g1"}, 2, "node g1: 2 rank(s) but no GPU allocated"),
])
def test_gpu_check(env, tasks, problem):
    found = jobs.check_gpus(env, tasks)
    assert (found[0].startswith(problem) if problem else found == []), found


@pytest.mark.one_cell
def test_gpu_check_counts_this_nodes_tasks():
    env = {"SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert jobs._tasks_here(env) == 2 and jobs.check_gpus(env, jobs._tasks_here(env)) == []


@pytest.mark.one_cell
def test_endpoint_check():
    assert jobs.check_endpoint("localhost", "nodeA", "nodeA") == []  # loopback on its own machine is fine
    problem = jobs.check_endpoint("localhost", "nodeA", "nodeB")
    assert problem and "resolves to the loopback address 127." in problem[0] and "HPCCOMM_STORE_ADDR" in problem[0]
    assert "cannot resolve" in jobs.check_endpoint("no-such-host.invalid", "x", "y")[0]


@pytest.mark.one_cell
def test_preflight_no_mpi_refuses_a_loopback_endpoint_on_two_nodes():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURM_JOB_NUM_NODES": "2"}
    proc = subprocess.run([sys.executable, "-m", "hpccomm.tools.jobs", "preflight", "--no-mpi", "--rdzv-endpoint",
                           "127.0.0.1:29500"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and "is a loopback address on a 2-node job" in proc.stderr, proc.stderr


if __name__ == "__main__" and sys.argv[1:] == ["--regenerate"]:
    DATA.mkdir(parents=True, exist_ok=True)
    for name, (values, command) in REFERENCE.items():
        (DATA / f"{name}.sbatch").write_text(jobs.render(name, values, command))
        print("wrote", DATA / f"{name}.sbatch")
