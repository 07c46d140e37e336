"""hpccomm's methods that torch's C++ layer calls are kept out of TorchDynamo
once Dynamo is imported, whichever is imported first, and importing hpccomm
does not import Dynamo (about 1 s).  See hpccomm._compat.hide_from_compiler;
tests/test_fsdp.py::test_compiled_ddp_matches_eager is the end-to-end test."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
{first}
from hpccomm import ProcessGroupHpccomm
from hpccomm._ops import op_path
from hpccomm._core.work import Work
print("dynamo imported:", "torch._dynamo" in sys.modules)
{then}
names = ["broadcast", "allreduce", "all_gather_single", "_allgather_base", "all_to_all_single", "barrier",
         "send", "recv", "recv_anysource", "getGroupName"]
hidden = [getattr(getattr(ProcessGroupHpccomm, n), "_torchdynamo_disable", False) for n in names]
hidden += [getattr(getattr(Work, n), "_torchdynamo_disable", False) for n in ("wait", "get_future")]
from hpccomm._adapters.backend import BackendHpccomm  # the torch >= 2.14 adapter (its class exists on every torch)
hidden += [getattr(getattr(BackendHpccomm, n), "_torchdynamo_disable", False)
           for n in [*(n for n in names[:-1] if n != "_allgather_base"), "start_coalescing", "end_coalescing",
                     "split", "monitored_barrier"]]
print("hidden:", all(hidden))
print("run-time methods:", getattr(op_path.run, "_torchdynamo_disable", False))
"""


@pytest.mark.parametrize("first,then,imported_first", [
    ("import hpccomm", "import torch._dynamo", False),
    ("import torch._dynamo; import hpccomm", "", True),
])
def test_methods_hidden_from_dynamo_once_it_is_imported(first, then, imported_first):
    out = subprocess.run([sys.executable, "-c", CHECK.format(first=first, then=then)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"dynamo imported: {imported_first}" in out.stdout, out.stdout
    assert "hidden: True" in out.stdout, out.stdout
    assert "run-time methods: False" in out.stdout, out.stdout
