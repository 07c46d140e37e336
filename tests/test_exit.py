"""A job with gloo groups beside hpccomm exits 0, every time.

torch 2.13's gloo worker thread releases a finished op's tensors a moment
after the op completes, and releasing a tensor Python also holds takes the
GIL; a worker that asks for the GIL once Python has begun to finalize is
ended by Python, and that aborts the process (``terminate called without an
active exception``, status 134; torch issue #190489).  hpccomm's exit hook
therefore waits, with the GIL given up, until every gloo worker thread is
parked (hpccomm._core.gloo_exit) before MPI and Python finalize.

The unit tests check the /proc reading against real threads; the job tests
run real 3-rank jobs under mpirun (no pytest inside: the exit status of the
processes is what is tested).
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hpccomm._core import gloo_exit

ROOT = Path(__file__).resolve().parent.parent


# -- reading /proc --------------------------------------------------------------

def _thread_files(ident: int) -> tuple[str, str]:
    tid = next(t.native_id for t in threading.enumerate() if t.ident == ident)
    base = f"/proc/self/task/{tid}"
    return Path(f"{base}/stat").read_text(), Path(f"{base}/syscall").read_text()


def _blocked_thread(block) -> threading.Thread:
    """A thread sitting in ``block()``; returns once the kernel shows it asleep."""
    started = threading.Event()

    def body():
        started.set()
        block()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    started.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stat, _ = _thread_files(t.ident)
        if stat[stat.rindex(")") + 2] == "S":
            return t
        time.sleep(0.001)
    raise AssertionError("the helper thread never went to sleep")


def test_parked_reads_an_untimed_futex_wait_as_parked():
    """A thread blocked without a timeout (as gloo's worker on its empty
    queue) is parked; the kernel's own files are read."""
    lock = threading.Lock()
    lock.acquire()
    t = _blocked_thread(lock.acquire)  # untimed: futex(FUTEX_WAIT_BITSET, timeout=NULL)
    try:
        stat, syscall = _thread_files(t.ident)
        assert gloo_exit.parked(stat, syscall, gloo_exit._futex_syscall()), (stat, syscall)
    finally:
        lock.release()
        t.join()


def test_parked_reads_a_timed_wait_or_a_sleep_as_busy():
    """Waiting with a timeout (as for the GIL) or any other syscall is not parked."""
    lock = threading.Lock()
    lock.acquire()
    timed = _blocked_thread(lambda: lock.acquire(timeout=60))
    stop = threading.Event()
    sleeper = _blocked_thread(lambda: [time.sleep(0.01) for _ in iter(stop.is_set, True)])
    try:
        for t in (timed, sleeper):
            stat, syscall = _thread_files(t.ident)
            assert not gloo_exit.parked(stat, syscall, gloo_exit._futex_syscall()), (stat, syscall)
        stat, syscall = _thread_files(threading.main_thread().ident)  # this thread: running
        assert not gloo_exit.parked(stat, syscall, gloo_exit._futex_syscall()), (stat, syscall)
    finally:
        lock.release()
        stop.set()
        timed.join()
        sleeper.join()


@pytest.mark.parametrize("stat,syscall,expected", [
    ("7 (pt_gloo_runloop) S 1 1", "202 0x55d4 0x189 0x0 0x0 0x0 0xffffffff 0x7f10 0x7f20", True),
    ("7 (pt_gloo_runloop) S 1 1", "202 0x55d4 0x189 0x0 0x7ffd10 0x0 0xffffffff 0x7f10 0x7f20", False),  # timed
    ("7 (pt_gloo_runloop) S 1 1", "202 0x55d4 0x80 0x2 0x0 0x0 0x0 0x7f10 0x7f20", False),  # a mutex
    ("7 (pt_gloo_runloop) R 1 1", "running", False),
    ("7 (pt_gloo_runloop) R 1 1", "202 0x55d4 0x189 0x0 0x0 0x0 0xffffffff 0x7f10 0x7f20", False),
    ("7 (a (b) c) S 1 1", "202 0x55d4 0x189 0x0 0x0 0x0 0xffffffff 0x7f10 0x7f20", True),  # ')' in a name
    ("7 (pt_gloo_runloop) S 1 1", "230 0x1 0x0 0x7ffd 0x7ffd 0x0 0x0 0x7f10 0x7f20", False),  # nanosleep
    ("garbage", "", False),
])
def test_parked_on_recorded_lines(stat, syscall, expected):
    assert gloo_exit.parked(stat, syscall, "202") is expected


