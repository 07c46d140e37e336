#!/usr/bin/env bash
# Run "$@" as one MPI rank: rank 0 keeps the terminal, other ranks write to
# tests/logs/n<size>-rank<r>.log.  The rank is the launcher's: Open MPI's mpirun
# (OMPI_COMM_WORLD_*), Hydra's mpiexec of MPICH and Intel MPI, and srun --mpi=pmi2
# (PMI_*), srun with any other plugin (SLURM_*).  With HPCCOMM_TEST_JUNIT set
# (tests/run.sh's time report), rank 0's pytest writes its JUnit report there;
# the other ranks run the same tests and write none.
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}
size=${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-${SLURM_NTASKS:-1}}}
if [ "$rank" = 0 ]; then
    [ -n "${HPCCOMM_TEST_JUNIT:-}" ] && set -- "$@" --junitxml="$HPCCOMM_TEST_JUNIT" -o junit_family=xunit1
    exec "$@"
fi
mkdir -p "$(dirname "$0")/logs"
exec "$@" >"$(dirname "$0")/logs/n$size-rank$rank.log" 2>&1
