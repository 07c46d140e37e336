"""``hpccomm info``: what hpccomm sees on each rank, and what is wrong with it.

Run alone or under the launcher of a job (``mpirun -n 4 hpccomm info``,
``srun --mpi=pmix hpccomm info``).  Every rank collects its view
(:func:`collect`); with more than one rank the views are gathered to rank 0,
which prints rank 0's view, a per-rank table of the fields that differ, and
the problems found (:func:`problems`): versions or MPI libraries that differ
between ranks, a launcher that disagrees with MPI (the silent-singleton
trap), a host name resolving to a loopback address on a multi-node run, a
key-value store port that cannot be opened, a malformed ``HPCCOMM_*`` option.

Exit status: 0 when no problem was found, 1 when one was (so a job script
can run it as a preflight check), 2 for a bad command line.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import sys
from dataclasses import asdict

#: Fields that must be equal on every rank (dotted names; a trailing ``.``
#: means every field under it).
MUST_AGREE = ("versions.", "mpi.library", "mpi.abi", "mpi.family", "mpi.standard", "mpi.thread_level_granted", "mpi.size",
              "launcher.name", "launcher.size", "options.")

#: Fields left out of the per-rank table: they say nothing about the job.
NOT_TABULATED = ("host.fqdn", "pid")
#: Rank numbers: left out of the per-rank table where each equals the rank of its row.
RANK_NUMBERS = ("mpi.rank", "launcher.rank", "launcher.local_rank")


# --------------------------------------------------------------------------
# one rank's view
# --------------------------------------------------------------------------

def _version(module: str):
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - missing or broken: say so, keep reporting
        return None


def host_info(name=None) -> dict:
    """The host name and the IPv4/IPv6 addresses it resolves to; ``loopback``
    is True when every one of them is a loopback address (then other nodes
    cannot reach a service this host advertises by name)."""
    name = socket.gethostname() if name is None else name
    try:
        addresses = sorted({a[4][0] for a in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})
        error = None
    except OSError as exc:
        addresses, error = [], f"{name!r} does not resolve: {exc}"
    loopback = bool(addresses) and all(a.startswith("127.") or a == "::1" for a in addresses)
    return {"name": name, "fqdn": socket.getfqdn(name), "addresses": addresses, "loopback": loopback,
            "error": error}


def interfaces() -> dict:
    """Network interface name -> its addresses (IPv4 by ioctl, IPv6 from
    /proc/net/if_inet6), with the standard library only."""
    out: dict = {}
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        out[name] = []
        addr = _ipv4_of(name)
        if addr:
            out[name].append(addr)
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6:
                    raw = fields[0]
                    addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(raw))
                    out.setdefault(fields[5], []).append(f"{addr}/{int(fields[2], 16)}")
    except OSError:
        pass
    return out


def _ipv4_of(name: str):
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None  # no IPv4 address (or not Linux)


def port_check(port: int, host: str = "") -> str:
    """"ok" when a TCP listening socket can be bound to ``port`` (0: any free
    port) on ``host`` (all interfaces by default), else the error."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, port))
            s.listen(1)
        return "ok"
    except OSError as exc:
        return f"cannot listen on {host or '*'}:{port}: {exc.strerror or exc}"


def store_info() -> dict:
    """Whether the key-value store hpccomm opens on rank 0 could listen here:
    on a free port, and on HPCCOMM_STORE_PORT if set."""
    from .. import config
    from ..errors import ConfigError

    out = {"free_port": port_check(0), "configured_port": None, "port": None}
    try:
        port = config.get("HPCCOMM_STORE_PORT")
    except ConfigError as exc:
        out["configured_port"] = str(exc)
        return out
    if port:
        out["port"] = port
        out["configured_port"] = port_check(port)
    return out


