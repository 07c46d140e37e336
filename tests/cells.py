"""What CI runs: the test suites (named sets of test files) and the cells of the
matrix (tests/matrix.sh), each with its torch, its MPI family and what runs in
each of its phases.  docs/testing.md says why each cell runs what it runs.

Standard library only: tests/matrix.sh reads it with the machine's python3
before any venv exists, and fails before installing anything when a test file
is in no suite or a suite is run by no cell (``check``).

    python3 tests/cells.py files SUITE...    # the suites' test files, from the repository root
    python3 tests/cells.py files-at N SUITE... # those of the suites that run at world size N
    python3 tests/cells.py suites            # every suite's name
    python3 tests/cells.py cells             # the matrix's cells, in the order it runs them
    python3 tests/cells.py spec CELL         # torch|family|sizes|MPI suites|no-MPI suites|marker expression
    python3 tests/cells.py one-size N...     # the size a run at sizes N... runs its one_size tests at
    python3 tests/cells.py check             # what no cell runs (exit 1 if anything)
    python3 tests/cells.py report DIR CELL.. # where a matrix run's time went (tests/matrix.sh prints it)

A phase of a cell runs the files of its suites: the no-MPI phase their tests
without ``@pytest.mark.mpi``, the MPI phase their MPI tests under the launcher
at each of the cell's sizes, or at the sizes an MPI suite names after an ``@``
(``"large@2"``: at 2 ranks only; a cell other than the primary one, and sizes
that include the cell's one size).  Two markers narrow that (tests/run.sh):

- ``one_size``: an MPI test whose outcome cannot depend on the world size runs
  at one size of the cell (:func:`one_size_of`), not at each;
- ``one_cell``: a test whose outcome cannot depend on what a cell other than the
  primary one changes (torch's version, the MPI family, hpccomm installed from
  its wheel) runs in the primary cell only.

And one for the MPI families without ULFM: ``ulfm_only``, a fault-tolerance job whose
check under such a family (every rank refused at init) another job of its file
makes at the same world size, runs only in the Open MPI cells.

tests/test_cells.py checks, test by test, that every test runs somewhere and
that the primary cell runs every one (every MPI test without ``one_size`` at
sizes 1, 2, 3 and 4).
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: Named sets of test files (``HPCCOMM_TEST_SUITES="ops training"`` in tests/run.sh); every test file
#: (tests/test_*.py, tests/installed/test_*.py) is in exactly one.
SUITES = {
    "ops": ["test_reduce.py", "test_gather.py", "test_scatter.py", "test_alltoall.py", "test_p2p.py",
            "test_objects.py", "test_groups.py", "test_async.py", "test_async_stress.py", "test_errors.py",
            "test_debug.py", "test_mismatch.py", "test_properties.py", "test_routes.py", "test_composed.py"],
    # a message past 2**31 elements (MPI's int counts): about 2 GiB per rank, the slowest MPI test
    "large": ["test_large.py"],
    "training": ["test_ddp.py", "test_fsdp.py", "test_mesh.py"],
    "failures": ["test_failures.py", "test_flight.py"],
    "exit": ["test_exit.py", "test_soak.py"],
    "init": ["test_init.py", "test_host.py"],
    # fault tolerance (ULFM): real jobs started by the tests, Open MPI only; under MPICH and Intel MPI the
    # same jobs check the refusal at init
    "ft": ["test_fault_tolerance.py"],
    "launch": ["test_launcher.py", "test_cli.py", "test_examples.py"],
    "docs": ["test_docs.py"],
    "horovod": ["test_horovod.py", "test_horovod_examples.py"],
    "bench": ["test_bench.py"],
    # the sbatch templates: rendered here, submitted to a two-node SLURM in test_slurm
    "tools": ["test_jobs.py", "test_slurm.py"],
    # the runner of torch's own distributed tests (tests/torch_suite)
    "torchsuite": ["test_torch_suite_runner.py"],
    "unit": ["test_unit.py", "test_unit_compile.py", "test_layers.py", "test_cells.py", "test_declarations.py"],
    "gpu": ["test_gpu_unit.py", "test_cuda.py", "test_gpu_contracts.py"],
    # hpccomm installed from its wheel, with the training frameworks: only in the 2.13-wheel cell, which makes
    # the venv they need (tests/installed/conftest.py: a run that names no suite does not collect them)
    "frameworks": ["installed/test_frameworks.py"],
    "wheel": ["installed/test_wheel.py"],
}

#: The suites that need the 2.13-wheel cell's venv.
INSTALLED = ("frameworks", "wheel")
#: Every other suite: the whole suite, as the primary cell runs it.
EVERY = tuple(s for s in SUITES if s not in INSTALLED)
#: The MPI phase of the 2.13-wheel cell: the suites whose tests reach more of the installed package than
#: its modules (its entry points, console script, examples, templates, docs); a module the wheel lacks
#: fails tests/installed/test_wheel.py, which compares the wheel with the sdist and imports it on every rank.
WHEEL_MPI = tuple(s for s in EVERY if s not in ("ops", "large", "training", "gpu", "unit"))


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: a venv with ``torch`` and the MPI ``family`` (the
    name of hpccomm's pip extra), and what tests/run.sh runs there."""

    name: str
    torch: str
    family: str
    #: the world sizes of the MPI phase
    sizes: tuple
    #: the suites of the MPI phase (their ``@pytest.mark.mpi`` tests), each at every size of the cell or at
    #: the sizes it names after an ``@`` (``"training@2,3"``)
    mpi: tuple
    #: the suites of the no-MPI phase (unit tests and the tests that start their own jobs)
    unit: tuple
    #: the primary cell runs the whole suite, ``one_cell`` tests included
    primary: bool = False

    @property
    def ulfm(self) -> bool:
        """Whether its MPI family can survive a lost rank (Open MPI's ULFM): else it leaves ``ulfm_only`` out."""
        return self.family == "openmpi"

    @property
    def mark(self) -> str:
        """The marker expression tests/run.sh adds to both phases."""
        parts = ([] if self.primary else ["not one_cell"]) + ([] if self.ulfm else ["not ulfm_only"])
        return " and ".join(parts)


