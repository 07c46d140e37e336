"""The ``hpccomm`` command: ``hpccomm info`` alone and under mpirun, its
problem detection over synthetic per-rank views, and the command-line
conventions (``--help``, exit status 2 for a bad command line, no traceback).

Plain pytest; the launches are subprocesses under ``timeout``, with the
launcher of the MPI family in use (tests/mpilaunch.py); what ``hpccomm info``
must say differs by family (FAMILY_INFO).
"""
from __future__ import annotations

import configparser
import copy
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mpilaunch import require

from hpccomm.tools import info

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120
HPCCOMM = [sys.executable, "-m", "hpccomm"]


#: What ``hpccomm info`` says of each family's wheel (recorded here: Open MPI 5.0.11,
#: MPICH 5.0.2, Intel MPI 2021.18.1); docs/mpi-families.md has the whole table.
FAMILY_INFO = {
    "openmpi": {"abi": "openmpi", "library": "Open MPI v5", "path": "libmpi.so.40", "standard": "3.1",
                "launcher": "mpirun", "oversubscribe": "--oversubscribe", "srun_mpi": "--mpi=pmix",
                "large_count": "no (no MPI_Send_c", "ulfm_error_classes": "distinct classes"},
    "mpich": {"abi": "mpich", "library": "MPICH Version:", "path": "libmpi.so.12", "standard": "5.0",
              "launcher": "mpiexec", "oversubscribe": "none needed (Hydra starts any number of ranks)",
              "srun_mpi": "--mpi=pmi2", "large_count": "yes (MPI_Send_c",
              "ulfm_error_classes": "ERR_PROC_FAILED and ERR_REVOKED are ERR_UNKNOWN"},
    "intelmpi": {"abi": "mpich", "library": "Intel(R) MPI Library 2021.", "path": "libmpi.so", "standard": "4.1",
                 "launcher": "mpiexec", "oversubscribe": "none needed (Hydra starts any number of ranks)",
                 "srun_mpi": "--mpi=pmi2", "large_count": "yes (MPI_Send_c",
                 "ulfm_error_classes": "ERR_PROC_FAILED and ERR_REVOKED are ERR_UNKNOWN"},
}


def _env(**extra) -> dict:
    return require().env(**extra)


def run(*args, mpirun=None, **env) -> subprocess.CompletedProcess:
    """``hpccomm ARGS`` (under the family's launcher with N ranks when
    ``mpirun`` is N, or with a list of launcher arguments), under a timeout."""
    cmd = ["timeout", "--kill-after=10", str(TIMEOUT - 15)]
    if isinstance(mpirun, int):
        cmd += require().argv(mpirun, *HPCCOMM, *args)
    elif mpirun:
        cmd += [require().launcher, *require().spec.oversubscribe, *mpirun]
    else:
        cmd += [*HPCCOMM, *args]
    return subprocess.run(cmd, env=_env(**env), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)


def _expected():
    return FAMILY_INFO[require().family]


def describe(proc) -> str:
    return f"$ {' '.join(proc.args)}\nexit {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n" \
           f"{proc.stderr[-5000:]}"


# --------------------------------------------------------------------------
# real runs
# --------------------------------------------------------------------------

def test_info_text_alone():
    proc = run("info")
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    import mpi4py
    import torch

    for section in ("[versions]", "[mpi]", "[launcher]", "[host]", "[interfaces]", "[store]", "[options]"):
        assert f"\n{section}\n" in out, describe(proc)
    gpu = "\n[gpu]\n" if torch.cuda.is_available() else f"\n[gpu] none: torch {torch.__version__} sees no CUDA device"
    assert gpu in out, describe(proc)

    assert f"  torch                      {torch.__version__}\n" in out
    assert f"  mpi4py                     {mpi4py.__version__}\n" in out
    assert "  thread_level_requested     MULTIPLE\n" in out and "  name                       single\n" in out
    want = _expected()
    assert f"  library                    {want['library']}" in out, out
    assert f"  family                     {require().family}\n" in out, out
    assert f"  launcher                   {require().launcher}\n" in out, out
    for key in ("oversubscribe", "srun_mpi"):
        assert f"  {key:26s} {want[key]}\n" in out, out
    assert out.rstrip().endswith("[problems] none found"), out
    assert "Traceback" not in proc.stderr, describe(proc)