def options() -> dict:
    """Every HPCCOMM_* option's value; a malformed one as ``"INVALID: ..."``."""
    from .. import config
    from ..errors import ConfigError

    out = {}
    for name, opt in config.OPTIONS.items():
        try:
            out[name] = opt.get()
        except ConfigError as exc:
            out[name] = f"INVALID: {exc}"
    return out


def mpi_info() -> dict:
    """The MPI library and this process's place in MPI_COMM_WORLD (starts
    MPI); without a usable MPI, why not."""
    from .. import _mpi
    from .._mpi import library

    probe = library.probe()
    out = {"available": probe.available, "library": probe.library, "abi": probe.abi, "path": probe.path,
           "reason": probe.reason or None, "standard": None, "thread_level_requested": _mpi.REQUESTED_THREAD_LEVEL,
           "thread_level_granted": None, "rank": None, "size": None, "processor": None}
    out.update(family_info(probe))
    if not probe.available:
        return out
    MPI = _mpi.mpi()
    out.update(library=_mpi.library_version(), standard="%d.%d" % MPI.Get_version(),
               thread_level_granted=_mpi.thread_level(), rank=MPI.COMM_WORLD.Get_rank(),
               size=MPI.COMM_WORLD.Get_size(), processor=MPI.Get_processor_name())
    out.update(capability_info(library.capabilities()))
    return out


def family_info(probe) -> dict:
    """The MPI family of the library mpi4py loads and how that family is
    launched (docs/mpi-families.md): ``family``, ``launcher`` (the launcher
    beside the library, else on PATH), ``oversubscribe`` (the launcher's flag
    for more ranks than cores), ``srun_mpi`` (the srun plugin)."""
    from .. import launcher
    from .._mpi import library

    fam = launcher.family_of(probe.library)
    if fam is None:
        return {"family": None, "launcher": None, "oversubscribe": None, "srun_mpi": None}
    return {"family": fam.name,
            "launcher": library.launcher_path(fam, probe.path) or f"{fam.launcher} (not found beside the library "
                                                                 "or on PATH)",
            "oversubscribe": " ".join(fam.oversubscribe) or "none needed (Hydra starts any number of ranks)",
            "srun_mpi": f"--mpi={fam.srun_mpi}"}


def capability_info(caps: dict) -> dict:
    """:func:`hpccomm._mpi.library.capabilities` as the lines of ``hpccomm info``."""
    large = caps["large_count"]
    if large is None:
        count = "unknown (the MPI library file was not found in this process)"
    elif large:
        count = "yes (MPI_Send_c and the other MPI-4 _c calls, which mpi4py uses)"
    else:
        count = ("no (no MPI_Send_c: mpi4py refuses counts past 2**31-1; hpccomm splits messages at "
                 "HPCCOMM_MAX_MPI_COUNT)")
    classes = " ".join(f"{k}={v}" for k, v in caps["error_classes"].items())
    ulfm = ("distinct classes" if caps["ulfm_classes"] else
            "ERR_PROC_FAILED and ERR_REVOKED are ERR_UNKNOWN in this mpi4py build (no fault-tolerance classes)")
    return {"large_count": count, "tag_ub": caps["tag_ub"], "error_classes": classes, "ulfm_error_classes": ulfm}


def collect() -> dict:
    """This rank's view, as plain JSON-able data.  Under a launcher every
    rank calls it at once (its GPU routes are agreed over MPI_COMM_WORLD)."""
    import torch

    from .. import gpu, launcher
    from .._about import __version__
    from .. import _compat as compat

    mpi = mpi_info()
    try:
        cuda, devices = torch.cuda.is_available(), torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a broken CUDA set-up is itself worth reporting, not a crash
        cuda, devices = False, 0
    return {
        "versions": {"hpccomm": __version__, "torch": torch.__version__, "mpi4py": _version("mpi4py"),
                     "numpy": _version("numpy"), "python": platform.python_version()},
        "mpi": mpi,
        "launcher": asdict(launcher.detect()),
        "host": host_info(),
        "interfaces": interfaces(),
        "store": store_info(),
        "options": options(),
        # every rank collects at once: the GPU routes are those of a group of every rank, from all their findings
        "gpu": {"cuda": cuda, "devices": devices, "nccl": compat.nccl_available(),
                **(gpu.info(everyone=(mpi["size"] or 1) > 1) if mpi["available"] else {})},
        "pid": os.getpid(),
    }


