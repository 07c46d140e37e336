"""Run torch's own distributed test suite (``DistributedTest._DistTestBase``,
the copy inside the torch wheel) against hpccomm and against gloo, and write
a table: test, gloo result, hpccomm result, first line of the error.

How torch runs the suite for a backend (upstream ``test/run_test.py`` and
``test/distributed/test_distributed_spawn.py``): ``BACKEND``, ``WORLD_SIZE``
(3 on CPU) and ``TEMP_DIR`` (with ``barrier/`` and ``test_dir/``) in the
environment; for gloo/nccl/ucc a ``TestDistBackend`` parent process spawns
``WORLD_SIZE`` children per test, each of which inits the default group with
``file://`` (``TestDistBackend._run``), runs one test and exits.  torch's own
MPI backend could not be spawned that way (an MPI rank must be started by
``mpiexec``), so ``run_test.py`` launched the whole test file under
``mpiexec -n 3``, with one process group for the whole run.

hpccomm has the same constraint: its ranks are MPI ranks, so the processes
must come from ``mpirun``, not from ``torch.multiprocessing.spawn``.  This
runner keeps torch's per-test isolation anyway: ``mpirun -n 3`` starts three
workers; each worker runs a list of tests, and for every test does exactly
what ``TestDistBackend._run`` does in a spawned child (a fresh default group
over a fresh ``file://`` store, the file barrier, the test, the barrier,
``destroy_process_group``), with that test's own ``TEMP_DIR`` and
``INIT_METHOD`` as the spawned child would see them.  gloo runs the same way
by default (the same harness for both columns); ``--gloo-launch spawn`` runs
gloo the way torch's CI does instead (one spawn per test), to check that the
harness itself changes nothing for gloo.

As in torch's spawn mode, the first rank to fail a test ends the job (so no
rank waits for a peer that gave up); the runner records the error, starts a
new ``mpirun`` and goes on with the next test.  A test that outlives
``--test-timeout`` dumps every thread's stack into the rank's log and is
recorded as a timeout.

Usage (from the repository root, in the venv; needs ``pip install expecttest``,
which torch's test utilities import)::

    python tests/torch_suite/run_distributed_test.py                 # both backends, every test
    python tests/torch_suite/run_distributed_test.py -k all_gather -k sparse
    python tests/torch_suite/run_distributed_test.py --backend hpccomm --tests-from names.txt
    python tests/torch_suite/run_distributed_test.py --backend gloo --gloo-launch spawn -k broadcast

Results go to ``--out`` (default ``tests/torch_suite/out``): ``table.md``,
``results.json``, and per backend the workers' logs and JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SKIP, PASS, FAIL, CRASH, TIMEOUT = "skip", "pass", "FAIL", "CRASH", "TIMEOUT"
LIFTED = "hpccomm, gate lifted"
#: Skip reasons about this machine (no GPU, too few ranks, a missing package), not about the backend.
HARDWARE_SKIP = re.compile(r"CUDA|GPU|[Ww]orld size|world_size|torchvision|accelerator|ROCm|file:// init")
FAIL_EXIT = 10  # a worker that recorded a failure exits with this (torch's TEST_ERROR_EXIT_CODE)
TIMEOUT_EXIT = 11  # faulthandler's exit after --test-timeout is 1; the driver tells them apart by the record


# ----------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------

def error_line(text: str) -> str:
    """The line of a traceback that says what went wrong: the last line that
    starts a ``Type: message`` (not indented, not a 'Traceback' header)."""
    lines = [ln.rstrip() for ln in (text or "").splitlines() if ln.strip()]
    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout|SkipTest|Failure)\b.*")
    for line in reversed(lines):
        if pattern.match(line) and not line.startswith("Traceback"):
            return line[:300]
    return (lines[-1] if lines else "")[:300]


def _rank_from_launcher() -> tuple[int, int]:
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                               ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise SystemExit("run_distributed_test --worker: start it under mpirun (no launcher rank variable found)")


def _prepare_torch_suite(backend: str, world_size: int, temp_dir: str):
    """Import torch's suite for ``backend`` (the module reads BACKEND at import)."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["TEMP_DIR"] = temp_dir
    os.environ.setdefault("INIT_METHOD", "env://")
    if backend == "hpccomm":
        import hpccomm  # noqa: F401 - registers the backend with torch
        from torch.testing._internal.common_distributed import DistTestCases

        # torch's suite gates tests on which backends claim a feature; a plugin
        # backend declares its own (DistTestCases is the suite's hook for it).
        # hpccomm claims every one of them: CPU tensors, subgroups, DDP, and CUDA
        # tensors (UNVERIFIED ON HARDWARE: GPU tests still skip without a GPU).
        for feature in ("gpu", "cuda", "ddp", "subgroup", "plugin"):
            DistTestCases.backend_feature[feature].add("hpccomm")
    from torch.testing._internal.distributed import distributed_test as dt

    return dt


