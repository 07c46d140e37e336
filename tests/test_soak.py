"""A bounded soak: thousands of mixed ops at 3 ranks in one job, checked for
results and for leaks (threads, communicators, store keys, memory).

One real mpirun job (well under 2 minutes here): blocking and async
collectives, point-to-point rings, batched point-to-point, and groups made,
used and destroyed, round after round.  After a warm-up round, every rank
records its threads, hpccomm's live communicators, the store's key count
and its resident memory; at the end each must be back where it was (memory
within a stated bound), and every result must have been right.
"""
from __future__ import annotations

import json

from test_init import mpirun, worker

ROUNDS = 120
RSS_BOUND_MIB = 24.0  # growth allowed after warm-up (allocator and interpreter caches settle)

SOAK = f'''
import gc, threading
from datetime import timedelta
import torch, torch.distributed as dist
import hpccomm
from hpccomm import _mpi

ROUNDS = {ROUNDS}
hpccomm.init_process_group(timeout=timedelta(seconds=60))
r, n = dist.get_rank(), dist.get_world_size()
prev, nxt = (r - 1) % n, (r + 1) % n
store = dist.distributed_c10d._get_default_store()
wrong = []
ops = 0


def check(ok, what):
    if not ok:
        wrong.append(what)


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def one_round(i):
    global ops
    t = torch.full((64,), float(r + i))
    dist.all_reduce(t)
    check(torch.all(t == sum(k + i for k in range(n))), f"round {{i}}: all_reduce")
    works, outs = [], []
    for j in range(8):
        u = torch.full((256,), float(r * j))
        works.append(dist.all_reduce(u, async_op=True))
        outs.append((j, u))
    big = torch.empty(n * 32)
    dist.all_gather_into_tensor(big, torch.full((32,), float(r)))
    check(torch.equal(big, torch.arange(n, dtype=torch.float32).repeat_interleave(32)), f"round {{i}}: all_gather")
    rs = torch.empty(16)
    dist.reduce_scatter_tensor(rs, torch.ones(16 * n))
    check(torch.all(rs == n), f"round {{i}}: reduce_scatter")
    b = torch.full((8,), float(r))
    dist.broadcast(b, src=i % n)
    check(torch.all(b == i % n), f"round {{i}}: broadcast")
    for w in works:
        w.wait()
    for j, u in outs:
        check(torch.all(u == j * sum(range(n))), f"round {{i}}: async {{j}}")
    got = torch.zeros(4, dtype=torch.int64)
    rw = dist.irecv(got, src=prev, tag=i % 7)
    dist.isend(torch.full((4,), r * 1000 + i, dtype=torch.int64), dst=nxt, tag=i % 7).wait()
    rw.wait()
    check(torch.all(got == prev * 1000 + i), f"round {{i}}: isend/irecv")
    a, c = torch.zeros(3), torch.zeros(3)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, a, prev), dist.P2POp(dist.irecv, c, nxt),
                                     dist.P2POp(dist.isend, torch.full((3,), float(r)), nxt),
                                     dist.P2POp(dist.isend, torch.full((3,), float(r)), prev)]):
        w.wait()
    check(torch.all(a == prev) and torch.all(c == nxt), f"round {{i}}: batch_isend_irecv")
    ops += 1 + 8 + 3 + 2 + 4
    if i % 10 == 0:
        members = [k for k in range(n) if k != i % n]
        sub = dist.new_group(members)
        if r in members:
            s = torch.ones(2)
            dist.all_reduce(s, group=sub)
            check(torch.all(s == len(members)), f"round {{i}}: subgroup")
            dist.destroy_process_group(sub)
        ops += 2
    if i % 20 == 0:
        hpccomm.monitored_barrier(timeout=timedelta(seconds=60))
        ops += 1


def snapshot():
    gc.collect()
    return dict(threads=threading.active_count(), groups=sum(1 for g in _mpi.live if not g.freed),
                keys=store.num_keys(), rss=rss_mib())


one_round(0)
one_round(1)
before = snapshot()
for i in range(2, ROUNDS):
    one_round(i)
after = snapshot()
# every rank's snapshot before any rank destroys the world: a rank that destroys it says so in the
# store (a key its peers read if they time out waiting for it: hpccomm._core.state.record_leaving)
dist.barrier()
report(rank=r, ops=ops, wrong=wrong[:5], before=before, after=after)
dist.destroy_process_group()
'''


def test_soak_mixed_ops_leak_nothing(tmp_path):
    job = mpirun(3, worker(tmp_path, "soak", SOAK)).ok(3)
    for r, rep in job.reports.items():
        before, after = rep["before"], rep["after"]
        assert rep["wrong"] == [], rep["wrong"]
        assert rep["ops"] > 2000, rep["ops"]
        assert after["threads"] == before["threads"], (before, after)
        assert after["groups"] == before["groups"], (before, after)
        assert after["keys"] == before["keys"], (before, after)
        growth = after["rss"] - before["rss"]
        assert growth < RSS_BOUND_MIB, f"rank {r}: resident memory grew {growth:.1f} MiB ({before} -> {after})"
    print("soak:", json.dumps({r: {"ops": rep["ops"], "rss_growth_mib": round(rep["after"]["rss"] -
                                                                          rep["before"]["rss"], 2)}
                               for r, rep in job.reports.items()}))
