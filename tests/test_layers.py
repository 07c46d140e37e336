"""The layering test, which is the map of hpccomm: every module's place, bottom to top.

:data:`MAP` lists every module of the package in layers, bottom first; inside
a layer, in order.  A module may import only modules listed before it (its
package's ``__init__`` included): an import that climbs, at module level or
inside a function, fails the test, and so does any circle (a circle always
climbs somewhere).  A module missing from the map fails it too: a new module
takes its place here.  Folders follow the layers too (:func:`folder_climbs`):
each package inside hpccomm (``_core``, ``_ops`` ...) sits wholly below every
folder or top-level module that imports from it, so no import between two
folders runs back up and folders make no circle either.  The tools on top
(:data:`TOOLS`) may import anything below, nothing imports them.  Three rules more, about what only one place may
import: mpi4py only ``hpccomm._mpi`` (and the bench's raw-MPI baselines,
:data:`RAW_MPI`, inside a function, after hpccomm started MPI: every other
tool asks ``hpccomm.mpi_module()``); torch's distributed internals only ``hpccomm._compat``;
``torch.distributed`` itself only the modules that drive torch's own API.

No MPI: the sources are read, not imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hpccomm

pytestmark = pytest.mark.one_cell  # the sources are the same in every cell of the CI matrix

PKG = Path(hpccomm.__file__).resolve().parent

#: Every module of hpccomm, by layer, bottom first (see the module docstring).
MAP = {
    "foundation: torch's symbols, errors, settings, the launcher's view": [
        "hpccomm._about", "hpccomm._compat", "hpccomm.errors", "hpccomm.config", "hpccomm.launcher"],
    "the MPI layer": ["hpccomm._mpi", "hpccomm._mpi.library"],
    "run-time state and instruments": [
        "hpccomm._core", "hpccomm._core.state", "hpccomm._core.flight", "hpccomm._core.debug_mode", "hpccomm._core.trace",
        "hpccomm._core.gloo_exit"],
    "the op core: plans, the comm thread, the failure policy, the op record, the Work": [
        "hpccomm._core.plan", "hpccomm._core.steps", "hpccomm._core.comm_thread", "hpccomm._core.ulfm",
        "hpccomm._core.failures", "hpccomm._core.signatures", "hpccomm._core.execute", "hpccomm._core.record",
        "hpccomm._core.work"],
    "core services: timeouts, signals, the exit, groups": [
        "hpccomm._core.watchdog", "hpccomm._core.signals", "hpccomm._core.shutdown", "hpccomm._core.group"],
    "GPU transports, and the routes that choose them (a group's routes on the group)": [
        "hpccomm._gpu", "hpccomm._gpu.streams", "hpccomm._gpu.detect", "hpccomm._gpu.nccl_wire", "hpccomm._gpu.probe",
        "hpccomm._gpu.select", "hpccomm._gpu.once", "hpccomm._gpu.findings", "hpccomm._gpu.binding",
        "hpccomm._gpu.group_routes", "hpccomm._gpu.overrides", "hpccomm._gpu.cuda_mpi", "hpccomm._gpu.staged",
        "hpccomm._gpu.nccl_torch", "hpccomm._gpu.nccl_cupy", "hpccomm._gpu.transports",
        "hpccomm._gpu.agreement", "hpccomm._gpu.delegation", "hpccomm._gpu.dispatch"],
    "the ops, each declared once (checks, signature, plan, GPU forms), and the op path": [
        "hpccomm._ops", "hpccomm._ops.op", "hpccomm._ops.checks", "hpccomm._ops.staging", "hpccomm._ops.composed",
        "hpccomm._ops.gather", "hpccomm._ops.reduce", "hpccomm._ops.scatter", "hpccomm._ops.alltoall",
        "hpccomm._ops.p2p", "hpccomm._ops.registry", "hpccomm._ops.op_path"],
    "the torch adapters": [
        "hpccomm.barrier", "hpccomm._adapters", "hpccomm._adapters.methods", "hpccomm._adapters.backend",
        "hpccomm._adapters.process_group"],
    "start-up": ["hpccomm._start", "hpccomm._start.bootstrap", "hpccomm._start.creator"],
    "the public API": ["hpccomm.init", "hpccomm.fault_tolerance", "hpccomm.debugging", "hpccomm.gpu"],
    "how torch finds hpccomm, and the package": [
        "hpccomm._torch", "hpccomm._torch.plugin", "hpccomm"],
}

#: Tools on top of the library (``hpccomm`` subcommands, ``hpccomm.tools``; the
#: examples, Horovod's API): like any user they may import anything below, and torch.distributed;
#: nothing in the library imports them.  (hpccomm.horovod has its own map: tests/test_horovod.py.)
TOOLS = ("hpccomm.__main__", "hpccomm.tools", "hpccomm.examples", "hpccomm.horovod")

#: The tools that may import mpi4py themselves (inside a function): the bench's raw-MPI baselines.
RAW_MPI = ("hpccomm.tools.bench",)

#: The modules that drive torch's own API (init, new groups, a shrink) and so import torch.distributed.
TORCH_DISTRIBUTED = ("hpccomm._compat", "hpccomm._start.creator", "hpccomm.init", "hpccomm.fault_tolerance")

ORDER = [m for layer in MAP.values() for m in layer]


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def is_tool(module: str) -> bool:
    return any(_is(module, t) for t in TOOLS)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list:
    """``(line, absolute module name, at module level)`` for every import in
    ``source``, function-level ones too, relative imports resolved against
    ``module``; ``importlib.import_module("literal")`` and ``__import__("literal")``
    calls count; ``from X import Y`` yields both X and X.Y (Y may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []

    def visit(node, top: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, top) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((node.lineno, mod, top))
            out.extend((node.lineno, f"{mod}.{a.name}", top) for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append((node.lineno, node.args[0].value, top))
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source), True)
    return out