# --------------------------------------------------------------------------
# many ranks' views
# --------------------------------------------------------------------------

def flatten(report: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out = {}
    for key, value in report.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differing(reports: list) -> list:
    """The dotted field names whose values are not the same on every rank."""
    flat = [flatten(r) for r in reports]
    keys = sorted(set().union(*flat)) if flat else []
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1
            and k not in NOT_TABULATED]


def _must_agree(key: str) -> bool:
    return any(key.startswith(p) if p.endswith(".") else key == p for p in MUST_AGREE)


def problems(reports: list) -> list:
    """What is wrong, as sentences naming the ranks and the fix, from the
    views of all ranks (``reports[r]`` is rank r's :func:`collect`)."""
    from .. import launcher as launchers

    found = []
    flat = [flatten(r) for r in reports]
    for key in differing(reports):
        if _must_agree(key):
            groups: dict = {}
            for rank, f in enumerate(flat):
                groups.setdefault(json.dumps(f.get(key)), []).append(rank)
            said = "; ".join(f"{json.loads(v)!r} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}"
                             for v, rs in groups.items())
            found.append(f"{key} differs between ranks: {said}")
    hosts = {r.get("host", {}).get("name") for r in reports}
    for rank, r in enumerate(reports):
        mpi, launch, host = r.get("mpi", {}), r.get("launcher", {}), r.get("host", {})
        if not mpi.get("available"):
            found.append(f"rank {rank}: no usable MPI: {mpi.get('reason')}")
            continue
        size, lsize = mpi.get("size"), launch.get("size")
        if lsize is not None and launch.get("name") != "single" and lsize != size:
            plugin = launchers.srun_mpi_plugin(mpi.get("library") or "")
            hint = ""
            if size == 1 and launch.get("name") == "srun":
                hint = (f" (the silent-singleton trap: use srun --mpi={plugin}" if plugin
                        else " (the silent-singleton trap: use srun --mpi=pmix for Open MPI, --mpi=pmi2 for MPICH")
                hint += f"; this step has --mpi={launch.get('pmi') or 'none'})"
            elif size == 1:
                hint = " (the silent-singleton trap: every process runs alone; launch with the MPI library's own " \
                       "mpirun/mpiexec" + (f" or srun --mpi={plugin}" if plugin else "") + ")"
            found.append(f"rank {rank}: {launch.get('command')} started {lsize} processes "
                         f"({launch.get('size_variable')}={lsize}) but MPI says the world has {size}{hint}")
        elif launch.get("name") != "single" and launch.get("rank") not in (None, mpi.get("rank")):
            found.append(f"rank {rank}: {launch.get('command')} says rank {launch.get('rank')} "
                         f"({launch.get('rank_variable')}) but MPI says rank {mpi.get('rank')}")
        if host.get("error"):
            found.append(f"rank {rank}: {host['error']}: fix /etc/hosts or DNS, or set HPCCOMM_STORE_ADDR")
        elif len(hosts) > 1 and host.get("loopback"):
            found.append(f"rank {rank}: host name {host.get('name')!r} resolves only to loopback "
                         f"({', '.join(host.get('addresses', []))}) on a {len(hosts)}-node run: other nodes cannot "
                         "reach it by name; fix /etc/hosts or set HPCCOMM_STORE_ADDR to an address of rank 0")
        for key, value in flatten(r.get("options", {}), "options.").items():
            if isinstance(value, str) and value.startswith("INVALID: "):
                found.append(f"rank {rank}: {value[len('INVALID: '):]}")
    store = reports[0].get("store", {}) if reports else {}
    for what in ("free_port", "configured_port"):
        value = store.get(what)
        if value not in (None, "ok"):
            found.append(f"rank 0 (where the key-value store opens): {value}"
                         + ("; set HPCCOMM_STORE_PORT to a port that is free" if what == "configured_port" else ""))
    return _unique(found)


