"""Printing and saving benchmark rows: nccl-tests-style tables, the comparison
table, JSON, CSV and the plot.  Pure Python (matplotlib only for the plot)."""
from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, fields

from .ops import IP, OOP, OPS, Row

#: The placement compared across backends: the one torch's call has natively.
PRIMARY = {name: (IP if spec.placements == (IP,) else OOP) for name, spec in OPS.items()}

COLUMNS = [f.name for f in fields(Row)]


def _num(x: float, width: int, prec: int) -> str:
    return f"{'n/a':>{width}}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:>{width}.{prec}f}"


def _cell(row, stats: bool) -> str:
    """One placement's columns: time [min max p99] algbw busbw #wrong."""
    extra = 3 if stats else 0
    if row is None or row.note:
        return "".join(f" {'n/a':>9}" for _ in range(1 + extra)) + f" {'n/a':>7} {'n/a':>7} {'n/a':>6}"
    parts = [_num(row.time_us, 9, 1)]
    if stats:
        parts += [_num(row.min_us, 9, 1), _num(row.max_us, 9, 1), _num(row.p99_us, 9, 1)]
    bw = [float("nan"), float("nan")] if row.size == 0 else [row.algbw, row.busbw]
    parts += [_num(bw[0], 7, 3), _num(bw[1], 7, 3), f"{row.wrong:>6}"]
    return " " + " ".join(parts)


def table(rows: list, stats: bool = False) -> str:
    """The nccl-tests table of one (backend, op, dtype, mode): a line per
    size with out-of-place and in-place columns, and the average bus bandwidth."""
    if not rows:
        return ""
    r0 = rows[0]
    names = ["time", *(["min", "max", "p99"] if stats else [])]
    head = "".join(f" {c:>9}" for c in names) + f" {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    units = "".join(f" {'(us)':>9}" for _ in names) + f" {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
    left = 1 + 11 + 1 + 12 + 1 + 9 + 1 + 6 + 1 + 5  # the size .. root columns
    lines = [
        f"# {r0.backend}: {r0.op} ({OPS[r0.op].torch_name}), {r0.type}, {r0.mode}"
        + ("" if r0.group == "world" else f", {_GROUP[r0.group]}"),
        f"#{'':{left - 1}}{OOP:^{len(head)}}{IP:^{len(head)}}".rstrip(),
        f"#{'size':>11} {'count':>12} {'type':>9} {'redop':>6} {'root':>5}" + head * 2,
        (f"#{'(B)':>11} {'(elements)':>12} {'':>9} {'':>6} {'':>5}" + units * 2).rstrip(),
    ]
    by_size: dict = {}
    for r in rows:
        by_size.setdefault(r.size, {})[r.placement] = r
    notes = set()
    for size, cols in by_size.items():
        any_row = next(iter(cols.values()))
        lines.append(f" {size:>11} {any_row.count:>12} {any_row.type:>9} {any_row.redop:>6} {any_row.root:>5}"
                     + _cell(cols.get(OOP), stats) + _cell(cols.get(IP), stats))
        notes.update(f"{r.placement}: {r.note}" for r in cols.values() if r.note)
    for note in sorted(notes):
        lines.append(f"# n/a {note}")
    bws = [r.busbw for r in rows if not r.note and r.size and not math.isnan(r.busbw)]
    wrong = sum(r.wrong for r in rows)
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {sum(bws) / len(bws):.4f} GB/s" if bws
                 else "# Avg bus bandwidth    : n/a")
    return "\n".join(lines) + "\n"


#: How a table names a row's group (world: said by nothing).
_GROUP = {"world": "default group", "sub": "subgroup (dist.new_group of every rank)"}


