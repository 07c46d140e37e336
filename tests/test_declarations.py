"""Each op is declared once (hpccomm._ops.op.Op, in its family's module), and
everything about it comes from that declaration: the adapters' methods, its
checks and signature, its description in messages, its GPU forms, its cache
key.  No MPI: declarations and checks run on a fake group.

- every op's functions live in its family's file (``docs/scripts/op_facts.py``
  prints the table: op -> the file of its checks and signature, plan, key,
  composed, NCCL and CuPy forms);
- the adapters' methods are exactly the declared ones, each running its op;
- a signature is derived from the declaration for every op, and changing any
  one field a rank could get wrong (a tensor's count or dtype, the ReduceOp,
  the root, a split) changes it;
- a call's cache key changes whenever its checked call would (a stale cached
  verdict would be a silent wrong answer);
- no branch on an op's name is left in the library, but those listed here.
"""
from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hpccomm
from helpers import fake_group
from hpccomm._ops import alltoall, gather, p2p, reduce, registry, scatter
from hpccomm._core.plan import AFTER, BEFORE, CALL, FIELDS, KEEP, NBYTES, OUTPUTS
from hpccomm._ops.op import Call

R = dist.ReduceOp
PKG = Path(hpccomm.__file__).resolve().parent
FAMILIES = {"reduce": reduce, "gather": gather, "scatter": scatter, "alltoall": alltoall, "p2p": p2p}


def family_of(op) -> str:
    return next(name for name, module in FAMILIES.items() if op in module.OPS)


# --------------------------------------------------------------------------
# one place per op
# --------------------------------------------------------------------------

def test_every_op_is_declared_once_in_its_family():
    names = [op.name for op in registry.OPS]
    assert len(set(map(id, registry.OPS))) == len(registry.OPS)
    assert sorted(set(names)) == sorted({*names}) and len(names) == len(set(names)) + 1  # (all_reduce's sparse twin)
    for op in registry.OPS:
        home = FAMILIES[family_of(op)].__name__
        for part in ("check", "plan", "key", "composed", "nccl", "cupy", "roles"):
            fn = getattr(op, part)
            if fn is None or fn.__name__ == "uncached":
                continue
            assert fn.__module__ == home, (op, part, fn.__module__)


def test_op_facts_script_lists_one_file_per_op(capsys):
    """The table a maintainer reads: for every op, the one file that states its checks, signature, plan,
    cache key and GPU forms (the description is derived from the signature, hpccomm._ops.op)."""
    import runpy

    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(PKG.parent / "docs" / "scripts" / "op_facts.py"), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    for op in registry.OPS:
        row = next((line for line in out.splitlines() if line.split("|")[1:2] == [f" {op.name} "]
                    and f"`{'allreduce_sparse' if op is reduce.ALL_REDUCE_SPARSE else op.methods[0]}`" in line), None)
        assert row is not None, (op, out)
        assert f"hpccomm/_ops/{family_of(op)}.py" in row, row


# --------------------------------------------------------------------------
# the adapters run the declared ops
# --------------------------------------------------------------------------

class _Destroyed:
    """An adapter over a destroyed group: every op is refused naming itself, before anything else."""

    def __init__(self):
        from hpccomm._adapters.methods import TorchOps

        self.ops = TorchOps()
        self.ops._g = fake_group()
        self.ops._g.comm = None  # (the group was destroyed: the op path refuses, naming the op)


def _arguments(method):
    """Placeholders for a method's arguments (torch's options with a root and a ReduceOp)."""
    import inspect

    opts = types.SimpleNamespace(rootRank=0, reduceOp=R.SUM, asyncOp=False)
    params = list(inspect.signature(method).parameters)[1:]
    return [opts if p == "opts" else 0 if p in ("dst", "src", "tag") else ["x"] for p in params]


def test_each_point_to_point_op_names_its_counterpart():
    """A point-to-point op declares the op its peer must post (``matched_by``, what the
    watchdog's diagnosis of a timed-out one names); the two name each other, and no
    collective names one."""
    for op in registry.OPS:
        if not op.p2p:
            assert op.matched_by is None, op.name
            continue
        other = registry.BY_NAME[op.matched_by]
        assert other.p2p and other.matched_by == op.name and other.receives != op.receives, (op.name, other.name)