#: The cells, in the order tests/matrix.sh runs them (one torch version after the other: the disk holds
#: one CUDA torch at a time).  Why each runs what it runs: docs/testing.md, "Cells".
CELLS = [
    Cell("2.13-openmpi", "2.13.0", "openmpi", (1, 2, 3, 4), EVERY, EVERY, primary=True),
    Cell("2.13-wheel", "2.13.0", "openmpi", (2,), WHEEL_MPI + INSTALLED, INSTALLED),
    Cell("2.15-openmpi", "2.15.0", "openmpi", (2,), ("gpu", "horovod"),
         ("unit", "gpu", "exit", "ft", "horovod", "bench", "torchsuite")),
    Cell("2.15-mpich", "2.15.0", "mpich", (1, 2, 3, 4), ("ops", "large@2", "training@2,3"),
         ("init", "launch", "tools", "ft")),
    Cell("2.15-impi", "2.15.0", "impi", (2, 3), ("ops", "large@2", "training@2"), ("failures", "ft")),
    Cell("2.14-openmpi", "2.14.1", "openmpi", (3,), ("ops", "training"), ()),
]
BY_NAME = {c.name: c for c in CELLS}


def one_size_of(sizes) -> int:
    """The world size a run at ``sizes`` runs its ``one_size`` tests at: 2 where
    the run has it (two ranks: the smallest world where a rank has a peer), else
    its first size."""
    sizes = [int(n) for n in sizes]
    return 2 if 2 in sizes else sizes[0]


def primary_only_but(values, keep) -> list:
    """pytest parameters for a test that starts its own job per value (a world
    size, say): the primary cell runs every value, the matrix's other cells
    those in ``keep`` (the rest are marked ``one_cell``).  For a test another
    cell runs for what that cell changes (the MPI family, torch's version) where
    the values left to the primary cell check nothing that change could alter
    that the kept ones do not check.

    Args:
        values: the parameters.
        keep: the values the other cells run too.

    Raises:
        ValueError: a value of ``keep`` is not one of ``values``.

    A tuple value is one case of several argument names (``parametrize("a, b", ...)``).

    Example: ``@pytest.mark.parametrize("n", primary_only_but([1, 2, 3, 4], keep=(1, 3)))``.
    """
    import pytest

    unknown = [k for k in keep if k not in values]
    if unknown:
        raise ValueError(f"primary_only_but: keep={unknown} names no value of {list(values)}")
    return [v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.one_cell)
            for v in values]


def split(entry: str):
    """An MPI suite of a cell and the sizes it runs at: ``"large@2,3"`` ->
    ``("large", (2, 3))``; ``"ops"`` -> ``("ops", None)`` (every size of the
    cell).

    Raises:
        ValueError: a size that is not a whole number.
    """
    name, _, sizes = entry.partition("@")
    if not sizes:
        return name, None
    try:
        return name, tuple(int(n) for n in sizes.split(","))
    except ValueError:
        raise ValueError(f"{entry!r}: the sizes after '@' are whole numbers separated by commas") from None


