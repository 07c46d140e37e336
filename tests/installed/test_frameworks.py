"""The training frameworks on hpccomm (docs/frameworks.md): Lightning's
Trainer, Accelerate and the transformers Trainer, each launched as a user
would (``mpirun -n N python -m hpccomm.examples.train_<framework>``) at 2 and
3 ranks, and the errors the page says a user meets, run as the page shows them.

Each example checks, on every rank, that the backend in use is hpccomm (the
default group's and DDP's), that the framework counts the job's processes,
and that the trained weights equal a one-process run on the world's batches
(each rank computes that reference itself) and are identical on every rank;
the job exits non-zero on every rank otherwise.  These tests check the exit
status and rank 0's verdict.

Needs the ``frameworks`` extra (tests/installed/conftest.py says where these
tests run); the versions installed must be the ones setup.cfg pins.
"""
from __future__ import annotations

import importlib.metadata
import re
import shlex
from pathlib import Path

import pytest
from test_examples import launch

DOCS = Path(__file__).resolve().parents[2] / "docs" / "frameworks.md"
EXAMPLES = {"train_lightning": "lightning", "train_accelerate": "accelerate", "train_transformers": "transformers"}
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
MARKER = "# with frameworks:"


def pinned() -> dict:
    """``{package: version}`` of the ``frameworks`` extra, from hpccomm's installed metadata."""
    found = {}
    for req in importlib.metadata.requires("hpccomm") or []:
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^;\s]+)\s*;.*extra\s*==\s*['\"]frameworks['\"]", req)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_installed_frameworks_are_the_pinned_versions():
    pins = pinned()
    assert set(pins) == set(EXAMPLES.values()), pins
    installed = {name: importlib.metadata.version(name) for name in pins}
    assert installed == pins, f"installed {installed}, setup.cfg's frameworks extra pins {pins}"


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_framework_trains_on_hpccomm(name, n):
    framework = EXAMPLES[name]
    rc, rank0, log = launch(n, "-m", f"hpccomm.examples.{name}", HF_HUB_OFFLINE="1")
    assert rc == 0, log
    text = "\n".join(rank0)
    version = importlib.metadata.version(framework)
    assert re.search(rf"^{name}: {framework} {re.escape(version)} on {n} rank\(s\), backend hpccomm; weights "
                     r"within \S+ of the one-process reference, identical on every rank \(sha256 [0-9a-f]+\)$",
                     text, re.M), log
    assert f"{name}: all checks passed on {n} rank(s)" in rank0, log


def page_blocks():
    """``(line, ranks, must_fail, text, code)`` of every block of docs/frameworks.md
    that starts with ``# with frameworks: mpirun -n N``, then ``# fails with: TEXT``
    (the program must fail, printing TEXT) or ``# prints: TEXT``."""
    page = DOCS.read_text()
    found = []
    for m in FENCE.finditer(page):
        lines = m.group(1).splitlines()
        if not lines or not lines[0].startswith(MARKER):
            continue
        words = shlex.split(lines[0][len(MARKER):])
        assert words[:2] == ["mpirun", "-n"] and len(words) == 3, f"malformed marker {lines[0]!r}"
        kind, _, text = lines[1].partition(":")
        assert kind in ("# fails with", "# prints") and text.strip(), f"no '# fails with:' or '# prints:' after " \
                                                                      f"{lines[0]!r}"
        found.append((page.count("\n", 0, m.start()) + 2, int(words[2]), kind == "# fails with", text.strip(),
                      m.group(1)))
    return found


BLOCKS = page_blocks()


def test_page_shows_each_framework_failing_without_help():
    """The page runs (below) an error or a silent fallback for each framework that needs the user's help."""
    codes = " ".join(b[4] for b in BLOCKS)
    assert len(BLOCKS) >= 5, BLOCKS
    for name in ("accelerate", "transformers"):
        assert f"from {name} import" in codes, name


@pytest.mark.slow
@pytest.mark.parametrize("line,ranks,must_fail,text,code", BLOCKS, ids=[f"frameworks.md:{b[0]}" for b in BLOCKS])
def test_page_block(tmp_path, line, ranks, must_fail, text, code):
    script = tmp_path / f"frameworks_{line}.py"
    script.write_text(code)
    rc, _, log = launch(ranks, str(script), HF_HUB_OFFLINE="1")
    where = f"docs/frameworks.md line {line}:\n{log}"
    assert (rc != 0) if must_fail else (rc == 0), where
    assert text in " ".join(log.split()), f"expected {text!r} in the output of " + where