def list_tests() -> list[str]:
    """Every test name of ``DistributedTest._DistTestBase`` (parametrized ones expanded)."""
    import tempfile

    dt = _prepare_torch_suite("gloo", 3, tempfile.gettempdir())
    return sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_"))


# ----------------------------------------------------------------------------
# the worker: one MPI rank, running tests one after another
# ----------------------------------------------------------------------------

def worker(args) -> None:
    rank, size = _rank_from_launcher()
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"rank{rank}.log", "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import faulthandler

    faulthandler.enable(file=log, all_threads=True)
    record_file = open(out / f"rank{rank}.jsonl", "a", buffering=1)

    def record(**kw):
        record_file.write(json.dumps(kw) + "\n")
        record_file.flush()
        os.fsync(record_file.fileno())

    tests = [t for t in Path(args.tests).read_text().split() if t]
    scratch = Path(args.scratch)
    backend = args.backend[0]
    dt = _prepare_torch_suite(backend, size, str(scratch))
    import unittest
    from datetime import timedelta

    import torch.distributed as dist
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import FILE_SCHEMA

    skip_codes = {s.exit_code: s.message for s in TEST_SKIPS.values()}

    class Suite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass

    os.environ["MASTER_ADDR"] = str(dt.MASTER_ADDR)  # as TestDistBackend.setUpClass
    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"  # as MultiProcessTestCase.run_test
    for index, name in zip(map(int, args.indices.split(",")), tests):
        # What a spawned child of TestDistBackend sees: its own TEMP_DIR (with
        # barrier/, test_dir/, init_dir/), INIT_METHOD a file in it, and a
        # fresh store file for the default group.
        tdir = scratch / f"{index:04d}"
        for sub in ("barrier", "test_dir", "init_dir"):
            (tdir / sub).mkdir(parents=True, exist_ok=True)
        os.environ["TEMP_DIR"] = str(tdir)
        init_method = FILE_SCHEMA + str(tdir / "init_dir" / "shared_init_file")
        os.environ["INIT_METHOD"] = init_method
        dt.INIT_METHOD = init_method
        dt.Barrier.barrier_id = 0
        record(event="start", test=name, index=index, rank=rank, t=time.time())
        print(f"==== [{index}] {name}", flush=True)
        faulthandler.dump_traceback_later(args.test_timeout, exit=True, file=log)
        start = time.time()
        status, detail = PASS, ""
        try:
            self = Suite(name)
            method = getattr(Suite, name)
            gated = getattr(method, "__unittest_skip__", False) or getattr(Suite, "__unittest_skip__", False)
            if gated and not args.lift_gates:
                # The suite's skip decorators mark the function; unittest's runner
                # (the spawn harness's parent) skips before spawning anything.
                raise unittest.SkipTest(getattr(method, "__unittest_skip_why__", "")
                                        or getattr(Suite, "__unittest_skip_why__", ""))
            self.rank = rank
            self.file_name = str(tdir / "store_file")
            timeout = dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout)
            dist.init_process_group(init_method=self.init_method, backend=backend, world_size=size,
                                    rank=rank, timeout=timedelta(seconds=timeout))
            self._barrier()
            common_utils.set_rng_seed()
            if args.lift_gates:
                # gloo's version of the test: bodies that branch on the backend's
                # name take gloo's branch (the process group is still hpccomm's).
                dt.BACKEND = "gloo"
            getattr(self, name)()
            self._barrier()
        except unittest.SkipTest as exc:
            status, detail = SKIP, str(exc)
        except SystemExit as exc:  # the suite's GPU and world-size skips exit the child with a code
            code = exc.code if isinstance(exc.code, int) else 1
            if code == 0:
                status = PASS
            elif code in skip_codes:
                status, detail = SKIP, skip_codes[code]
            else:
                import traceback

                status, detail = FAIL, f"SystemExit({exc.code})\n" + traceback.format_exc()
        except BaseException:  # noqa: BLE001 - every failure is recorded
            import traceback

            status, detail = FAIL, traceback.format_exc()
        faulthandler.cancel_dump_traceback_later()
        record(event="end", test=name, index=index, rank=rank, status=status, error=error_line(detail)
               if status == FAIL else detail[:300], traceback=detail[-6000:] if status == FAIL else "",
               seconds=round(time.time() - start, 2))
        if status == FAIL:
            print(detail, flush=True)
            log.flush()
            os._exit(FAIL_EXIT)  # as the spawn harness: the first failing rank ends the test for all
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - a failed teardown fails the test that left it
            import traceback

            detail = traceback.format_exc()
            record(event="end", test=name, index=index, rank=rank, status=FAIL, error="teardown: " +
                   error_line(detail), traceback=detail[-6000:], seconds=round(time.time() - start, 2))
            print(detail, flush=True)
            os._exit(FAIL_EXIT)
    record(event="done", rank=rank)


