"""What one fast path for a repeated blocking op would cost: a prototype measured, not hpccomm's code
(docs/benchmarks.md, "Each op declared once": "A fast path, measured as a prototype").

    python docs/scripts/fast_path_prototype.py --ops all_reduce --modes blocking --groups world --which hpccomm
    HPCCOMM_MISMATCH_CHECK=first HPCCOMM_FR_BUFFER_SIZE=0 python docs/scripts/fast_path_prototype.py ...

docs/scripts/op_instructions.py (its options, its callgrind counts) with torch's ``allreduce`` method
replaced, after init, by one function for the hot case: a call whose checked call the group cached,
blocking, on a group with nothing queued and nothing instrumented, of a contiguous tensor.  It keeps
every step the library's path takes for that case (the cache lookup by the call's shape, the op's
number and its group's in-flight record, the flight recorder's entry, the every-call check, the MPI
error named after the op, the finished Work) and drops what the case does not need: the plan made
per call (here bound to the call's shape once: the MPI call, count, bytes, datatype and op; per call
only the tensor's address is read), ``form``'s decision, ``execute``'s branches for debug mode, the
tracer and the first-call check, and four call frames.  Any other call goes to the library's method.
Only all_reduce is wired: the figure says what the design would buy, not that the prototype is right
for every op (it has no tests).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import op_instructions  # noqa: E402  (this folder's script)


def install() -> None:
    """Replace torch's allreduce method of hpccomm's adapters by the prototype (after init)."""
    from hpccomm import _mpi
    from hpccomm._adapters import backend, methods, process_group
    from hpccomm._core import failures, signatures, state, work
    from hpccomm._ops import reduce

    library = methods.TorchOps.allreduce
    bound = {}  # id(checked call) -> what its shape fixes (the prototype keeps it beside the call)
    in_place, fromaddress, monotonic = _mpi.IN_PLACE, _mpi.fromaddress, time.monotonic
    records, last_group, mpi_exception = state._records, state.last_group, _mpi.mpi().Exception

    def allreduce(self, tensors, opts=None):
        g = self._g
        redop = methods._SUM if opts is None else getattr(opts, "reduceOp", opts)
        call = g.checked.get(reduce.all_reduce_key((tensors, redop)))
        if call is None or g.queued or g.instrumented or (opts is not None and getattr(opts, "asyncOp", False)):
            return library(self, tensors, opts)
        fixed = bound.get(id(call))
        if fixed is None:
            r, n = call.facts, call.signature.tensors[0][1]
            if r.factor is not None or r.average or n > g.max_count:
                return library(self, tensors, opts)
            fixed = bound[id(call)] = (g.calls.Allreduce, n, n * r.itemsize, r.mtype, r.mop)
        t = tensors[0]
        checks = g.checks
        if not t.is_contiguous() or not (call.agreed or checks.every):
            return library(self, tensors, opts)
        mpi_call, n, nbytes, mtype, mop = fixed
        now = monotonic()
        g.seq = seq = next(g._seqs)
        running = g.running
        running.start = None
        running.name, running.seq = "all_reduce", seq
        running.start = now
        g.last = "all_reduce"
        last_group[0] = g
        if g.flight is not None:
            g.flight.append((next(records), "collective", seq, g.p2p_seq, "all_reduce", None, call.io, now))
        try:
            if checks.every:
                signatures.compare(g, call, seq)
            mpi_call(in_place, [fromaddress(t.data_ptr(), nbytes), n, mtype], mop)
        except mpi_exception as exc:
            raise failures.mpi_error(f"all_reduce ({g.where(seq)})", exc) from exc
        finally:
            running.start = None
        return work.finished(tensors)

    for module in (methods, process_group, backend):
        for name in dir(module):
            cls = getattr(module, name)
            if isinstance(cls, type) and issubclass(cls, methods.TorchOps):
                cls.allreduce = allreduce


if __name__ == "__main__":
    args = op_instructions.parse()
    if not args.inner:
        sys.exit(op_instructions.outer(args, os.path.abspath(__file__)))
    import hpccomm

    started = hpccomm.init_process_group

    def init_then_install(*a, **k):
        out = started(*a, **k)
        install()
        return out

    hpccomm.init_process_group = init_then_install
    sys.exit(op_instructions.inner(args))
