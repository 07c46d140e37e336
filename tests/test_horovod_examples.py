"""Horovod's PyTorch examples on hpccomm.horovod, compared with the same training on DDP.

Each test is one ``mpirun -n N`` job (from a plain pytest run, under
``timeout``) of tests/horovod_examples/runner.py: it runs the example with
its ``import horovod.torch as hvd`` line rewritten to ``import
hpccomm.horovod as hvd``, then the same training written for
``DistributedDataParallel`` on hpccomm, and compares the weights both leave
(the tolerances are in CASES; the runner prints the largest differences).

Which example files: Horovod's examples are in no package on PyPI (the
horovod sdist leaves examples/ out) and CI reaches PyPI only, so CI runs the
equivalents in tests/horovod_examples/ (labelled as such in their first
lines).  Given a checkout of Horovod's examples, ``HPCCOMM_HOROVOD_EXAMPLES=
<horovod>/examples/pytorch`` adds the same jobs on Horovod's own
pytorch_synthetic_benchmark.py and pytorch_mnist.py (they need torchvision on
the path; see docs/horovod.md for how that was done here).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "tests" / "horovod_examples"
TIMEOUT = 240
UPSTREAM = os.environ.get("HPCCOMM_HOROVOD_EXAMPLES", "")

SYNTHETIC = ["--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2"]
MNIST = ["--epochs", "2", "--batch-size", "20", "--test-batch-size", "30", "--log-interval", "3"]
#: (example, ranks, extra script arguments, rtol, atol): the DDP twin must agree within rtol/atol
CASES = [
    ("synthetic_benchmark", 2, [], 1e-4, 1e-6),
    ("synthetic_benchmark", 3, ["--fp16-allreduce"], 1e-2, 1e-4),  # fp16 rounds differently in DDP's hook
    ("synthetic_benchmark", 4, [], 1e-4, 1e-6),
    ("mnist", 2, [], 1e-4, 1e-6),
    ("mnist", 3, [], 1e-4, 1e-6),
    ("mnist", 4, ["--gradient-predivide-factor", "2.0"], 1e-4, 1e-6),
]


def _env(tmp_path, upstream: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_", "HPCCOMM_", "MASTER_", "RANK",
                                "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_", "HOROVOD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               OMPI_MCA_btl="^ofi",  # tests/mpilaunch.py SETTINGS says why
               PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1",
               HOME=str(tmp_path),  # Horovod's MNIST takes a FileLock in ~
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if upstream:
        env.update(HOROVOD_EXAMPLE_MODELS="torchvision.models", HOROVOD_EXAMPLE_DATA="torchvision")
    return env


def _run(tmp_path, n, script, twin, script_args, rtol, atol, upstream, mnist):
    cmd = ["timeout", "--kill-after=10", str(TIMEOUT - 15), "mpirun", "-n", str(n), "--oversubscribe",
           "--output", "tag", sys.executable, str(HERE / "runner.py"), "--script", str(script), "--twin", str(twin),
           "--out", str(tmp_path / "out"), "--rtol", str(rtol), "--atol", str(atol)]
    if upstream:
        cmd.append("--torchvision")
    if mnist:
        cmd += ["--make-mnist", str(tmp_path / "data")]
        script_args = [*script_args, "--data-dir", str(tmp_path / "data")]
    cmd += ["--", *script_args]
    proc = subprocess.Popen(cmd, env=_env(tmp_path, upstream), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpirun and its ranks: the session this test started
        out, err = proc.communicate()
        pytest.fail(f"timed out after {TIMEOUT} s: {' '.join(cmd)}\n{out[-4000:]}\n{err[-4000:]}")
    rank0 = [m.group(1) for m in re.finditer(r"^\[\d+,0\]<stdout>: ?(.*)$", out, re.MULTILINE)]
    log = f"$ {' '.join(cmd)}\nexit status {proc.returncode}\n--- stdout\n{out[-6000:]}\n--- stderr\n{err[-6000:]}"
    return proc.returncode, rank0, log


def _check_compare(rank0, n, log):
    line = next((x for x in rank0 if x.startswith("COMPARE ")), "")
    assert line, log
    assert f"ranks={n} " in line and "identical_across_ranks=True" in line, log
    print(line)
    return line


def _cases(upstream: bool):
    out = []
    for example, n, extra, rtol, atol in CASES:
        # Outside the primary cell (torch 2.15: what the examples compute depends on torch) the cases with
        # an option of their own run; the plain ones repeat an example at another size, which the op tests
        # cover at every size.
        marks = [pytest.mark.slow] + ([] if extra else [pytest.mark.one_cell])
        out.append(pytest.param(example, n, extra, rtol, atol, upstream, id=f"{example}-{n}ranks", marks=marks))
    return out


def _paths(example: str, upstream: bool):
    name = {"synthetic_benchmark": "pytorch_synthetic_benchmark.py", "mnist": "pytorch_mnist.py"}[example]
    script = Path(UPSTREAM) / name if upstream else HERE / name
    return script, HERE / f"ddp_{example}.py"


def _run_case(tmp_path, example, n, extra, rtol, atol, upstream):
    script, twin = _paths(example, upstream)
    mnist = example == "mnist"
    args = list(MNIST if mnist else SYNTHETIC) + extra
    if not mnist and upstream:
        args += ["--model", "squeezenet1_1"]
    rc, rank0, log = _run(tmp_path, n, script, twin, args, rtol, atol, upstream, mnist)
    assert rc == 0, log
    assert "runner: rewrote 'import horovod.torch as hvd' -> 'import hpccomm.horovod as hvd'" in rank0, log
    text = "\n".join(rank0)
    if mnist:
        per_rank = 240 // n
        assert re.search(rf"^Train Epoch: 1 \[0/{per_rank} \(0%\)\]\tLoss: \d+\.\d{{6}}$", text, re.M), log
        assert re.search(rf"^Train Epoch: 2 \[0/{per_rank} \(0%\)\]\tLoss: \d+\.\d{{6}}$", text, re.M), log
        assert len(re.findall(r"^Test set: Average loss: \d+\.\d{4}, Accuracy: \d+\.\d{2}%$", text, re.M)) == 2, log
    else:
        assert f"Number of CPUs: {n}" in rank0, log
        assert re.search(r"^Iter #1: [\d.]+ img/sec per CPU$", text, re.M), log
        assert re.search(rf"^Total img/sec on {n} CPU\(s\): [\d.]+ \+-[\d.]+$", text, re.M), log
    _check_compare(rank0, n, log)


@pytest.mark.parametrize("example,n,extra,rtol,atol,upstream", _cases(upstream=False))
def test_example_equivalent(tmp_path, example, n, extra, rtol, atol, upstream):
    """The equivalents of Horovod's examples (what CI can run): output lines as
    the originals print them, and the DDP twin's weights within tolerance."""
    _run_case(tmp_path, example, n, extra, rtol, atol, upstream)