# ----------------------------------------------------------------------------
# gloo the way torch's CI runs it (one spawn per test)
# ----------------------------------------------------------------------------

def spawn_worker(args) -> None:
    """Run tests with torch's own spawn harness (TestDistBackend + spawn), as
    upstream test_distributed_spawn.py does; results as JSON lines."""
    import unittest

    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    record_file = open(out / "spawn.jsonl", "a", buffering=1)
    tests = [t for t in Path(args.tests).read_text().split() if t]
    cls = _spawn_class()
    for index, name in zip(map(int, args.indices.split(",")), tests):
        record_file.write(json.dumps({"event": "start", "test": name, "index": index, "rank": 0}) + "\n")
        result = unittest.TestResult()
        start = time.time()
        cls(name).run(result)
        if result.errors or result.failures:
            text = (result.errors + result.failures)[0][1]
            status, detail = FAIL, text
        elif result.skipped:
            status, detail = SKIP, result.skipped[0][1]
        else:
            status, detail = PASS, ""
        for r in range(int(os.environ["WORLD_SIZE"])):
            record_file.write(json.dumps({"event": "end", "test": name, "index": index, "rank": r, "status": status,
                                          "error": error_line(detail) if status == FAIL else detail[:300],
                                          "traceback": detail[-6000:] if status == FAIL else "",
                                          "seconds": round(time.time() - start, 2)}) + "\n")
        record_file.flush()


def _spawn_class():
    dt = _prepare_torch_suite(os.environ["BACKEND"], int(os.environ["WORLD_SIZE"]), os.environ["TEMP_DIR"])
    import torch

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    globals()["TestDistBackendWithSpawn"] = TestDistBackendWithSpawn  # spawned children look it up here
    return TestDistBackendWithSpawn


if os.environ.get("_TORCH_SUITE_SPAWN") == "1" and __name__ != "__main__":
    _spawn_class()  # a spawned child re-imports this file: define the class it unpickles


# ----------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCCOMM_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                             if p))
    return env