def test_info_json_alone():
    proc = run("info", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert set(doc) == {"ranks", "differing", "problems"} and doc["problems"] == [] and doc["differing"] == []
    (rank,) = doc["ranks"]
    import numpy
    import torch

    import hpccomm

    assert rank["versions"] == {"hpccomm": hpccomm.__version__, "torch": torch.__version__,
                                "mpi4py": __import__("mpi4py").__version__, "numpy": numpy.__version__,
                                "python": "%d.%d.%d" % sys.version_info[:3]}
    mpi = rank["mpi"]
    want = _expected()
    assert mpi["available"] is True and mpi["abi"] == want["abi"] and mpi["path"].endswith("/" + want["path"]), mpi
    assert (mpi["rank"], mpi["size"], mpi["thread_level_granted"], mpi["standard"]) == \
        (0, 1, "MULTIPLE", want["standard"]), mpi
    assert mpi["library"].startswith(want["library"]) and mpi["family"] == require().family, mpi
    assert mpi["launcher"] == require().launcher and mpi["launcher"].endswith("/" + want["launcher"]), mpi
    for key in ("oversubscribe", "srun_mpi", "large_count", "ulfm_error_classes"):
        assert mpi[key].startswith(want[key]), (key, mpi[key])
    assert isinstance(mpi["tag_ub"], int) and mpi["tag_ub"] >= 32767, mpi  # the least MPI allows
    assert rank["launcher"]["name"] == "single" and rank["store"]["free_port"] == "ok"
    assert rank["host"]["name"] == socket.gethostname() and rank["host"]["addresses"], rank["host"]
    assert "lo" in rank["interfaces"] and "127.0.0.1" in rank["interfaces"]["lo"], rank["interfaces"]
    gpu = {k: rank["gpu"][k] for k in ("cuda", "devices", "nccl")}
    assert gpu == {"cuda": torch.cuda.is_available(), "devices": torch.cuda.device_count(),
                   "nccl": hpccomm.is_nccl_available()}
    # the GPU transport report (hpccomm.gpu.info): on this MPI, how CUDA-awareness was decided
    assert rank["gpu"]["mpi_cuda_aware"] in ("yes", "no", "unknown") and rank["gpu"]["mpi_cuda_aware_how"]
    assert rank["gpu"]["cpu_transport"] == "mpi (host memory)"
    assert rank["gpu"]["gpu_binding"].startswith("none: "), rank["gpu"]  # a CPU job binds no GPU
    assert rank["gpu"]["cuda_routes"].startswith("reduction: "), rank["gpu"]
    assert rank["options"]["HPCCOMM_LOG"] == "WARNING"
    # the synthetic views below have the same fields as a real one
    fake = _view(0, 1)
    assert set(rank) == set(fake)
    for section in set(rank) - {"interfaces", "options", "pid"}:
        assert set(rank[section]) == set(fake[section]), section


@pytest.mark.parametrize("n", [2, 3])
def test_info_json_under_mpirun(n):
    """Rank 0 prints one document with every rank's view; ranks agree."""
    proc = run("info", "--json", mpirun=n)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)  # exactly one JSON document: only rank 0 printed
    ranks = doc["ranks"]
    assert [r["mpi"]["rank"] for r in ranks] == list(range(n)) and {r["mpi"]["size"] for r in ranks} == {n}
    assert [(r["launcher"]["name"], r["launcher"]["rank"], r["launcher"]["size"], r["launcher"]["local_size"])
            for r in ranks] == [(require().family, k, n, n) for k in range(n)]
    # (Open MPI numbers local ranks its own way, not always in world-rank order)
    assert sorted(r["launcher"]["local_rank"] for r in ranks) == list(range(n))
    assert {r["launcher"]["command"] for r in ranks} == {require().command_name}
    assert {r["mpi"]["family"] for r in ranks} == {require().family}
    assert len({r["pid"] for r in ranks}) == n
    assert {"mpi.rank", "launcher.rank"} <= set(doc["differing"]) and "pid" not in doc["differing"], doc["differing"]
    assert doc["problems"] == [], doc["problems"]
    # the GPU routes of a group of every rank, from all their findings: one answer, said by every rank
    assert len({r["gpu"]["cuda_routes"] for r in ranks}) == 1 and "gpu.cuda_routes" not in doc["differing"]
    assert ranks[0]["gpu"]["cuda_routes"].startswith("reduction: "), ranks[0]["gpu"]


