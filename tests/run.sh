#!/usr/bin/env bash
# The whole test suite: plain unit tests once, then the MPI tests under
# mpirun at world sizes 1, 2, 3 and 4 (oversubscribed), each under a timeout so
# a hang becomes a failure with a log.  Rank 0 prints; other ranks' output is
# in tests/logs/n<size>-rank<r>.log.
#   HPCCOMM_TEST_SIZES="2 4" bash tests/run.sh     # only some sizes
#   bash tests/run.sh -k all_reduce                 # extra pytest arguments
set -uo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1        # oversubscribed: yield instead of spinning
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
sizes=${HPCCOMM_TEST_SIZES:-"1 2 3 4"}
limit=${HPCCOMM_TEST_TIMEOUT:-1800}
mkdir -p tests/logs
status=0
echo "== unit tests (no MPI launch)"
python -m pytest -q -p no:cacheprovider -m "not mpi" "$@"
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1   # 5: no test selected (a -k for MPI tests only)
for n in $sizes; do
    echo "== mpirun -n $n"
    timeout --kill-after=30 "$limit" mpirun -n "$n" --oversubscribe \
        bash tests/rank_output.sh python -m pytest -q -p no:cacheprovider --with-mpi -m mpi "$@"
    rc=$?
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "!! mpirun -n $n timed out after ${limit}s (see tests/logs/n$n-rank*.log)"
        status=1
    fi
done
[ $status -eq 0 ] && echo "== all test runs passed" || echo "!! some test runs failed"
exit $status
