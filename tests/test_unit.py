"""Unit tests: no MPI launch, plain pytest.

Configuration parsing, the dtype table, the ReduceOp support table, the
checks every op runs before communicating (against a group with no
communicator: touching it fails the test) and the format of their messages,
the launcher checks and errors (the layering test: tests/test_layers.py).

A few tests need MPI datatypes; they start MPI as a singleton in this process
(fixture ``MPI``), which ``mpirun`` is not needed for.
"""
from __future__ import annotations

import ast
import os
import pickle
import re
import threading
import time
from types import SimpleNamespace
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import hpccomm
import helpers
from hpccomm import _mpi, config, errors
from hpccomm import _compat as compat
from hpccomm._core import group as _group
from hpccomm._start import bootstrap
from hpccomm._ops import checks, staging
from hpccomm._ops import alltoall, gather, p2p, reduce, scatter
from helpers import MOVE_DTYPES, FakeCudaTensor

R = dist.ReduceOp
T = R.RedOpType
PKG = Path(hpccomm.__file__).resolve().parent
ALL_REDOPS = [T.SUM, T.PRODUCT, T.MIN, T.MAX, T.AVG, T.BAND, T.BOR, T.BXOR, T.PREMUL_SUM]





# --------------------------------------------------------------------------
# fakes
# --------------------------------------------------------------------------


def fake_group(rank: int = 1, size: int = 4):
    return helpers.fake_group(rank, size)


@pytest.fixture(scope="module")
def MPI():
    """mpi4py.MPI, MPI started as a singleton in this process."""
    return _mpi.mpi()


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------

def test_options_are_declared_well():
    assert config.OPTIONS, "no options"
    for name, opt in config.OPTIONS.items():
        assert name == opt.name and re.fullmatch(r"HPCCOMM_[A-Z0-9_]+", name), name
        assert opt.doc and opt.doc[0].isupper() and "  " not in opt.doc, (name, opt.doc)
        if opt.choices:
            assert opt.default in opt.choices, name


@pytest.mark.parametrize("name", sorted(config.OPTIONS))
def test_unset_or_empty_gives_default(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    assert config.get(name) == config.OPTIONS[name].default
    monkeypatch.setenv(name, "")
    assert config.get(name) == config.OPTIONS[name].default


@pytest.mark.parametrize("raw,value", [("7", 7), (" 12 ", 12), ("0x10", 16), ("2147483647", 2**31 - 1)])
def test_max_mpi_count_parses(monkeypatch, raw, value):
    monkeypatch.setenv("HPCCOMM_MAX_MPI_COUNT", raw)
    assert config.get("HPCCOMM_MAX_MPI_COUNT") == value


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "1.5", "1e6"])
def test_bad_max_mpi_count_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("HPCCOMM_MAX_MPI_COUNT", raw)
    with pytest.raises(hpccomm.ConfigError, match=rf"^HPCCOMM_MAX_MPI_COUNT={re.escape(repr(raw))} is not a "
                       r"valid positive integer: \S") as info:
        config.get("HPCCOMM_MAX_MPI_COUNT")
    assert isinstance(info.value, ValueError) and isinstance(info.value, hpccomm.HpccommError)
    assert info.value.variable == "HPCCOMM_MAX_MPI_COUNT"
    assert "  " not in str(info.value)


@pytest.mark.parametrize("raw", ["70000", "-1", "http"])
def test_bad_store_port_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("HPCCOMM_STORE_PORT", raw)
    with pytest.raises(hpccomm.ConfigError, match=rf"^HPCCOMM_STORE_PORT={re.escape(repr(raw))} is not a "
                       r"valid port"):
        config.get("HPCCOMM_STORE_PORT")


def test_log_level_choices(monkeypatch):
    monkeypatch.setenv("HPCCOMM_LOG", " info ")
    assert config.get("HPCCOMM_LOG") == "INFO"
    monkeypatch.setenv("HPCCOMM_LOG", "loud")
    with pytest.raises(hpccomm.ConfigError, match=r"^HPCCOMM_LOG='loud' is not one of CRITICAL, ERROR, WARNING, "
                       r"INFO, DEBUG$"):
        config.get("HPCCOMM_LOG")


def test_bad_log_level_refused_at_init(monkeypatch):
    """init reads HPCCOMM_LOG first: a bad value fails before MPI starts."""
    monkeypatch.setenv("HPCCOMM_LOG", "loud")
    with mock.patch.object(_mpi, "mpi", side_effect=AssertionError("MPI started before the config was read")):
        with pytest.raises(hpccomm.ConfigError, match="HPCCOMM_LOG"):
            bootstrap._configure_logging()


def test_unknown_option_name():
    with pytest.raises(KeyError):
        config.get("HPCCOMM_NO_SUCH_THING")


def _hpccomm_sources():
    return sorted(p for p in PKG.rglob("*.py"))


def test_every_hpccomm_variable_is_declared():
    """Every HPCCOMM_* name in the package is an option, and only config.py
    reads the environment for one."""
    undeclared, direct = set(), []
    for path in _hpccomm_sources():
        text = path.read_text()
        for name in re.findall(r"\bHPCCOMM_[A-Z][A-Z0-9_]*", text):
            if name not in config.OPTIONS and not name.endswith("_"):  # a prefix (HPCCOMM_TEST_) is no name
                undeclared.add(f"{path.relative_to(PKG)}: {name}")
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("HPCCOMM_") and _reads_env(path, node, text):
                direct.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not undeclared, f"not in config.OPTIONS: {sorted(undeclared)}"
    assert not direct, f"read HPCCOMM_* with os.environ/getenv instead of config.get: {direct}"


def _reads_env(path, node, text) -> bool:
    line = text.splitlines()[node.lineno - 1]
    return "environ" in line or "getenv" in line


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------

#: torch dtypes hpccomm deliberately does not handle (sub-byte, packed,
#: quantized, bit containers, complex32: torch views complex as real first).
REFUSED_DTYPES = {"complex32", "bcomplex32", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits1x8", "bits2x4",
                  "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2",
                  *(f"int{k}" for k in range(1, 8)), *(f"uint{k}" for k in range(1, 8))}