def test_adapter_methods_are_the_declared_ones():
    from hpccomm._adapters.methods import TorchOps
    from hpccomm._adapters.process_group import ProcessGroupHpccomm

    declared = {name: op for op in registry.OPS for name in op.methods}
    lifecycle = {"abort", "shutdown", "getBackendName", "mpi_comm"}
    public = {n for n, v in vars(TorchOps).items() if not n.startswith("_") and n not in lifecycle}
    assert public == set(declared), public ^ set(declared)
    adapter = _Destroyed().ops
    for name, op in declared.items():
        method = getattr(TorchOps, name)
        with pytest.raises(hpccomm.HpccommError, match=rf"^hpccomm {op.name} \(group 'fake'\): the process group "
                           r"was destroyed"):
            method(adapter, *_arguments(method))
    for op in registry.OPS:  # torch 2.13's older names: the same methods on the ProcessGroup route
        for old in op.legacy:
            assert getattr(ProcessGroupHpccomm, old) is getattr(TorchOps, op.methods[0]), (op, old)


# --------------------------------------------------------------------------
# signatures: every field a rank could get wrong changes it
# --------------------------------------------------------------------------

def t(n=4, dtype=torch.float32):
    return torch.ones(n, dtype=dtype)


SIZE = 4


def good(rank: int):
    """One valid call of every op as group rank ``rank`` of SIZE makes it (root 0), and
    ``(what, changed call)`` for each field a rank could get wrong."""
    root = rank == 0
    lst = [t() for _ in range(SIZE)]
    return {
        "all_reduce": (([t()], R.SUM), [("count", ([t(5)], R.SUM)), ("dtype", ([t(4, torch.float64)], R.SUM)),
                                        ("ReduceOp", ([t()], R.MAX))]),
        "all_reduce_coalesced": (([t(), t(3, torch.int32)], R.MAX),
                                 [("count", ([t(), t(4, torch.int32)], R.MAX)),
                                  ("dtype", ([t(), t(3, torch.int64)], R.MAX)), ("ReduceOp", ([t(), t(3, torch.int32)], R.MIN)),
                                  ("tensors", ([t()], R.MAX))]),
        "reduce": (([t()], 0, R.SUM), [("count", ([t(5)], 0, R.SUM)), ("dtype", ([t(4, torch.int64)], 0, R.SUM)),
                                       ("ReduceOp", ([t()], 0, R.PRODUCT)), ("root", ([t()], 1, R.SUM))]),
        "reduce_scatter": (([t()], [lst], R.SUM), [("count", ([t(2)], [[t(2)] * SIZE], R.SUM)),
                                                   ("dtype", ([t(4, torch.int32)], [[t(4, torch.int32)] * SIZE], R.SUM)),
                                                   ("ReduceOp", ([t()], [lst], R.AVG))]),
        "reduce_scatter_tensor": ((t(), t(4 * SIZE), R.SUM), [("count", (t(2), t(2 * SIZE), R.SUM)),
                                                             ("dtype", (t(4, torch.int8), t(4 * SIZE, torch.int8), R.SUM)),
                                                             ("ReduceOp", (t(), t(4 * SIZE), R.MIN))]),
        "reduce_scatter_tensor_coalesced": (([t()], [t(4 * SIZE)], R.SUM),
                                            [("count", ([t(3)], [t(3 * SIZE)], R.SUM)),
                                             ("dtype", ([t(4, torch.int32)], [t(4 * SIZE, torch.int32)], R.SUM)),
                                             ("ReduceOp", ([t()], [t(4 * SIZE)], R.MAX)),
                                             ("tensors", ([t(), t()], [t(4 * SIZE), t(4 * SIZE)], R.SUM))]),
        "broadcast": (([t()], 0), [("count", ([t(5)], 0)), ("dtype", ([t(4, torch.bool)], 0)), ("root", ([t()], 2))]),
        "scatter": (([t()], [lst] if root else [], 0),
                    [("count", ([t(5)], [[t(5)] * SIZE] if root else [], 0)),
                     ("dtype", ([t(4, torch.int16)], [[t(4, torch.int16)] * SIZE] if root else [], 0)),
                     ("root", ([t()], [lst] if rank == 1 else [], 1))]),
        "all_gather": (([lst], [t()]), [("count", ([[t(5)] * SIZE], [t(5)])),
                                        ("dtype", ([[t(4, torch.int64)] * SIZE], [t(4, torch.int64)]))]),
        "all_gather_into_tensor": ((t(4 * SIZE), t()), [("count", (t(5 * SIZE), t(5))),
                                                        ("dtype", (t(4 * SIZE, torch.uint8), t(4, torch.uint8)))]),
        "all_gather_coalesced": (([[t(), t(2)] for _ in range(SIZE)], [t(), t(2)]),
                                 [("count", ([[t(), t(3)] for _ in range(SIZE)], [t(), t(3)])),
                                  ("dtype", ([[t(), t(2, torch.int32)] for _ in range(SIZE)], [t(), t(2, torch.int32)]))]),
        "all_gather_into_tensor_coalesced": (([t(4 * SIZE)], [t()]),
                                             [("count", ([t(3 * SIZE)], [t(3)])),
                                              ("dtype", ([t(4 * SIZE, torch.float16)], [t(4, torch.float16)])),
                                              ("tensors", ([t(4 * SIZE)] * 2, [t()] * 2))]),
        "gather": (([lst] if root else [], [t()], 0),
                   [("count", ([[t(5)] * SIZE] if root else [], [t(5)], 0)),
                    ("dtype", ([[t(4, torch.int32)] * SIZE] if root else [], [t(4, torch.int32)], 0)),
                    ("root", ([lst] if rank == 1 else [], [t()], 1))]),
        "gather_single": ((t(4 * SIZE), t(), 0), [("count", (t(5 * SIZE), t(5), 0)),
                                                  ("dtype", (t(4 * SIZE, torch.int32), t(4, torch.int32), 0)),
                                                  ("root", (t(4 * SIZE), t(), 1))]),
        "all_to_all_single": ((t(2 * SIZE), t(2 * SIZE), None, None),
                              [("split", (t(2 * SIZE), t(2 * SIZE), None, [3, 1] + [2] * (SIZE - 2))),
                               ("split", (t(2 * SIZE), t(2 * SIZE), [1, 3] + [2] * (SIZE - 2), None)),
                               ("dtype", (t(2 * SIZE, torch.int32), t(2 * SIZE, torch.int32), None, None))]),
        "all_to_all": (([t(2) for _ in range(SIZE)], [t(3) for _ in range(SIZE)]),
                       [("split", ([t(2) for _ in range(SIZE)], [t(4)] + [t(3)] * (SIZE - 1))),
                        ("split", ([t(1)] + [t(2)] * (SIZE - 1), [t(3) for _ in range(SIZE)])),
                        ("dtype", ([t(2, torch.int32)] * SIZE, [t(3, torch.int32)] * SIZE))]),
        "barrier": ((), []),
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_every_field_a_rank_could_get_wrong_changes_the_signature(rank):
    """A signature derived from each op's declaration (its checks' result):
    changing any one field (a tensor's count or dtype, the ReduceOp, the
    root, a split, a coalesced op's list) gives another signature (its key,
    or for all_to_all its pairs), so the ranks' comparison sees it."""
    g = fake_group(rank, SIZE)
    calls = good(rank)
    collectives = {op.name for op in registry.OPS if not op.p2p}
    assert set(calls) == collectives, set(calls) ^ collectives
    for name, (args, changes) in calls.items():
        op = registry.BY_NAME[name]
        sig = op.check(g, *args).signature
        assert sig.op == name and sig.describe().startswith(f"{name}(")
        assert op.check(g, *args).signature == sig  # derived, the same every time
        fields = {what for what, _ in changes}
        needed = {"count", "dtype"} | ({"ReduceOp"} if op.reducing else set()) | \
                 ({"root"} if any(label == "root" for label, _ in sig.fields) else set())
        if name.startswith("all_to_all"):
            needed = {"split", "dtype"}
        if name == "barrier":
            needed = set()
        assert needed <= fields, (name, needed - fields)
        for what, changed in changes:
            other = op.check(g, *changed).signature
            assert other != sig, (name, what, sig, other)
            if what == "split":
                assert other.pairs != sig.pairs, (name, sig, other)
            else:
                assert other.key != sig.key, (name, what, sig, other)


def test_signatures_describe_the_call():
    g = fake_group(0, SIZE)
    assert reduce.ALL_REDUCE.check(g, [t(4, torch.bfloat16)], R.AVG).signature.describe() == \
        "all_reduce(bfloat16[4], AVG)"
    assert reduce.REDUCE.check(g, [t()], 2, R.MAX).signature.describe() == "reduce(float32[4], MAX, root 2)"
    assert scatter.BROADCAST.check(g, [t(3, torch.int64)], 1).signature.describe() == "broadcast(int64[3], root 1)"
    assert reduce.ALL_REDUCE_COALESCED.check(g, [t(), t(2, torch.int32)], R.SUM).signature.describe() == \
        "all_reduce_coalesced(float32[4], int32[2], SUM)"
    assert gather.ALL_GATHER.check(g, [[t(), t(2), t(), t()]], [t()]).signature.describe() == \
        "all_gather([float32[4], float32[2], float32[4], float32[4]])"
    assert alltoall.ALL_TO_ALL_SINGLE.check(g, t(8), t(8), None, [5, 1, 1, 1]).signature.pairs == \
        ((5, 1, 1, 1), (2, 2, 2, 2))


# --------------------------------------------------------------------------
# the cache key: a change the checks would see changes it
# --------------------------------------------------------------------------

def _key_cases():
    """(op, a valid call, calls that differ in one property) for every op with a key."""
    a = t()
    return [
        (reduce.ALL_REDUCE, ([a], R.SUM), [([t(5)], R.SUM), ([t(4, torch.int32)], R.SUM), ([a], R.MAX),
                                          ([a], R.AVG), ([a.to_sparse()], R.SUM), ([a, a], R.SUM), ((a,), R.SUM),
                                          ([torch.ones(4, device="meta")], R.SUM), ([a], R.SUM.value)]),
        (reduce.REDUCE, ([a], 0, R.SUM), [([a], 1, R.SUM), ([t(5)], 0, R.SUM), ([a], 0, R.MIN), ([a], 0.0, R.SUM)]),
        (reduce.REDUCE_SCATTER_TENSOR, (t(1), t(4), R.SUM),
         [(t(2), t(8), R.SUM), (t(1, torch.int32), t(4, torch.int32), R.SUM), (t(1), t(4), R.MAX),
          (t(1), t(4, torch.float64), R.SUM)]),
        (scatter.BROADCAST, ([a], 0), [([a], 1), ([t(5)], 0), ([t(4, torch.int8)], 0), ([a], True)]),
        (gather.ALL_GATHER_INTO_TENSOR, (t(16), a), [(t(20), t(5)), (t(16, torch.int32), t(4, torch.int32)),
                                                     (t(16), t(4, torch.float16))]),
        (p2p.SEND, ([a], 1, 0), [([a], 2, 0), ([a], 1, 3), ([t(5)], 1, 0), ([t(4, torch.int64)], 1, 0)]),
        (p2p.RECV, ([a], None, 0), [([a], 1, 0), ([a], None, 9), ([t(3)], None, 0)]),
    ]


def _verdict(op, g, args):
    """The checks' verdict on a call: its signature, or the refusal's type and message."""
    try:
        return op.check(g, *args).signature
    except hpccomm.OpError as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("op,args,others", _key_cases(), ids=[c[0].name for c in _key_cases()])
def test_a_call_keyed_alike_is_checked_alike(op, args, others):
    """Every op with a cache key (hpccomm._ops.op_path keeps its checked call
    by it): calls that share a key get the same verdict from the op's checks
    (the same signature, or the same refusal), so a cached checked call is
    never another call's; calls whose checks would differ have other keys."""
    g = fake_group(0, SIZE)
    key = op.key(args)
    assert key is not None and hash(key) == hash(op.key(args)) and key == op.key(args)
    calls = [args, *others]
    keyed = [(op.key(c), c) for c in calls]
    assert sum(k is not None for k, _ in keyed) >= 3, keyed  # (the cases reach the key, not only its refusals)
    for i, (ka, a) in enumerate(keyed):
        for kb, b in keyed[i + 1:]:
            if ka is not None and ka == kb:
                assert _verdict(op, g, a) == _verdict(op, g, b), (op, a, b)
            elif ka is not None and kb is not None:
                assert _verdict(op, g, a) != _verdict(op, g, b), (op, a, b)  # (a key differs only where it must)


def test_premul_sum_and_strange_reduce_ops_are_never_kept():
    """A PREMUL_SUM call's factor is its own: its checked call is not kept for the next call of its shape."""
    g = fake_group(0, SIZE)
    call = reduce.ALL_REDUCE.check(g, [t()], dist._make_nccl_premul_sum(2.0))
    assert isinstance(call, Call) and not call.cacheable
    assert reduce.ALL_REDUCE.check(g, [t()], R.SUM).cacheable
    assert reduce.ALL_REDUCE.key(([t()], R.SUM.value)) is None  # not a ReduceOp: checked (and refused) every call
    assert reduce.ALL_REDUCE.key(([t()], R.SUM)) == reduce.ALL_REDUCE.key(([t()], R(R.SUM)))  # (one kind, one key)


# --------------------------------------------------------------------------
# a plan bound to a call's shape is the op's plan
# --------------------------------------------------------------------------

def _bound_cases(rank: int):
    """``(op, args, hot)`` for every op with a bound plan: the hot calls
    (``hot``: a plan of one MPI call on the tensors' memory, no steps) and
    those ``fill`` must leave to ``plan`` (strided, aliased)."""
    out = torch.zeros(4 * SIZE)
    mine = out[4 * rank:4 * rank + 4]  # this rank's slot of the output (FSDP's in-place layout)
    other = out[4 * ((rank + 1) % SIZE):4 * ((rank + 1) % SIZE) + 4]  # another rank's slot: aliased
    big, strided = torch.ones(4 * SIZE), torch.ones(8)[::2]
    root = (rank + 1) % SIZE
    return [
        (reduce.ALL_REDUCE, ([t()], R.SUM), True), (reduce.ALL_REDUCE, ([t(0)], R.MAX), True),
        (reduce.ALL_REDUCE, ([t(4, torch.int64)], R.BAND), True),
        (reduce.ALL_REDUCE, ([t(4, torch.bfloat16)], R.SUM), True),
        (reduce.ALL_REDUCE, ([strided], R.SUM), False),
        (scatter.BROADCAST, ([t()], 0), True), (scatter.BROADCAST, ([t(3, torch.int8)], root), True),
        (scatter.BROADCAST, ([strided], root), False),
        (gather.ALL_GATHER_INTO_TENSOR, (out, t()), True), (gather.ALL_GATHER_INTO_TENSOR, (out, mine), True),
        (gather.ALL_GATHER_INTO_TENSOR, (torch.zeros(0), t(0)), True),
        (gather.ALL_GATHER_INTO_TENSOR, (out, other), False), (gather.ALL_GATHER_INTO_TENSOR, (out, strided), False),
        (gather.ALL_GATHER_INTO_TENSOR, (torch.zeros(32)[::2], t()), False),
        (reduce.REDUCE_SCATTER_TENSOR, (t(), big, R.SUM), True),
        (reduce.REDUCE_SCATTER_TENSOR, (t(4, torch.float16), big.half(), R.MIN), True),
        (reduce.REDUCE_SCATTER_TENSOR, (big[:4], big, R.SUM), False),
        (reduce.REDUCE_SCATTER_TENSOR, (strided, big, R.SUM), False),
    ]


def _plain(value):
    """A plan's field with its MPI buffers as ``(address, bytes)`` (they compare by identity)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if hasattr(value, "address") and hasattr(value, "nbytes"):
        return ("buffer", value.address, value.nbytes)
    return value


def _kept(keep) -> set:
    """The ids of the tensors a plan keeps alive."""
    items = keep if isinstance(keep, tuple) else (keep,)
    return {id(x) for x in items if isinstance(x, torch.Tensor)}


@pytest.mark.parametrize("rank", [0, 2])
def test_a_bound_plan_is_the_ops_plan(rank):
    """Every op's ``bind`` (the plan of a cached call's shape, hpccomm._ops.op_path's fast path
    and every later form) makes what the op's ``plan`` makes of the same call: the same MPI call
    and nonblocking call, the same buffers (addresses and bytes), counts, datatypes, ReduceOp and
    root, the same outputs, tensors kept and bytes, and no steps; it gives None where ``plan``
    needs copies (strided, aliased), and ``bind`` gives None where the shape needs steps or
    pieces (AVG, PREMUL_SUM, past the count limit)."""
    g = fake_group(rank, SIZE)
    bound = {op for op in registry.OPS if op.bind is not None}
    assert bound == {reduce.ALL_REDUCE, scatter.BROADCAST, gather.ALL_GATHER_INTO_TENSOR,
                     reduce.REDUCE_SCATTER_TENSOR}
    seen = set()
    for op, args, hot in _bound_cases(rank):
        call = op.check(g, *args)
        fill = op.bind(g, call)
        assert fill is not None, (op, args)
        made = fill(args)
        if not hot:
            assert made is None, (op, args)
            continue
        seen.add(op)
        plan = op.plan(g, call, args)
        assert len(made) == len(plan) == len(FIELDS)
        assert made[BEFORE] is made[AFTER] is plan[BEFORE] is plan[AFTER] is None, (op, args)  # (no steps)
        assert _plain(made[CALL:OUTPUTS]) == _plain(plan[CALL:OUTPUTS]), (op, args)  # call, its arguments, icall
        outputs = made[OUTPUTS], plan[OUTPUTS]
        assert len(outputs[0]) == len(outputs[1]) and all(a is b for a, b in zip(*outputs)), (op, args)
        assert _kept(made[KEEP]) == _kept(plan[KEEP]) and made[NBYTES] == plan[NBYTES], (op, args)
    assert seen == bound
    # shapes that need the op's plan: steps (AVG, PREMUL_SUM) or pieces (past the count limit)
    assert reduce.ALL_REDUCE.bind(g, reduce.ALL_REDUCE.check(g, [t()], R.AVG)) is None
    assert reduce.ALL_REDUCE.bind(g, reduce.ALL_REDUCE.check(g, [t()], dist._make_nccl_premul_sum(2.0))) is None
    assert reduce.REDUCE_SCATTER_TENSOR.bind(g, reduce.REDUCE_SCATTER_TENSOR.check(g, t(), t(4 * SIZE), R.AVG)) is None
    g.max_count = 3
    for op in bound:  # (each op's first case)
        args = next(args for o, args, _ in _bound_cases(rank) if o is op)
        assert op.bind(g, op.check(g, *args)) is None, op


# --------------------------------------------------------------------------
# no branches on op names
# --------------------------------------------------------------------------

#: Places in the library that may compare a string with an op's name, and why.
ALLOWED = {}

#: Folders and modules of tools, benches, examples and the Horovod API (clients of the library).
CLIENTS = ("tools", "examples", "horovod", "__main__.py")


def _branches(source: str, names: set) -> list:
    """``(line, text)`` of each comparison of a value with a string literal that is an op's name,
    and of each conditional expression that chooses an op's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.IfExp) and any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                                               and c.value in names for c in (node.body, node.orelse)):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare):
            literals = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            for c in [node.left, *node.comparators]:
                if isinstance(c, (ast.Tuple, ast.List, ast.Set)):
                    literals += [e for e in c.elts if isinstance(e, ast.Constant)]
            if any(isinstance(c.value, str) and c.value in names for c in literals):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith") and node.args and isinstance(node.args[0], ast.Constant):
            part = node.args[0].value  # a name's start or end standing for the ops that have it
            if isinstance(part, str) and len(part) > 1 and any(
                    (n.startswith(part) if node.func.attr == "startswith" else n.endswith(part)) for n in names):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_branch_on_an_op_name_in_the_library():
    names = {op.name for op in registry.OPS} | {n for op in registry.OPS for n in (*op.methods, *op.legacy)}
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.split("/")[0] in CLIENTS or rel in CLIENTS:
            continue
        for line, text in _branches(path.read_text(), names):
            if (rel, text) not in ALLOWED:
                found.append(f"hpccomm/{rel}:{line}: {text}")
    assert not found, "branches on op names (a missing field of an op's declaration):\n" + "\n".join(found)


def test_the_branch_finder_finds_branches():
    names = {"all_reduce", "recv"}
    assert [t for _, t in _branches('if op == "all_reduce":\n    pass\n', names)] == ["op == 'all_reduce'"]
    assert len(_branches('x = name in ("recv", "send")\n', names)) == 1
    assert _branches('x = op.name == other\n', names) == []
    assert len(_branches('x = name.endswith("_base")\n', {"_allgather_base"})) == 1  # (a part of a name)
    assert _branches('x = name.startswith("_")\n', {"_allgather_base"}) == []  # (one character: not a name)
    assert len(_branches('x = "recv" if receives else "send"\n', names)) == 1  # (an op's name chosen by a flag)
    assert _branches('x = op.matched_by if op else None\n', names) == []
