"""Where each op's facts are stated: one row per op, the file of each part of its declaration.

    python docs/scripts/op_facts.py

Every op is declared once (hpccomm._ops.op.Op) in its family's module; this prints,
for every op, the torch methods it serves and the file that states its checks and
signature (the op's ``check``: the signature is what it returns), its plan, its
cache key, its plan bound to a cached call's shape (``bind``), its composed
plan and its NCCL and CuPy forms ("-" where it has none).
Its description in messages is derived from its signature (hpccomm._ops.op.Signature),
the same code for every op.  tests/test_declarations.py runs it and checks that
each op's row names one file.
"""
from __future__ import annotations

import inspect
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hpccomm._ops import registry  # noqa: E402

PARTS = ("check", "plan", "key", "bind", "composed", "nccl", "cupy")


def where(fn) -> str:
    if fn is None or fn.__name__ == "uncached":
        return "-"
    path = inspect.getsourcefile(fn)
    return "hpccomm/" + path.split("/hpccomm/", 1)[1] if "/hpccomm/" in path else path


def main() -> int:
    print("| op | torch methods | checks and signature | plan | cache key | bound plan | composed | NCCL | CuPy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op in registry.OPS:
        methods = ", ".join(f"`{m}`" for m in (*op.methods, *op.legacy))
        cells = [where(getattr(op, part)) for part in PARTS]
        print(f"| {op.name} | {methods} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
