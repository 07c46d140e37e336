"""The example programs (hpccomm/examples), each launched as a user would:
``mpirun -n N python -m hpccomm.examples.<name>``, from a plain pytest run.

Every launch runs under coreutils ``timeout`` (and a subprocess timeout
outside it), with rank-tagged output, so a hang becomes a failure with a
log.  An example checks its own result and exits non-zero on every rank when
it is wrong; these tests check the exit status and what rank 0 printed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cells import primary_only_but
from mpilaunch import MPI_ERROR_TEXT, require

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 180  # seconds per launch: torch's start-up on every rank of a loaded 2-core machine
TUTORIAL = ["p2p_blocking", "p2p_nonblocking", "allreduce_group", "ring_allreduce", "dist_sgd"]
BAD_STDERR = re.compile(MPI_ERROR_TEXT + r"|Traceback|Segmentation|core dumped|exited on signal", re.IGNORECASE)


def launch(n: int, *python_args: str, **env):
    """``mpirun -n n python *python_args`` with the MPI family's launcher (no
    MPI, SLURM or HPCCOMM_* variables of this process; this checkout first on
    the path; the variables ``env`` set): (exit status, rank 0's stdout lines,
    all output)."""
    mpi = require()
    cmd = ["timeout", "--kill-after=10", str(TIMEOUT - 15), *mpi.argv(n, sys.executable, *python_args, tag=True)]
    proc = subprocess.Popen(cmd, env=mpi.env(**env), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpirun and its ranks: the session this test started
        out, err = proc.communicate()
        pytest.fail(f"timed out after {TIMEOUT} s: {' '.join(cmd)}\n{out[-4000:]}\n{err[-4000:]}")
    rank0 = mpi.lines_of(0, out)
    log = f"$ {' '.join(cmd)}\nexit status {proc.returncode}\n--- stdout\n{out[-6000:]}\n--- stderr\n{err[-6000:]}"
    bad = [line for line in err.splitlines() if BAD_STDERR.search(line)]
    assert not bad or proc.returncode != 0, "error text on stderr of a successful run:\n" + log
    return proc.returncode, rank0, log


#: besides the verdict line, what rank 0 must print
EXPECTED = {
    "allreduce_group": "sum over the world of rank + 1: 3.0 (expected 3.0)",
    "ring_allreduce": "first values [0.0, 3.0, 6.0, 9.0], expected [0.0, 3.0, 6.0, 9.0]",
    "dist_sgd": "weights identical on all 2 rank(s)",
}


# Outside the primary cell two of them: the MPI family's part of the others is the op layer's (the ops suite,
# at 1-4 ranks in that cell) and the launch's (test_launcher's real jobs); dist_sgd trains with torch.
@pytest.mark.parametrize("name", primary_only_but(TUTORIAL, keep=("p2p_nonblocking", "dist_sgd")))
def test_tutorial_example(name):
    rc, rank0, log = launch(2, "-m", f"hpccomm.examples.{name}")
    assert rc == 0, log
    assert f"{name}: all checks passed on 2 rank(s)" in rank0, log
    if name in EXPECTED:
        assert any(EXPECTED[name] in line for line in rank0), log


def _step_lines(rank0, backend, steps):
    """The step numbers of ``backend``'s progress lines (each with a loss and samples/s)."""
    pattern = rf"^{backend} +\[[#.]+\] step +(\d+)/{steps} +loss \d+\.\d+ +[\d,]+ samples/s$"
    return [m.group(1) for m in (re.search(pattern, line) for line in rank0) if m]


def test_train_ddp_4_ranks():
    """The README's job, few steps: per-step loss and samples/s lines, the
    identical-weights verdict, exit status 0."""
    rc, rank0, log = launch(4, "-m", "hpccomm.examples.train_ddp", "--steps", "6", "--hidden", "64",
                            "--progress", "lines", "--print-every", "2")
    assert rc == 0, log
    assert _step_lines(rank0, "hpccomm", 6) == ["1", "2", "4", "6"], log
    assert "hpccomm: all 4 ranks hold identical weights (sha256" in "\n".join(rank0), log