def _unique(items: list) -> list:
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def _ranks(ranks: list) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def gather(report: dict) -> list:
    """Every rank's report on rank 0 (None elsewhere); a list of one without MPI."""
    if not report["mpi"].get("available") or (report["mpi"].get("size") or 1) == 1:
        return [report]
    from .. import _mpi

    return _mpi.mpi().COMM_WORLD.gather(report, root=0)


# --------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------

def _show(value) -> str:
    if value is None:
        return "-"
    if value == "":
        return '""'
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    return str(value)


def render(reports: list, found: list) -> str:
    """Rank 0's view, the per-rank table of the fields that differ (besides
    rank numbers equal to the rank), the problems.  Where torch sees no CUDA
    device, the ``[gpu]`` section is one line (``--json`` has every field)."""
    lines = []
    first = reports[0]
    title = f"hpccomm info (rank 0 of {len(reports)})" if len(reports) > 1 else "hpccomm info"
    lines.append(title)
    for section in ("versions", "mpi", "launcher", "host", "interfaces", "store", "gpu", "options"):
        fields = first.get(section, {})
        if section == "gpu" and not fields.get("cuda") and not fields.get("devices"):
            lines.append(f"[gpu] none: torch {first.get('versions', {}).get('torch', '')} sees no CUDA device here: "
                         "CPU tensors only (hpccomm info --json has the GPU fields)")
            continue
        lines.append(f"[{section}]")
        for key, value in fields.items():
            lines.append(f"  {key:26s} {_show(value)}")
    if len(reports) > 1:
        flat = [flatten(r) for r in reports]
        numbers = [k for k in RANK_NUMBERS if all(f.get(k) == r for r, f in enumerate(flat))]
        keys = [k for k in differing(reports) if k not in numbers]
        if keys:
            lines.append(f"[per rank] fields that differ between the {len(reports)} ranks"
                         + (f" (besides {', '.join(numbers)}: the rank)" if numbers else ""))
            rows = [["rank", *keys]] + [[str(r), *(_show(f.get(k)) for k in keys)] for r, f in enumerate(flat)]
            widths = [max(len(row[i]) for row in rows) for i in range(len(keys) + 1)]
            for row in rows:
                lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        else:
            lines.append(f"[per rank] the {len(reports)} ranks differ only in their rank numbers"
                         + (f" ({', '.join(numbers)})" if numbers else ""))
    if found:
        lines.append(f"[problems] {len(found)}")
        lines += [f"  - {p}" for p in found]
    else:
        lines.append("[problems] none found")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print JSON: {\"ranks\": [each rank's view], \"differing\": [...], \"problems\": [...]}")
    parser.epilog = ("Exit status: 0 no problem found, 1 a problem found (listed under [problems]), "
                     "2 bad arguments. Under mpirun/srun, rank 0 prints every rank's view.")


def run(args) -> int:
    report = collect()
    reports = gather(report)
    status = 0
    if reports is not None:  # rank 0 speaks for all
        found = problems(reports)
        if args.json:
            print(json.dumps({"ranks": reports, "differing": differing(reports), "problems": found}, indent=2,
                             default=str))
        else:
            print(render(reports, found))
        sys.stdout.flush()
        status = 1 if found else 0
    if len(reports or ()) != 1 or reports[0] is not report:  # every rank exits with rank 0's verdict
        from .. import _mpi

        status = _mpi.mpi().COMM_WORLD.bcast(status, root=0)
    return status
