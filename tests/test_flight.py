"""The flight recorder (hpccomm._core.flight): each group's last ops, written where torch's analyser
reads them, ``python -m torch.distributed.flight_recorder.fr_trace DIR -p PREFIX``.

- Without a launch: the recorder's entries (fields, no tensor kept), its ring (the last N), the
  state of an op still running, where a dump goes, a dump that cannot be written (quiet), and the
  pickle fr_trace reads, which names the first op where ranks parted (records made here for two
  ranks that differ on purpose).
- A job desynced on purpose (one rank calls broadcast where the others call all_reduce): its ranks
  write their records as the job ends, and fr_trace names that op.
- Under mpirun at 1-4 ranks: ``hpccomm.dump_flight_record()`` on every rank, read back by fr_trace,
  which matches every op of a known sequence on every rank.
"""
from __future__ import annotations

import collections
import gc
import itertools
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import hpccomm
from hpccomm import _mpi, config
from hpccomm._compat import ReduceOp
from hpccomm._core import flight, state
from hpccomm._core import group as _group
from hpccomm._ops import op_path
from hpccomm._ops.registry import BY_NAME as OP
from mpilaunch import no_orphans, require

FR_TRACE = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]


def fr_trace(folder, prefix: str, *extra: str) -> subprocess.CompletedProcess:
    """torch's analyser on the records ``folder/prefix<rank>`` (its report goes to stdout and stderr)."""
    return subprocess.run([*FR_TRACE, str(folder), "-p", prefix, *extra], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def self_group():
    """A real hpccomm group of one rank (MPI_COMM_SELF, no launch), with its ring."""
    g = _group.world(_mpi.mpi().COMM_SELF, name="self")
    yield g
    g.free()


# ----------------------------------------------------------------------------
# the recorder, without a launch
# ----------------------------------------------------------------------------

def test_entries_hold_each_ops_fields_and_no_tensor(self_group):
    """Ops run through the op path on a group of one rank: each is an entry with torch's fields
    (name as torch's recorders name it, op numbers, element counts, dtypes, state, times), and
    the recorder keeps none of the tensors alive."""
    g = self_group
    assert g.flight is not None and g.flight.maxlen == config.get("HPCCOMM_FR_BUFFER_SIZE") == 2000
    t, ints = torch.ones(4), torch.zeros(3, dtype=torch.int32)
    out, inp = torch.empty(5), torch.ones(5)
    before = time.time_ns()
    op_path.run(g, OP["all_reduce"], ([t], ReduceOp.SUM))
    op_path.run(g, OP["broadcast"], ([ints], 0))
    op_path.run(g, OP["all_gather_into_tensor"], (out, inp))
    op_path.run(g, OP["all_gather"], ([[torch.empty(2)]], [torch.ones(2)]))
    send = op_path.run(g, OP["send"], ([torch.ones(2, dtype=torch.float64)], 0, 0))
    op_path.run(g, OP["recv"], ([torch.empty(2, dtype=torch.float64)], 0, 0)).wait()
    send.wait()
    op_path.run(g, OP["barrier"], ())
    after = time.time_ns()
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None  # the recorder holds no reference to a tensor

    record = flight.snapshot([g])
    assert record["version"] == "2.10" and record["comm_lib_version"].startswith(f"hpccomm {hpccomm.__version__} over ")
    assert record["pg_config"] == {"self": {"name": "self", "desc": "undefined", "ranks": "[0]"}}
    rows = [(e["profiling_name"], e["collective_seq_id"], e["p2p_seq_id"], e["is_p2p"], e["input_sizes"],
             e["input_dtypes"], e["output_sizes"], e["output_dtypes"], e["state"]) for e in record["entries"]]
    assert rows == [
        ("gloo:all_reduce", 1, 0, False, [[4]], ["Float"], [[4]], ["Float"], "completed"),
        ("gloo:broadcast", 2, 0, False, [[3]], ["Int"], [[3]], ["Int"], "completed"),
        ("gloo:_all_gather_base", 3, 0, False, [[5]], ["Float"], [[5]], ["Float"], "completed"),
        ("gloo:all_gather", 4, 0, False, [[2]], ["Float"], [[1, 2]], ["Float"], "completed"),  # torch's stacked form
        ("gloo:send 0->0", 4, 1, True, [[2]], ["Double"], [], [], "completed"),
        ("gloo:recv 0<-0", 4, 2, True, [], [], [[2]], ["Double"], "completed"),
        ("gloo:barrier", 5, 2, False, [], [], [], [], "completed"),
    ], rows
    ids = [e["record_id"] for e in record["entries"]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for e in record["entries"]:
        assert e["process_group"] == ("self", "undefined") and e["retired"] and e["frames"] == []
        assert before - 10**6 <= e["time_created_ns"] == e["time_discovered_started_ns"] <= after + 10**6, e
        assert e["time_discovered_completed_ns"] is None and e["timeout_ms"] == 0
    assert record["pg_status"]["0"] == {"last_enqueued_collective": 5, "last_started_collective": 5,
                                        "last_completed_collective": 5}


def test_the_ring_keeps_the_last_n_ops(self_group, monkeypatch):
    """HPCCOMM_FR_BUFFER_SIZE ops per group: older ones fall out, in order."""
    monkeypatch.setenv("HPCCOMM_FR_BUFFER_SIZE", "3")
    monkeypatch.setattr(config, "_loaded", {})  # (read from the environment, as before init)
    g = _group.world(_mpi.mpi().COMM_SELF, name="small")
    try:
        assert g.flight.maxlen == 3
        for n in range(1, 6):
            op_path.run(g, OP["all_reduce"], ([torch.ones(n)], ReduceOp.SUM))
        entries = flight.snapshot([g])["entries"]
        assert [(e["collective_seq_id"], e["input_sizes"]) for e in entries] == [(3, [[3]]), (4, [[4]]), (5, [[5]])]
    finally:
        g.free()


def test_recorder_off(monkeypatch):
    monkeypatch.setenv("HPCCOMM_FR_BUFFER_SIZE", "0")
    monkeypatch.setattr(config, "_loaded", {})
    g = _group.world(_mpi.mpi().COMM_SELF, name="off")
    try:
        assert g.flight is None
        op_path.run(g, OP["all_reduce"], ([torch.ones(2)], ReduceOp.SUM))  # runs, unrecorded
        assert flight.dump_quietly("test") is None
    finally:
        g.free()


def test_an_op_running_is_started_then_completed(self_group):
    """Whether an op is over is hpccomm._core.state's to say: started while it runs."""
    g = self_group
    io = flight.tensors_io(OP["all_reduce"], ([torch.ones(4)], ReduceOp.SUM))
    seq = state.start(g, "all_reduce", None, io)
    try:
        (entry,) = flight.snapshot([g])["entries"]
        assert (entry["collective_seq_id"], entry["state"], entry["retired"]) == (seq, "started", False)
    finally:
        state.finished(g)
    (entry,) = flight.snapshot([g])["entries"]
    assert (entry["state"], entry["retired"]) == ("completed", True)


def test_a_later_record_is_what_a_first_one_would_be(self_group):
    """A record after more ops (a job that caught a mismatch and went on) reuses the entries of
    ops already written (completed ops' entries never change) and holds exactly what a record
    written afresh holds: the new ops, the ring's oldest gone, each group at its place."""
    g = self_group
    g.flight = collections.deque(maxlen=3)
    other = _group.world(_mpi.mpi().COMM_SELF, name="other")
    try:
        for n in (1, 2):
            op_path.run(g, OP["all_reduce"], ([torch.ones(n)], ReduceOp.SUM))
        first = flight.snapshot([g])
        for n in (3, 4):
            op_path.run(g, OP["all_reduce"], ([torch.ones(n)], ReduceOp.SUM))
        op_path.run(other, OP["broadcast"], ([torch.ones(5)], 0))
        later = flight.snapshot([other, g])   # g's place changed: its entries say pg_id 1 now
        flight._written.clear()
        fresh = flight.snapshot([other, g])
        assert [e["input_sizes"] for e in first["entries"]] == [[[1]], [[2]]]
        assert [(e["pg_id"], e["input_sizes"]) for e in later["entries"]] == [(1, [[2]]), (1, [[3]]), (1, [[4]]),
                                                                              (0, [[5]])]
        times = ("time_created_ns", "time_discovered_started_ns")   # (the wall clock's offset, read at each record)
        untimed = [[{k: v for k, v in e.items() if k not in times} for e in r["entries"]] for r in (later, fresh)]
        assert untimed[0] == untimed[1] and later["pg_status"] == fresh["pg_status"]
        assert all(abs(a[k] - b[k]) < 10**6 for a, b in zip(later["entries"], fresh["entries"]) for k in times)
        assert flight.snapshot([other, g])["entries"][0] is fresh["entries"][0]   # reused, not made again
        assert set(flight._written) == {id(other), id(g)}   # only live groups' entries are kept
        flight.snapshot([g])
        assert set(flight._written) == {id(g)} and len(flight._written[id(g)]) == 3
    finally:
        other.free()


def test_a_record_of_a_new_group_where_a_freed_one_was_is_its_own(self_group, monkeypatch):
    """A group made where a freed one was (the same ``id``), whose ops have the freed one's record
    ids (here: the counter starts again), gets entries of its own ops, never the freed one's."""
    g = self_group
    g.flight = collections.deque(maxlen=3)
    for dtype in (torch.float32, torch.int32):
        monkeypatch.setattr(state, "_records", itertools.count())   # the same record ids both times
        g.flight.clear()
        op_path.run(g, OP["all_reduce"], ([torch.ones(4, dtype=dtype)], ReduceOp.SUM))
        (entry,) = flight.snapshot([g])["entries"]
        assert entry["input_dtypes"] == [flight._dtype_name(dtype)], (dtype, entry)


def test_where_dumps_go(monkeypatch, tmp_path):
    """Where torch's own recorders write: TORCH_FR_DUMP_TEMP_FILE (its older name too), else
    torch's default under the cache folder."""
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    assert flight.prefix() == "/tmp/.cache/torch/comm_lib_trace_rank_"
    monkeypatch.setenv("HOME", "/home/me")
    assert flight.prefix() == "/home/me/.cache/torch/comm_lib_trace_rank_"
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert flight.prefix() == "/cache/torch/comm_lib_trace_rank_"
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/old/name_")
    assert flight.prefix() == "/old/name_"
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", f"{tmp_path}/fr/rank_")
    assert flight.prefix() == f"{tmp_path}/fr/rank_"


def test_write_and_a_dump_that_cannot_be_written(self_group, monkeypatch, tmp_path):
    """write() replaces the rank's file whole (the folder made); a dump on a failure that cannot
    write says nothing and returns (never an error of its own in the job's way)."""
    op_path.run(self_group, OP["all_reduce"], ([torch.ones(2)], ReduceOp.SUM))
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", f"{tmp_path}/fr/rank_")
    path = hpccomm.dump_flight_record()
    assert path == f"{tmp_path}/fr/rank_{state.world.rank}" and os.listdir(tmp_path / "fr") == [os.path.basename(path)]
    with open(path, "rb") as f:
        record = pickle.load(f)
    assert record["hpccomm"]["reason"] == "on request (hpccomm.dump_flight_record)"
    assert any(e["process_group"][0] == "self" for e in record["entries"])
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", f"{tmp_path}/file/rank_")  # a folder that cannot be made
    t0 = time.monotonic()
    assert flight.dump_quietly("test") is None and time.monotonic() - t0 < flight._BOUND
    with pytest.raises(OSError):
        hpccomm.dump_flight_record()


def _rank(rank: int, calls, monkeypatch) -> dict:
    """The record of world rank ``rank`` of two, whose group '0' ran ``calls`` ((name, count, dtype)):
    each entered as the op path enters it (hpccomm._core.state.start), in a process of its own (its
    record ids from 0)."""
    monkeypatch.setattr(state, "_records", itertools.count())
    g = SimpleNamespace(name="0", desc="default_pg", global_ranks=[0, 1], rank=rank, seq=0, p2p_seq=0,
                        _seqs=itertools.count(1), last=None, timeout_s=30.0,
                        flight=collections.deque(maxlen=100))
    g.running = state.InFlight(g)  # its blocking collectives' record (a real group makes its own)
    for name, count, dtype in calls:
        state.start(g, name, None, flight.make_io(SimpleNamespace(recorded_as=name, stacked=(False, False), receives=False),
                                                   (count,), (dtype,), (count,), (dtype,)))
    return flight.snapshot([g])


AGREED = [("all_reduce", 4, torch.float32)] * 3


@pytest.mark.parametrize("rank1, said", [
    ([("broadcast", 4, torch.float32)], [
        "Collective sequence number: 4 has errors", "collective: gloo:all_reduce",
        "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' does not "
        "match found collective type: 'broadcast'"]),
    ([("all_reduce", 6, torch.float32)], [
        "Collective sequence number: 4 has errors",
        "Culprit rank 1; Error type: SIZE_OR_SYNTAX_MISMATCH, Expected input sizes: '[[4]]' does not match found "
        "input sizes: '[[6]]'"]),
    ([("all_reduce", 4, torch.int32)], [
        "Collective sequence number: 4 has errors", "Culprit rank 1; Error type: COLLECTIVE_DTYPE_MISMATCH"]),
    ([], ["Not all ranks joining collective, sequence number: 4", "collective: gloo:all_reduce",
          "missing ranks: {1}"]),
], ids=["another collective", "another size", "another dtype", "a rank missing"])
def test_fr_trace_names_the_first_op_where_ranks_parted(monkeypatch, tmp_path, rank1, said):
    """Records of two ranks that agree on ops 1-3 and part at op 4 (rank 0 calls all_reduce of 4
    float32): torch's analyser reads them and names op 4, the way rank 1 differs."""
    monkeypatch.setattr(state, "last_group", [None])  # (state.start notes the last group)
    for rank, calls in ((0, AGREED + [("all_reduce", 4, torch.float32)]), (1, AGREED + rank1)):
        with open(tmp_path / f"rank_{rank}", "wb") as f:
            pickle.dump(_rank(rank, calls, monkeypatch), f)
    proc = fr_trace(tmp_path, "rank_")
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    for line in said:
        assert line in report, report
    assert report.count("sequence number") == 1, report  # ops 1-3 matched


def test_fr_trace_reads_a_record_of_every_kind_of_op(self_group, tmp_path):
    """Each op hpccomm records loads in fr_trace's matcher (its op names are ones it knows), and
    one rank's record of them has no mismatch."""
    g, n = self_group, 3
    ops = [(OP["all_reduce"], ([torch.ones(n)], ReduceOp.SUM)),
           (OP["all_reduce_coalesced"], ([torch.ones(n), torch.ones(2)], ReduceOp.SUM)),
           (OP["reduce"], ([torch.ones(n)], 0, ReduceOp.SUM)),
           (OP["reduce_scatter"], ([torch.empty(n)], [[torch.ones(n)]], ReduceOp.SUM)),
           (OP["reduce_scatter_tensor"], (torch.empty(n), torch.ones(n), ReduceOp.SUM)),
           (OP["broadcast"], ([torch.ones(n)], 0)),
           (OP["scatter"], ([torch.empty(n)], [[torch.ones(n)]], 0)),
           (OP["all_gather"], ([[torch.empty(n)]], [torch.ones(n)])),
           (OP["all_gather_into_tensor"], (torch.empty(n), torch.ones(n))),
           (OP["all_gather_coalesced"], ([[torch.empty(n)]], [torch.ones(n)])),
           (OP["all_gather_into_tensor_coalesced"], ([torch.empty(n)], [torch.ones(n)])),
           (OP["gather"], ([[torch.empty(n)]], [torch.ones(n)], 0)),
           (OP["gather_single"], (torch.empty(n), torch.ones(n), 0)),
           (OP["all_to_all_single"], (torch.empty(n), torch.ones(n), [], [])),
           (OP["all_to_all"], ([torch.empty(n)], [torch.ones(n)])),
           (OP["barrier"], ())]
    for op, args in ops:
        op_path.run(g, op, args).wait()
    from torch.distributed.flight_recorder.components.types import Op

    record = flight.snapshot([g])
    assert len(record["entries"]) == len(ops)
    for entry in record["entries"]:  # fr_trace's parser of an entry (its op name must be one it knows)
        op = Op(entry, {"self": {0}}, "self")
        assert op.type == entry["profiling_name"].split(":")[1] and op.collective_seq_id == entry["collective_seq_id"]
    with open(tmp_path / "rank_0", "wb") as f:
        pickle.dump(record, f)
    proc = fr_trace(tmp_path, "rank_")
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "sequence number" not in report and "Traceback" not in report, report


# ----------------------------------------------------------------------------
# a job desynced on purpose
# ----------------------------------------------------------------------------

DESYNC = """
from datetime import timedelta
import torch, torch.distributed as dist, hpccomm

hpccomm.init_process_group(timeout=timedelta(seconds=60))
t = torch.ones(4)
for step in range(3):
    dist.all_reduce(t)                                        # ops 1-3 on every rank
if dist.get_rank() == 1:
    dist.broadcast(torch.zeros(3, dtype=torch.int32), 0)      # op 4 on rank 1: the desync
else:
    dist.all_reduce(t)                                        # op 4 on the others
dist.all_reduce(t)
"""


@pytest.mark.parametrize("check, state", [("every", "completed"), ("first", "started")])
def test_a_desynced_job_leaves_records_that_fr_trace_reads(tmp_path, check, state):
    """Three ranks; rank 1 calls broadcast where the others call all_reduce (op #4).  hpccomm ends
    the job (the mismatch is caught: by every call's check, which raises on every rank, the op
    over; or, in the first mode, while the ranks' op #4 waits), every rank writes its record to
    TORCH_FR_DUMP_TEMP_FILE + rank, and fr_trace names op #4, rank 1 and the two collectives."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(DESYNC))
    prefix = tmp_path / "fr" / "rank_"
    mpi = require()
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(prefix), "HPCCOMM_MISMATCH_CHECK": check}
    t0 = time.monotonic()
    proc = subprocess.run(["timeout", "--kill-after=10", "120", *mpi.argv(3, sys.executable, str(script),
                                                                          pass_env=env)],
                          capture_output=True, text=True, env=mpi.env(**env))
    took = time.monotonic() - t0
    assert proc.returncode not in (0, 124, 137), (proc.returncode, proc.stderr)
    assert took < 60, took
    assert sorted(os.listdir(tmp_path / "fr")) == ["rank_0", "rank_1", "rank_2"], (os.listdir(tmp_path / "fr"),
                                                                                  proc.stderr)
    for r in range(3):
        with open(f"{prefix}{r}", "rb") as f:
            record = pickle.load(f)
        last = record["entries"][-1]
        assert (last["collective_seq_id"], last["state"]) == (4, state), (r, record["entries"])
        assert last["profiling_name"] == ("gloo:broadcast" if r == 1 else "gloo:all_reduce")
    report = fr_trace(tmp_path / "fr", "rank_")
    said = report.stdout + report.stderr
    assert report.returncode == 0, said
    assert "Collective sequence number: 4 has errors" in said, said
    assert "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' does " \
           "not match found collective type: 'broadcast'" in said, said
    assert said.count("sequence number") == 1, said
    assert no_orphans(tmp_path)


# ----------------------------------------------------------------------------
# on request, under mpirun
# ----------------------------------------------------------------------------

@pytest.mark.mpi
def test_dump_on_request_on_every_rank_is_matched_by_fr_trace(world, monkeypatch):
    """Every rank runs the same ops on a new group and writes its record (one folder, rank 0's);
    fr_trace matches every op of that group on every rank, in order, with its sizes."""
    rank, size = world
    folder = [tempfile.mkdtemp(prefix="hpccomm-flight-") if rank == 0 else None]
    dist.broadcast_object_list(folder, 0)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", f"{folder[0]}/rank_")
    pg = dist.new_group(list(range(size)))
    n = 4
    dist.all_reduce(torch.ones(n), group=pg)
    dist.broadcast(torch.zeros(3, dtype=torch.int32), 0, group=pg)
    dist.all_gather_into_tensor(torch.empty(n * size), torch.ones(n), group=pg)
    dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * size), group=pg)
    dist.all_reduce(torch.ones(2, dtype=torch.float64), group=pg, async_op=True).wait()
    dist.barrier(group=pg)
    path = hpccomm.dump_flight_record()
    assert path == f"{folder[0]}/rank_{rank}"
    dist.barrier()
    if rank != 0:
        return
    try:
        _check_records(folder[0], pg.group_name, size, n)
    finally:
        shutil.rmtree(folder[0], ignore_errors=True)


def _only_group(folder: str, name: str, size: int) -> None:
    """Each rank's record ``folder/rank_<r>`` with only group ``name``'s entries, as
    ``folder/ours_<r>``: the MPI phase runs the test files in one process per rank, and
    earlier tests (test_mismatch) leave ops they mismatched on purpose in their groups'
    rings, which fr_trace rightly reports.  Their record ids are numbered again from 0 on
    every rank: fr_trace aligns the ranks' records by id (torch's ids count every group's
    ops on a rank), and those earlier tests ran a different number of ops on each rank."""
    for r in range(size):
        with open(f"{folder}/rank_{r}", "rb") as f:
            record = pickle.load(f)
        record["entries"] = [e for e in record["entries"] if e["process_group"][0] == name]
        for i, e in enumerate(record["entries"]):
            e["record_id"] = i
        ids = {str(e["pg_id"]) for e in record["entries"]}
        record["pg_config"] = {k: v for k, v in record["pg_config"].items() if k == name}
        record["pg_status"] = {k: v for k, v in record["pg_status"].items() if k in ids}
        with open(f"{folder}/ours_{r}", "wb") as f:
            pickle.dump(record, f)


def _check_records(folder: str, name: str, size: int, n: int) -> None:
    _only_group(folder, name, size)
    proc = fr_trace(folder, "ours_", "-o", f"{folder}/db.pkl")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "sequence number" not in said and "Traceback" not in said, said
    with open(f"{folder}/db.pkl", "rb") as f:
        _, db = pickle.load(f)
    ours = [(c.collective_name, c.collective_seq_id, c.input_sizes, c.output_sizes, c.pass_check,
             c.expected_ranks) for c in db.collectives if c.group_id == name]
    everyone = set(range(size))
    assert ours == [("gloo:all_reduce", 1, [[n]], [[n]], True, everyone),
                    ("gloo:broadcast", 2, [[3]], [[3]], True, everyone),
                    ("gloo:_all_gather_base", 3, [[n]], [[n * size]], True, everyone),
                    ("gloo:_reduce_scatter_base", 4, [[n * size]], [[n]], True, everyone),
                    ("gloo:all_reduce", 5, [[2]], [[2]], True, everyone),
                    ("gloo:barrier", 6, [], [], True, everyone)], ours
    assert all(c.pass_check for c in db.collectives), [c for c in db.collectives if not c.pass_check]
