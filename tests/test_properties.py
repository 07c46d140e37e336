"""Property tests (hypothesis) under mpirun: random shapes (0-dim, empty,
non-contiguous views), dtypes, ReduceOps, roots, split sizes, per-rank sizes
and group shapes, checked against references each rank computes itself.

- all_reduce and reduce equal test_reduce.reference over every rank's input;
  reduce_scatter_tensor equals this rank's slice of it;
- all_gather (list form, a different size on every rank),
  all_gather_into_tensor, all_to_all_single (random splits, zeros included),
  broadcast, scatter and gather move bytes exactly (random bit patterns:
  NaN payloads and float8 included);
- the results of all_reduce, all_gather(_into_tensor) and broadcast are
  bit-identical on every rank of the group; inputs are left unchanged.

Every rank must draw the same examples in the same order and stop together:
the settings derandomize, keep no database and never shrink (shrinking
follows each rank's own outcomes), and tensor data come from a drawn seed and
a rank (torch.Generator), so that each rank makes every other rank's input
itself.  An example communicates first, then gathers the verdict of every
rank (:func:`agree`): all ranks fail the same example together, instead of one
stopping while the others wait in the next example's collective.

HPCCOMM_TEST_EXAMPLES sets the examples per test (default 25);
HPCCOMM_TEST_SEED=<int> draws another sequence of examples (the same on
every rank) instead of the derandomized one:
    HPCCOMM_TEST_EXAMPLES=300 HPCCOMM_TEST_SEED=7 bash tests/run.sh tests/test_properties.py
"""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import helpers
from helpers import MOVE_DTYPES, REDUCE_DTYPES, assert_close, same_on_all_ranks
from move_checks import Checks
from test_reduce import OPS, make_op, reference, supported

pytestmark = pytest.mark.mpi

EXAMPLES = int(os.environ.get("HPCCOMM_TEST_EXAMPLES", "25"))
SEED = os.environ.get("HPCCOMM_TEST_SEED", "")

# Identical on every rank: derandomized, no database, no shrinking, and no
# timing-dependent health check that could stop one rank's run and not another's.
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=EXAMPLES,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
    print_blob=False,
)


def prop(strategy):
    """``@given(case=strategy)`` under SETTINGS; with HPCCOMM_TEST_SEED, seeded
    by it (a seed overrides derandomize, and is the same on every rank)."""
    def wrap(fn):
        fn = SETTINGS(given(case=strategy)(fn))
        return seed(int(SEED))(fn) if SEED else fn

    return wrap


#: Layouts of a tensor an op writes into.
OUT_LAYOUTS = ("contiguous", "permuted", "strided", "offset")
#: Layouts of a tensor an op only reads: also a broadcast (stride-0) view.
IN_LAYOUTS = OUT_LAYOUTS + ("expanded",)

REDUCE_CASES = [(d, o) for d in REDUCE_DTYPES for o in OPS if supported(d, o)]
# torch's all_reduce itself refuses PRODUCT on complex tensors before the backend sees them.
ALL_REDUCE_CASES = [(d, o) for d, o in REDUCE_CASES if not (d.is_complex and o == "PRODUCT")]
#: PREMUL_SUM factors whose products with the data stay exact in every float dtype.
FACTORS = (0.5, 0.25, 2.0, -1.5, 0.75, 3.0, 1.0)


# -- strategies (drawn inside the test, after the world is up) ------------------------

#: 0 to 3 dims of 0 to 4 (the number of dims drawn first: a list strategy would mostly draw 0-dim).
shapes = st.integers(0, 3).flatmap(lambda ndim: st.tuples(*[st.integers(0, 4)] * ndim))


@st.composite
def per_rank(draw, strategy):
    """One draw of ``strategy`` per world rank (a group rank k uses entry k);
    the world size is read when drawing, once the world is up."""
    n = dist.get_world_size()
    return draw(st.lists(strategy, min_size=n, max_size=n))


@st.composite
def base(draw, layouts=OUT_LAYOUTS, **fields):
    """What every example has: a group (index into the ``groups`` fixture), a
    data seed and a layout per rank, plus ``fields`` (name -> strategy)."""
    case = {"group": draw(st.integers(0, 3)), "seed": draw(st.integers(0, 2 ** 32 - 1)),
            "layouts": draw(per_rank(st.sampled_from(layouts)))}
    for name, strategy in fields.items():
        case[name] = draw(strategy)
    return case


