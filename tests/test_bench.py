"""``hpccomm bench``: the busbw factors and the checker without MPI, then short
real sweeps under ``timeout mpirun -n 2`` (plain pytest: each test launches its
own job), asserting #wrong == 0 on every row and the output's columns."""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys

import pytest
from mpilaunch import require
import torch

import hpccomm.tools.bench as bench_cli
from hpccomm.tools.bench import ops as B
from hpccomm.tools.bench import parse_bytes, report

# -- nccl-tests' formulas (doc/PERFORMANCE.md), written out independently -----
NCCL_TESTS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1,
    "reduce": lambda n: 1,
    "sendrecv": lambda n: 1,
}


@pytest.mark.parametrize("op", sorted(NCCL_TESTS_FACTOR))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_bus_factor_matches_nccl_tests(op, n):
    assert B.bus_factor(op, n) == pytest.approx(NCCL_TESTS_FACTOR[op](n))


def test_busbw_of_known_figures():
    # 1 GB in 0.5 s on 4 ranks: algbw 2 GB/s; all_reduce bus factor 1.5 -> 3 GB/s
    assert B.algbw(10**9, 0.5) == pytest.approx(2.0)
    assert B.busbw("all_reduce", 10**9, 0.5, 4) == pytest.approx(3.0)
    assert B.busbw("all_gather", 10**9, 0.5, 4) == pytest.approx(1.5)
    assert B.busbw("broadcast", 10**9, 0.5, 4) == pytest.approx(2.0)


def test_every_issue_op_is_benchmarked():
    assert set(B.OPS) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
                          "gather", "scatter", "sendrecv", "barrier"}
    assert [s.name for s in B.parse_ops("all_gather_into_tensor,reduce_scatter_tensor,all_to_all_single")] == \
        ["all_gather", "reduce_scatter", "all_to_all"]
    with pytest.raises(ValueError, match="unknown op 'allgatherz'"):
        B.parse_ops("allgatherz")