@pytest.mark.one_cell  # the example's --bench and its weights compared; the MPI family's part is test_train_ddp_4_ranks
def test_train_ddp_bench_both_backends():
    """2 ranks, --bench --backend both: both trainings show their progress,
    agree across ranks, and the step times and their ratio are printed."""
    rc, rank0, log = launch(2, "-m", "hpccomm.examples.train_ddp", "--steps", "5", "--warmup", "2",
                            "--hidden", "64", "--bench", "--backend", "both", "--progress", "lines",
                            "--print-every", "2")
    assert rc == 0, log
    text = "\n".join(rank0)
    for backend in ("hpccomm", "gloo"):
        assert _step_lines(rank0, backend, 5) == ["1", "2", "4", "5"], log
    for backend in ("hpccomm", "gloo"):
        assert f"{backend}: all 2 ranks hold identical weights" in text, log
        assert re.search(rf"bench {backend}: mean step time [\d.]+ ms", text), log
    assert re.search(r"bench: hpccomm/gloo step time ratio [\d.]+ \(2 ranks", text), log
    # the same seeds and data on both backends: the same weights (two-rank sums are exact)
    digests = re.findall(r"identical weights \(sha256 ([0-9a-f]+)\)", text)
    assert len(digests) == 2 and digests[0] == digests[1], log


def test_train_ddp_progress_in_a_log_is_whole_lines():
    """The default progress (``--progress auto``) when the job's output goes
    to a pipe, as a batch job's goes to its log: a plain line every
    ``--print-every`` steps, no carriage return.  Open MPI's mpirun gives each
    rank a pseudo-terminal whatever its own output is (the rank's isatty() is
    True here), so the rank must look at mpirun's output to get this right."""
    rc, rank0, log = launch(2, "-m", "hpccomm.examples.train_ddp", "--steps", "6", "--hidden", "64",
                            "--print-every", "2")
    assert rc == 0, log
    assert _step_lines(rank0, "hpccomm", 6) == ["1", "2", "4", "6"], log
    assert not any("\r" in line for line in rank0), log


def test_train_ddp_progress_on_a_terminal_updates_one_line():
    """The same job with mpirun's output on a terminal (a pseudo-terminal this
    test holds): under Open MPI, rank 0 shows one line updated in place, a
    carriage return before every step's report.  Hydra (MPICH, Intel MPI)
    gives its ranks pipes even then, so there the report is whole lines."""
    import pty
    import select
    import termios
    import time

    mpi = require()
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # no newline -> CR LF translation: a carriage return seen is the program's
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    cmd = ["timeout", "--kill-after=10", str(TIMEOUT - 15),
           *mpi.argv(2, sys.executable, "-m", "hpccomm.examples.train_ddp", "--steps", "6", "--hidden", "64",
                     "--print-every", "2")]
    proc = subprocess.Popen(cmd, env=mpi.env(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=subprocess.PIPE, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + TIMEOUT
    while True:
        if not select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.killpg(proc.pid, signal.SIGKILL)  # a process of the job kept the terminal open past the timeout
            pytest.fail(f"the terminal was still open after {TIMEOUT} s: {' '.join(cmd)}\n{b''.join(chunks)[-4000:]!r}")
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    err = proc.communicate(timeout=TIMEOUT)[1].decode(errors="replace")
    out = b"".join(chunks).decode(errors="replace")
    log = f"$ {' '.join(cmd)}\nexit status {proc.returncode}\n--- terminal\n{out[-6000:]!r}\n--- stderr\n{err[-4000:]}"
    assert proc.returncode == 0, log
    updates = re.findall(r"\rhpccomm +\[[#.]+\] step +(\d+)/6 ", out)
    lines = re.findall(r"(?m)^hpccomm +\[[#.]+\] step +(\d+)/6 .*samples/s$", out)
    if mpi.family == "openmpi":
        assert updates == ["1", "2", "3", "4", "5", "6"] and not lines, log
    else:
        assert lines == ["1", "2", "4", "6"] and not updates, log
    assert "hpccomm: all 2 ranks hold identical weights" in out, log


def test_failed_check_fails_every_rank(tmp_path):
    """The examples' verdict: a check that fails on one rank makes every
    rank exit non-zero (so mpirun's status says so)."""
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent('''
        import sys
        import torch.distributed as dist
        from hpccomm.examples._common import Checks, start
        rank, size = start()
        checks = Checks()
        checks.expect(rank != size - 1, "planted failure on the last rank")
        code = checks.finish("planted")
        print(f"exit code {code}", flush=True)
        sys.exit(code)
    '''))
    rc, rank0, log = launch(2, str(script))
    assert rc != 0, log
    assert "exit code 1" in rank0 and "planted: 1 check(s) FAILED (see the WRONG lines above)" in rank0, log