def sources():
    """``{module: source}`` of every module of hpccomm."""
    return {module_name(p): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def edges(modules: dict) -> list:
    """``(module, line, imported hpccomm module, at module level)`` of ``modules``
    (``{name: source}``); ``from X import Y`` counts as importing X.Y where X.Y is
    a module of ``modules``, else X."""
    out = []
    for module, source in modules.items():
        is_package = module == "hpccomm" or any(m.startswith(module + ".") for m in modules)
        for line, name, top in imports_of(source, module, is_package):
            if _is(name, "hpccomm"):
                target = name if name in modules else name.rpartition(".")[0] if name.rpartition(".")[0] in modules \
                    else None
                # (a module's own packages are imported before it, by Python: not an import of its own)
                if target is not None and target != module and not module.startswith(target + "."):
                    out.append((module, line, target, top))
    return sorted(set(out))


def violations(modules: dict, order: list, tools=TOOLS) -> list:
    """What breaks the map: a module not in ``order`` (nor a tool), an import
    of a module listed after the importer (a climb, at any level), an import
    of a tool by the library, and every circle."""
    place = {m: i for i, m in enumerate(order)}
    tool = lambda m: any(_is(m, t) for t in tools)  # noqa: E731
    bad = [f"{m}: not in the map (tests/test_layers.py MAP): give it its layer"
           for m in modules if m not in place and not tool(m)]
    graph: dict = {}
    for module, line, target, top in edges(modules):
        graph.setdefault(module, set()).add(target)
        if tool(module):
            continue
        where = f"{module}:{line}{'' if top else ' (inside a function)'}"
        if tool(target):
            bad.append(f"{where} imports the tool {target}; nothing in the library may")
        elif target in place and module in place and place[target] >= place[module]:
            bad.append(f"{where} imports {target}, which sits above it in the map")
    bad += [f"circle: {' -> '.join(c)}" for c in circles(graph)]
    return bad


def folder_of(module: str, modules) -> str:
    """The folder unit of ``module``: the package directly inside hpccomm that
    holds it (``hpccomm._core`` for ``hpccomm._core.work``), or the module
    itself when it sits in hpccomm's own folder (``hpccomm.errors``)."""
    parts = module.split(".")
    if len(parts) > 2 or any(m.startswith(module + ".") for m in modules):
        return ".".join(parts[:2])
    return module


def folder_climbs(modules: dict, order: list, tools=TOOLS) -> list:
    """Imports between folders that do not point down the map: an import of
    a module of folder B by one of folder A (different folders, or
    top-level modules) needs every module of B listed before every module
    of A.  Tools are left out, as in :func:`violations`."""
    place = {m: i for i, m in enumerate(order)}
    tool = lambda m: any(_is(m, t) for t in tools)  # noqa: E731
    span: dict = {}
    for m in order:
        unit = folder_of(m, modules)
        low, high = span.get(unit, (place[m], place[m]))
        span[unit] = (min(low, place[m]), max(high, place[m]))
    bad = []
    for module, line, target, _ in edges(modules):
        if tool(module) or tool(target) or module not in place or target not in place:
            continue
        a, b = folder_of(module, modules), folder_of(target, modules)
        if a != b and span[b][1] >= span[a][0]:
            bad.append(f"{module}:{line} imports {target}: folder {b} (map places {span[b][0]}-{span[b][1]}) "
                       f"does not sit below {a} ({span[a][0]}-{span[a][1]})")
    return sorted(set(bad))


def circles(graph: dict) -> list:
    """The import circles of ``graph`` (``{module: imported modules}``): one
    path around each strongly connected part of more than one module."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part) + [sorted(part)[0]])

    for v in list(graph):
        if v not in index:
            strong(v)
    return found


def only_here_rules(modules: dict) -> list:
    """mpi4py only in hpccomm._mpi (the bench's baselines inside a function); torch's
    distributed internals only in hpccomm._compat; torch.distributed
    only in the modules of :data:`TORCH_DISTRIBUTED` (and the tools)."""
    bad = []
    for module, source in modules.items():
        tool = is_tool(module)
        for line, name, top in imports_of(source, module, module == "hpccomm"):
            where = f"{module}:{line}"
            raw = any(_is(module, r) for r in RAW_MPI)
            if _is(name, "mpi4py") and not _is(module, "hpccomm._mpi") and (top or not raw):
                bad.append(f"{where}: imports {name}; only hpccomm._mpi may import mpi4py"
                           + (" (the bench's raw-MPI baselines may, inside a function)" if raw else
                              " (hpccomm.mpi_module() gives mpi4py.MPI)" if tool else ""))
            if _torch_internal(name) and module != "hpccomm._compat":
                bad.append(f"{where}: imports torch internals ({name}); only hpccomm._compat may")
            if name == "torch.distributed" and not tool and module not in TORCH_DISTRIBUTED:
                bad.append(f"{where}: imports torch.distributed; only {', '.join(TORCH_DISTRIBUTED)} may (the "
                           "rest get torch's names from hpccomm._compat)")
    return bad


def _torch_internal(name: str) -> bool:
    """torch.distributed's internals: submodules and private names."""
    if _is(name, "torch._C"):
        return True
    if _is(name, "torch.distributed") and name != "torch.distributed":
        last = name[len("torch.distributed."):]
        return last.startswith("_") or "." in last or last in _TORCH_DIST_SUBMODULES
    return False


_TORCH_DIST_SUBMODULES = {"distributed_c10d", "rendezvous", "c10d_logger", "constants", "utils", "device_mesh",
                          "elastic", "algorithms", "fsdp", "tensor", "checkpoint", "launcher", "run", "nn",
                          "optim", "pipelining", "rpc", "autograd", "logging_handlers"}


# -- the tests ---------------------------------------------------------------------------------------

def test_every_module_has_its_place_and_imports_only_below():
    modules = sources()
    assert "hpccomm._ops.op_path" in modules and len(modules) > 50, sorted(modules)
    found = edges(modules)
    assert any(m == "hpccomm._ops.op_path" and t == "hpccomm._core.work" for m, _, t, _ in found), \
        "relative imports unread"
    bad = violations(modules, ORDER)
    assert not bad, "the map is broken:\n" + "\n".join(bad)


def test_folders_follow_the_layers():
    """No module imports from a folder that sits above (or beside) its own."""
    bad = folder_climbs(sources(), ORDER)
    assert not bad, "folders do not follow the layers:\n" + "\n".join(bad)


def test_the_map_lists_only_modules_that_exist():
    modules = sources()
    assert [m for m in ORDER if m not in modules] == []
    assert len(ORDER) == len(set(ORDER)), "a module listed twice"


def test_only_here_rules():
    bad = only_here_rules(sources())
    assert not bad, "\n".join(bad)


# -- the test of the test: planted graphs ------------------------------------------------------------

def test_a_circle_is_refused():
    planted = {"hpccomm.a": "from . import b\n", "hpccomm.b": "def f():\n    from . import a\n",
               "hpccomm": ""}
    found = violations(planted, ["hpccomm.a", "hpccomm.b", "hpccomm"])
    assert found == ["hpccomm.a:1 imports hpccomm.b, which sits above it in the map",
                     "circle: hpccomm.a -> hpccomm.b -> hpccomm.a"], found


def test_a_climbing_function_level_import_is_refused():
    planted = {"hpccomm.low": "import os\n\n\ndef f():\n    from .high import thing\n",
               "hpccomm.high": "", "hpccomm": ""}
    found = violations(planted, ["hpccomm.low", "hpccomm.high", "hpccomm"])
    assert found == ["hpccomm.low:5 (inside a function) imports hpccomm.high, which sits above it in the map"], found


def test_a_module_off_the_map_and_a_tool_import_are_refused():
    planted = {"hpccomm.low": "from .tools import demo\n", "hpccomm.new": "", "hpccomm.tools.demo": "from .. import low\n",
               "hpccomm": ""}
    found = violations(planted, ["hpccomm.low", "hpccomm"], tools=("hpccomm.tools.demo",))
    assert "hpccomm.new: not in the map (tests/test_layers.py MAP): give it its layer" in found, found
    assert "hpccomm.low:1 imports the tool hpccomm.tools.demo; nothing in the library may" in found, found


def test_a_folder_that_climbs_is_refused():
    """Modules in order, but folder ``hpccomm.b`` both below and above ``hpccomm.a``: refused;
    the same graph with folders that follow the layers passes."""
    planted = {"hpccomm.b": "", "hpccomm.b.low": "", "hpccomm.a": "", "hpccomm.a.mid": "from ..b import low\n",
               "hpccomm.b.high": "from ..a import mid\n", "hpccomm": ""}
    order = ["hpccomm.b", "hpccomm.b.low", "hpccomm.a", "hpccomm.a.mid", "hpccomm.b.high", "hpccomm"]
    assert violations(planted, order, tools=()) == []  # module by module, nothing climbs
    found = folder_climbs(planted, order, tools=())
    assert found and all("does not sit below" in f for f in found), found
    assert any(f.startswith("hpccomm.a.mid:1 imports hpccomm.b.low: folder hpccomm.b") for f in found), found
    assert any(f.startswith("hpccomm.b.high:1 imports hpccomm.a.mid: folder hpccomm.a") for f in found), found
    planted["hpccomm.c.high"] = planted.pop("hpccomm.b.high")
    order[4] = "hpccomm.c.high"
    assert folder_climbs(planted, order, tools=()) == []


def test_an_allowed_graph_passes():
    planted = {"hpccomm.low": "import os\n", "hpccomm.high": "def f():\n    from . import low\n", "hpccomm": ""}
    assert violations(planted, ["hpccomm.low", "hpccomm.high", "hpccomm"]) == []


@pytest.mark.parametrize("module,line", [
    ("hpccomm._ops.reduce", "from .._adapters.process_group import ProcessGroupHpccomm"),
    ("hpccomm._ops.reduce", "from .._adapters import process_group"),
    ("hpccomm._mpi", "from .._core.group import Group"),
    ("hpccomm.errors", "from .config import get"),
    ("hpccomm.init", "from .tools import bench"),
    ("hpccomm._ops.gather", "from ..tools.demo import say"),
    ("hpccomm._core.state", "def f():\n    from .._ops.op_path import run"),
    ("hpccomm._core.record", "from .._ops import checks"),
])
def test_the_map_catches_a_planted_import(module, line):
    """Each kind of bad import, planted in a real module of the package, breaks the map."""
    modules = sources()
    modules[module] += "\n" + line + "\n"
    assert violations(modules, ORDER), (module, line)


@pytest.mark.parametrize("module,source", [
    ("hpccomm._core.group", "def f():\n    import mpi4py.MPI"),
    ("hpccomm.init", "from torch.distributed import distributed_c10d"),
    ("hpccomm._core.work", "import torch._C._distributed_c10d as c"),
    ("hpccomm._core.group", "import torch.distributed as dist"),
    ("hpccomm._adapters.process_group", "import importlib\nimportlib.import_module('torch.distributed.rendezvous')"),
    ("hpccomm.tools.bench", "from mpi4py import MPI"),
    ("hpccomm.horovod.lifecycle", "def init():\n    from mpi4py import MPI"),
    ("hpccomm.tools.jobs", "def run():\n    from mpi4py import MPI"),
    ("hpccomm._core.group", "def f():\n    return __import__('mpi4py').MPI"),
])
def test_only_here_rules_catch(module, source):
    assert only_here_rules({module: source}), (module, source)


@pytest.mark.parametrize("module,source", [
    ("hpccomm.tools.bench", "def main():\n    from mpi4py import MPI"),
    ("hpccomm.tools.demo", "import torch.distributed as dist\nimport hpccomm"),
    ("hpccomm.init", "import torch.distributed as dist"),
])
def test_only_here_rules_allow(module, source):
    assert only_here_rules({module: source}) == []