if UPSTREAM:
    @pytest.mark.parametrize("example,n,extra,rtol,atol,upstream", _cases(upstream=True))
    def test_example_horovod_original(tmp_path, example, n, extra, rtol, atol, upstream):
        """Horovod's own example files (from HPCCOMM_HOROVOD_EXAMPLES), unchanged
        but for the import line."""
        _run_case(tmp_path, example, n, extra, rtol, atol, upstream)


def test_rewrite_changes_only_the_import_lines():
    """The runner's rewrite touches the two Horovod import forms and nothing
    else, and refuses a script importing horovod some other way."""
    sys.path.insert(0, str(HERE))
    try:
        import runner
    finally:
        sys.path.remove(str(HERE))
    source = "import os\nimport horovod\nimport horovod.torch as hvd\nx = 'import horovod.torch as hvd'\n"
    new, changes = runner.rewrite(source)
    assert new == ("import os\nimport hpccomm.horovod as horovod\nimport hpccomm.horovod as hvd\n"
                   "x = 'import horovod.torch as hvd'\n")
    assert changes == [("import horovod", "import hpccomm.horovod as horovod"),
                       ("import horovod.torch as hvd", "import hpccomm.horovod as hvd")]
    with pytest.raises(SystemExit, match="imports horovod in a way the one-line rewrite does not cover"):
        runner.rewrite("from horovod.torch import allreduce\n")