def test_sizes_counts_and_stats():
    assert B.sizes(8, 64 << 20, 2)[0] == 8 and B.sizes(8, 64 << 20, 2)[-1] == 64 << 20
    assert B.sizes(8, 1024, 4) == [8, 32, 128, 512]
    with pytest.raises(ValueError, match="factor 1"):
        B.sizes(8, 64, 1)
    assert parse_bytes("64M") == 64 << 20 and parse_bytes("8") == 8 and parse_bytes("1GiB") == 1 << 30
    assert B.count_for(B.OPS["all_gather"], 8, 4, 4) == 4  # at least one element per rank
    assert B.count_for(B.OPS["all_reduce"], 8, 4, 4) == 2
    assert B.count_for(B.OPS["scatter"], 1 << 20, 4, 3) == (262144 // 3) * 3
    st = B.stats([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (st["median"], st["min"], st["max"]) == (3.0, 1.0, 5.0)
    assert B.stats(list(range(1, 101)))["p99"] == 99
    assert B.stats([1.0, 2.0])["median"] == 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64])
@pytest.mark.parametrize("redop", ["sum", "prod", "min", "max", "avg"])
def test_expected_reduction_is_the_brute_force_one(dtype, redop):
    n = 5
    ins = torch.stack([B.red_input(r, 3, 40, torch.float64, redop) for r in range(n)])
    assert ((ins >= 1) & (ins == ins.round())).all(), "inputs must be integers >= 1 (0 is the poison)"
    want = {"sum": ins.sum(0), "prod": ins.prod(0), "min": ins.min(0).values, "max": ins.max(0).values,
            "avg": ins.sum(0)}[redop]
    if redop == "avg":
        want = want.to(dtype) / n if dtype.is_floating_point else torch.div(want, n, rounding_mode="trunc")
    assert torch.equal(B.red_expected(n, 3, 40, dtype, redop), want.to(dtype))


def _reduce(ts, redop, n):
    st = torch.stack(ts)
    if redop in ("sum", "avg"):
        out = st.sum(0)
        if redop == "avg":
            out = out / n if out.dtype.is_floating_point else torch.div(out, n, rounding_mode="trunc")
        return out.to(ts[0].dtype)
    return {"prod": lambda: st.prod(0), "min": lambda: st.min(0).values, "max": lambda: st.max(0).values}[redop]()


def _simulate(name, cases, n, redop, root):
    """Do the op by hand over every simulated rank's buffers (a reference independent of the checker)."""
    t = [c.tensors for c in cases]
    if name == "all_reduce":
        res = _reduce([x["buf"].clone() for x in t], redop, n)
        for x in t:
            x["buf"].copy_(res)
    elif name == "all_gather":
        res = torch.cat([x["inp"].clone() for x in t])
        for x in t:
            x["out"].copy_(res)
    elif name == "reduce_scatter":
        ins = [x["inp"].clone() for x in t]
        for r, x in enumerate(t):
            x["out"].copy_(_reduce([i.chunk(n)[r] for i in ins], redop, n))
    elif name == "all_to_all":
        ins = [x["inp"].clone() for x in t]
        for r, x in enumerate(t):
            x["out"].copy_(torch.cat([i.chunk(n)[r] for i in ins]))
    elif name == "broadcast":
        for x in t:
            x["buf"].copy_(t[root]["buf"].clone())
    elif name == "reduce":
        t[root]["buf"].copy_(_reduce([x["buf"].clone() for x in t], redop, n))
    elif name == "gather":
        t[root]["out"].copy_(torch.cat([x["inp"].clone() for x in t]))
    elif name == "scatter":
        src = t[root]["inp"].clone()
        for r, x in enumerate(t):
            x["out"].copy_(src.chunk(n)[r])
    elif name == "sendrecv":
        for c in cases:
            if c.role == "pong":
                c.tensors["buf"].copy_(t[c.tensors["partner"]]["buf"])
        for c in cases:
            if c.role == "ping":
                c.tensors["back"].copy_(t[c.tensors["partner"]]["buf"])


@pytest.mark.parametrize("op,placement", [(o, p) for o, s in B.OPS.items() if o != "barrier" for p in s.placements])
@pytest.mark.parametrize("dtype,redop", [(torch.float32, "sum"), (torch.bfloat16, "max"), (torch.int32, "avg"),
                                         (torch.float64, "prod")])
def test_checker_passes_a_right_result_and_counts_an_injected_corruption(op, placement, dtype, redop):
    spec = B.OPS[op]
    n, root = 3, 1
    count = B.count_for(spec, 4 * 1000, 4, n)
    cases = [B.make_case(spec, placement, count, dtype, r, n, redop, root) for r in range(n)]
    for c in cases:
        c.fill()
    assert sum(c.wrong() for c in cases) > 0, "poisoned outputs must count as wrong before the op ran"
    _simulate(op, cases, n, redop, root)
    assert [c.wrong() for c in cases] == [0] * n
    # inject: one element off by one on one rank that has an output
    victim = next(c for c in cases if c.tensors.get("out") is not None or c.tensors.get("back") is not None
                  or (op in ("all_reduce", "broadcast") or (op == "reduce" and c is cases[root])))
    out = victim.tensors.get("back", victim.tensors.get("out", victim.tensors.get("buf")))
    out.view(-1)[out.numel() - 1] += 1
    assert victim.wrong() == 1
    out.view(-1)[0] = float("nan") if dtype.is_floating_point else 0
    assert victim.wrong() == 2


def test_report_table_has_nccl_tests_columns():
    row = B.Row("hpccomm", "all_gather", "blocking", B.OOP, 1024, 128, "float32", "none", -1,
                10.0, 9.0, 12.0, 11.5, 0.1024, 0.0512, 0, 5)
    text = report.table([row, B.Row(**{**row.__dict__, "placement": B.IP})], stats=True)
    for col in ("size", "count", "type", "redop", "root", "time", "min", "max", "p99", "algbw", "busbw",
                "#wrong", "out-of-place", "in-place", "Avg bus bandwidth"):
        assert col in text, col
    assert "0.0512" in text.split("Avg bus bandwidth")[1]


# -- real sweeps under mpirun ---------------------------------------------------

def bench(tmp_path, *args, n: int = 2, limit: int = 150):
    """``hpccomm.tools.bench ARGS`` on ``n`` ranks, with the MPI family's launcher (tests/mpilaunch.py)."""
    mpi = require()
    cmd = ["timeout", "--kill-after=10", str(limit), *mpi.argv(n, sys.executable, "-m", "hpccomm.tools.bench",
                                                               *map(str, args))]
    return subprocess.run(cmd, capture_output=True, text=True, env=mpi.env(), cwd=tmp_path)


def _plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.one_cell
def test_short_sweep_every_op_all_backends(tmp_path):
    """CI's short mode: every op at a handful of sizes, against gloo and raw MPI; no wrong result.  Two ops
    per sample (``--batch 2``: back to back, as a sample of small ops is timed), not the hundred that
    ``--batch auto`` gives small sizes: what is checked is every op's results and the output's form."""
    js, cs, png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    args = ["--ops", "all", "-b", "8", "-e", "128K", "-f", "16", "-n", "3", "-w", "1", "--batch", "2",
            "--compare", "gloo,mpi4py", "--stats", "--json", js, "--csv", cs]
    proc = bench(tmp_path, *args, "--plot", png)
    out = proc.stdout + proc.stderr
    if not _plot_available():  # then --plot must refuse up front, clearly
        assert proc.returncode == 2 and "--plot needs matplotlib" in out, out[-3000:]
        proc = bench(tmp_path, *args)
        out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for col in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "out-of-place",
                "in-place", "Avg bus bandwidth", "Out of bounds values : 0 OK", "x/gloo", "x/mpi4py"):
        assert col in proc.stdout, col
    # How long it will take, up front, then one line per op as each finishes.
    head = [x for x in proc.stdout.splitlines() if x.startswith("# ")]
    est = [x for x in head if ", estimated: about " in x]
    assert len(est) == 1 and est[0].startswith(f"# {len(B.OPS)} ops x 4 sizes (8 B .. 32 KiB) x 3 backends, "
                                               "estimated: about "), head
    assert est[0].endswith(" s on a 2-core machine (docs/benchmarks.md); --full: the whole nccl-tests sweep"), est
    done = [x for x in head if x.startswith("# [")]
    assert [x.split("] ")[1].split(" (")[0] for x in done] == list(B.OPS), done
    assert all(re.fullmatch(rf"# \[{k + 1}/{len(B.OPS)}\] \S+ \(float32\) done in \d+\.\d s; \d+ s so far, "
                            r"about \d+ s left", x) for k, x in enumerate(done)), done
    assert proc.stdout.index(est[0]) < proc.stdout.index("Avg bus bandwidth") < proc.stdout.index(done[0])
    doc = json.loads(js.read_text())
    rows = doc["rows"]
    assert set(doc["columns"]) >= {"size", "count", "type", "redop", "root", "time_us", "min_us", "max_us",
                                   "p99_us", "algbw", "busbw", "wrong", "placement", "backend", "mode"}
    assert {r["op"] for r in rows} == set(B.OPS)
    assert {r["backend"] for r in rows} == {"hpccomm", "gloo", "mpi4py"}
    measured = [r for r in rows if not r["note"]]
    assert all(r["wrong"] == 0 for r in rows), [r for r in rows if r["wrong"]]
    assert all(r["time_us"] > 0 for r in measured)
    hp = [r for r in measured if r["backend"] == "hpccomm"]
    assert len(hp) == len([r for r in rows if r["backend"] == "hpccomm"]), "hpccomm must run every case"
    assert {r["size"] for r in hp if r["op"] == "all_reduce"} == {8, 128, 2048, 32768}
    for r in hp:  # busbw = size / time x factor, as printed
        if r["size"]:
            assert r["busbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9 * B.bus_factor(r["op"], 2))
    assert doc["compare"] and all(c["x_gloo"] is not None for c in doc["compare"] if c["op"] == "all_reduce")
    with open(cs) as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and set(table[0]) == set(report.COLUMNS)
    if _plot_available():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_sweep_and_full_sweep():
    """Without -b/-e/-f the sweep is the short one (about a minute on 2 cores
    with every backend); --full is nccl-tests' (8 B .. 64 MiB, x2); a size
    given on the command line wins either way."""
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    for argv, want in (([], (8, 16 << 20, 8)), (["--full"], (8, 64 << 20, 2)),
                       (["--full", "-e", "1M"], (8, 1 << 20, 2)), (["-f", "4"], (8, 16 << 20, 4))):
        args = p.parse_args(argv)
        bench_cli.resolve_sweep(args)
        assert (args.min_bytes, args.max_bytes, args.factor) == want, argv


def test_estimate_grows_with_the_sweep():
    """The estimate (hpccomm.tools.bench.estimate) counts what the sweep runs: more
    bytes, ops or backends take longer; the default sweep with every backend
    is estimated at about a minute (its measured time on the 2-core machine:
    docs/benchmarks.md)."""
    from hpccomm.tools.bench import estimate
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)

    def total(argv, backends):
        args = p.parse_args(argv)
        bench_cli.resolve_sweep(args)
        plan = [(torch.float32, spec, nb) for spec in B.parse_ops(args.ops)
                for nb in (B.sizes(args.min_bytes, args.max_bytes, args.factor) if spec.sweeps else [0])]
        return estimate.seconds(bench_cli._cases(plan, ["world"], ["blocking"], backends, args), args)

    every = ["hpccomm", "gloo", "mpi4py", "floor"]
    default = total([], every)
    assert 40 < default < 80, default
    assert total(["--full"], every) > 3 * default
    assert total([], ["hpccomm"]) < default
    assert total(["--ops", "all_reduce"], every) < default
    assert estimate.say(55.2) == "about 55 s" and estimate.say(600) == "about 10 min"