def _torch_dtypes():
    return {str(v).replace("torch.", ""): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def test_every_torch_dtype_has_a_decision():
    """A dtype torch adds must be put in DTYPES or refused on purpose."""
    undecided = [n for n, d in _torch_dtypes().items() if d not in _mpi.DTYPES and n not in REFUSED_DTYPES]
    assert not undecided, f"torch dtypes neither in _mpi.DTYPES nor refused: {sorted(undecided)}"
    both = [n for n, d in _torch_dtypes().items() if d in _mpi.DTYPES and n in REFUSED_DTYPES]
    assert not both, both


def test_tested_dtypes_are_in_the_table():
    assert [d for d in MOVE_DTYPES if d not in _mpi.DTYPES] == []


def _expected_kind(dtype: torch.dtype) -> str:
    name = str(dtype)
    if dtype == torch.bool:
        return "bool"
    if "float8" in name:
        return "bytes"
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "int"


@pytest.mark.parametrize("dtype", list(_mpi.DTYPES), ids=[str(d)[6:] for d in _mpi.DTYPES])
def test_dtype_entry_is_sensible(MPI, dtype):
    info = _mpi.DTYPES[dtype]
    assert info.kind == _expected_kind(dtype), (dtype, info)
    assert info.kind in _mpi.ALLOWED_OPS
    mtype = getattr(MPI, info.move, None)
    assert mtype is not None and mtype != MPI.DATATYPE_NULL, (dtype, info.move)
    assert mtype.Get_size() == torch.empty(0, dtype=dtype).element_size(), (dtype, info.move)
    assert _mpi.mpi_type(dtype) == mtype
    if info.kind == "float":
        assert info.move == {torch.float32: "FLOAT", torch.float64: "DOUBLE"}[dtype]
    elif info.kind == "complex":
        assert info.move == {torch.complex64: "C_FLOAT_COMPLEX", torch.complex128: "C_DOUBLE_COMPLEX"}[dtype]
    elif info.kind == "int":
        # MIN/MAX/AVG depend on the signedness MPI is told
        assert info.move.startswith("UINT") == (not dtype.is_signed), (dtype, info.move)
        assert info.move.endswith("_T")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("dtype", [torch.bits8, torch.complex32, torch.quint8, torch.float4_e2m1fn_x2])
def test_unknown_dtype_is_rejected(dtype):
    assert dtype not in _mpi.DTYPES
    with pytest.raises(KeyError):
        _mpi.mpi_type(dtype)
    t = torch.empty(2, dtype=dtype) if dtype != torch.quint8 else torch.quantize_per_tensor(
        torch.zeros(2), 0.1, 0, torch.quint8)
    with pytest.raises(hpccomm.OpTypeError, match=rf"tensor has dtype {re.escape(str(dtype))}, which hpccomm "
                       r"cannot send\. Supported: float32, float64, float16, bfloat16"):
        checks.check_tensor(fake_group(), "broadcast", t)


# --------------------------------------------------------------------------
# ReduceOps
# --------------------------------------------------------------------------

def _supported(dtype, redop) -> bool:
    """torch's semantics, independent of hpccomm's tables."""
    if "float8" in str(dtype):
        return False
    if dtype == torch.bool:
        return redop not in (T.AVG, T.PREMUL_SUM)
    if dtype.is_complex:
        return redop in (T.SUM, T.PRODUCT, T.AVG, T.PREMUL_SUM)
    if dtype.is_floating_point:
        return redop not in (T.BAND, T.BOR, T.BXOR)
    return redop != T.PREMUL_SUM


def _redop(kind):
    return dist._make_nccl_premul_sum(2.5) if kind == T.PREMUL_SUM else R(kind)


TABLE = [(d, k) for d in _mpi.DTYPES for k in ALL_REDOPS]


@pytest.mark.parametrize("dtype,kind", TABLE, ids=[f"{str(d)[6:]}-{str(k).split('.')[-1]}" for d, k in TABLE])
def test_reduce_op_support_table(dtype, kind):
    g = fake_group()
    if _supported(dtype, kind):
        got, factor = checks.reduce_op(g, "all_reduce", dtype, _redop(kind))
        assert got == kind
        assert factor == (2.5 if kind == T.PREMUL_SUM else None)
        if kind != T.PREMUL_SUM:  # a bare RedOpType is accepted too
            assert checks.reduce_op(g, "all_reduce", dtype, kind) == (kind, None)
    else:
        name = str(kind).split(".")[-1]
        with pytest.raises(hpccomm.OpTypeError) as info:
            checks.reduce_op(g, "all_reduce", dtype, _redop(kind))
        msg = str(info.value)
        assert msg.startswith("hpccomm all_reduce (op #7 on group 'fake', rank 1/4): "), msg
        assert f"ReduceOp.{name}" in msg or "can be moved but not reduced" in msg, msg
        assert str(dtype) in msg or "complex" in msg or "bool" in msg, msg
        _assert_well_formed(msg)


def test_premul_sum_tensor_factor():
    factor = torch.tensor([0.25], dtype=torch.float64)
    kind, got = checks.reduce_op(fake_group(), "all_reduce", torch.float32, dist._make_nccl_premul_sum(factor))
    assert kind == T.PREMUL_SUM and torch.equal(got, factor)


def test_not_a_reduce_op():
    with pytest.raises(hpccomm.OpTypeError, match=r"'max' is not a torch\.distributed\.ReduceOp$"):
        checks.reduce_op(fake_group(), "all_reduce", torch.float32, "max")


def test_mpi_ops(MPI):
    """Native ops where MPI computes right; a user-defined op (torch kernels)
    for 16-bit floats, never MPI's integer arithmetic on their bits; bool's
    SUM/PRODUCT are logical or/and."""
    predefined = [getattr(MPI, n) for n in ("SUM", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR", "LOR", "LAND")]
    try:
        for dtype, info in _mpi.DTYPES.items():
            for kind in _mpi.ALLOWED_OPS[info.kind]:
                op = _mpi.mpi_op(dtype, kind)
                if info.kind == "half":
                    assert op not in predefined and op != MPI.OP_NULL and op.Is_commutative(), (dtype, kind)
                elif info.kind == "bool" and kind in (T.SUM, T.PRODUCT):
                    assert op == (MPI.MAX if kind == T.SUM else MPI.MIN), (dtype, kind)
                else:
                    expected = {T.SUM: MPI.SUM, T.AVG: MPI.SUM, T.PREMUL_SUM: MPI.SUM, T.PRODUCT: MPI.PROD,
                                T.MIN: MPI.MIN, T.MAX: MPI.MAX, T.BAND: MPI.BAND, T.BOR: MPI.BOR,
                                T.BXOR: MPI.BXOR}[kind]
                    assert op == expected, (dtype, kind)
    finally:
        _mpi.free_user_ops()


# --------------------------------------------------------------------------
# checks before communication, and their messages
# --------------------------------------------------------------------------

_PREFIX = re.compile(r"^hpccomm (?P<op>[a-z_]+) \((?:p2p )?op #(?P<seq>\d+) on group '(?P<group>[^']+)', "
                     r"rank (?P<rank>\d+)/(?P<size>\d+)\): (?P<rest>.+)$", re.DOTALL)


def _assert_well_formed(msg: str) -> None:
    """No doubled spaces or periods, no stray space before punctuation, no
    doubled word, no unformatted placeholder, each sentence starts a capital."""
    m = _PREFIX.match(msg)
    assert m, f"not 'hpccomm OP (op #N on group 'G', rank R/N): ...': {msg!r}"
    rest = m.group("rest")
    assert "  " not in msg, f"doubled space: {msg!r}"
    assert not re.search(r"\s[,;:)]|\s\.(?=\s|$)", msg), f"space before punctuation: {msg!r}"
    assert ".." not in rest.replace("0..", "").replace("...", ""), f"doubled period: {msg!r}"
    assert not msg.endswith((".", " ", ":", ",")), f"ragged end: {msg!r}"
    assert not re.search(r"\b([A-Za-z]{2,}) \1\b", msg), f"doubled word: {msg!r}"
    assert "{" not in msg and "}" not in msg, f"unformatted placeholder: {msg!r}"
    assert "torch.torch." not in msg
    for sentence in re.split(r"(?<=[a-z0-9)\]])\. (?=\S)", rest)[1:]:
        # a sentence may begin with the op's own name ("gather needs ...")
        assert sentence[0].isupper() or sentence.split()[0] == m.group("op"), \
            f"sentence after the first does not start with a capital: {msg!r}"


def _t(*shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype)


def _meta():
    return torch.empty(2, device="meta")


def _device_mock(device: str):
    """A stand-in passing isinstance(torch.Tensor) on ``device`` (cuda:1, xpu:1: no such device here)."""
    m = mock.MagicMock(spec=torch.Tensor)
    m.layout, m.device, m.dtype, m.is_cpu = torch.strided, torch.device(device), torch.float32, False
    m.is_cuda = m.device.type == "cuda"
    m.numel.return_value = 2
    return m


S = T.SUM
# (name, op, function, args after the group, fragment of what the message must say).
# The fake group has rank 1 of 4; root 0 is another rank.
BAD = [
    ("not-a-tensor", "all_reduce", reduce.ALL_REDUCE.check, ([[1.0]], S), r"tensor is a list, not a torch\.Tensor"),
    ("not-a-list", "all_reduce", reduce.ALL_REDUCE.check, ("x", S), r"tensors is a str, not a list of tensors"),
    ("two-tensors", "all_reduce", reduce.ALL_REDUCE.check, ([_t(2), _t(2)], S), r"tensors has 2 tensors, expected 1$"),
    ("sparse", "broadcast", scatter.BROADCAST.check, ([_t(2).to_sparse()], 0),  # (all_reduce takes sparse: gloo's sum)
     r"tensor has layout torch\.sparse_coo; only dense \(strided\) tensors can be sent\. Call \.to_dense\(\) first"),
    ("meta", "all_reduce", reduce.ALL_REDUCE.check, ([_meta()], S), r"tensor is a meta tensor: it has no data"),
    ("xpu-mock", "broadcast", scatter.BROADCAST.check, ([_device_mock("xpu:1")], 0),
     r"tensor is on device xpu:1; hpccomm moves CPU and CUDA tensors\. Move it to the CPU with \.cpu\(\)"),
    ("bits8", "all_reduce", reduce.ALL_REDUCE.check, ([torch.zeros(2, dtype=torch.bits8)], S),
     r"tensor has dtype torch\.bits8, which hpccomm cannot send"),
    ("band-float", "all_reduce", reduce.ALL_REDUCE.check, ([_t(2)], T.BAND), r"ReduceOp\.BAND needs an integer or bool"),
    ("avg-bool", "all_reduce", reduce.ALL_REDUCE.check, ([_t(2, dtype=torch.bool)], T.AVG),
     r"ReduceOp\.AVG is not defined for bool tensors"),
    ("premul-int", "all_reduce", reduce.ALL_REDUCE.check, ([_t(2, dtype=torch.int32)], dist._make_nccl_premul_sum(2.0)),
     r"ReduceOp\.PREMUL_SUM needs a floating-point or complex tensor, got torch\.int32"),
    ("float8", "all_reduce", reduce.ALL_REDUCE.check, ([_t(2).to(torch.float8_e4m3fn)], T.MAX),
     r"torch\.float8_e4m3fn can be moved but not reduced"),
    ("coalesced-float8", "all_reduce_coalesced", reduce.ALL_REDUCE_COALESCED.check,
     ([_t(2), _t(2).to(torch.float8_e5m2)], S), r"torch\.float8_e5m2 can be moved but not reduced"),
    ("reduce-root", "reduce", reduce.REDUCE.check, ([_t(2)], 4, S), r"\w+ 4 is not a rank of this group of size 4"),
    ("reduce-root-float", "reduce", reduce.REDUCE.check, ([_t(2)], 1.0, S), r"\w+ 1\.0 is not a rank of this group"),
    ("reduce-min-complex", "reduce", reduce.REDUCE.check, ([_t(2, dtype=torch.complex64)], 0, T.MIN),
     r"ReduceOp\.MIN is not defined for complex tensors"),
    ("rst-size", "reduce_scatter_tensor", reduce.REDUCE_SCATTER_TENSOR.check, (_t(3), _t(8), S),
     r"input has 8 elements, expected output's 3 × group size 4 = 12"),
    ("rst-dtype", "reduce_scatter_tensor", reduce.REDUCE_SCATTER_TENSOR.check, (_t(2), _t(8, dtype=torch.float64), S),
     r"input has dtype torch\.float64 but output has torch\.float32"),
    ("rs-len", "reduce_scatter", reduce.REDUCE_SCATTER.check, ([_t(2)], [[_t(2)] * 3], S),
     r"input_list has 3 tensors, expected 4 \(one per rank of the group\)"),
    ("rs-entry", "reduce_scatter", reduce.REDUCE_SCATTER.check, ([_t(2)], [[_t(2), _t(3), _t(2), _t(2)]], S),
     r"input_list\[1\] has 3 elements but output has 2\. Every input must have the output's size"),
    ("rs-dtype", "reduce_scatter", reduce.REDUCE_SCATTER.check, ([_t(2)], [[_t(2, dtype=torch.int8)] * 4], S),
     r"input_list\[0\] has dtype torch\.int8 but the input has torch\.float32\. All tensors of one op"),
    ("rstc-len", "reduce_scatter_tensor_coalesced", reduce.REDUCE_SCATTER_TENSOR_COALESCED.check,
     ([_t(2)], [_t(8), _t(8)], S), r"inputs has 2 tensors, expected 1$"),
    ("agit-size", "all_gather_into_tensor", gather.ALL_GATHER_INTO_TENSOR.check, (_t(9), _t(2)),
     r"output has 9 elements, expected input's 2 × group size 4 = 8"),
    ("agit-dtype", "all_gather_into_tensor", gather.ALL_GATHER_INTO_TENSOR.check, (_t(8, dtype=torch.int64), _t(2)),
     r"input has dtype torch\.float32 but output has torch\.int64"),
    ("agit-meta", "all_gather_into_tensor", gather.ALL_GATHER_INTO_TENSOR.check, (_t(8), _meta()),
     r"input is a meta tensor"),
    ("ag-len", "all_gather", gather.ALL_GATHER.check, ([[_t(2)] * 5], [_t(2)]),
     r"tensor_list has 5 tensors, expected 4 \(one per rank of the group\)"),
    ("ag-slot", "all_gather", gather.ALL_GATHER.check, ([[_t(2), _t(3), _t(2), _t(2)]], [_t(2)]),
     r"tensor_list\[1\] \(this rank's slot\) has 3 elements but the input has 2"),
    ("ag-dtype", "all_gather", gather.ALL_GATHER.check, ([[_t(2, dtype=torch.float16)] * 4], [_t(2)]),
     r"tensor_list\[0\] has dtype torch\.float16 but the input has torch\.float32"),
    ("agc-len", "all_gather_coalesced", gather.ALL_GATHER_COALESCED.check, ([[_t(2)] * 4], [_t(2), _t(2)]),
     r"output_tensor_lists has 1 tensors, expected 4 \(one per rank of the group\)$"),
    ("agc-inner", "all_gather_coalesced", gather.ALL_GATHER_COALESCED.check, ([[_t(2)] * 2] * 3 + [[_t(2)]], [_t(2), _t(2)]),
     r"output_tensor_lists\[3\] has 1 tensors, expected 2$"),
    ("agitc-len", "all_gather_into_tensor_coalesced", gather.ALL_GATHER_INTO_TENSOR_COALESCED.check,
     ([_t(8)], [_t(2), _t(2)]), r"inputs has 2 tensors, expected 1$"),
    ("gather-root", "gather", gather.GATHER.check, ([[]], [_t(2)], -1), r"dst -1 is not a rank of this group of size 4"),
    ("gather-nonroot-list", "gather", gather.GATHER.check, ([[_t(2)] * 4], [_t(2)], 0),
     r"gather_list must be empty or None on rank 1, which is not the destination \(rank 0\)"),
    ("gather-root-len", "gather", gather.GATHER.check, ([[_t(2)] * 3], [_t(2)], 1),
     r"gather_list has 3 tensors, expected 4 \(one per rank of the group\)"),
    ("gather-root-entry", "gather", gather.GATHER.check, ([[_t(2), _t(2), _t(2), _t(5)]], [_t(2)], 1),
     r"gather_list\[3\] has 5 elements but the input has 2\. gather needs tensors of one size on every rank"),
    ("bcast-root", "broadcast", scatter.BROADCAST.check, ([_t(2)], 4), r"src 4 is not a rank of this group of size 4\. "
     r"Pass a group rank in 0\.\.size-1"),
    ("scatter-root", "scatter", scatter.SCATTER.check, ([_t(2)], [], 9), r"src 9 is not a rank"),
    ("scatter-nonroot-list", "scatter", scatter.SCATTER.check, ([_t(2)], [[_t(2)] * 4], 0),
     r"scatter_list must be empty or None on rank 1, which is not the source \(rank 0\)"),
    ("scatter-root-len", "scatter", scatter.SCATTER.check, ([_t(2)], [[_t(2)] * 2], 1),
     r"scatter_list has 2 tensors, expected 4"),
    ("scatter-root-dtype", "scatter", scatter.SCATTER.check, ([_t(2)], [[_t(2, dtype=torch.int16)] * 4], 1),
     r"scatter_list\[0\] has dtype torch\.int16 but the input has torch\.float32"),
    ("a2as-splits-len", "all_to_all_single", alltoall.ALL_TO_ALL_SINGLE.check, (_t(4), _t(4), [1] * 4, [1] * 3),
     r"input_split_sizes has 3 entries, expected 4 \(one per rank\)"),
    ("a2as-splits-sum", "all_to_all_single", alltoall.ALL_TO_ALL_SINGLE.check, (_t(4), _t(4), [1] * 4, [2, 1, 1, 1]),
     r"input_split_sizes \[2, 1, 1, 1\] do not add up to input's 4 rows \(dim 0\)"),
    ("a2as-rows", "all_to_all_single", alltoall.ALL_TO_ALL_SINGLE.check, (_t(4), _t(6), [], []),
     r"input has 6 rows, not divisible by the group size 4\. Pass input_split_sizes"),
    ("a2as-dtype", "all_to_all_single", alltoall.ALL_TO_ALL_SINGLE.check, (_t(4, dtype=torch.int32), _t(4), [], []),
     r"input has dtype torch\.float32 but output has torch\.int32"),
    ("a2a-len", "all_to_all", alltoall.ALL_TO_ALL.check, ([_t(1)] * 4, [_t(1)] * 5),
     r"input_tensor_list has 5 tensors, expected 4"),
    ("a2a-dtype", "all_to_all", alltoall.ALL_TO_ALL.check, ([_t(1, dtype=torch.int32)] * 4, [_t(1)] * 4),
     r"output_tensor_list\[0\] has dtype torch\.int32 but the input has torch\.float32"),
    ("send-dst", "send", p2p.SEND.check, ([_t(2)], 4, 0), r"dst 4 is not a rank of this group of size 4"),
    ("send-tag", "send", p2p.SEND.check, ([_t(2)], 0, -3), r"tag -3 is outside 0\.\.32767 \(MPI_TAG_UB\)"),
    ("recv-src", "recv", p2p.RECV.check, ([_t(2)], -2, 0), r"src -2 is not a rank of this group of size 4"),
    ("recv-tag", "recv", p2p.RECV.check, ([_t(2)], None, 40000), r"tag 40000 is outside 0\.\.32767"),
]


@pytest.mark.parametrize("name,op,fn,args,what", BAD, ids=[b[0] for b in BAD])
def test_refused_before_communication(name, op, fn, args, what):
    """Every op's checks (its declaration's ``check``, which every route runs
    once) refuse bad input without touching its communicator, with an
    OpError naming the op, the group, rank/size and what is wrong."""
    g = fake_group()
    with pytest.raises(errors.OpError) as info:
        fn(g, *args)
    exc = info.value
    msg = str(exc)
    assert isinstance(exc, (hpccomm.OpValueError, hpccomm.OpTypeError)), type(exc)
    assert exc.op == op, (exc.op, msg)
    label = "p2p op" if op in ("send", "recv") else "op"  # point-to-point ops are numbered apart
    assert msg.startswith(f"hpccomm {op} ({label} #7 on group 'fake', rank 1/4): "), msg
    assert re.search(what, msg), f"{what!r} not in {msg!r}"
    _assert_well_formed(msg)


@pytest.mark.parametrize("make,device", [(lambda: _t(2).as_subclass(FakeCudaTensor), "cuda:0"),
                                         (lambda: _device_mock("cuda:1"), "cuda:1")], ids=["fake-cuda", "cuda-mock"])
def test_cuda_tensors_pass_the_checks_and_name_their_device(make, device):
    """A CUDA tensor is not refused by an op's checks (every route runs the
    same checks): the op path finds its device and takes it to the route its
    group has for that device (hpccomm._gpu.dispatch), never by catching a
    refusal of the CPU path."""
    from hpccomm._gpu import detect

    g, t = fake_group(), make()
    call = scatter.BROADCAST.check(g, [t], 0)
    assert call.signature.describe() == "broadcast(float32[2], root 0)"
    assert detect.cuda_device(g, scatter.BROADCAST, ([t], 0)) == torch.device(device)
    assert scatter.BROADCAST.key(([t], 0)) is None  # (never a cached CPU call)


def test_message_check_catches_bad_messages():
    """The format check itself can fail."""
    for bad in ["hpccomm x (op #1 on group 'g', rank 0/1): a  b",
                "hpccomm x (op #1 on group 'g', rank 0/1): the the tensor",
                "hpccomm x (op #1 on group 'g', rank 0/1): tensor {what}",
                "hpccomm x (op #1 on group 'g', rank 0/1): bad. fix it",
                "hpccomm x (op #1 on group 'g', rank 0/1): bad .",
                "hpccomm x rank 0/1: bad"]:
        with pytest.raises(AssertionError):
            _assert_well_formed(bad)


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------

def test_op_error_format():
    e = errors.OpValueError("broadcast", "op #3 on group 'g', rank 0/2", "src 5 is bad", "Pass 0 or 1")
    assert str(e) == "hpccomm broadcast (op #3 on group 'g', rank 0/2): src 5 is bad. Pass 0 or 1"
    assert (e.op, e.where, e.what, e.fix) == ("broadcast", "op #3 on group 'g', rank 0/2", "src 5 is bad",
                                             "Pass 0 or 1")
    e = errors.OpTypeError("send", "w", "no fix")
    assert str(e) == "hpccomm send (w): no fix" and e.fix == ""
    assert isinstance(e, TypeError) and isinstance(errors.OpValueError("a", "w", "x"), ValueError)


def test_op_error_tidies_its_parts():
    """Stray periods and spaces at the joins never double up."""
    e = errors.OpValueError("gather", "w", " dst 5 is bad. ", " Pass a group rank. ")
    assert str(e) == "hpccomm gather (w): dst 5 is bad. Pass a group rank"


@pytest.mark.parametrize("exc", [
    errors.OpValueError("all_reduce", "op #1 on group 'g', rank 0/2", "what", "Fix"),
    errors.OpTypeError("all_reduce", "w", "what"),
    errors.ConfigError("HPCCOMM_LOG='x' is bad", variable="HPCCOMM_LOG"),
    errors.InitError("hpccomm init: no"),
    errors.HpccommError("plain"),
])
def test_errors_pickle(exc):
    """Errors cross process boundaries (multiprocessing, torch elastic's error files)."""
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    for attr in ("op", "where", "what", "fix", "variable"):
        assert getattr(back, attr, None) == getattr(exc, attr, None), attr


def test_error_hierarchy():
    for cls in (errors.ConfigError, errors.InitError, errors.OpError, errors.OpValueError, errors.OpTypeError):
        assert issubclass(cls, hpccomm.HpccommError) and issubclass(cls, RuntimeError)
    assert hpccomm.OpError is errors.OpError


# --------------------------------------------------------------------------
# launch checks and init state (no MPI)
# --------------------------------------------------------------------------

class _Comm:
    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0


#: Every launcher's variables go (the test may itself run under one).
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "HYDI_", "I_MPI_", "TORCHELASTIC_")


@pytest.mark.parametrize("env,size,fragment", [
    ({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, 1, r"srun started 4 processes \(SLURM_NTASKS=4\) but MPI sees "
     r"a world of 1: every rank would run alone\. Launch with srun --mpi={plugin}"),   # the MPI family's plugin
    ({"OMPI_COMM_WORLD_SIZE": "2"}, 1, r"mpirun started 2 processes \(OMPI_COMM_WORLD_SIZE=2\)"),
    ({"PMI_SIZE": "8"}, 1, r"mpiexec started 8 processes \(PMI_SIZE=8\)"),
    ({"SLURM_NTASKS": "4"}, 1, None),                         # a batch script: not a job step
    ({"SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, 1, None),   # srun -n 1
    ({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, 4, None),   # the right plugin
    ({"PMI_SIZE": "junk"}, 1, None),
])
def test_check_launch(monkeypatch, env, size, fragment):
    for var in [v for v in os.environ if v.startswith(_LAUNCH_PREFIXES)]:
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if fragment is None:
        bootstrap._check_launch(_Comm(size))
    else:
        from mpilaunch import require

        fragment = fragment.replace("{plugin}", require().spec.srun_mpi)
        with pytest.raises(hpccomm.InitError, match=rf"^hpccomm init: {fragment}"):
            bootstrap._check_launch(_Comm(size))


@pytest.mark.parametrize("fn", [hpccomm.local_rank, hpccomm.local_size, hpccomm.node_index])
def test_rank_info_before_init(monkeypatch, fn):
    monkeypatch.setattr(bootstrap.started, "info", None)
    with pytest.raises(hpccomm.InitError, match=r"not initialised; call hpccomm\.init_process_group\(\) first"):
        fn()


def test_from_mpi4py_before_init(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with mock.patch.object(_mpi, "mpi"):
        with pytest.raises(hpccomm.InitError, match="initialise torch.distributed first"):
            hpccomm.from_mpi4py(object())


# --------------------------------------------------------------------------
# small helpers of _ops/staging
# --------------------------------------------------------------------------

@pytest.mark.parametrize("count,limit,expected", [
    (0, 5, [(0, 0)]), (5, 5, [(0, 5)]), (6, 5, [(0, 5), (5, 1)]), (10, 3, [(0, 3), (3, 3), (6, 3), (9, 1)]),
])
def test_chunks(count, limit, expected):
    assert list(staging.chunks(count, limit)) == expected


def test_flat_view_and_overlaps():
    base = torch.arange(12.0)
    parts = list(base.chunk(4))
    flat = staging.flat_view(parts)
    assert flat is not None and flat.data_ptr() == base.data_ptr() and torch.equal(flat, base)
    assert staging.flat_view(parts[::-1]) is None          # out of order
    assert staging.flat_view([torch.ones(3), torch.ones(3)]) is None  # two storages
    assert staging.flat_view([base[::2]]) is None           # not contiguous
    assert staging.overlaps(parts[0], base) and not staging.overlaps(parts[0], parts[1])
    assert not staging.overlaps(torch.empty(0), base)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint64, torch.float32])
def test_finish_average_truncates_integers(dtype):
    t = torch.tensor([7, 9, 0], dtype=dtype)
    staging.finish_average(t, 4)
    expected = [1.75, 2.25, 0.0] if dtype.is_floating_point else [1, 2, 0]
    assert t.tolist() == expected
    if dtype.is_signed:
        s = torch.tensor([-7], dtype=dtype)
        staging.finish_average(s, 4)
        assert s.tolist() == ([-1.75] if dtype.is_floating_point else [-1])  # toward zero, as NCCL


def test_premul_sum_factor_from_compat():
    assert compat.premul_sum_factor(dist._make_nccl_premul_sum(3.0)) == 3.0
    assert compat.reduce_op_type(R.MAX) == T.MAX
    assert compat.reduce_op_type(dist._make_nccl_premul_sum(3.0)) == T.PREMUL_SUM


def test_dead_local_peers_finds_gone_and_zombie_processes():
    import socket
    import subprocess

    from hpccomm._core import state

    me = socket.gethostname()
    live = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["true"])
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid no longer exists
    deadline = time.monotonic() + 5
    while state.alive(zombie.pid) and time.monotonic() < deadline:  # exited, not reaped yet
        time.sleep(0.05)
    try:
        peers = [(me, os.getpid()), (me, live.pid), (me, zombie.pid), (me, gone.pid), ("elsewhere", gone.pid)]
        assert state.dead_local_peers(peers) == [(2, me, zombie.pid), (3, me, gone.pid)]
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_report_line_names_the_running_op_and_the_recorded_failure(monkeypatch):
    from hpccomm._core import signals
    from hpccomm._core import state

    class Group:
        name, timeout = "WORLD", 60

    class Store:
        def __init__(self):
            self.kv = {}

        def set(self, k, v):
            self.kv[k] = v.encode()

        def check(self, keys):
            return all(k in self.kv for k in keys)

        def get(self, k):
            return self.kv[k]

    store = Store()
    monkeypatch.setattr(state, "world", state._World())
    state.set_world(1, 4, store, [])
    monkeypatch.setattr(state, "watched", {})
    assert signals.report_line() == (
        "hpccomm: rank 1 of 4 ended by SIGTERM (the launcher ends the job) outside any hpccomm op; no failed "
        "rank known here (one on another node, or the job was cancelled: the launcher's message names it)")
    running = state.InFlight(Group(), "all_gather")  # (an op's record, as hpccomm._core.state.start leaves it)
    running.seq, running.start = 7, time.monotonic()
    state.watch(running)
    state.record_failure("raised an uncaught KeyError (last op: barrier (op #6 on group 'WORLD'))")
    line = signals.report_line()
    assert line.startswith("hpccomm: rank 1 of 4 ended by SIGTERM (the launcher ends the job) while in all_gather "
                           "(op #7 on group 'WORLD', for 0.0 s); rank 1 raised an uncaught KeyError"), line


def test_wait_returns_only_after_the_future_completed(monkeypatch):
    """A waiter that sees the op done while another thread is between
    marking it done and completing its future waits for the future:
    get_future().value() then never finds it incomplete (a race seen once as
    a torch INTERNAL ASSERT in a test).  The completing thread is the comm
    thread, running a queued op (hpccomm._core.record)."""
    import itertools
    import threading

    from hpccomm._core import record as core_record
    from hpccomm._core import state
    from hpccomm._core import work as core_work

    class Group:  # what running a queued op reads of its group (no MPI: its plan calls no MPI)
        name, rank, size, seq, queued, instrumented = "test", 0, 1, 0, 0, False
        checks = SimpleNamespace(agreed=None, every=False)  # no comparison across ranks (hpccomm._core.signatures)
        _seqs = itertools.count(1)

        def __init__(self):
            self.running = state.InFlight(self)  # its blocking collective's record (hpccomm._core.state.start)

        def where(self, seq=None):
            return f"op #{seq} on group 'test'"

    monkeypatch.setattr(state, "last_group", [None])
    out = [torch.ones(2)]
    go, in_set_result, release = threading.Event(), threading.Event(), threading.Event()
    plan = (lambda: go.wait(10), (), None, out, out, None, None, 0)  # blocks the comm thread until go
    record = core_record.OpRecord(Group(), _op("all_reduce"), plan)
    work = core_work.pending(record, out)
    record.queue(_call("all_reduce"), True)

    class HeldFuture:  # holds the completing thread just before it completes the future
        def __init__(self, raw):
            self.raw = raw

        def set_result(self, value):
            in_set_result.set()
            release.wait(10)
            self.raw.set_result(value)

    work.get_future()  # the futures exist: completing the op completes them
    record.raw = HeldFuture(record.raw)
    go.set()
    assert in_set_result.wait(10)
    assert record.state == core_record.DONE and not work.is_completed()  # marked done, future not yet complete
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (work.wait(), waited.set()))
    waiter.start()
    assert not waited.wait(0.3), "wait() returned before the Work's future completed"
    release.set()
    assert waited.wait(10)
    assert work.get_future().value() is out and work.is_completed()
    waiter.join()


# -- the op record's states and who moves it (hpccomm._core.record) ------------------------------------------

class FakeRequest:
    """An MPI request completed when the test says (``finish()``), with ``error`` if given."""

    def __init__(self, error=None):
        self.finished, self.error = threading.Event(), error

    def finish(self):
        self.finished.set()

    def Test(self, status=None):
        if self.finished.is_set() and self.error is not None:
            raise self.error
        return self.finished.is_set()

    def Wait(self, status=None):
        assert self.finished.wait(30)
        if self.error is not None:
            raise self.error


@pytest.fixture
def self_group():
    """A real hpccomm group of one rank (MPI_COMM_SELF); its plans below make no MPI call."""
    g = _group.world(_mpi.mpi().COMM_SELF, name="self")
    yield g
    g.free()


def _op(name: str):
    """The declaration of op ``name`` (hpccomm._ops.registry)."""
    from hpccomm._ops import registry

    return registry.BY_NAME[name]


def _call(name: str):
    """A checked call of op ``name`` with nothing to compare (a record's plans here make no MPI call)."""
    from hpccomm._ops.op import Call, Signature

    return Call(Signature(name))


def _plan(call=lambda: None, icall=None, outputs=None, after=None):
    return (call, (), icall, outputs, None, None, after, 0)


def test_record_queued_submitted_running_done(self_group):
    """A queued op: SUBMITTED while ops queued before it run, RUNNING (numbered) while
    its plan runs on the comm thread, DONE once complete: its future's callbacks ran
    there, once, and its Work reports success."""
    from hpccomm._core import comm_thread, record as rec, state, work as core_work

    gate, running, go = threading.Event(), threading.Event(), threading.Event()
    first = rec.OpRecord(self_group, _op("barrier"), _plan(lambda: gate.wait(30)))
    first.queue(_call("barrier"), True)
    out = [torch.ones(1)]
    second = rec.OpRecord(self_group, _op("all_reduce"), _plan(lambda: (running.set(), go.wait(30)), outputs=out))
    w = core_work.pending(second, out)
    second.queue(_call("all_reduce"), True)
    assert second.state == rec.SUBMITTED and second.seq is None and second.describe() == "all_reduce (group 'self')"
    ran = []
    chained = w.get_future().then(lambda f: ran.append(threading.current_thread().name) or f.value())
    gate.set()
    assert running.wait(30)
    assert second.state == rec.RUNNING and second.seq == self_group.seq and not w.is_completed()
    go.set()
    assert w.wait(timedelta(seconds=30)) and second.state == rec.DONE
    assert chained.wait() is out and ran == [comm_thread.THREAD_NAME]
    assert w.is_completed() and w.is_success() and w.exception() is None and w.result() is out
    assert first.state == rec.DONE and self_group.queued == 0 and state.records() == []


def test_comm_thread_runs_entries_in_order_then_releases_their_records(self_group):
    """The comm thread's protocol: an entry is a tuple ``(run, record, ...)``;
    the thread calls ``run(entry)`` (the entry whole: what to run travels in
    it, not in the record), then, with the group's queued count down,
    ``record.release()``, entry after entry in queue order."""
    from hpccomm._core import comm_thread

    seen, done = [], threading.Event()

    class Record:  # what the thread uses of a record: its group and release()
        def __init__(self, name):
            self.group, self.name = self_group, name

        def release(self):
            seen.append(("release", self.name, self.group.queued))
            if self.name == "b":
                done.set()

    def run(entry):
        seen.append(("run", entry[1].name, entry[2], threading.current_thread().name))

    a, b = Record("a"), Record("b")
    comm_thread.submit((run, a, "what a runs"))
    comm_thread.submit((run, b, "what b runs"))
    assert done.wait(30)
    thread = comm_thread.THREAD_NAME
    queued_at_a = seen[1][2] if len(seen) == 4 else None  # (b queued by then, or not yet: 1 or 0)
    assert seen == [("run", "a", "what a runs", thread), ("release", "a", queued_at_a),
                    ("run", "b", "what b runs", thread), ("release", "b", 0)] and queued_at_a in (0, 1)
    assert self_group.queued == 0


def test_the_fast_path_takes_its_case_only(self_group, monkeypatch):
    """A repeated blocking call of a cached shape with a bound plan, on a group with nothing
    queued or instrumented, runs through hpccomm._core.execute.execute_bound (the op path's fast
    path): numbered (one op number per op), in the flight record, with the right result and a
    completed Work, for every op with a bound plan.  Every other case takes the general path with
    the same results: the first call of a shape, tensors the bound plan does not take (strided),
    ``async_op=True``, debug mode, a signature not yet agreed in ``first`` mode.  A destroyed
    group's cached calls are gone: the next call is refused naming the op."""
    from hpccomm._ops import op_path

    g = self_group
    assert g.flight is not None  # (the flight recorder is on by default)
    taken = []
    fast, general = op_path.execute_bound, op_path.execute
    monkeypatch.setattr(op_path, "execute_bound", lambda *a: taken.append("fast") or fast(*a))
    monkeypatch.setattr(op_path, "execute", lambda *a: taken.append("general") or general(*a))
    R = dist.ReduceOp

    def run(op, args, opts=None):
        """One call through the op path: which way it went, and its Work."""
        taken.clear()
        seq = g.seq
        w = op_path.run(g, op, args, opts)
        assert w.wait() and w.is_completed() and w.is_success()
        assert g.seq == seq + 1
        return taken[:], w

    out, inp = torch.zeros(4), torch.arange(4.0)
    calls = [(reduce.ALL_REDUCE, lambda: ([torch.arange(4.0)], R.SUM), torch.arange(4.0)),
             (scatter.BROADCAST, lambda: ([torch.arange(3, dtype=torch.int64)], 0), torch.arange(3)),
             (gather.ALL_GATHER_INTO_TENSOR, lambda: (out, inp), inp),
             (reduce.REDUCE_SCATTER_TENSOR, lambda: (out, inp * 2, R.SUM), inp * 2)]
    for op, args, expected in calls:
        out.zero_()
        assert run(op, args())[0] == ["general"], op  # its first call: checked, then kept with its bound plan
        for _ in range(3):
            out.zero_()
            a = args()
            way, w = run(op, a)
            assert way == ["fast"], op
            result = w.result()
            mine = a[0][0] if op in (reduce.ALL_REDUCE, scatter.BROADCAST) else out  # (its output tensor)
            assert torch.equal(result[0].to(expected.dtype), expected) and result[0] is mine
        entry = g.flight[-1]
        assert entry[4] == op.name and entry[2] == g.seq and entry[6] is not None, entry  # (its io: in the record)
    # the same shape, another way: strided, async, debug mode, not yet agreed
    strided = torch.arange(8.0)[::2]
    assert run(reduce.ALL_REDUCE, ([strided], R.SUM))[0] == ["general"]
    assert torch.equal(strided, torch.arange(0.0, 8.0, 2))
    way, w = run(reduce.ALL_REDUCE, ([torch.arange(4.0)], R.SUM), SimpleNamespace(asyncOp=True))
    assert way == [] and torch.equal(w.result()[0], torch.arange(4.0))  # (queued: the comm thread ran it)
    g.debug = True
    try:
        assert run(reduce.ALL_REDUCE, ([torch.arange(4.0)], R.SUM))[0] == ["general"]
    finally:
        g.debug = False
    call = next(c for c in g.checked.values() if c.signature.op == "all_reduce")
    agreed, call.agreed = call.agreed, False
    old = g.checks.agreed, g.checks.every
    g.checks.agreed, g.checks.every = set(), False  # (``first`` mode: this signature not agreed yet)
    try:
        assert run(reduce.ALL_REDUCE, ([torch.arange(4.0)], R.SUM))[0] == ["general"]
        assert call.agreed  # (agreed by its first-call check: the next call is fast)
        assert run(reduce.ALL_REDUCE, ([torch.arange(4.0)], R.SUM))[0] == ["fast"]
    finally:
        (g.checks.agreed, g.checks.every), call.agreed = old, agreed
    g.free()
    with pytest.raises(errors.HpccommError, match="all_reduce .*destroyed"):
        op_path.run(g, reduce.ALL_REDUCE, ([torch.arange(4.0)], R.SUM))


def test_record_queued_failed(self_group):
    """A queued op whose plan raises: FAILED, its error named after the op, raised by
    wait(), result() and the future; the group goes on."""
    from hpccomm._core import record as rec, work as core_work

    def broken():
        raise RuntimeError("the plan broke")

    r = rec.OpRecord(self_group, _op("all_reduce"), _plan(broken))
    w = core_work.pending(r, [])
    r.queue(_call("all_reduce"), True)
    with pytest.raises(errors.HpccommError, match=r"hpccomm all_reduce \(op #\d+ on group 'self', rank 0/1\): "
                                                  r"RuntimeError: the plan broke"):
        w.wait()
    assert r.state == rec.FAILED and w.is_completed() and not w.is_success() and w.exception() is r.error
    with pytest.raises(RuntimeError, match="HpccommError: hpccomm all_reduce .*the plan broke"):  # (torch's wrapping)
        w.get_future().wait()
    ok = rec.OpRecord(self_group, _op("all_reduce"), _plan())
    ok.queue(_call("all_reduce"), True)
    ok.wait()
    assert ok.state == rec.DONE


def test_record_posted_running_timed_out_done(self_group):
    """A posted op: RUNNING and watched from its post (numbered, a deadline), its
    ``after`` step run once it completed; the watchdog's mark (timed_out) leaves it
    running, and it still completes: DONE, no longer watched."""
    from hpccomm._core import record as rec, state, work as core_work

    req, steps = FakeRequest(), []
    r = rec.OpRecord(self_group, _op("all_gather_into_tensor"), _plan(icall=lambda: req, after=lambda: steps.append(1)))
    w = core_work.pending(r, [])
    r.post()
    assert r.state == rec.RUNNING and r in state.records() and r.seq == self_group.seq and r.token is not None
    with pytest.raises(TimeoutError, match=r"all_gather_into_tensor \(op #\d+ on group 'self', rank 0/1\): not "
                                           r"complete after 0.01 s"):
        w.wait(timedelta(milliseconds=10))
    r.expired()  # (what the watchdog does when it reports it)
    assert r.timed_out and r.state == rec.RUNNING and not w.is_completed()
    req.finish()
    assert w.wait() and r.state == rec.DONE and steps == [1] and r not in state.records()


def test_every_form_in_flight_is_one_record_type(self_group):
    """What runs is one record type, hpccomm._core.state.InFlight, whatever its form: a blocking
    collective in its group's own record (the same object for each: none made per op), watched
    while it runs; a posted op's record; a group's creation (its group side the members, a real
    object, not a group) as a record of kind "setup".  The readers take them as they are."""
    from hpccomm._core import flight, record as rec, state, work as core_work
    from hpccomm._core.watchdog import current, watchdog

    g = self_group
    own = g.running
    assert isinstance(own, state.InFlight) and own not in state.records()
    seq = state.start(g, "all_reduce")
    try:
        assert own in state.records() and g.running is own and (own.name, own.seq, own.kind) == ("all_reduce", seq,
                                                                                                  "collective")
        assert own.describe() == f"all_reduce (op #{seq} on group 'self', rank 0/1)"
        assert (id(g), False, seq) in flight._running()
    finally:
        state.finished(g)
    assert own not in state.records() and own.start is None
    state.start(g, "broadcast")
    state.finished(g)
    assert g.running is own and own.name == "broadcast" and state.last_op_text() == (
        f"last op: broadcast (op #{seq + 1} on group 'self', rank 0/1)")
    # a posted op: its op record is its InFlight
    req = FakeRequest()
    r = rec.OpRecord(g, _op("broadcast"), _plan(icall=lambda: req))
    w = core_work.pending(r, [])
    r.post()
    assert isinstance(r, state.InFlight) and r in state.records() and current() is r
    made = rec.OpRecord(g, _op("recv"), _plan(), "p2p", peer=0)
    plain = state.InFlight(g, "recv", "p2p", 0, "send")  # (OpRecord sets InFlight's fields itself: the same)
    assert {k: getattr(made, k) for k in state.InFlight.__slots__} == {k: getattr(plain, k)
                                                                     for k in state.InFlight.__slots__}
    req.finish()
    assert w.wait() and r not in state.records()

    # a group's creation: watched through its members, kind "setup", never taken for an op of a ring
    class Untouchable:  # a refusal is no question for a group being made: its store is not asked
        def check(self, keys):
            raise AssertionError(f"store asked {keys}")

        get = set = check

    members = _group.Members([0, 2], 1, 2, Untouchable(), timedelta(seconds=60))
    token = watchdog.begin(members, "new_group (MPI_Comm_create_group)", 0)
    try:
        (made,) = [x for x in state.records() if x.group is members]
        assert type(made) is state.InFlight and made.kind == "setup" and made.token == token
        assert made.describe() == "new_group (MPI_Comm_create_group) (creating the new group of ranks [0, 2], rank 1/2)"
        assert made.deadline == made.start + 60
        assert not watchdog._peer_refused(made)
        assert all(key[0] != id(members) for key in flight._running())
    finally:
        watchdog.end(token)
    assert all(x.group is not members for x in state.records())
    assert not hasattr(rec.OpRecord, "noted") and not hasattr(state, "notes")


def test_a_receive_checks_what_arrived_in_its_own_step():
    """recv's step at completion (hpccomm._ops.p2p.received, its declaration's ``completes``): the
    source rank when the count fits (its peer's, or the status's for any source); a short message
    raises naming both counts; a truncated one's MPI error becomes one naming the op; another MPI
    error is left to the record."""
    from hpccomm._ops import p2p

    MPI = _mpi.mpi()

    class Status:
        def __init__(self, source, got):
            self.source, self.got = source, got

        def Get_source(self):
            return self.source

        def Get_elements(self, datatype):
            assert datatype == MPI.INT64_T
            return self.got

    t = torch.zeros(5, dtype=torch.int64)
    plan = (None, ([None, 5, MPI.INT64_T], 0, 7), None, [t], t, None, None, 40)

    def describe():
        return "recv (p2p op #4 on group 'g', rank 1/2)"

    assert p2p.RECV.completes is p2p.received and p2p.SEND.completes is None
    assert p2p.received(plan, Status(3, 5), 0, describe) == 0
    assert p2p.received(plan, Status(3, 5), None, describe) == 3
    with pytest.raises(errors.HpccommError, match=r"^hpccomm recv \(p2p op #4 on group 'g', rank 1/2\): received 3 "
                                                  r"elements from rank 0 but the tensor has 5; only its first 3"):
        p2p.received(plan, Status(0, 3), 0, describe)

    class Truncated(Exception):
        def __init__(self, cls):
            self.cls = cls

        def Get_error_class(self):
            return self.cls

    named = p2p.received(plan, Status(2, 9), None, describe, Truncated(MPI.ERR_TRUNCATE))
    assert isinstance(named, errors.HpccommError) and str(named).startswith(
        "hpccomm recv (p2p op #4 on group 'g', rank 1/2): the message from rank 2 is larger than the tensor (5 "
        "elements)")
    assert p2p.received(plan, Status(2, 9), None, describe, Truncated(MPI.ERR_OTHER)) is None


def test_the_record_runs_the_ops_own_step_at_completion(self_group):
    """A posted op's record keeps its request's status for the op's own step at completion
    (``Op.completes``) and takes its source rank from it; the record has no branch on receives."""
    from hpccomm._core import record as rec, work as core_work
    from hpccomm._ops.op import Op

    seen = []

    def completes(plan, status, peer, describe, error=None):
        seen.append((status is not None, peer, describe(), error))
        return 3

    base = _op("recv")
    op = Op("recv", methods=("recv",), check=base.check, plan=base.plan, p2p=True, nonblocking=True,
            receives=True, completes=completes)
    req = FakeRequest()
    r = rec.OpRecord(self_group, op, _plan(icall=lambda: req), "p2p", peer=None)
    w = core_work.pending(r, [])
    r.post()
    req.finish()
    assert w.wait() and r.state == rec.DONE and r.source == 3
    assert seen == [(True, None, f"recv (p2p op #{r.seq} on group 'self', rank 0/1)", None)]
    source = Path(rec.__file__).read_text()
    assert not re.search(r"\bif\b[^\n]*receives", source) and "ERR_TRUNCATE" not in source


def _state_table(text: str, after: str = "") -> list:
    """The rows ``(state, meaning)`` of the first ``| state | meaning | moved there by |`` table in
    ``text`` past ``after``, with the code quotes of Markdown and reST made alike."""
    text = text[text.index(after):] if after else text
    lines = text[text.index("| state | meaning | moved there by |"):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("``", "`") for c in line.strip("|").split("|")]
        rows.append((cells[0], cells[1]))
    return rows


def test_record_state_table_is_the_code():
    """The op record's state table (its module's docstring, and docs/design.md's copy) lists the
    states the code has, in their order, and no other: the module's state constants (one
    ``A, B, ... = range(n)``), and every value ``record.state`` is set to in the module."""
    from hpccomm._core import record as rec

    source = Path(rec.__file__).read_text()
    tree = ast.parse(source)
    (constants,) = [[t.id for t in node.targets[0].elts] for node in tree.body
                    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                    and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "range"]
    assert [getattr(rec, name) for name in constants] == list(range(len(constants)))
    set_to = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                for t, v in pairs:
                    if isinstance(t, ast.Attribute) and t.attr == "state":
                        assert isinstance(v, ast.Name), ast.unparse(node)
                        set_to.add(v.id)
    assert set_to and set_to <= set(constants), (set_to, constants)
    table = _state_table(rec.__doc__)
    assert [name for name, _ in table] == constants, (table, constants)
    design = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    assert _state_table(design, "## One record per op in flight") == table
    assert "TIMED_OUT" not in rec.__doc__ and not hasattr(rec, "TIMED_OUT")


def test_record_posted_failed(self_group):
    """A posted op whose request completes with an error: FAILED, named after the op,
    no longer watched, its ``after`` step not run."""
    from hpccomm._core import record as rec, state, work as core_work

    req, steps = FakeRequest(RuntimeError("the request broke")), []
    r = rec.OpRecord(self_group, _op("broadcast"), _plan(icall=lambda: req, after=lambda: steps.append(1)))
    w = core_work.pending(r, [])
    r.post()
    req.finish()
    assert w.is_completed() and not w.is_success()
    assert r.state == rec.FAILED and steps == [] and r not in state.records()
    with pytest.raises(errors.HpccommError, match=r"hpccomm broadcast \(op #\d+ .*RuntimeError: the request broke"):
        w.wait()


def test_record_future_hands_a_posted_collective_to_the_comm_thread(self_group):
    """Asking a posted collective's future changes its state, not its owner: the same
    record goes to the comm thread, which completes it and runs the callbacks; ops
    queued on the group meanwhile wait behind it."""
    from hpccomm._core import comm_thread, record as rec, work as core_work

    req, out = FakeRequest(), [torch.ones(1)]
    r = rec.OpRecord(self_group, _op("all_reduce"), _plan(icall=lambda: req, outputs=out))
    w = core_work.pending(r, out)
    r.post()
    ran = []
    fut = w.get_future().then(lambda f: ran.append(threading.current_thread().name))
    assert r.by_comm_thread and self_group.queued == 1 and w._op is r
    later = rec.OpRecord(self_group, _op("barrier"), _plan())
    later.queue(_call("barrier"), True)  # behind it
    assert later.state == rec.SUBMITTED
    req.finish()
    fut.wait()
    later.wait()
    assert r.state == rec.DONE and ran == [comm_thread.THREAD_NAME] and later.state == rec.DONE