def compare_rows(rows: list, others: list) -> list:
    """Per (op, dtype, mode, group, size): hpccomm against each other backend at the
    op's primary placement; ratio = other time / hpccomm time (> 1: hpccomm faster)."""
    index = {(r.backend, r.op, r.type, r.mode, r.group, r.size, r.placement): r for r in rows}
    out = []
    for r in rows:
        if r.backend != "hpccomm" or r.placement != PRIMARY[r.op] or r.note:
            continue
        entry = {"op": r.op, "type": r.type, "mode": r.mode, "group": r.group, "placement": r.placement,
                 "size": r.size, "hpccomm_us": r.time_us, "hpccomm_busbw": r.busbw}
        for b in others:
            o = index.get((b, r.op, r.type, r.mode, r.group, r.size, r.placement))
            ok = o is not None and not o.note
            entry[f"{b}_us"] = o.time_us if ok else float("nan")
            entry[f"{b}_busbw"] = o.busbw if ok else float("nan")
            entry[f"x_{b}"] = o.time_us / r.time_us if ok and r.time_us > 0 else float("nan")
        out.append(entry)
    return out


def compare_table(entries: list, others: list) -> str:
    if not entries:
        return ""
    e0 = entries[0]
    group = e0.get("group", "world")
    lines = [f"# compare {e0['op']} ({e0['placement']}), {e0['type']}, {e0['mode']}"
             + ("" if group == "world" else f", {_GROUP[group]}") + ": time in us, busbw in GB/s; "
             + ", ".join(f"x/{b} = {b} time / hpccomm time (> 1: hpccomm faster)" for b in others),
             f"#{'size':>11} {'hpccomm':>9}" + "".join(f" {b:>9}" for b in others)
             + f" {'busbw':>8}" + "".join(f" {b[:8]:>8}" for b in others) + "".join(f" {'x/' + b:>9}" for b in others)]
    for e in entries:
        lines.append(f" {e['size']:>11} {_num(e['hpccomm_us'], 9, 1)}"
                     + "".join(f" {_num(e[b + '_us'], 9, 1)}" for b in others)
                     + f" {_num(e['hpccomm_busbw'], 8, 3)}" + "".join(f" {_num(e[b + '_busbw'], 8, 3)}" for b in others)
                     + "".join(f" {_num(e['x_' + b], 9, 2)}" for b in others))
    return "\n".join(lines) + "\n"


def _clean(x):
    return None if isinstance(x, float) and (math.isnan(x) or math.isinf(x)) else x


def write_json(path: str, meta: dict, rows: list, compare: list, extra: dict | None = None) -> None:
    doc = {"meta": meta, "columns": COLUMNS,
           "rows": [{k: _clean(v) for k, v in asdict(r).items()} for r in rows],
           "compare": [{k: _clean(v) for k, v in e.items()} for e in compare]}
    doc.update(extra or {})
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def write_csv(path: str, rows: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow(["" if _clean(v) is None else v for v in (getattr(r, c) for c in COLUMNS)])


def plot(path: str, rows: list, title: str) -> None:
    """Bus bandwidth and latency against size, one line per backend (and dtype,
    mode), a row of two panels per op.  Needs matplotlib (``pip install hpccomm[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("hpccomm bench --plot needs matplotlib: pip install 'hpccomm[plot]' "
                         "(or pip install matplotlib)") from None
    ops = [op for op in OPS if any(r.op == op and r.size for r in rows)]
    if not ops:
        raise SystemExit("hpccomm bench --plot: no sized results to plot")
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        lines: dict = {}
        for r in rows:
            if r.op == op and r.placement == PRIMARY[op] and not r.note and r.size:
                lines.setdefault((r.backend, r.type, r.mode, r.group), []).append(r)
        order = {"hpccomm": 0, "gloo": 1, "mpi4py": 2, "floor": 3}
        for (backend, dtype, mode, group), rs in sorted(lines.items(),
                                                        key=lambda kv: (order.get(kv[0][0], 9), kv[0])):
            rs.sort(key=lambda r: r.size)
            label = backend + ("" if dtype == "float32" else f" {dtype}") + ("" if mode == "blocking" else f" {mode}") \
                + ("" if group == "world" else f" {group}")
            xs = [r.size for r in rs]
            axes[i][0].plot(xs, [r.busbw for r in rs], marker=".", label=label)
            axes[i][1].plot(xs, [r.time_us for r in rs], marker=".", label=label)
        for j, (ylabel, ylog) in enumerate((("busbw (GB/s)", False), ("time (us, median)", True))):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            if ylog:
                ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op} ({PRIMARY[op]})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