def _fake_tasks(tmp_path, threads):
    for tid, (name, state, syscall) in threads.items():
        d = tmp_path / str(tid)
        d.mkdir()
        (d / "comm").write_text(name + "\n")
        (d / "stat").write_text(f"{tid} ({name}) {state} 1 1 1\n")
        (d / "syscall").write_text(syscall + "\n")
    return str(tmp_path)


IDLE = "202 0x55d4 0x189 0x0 0x0 0x0 0xffffffff 0x7f10 0x7f20"


def test_busy_gloo_workers_names_only_unparked_gloo_threads(tmp_path):
    tasks = _fake_tasks(tmp_path, {
        11: ("python", "R", "running"),                      # not gloo: ignored
        12: ("pt_gloo_runloop", "S", IDLE),                  # parked
        13: ("pt_gloo_runloop", "R", "running"),             # busy
        14: ("pt_gloo_runloop", "S", IDLE.replace("0x189 0x0 0x0", "0x189 0x0 0x7ffd10")),  # wants the GIL
        15: ("gloo_tcp_loop", "S", "232 0x11 0x7f 0x40 0xa 0x0 0x0 0x7f 0x7f"),  # gloo's I/O thread: ignored
    })
    assert sorted(gloo_exit.busy_gloo_workers(tasks, "202")) == ["13", "14"]


def test_wait_for_gloo_workers_returns_when_all_are_parked(tmp_path):
    tasks = _fake_tasks(tmp_path, {12: ("pt_gloo_runloop", "S", IDLE), 13: ("python", "R", "running")})
    out = io.StringIO()
    assert gloo_exit.wait_for_gloo_workers(limit=5, tasks=tasks, stream=out) is True
    assert out.getvalue() == ""


def test_wait_for_gloo_workers_gives_up_at_the_limit_and_says_so(tmp_path):
    tasks = _fake_tasks(tmp_path, {12: ("pt_gloo_runloop", "S", IDLE), 13: ("pt_gloo_runloop", "R", "running")})
    out = io.StringIO()
    start = time.monotonic()
    assert gloo_exit.wait_for_gloo_workers(limit=0.05, tasks=tasks, stream=out) is False
    assert time.monotonic() - start < 5
    assert out.getvalue() == ("hpccomm: at exit, 1 gloo worker thread(s) still busy after 0.05 s (thread ids 13): "
                              "a gloo op still running, which a peer never joined? Exiting anyway; the process "
                              "may abort\n")


def test_wait_for_gloo_workers_without_proc_waits_for_nothing(tmp_path):
    assert gloo_exit.wait_for_gloo_workers(limit=5, tasks=str(tmp_path / "absent")) is True


# -- real jobs ------------------------------------------------------------------