@st.composite
def reductions(draw, cases, read_only=False, **fields):
    """A reducing dtype and ReduceOp from ``cases``; ``read_only``: the op only
    reads the inputs, so they may be stride-0 (expanded) views."""
    dtype, opname = draw(st.sampled_from(cases))
    case = draw(base(IN_LAYOUTS if read_only else OUT_LAYOUTS, **fields))
    case.update(dtype=dtype, op=opname, small=draw(st.booleans()))
    if opname == "PREMUL_SUM":
        # The factor as a number, or as a 0-dim or 1-element tensor (the NCCL form).
        case.update(factor=draw(st.sampled_from(FACTORS)),
                    factor_form=draw(st.sampled_from(("float", "0-dim", "1-elem"))))
    return case


# -- data ---------------------------------------------------------------------------------

def values(case, rank: int, shape, dtype, piece: int = 0, move: bool = False) -> torch.Tensor:
    """Group rank ``rank``'s data (``piece`` tells its tensors apart), the same
    on every rank that computes it.  ``move``: random bit patterns (NaNs,
    infinities, float8 specials); else values whose reductions are exact or
    within helpers.tolerance: floats are multiples of 1/4 up to 4, integers
    small or spread over the dtype's range with room for a sum over the world."""
    g = torch.Generator().manual_seed((case["seed"] * 1_000_003 + rank * 7_919 + piece * 104_729) % 2 ** 63)
    shape = tuple(shape)
    numel = math.prod(shape)
    if dtype == torch.bool:
        flat = torch.randint(0, 2, (numel,), generator=g).bool()
    elif move:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        flat = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    elif dtype.is_floating_point or dtype.is_complex:
        k = torch.randint(-16, 17, (numel * (2 if dtype.is_complex else 1),), generator=g).double() / 4
        flat = (torch.complex(k[0::2], k[1::2]) if dtype.is_complex else k).to(dtype)
    else:
        info, n = torch.iinfo(dtype), dist.get_world_size()
        lo, hi = max(info.min, -2 ** 63) // n, min(info.max, 2 ** 63 - 1) // n
        if case.get("small"):
            lo, hi = max(lo, -4), min(hi, 5)
        flat = torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64).to(dtype)
    return flat.reshape(shape)


