"""Failures end the job loudly: a rank that never joins (timeout), a rank
that raises, a rank that is killed.  Each case launches a real mpirun job
from pytest and checks its exit status, its time to end, and the message."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

HEADER = """
import os, sys, time, signal
from datetime import timedelta
import torch, torch.distributed as dist, hpccomm
"""


def launch(tmp_path, body: str, n: int = 3, limit: int = 120, env=None):
    script = tmp_path / "job.py"
    script.write_text(HEADER + textwrap.dedent(body))
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCCOMM_"))}
    full.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
                PYTHONUNBUFFERED="1")
    full.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.run(["timeout", "--kill-after=10", str(limit), "mpirun", "-n", str(n), "--oversubscribe",
                           sys.executable, str(script)], capture_output=True, text=True, env=full)
    return proc, time.monotonic() - t0


def no_orphans(script_name: str = "job.py") -> bool:
    out = subprocess.run(["pgrep", "-f", script_name], capture_output=True, text=True).stdout.split()
    return not [p for p in out if int(p) != os.getpid()]


def test_timeout_names_the_missing_rank_and_aborts(tmp_path):
    proc, took = launch(tmp_path, """
        hpccomm.init_process_group(timeout=timedelta(seconds=3))
        t = torch.ones(4)
        dist.all_reduce(t)
        if dist.get_rank() == 2:
            time.sleep(120)          # never joins the next all_reduce
        dist.all_reduce(t)
    """)
    assert proc.returncode != 0
    assert took < 40, took  # timeout 3 s + watchdog tick 1 s + grace 3 s + launcher teardown
    assert "all_reduce (op #2 on group" in proc.stderr, proc.stderr
    assert "rank(s) [2] never arrived" in proc.stderr, proc.stderr
    assert "aborting the job" in proc.stderr
    assert no_orphans()


def test_timeout_warn_mode_keeps_waiting(tmp_path):
    proc, took = launch(tmp_path, """
        hpccomm.init_process_group(timeout=timedelta(seconds=2))
        t = torch.ones(4)
        if dist.get_rank() == 1:
            time.sleep(8)            # late, not lost
        dist.all_reduce(t)
        assert t[0] == dist.get_world_size()
        dist.destroy_process_group()
    """, n=2, env={"HPCCOMM_ON_TIMEOUT": "warn"})
    assert proc.returncode == 0, proc.stderr
    assert "did not complete within its timeout" in proc.stderr and "rank(s) [1] never arrived" in proc.stderr


def test_uncaught_exception_ends_the_job_with_its_rank(tmp_path):
    proc, took = launch(tmp_path, """
        hpccomm.init_process_group()   # default timeout: 30 minutes
        t = torch.ones(4)
        dist.all_reduce(t)
        if dist.get_rank() == 1:
            raise ValueError("bad data on this rank")
        dist.all_reduce(t)             # the others wait here
    """)
    assert proc.returncode != 0
    assert took < 30, took
    assert "ValueError: bad data on this rank" in proc.stderr
    assert "hpccomm: rank 1 of 3 raised an uncaught ValueError (last op: all_reduce (op #1" in proc.stderr, \
        proc.stderr
    assert no_orphans()


def test_killed_rank_ends_the_job(tmp_path):
    proc, took = launch(tmp_path, """
        hpccomm.init_process_group()
        t = torch.ones(4)
        dist.all_reduce(t)
        if dist.get_rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    """)
    assert proc.returncode != 0
    assert took < 30, took
    assert no_orphans()


def test_monitored_barrier_names_every_missing_rank(tmp_path):
    proc, took = launch(tmp_path, """
        hpccomm.init_process_group()
        hpccomm.monitored_barrier(timeout=timedelta(seconds=20))   # everyone arrives
        if dist.get_rank() in (1, 3):
            time.sleep(15)
            sys.exit(0)
        try:
            hpccomm.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
        except hpccomm.HpccommError as exc:
            print("CAUGHT", dist.get_rank(), exc, flush=True)
            sys.exit(0)
        print("NO ERROR", dist.get_rank(), flush=True)
    """, n=4)
    caught = [line for line in proc.stdout.splitlines() if line.startswith("CAUGHT")]
    assert len(caught) == 2 and "NO ERROR" not in proc.stdout, proc.stdout + proc.stderr
    for line in caught:
        assert "rank(s) [1, 3] did not arrive within 0:00:02" in line, line


def test_trace_is_one_merged_timeline(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    proc, _ = launch(tmp_path, """
        hpccomm.init_process_group()
        t = torch.ones(1000)
        for _ in range(3):
            dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.barrier()
        dist.destroy_process_group()
    """, n=3, env={"HPCCOMM_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e["ph"] == "X"]
    assert sorted({e["pid"] for e in ops}) == [0, 1, 2]
    for rank in range(3):
        mine = [e for e in ops if e["pid"] == rank]
        assert [e["name"] for e in mine].count("all_reduce") == 4
        assert [e["name"] for e in mine].count("barrier") == 1
        assert any(e["tid"] == "hpccomm-comm" for e in mine)  # the async one ran on the comm thread
        assert all(e["args"]["bytes"] in (4000, 0) for e in mine)
        seqs = [e["args"]["op"] for e in mine if e["cat"] == mine[0]["cat"]]
        assert seqs == sorted(seqs)


def test_ctrl_c_ends_every_rank(tmp_path):
    import signal

    script = tmp_path / "job.py"
    script.write_text(HEADER + textwrap.dedent("""
        hpccomm.init_process_group()
        t = torch.ones(4)
        dist.all_reduce(t)
        print("READY", dist.get_rank(), flush=True)
        if dist.get_rank() == 1:
            time.sleep(300)
        dist.all_reduce(t)   # the others wait here (inside MPI) when Ctrl-C comes
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCCOMM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(["mpirun", "-n", "3", "--oversubscribe", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    ready = 0
    deadline = time.monotonic() + 120
    while ready < 3 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        ready += line.startswith("READY")
    assert ready == 3
    time.sleep(1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < 15, (proc.returncode, took)
    assert no_orphans()