@pytest.mark.one_cell
def test_corrupted_results_are_counted_and_fail_the_run(tmp_path):
    js = tmp_path / "c.json"
    proc = bench(tmp_path, "--ops", "all_reduce,all_gather,sendrecv", "-b", "64", "-e", "64", "-n", "3", "-w", "1",
                 "--corrupt", "--json", js, "-a", "--batch", "1")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    rows = json.loads(js.read_text())["rows"]
    # one corrupted element per checked result: 4 iterations x 2 ranks
    assert all(r["wrong"] == 8 for r in rows), rows
    assert {r["mode"] for r in rows} == {"async"}
    assert "FAILED" in proc.stdout + proc.stderr


def test_peak_memory_is_printed(tmp_path):
    proc = bench(tmp_path, "--peak-memory", "32")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "peak memory: one float32 all_reduce of 32 MiB" in proc.stdout
    assert proc.stdout.count(" ok") >= 4  # hpccomm and mpi4py on 2 ranks, results checked


def test_bad_arguments_fail_before_mpi(tmp_path):
    proc = bench(tmp_path, "--ops", "all_reduse", n=1, limit=60)
    assert proc.returncode != 0 and "unknown op 'all_reduse'" in proc.stderr


def test_floor_backend_is_checked_and_right_at_an_odd_size(tmp_path):
    """``--compare floor`` (raw MPI calls inside the thinnest Python backend, on hpccomm's own route): its
    results go through the same checker (right with MAX at 3 ranks, blocking and async, on the default group
    and on a subgroup; every checked result caught when corrupted), and the cases it cannot run say why."""
    args = ["--ops", "all_reduce,all_gather,reduce_scatter,broadcast,sendrecv,all_to_all", "-b", "8", "-e", "32K",
            "-f", "64", "-n", "3", "-w", "1", "-o", "max", "--compare", "floor", "--batch", "1",
            "--mode", "both", "--group", "both"]
    js = tmp_path / "f.json"
    proc = bench(tmp_path, *args, "--json", js, n=3, limit=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "x/floor" in proc.stdout
    assert "# route: " in proc.stdout and "the floor takes the same route" in proc.stdout
    assert "subgroup (dist.new_group of every rank)" in proc.stdout
    doc = json.loads(js.read_text())
    assert doc["meta"]["groups"] == ["world", "sub"] and doc["meta"]["route"]
    # torch >= 2.15 hooks its flight recorder onto the groups of backends that do not record themselves
    # (on by default: TORCH_FR_BUFFER_SIZE unset); the header says so where it costs the route
    fr_size = next((os.environ[v] for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
                    if os.environ.get(v)), "2000")
    hooked = hasattr(torch.distributed.distributed_c10d, "_maybe_attach_flight_recorder") and \
        doc["meta"]["route"].startswith("c10d Backend") and int(fr_size) > 0
    assert ("flight recorder hook records every op" in doc["meta"]["route"]) == hooked, doc["meta"]["route"]
    rows = [r for r in doc["rows"] if r["backend"] == "floor"]
    ran = {(r["op"], r["placement"]) for r in rows if not r["note"]}
    assert ran == {("all_reduce", "in-place"), ("all_gather", "out-of-place"), ("all_gather", "in-place"),
                   ("reduce_scatter", "out-of-place"), ("broadcast", "in-place"), ("sendrecv", "out-of-place")}, ran
    assert {(r["mode"], r["group"]) for r in rows if not r["note"]} == {
        ("blocking", "world"), ("blocking", "sub"), ("async", "world"), ("async", "sub")}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows if not r["note"]), rows
    notes = {r["op"]: r["note"] for r in rows if r["note"]}
    assert notes["all_to_all"].startswith("floor: only all_reduce, all_gather, reduce_scatter, broadcast, sendrecv"), \
        notes
    assert "out-of-place reduce_scatter only" in notes["reduce_scatter"], notes
    compared = {(c["op"], c["mode"], c["group"]) for c in doc["compare"] if c["x_floor"] is not None}
    assert ("sendrecv", "async", "sub") in compared and ("broadcast", "blocking", "world") in compared, compared

    proc = bench(tmp_path, *args, "--json", js, "--corrupt", n=3, limit=300)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    rows = [r for r in json.loads(js.read_text())["rows"] if r["backend"] == "floor" and not r["note"]]
    # (iterations + warm-up) x ranks with an output (sendrecv at 3 ranks: the pair 0-1; rank 2 has no partner)
    assert rows and all(r["wrong"] == (3 + 1) * (2 if r["op"] == "sendrecv" else 3) for r in rows), rows
