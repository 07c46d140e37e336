"""The CI plan (tests/cells.py): every test runs in some cell, and the primary
cell runs every one, each MPI test at sizes 1, 2, 3 and 4 unless it is marked
``one_size``.  No MPI: pytest collects the suite in a subprocess and each
test's markers are read from there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import cells

pytestmark = pytest.mark.one_cell  # the plan is the same data in every cell

ROOT = Path(__file__).resolve().parent.parent

#: A pytest plugin that writes each collected test's id and markers (as JSON) to $CELLS_COLLECTED.
PLUGIN = """
import json, os

def pytest_collection_modifyitems(session, config, items):
    marks = {i.nodeid: sorted({m.name for m in i.iter_markers()} & {"mpi", "one_size", "one_cell", "ulfm_only"}) for i in items}
    with open(os.environ["CELLS_COLLECTED"], "w") as f:
        json.dump(marks, f)
"""


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """Test id -> set of markers, for every test of every suite (tests/installed's named, as the wheel cell does)."""
    tmp = tmp_path_factory.mktemp("collect")
    (tmp / "cells_collect.py").write_text(textwrap.dedent(PLUGIN))
    out = tmp / "collected.json"
    env = {**os.environ, "CELLS_COLLECTED": str(out),
           "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    files = cells.suite_files(cells.SUITES)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "cells_collect", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {t: set(m) for t, m in json.loads(out.read_text()).items()}
    assert len(found) > 1000, len(found)
    return found


def test_every_test_file_is_in_a_suite_that_a_cell_runs():
    assert cells.check() == []


def test_the_check_names_what_no_cell_runs():
    """The check fails on a test file in no suite, a suite that no cell runs, and a primary cell that leaves
    out part of the suite (planted plans)."""
    suites = {"ops": ["test_reduce.py"], "docs": ["test_docs.py"]}
    primary = cells.Cell("p", "2.13.0", "openmpi", (1, 2, 3, 4), ("ops", "docs"), ("ops", "docs"), primary=True)
    assert cells.check(suites, [primary], ["test_reduce.py", "test_docs.py"]) == []
    assert cells.check(suites, [primary], ["test_reduce.py", "test_docs.py", "test_new.py"]) == [
        "tests/test_new.py is in no suite of tests/cells.py SUITES: no cell runs it"]
    lazy = cells.Cell("p", "2.13.0", "openmpi", (2, 3), ("ops",), ("ops",), primary=True)
    assert cells.check(suites, [lazy], ["test_reduce.py", "test_docs.py"]) == [
        "the primary cell p runs suites ['ops'] at sizes [2, 3]: it runs the whole suite at 1, 2, 3 and 4",
        "no cell runs suite 'docs'"]
    assert "tests/test_gone.py (in SUITES) does not exist" in cells.check(
        {**suites, "x": ["test_gone.py"]}, [primary], ["test_reduce.py", "test_docs.py"])


def test_a_suite_narrowed_to_some_sizes():
    """``"large@2"`` in a cell's MPI suites: the suite's MPI tests run at 2 ranks only there (the files of
    each size and the plan say so); the check refuses sizes the cell does not run, sizes without the
    cell's one size (its one_size tests would run nowhere there) and a primary cell that narrows a suite."""
    assert cells.split("training@2,3") == ("training", (2, 3)) and cells.split("ops") == ("ops", None)
    assert cells.sizes_of("large@2", (1, 2, 3, 4)) == (2,) and cells.sizes_of("ops", ["1", "3"]) == (1, 3)
    assert cells.files_at(1, ["ops", "large@2"]) == cells.suite_files(["ops"])
    assert cells.files_at(2, ["ops", "large@2"]) == cells.suite_files(["ops", "large"])
    assert cells.suite_files(["large@2"]) == ["tests/test_large.py"]
    suites = {"ops": ["test_reduce.py"], "large": ["test_large.py"]}
    on_disk = ["test_reduce.py", "test_large.py"]
    primary = cells.Cell("p", "2.13.0", "openmpi", (1, 2, 3, 4), ("ops", "large"), ("ops", "large"), primary=True)
    other = cells.Cell("o", "2.15.0", "mpich", (1, 2, 3, 4), ("ops", "large@2"), ())
    assert cells.check(suites, [primary, other], on_disk) == []
    wrong = cells.Cell("o", "2.15.0", "mpich", (2, 3), ("ops", "large@3,4"), ())
    assert cells.check(suites, [primary, wrong], on_disk) == [
        "cell o: 'large@3,4' must name sizes of the cell ([2, 3]) that include its one size 2 (where its "
        "one_size tests run)"]
    assert cells.check(suites, [primary, cells.Cell("o", "2.15.0", "mpich", (2,), ("large@x",), ())], on_disk) == [
        "cell o: 'large@x': the sizes after '@' are whole numbers separated by commas"]
    narrowed = cells.Cell("p", "2.13.0", "openmpi", (1, 2, 3, 4), ("ops", "large@2"), ("ops", "large"), primary=True)
    assert "the primary cell p narrows 'large@2': it runs every suite at every size" in \
        cells.check(suites, [narrowed], on_disk)
    tests = {"tests/test_large.py::test_big": {"mpi"}, "tests/test_large.py::test_any_size": {"mpi", "one_size"},
             "tests/test_reduce.py::test_sum": {"mpi"}}
    where = cells.plan(tests, [primary, other])
    assert where["tests/test_large.py::test_big"] == {("p", "n1"), ("p", "n2"), ("p", "n3"), ("p", "n4"),
                                                      ("o", "n2")}
    assert where["tests/test_large.py::test_any_size"] == {("p", "n2"), ("o", "n2")}
    assert {p for c, p in where["tests/test_reduce.py::test_sum"] if c == "o"} == {"n1", "n2", "n3", "n4"}


def test_every_test_runs_somewhere_and_the_primary_cell_runs_every_one(collected):
    where = cells.plan(collected)
    primary = next(c for c in cells.CELLS if c.primary)
    installed = set(cells.suite_files(cells.INSTALLED))
    nowhere = sorted(t for t, w in where.items() if not w)
    assert not nowhere, f"{len(nowhere)} tests run in no cell, e.g. {nowhere[:5]}"
    missed = []
    for t, marks in collected.items():
        if t.split("::")[0] in installed:
            continue
        phases = {p for c, p in where[t] if c == primary.name}
        if "mpi" not in marks:
            want = {"unit"}
        elif "one_size" in marks:
            want = {f"n{cells.one_size_of(primary.sizes)}"}
        else:
            want = {"n1", "n2", "n3", "n4"}
        if not want <= phases:
            missed.append((t, sorted(want - phases)))
    assert not missed, f"the primary cell misses {len(missed)}: {missed[:5]}"


def test_one_size_marks_only_mpi_tests(collected):
    """``one_size`` chooses among world sizes: on a test without MPI it would mean nothing."""
    wrong = sorted(t for t, m in collected.items() if "one_size" in m and "mpi" not in m)
    assert not wrong, wrong


def test_the_mpich_cell_runs_the_ops_suite_at_every_size():
    """The MPI family's op layer (the mismatch checks among it) is tested at 1-4 ranks under a second family."""
    mpich = cells.BY_NAME["2.15-mpich"]
    assert "ops" in mpich.mpi and sorted(mpich.sizes) == [1, 2, 3, 4]


def test_primary_only_but_marks_the_other_values_one_cell():
    """The kept values run in every cell that runs the test, the others in the primary cell only; a tuple
    is one case of several argument names."""
    got = cells.primary_only_but([1, 2, 3], keep=(2,))
    assert got[1] == 2 and [p.values for p in (got[0], got[2])] == [(1,), (3,)]
    assert all([m.name for m in p.marks] == ["one_cell"] for p in (got[0], got[2]))
    pairs = cells.primary_only_but([("a", 1), ("b", 2)], keep=[("a", 1)])
    assert pairs[0] == ("a", 1) and pairs[1].values == ("b", 2) and pairs[1].marks[0].name == "one_cell"
    with pytest.raises(ValueError, match=r"keep=\[5\] names no value of \[1, 2, 3\]"):
        cells.primary_only_but([1, 2, 3], keep=(5,))


def test_one_size_is_2_where_a_run_has_it():
    assert [cells.one_size_of(s) for s in ([1, 2, 3, 4], [2, 3], ["3"], [4, 1])] == [2, 2, 3, 4]


def test_report_gives_each_phase_and_the_ten_slowest_tests(tmp_path):
    """The time table at the end of a matrix run, from planted phase times and JUnit reports."""
    a = tmp_path / "2.13-openmpi"
    a.mkdir()
    (a / "phases.tsv").write_text("install\t40\tok\nunit\t600\tpassed\nn1\t10\tpassed\nn2\t20\tpassed\n"
                                  "n3\t30\tpassed\nn4\t50\tpassed\ncell\t760\tpassed\n")
    cases = "".join(f'<testcase classname="tests.test_x" file="tests/test_x.py" name="test_{k}" time="{k}.5"/>'
                    for k in range(12))
    (a / "unit.xml").write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    (a / "n2.xml").write_text('<testsuites><testsuite name="pytest"><testcase classname="tests.test_y.TestZ" '
                              'file="tests/test_y.py" name="test_big[4]" time="99"/></testsuite></testsuites>')
    b = tmp_path / "2.14-openmpi"
    b.mkdir()
    (b / "phases.tsv").write_text("install\t70\tok\nn2\t15\tpassed\nn3\t16\tFAILED\ncell\t105\tFAILED\n")
    text = cells.report(tmp_path, ["2.13-openmpi", "2.14-openmpi"])
    lines = text.splitlines()
    assert lines[0] == "==== where the time went: 865 s (14 min 25 s), seconds per cell and phase", text
    assert lines[1].split() == ["cell", "result", "install", "no-MPI", "n1", "n2", "n3", "n4", "other", "total"]
    assert lines[2].split() == ["2.13-openmpi", "passed", "40", "600", "10", "20", "30", "50", "10", "760"]
    assert lines[3].split() == ["2.14-openmpi", "FAILED", "70", "-", "-", "15", "16", "-", "4", "105"]
    assert lines[4] == "==== the ten slowest tests (setup, call and teardown; seconds)"
    slowest = [x.split() for x in lines[5:]]
    assert len(slowest) == 10
    assert slowest[0] == ["99.0", "2.13-openmpi", "n2", "tests/test_y.py::TestZ::test_big[4]"]
    assert [x[3] for x in slowest[1:]] == [f"tests/test_x.py::test_{k}" for k in range(11, 2, -1)]
