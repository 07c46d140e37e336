"""The arithmetic and the memory test the plans' steps share, on the op
modules' side (hpccomm._ops.staging, the composed reductions) and on the GPU
transports' (the NCCL rewrites, hpccomm._gpu.nccl_wire): one definition below
both."""
from __future__ import annotations

import torch

_UNSIGNED_WIDE = (torch.uint16, torch.uint32, torch.uint64)
#: The signed integer type of each width in bytes.
SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def signed_view(t: torch.Tensor) -> torch.Tensor:
    """The signed integer view of ``t``'s bits, of its width: an unsigned
    SUM, PRODUCT or bitwise op gives the same bits on it (two's complement)."""
    return t.view(SIGNED[t.element_size()])


def sign_flipped(s: torch.Tensor) -> torch.Tensor:
    """Signed ``s`` with its sign bit flipped (a new tensor): the unsigned
    order of the bits as the signed order, for MIN and MAX, and back."""
    return torch.bitwise_xor(s, torch.iinfo(s.dtype).min)


def finish_average(t: torch.Tensor, n: int) -> None:
    """Divide a SUM by the group size: integers truncate toward zero, as NCCL's AVG."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.div_(n)
    elif t.dtype in _UNSIGNED_WIDE:  # torch has no integer division for these; numpy does
        host = t if t.device.type == "cpu" else t.cpu()  # a device tensor: divide a host copy
        a = host.numpy()
        a //= n
        if host is not t:
            t.copy_(host)
    else:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))


def overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    """Whether ``a_bytes`` bytes from address ``a`` and ``b_bytes`` from ``b`` intersect
    (the addresses of MPI buffers, ``buf.address``, or tensors, ``t.data_ptr()``)."""
    return a < b + b_bytes and b < a + a_bytes and a_bytes > 0 and b_bytes > 0  # (empty memory overlaps nothing)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of contiguous tensors ``a`` and ``b`` intersects."""
    return overlap(a.data_ptr(), a.nbytes, b.data_ptr(), b.nbytes)
