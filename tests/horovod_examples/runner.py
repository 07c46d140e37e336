"""Run a Horovod example script and its DDP twin in one MPI job; compare their weights.

Under ``mpirun -n N python tests/horovod_examples/runner.py --script S --twin T
--out DIR [--seed K] -- <script arguments>``, every rank:

1. reads the Horovod script ``S`` and rewrites its import lines, and nothing
   else: ``import horovod.torch as hvd`` becomes ``import hpccomm.horovod as
   hvd``; a bare ``import horovod`` (Horovod's MNIST uses it only for
   ``horovod.run``, the launcher API) becomes ``import hpccomm.horovod as
   horovod``.  The rewritten file is written to ``DIR`` (to be read);
2. seeds torch's generator with ``K + rank`` and runs the script as
   ``__main__`` with the given arguments, recording the optimizer that
   ``hvd.DistributedOptimizer`` returns (the runner wraps that function);
3. ``hvd.shutdown()``, the same seed again, then runs the DDP twin ``T`` (the
   same training written for ``DistributedDataParallel`` on hpccomm) with the
   same arguments, recording its DDP model;
4. compares the two sets of parameters on every rank and prints, on rank 0,
   one line ``COMPARE ...`` with the largest differences; checks that every
   rank holds the same Horovod-trained parameters; exits 1 on every rank if a
   check failed.

When torchvision is importable but its compiled ops are not (the CUDA
torchvision wheel on a CPU torch: ``operator torchvision::nms does not
exist``), the runner first declares the two operator schemas torchvision's
import registers fakes for, so ``torchvision.models``/``datasets`` import;
they are never called by classification models or MNIST.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def rewrite(source: str):
    """The script with its Horovod imports pointed at hpccomm.horovod; the lines changed."""
    changes = []
    out = []
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == "import horovod.torch as hvd":
            new = line.replace("import horovod.torch as hvd", "import hpccomm.horovod as hvd")
        elif stripped == "import horovod":
            new = line.replace("import horovod", "import hpccomm.horovod as horovod")
        else:
            out.append(line)
            continue
        changes.append((line.rstrip("\n"), new.rstrip("\n")))
        out.append(new)
    if re.search(r"^\s*(from|import)\s+horovod\b", "".join(out), re.M):
        raise SystemExit("runner: the script imports horovod in a way the one-line rewrite does not cover")
    return "".join(out), changes


def torchvision_shim() -> str:
    """Make ``import torchvision`` work without its compiled ops (see module docstring)."""
    try:
        import torchvision  # noqa: F401
        return "torchvision imported as it is"
    except RuntimeError as exc:
        if "torchvision::nms does not exist" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "DEF")  # kept alive below: the schemas live as long as it
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    torchvision_shim.lib = lib
    import torchvision  # noqa: F401,F811
    return "torchvision imported without its compiled ops (nms/qnms schemas declared by the runner)"


def run_main(path: str, source: str, argv) -> None:
    sys.argv = [path, *argv]
    code = compile(source, path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", required=True)
    parser.add_argument("--twin", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--torchvision", action="store_true", help="the script needs torchvision (Horovod's files)")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--make-mnist", metavar="DIR", help="write MNIST-format files under DIR first")
    args, rest = parser.parse_known_args()
    if rest and rest[0] == "--":
        rest = rest[1:]
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    problems = []
    if args.make_mnist:
        if rank == 0:
            import mnist_idx

            mnist_idx.write(args.make_mnist, n_train=240, n_test=120)
        world.Barrier()
    if args.torchvision:
        note = torchvision_shim()
        if rank == 0:
            print(f"runner: {note}", flush=True)
    with open(args.script) as f:
        source, changes = rewrite(f.read())
    os.makedirs(args.out, exist_ok=True)
    if rank == 0:
        with open(os.path.join(args.out, os.path.basename(args.script)), "w") as f:
            f.write(source)
        for old, new in changes:
            print(f"runner: rewrote {old.strip()!r} -> {new.strip()!r}", flush=True)
    if not any("horovod.torch" in old for old, _ in changes):
        problems.append("the script has no 'import horovod.torch as hvd' line")

    import hpccomm.horovod as hvd

    made = []
    real = hvd.DistributedOptimizer

    initial = {}

    def recording(*a, **k):
        opt = real(*a, **k)
        made.append(opt)
        initial.update({id(p): p.detach().clone() for g in opt.param_groups for p in g["params"]})
        return opt

    hvd.DistributedOptimizer = recording
    torch.manual_seed(args.seed + rank)
    try:
        run_main(args.script, source, rest)
    finally:
        hvd.DistributedOptimizer = real
    if len(made) != 1:
        problems.append(f"the script made {len(made)} DistributedOptimizer(s), expected 1")
    opt = made[-1]
    names = opt._parameter_names  # Horovod's {parameter: name}
    hvd_params = {names[p]: p.detach().clone() for g in opt.param_groups for p in g["params"]}
    moved = max((p.detach() - initial[id(p)]).abs().max().item() for g in opt.param_groups for p in g["params"])
    if not moved > 0:
        problems.append("training did not change the weights (nothing was compared)")
    hvd.shutdown()

    from torch.nn import parallel

    ddps = []
    real_ddp = parallel.DistributedDataParallel

    class RecordingDDP(real_ddp):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            ddps.append(self)

    parallel.DistributedDataParallel = RecordingDDP
    torch.manual_seed(args.seed + rank)
    try:
        with open(args.twin) as f:
            run_main(args.twin, f.read(), rest)
    finally:
        parallel.DistributedDataParallel = real_ddp
    ddp_params = {k: v.detach().clone() for k, v in ddps[-1].module.named_parameters()}

    if sorted(hvd_params) != sorted(ddp_params):
        problems.append(f"parameter names differ: {sorted(hvd_params)} vs {sorted(ddp_params)}")
    worst_abs = worst_rel = 0.0
    worst_name = ""
    for name in sorted(set(hvd_params) & set(ddp_params)):
        a, b = hvd_params[name].double(), ddp_params[name].double()
        diff = (a - b).abs()
        if diff.numel() and diff.max().item() > worst_abs:
            worst_abs, worst_name = diff.max().item(), name
        worst_rel = max(worst_rel, (diff / b.abs().clamp_min(1e-3)).max().item() if diff.numel() else 0.0)
        if not torch.allclose(a, b, rtol=args.rtol, atol=args.atol):
            problems.append(f"{name}: Horovod and DDP weights differ by up to {diff.max().item():.3g} "
                            f"(rtol {args.rtol}, atol {args.atol})")
    flat = torch.cat([hvd_params[k].flatten() for k in sorted(hvd_params)])
    everyone = world.allgather(flat.numpy().tobytes())
    if any(b != everyone[0] for b in everyone):
        problems.append("the Horovod-trained parameters differ between ranks")
    worst_abs = world.allreduce(worst_abs, op=MPI.MAX)
    worst_rel = world.allreduce(worst_rel, op=MPI.MAX)
    all_problems = world.allgather(problems)
    if rank == 0:
        print(f"COMPARE ranks={size} tensors={len(hvd_params)} elements={flat.numel()} max_abs_diff={worst_abs:.3e} "
              f"max_rel_diff={worst_rel:.3e} (largest in {worst_name or '-'}) rtol={args.rtol} atol={args.atol} "
              f"identical_across_ranks={all(b == everyone[0] for b in everyone)} "
              f"largest_weight_change={moved:.3e}", flush=True)
        for r, ps in enumerate(all_problems):
            for p in ps:
                print(f"WRONG rank {r}: {p}", flush=True)
    return 1 if any(all_problems) else 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - end every rank, not just this one
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    sys.exit(code)
