"""tests/torch_suite/run_distributed_test.py, the runner of torch's own
DistributedTest suite: its table, its error extraction and its refusals.
(Running the suite itself takes many minutes; docs/torch-suite.md has the
results and how to run it.)"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "torch_suite" / "run_distributed_test.py"
_spec = importlib.util.spec_from_file_location("run_distributed_test", SCRIPT)
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


def test_error_line_is_the_exception_line_not_the_traceback_header():
    text = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    g()\n"
            "hpccomm.errors.OpValueError: hpccomm all_gather_coalesced (op #1): output_lists has 3 tensors, "
            "expected 1\n\nTo execute this test, run the following from the base repo dir:\n    python x.py\n")
    assert runner.error_line(text) == ("hpccomm.errors.OpValueError: hpccomm all_gather_coalesced (op #1): "
                                       "output_lists has 3 tensors, expected 1")
    chained = "RuntimeError: first\n\nDuring handling of the above exception, another exception occurred:\n" \
              "Traceback (most recent call last):\nAssertionError: \"a\" does not match \"b\"\n"
    assert runner.error_line(chained) == "AssertionError: \"a\" does not match \"b\""
    assert runner.error_line("") == ""


def test_table_lists_every_test_with_each_column_and_counts(tmp_path):
    results = {
        "gloo": {"test_a": {"status": "pass", "error": ""}, "test_b": {"status": "pass", "error": ""},
                 "test_c": {"status": "skip", "error": "CUDA is not available."}},
        "hpccomm": {"test_a": {"status": "pass", "error": ""},
                    "test_b": {"status": "skip", "error": "Only gloo backend supports x"},
                    "test_c": {"status": "skip", "error": "CUDA is not available."}},
        runner.LIFTED: {"test_b": {"status": "FAIL", "error": "ValueError: only gloo | here"}},
    }
    table = runner.write_table(results, ["gloo", "hpccomm", runner.LIFTED], tmp_path).read_text().splitlines()
    assert table[:8] == [
        "# torch DistributedTest: gloo vs hpccomm vs hpccomm, gate lifted",
        "",
        "- gloo: pass 2, skip 1",
        "- hpccomm: pass 1, skip 2",
        "- hpccomm, gate lifted: FAIL 1",
        "- gloo passes, hpccomm does not: 1",
        "- of those, skipped by the suite for hpccomm by backend name: 1; run anyway: FAIL 1",
        "",
    ]
    assert table[8:] == [
        "| test | gloo | hpccomm | hpccomm, gate lifted | error (first line) |",
        "|---|---|---|---|---|",
        "| test_a | pass | pass | - |  |",
        "| test_b | pass | skip | FAIL | hpccomm, gate lifted: ValueError: only gloo \\| here |",
        "| test_c | skip | skip | - |  |",
    ]


@pytest.mark.parametrize("reason,hardware", [
    ("Need at least 2 CUDA devices", True), ("Skipped due to small world size.", True),
    ("Test requires an exact world size of 4", True), ("no torchvision", True),
    ("Only gloo backend supports timeouts", False), ("Test requires backend hpccomm to be one of {'gloo'}", False),
    ("get_future is only supported on mpi, nccl and gloo", False),
])
def test_gate_lifting_leaves_hardware_skips_alone(reason, hardware):
    assert bool(runner.HARDWARE_SKIP.search(reason)) is hardware


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_unknown_test_names_are_refused_by_name(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("test_get_rank\ntest_no_such_thing\n")
    proc = _run("--tests-from", str(names), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "run_distributed_test: not in torch's suite: ['test_no_such_thing']" in proc.stderr


def test_a_filter_that_selects_nothing_is_an_error(tmp_path):
    proc = _run("-k", "no_test_has_this_in_its_name", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "run_distributed_test: no test selected" in proc.stderr


def test_list_prints_the_suites_test_names():
    proc = _run("--list", "-k", "test_all_gather_coalesced")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["test_all_gather_coalesced_complex", "test_all_gather_coalesced_full_group",
                                   "test_all_gather_coalesced_group", "test_all_gather_coalesced_simple",
                                   "test_all_gather_coalesced_with_empty"]


def test_the_worker_refuses_to_start_outside_a_launcher(tmp_path):
    env_free = {k: v for k, v in __import__("os").environ.items()
                if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--worker", "--backend", "gloo", "--tests", "x",
                           "--indices", "0", "--results", str(tmp_path), "--scratch", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env_free)
    assert proc.returncode == 1
    assert "run_distributed_test --worker: start it under mpirun (no launcher rank variable found)" in proc.stderr