def sizes_of(entry: str, cell_sizes) -> tuple:
    """The world sizes an MPI suite entry of a cell with ``cell_sizes`` runs at."""
    sizes = split(entry)[1]
    return tuple(int(n) for n in cell_sizes) if sizes is None else sizes


def files_at(n: int, entries) -> list:
    """The test files of the MPI suite entries (``"ops"``, ``"large@2"``) that run at world size ``n``
    (an entry without ``@`` runs at every size)."""
    parsed = [split(e) for e in entries]
    return suite_files([name for name, sizes in parsed if sizes is None or int(n) in sizes])


def suite_files(names) -> list:
    """The test files (paths from the repository root) of the named suites
    (an MPI suite entry's ``@`` sizes are ignored)."""
    names = [split(n)[0] for n in names]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise KeyError(f"no test suite {', '.join(map(repr, unknown))} (suites: {', '.join(SUITES)})")
    return [f"tests/{f}" for n in names for f in SUITES[n]]


def files_on_disk() -> list:
    """Every test file of the suite on disk (tests/test_*.py, tests/installed/test_*.py), from tests/."""
    return sorted(str(p.relative_to(TESTS)) for pattern in ("test_*.py", "installed/test_*.py")
                  for p in TESTS.glob(pattern))


def check(suites=None, cells=None, on_disk=None) -> list:
    """What is wrong with the plan (default: :data:`SUITES`, :data:`CELLS` and
    the test files on disk): a test file in no suite or in two, a suite naming a
    file that is not there, a suite no cell runs, a primary cell that leaves a
    suite out.  Empty when every test file is run by some cell."""
    suites = SUITES if suites is None else suites
    cells = CELLS if cells is None else cells
    on_disk = files_on_disk() if on_disk is None else on_disk
    every = [s for s in suites if s not in INSTALLED]
    problems = []
    listed = [f for files in suites.values() for f in files]
    for f in on_disk:
        if f not in listed:
            problems.append(f"tests/{f} is in no suite of tests/cells.py SUITES: no cell runs it")
    for f in sorted({f for f in listed if listed.count(f) > 1}):
        problems.append(f"tests/{f} is in more than one suite")
    for f in listed:
        if f not in on_disk:
            problems.append(f"tests/{f} (in SUITES) does not exist")
    primaries = [c for c in cells if c.primary]
    if len(primaries) != 1:
        problems.append(f"{len(primaries)} primary cells: there must be one, which runs the whole suite")
    for c in primaries:
        left = [s for s in every if s not in c.mpi or s not in c.unit]
        if left or sorted(c.sizes) != [1, 2, 3, 4]:
            problems.append(f"the primary cell {c.name} runs suites {sorted(set(c.mpi) & set(c.unit))} at sizes "
                            f"{list(c.sizes)}: it runs the whole suite at 1, 2, 3 and 4")
    for name in suites:
        if not any(name in [split(e)[0] for e in c.mpi] or name in c.unit for c in cells):
            problems.append(f"no cell runs suite {name!r}")
    for c in cells:
        for s in c.unit:
            if s not in suites:
                problems.append(f"cell {c.name} names suite {s!r}, which is not in SUITES")
        for e in c.mpi:
            try:
                name, sizes = split(e)
            except ValueError as exc:
                problems.append(f"cell {c.name}: {exc}")
                continue
            if name not in suites:
                problems.append(f"cell {c.name} names suite {name!r}, which is not in SUITES")
            if sizes is None:
                continue
            if c.primary:
                problems.append(f"the primary cell {c.name} narrows {e!r}: it runs every suite at every size")
            elif not set(sizes) <= set(c.sizes) or one_size_of(c.sizes) not in sizes:
                problems.append(f"cell {c.name}: {e!r} must name sizes of the cell ({list(c.sizes)}) that include "
                                f"its one size {one_size_of(c.sizes)} (where its one_size tests run)")
    return problems


def plan(tests, cells=None) -> dict:
    """Where each test runs: ``tests`` maps a test id (``tests/test_x.py::test_y``)
    to its markers (a set of names: ``mpi``, ``one_size``, ``one_cell``, ``ulfm_only``);
    returns test id -> set of (cell, phase), phase ``unit`` or ``n<size>``."""
    where = {t: set() for t in tests}
    for c in CELLS if cells is None else cells:
        unit_files = set(suite_files(c.unit))
        mpi_sizes = {f: sizes_of(e, c.sizes) for e in c.mpi for f in suite_files([e])}  # file -> its sizes
        for t, marks in tests.items():
            path = t.split("::")[0]
            if ("one_cell" in marks and not c.primary) or ("ulfm_only" in marks and not c.ulfm):
                continue
            if "mpi" not in marks and path in unit_files:
                where[t].add((c.name, "unit"))
            elif "mpi" in marks and path in mpi_sizes:
                sizes = [one_size_of(c.sizes)] if "one_size" in marks else mpi_sizes[path]
                where[t].update((c.name, f"n{n}") for n in sizes)
    return where


