#!/usr/bin/env bash
# Run "$@" as one MPI rank: rank 0 keeps the terminal, other ranks write to
# tests/logs/n<size>-rank<r>.log (Open MPI and MPICH/Hydra variables).
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}
size=${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-${SLURM_NTASKS:-1}}}
if [ "$rank" = 0 ]; then
    exec "$@"
fi
mkdir -p "$(dirname "$0")/logs"
exec "$@" >"$(dirname "$0")/logs/n$size-rank$rank.log" 2>&1
