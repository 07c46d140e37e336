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


def no_orphans(tmp_path) -> bool:
    """No process of this test's job is left (matched by the script's unique path)."""
    script = str(tmp_path / "job.py")
    deadline = time.monotonic() + 5  # the launcher reaps its children right after it exits
    while True:
        out = subprocess.run(["pgrep", "-f", script], capture_output=True, text=True).stdout.split()
        left = [p for p in out if int(p) != os.getpid()]
        if not left or time.monotonic() > deadline:
            return not left
        time.sleep(0.2)


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
    assert no_orphans(tmp_path)


def test_timeout_is_honoured_in_debug_mode(tmp_path):
    # The debug-mode fingerprint exchange is a collective too: a rank that never comes is named.
    proc, took = launch(tmp_path, """
        hpccomm.init_process_group(timeout=timedelta(seconds=3))
        t = torch.ones(4)
        dist.all_reduce(t)
        if dist.get_rank() == 1:
            time.sleep(120)
        dist.all_reduce(t)
    """, n=2, env={"HPCCOMM_DEBUG": "DETAIL"})
    assert proc.returncode != 0 and took < 40, (proc.returncode, took, proc.stderr)
    assert "all_reduce (debug-mode fingerprint check) (op #2 on group" in proc.stderr, proc.stderr
    assert "rank(s) [1] never arrived" in proc.stderr, proc.stderr
    assert no_orphans(tmp_path)


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
    # Each survivor says why it ended, naming the failed rank (recorded in the store by rank 1).
    for rank in (0, 2):
        assert (f"hpccomm: rank {rank} of 3 ended by SIGTERM (the launcher ends the job) while in all_reduce "
                f"(op #2 on group ") in proc.stderr, proc.stderr
    assert proc.stderr.count("; rank 1 raised an uncaught ValueError (last op: all_reduce (op #1") == 2, proc.stderr
    assert no_orphans(tmp_path)


#: A job whose last rank is killed (SIGKILL) between two all_reduces.
KILL_LAST_RANK = """
    hpccomm.init_process_group()
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
"""


def test_killed_rank_ends_the_job(tmp_path):
    proc, took = launch(tmp_path, KILL_LAST_RANK)
    assert proc.returncode != 0
    assert took < 30, took
    # The launcher names the dead rank; each survivor says where it was and who died (same node: by pid).
    assert "rank 2 with PID" in proc.stderr and "signal 9" in proc.stderr, proc.stderr
    for rank in (0, 1):
        line = [x for x in proc.stderr.splitlines() if x.startswith(f"hpccomm: rank {rank} of 3 ended by SIGTERM")]
        assert len(line) == 1, proc.stderr
        assert "while in all_reduce (op #2 on group " in line[0], line
        assert "; rank 2 (pid " in line[0] and line[0].endswith(") is dead"), line
    assert no_orphans(tmp_path)


def test_user_sigterm_handler_is_left_alone(tmp_path):
    proc, took = launch(tmp_path, """
        signal.signal(signal.SIGTERM, lambda *a: (print("USER HANDLER", flush=True), os._exit(7)))
        hpccomm.init_process_group()
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        dist.barrier()
    """, n=2)
    assert "USER HANDLER" in proc.stdout, proc.stdout + proc.stderr
    assert "ended by SIGTERM" not in proc.stderr, proc.stderr


def test_sigterm_report_can_be_turned_off(tmp_path):
    proc, took = launch(tmp_path, KILL_LAST_RANK, n=2, env={"HPCCOMM_SIGNAL_REPORT": "0"})
    assert proc.returncode != 0 and took < 30, (proc.returncode, took)
    assert "ended by SIGTERM" not in proc.stderr, proc.stderr


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
    assert no_orphans(tmp_path)


def test_exit_with_async_ops_never_waited_for_is_clean(tmp_path):
    """A program that exits with async ops still queued (no wait(), no destroy_process_group) ends
    normally: the ops run to completion first (this used to end in SIGSEGV or SIGABRT)."""
    proc, took = launch(tmp_path, """
        import atexit
        t = torch.ones(1 << 16)
        # registered before hpccomm's own exit handler, so it runs after it (atexit is LIFO)
        atexit.register(lambda: print(f"rank {os.environ['OMPI_COMM_WORLD_RANK']}"
                                      f" final {t[0].item()} {t[-1].item()}", flush=True))
        hpccomm.init_process_group()
        works = [dist.all_reduce(t, async_op=True) for _ in range(10)]
        big = [dist.all_reduce(torch.ones(1 << 14), async_op=True) for _ in range(300)]
        print("exiting", flush=True)
    """)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for bad in ("Segmentation fault", "Aborted", "terminate called", "signal"):
        assert bad not in out, out[-3000:]
    for r in range(3):  # ten in-place sums of ones over 3 ranks: 3 ** 10 everywhere
        assert f"rank {r} final 59049.0 59049.0" in proc.stdout, proc.stdout
    assert no_orphans(tmp_path)