# ---------------------------------------------------------------------------
# the time report of a matrix run
# ---------------------------------------------------------------------------

def _phases(folder: Path) -> dict:
    """phase -> (seconds, result) from the ``phases.tsv`` tests/run.sh and tests/matrix.sh write."""
    out = {}
    path = folder / "phases.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 2:
                out[parts[0]] = (float(parts[1]), parts[2] if len(parts) > 2 else "")
    return out


def _tests(folder: Path):
    """(seconds, phase, test id) of every test in the JUnit reports of a cell's phases."""
    for xml in sorted(folder.glob("*.xml")):
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError:
            continue
        for case in root.iter("testcase"):
            path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            cls = case.get("classname", "").rsplit(".", 1)[-1]
            name = f"{cls}::{case.get('name')}" if cls[:1].isupper() else case.get("name")
            yield float(case.get("time") or 0), xml.stem, f"{path}::{name}"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60} min {s % 60:02d} s"


def report(folder, cells) -> str:
    """Where a matrix run's time went: per cell its result and the seconds of
    each phase (install, the no-MPI phase, the MPI phase at each size, and
    the rest: venv removal, the report), then the ten slowest tests of the run."""
    folder = Path(folder)
    rows, slow, total = [], [], 0.0
    sizes = sorted({n for c in cells if c in BY_NAME for n in BY_NAME[c].sizes})
    head = ["cell", "result", "install", "no-MPI"] + [f"n{n}" for n in sizes] + ["other", "total"]
    for name in cells:
        ph = _phases(folder / name)
        took, result = ph.get("cell", (0.0, "?"))
        total += took
        parts = [ph.get("install", (None,))[0], ph.get("unit", (None,))[0]] + \
            [ph.get(f"n{n}", (None,))[0] for n in sizes]
        other = took - sum(p for p in parts if p is not None)
        rows.append([name, result] + ["-" if p is None else f"{p:.0f}" for p in parts] + [f"{other:.0f}",
                                                                                          f"{took:.0f}"])
        slow += [(s, name, phase, t) for s, phase, t in _tests(folder / name)]
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda r: "  " + "  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w)  # noqa: E731
                                    for i, (x, w) in enumerate(zip(r, widths)))
    lines = [f"==== where the time went: {total:.0f} s ({_clock(total)}), seconds per cell and phase",
             fmt(head)] + [fmt(r) for r in rows]
    lines.append("==== the ten slowest tests (setup, call and teardown; seconds)")
    for s, name, phase, t in sorted(slow, reverse=True)[:10]:
        lines.append(f"  {s:6.1f}  {name:<13} {phase:<5} {t}")
    return "\n".join(lines)


def main(argv) -> int:
    if argv[:1] in (["files"], ["files-at"]):
        try:
            print(" ".join(suite_files(argv[1:]) if argv[0] == "files" else files_at(int(argv[1]), argv[2:])))
        except (KeyError, ValueError, IndexError) as exc:
            print(f"tests/cells.py: {exc.args[0] if exc.args else exc}", file=sys.stderr)
            return 2
    elif argv == ["suites"]:
        print(" ".join(SUITES))
    elif argv[:1] == ["one-size"] and len(argv) > 1:
        print(one_size_of(argv[1:]))
    elif argv == ["cells"]:
        print(" ".join(c.name for c in CELLS))
    elif argv[:1] == ["spec"] and len(argv) == 2:
        c = BY_NAME.get(argv[1])
        if c is None:
            print(f"tests/cells.py: no cell {argv[1]!r} (cells: {', '.join(BY_NAME)})", file=sys.stderr)
            return 2
        print("|".join([c.torch, c.family, " ".join(map(str, c.sizes)), " ".join(c.mpi), " ".join(c.unit),
                        c.mark]))
    elif argv == ["check"]:
        problems = check()
        for p in problems:
            print(f"!! {p}", file=sys.stderr)
        return 1 if problems else 0
    elif argv[:1] == ["report"] and len(argv) >= 2:
        print(report(argv[1], argv[2:] or [c.name for c in CELLS]))
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
