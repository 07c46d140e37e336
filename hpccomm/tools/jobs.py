"""``hpccomm jobs``: SLURM job templates (list, render, submit) and the preflight
checks the templates run before the real work.

The templates are the plain sbatch scripts in the repository's ``jobs/`` folder;
each runs as-is once its values are set.  Rendering fills in the values of
those scripts' own lines, so a rendered script reads like the template:

- ``#SBATCH --nodes=2`` style lines for ``--nodes``, ``--ntasks-per-node``,
  ``--gpus-per-node``, ``--cpus-per-task``, ``--time``; ``##SBATCH
  --partition=...`` (commented out) becomes ``#SBATCH --partition=P``;
- the ``COMMAND=(...)`` line gets the command given after ``--``;
- ``--mpi-plugin`` sets the ``MPI_PLUGIN=`` line (srun's ``--mpi=``; ``auto``,
  the templates' default, asks ``python -m hpccomm jobs mpi-plugin`` in the job);
- torchrun.sbatch runs one task per node: there ``--ntasks-per-node`` sets its
  ``NPROC_PER_NODE=`` line (workers per node) instead.

A value the template has no line for is an error, as is a missing value the
template needs.  Examples::

    hpccomm jobs list
    hpccomm jobs render cpu --nodes 2 --ntasks-per-node 4 -- python train.py > job.sbatch
    hpccomm jobs submit cpu --nodes 2 --ntasks-per-node 4 -- python train.py
    srun --mpi=pmix python -m hpccomm jobs preflight      # inside a job, on every rank
    python -m hpccomm jobs mpi-plugin                     # pmix or pmi2: the srun plugin of the MPI library

Nothing in the library imports this module.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: Where the templates are: the ``jobs/`` folder of the source tree.
DEFAULT_TEMPLATES = Path(__file__).resolve().parents[2] / "jobs"


class JobsError(Exception):
    """A user mistake: printed as one line on stderr, exit status 2."""


@dataclass(frozen=True)
class Param:
    name: str  # the option name, without dashes
    pattern: str  # regex of the template line holding the value (group 1: the value)
    line: str  # the rendered line, with {value}


def _sbatch(option: str) -> Param:
    return Param(option, rf"^#SBATCH --{option}=(\S+)$", f"#SBATCH --{option}={{value}}")


#: The parameters ``render`` fills in, in the order they are applied.
PARAMS = {p.name: p for p in (
    _sbatch("nodes"),
    _sbatch("ntasks-per-node"),
    _sbatch("gpus-per-node"),
    _sbatch("cpus-per-task"),
    _sbatch("time"),
    Param("partition", r"^##?SBATCH --partition=(\S+)$", "#SBATCH --partition={value}"),
    Param("mpi-plugin", r"^MPI_PLUGIN=(\S+)$", "MPI_PLUGIN={value}"),
)}
#: Templates where a parameter lives on another line.
OVERRIDES = {
    "torchrun": {"ntasks-per-node": Param("ntasks-per-node", r"^NPROC_PER_NODE=(\S+)$", "NPROC_PER_NODE={value}")},
}
COMMAND = Param("command", r"^COMMAND=\((.*)\)$", "COMMAND=({value})")
#: Parameters every rendering must be given.
REQUIRED = ("nodes", "ntasks-per-node")

_TIME = re.compile(r"^(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d)$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_PLUGIN = re.compile(r"^[a-z][a-z0-9_]*$")


def templates(folder: Path = DEFAULT_TEMPLATES) -> dict:
    """Template name -> path, for every ``*.sbatch`` in ``folder``."""
    if not folder.is_dir():
        raise JobsError(f"no templates folder {folder}; pass --templates DIR (the jobs/ folder of hpccomm's "
                        "source tree)")
    return {p.name[: -len(".sbatch")]: p for p in sorted(folder.glob("*.sbatch"))}


def description(path: Path) -> str:
    """The first comment line after the shebang."""
    for line in path.read_text().splitlines()[1:]:
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def _params_of(name: str) -> dict:
    return {**PARAMS, **OVERRIDES.get(name, {})}


def _check_value(option: str, value) -> str:
    text = str(value)
    if option in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task"):
        if not text.isdigit() or int(text) < 1:
            raise JobsError(f"--{option} must be a positive integer, not {text!r}")
    elif option == "time" and not _TIME.match(text):
        raise JobsError(f"--time {text!r} is not a SLURM time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)")
    elif option == "partition" and not _NAME.match(text):
        raise JobsError(f"--partition {text!r} is not a partition name")
    elif option == "mpi-plugin" and not _PLUGIN.match(text):
        raise JobsError(f"--mpi-plugin {text!r} is not an srun MPI plugin name (auto, pmix, pmi2, ...)")
    return text


def render(name: str, values: dict, command: list, folder: Path = DEFAULT_TEMPLATES) -> str:
    """The template ``name`` with ``values`` ({option: value}, None = keep the
    template's) and ``command`` (a list of words) filled in.

    Raises :class:`JobsError` for an unknown template, a missing required value
    or command, a value the template has no line for, or a malformed value.

    Example::

        render("cpu", {"nodes": 2, "ntasks-per-node": 4}, ["python", "train.py"])
    """
    known = templates(folder)
    if name not in known:
        raise JobsError(f"no template {name!r}; templates: {', '.join(known) or '(none)'} (in {folder})")
    lines = known[name].read_text().splitlines()
    params = _params_of(name)
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise JobsError(f"unknown parameter(s) {', '.join('--' + u for u in unknown)}; "
                        f"known: {', '.join('--' + p for p in params)}")
    given = {k: v for k, v in values.items() if v is not None}
    for option in REQUIRED:
        if option not in given:
            raise JobsError(f"template {name!r} needs --{option}")
    if not command:
        raise JobsError(f"template {name!r} needs the command to run, after -- (e.g. -- python train.py)")

    def slot(param: Param) -> Optional[int]:
        found = [i for i, line in enumerate(lines) if re.match(param.pattern, line)]
        if len(found) > 1:
            raise JobsError(f"template {name!r} has {len(found)} lines for --{param.name} "
                            f"(lines {', '.join(str(i + 1) for i in found)}); it must have one")
        return found[0] if found else None

    for option, param in params.items():
        where = slot(param)
        if option == "gpus-per-node" and where is not None and option not in given:
            raise JobsError(f"template {name!r} needs --gpus-per-node")
        if option not in given:
            continue
        if where is None:
            raise JobsError(f"template {name!r} has no --{option} (no line matching {param.pattern!r}); "
                            "leave the option out or pick another template")
        lines[where] = param.line.format(value=_check_value(option, given[option]))
    where = slot(COMMAND)
    if where is None:
        raise JobsError(f"template {name!r} has no COMMAND=(...) line")
    lines[where] = COMMAND.line.format(value=" ".join(shlex.quote(word) for word in command))
    return "\n".join(lines) + "\n"


def submit(script: str, test_only: bool = False) -> str:
    """Submit ``script`` with sbatch; returns sbatch's answer (the job id, or
    with ``test_only`` the scheduler's estimate).  Raises JobsError if sbatch is
    missing or refuses the job."""
    cmd = ["sbatch", "--test-only"] if test_only else ["sbatch", "--parsable"]
    try:
        proc = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise JobsError("sbatch not found: run this on a SLURM login node (or put SLURM's commands on PATH)") \
            from None
    if proc.returncode != 0:
        raise JobsError(f"sbatch refused the job (exit status {proc.returncode}): {proc.stderr.strip()}")
    if test_only:  # sbatch --test-only answers on stderr
        return (proc.stdout + proc.stderr).strip()
    return proc.stdout.strip().split(";")[0]


# --------------------------------------------------------------------------- preflight


def tasks_per_node(spec: str) -> list:
    """SLURM's compressed tasks-per-node list expanded: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    out = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"not a SLURM tasks-per-node list: {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _gpus_here(env) -> Optional[int]:
    """GPUs SLURM gave this node's tasks (None: SLURM gave none it knows of)."""
    visible = env.get("CUDA_VISIBLE_DEVICES", env.get("ROCR_VISIBLE_DEVICES"))
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    return int(on_node) if on_node.isdigit() else None


def _tasks_here(env) -> Optional[int]:
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    node = env.get("SLURM_NODEID", "")
    try:
        per_node = tasks_per_node(spec)
    except ValueError:
        return None
    return per_node[int(node)] if node.isdigit() and int(node) < len(per_node) else None


def check_gpus(env, tasks: Optional[int]) -> list:
    """Problems with the GPUs of this node for ``tasks`` ranks (one GPU each)."""
    gpus = _gpus_here(env)
    node = env.get("SLURMD_NODENAME", socket.gethostname())
    if tasks is None:
        return []
    if gpus is None or gpus == 0:
        return [f"node {node}: {tasks} rank(s) but no GPU allocated (CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE "
                "unset): add #SBATCH --gpus-per-node equal to --ntasks-per-node"]
    if gpus != tasks:
        return [f"node {node}: {tasks} rank(s) but {gpus} GPU(s): one rank per GPU needs "
                f"--ntasks-per-node equal to --gpus-per-node "
                f"({'GPUs left idle' if gpus > tasks else 'ranks would share GPUs'})"]
    return []


def _is_loopback(host: str) -> Optional[str]:
    """The loopback address ``host`` resolves to here, or None."""
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return None
    loop = sorted(a for a in addrs if a.startswith("127.") or a == "::1")
    return loop[0] if loop and len(loop) == len(addrs) else None


def check_endpoint(host: str, host_machine: str, here: str) -> list:
    """Problems reaching ``host`` (run on machine ``host_machine``) from machine ``here``."""
    try:
        socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        return [f"host {here}: cannot resolve the rendezvous host {host!r}: {exc}"]
    loop = _is_loopback(host)
    if loop and here.split(".")[0] != host_machine.split(".")[0]:
        return [f"host {here}: the rendezvous host {host!r} (on {host_machine}) resolves to the loopback address "
                f"{loop} here, so this node would talk to itself: use an address of {host_machine} the other "
                "nodes reach (for hpccomm: HPCCOMM_STORE_ADDR), or fix its /etc/hosts entry"]
    return []


def _store_address() -> str:
    """The address rank 0 would give hpccomm's store on a multi-node job."""
    from .._start.bootstrap import store_address

    return store_address(multi_node=True)


def _library(MPI) -> str:
    """The MPI library's name and version, e.g. ``Open MPI v5.0.11``."""
    return MPI.Get_library_version().splitlines()[0].split(",")[0].strip()


def _mpi_plugin_hint(library: str) -> str:
    from ..launcher import family_of

    family = family_of(library)
    if family is None:
        return "use srun --mpi=pmix for Open MPI, --mpi=pmi2 for MPICH and Intel MPI (srun --mpi=list shows them)"
    return f"this is {family.title}: use srun --mpi={family.srun_mpi} ({family.srun_others})"


def mpi_plugin() -> str:
    """The ``srun --mpi=`` plugin for the MPI library mpi4py loads (found
    without starting MPI): ``pmix`` (Open MPI) or ``pmi2`` (MPICH, Intel MPI).
    Raises :class:`JobsError` when there is no MPI library or it is of no
    family hpccomm knows."""
    from .._mpi import library
    from ..launcher import srun_mpi_plugin

    probe = library.probe()
    if not probe.available:
        raise JobsError(f"no usable MPI library: {probe.reason}")
    plugin = srun_mpi_plugin(probe.library)
    if plugin is None:
        raise JobsError(f"no srun plugin known for {probe.library!r}: set MPI_PLUGIN= in the job script "
                        "(srun --mpi=list shows the plugins of this SLURM)")
    return plugin


#: How long the preflight's MPI_Init may take before the rank ends with a message (seconds).
PREFLIGHT_INIT_TIMEOUT = 300


def preflight_mpi(gpus: bool, env=os.environ, expect: Optional[int] = None) -> list:
    """Run on every rank: the MPI world is the whole job, GPUs (if asked) match
    ranks per node, the store address is reachable from every host.  Returns
    the problems (on every rank; [] when all is well).  ``expect``: the world
    size wanted (default SLURM_NTASKS; under mpirun, pass the job's, since the
    ranks see the SLURM_NTASKS of mpirun's own daemon step)."""
    from .. import _mpi

    # MPI_Init watched: a rank that never comes or a broken PMI exchange (the pip MPICH wheel's UCX
    # addresses under srun --mpi=pmi2) ends the preflight with a message instead of hanging the job.
    MPI = _mpi.mpi(init_timeout=PREFLIGHT_INIT_TIMEOUT)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    library = _library(MPI)
    expected = str(expect) if expect is not None else env.get("SLURM_NTASKS", "")
    if expected.isdigit() and int(expected) != size:
        # A world of 1 whose launcher is srun itself (not an mpirun or mpiexec that srun
        # started): the wrong --mpi= plugin.
        from ..launcher import detect

        if size == 1 and detect(env).name == "srun":
            return [f"srun started {expected} tasks (SLURM_NTASKS={expected}) but MPI sees a world of {size} "
                    f"({library}): every rank would run alone; " + _mpi_plugin_hint(library)]
        return [f"the job has {expected} tasks but MPI sees a world of {size} ({library}): start {expected} ranks "
                "(mpirun inside the allocation takes the count from SLURM when given no -n)"]
    problems = []
    if gpus:
        problems += check_gpus(env, _tasks_here(env))
    here = socket.gethostname()
    root_host, store = comm.bcast((here, _store_address() if rank == 0 else None), root=0)
    if len(set(comm.allgather(here))) > 1:
        problems += check_endpoint(store, root_host, here)
    return list(dict.fromkeys(p for ps in comm.allgather(problems) for p in ps))  # once per node, not per rank


def _templates_option(p, suppress: bool = False) -> None:
    p.add_argument("--templates", type=Path, default=argparse.SUPPRESS if suppress else DEFAULT_TEMPLATES,
                   metavar="DIR", help=f"the templates folder (default: {DEFAULT_TEMPLATES})")


def _render_options(p, suppress: bool = False) -> None:
    _templates_option(p, suppress)
    default = argparse.SUPPRESS if suppress else None
    p.add_argument("--nodes", default=default, help="number of nodes (required)")
    p.add_argument("--ntasks-per-node", default=default, help="ranks per node (torchrun: workers per node; required)")
    p.add_argument("--gpus-per-node", default=default, help="GPUs per node (GPU templates only; required there)")
    p.add_argument("--cpus-per-task", default=default, help="cores per rank")
    p.add_argument("--time", default=default, help="time limit, e.g. 01:00:00")
    p.add_argument("--partition", default=default, help="partition (queue)")
    p.add_argument("--mpi-plugin", default=default,
                   help="srun's --mpi= plugin (templates started by srun; default auto: the MPI library's)")


def _split_rest(args) -> list:
    """Parse the options that came after NAME into ``args``; return the command."""
    rest = list(args.rest)
    command = []
    if "--" in rest:
        cut = rest.index("--")
        rest, command = rest[:cut], rest[cut + 1:]
    inner = argparse.ArgumentParser(prog=f"hpccomm jobs {args.jobs_command} NAME", add_help=False)
    _render_options(inner, suppress=True)
    if args.jobs_command == "submit":
        inner.add_argument("--test-only", action="store_true", default=argparse.SUPPRESS)
    extra, unknown = inner.parse_known_args(rest)
    if unknown:
        raise JobsError(f"unexpected argument(s) {' '.join(unknown)}; the command goes after -- "
                        "(e.g. -- python train.py)")
    for key, value in vars(extra).items():
        setattr(args, key, value)
    return command


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    p = sub.add_parser("list", help="list the templates", description="List the sbatch templates.")
    _templates_option(p)
    for action, text in (("render", "print a ready sbatch script from a template"),
                         ("submit", "render a template and submit it with sbatch; prints the job id")):
        p = sub.add_parser(action, help=text, description=text + ".",
                           epilog="The command every rank runs goes after --, e.g. -- python train.py")
        p.add_argument("name", help="template name (see: hpccomm jobs list)")
        _render_options(p)
        # Options may come before or after NAME: the rest is parsed again in run().
        p.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- COMMAND...", help="what every rank runs")
        if action == "submit":
            p.add_argument("--test-only", action="store_true",
                           help="sbatch --test-only: check the job against the cluster without submitting it")
    p = sub.add_parser("preflight", help="check a launch before the real work (run on every rank)",
                       description="Check a launch before the real work.  With MPI (the default) run it on "
                       "every rank (srun --mpi=pmix python -m hpccomm jobs preflight): the MPI world has "
                       "SLURM_NTASKS ranks, GPUs match ranks per node (--gpus), hpccomm's store address is "
                       "not a loopback address on a multi-host job.  With --no-mpi (torchrun: one task per "
                       "node) it checks the rendezvous endpoint and GPUs against --nproc-per-node.  Exit "
                       "status 1 and the problems on stderr when a check fails.")
    p.add_argument("--no-mpi", action="store_true", help="do not start MPI (for torchrun's one task per node)")
    sub.add_parser("mpi-plugin", help="print the srun --mpi= plugin of the MPI library mpi4py loads",
                   description="Print the srun --mpi= plugin that connects ranks of the MPI library mpi4py "
                   "loads: pmix for Open MPI, pmi2 for MPICH and Intel MPI (MPI is not started). The "
                   "templates' MPI_PLUGIN=auto runs this. Exit status 2 when it cannot tell.")
    p.add_argument("--gpus", action="store_true", help="check one GPU per rank on every node")
    p.add_argument("--expect-size", type=int, metavar="N",
                   help="the world size wanted (default: SLURM_NTASKS; under mpirun pass the job's $SLURM_NTASKS)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="(--no-mpi) the torchrun rendezvous endpoint")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="(--no-mpi) workers per node")


def _run_preflight(args) -> int:
    env = os.environ
    if args.no_mpi:
        here = socket.gethostname()
        problems = []
        if args.rdzv_endpoint:
            host, _, port = args.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise JobsError(f"--rdzv-endpoint {args.rdzv_endpoint!r} is not HOST:PORT")
            nodes = env.get("SLURM_JOB_NUM_NODES", "1")
            if (host == "localhost" or host.startswith("127.") or host == "::1") and nodes != "1":
                problems.append(f"host {here}: the rendezvous endpoint {host!r} is a loopback address on a "
                                f"{nodes}-node job: use the first node's host name (RDZV_HOST=$(hostname))")
            else:  # a host name: the machine of that name is the one running the rendezvous
                problems += check_endpoint(host, host, here)
        if args.nproc_per_node and _gpus_here(env):
            problems += check_gpus(env, args.nproc_per_node)
        for p in problems:
            print(f"hpccomm preflight: {p}", file=sys.stderr)
        if not problems and env.get("SLURM_NODEID", "0") == "0":
            print(f"hpccomm preflight ok: {env.get('SLURM_JOB_NUM_NODES', '1')} node(s), rendezvous "
                  f"{args.rdzv_endpoint or '(none given)'}", flush=True)
        return 1 if problems else 0
    problems = preflight_mpi(args.gpus, env, args.expect_size)
    # mpirun's ranks inherit SLURM_PROCID from mpirun's daemons: the innermost launcher's rank.
    from ..launcher import detect

    first = (detect(env).rank or 0) == 0
    if problems and first:
        for p in problems:
            print(f"hpccomm preflight: {p}", file=sys.stderr)
    if not problems and first:
        from .. import _mpi

        MPI = _mpi.mpi()  # (started by the preflight)
        print(f"hpccomm preflight ok: {MPI.COMM_WORLD.Get_size()} ranks, "
              f"{env.get('SLURM_JOB_NUM_NODES', '?')} node(s) ({env.get('SLURM_JOB_NODELIST', '?')}), "
              f"{_library(MPI)}", flush=True)
    return 1 if problems else 0


def run(args) -> int:
    try:
        if args.jobs_command == "list":
            known = templates(args.templates)
            width = max((len(n) for n in known), default=0)
            for name, path in known.items():
                print(f"{name:{width}s}  {description(path)}")
            return 0
        if args.jobs_command == "preflight":
            return _run_preflight(args)
        if args.jobs_command == "mpi-plugin":
            print(mpi_plugin())
            return 0
        command = _split_rest(args)
        values = {k: getattr(args, k.replace("-", "_")) for k in PARAMS}
        script = render(args.name, values, command, args.templates)
        if args.jobs_command == "render":
            sys.stdout.write(script)
            return 0
        print(submit(script, args.test_only))
        return 0
    except JobsError as exc:
        print(f"hpccomm jobs {args.jobs_command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def main(argv=None) -> int:
    """``python -m hpccomm.tools.jobs ...``: the same as ``hpccomm jobs ...``."""
    parser = argparse.ArgumentParser(prog="hpccomm jobs", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