def blank(shape, dtype, layout: str) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` laid out as ``layout``: contiguous;
    permuted (dims reversed in memory, when 2 or more); strided (every other
    element of a wider tensor); offset (contiguous, not at its storage's start)."""
    shape = tuple(shape)
    if layout == "permuted" and len(shape) >= 2:
        order = tuple(reversed(range(len(shape))))
        return torch.empty(tuple(shape[i] for i in order), dtype=dtype).permute(order)
    if layout == "strided":
        if not shape:
            return torch.empty(2, dtype=dtype)[1]
        return torch.empty(shape[:-1] + (2 * shape[-1],), dtype=dtype)[..., ::2]
    if layout == "offset":
        return torch.empty(math.prod(shape) + 3, dtype=dtype)[3:].view(shape)
    return torch.empty(shape, dtype=dtype)


def logical(data: torch.Tensor, layout: str) -> torch.Tensor:
    """What a tensor made by :func:`laid_out` from ``data`` holds: for
    "expanded", row 0 repeated (a stride-0 view cannot hold distinct rows)."""
    if layout == "expanded" and data.dim() and data.shape[0]:
        return data[:1].expand(data.shape)
    return data


def laid_out(data: torch.Tensor, layout: str) -> torch.Tensor:
    """A new tensor holding ``logical(data, layout)`` in ``layout``."""
    if layout == "expanded":
        if data.dim() and data.shape[0]:
            return data[:1].clone().expand(data.shape)
        layout = "contiguous"
    t = blank(data.shape, data.dtype, layout)
    t.copy_(data)
    return t


def flat_pieces(shapes_, dtype, offset: int = 0):
    """Tensors of ``shapes_`` that are contiguous views laid end to end in one buffer."""
    counts = [math.prod(s) for s in shapes_]
    buf = torch.empty(sum(counts) + offset, dtype=dtype)[offset:]
    return [p.view(s) for p, s in zip(buf.split(counts), shapes_)]


# -- the verdict ----------------------------------------------------------------------------

@contextlib.contextmanager
def captured(check: Checks):
    """An exception while communicating becomes a failed check, reported through
    the gathered verdict (when every rank raises alike, no rank is left waiting)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - any error fails the example on every rank
        check.failures.append(f"raised {type(exc).__name__}: {exc}")


def agree(check: Checks, what: str, case: dict, g) -> None:
    """Gather every rank's failed checks; raise the same error on every rank if any failed."""
    everyone = helpers.verdict_comm().allgather(check.failures)
    bad = [r for r, f in enumerate(everyone) if f]
    if bad:
        shown = {k: (str(v)[6:] if isinstance(v, torch.dtype) else v) for k, v in case.items()}
        first = " | ".join(everyone[bad[0]][:3])
        raise AssertionError(f"{what} on group {g.name} (ranks {g.ranks}) with {shown}: failed on world rank(s) "
                             f"{bad}; world rank {bad[0]}: {first}"[:2000])


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements' bytes in row-major order, for any shape and strides
    (0-dim, empty with odd strides: cases move_checks.as_bytes cannot view)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def raw_all(ts) -> torch.Tensor:
    return torch.cat([raw(t) for t in ts]) if ts else torch.empty(0, dtype=torch.uint8)


def same(check: Checks, actual, expected, what: str) -> None:
    """``actual`` has ``expected``'s dtype, shape and bytes (deferred: see Checks)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        check.failures.append(f"{what}: {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} "
                              f"{tuple(expected.shape)}")
        return
    a, e = raw(actual), raw(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().reshape(-1)
        check.failures.append(f"{what}: {bad.numel()} of {a.numel()} bytes differ, first at byte {bad[0].item()}; "
                              f"got {a[:24].tolist()}, expected {e[:24].tolist()}")


def close(check: Checks, actual, expected, dtype, n_terms: int, what: str) -> None:
    try:
        assert actual.shape == expected.shape, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        assert_close(actual, expected, dtype, n_terms)
    except AssertionError as exc:
        check.failures.append(f"{what}: {str(exc)[:300]}")


def unchanged(check: Checks, t, before, what: str) -> None:
    check.true(torch.equal(raw(t), raw(before)), f"{what} changed")


def redop(case):
    if case["op"] != "PREMUL_SUM":
        return make_op(case["op"])
    form, f = case["factor_form"], case["factor"]
    factor = f if form == "float" else torch.tensor(f if form == "0-dim" else [f], dtype=torch.float64)
    return make_op("PREMUL_SUM", factor)


def expected_reduction(case, g, shape, layout_of=lambda k: "contiguous"):
    inputs = [logical(values(case, k, shape, case["dtype"]), layout_of(k)) for k in range(g.size)]
    return inputs, reference(inputs, case["dtype"], case["op"], case.get("factor", 0.5))


# -- reductions -------------------------------------------------------------------------------

@prop(reductions(ALL_REDUCE_CASES, shape=shapes))
def test_all_reduce(world, groups, case):
    """Every rank of the group gets the reduction, in its own tensor of any
    layout, bit-identical across the group."""
    g = groups[case["group"] % len(groups)]
    check, result = Checks(), None
    if g.member:
        with captured(check):
            inputs, expected = expected_reduction(case, g, case["shape"])
            t = laid_out(inputs[g.rank], case["layouts"][g.rank])
            dist.all_reduce(t, op=redop(case), group=g.pg)
            close(check, t, expected, case["dtype"], g.size, f"group rank {g.rank}")
            result = raw(t)
    check.true(same_on_all_ranks(result, g.ranks), "ranks hold different results")
    agree(check, "all_reduce", case, g)


@prop(reductions(REDUCE_CASES, shape=shapes, root=st.integers(0, 3), read_only=True))
def test_reduce(world, groups, case):
    """The root gets the reduction; other ranks' tensors (any layout, stride-0
    views included: reduce only reads them) are left as they were."""
    g = groups[case["group"] % len(groups)]
    check = Checks()
    if g.member:
        with captured(check):
            root = case["root"] % g.size
            layout = case["layouts"][g.rank]
            if g.rank == root and layout == "expanded":
                layout = "strided"  # the root's tensor is written
            inputs, expected = expected_reduction(case, g, case["shape"],
                                                  lambda k: "contiguous" if k == root else case["layouts"][k])
            t = laid_out(inputs[g.rank], layout)
            before = t.clone()
            dist.reduce(t, dst=g.ranks[root], op=redop(case), group=g.pg)
            if g.rank == root:
                close(check, t, expected, case["dtype"], g.size, f"group root {root}")
            else:
                unchanged(check, t, before, f"group rank {g.rank}'s tensor (not the root)")
    agree(check, "reduce", case, g)


@prop(reductions(REDUCE_CASES, shape=shapes, form=st.sampled_from(("stack", "cat", "flat")), in_place=st.booleans(),
                 out_layouts=per_rank(st.sampled_from(OUT_LAYOUTS)), read_only=True))
def test_reduce_scatter_tensor(world, groups, case):
    """Rank r gets elements [r·m, (r+1)·m) of the reduction of the inputs in
    row-major order (m = output numel), whatever the input's shape and layout;
    in place: the output is this rank's slot of a contiguous input."""
    g = groups[case["group"] % len(groups)]
    check = Checks()
    if g.member:
        with captured(check):
            shape, form = case["shape"], case["form"]
            if form == "cat" and shape:
                in_shape = (g.size * shape[0], *shape[1:])
            elif form == "flat":
                in_shape = (g.size * math.prod(shape),)
            else:
                in_shape = (g.size, *shape)
            in_place = case["in_place"]
            layout_of = (lambda k: "contiguous") if in_place else (lambda k: case["layouts"][k])
            inputs, full = expected_reduction(case, g, in_shape, layout_of)
            m = math.prod(shape)
            expected = full.reshape(-1)[g.rank * m:(g.rank + 1) * m].reshape(shape)
            inp = laid_out(values(case, g.rank, in_shape, case["dtype"]), layout_of(g.rank))
            before = inp.clone()
            if in_place:
                out = inp.view(-1)[g.rank * m:(g.rank + 1) * m].view(shape)
            else:
                out = blank(shape, case["dtype"], case["out_layouts"][g.rank])
            dist.reduce_scatter_tensor(out, inp, op=redop(case), group=g.pg)
            close(check, out, expected, case["dtype"], g.size, f"group rank {g.rank}")
            if not in_place:
                unchanged(check, inp, before, "the input")
    agree(check, "reduce_scatter_tensor", case, g)


# -- data movement ----------------------------------------------------------------------------

move_dtypes = st.sampled_from(MOVE_DTYPES)


@prop(base(IN_LAYOUTS, dtype=move_dtypes, shapes=per_rank(shapes),
           outputs=st.sampled_from(("separate", "flat", "flat-offset", "in-place")),
           out_layouts=per_rank(st.sampled_from(OUT_LAYOUTS))))
def test_all_gather(world, groups, case):
    """List form, each rank's tensor of its own shape (0-dim and empty
    included), into separate tensors of any layout, views of one buffer, or in
    place (the input is this rank's view of that buffer)."""
    g = groups[case["group"] % len(groups)]
    check, result = Checks(), None
    if g.member:
        with captured(check):
            dtype, form = case["dtype"], case["outputs"]
            shape_of = case["shapes"]
            layout_of = (lambda k: "contiguous") if form == "in-place" else (lambda k: case["layouts"][k])
            expected = [logical(values(case, k, shape_of[k], dtype, move=True), layout_of(k)) for k in range(g.size)]
            if form == "separate":
                outs = [blank(shape_of[k], dtype, case["out_layouts"][k]) for k in range(g.size)]
            else:
                outs = flat_pieces([shape_of[k] for k in range(g.size)], dtype, 5 if form == "flat-offset" else 0)
            if form == "in-place":
                inp = outs[g.rank]
                inp.copy_(expected[g.rank])
            else:
                inp = laid_out(values(case, g.rank, shape_of[g.rank], dtype, move=True), case["layouts"][g.rank])
            before = inp.clone()
            dist.all_gather(outs, inp, group=g.pg)
            for k in range(g.size):
                same(check, outs[k], expected[k], f"group rank {g.rank}, slot {k}")
            if form != "in-place":
                unchanged(check, inp, before, "the input")
            result = raw_all(outs)
    check.true(same_on_all_ranks(result, g.ranks), "ranks hold different results")
    agree(check, "all_gather", case, g)


@prop(base(IN_LAYOUTS, dtype=move_dtypes, shape=shapes, form=st.sampled_from(("stack", "cat", "flat")),
           in_place=st.booleans(), out_layouts=per_rank(st.sampled_from(OUT_LAYOUTS))))
def test_all_gather_into_tensor(world, groups, case):
    """The output, stacked, concatenated on dim 0 or flat and of any layout,
    holds the inputs in rank order (row-major); in place: the input is this
    rank's slot of a contiguous output."""
    g = groups[case["group"] % len(groups)]
    check, result = Checks(), None
    if g.member:
        with captured(check):
            dtype, shape, form = case["dtype"], case["shape"], case["form"]
            in_place = case["in_place"]
            layout_of = (lambda k: "contiguous") if in_place else (lambda k: case["layouts"][k])
            parts = [logical(values(case, k, shape, dtype, move=True), layout_of(k)) for k in range(g.size)]
            m = math.prod(shape)
            if form == "cat" and shape:
                out_shape = (g.size * shape[0], *shape[1:])
            elif form == "flat":
                out_shape = (g.size * m,)
            else:
                out_shape = (g.size, *shape)
            expected = torch.cat([p.reshape(-1) for p in parts]).reshape(out_shape)
            out = blank(out_shape, dtype, "contiguous" if in_place else case["out_layouts"][g.rank])
            if in_place:
                inp = out.view(-1)[g.rank * m:(g.rank + 1) * m].view(shape)
                inp.copy_(parts[g.rank])
            else:
                inp = laid_out(values(case, g.rank, shape, dtype, move=True), case["layouts"][g.rank])
            before = inp.clone()
            dist.all_gather_into_tensor(out, inp, group=g.pg)
            same(check, out, expected, f"group rank {g.rank}")
            if not in_place:
                unchanged(check, inp, before, "the input")
            result = raw(out)
    check.true(same_on_all_ranks(result, g.ranks), "ranks hold different results")
    agree(check, "all_gather_into_tensor", case, g)


@prop(base(IN_LAYOUTS, dtype=move_dtypes, row=st.lists(st.integers(0, 3), max_size=2).map(tuple),
           splits=per_rank(per_rank(st.integers(0, 3))), even=st.sampled_from((None, 0, 1, 2)),
           pass_splits=st.booleans(), out_layouts=per_rank(st.sampled_from(OUT_LAYOUTS))))
def test_all_to_all_single(world, groups, case):
    """Rank i sends rows [offset, offset + splits[i][j]) of its input to rank j,
    who stores them after those of ranks < i.  ``even`` (rows per rank): equal
    splits, passed or left to the op (``pass_splits``); else the drawn matrix."""
    g = groups[case["group"] % len(groups)]
    check = Checks()
    if g.member:
        with captured(check):
            dtype, row, n, r = case["dtype"], case["row"], g.size, g.rank
            even = case["even"]
            splits = [[even if even is not None else case["splits"][i][j] for j in range(n)] for i in range(n)]
            ins = [logical(values(case, i, (sum(splits[i]), *row), dtype, move=True), case["layouts"][i])
                   for i in range(n)]
            pieces = [ins[i][sum(splits[i][:r]):sum(splits[i][:r + 1])] for i in range(n)]
            expected = torch.cat(pieces)
            inp = laid_out(values(case, r, (sum(splits[r]), *row), dtype, move=True), case["layouts"][r])
            before = inp.clone()
            out = blank(expected.shape, dtype, case["out_layouts"][r])
            explicit = even is None or case["pass_splits"]
            dist.all_to_all_single(out, inp,
                                   output_split_sizes=[splits[i][r] for i in range(n)] if explicit else None,
                                   input_split_sizes=splits[r] if explicit else None, group=g.pg)
            same(check, out, expected, f"group rank {r}")
            unchanged(check, inp, before, "the input")
    agree(check, "all_to_all_single", case, g)


@prop(base(OUT_LAYOUTS, dtype=move_dtypes, shape=shapes, root=st.integers(0, 3)))
def test_broadcast(world, groups, case):
    """Every rank's tensor, of any layout, ends up holding the root's bytes."""
    g = groups[case["group"] % len(groups)]
    check, result = Checks(), None
    if g.member:
        with captured(check):
            root = case["root"] % g.size
            expected = values(case, root, case["shape"], case["dtype"], move=True)
            # Other ranks start from data of their own, which must be overwritten.
            t = laid_out(values(case, g.rank, case["shape"], case["dtype"], move=True), case["layouts"][g.rank])
            dist.broadcast(t, src=g.ranks[root], group=g.pg)
            same(check, t, expected, f"group rank {g.rank} (root {root})")
            result = raw(t)
    check.true(same_on_all_ranks(result, g.ranks), "ranks hold different results")
    agree(check, "broadcast", case, g)


@prop(base(IN_LAYOUTS, dtype=move_dtypes, shape=shapes, root=st.integers(0, 3),
           pieces=st.sampled_from(("separate", "flat", "flat-offset", "in-place")),
           out_layouts=per_rank(st.sampled_from(OUT_LAYOUTS))))
def test_scatter(world, groups, case):
    """Rank j gets the root's piece j; the root's scatter_list is separate
    tensors of any layout (``layouts``) or views of one buffer, its output
    then its own piece of that buffer (in place) or a tensor of its own."""
    g = groups[case["group"] % len(groups)]
    check = Checks()
    if g.member:
        with captured(check):
            dtype, shape = case["dtype"], case["shape"]
            root = case["root"] % g.size
            pieces = [values(case, root, shape, dtype, piece=j, move=True) for j in range(g.size)]
            scatter_list = None
            if g.rank == root:
                if case["pieces"] == "separate":
                    scatter_list = [laid_out(p, case["layouts"][j]) for j, p in enumerate(pieces)]
                    pieces = [logical(p, case["layouts"][j]) for j, p in enumerate(pieces)]
                else:
                    scatter_list = flat_pieces([shape] * g.size, dtype, 2 if case["pieces"] == "flat-offset" else 0)
                    for t, p in zip(scatter_list, pieces):
                        t.copy_(p)
                before = [t.clone() for t in scatter_list]
            elif case["pieces"] == "separate":  # the root's layouts decide what it sends
                pieces = [logical(p, case["layouts"][j]) for j, p in enumerate(pieces)]
            if g.rank == root and case["pieces"] == "in-place":
                out = scatter_list[root]
            else:
                out = blank(shape, dtype, case["out_layouts"][g.rank])
            dist.scatter(out, scatter_list, src=g.ranks[root], group=g.pg)
            same(check, out, pieces[g.rank], f"group rank {g.rank} (root {root})")
            if scatter_list is not None:
                for j, (t, b) in enumerate(zip(scatter_list, before)):
                    unchanged(check, t, b, f"scatter_list[{j}]")
    agree(check, "scatter", case, g)


@prop(base(IN_LAYOUTS, dtype=move_dtypes, shape=shapes, root=st.integers(0, 3),
           outputs=st.sampled_from(("separate", "flat", "flat-offset", "in-place")),
           out_layouts=per_rank(st.sampled_from(OUT_LAYOUTS))))
def test_gather(world, groups, case):
    """The root's gather_list (separate tensors of any layout, or views of one
    buffer) gets every rank's input in rank order; inputs are left unchanged.
    In place: the root's input is its own slot of that buffer."""
    g = groups[case["group"] % len(groups)]
    check = Checks()
    if g.member:
        with captured(check):
            dtype, shape = case["dtype"], case["shape"]
            root = case["root"] % g.size
            in_place = case["outputs"] == "in-place"

            def layout_of(k):
                return "contiguous" if in_place and k == root else case["layouts"][k]

            inp = laid_out(values(case, g.rank, shape, dtype, move=True), layout_of(g.rank))
            gather_list = None
            if g.rank == root:
                if case["outputs"] == "separate":
                    gather_list = [blank(shape, dtype, case["out_layouts"][k]) for k in range(g.size)]
                else:
                    gather_list = flat_pieces([shape] * g.size, dtype, 1 if case["outputs"] == "flat-offset" else 0)
                if in_place:
                    gather_list[root].copy_(inp)
                    inp = gather_list[root]
            before = inp.clone()
            dist.gather(inp, gather_list, dst=g.ranks[root], group=g.pg)
            if gather_list is not None:
                for k in range(g.size):
                    expected = logical(values(case, k, shape, dtype, move=True), layout_of(k))
                    same(check, gather_list[k], expected, f"group root {root}, slot {k}")
            unchanged(check, inp, before, f"group rank {g.rank}'s input")
    agree(check, "gather", case, g)