def test_info_text_under_mpirun_shows_per_rank_table():
    proc = run("info", mpirun=2)
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    assert out.startswith("hpccomm info (rank 0 of 2)\n") and out.count("[versions]") == 1, out
    # One machine, one MPI: the ranks differ in their rank numbers only, which the table leaves out.
    assert "\n[per rank] the 2 ranks differ only in their rank numbers (mpi.rank, launcher.rank, " \
           "launcher.local_rank)\n" in out, out
    assert out.rstrip().endswith("[problems] none found"), out


def test_info_under_mpirun_reports_a_disagreement():
    """One rank with another HPCCOMM_DEBUG: named, with its ranks, exit 1."""
    proc = run(mpirun=["-n", "1", "env", "HPCCOMM_DEBUG=INFO", *HPCCOMM, "info", "--json", ":",
                       "-n", "2", *HPCCOMM, "info", "--json"])
    assert proc.returncode == 1, describe(proc)
    doc = json.loads(proc.stdout)
    assert "options.HPCCOMM_DEBUG" in doc["differing"], doc["differing"]
    assert doc["problems"] == ["options.HPCCOMM_DEBUG differs between ranks: 'INFO' on rank 0; 'OFF' on ranks 1-2"]


def test_info_flags_the_silent_singleton():
    """A process SLURM says is one of 4 tasks of a step, alone in its MPI
    world: the fix names the srun plugin of the MPI family in use."""
    proc = run("info", SLURM_NTASKS=4, SLURM_STEP_ID=0, SLURM_PROCID=2)
    assert proc.returncode == 1, describe(proc)
    assert "[problems] 1\n" in proc.stdout, describe(proc)
    assert "  - rank 0: srun started 4 processes (SLURM_NTASKS=4) but MPI says the world has 1 (the " \
           f"silent-singleton trap: use srun {_expected()['srun_mpi']}; this step has --mpi=none)\n" in proc.stdout, \
        proc.stdout
    assert "  - rank 0: srun says rank 2 (SLURM_PROCID) but MPI says rank 0\n" not in proc.stdout  # one line per rank
    assert "Traceback" not in proc.stderr


def test_info_flags_a_busy_store_port():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run("info", "--json", HPCCOMM_STORE_PORT=port)
    assert proc.returncode == 1, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["ranks"][0]["store"]["port"] == port
    (problem,) = doc["problems"]
    assert problem.startswith(f"rank 0 (where the key-value store opens): cannot listen on *:{port}: Address "
                              "already in use; set HPCCOMM_STORE_PORT to a port that is free"), problem


def test_info_flags_a_bad_option_without_traceback():
    proc = run("info", HPCCOMM_STORE_PORT="http")
    assert proc.returncode == 1, describe(proc)
    assert "  - rank 0: HPCCOMM_STORE_PORT='http' is not a valid port: " in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, describe(proc)


# --------------------------------------------------------------------------
# command-line conventions
# --------------------------------------------------------------------------

@pytest.mark.one_cell
@pytest.mark.parametrize("args", [["--help"], ["info", "--help"], ["-h"]])
def test_help(args):
    proc = run(*args)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: hpccomm"), describe(proc)
    if "info" in args:
        assert "--json" in proc.stdout and "Exit status: 0 no problem found, 1 a problem found" in proc.stdout


