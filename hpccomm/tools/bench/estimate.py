"""How long a sweep will take, said before it starts.

A sweep's time is dominated by what each backend does per size: samples
(each a fill of the buffers, a barrier and a check of the result) and timed
ops, each touching the buffers' bytes.  :func:`seconds` adds, over every
(op, size, placement, mode, group, backend) the sweep will run,

    A * samples + C * timed ops + D * (samples + timed ops) * bytes

(a reduction's bytes counted twice: it computes as it moves them) plus the
start-up (the launch, importing torch, making the groups).  The constants
were fitted to six sweeps timed on the 2-core development machine at 2 ranks
(from one op at one size to every op at 8 sizes; each within 15 %), where the
default sweep with ``--compare gloo,mpi4py,floor`` takes about a minute:
on a faster machine the estimate is high, on a loaded one low; the progress
lines (one per op) say how it is going.
"""
from __future__ import annotations

#: Seconds: per sample (fill, barrier, check, in Python), per timed op, per byte touched, start-up.
A, C, D, START = 2.6e-4, 8.0e-5, 7.6e-10, 6.0


def samples_and_ops(args, nbytes: int) -> tuple:
    """``(samples, timed ops)`` of one backend at one size, as the sweep runs
    them (hpccomm.tools.bench._measure): warm-up samples, then rounds of ``batch``
    ops back to back."""
    batch = args.batch or max(1, min(100, (1 << 20) // max(1, nbytes)))
    rounds = args.iters if batch == 1 else max(5, args.iters // batch)
    return args.warmup + rounds, rounds * batch


def seconds(cases, args) -> float:
    """The sweep's estimated wall time; ``cases``: ``(nbytes, backends)`` for
    every (op, size, placement, mode, group) it runs, ``backends`` how many
    backends run that case."""
    total = START
    for nbytes, backends in cases:
        samples, ops = samples_and_ops(args, nbytes)
        total += backends * (A * samples + C * ops + D * (samples + ops) * nbytes)
    return total


def say(total: float) -> str:
    """``"about 50 s"``, ``"about 4 min"``."""
    if total < 90:
        return f"about {max(5, round(total / 5) * 5):.0f} s"
    return f"about {total / 60:.0f} min"