def _read_records(path: Path) -> list[dict]:
    records = []
    for f in sorted(path.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a killed process
    return records


def run_backend(backend: str, names: list[str], args, lift: bool = False) -> dict:
    """Run ``names`` for one backend; returns {test: {status, error, seconds, ranks}}.
    ``lift``: run tests even where the suite's skip decorators say to skip."""
    base = Path(args.out) / (backend + ("-gate-lifted" if lift else ""))
    base.mkdir(parents=True, exist_ok=True)
    spawn = backend == "gloo" and args.gloo_launch == "spawn"
    results: dict = {}
    pending = list(enumerate(names))
    launch = 0
    while pending:
        chunk = pending[:args.chunk]
        launch += 1
        part = base / f"launch{launch:03d}"
        part.mkdir(exist_ok=True)
        tests_file = part / "tests.txt"
        tests_file.write_text("\n".join(n for _, n in chunk) + "\n")
        indices = ",".join(str(i) for i, _ in chunk)
        common = ["--backend", backend, "--tests", str(tests_file), "--indices", indices, "--results", str(part),
                  "--scratch", str(part / "tmp"), "--test-timeout", str(args.test_timeout)]
        if lift:
            common.append("--lift-gates")
        env = _env()
        if spawn:
            scratch = part / "tmp"
            (scratch / "barrier").mkdir(parents=True, exist_ok=True)
            (scratch / "test_dir").mkdir(exist_ok=True)
            env.update(BACKEND=backend, WORLD_SIZE=str(args.ranks), TEMP_DIR=str(scratch), _TORCH_SUITE_SPAWN="1")
            cmd = [sys.executable, __file__, "--spawn-worker", *common]
        else:
            cmd = ["mpirun", "-n", str(args.ranks), "--oversubscribe", sys.executable, __file__, "--worker", *common]
        limit = args.test_timeout * len(chunk) + 120
        started = time.time()
        print(f"[{backend}] launch {launch}: {len(chunk)} tests from #{chunk[0][0]} {chunk[0][1]}", flush=True)
        with open(part / "launcher.log", "w") as launcher_log:
            proc = subprocess.run(["timeout", "--kill-after=15", str(limit), *cmd], env=env, cwd=ROOT,
                                  stdout=launcher_log, stderr=subprocess.STDOUT)
        records = _read_records(part)
        finished = {}
        started_tests = {}
        for r in records:
            if r.get("event") == "start":
                started_tests.setdefault(r["test"], set()).add(r["rank"])
            elif r.get("event") == "end":
                finished.setdefault(r["test"], []).append(r)
        done_upto = -1
        for pos, (index, name) in enumerate(chunk):
            ends = finished.get(name)
            if ends is None:
                break
            statuses = {e["status"] for e in ends}
            failed = [e for e in ends if e["status"] == FAIL]
            if failed:
                first = min(failed, key=lambda e: e["rank"])
                results[name] = {"status": FAIL, "error": first["error"], "traceback": first["traceback"],
                                 "failed_ranks": sorted(e["rank"] for e in failed),
                                 "seconds": max(e["seconds"] for e in ends)}
            elif len(ends) < args.ranks and proc.returncode != 0:
                break  # some ranks finished, the others died: treated below as a crash of this test
            elif statuses == {SKIP}:
                results[name] = {"status": SKIP, "error": ends[0]["error"], "seconds": 0}
            elif statuses == {PASS}:
                results[name] = {"status": PASS, "error": "", "seconds": max(e["seconds"] for e in ends)}
            else:
                results[name] = {"status": FAIL, "error": f"ranks disagree: {sorted(statuses)}",
                                 "seconds": max(e["seconds"] for e in ends)}
            done_upto = pos
            if results[name]["status"] == FAIL:
                break
        stopped_at_failure = done_upto >= 0 and results[chunk[done_upto][1]]["status"] == FAIL
        if not stopped_at_failure and done_upto + 1 < len(chunk):
            index, name = chunk[done_upto + 1]  # the test the launch died in (or never reached)
            if name in started_tests:
                logs = "\n".join((part / f"rank{r}.log").read_text(errors="replace")[-3000:]
                                  for r in range(args.ranks) if (part / f"rank{r}.log").exists())
                timed_out = "Timeout (0:" in logs or proc.returncode in (124, 137)
                last = error_line(logs.split(f"==== [{index}] {name}")[-1]) if logs else ""
                results[name] = {"status": TIMEOUT if timed_out else CRASH,
                                 "error": f"exit {proc.returncode}: {last}", "seconds": round(time.time() - started, 1)}
            else:  # the harness itself failed (nothing started): stop rather than mark every test
                tail = "".join((part / f"rank{r}.log").read_text(errors="replace")[-2000:]
                               for r in range(args.ranks) if (part / f"rank{r}.log").exists())
                raise SystemExit(f"run_distributed_test: launch {launch} of {backend} exited {proc.returncode} before "
                                 f"any test started (see {part}):\n{tail or (part / 'launcher.log').read_text()}")
            done_upto += 1
        pending = pending[done_upto + 1:]
    return results


def write_table(all_results: dict, backends: list[str], out: Path) -> Path:
    names = sorted(set().union(*(set(r) for r in all_results.values())))
    lines = ["| test | " + " | ".join(backends) + " | error (first line) |",
             "|---|" + "---|" * len(backends) + "---|"]
    for name in names:
        cells = [all_results[b].get(name, {}).get("status", "-") for b in backends]
        error = ""
        for b in reversed(backends):  # hpccomm's error first when it is listed last
            r = all_results[b].get(name, {})
            if r.get("status") in (FAIL, CRASH, TIMEOUT):
                error = f"{b}: {r['error']}"
                break
        error = error.replace("|", "\\|")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {error} |")
    counts = []
    for b in backends:
        tally: dict = {}
        for r in all_results[b].values():
            tally[r["status"]] = tally.get(r["status"], 0) + 1
        counts.append(f"{b}: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    if "gloo" in backends and "hpccomm" in backends:
        worse = [n for n in names if all_results["gloo"].get(n, {}).get("status") == PASS
                 and all_results["hpccomm"].get(n, {}).get("status") != PASS]
        counts.append(f"gloo passes, hpccomm does not: {len(worse)}")
        if LIFTED in all_results:
            lifted = [all_results[LIFTED][n]["status"] for n in worse if n in all_results[LIFTED]]
            counts.append(f"of those, skipped by the suite for hpccomm by backend name: {len(lifted)}; run anyway: "
                          + ", ".join(f"{k} {lifted.count(k)}" for k in sorted(set(lifted))))
    table = out / "table.md"
    table.write_text("\n".join(["# torch DistributedTest: " + " vs ".join(backends), "", *[f"- {c}" for c in counts],
                                "", *lines, ""]))
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", action="append", choices=["gloo", "hpccomm"],
                   help="backend to run (repeatable; default: gloo then hpccomm)")
    p.add_argument("-k", action="append", default=[], help="run tests whose name contains this (repeatable)")
    p.add_argument("--tests-from", help="a file with test names, one per line")
    p.add_argument("--ranks", type=int, default=3, help="world size (torch runs its CPU suite at 3)")
    p.add_argument("--chunk", type=int, default=60, help="most tests per mpirun launch")
    p.add_argument("--test-timeout", type=int, default=300, help="seconds before a test counts as hung "
                   "(torch's default for its distributed tests)")
    p.add_argument("--gloo-launch", choices=["mpirun", "spawn"], default="mpirun",
                   help="gloo under the same mpirun harness, or torch's own spawn harness")
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--list", action="store_true", help="print the test names and exit")
    # internal: the worker modes
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spawn-worker", action="store_true", help=argparse.SUPPRESS)
    for internal in ("--tests", "--indices", "--results", "--scratch"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    p.add_argument("--lift-gates", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-lifted", action="store_true",
                   help="do not re-run, with the suite's backend gate lifted, the tests gloo passes and the "
                        "suite skips for hpccomm by backend name")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.spawn_worker:
        os.environ["_TORCH_SUITE_SPAWN"] = "1"
        spawn_worker(args)
        return 0
    try:
        import expecttest  # noqa: F401 - torch.testing._internal imports it
    except ImportError:
        print("run_distributed_test: torch's test utilities need expecttest: pip install expecttest", file=sys.stderr)
        return 2
    names = list_tests()
    if args.tests_from:
        wanted = [n.strip() for n in Path(args.tests_from).read_text().splitlines() if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            print(f"run_distributed_test: not in torch's suite: {unknown}", file=sys.stderr)
            return 2
        names = wanted
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    if not names:
        print("run_distributed_test: no test selected", file=sys.stderr)
        return 2
    backends = args.backend or ["gloo", "hpccomm"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all_results = {}
    t0 = time.time()
    for backend in backends:
        all_results[backend] = run_backend(backend, names, args)
    columns = list(backends)
    if "gloo" in backends and "hpccomm" in backends and not args.no_lifted:
        # The suite gates some tests on the backend's name ("Only gloo backend
        # supports ...").  Where gloo passes such a test, run it on hpccomm with
        # the gate lifted: the column says what hpccomm does with gloo's test.
        gated = [n for n in names if all_results["gloo"].get(n, {}).get("status") == PASS
                 and all_results["hpccomm"].get(n, {}).get("status") == SKIP
                 and not HARDWARE_SKIP.search(all_results["hpccomm"][n].get("error", ""))]
        if gated:  # with the gate lifted, the test body sees BACKEND == "gloo" (gloo's version of the test)
            all_results[LIFTED] = run_backend("hpccomm", gated, args, lift=True)
            columns.append(LIFTED)
    (out / "results.json").write_text(json.dumps({"backends": columns, "ranks": args.ranks,
                                                  "gloo_launch": args.gloo_launch, "results": all_results},
                                                 indent=1))
    table = write_table(all_results, columns, out)
    print(f"{len(names)} tests x {len(backends)} backend(s) in {time.time() - t0:.0f} s: {table}")
    print("\n".join(ln for ln in table.read_text().splitlines() if ln.startswith("- ")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