@pytest.mark.one_cell
@pytest.mark.parametrize("args,fragment", [
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_arguments_exit_2_without_traceback(args, fragment):
    proc = run(*args)
    assert proc.returncode == 2, describe(proc)
    assert proc.stdout == "" and fragment in proc.stderr and "Traceback" not in proc.stderr, describe(proc)


@pytest.mark.one_cell
def test_every_subcommand_is_a_tool_with_help():
    """Every subcommand is a module of hpccomm.tools with its own --help."""
    from hpccomm.__main__ import SUBCOMMANDS

    assert all(module.startswith("hpccomm.tools.") for module, _ in SUBCOMMANDS.values()), SUBCOMMANDS
    for name in SUBCOMMANDS:
        proc = run(name, "--help")
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: hpccomm {name}"), describe(proc)


@pytest.mark.one_cell
def test_demo_under_mpirun():
    proc = run("demo", mpirun=2)
    assert proc.returncode == 0, describe(proc)
    assert "all_reduce(SUM) of rank+1 over 2 ranks: [3.0, 3.0, 3.0, 3.0]  (expected 3.0)" in proc.stdout, \
        describe(proc)
    assert "all ranks hold identical weights" in proc.stdout, describe(proc)


@pytest.mark.one_cell
def test_bench_gpu_on_the_host_path_and_a_bad_op():
    """``hpccomm bench-gpu --device cpu`` runs its loop on CPU tensors and checks
    every result; an unknown op is refused (status 2) before MPI starts."""
    proc = run("bench-gpu", "--device", "cpu", "--ops", "all_reduce,broadcast", "--sizes", "64,4K", "--iters", "2",
               "--warmup", "1", mpirun=2)
    assert proc.returncode == 0 and "WRONG" not in proc.stdout, describe(proc)
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["host"]]
    assert sorted((r[2], r[3]) for r in rows) == sorted(
        (op, size) for op in ("all_reduce", "broadcast") for size in ("64", "4096")), describe(proc)
    bad = run("bench-gpu", "--device", "cpu", "--ops", "all_reduce,nosuch")
    assert bad.returncode == 2 and "unknown op(s) ['nosuch']" in bad.stderr and "Traceback" not in bad.stderr, \
        describe(bad)


def test_console_script_is_declared():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert "hpccomm = hpccomm.__main__:main" in cfg["options.entry_points"]["console_scripts"]


# --------------------------------------------------------------------------
# problem detection over synthetic per-rank views
# --------------------------------------------------------------------------

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"


def _view(rank: int, size: int, host: str = "n1", launcher: str = "openmpi") -> dict:
    """A rank's view as :func:`hpccomm.tools.info.collect` makes it (same fields)."""
    return {
        "versions": {"hpccomm": "0.1.0", "torch": "2.13.0+cpu", "mpi4py": "4.1.2", "numpy": "2.4.6",
                     "python": "3.11.7"},
        "mpi": {"available": True, "library": OPEN_MPI, "abi": "openmpi", "path": "/venv/lib/libmpi.so.40",
                "reason": None, "standard": "3.1", "thread_level_requested": "MULTIPLE",
                "thread_level_granted": "MULTIPLE", "rank": rank, "size": size, "processor": host,
                "family": "openmpi", "launcher": "/venv/bin/mpirun", "oversubscribe": "--oversubscribe",
                "srun_mpi": "--mpi=pmix", "large_count": "no (no MPI_Send_c: ...)", "tag_ub": 2**31 - 1,
                "error_classes": "ERR_TRUNCATE=15 ERR_UNKNOWN=14 ERR_PROC_FAILED=75 ERR_REVOKED=77",
                "ulfm_error_classes": "distinct classes"},
        "launcher": {"name": launcher, "rank": rank, "size": size, "local_rank": rank % 2, "local_size": 2,
                     "node_index": None, "command": "mpirun", "rank_variable": "OMPI_COMM_WORLD_RANK",
                     "size_variable": "OMPI_COMM_WORLD_SIZE", "pmi": None},
        "host": {"name": host, "fqdn": host + ".cluster", "addresses": ["10.0.0.%d" % (1 + int(host[1:]))],
                 "loopback": False, "error": None},
        "interfaces": {"lo": ["127.0.0.1", "::1/128"], "eth0": ["10.0.0.%d" % (1 + int(host[1:]))]},
        "store": {"free_port": "ok", "configured_port": None, "port": None},
        "options": {"HPCCOMM_LOG": "WARNING", "HPCCOMM_DEBUG": "OFF"},
        "gpu": {"cuda": False, "devices": 0, "nccl": False, "mpi_cuda_aware": "no",
                "mpi_cuda_aware_how": "MPIX_Query_cuda_support() returned 0 (Open MPI extension)",
                "nccl_torch": "no (torch.distributed.is_nccl_available() is False)", "nccl_cupy": "no",
                "gpu_count": 0, "gpu_transport": "auto", "cpu_transport": "mpi (host memory)",
                "mpi_cuda_advice": "-", "mpi_device_reductions": "unknown (not CUDA-aware)",
                "mpi_device_movement": "unknown (not CUDA-aware)",
                "mpi_device_reduce_scatter": "unknown (not CUDA-aware)",
                "cuda_routes": "reduction: staged, movement: staged, p2p: staged (fallback staged): ...",
                "gpu_binding": "none: not bound yet"},
        "pid": 1000 + rank,
    }


def _job(size=4, nodes=2):
    return [_view(r, size, host=f"n{r * nodes // size + 1}") for r in range(size)]


def test_healthy_job_has_no_problems():
    views = _job()
    assert info.problems(views) == []
    assert info.differing(views) == ["host.addresses", "host.name", "interfaces.eth0", "launcher.local_rank",
                                     "launcher.rank", "mpi.processor", "mpi.rank"]


@pytest.mark.parametrize("field,values,expected", [
    ("versions.torch", {2: "2.12.0"}, "versions.torch differs between ranks: '2.13.0+cpu' on ranks 0-1,3; '2.12.0' "
                                      "on rank 2"),
    ("versions.hpccomm", {0: "0.2.0", 1: "0.2.0"}, "versions.hpccomm differs between ranks: '0.2.0' on ranks 0-1; "
                                                   "'0.1.0' on ranks 2-3"),
    ("mpi.library", {3: "MPICH Version:      5.0.2"},
     f"mpi.library differs between ranks: {OPEN_MPI!r} on ranks 0-2; 'MPICH Version:      5.0.2' on rank 3"),
    ("mpi.thread_level_granted", {1: "SERIALIZED"}, "mpi.thread_level_granted differs between ranks: 'MULTIPLE' on "
                                                    "ranks 0,2-3; 'SERIALIZED' on rank 1"),
    ("options.HPCCOMM_DEBUG", {0: "DETAIL"}, "options.HPCCOMM_DEBUG differs between ranks: 'DETAIL' on rank 0; "
                                             "'OFF' on ranks 1-3"),
])
def test_fields_that_must_agree(field, values, expected):
    views = _job()
    section, key = field.split(".")
    for rank, value in values.items():
        views[rank][section][key] = value
    assert info.problems(views) == [expected]
    assert field in info.differing(views)


def test_mpi_family_must_agree():
    views = _job()
    views[2]["mpi"].update(family="mpich")
    assert info.problems(views) == ["mpi.family differs between ranks: 'openmpi' on ranks 0-1,3; 'mpich' on rank 2"]


#: _mpi.library.capabilities() as recorded on the three wheels (Open MPI 5.0.11, MPICH 5.0.2, Intel MPI 2021.18.1).
CAPABILITIES = {
    "openmpi": {"large_count": False, "tag_ub": 2**31 - 1, "ulfm_classes": True,
                "error_classes": {"ERR_TRUNCATE": 15, "ERR_UNKNOWN": 14, "ERR_PROC_FAILED": 75, "ERR_REVOKED": 77}},
    "mpich": {"large_count": True, "tag_ub": 2**29 - 1, "ulfm_classes": False,
              "error_classes": {"ERR_TRUNCATE": 14, "ERR_UNKNOWN": 13, "ERR_PROC_FAILED": 13, "ERR_REVOKED": 13}},
    "intelmpi": {"large_count": True, "tag_ub": 2**30 - 1, "ulfm_classes": False,
                 "error_classes": {"ERR_TRUNCATE": 14, "ERR_UNKNOWN": 13, "ERR_PROC_FAILED": 13, "ERR_REVOKED": 13}},
}


@pytest.mark.parametrize("family", sorted(CAPABILITIES))
def test_capability_lines(family):
    lines = info.capability_info(CAPABILITIES[family])
    assert lines["tag_ub"] == CAPABILITIES[family]["tag_ub"]
    if family == "openmpi":
        assert lines["large_count"] == ("no (no MPI_Send_c: mpi4py refuses counts past 2**31-1; hpccomm splits "
                                        "messages at HPCCOMM_MAX_MPI_COUNT)")
        assert lines["error_classes"] == "ERR_TRUNCATE=15 ERR_UNKNOWN=14 ERR_PROC_FAILED=75 ERR_REVOKED=77"
        assert lines["ulfm_error_classes"] == "distinct classes"
    else:
        assert lines["large_count"] == "yes (MPI_Send_c and the other MPI-4 _c calls, which mpi4py uses)"
        assert lines["error_classes"] == "ERR_TRUNCATE=14 ERR_UNKNOWN=13 ERR_PROC_FAILED=13 ERR_REVOKED=13"
        assert lines["ulfm_error_classes"] == ("ERR_PROC_FAILED and ERR_REVOKED are ERR_UNKNOWN in this mpi4py "
                                               "build (no fault-tolerance classes)")
    unknown = info.capability_info({**CAPABILITIES[family], "large_count": None})
    assert unknown["large_count"] == "unknown (the MPI library file was not found in this process)"


@pytest.mark.parametrize("library,family,launcher,oversubscribe,srun", [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution", "openmpi", "mpirun", "--oversubscribe",
     "--mpi=pmix"),
    ("MPICH Version:      5.0.2", "mpich", "mpiexec", "none needed (Hydra starts any number of ranks)", "--mpi=pmi2"),
    ("Intel(R) MPI Library 2021.18.1 for Linux* OS", "intelmpi", "mpiexec",
     "none needed (Hydra starts any number of ranks)", "--mpi=pmi2"),
])
def test_family_lines(tmp_path, monkeypatch, library, family, launcher, oversubscribe, srun):
    """The launcher is the one beside the library (bin/ next to lib/), else
    the first on PATH, else said to be missing."""
    from hpccomm._mpi.library import Probe

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmpi.so").write_text("")
    probe = Probe(True, "x", library, str(tmp_path / "lib" / "libmpi.so"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("PATH", str(elsewhere))
    lines = info.family_info(probe)
    assert lines == {"family": family, "launcher": f"{launcher} (not found beside the library or on PATH)",
                     "oversubscribe": oversubscribe, "srun_mpi": srun}
    for where in (elsewhere, tmp_path / "bin"):  # on PATH; then beside the library, which wins
        where.mkdir(exist_ok=True)
        (where / launcher).write_text("#!/bin/sh\n")
        (where / launcher).chmod(0o755)
        assert info.family_info(probe)["launcher"] == str(where / launcher)
    assert info.family_info(Probe(False, reason="none")) == {"family": None, "launcher": None,
                                                           "oversubscribe": None, "srun_mpi": None}


def test_fields_that_may_differ_are_no_problem():
    views = _job()
    views[1]["gpu"]["devices"] = 2
    views[1]["pid"] = 5
    assert info.problems(views) == [] and "gpu.devices" in info.differing(views)
    assert "pid" not in info.differing(views)


def test_silent_singleton_under_srun():
    """srun --mpi=pmi2 with Open MPI: every rank alone; the fix names pmix."""
    views = [_view(0, 1, "n1") for _ in range(2)]
    for r, v in enumerate(views):
        v["launcher"].update(name="srun", command="srun", rank=r, size=2, size_variable="SLURM_STEP_NUM_TASKS",
                             rank_variable="SLURM_PROCID", pmi="pmi2")
    found = info.problems(views)
    assert found[0] == ("rank 0: srun started 2 processes (SLURM_STEP_NUM_TASKS=2) but MPI says the world has 1 "
                        "(the silent-singleton trap: use srun --mpi=pmix; this step has --mpi=pmi2)"), found
    assert found[1].startswith("rank 1: srun started 2 processes"), found
    views[0]["mpi"]["library"] = views[1]["mpi"]["library"] = "MPICH Version:      5.0.2"
    assert "use srun --mpi=pmi2; this step has --mpi=pmi2" in info.problems(views)[0]


def test_launcher_size_and_rank_disagree_with_mpi():
    views = _job(size=2, nodes=1)
    views[0]["launcher"]["size"] = 3
    views[1]["launcher"]["rank"] = 0
    found = info.problems(views)
    assert "launcher.size differs between ranks: 3 on rank 0; 2 on rank 1" in found
    assert "rank 0: mpirun started 3 processes (OMPI_COMM_WORLD_SIZE=3) but MPI says the world has 2" in found
    assert "rank 1: mpirun says rank 0 (OMPI_COMM_WORLD_RANK) but MPI says rank 1" in found


def test_loopback_host_only_matters_across_nodes():
    one_node = _job(size=2, nodes=1)
    for v in one_node:
        v["host"].update(addresses=["127.0.1.1"], loopback=True)
    assert info.problems(one_node) == []
    views = _job(size=4, nodes=2)
    views[0]["host"].update(addresses=["127.0.1.1"], loopback=True)
    assert info.problems(views) == [
        "rank 0: host name 'n1' resolves only to loopback (127.0.1.1) on a 2-node run: other nodes cannot reach it "
        "by name; fix /etc/hosts or set HPCCOMM_STORE_ADDR to an address of rank 0"]


def test_unresolvable_host_store_port_and_missing_mpi():
    views = _job(size=2, nodes=1)
    views[1]["host"]["error"] = "'n9' does not resolve: [Errno -2] Name or service not known"
    views[0]["store"]["configured_port"] = "cannot listen on *:29500: [Errno 98] Address already in use"
    views[1]["store"]["configured_port"] = "cannot listen on *:29500: elsewhere, not rank 0: ignored"
    assert info.problems(views) == [
        "rank 1: 'n9' does not resolve: [Errno -2] Name or service not known: fix /etc/hosts or DNS, or set "
        "HPCCOMM_STORE_ADDR",
        "rank 0 (where the key-value store opens): cannot listen on *:29500: [Errno 98] Address already in use; set "
        "HPCCOMM_STORE_PORT to a port that is free",
    ]
    lonely = _view(0, 1)
    lonely["mpi"] = {**lonely["mpi"], "available": False, "reason": "mpi4py is not installed (pip install mpi4py)",
                     "rank": None, "size": None}
    assert info.problems([lonely]) == ["rank 0: no usable MPI: mpi4py is not installed (pip install mpi4py)"]


def test_render_table():
    views = _job(size=3, nodes=1)
    views[2]["versions"]["torch"] = "2.12.0"
    found = info.problems(views)
    text = info.render(views, found)
    lines = text.splitlines()
    assert lines[0] == "hpccomm info (rank 0 of 3)"
    start = lines.index("[per rank] fields that differ between the 3 ranks (besides mpi.rank, launcher.rank: the rank)")
    header = lines[start + 1].split()
    assert header == ["rank", "launcher.local_rank", "versions.torch"], header   # (2 ranks a node: local ranks 0 1 0)
    assert lines[start + 4].split() == ["2", "0", "2.12.0"], lines
    assert lines[-2:] == ["[problems] 1", "  - versions.torch differs between ranks: '2.13.0+cpu' on ranks 0-1; "
                                          "'2.12.0' on rank 2"]


def test_render_without_gpu_and_with_rank_numbers_only():
    """On a CPU-only machine the [gpu] section is one line; ranks that differ
    in rank numbers only get one line, not a table of them."""
    views = [_view(r, 2, host="n1") for r in range(2)]
    for r, v in enumerate(views):
        v["launcher"]["local_rank"] = r
    text = info.render(views, info.problems(views))
    assert "\n[gpu] none: torch 2.13.0+cpu sees no CUDA device here: CPU tensors only (hpccomm info --json has the " \
           "GPU fields)\n[options]\n" in text, text
    assert "mpi_cuda_aware" not in text and "cuda_routes" not in text, text
    assert "\n[per rank] the 2 ranks differ only in their rank numbers (mpi.rank, launcher.rank, " \
           "launcher.local_rank)\n[problems] none found" in text, text
    views[1]["gpu"].update(cuda=True, devices=1)   # a GPU on rank 1 only: rank 0's view has none, the table says
    lines = info.render(views, []).splitlines()
    start = lines.index("[per rank] fields that differ between the 2 ranks (besides mpi.rank, launcher.rank, "
                        "launcher.local_rank: the rank)")
    assert [x.split() for x in lines[start + 1:start + 4]] == [["rank", "gpu.cuda", "gpu.devices"],
                                                               ["0", "False", "0"], ["1", "True", "1"]], lines


def test_flatten_and_rank_ranges():
    assert info.flatten({"a": {"b": 1, "c": {"d": [2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [2], "e": {}}
    assert info._ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and info._ranks([3]) == "3"
    before = copy.deepcopy(_job())
    info.problems(before)
    assert before == _job()  # problems() does not modify the views