JOB = textwrap.dedent('''
    """3 ranks: hpccomm's default group, gloo groups beside it, gloo ops up to the end."""
    import time
    import torch
    import torch.distributed as dist
    import hpccomm

    hpccomm.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    pair = dist.new_group([0, 1], backend="gloo")
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)                                            # hpccomm
    assert torch.equal(t, torch.full((4,), float(size * (size - 1) // 2)))
    # An op the program never waits for, whose worker is still busy (a slow
    # callback runs on gloo's worker thread) when the program ends.
    late = torch.full((4,), float(rank))
    work = dist.all_reduce(late, group=gloo, async_op=True)
    work.get_future().then(lambda fut: time.sleep(0.5) or fut.value())
    # The last ops: on the other gloo worker, and on a second gloo group.
    x = torch.ones(4)
    dist.all_reduce(x, group=gloo)
    assert torch.equal(x, torch.full((4,), float(size)))
    if rank < 2:
        y = torch.full((4,), float(rank))
        dist.broadcast(y, src=1, group=pair)
        assert torch.equal(y, torch.full((4,), 1.0))
    print(f"rank {rank}: results right", flush=True)
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_job_with_gloo_groups_beside_hpccomm_exits_0(tmp_path):
    """The 3-rank job: every rank prints its results and the job exits 0.
    Before the fix every run ended with status 134: the job makes the race
    itself (a gloo worker still in a callback when the program ends), so one
    run shows it."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCCOMM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TORCH_CPP_LOG_LEVEL="WARNING",  # torch's default, as a user has it: its warnings would show
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(["timeout", "--kill-after=10", "120", "mpirun", "-n", "3", "--oversubscribe",
                           sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 124, f"timed out:\n{output[-3000:]}"
    assert sorted(line for line in output.splitlines() if line.endswith(": results right")) == \
        [f"rank {r}: results right" for r in range(3)], output[-3000:]
    assert "terminate called" not in output, output[-3000:]
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{output[-3000:]}"
    # What the job prints last is its own: no warning or stack trace from torch, gloo or MPI at exit.
    assert [x for x in output.splitlines() if x.strip()] == \
        [x for x in output.splitlines() if x.endswith(": results right")], output[-3000:]


POSTED_JOB = textwrap.dedent('''
    """2 ranks: async all_reduces posted as nonblocking MPI collectives, never
    waited for, then the program ends (no wait(), no destroy_process_group)."""
    import torch
    import torch.distributed as dist
    import hpccomm

    hpccomm.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    small = [torch.full((16,), float(rank + k)) for k in range(5)]
    # hpccomm waits for these requests at exit (MPI forbids cancelling or freeing them)
    works = [dist.all_reduce(t, async_op=True) for t in small]
    gathered = torch.empty(4 * size)
    works.append(dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank)), async_op=True))
    print(f"rank {rank}: posted", flush=True)
''')


@pytest.mark.slow
def test_job_exiting_with_posted_collectives_never_waited_exits_0(tmp_path):
    """Posted async collectives nobody waited for are waited for at exit,
    before MPI_Finalize (not cancelled or freed, which MPI forbids for
    collectives): the job ends with status 0 and no crash, twice in a row."""
    script = tmp_path / "posted.py"
    script.write_text(POSTED_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCCOMM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               HPCCOMM_ASYNC_NONBLOCKING="1")  # the nonblocking form (off by default)
    for run in range(2):
        proc = subprocess.run(["timeout", "--kill-after=10", "120", "mpirun", "-n", "2", "--oversubscribe",
                               sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 124, f"run {run + 1}: timed out:\n{output[-3000:]}"
        assert sorted(line for line in output.splitlines() if line.endswith(": posted")) == \
            [f"rank {r}: posted" for r in range(2)], f"run {run + 1}:\n{output[-3000:]}"
        for bad in ("Segmentation fault", "Aborted", "terminate called", "MPI_ERR"):
            assert bad not in output, f"run {run + 1}:\n{output[-3000:]}"
        assert proc.returncode == 0, f"run {run + 1}: exit status {proc.returncode}:\n{output[-3000:]}"


WATCHED_JOB = textwrap.dedent('''
    """1 rank: the watchdog runs; a hook registered before hpccomm's exit hook runs after it."""
    import atexit
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import hpccomm
    from hpccomm._core.watchdog import watchdog


    def after_hpccomms_hook():   # atexit runs last-registered first: this runs after hpccomm's hook
        print(f"watchdog alive after hpccomm's exit hook: {watchdog._thread.is_alive()}", flush=True)


    atexit.register(after_hpccomms_hook)
    hpccomm.init_process_group(timeout=timedelta(seconds=60))
    t = torch.ones(4)
    dist.all_reduce(t)
    assert torch.equal(t, torch.ones(4))
    print(f"watchdog alive while ops run: {watchdog._thread.is_alive()}", flush=True)
''')


def test_watchdog_thread_is_joined_before_the_interpreter_finalizes(tmp_path):
    """The watchdog (a daemon thread that calls torch's store) is stopped and
    joined by hpccomm's exit hook: a daemon thread inside a torch store call
    when Python finalizes aborts the process (``terminate called without an
    active exception``; seen under HPCCOMM_ON_TIMEOUT=warn, see
    tests/test_failures.py::test_timeout_warn_mode_keeps_waiting)."""
    script = tmp_path / "watched.py"
    script.write_text(WATCHED_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCCOMM_"))}
    env.update(PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(["timeout", "--kill-after=10", "120", sys.executable, str(script)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{output[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("watchdog alive")]
    assert lines == ["watchdog alive while ops run: True", "watchdog alive after hpccomm's exit hook: False"], output
