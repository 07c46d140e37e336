#!/usr/bin/env bash
# The CI matrix: the test suite (tests/run.sh) once per cell, a cell being a
# torch version x an MPI family, each in its own virtual environment inside the
# clone (made here when missing; nothing is cached outside the clone).
#
#   bash tests/matrix.sh                              # every cell (what .ci/run runs)
#   HPCCOMM_TEST_CELLS="2.15-mpich" bash tests/matrix.sh   # pick cells
#
# Cells: tests/cells.py CELLS, each a torch version x an MPI family and what runs there: the primary
# cell (torch 2.13 + Open MPI, the README's .venv) the whole suite, every MPI test at sizes 1-4; each
# other cell the tests whose outcome can depend on what that cell changes (torch's version, the MPI
# family, hpccomm installed from its wheel).  docs/testing.md, "Cells", says what each runs and why.
# Before installing anything the matrix checks that every test file is run by some cell
# (python3 tests/cells.py check), and at the end it prints where the time went: per cell, the install,
# the no-MPI phase and the MPI phase at each size, then the ten slowest tests (tests/cells.py report,
# from the phase times and JUnit reports tests/run.sh writes to build/ci-times/<cell>/).
#
# The torch 2.14/2.15 wheels are CUDA builds with their nvidia wheels (about 4 GB to download, 5.4 GB
# installed, about 2 minutes to install here; they run without a GPU).  One torch install serves every
# cell of that version: the cell's venv holds its MPI wheel, mpi4py and hpccomm, and sees torch through
# a .pth file naming the shared torch venv (one MPI wheel per venv: each writes lib/libmpi.so).  The
# venvs of the cells after the primary one, up to the first CUDA torch's last cell, are made in the
# background while the primary cell's tests run (start_prefetch, below).
#
# Disk: a CI machine may have little (CI's run of 471c8e8 ran out of space installing the second CUDA
# torch).  So installs here keep no pip cache (it would hold a second copy of every wheel), the cells
# of one torch version run one after the other, and a torch venv this run made is removed, with the
# cell venvs that lean on it, once no later cell of the run needs it; venvs that were there before the
# run are kept.  At most one CUDA torch is on disk at a time: about 9 GB at the peak besides the clone
# (the primary cell's venv, and the wheel cell's and 2.15's made beside it in the background).
# An install that fails (the network dropped, say) is retried twice from an empty venv.
#
# pip runs with tests/constraints.txt as its only constraints, whatever the machine's or the user's pip
# configuration says (tests/pip_env.py; docs/testing.md "pip's configuration"), and each cell prints the
# torch its venv really holds and fails if it is not the declared one.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
cells=${HPCCOMM_TEST_CELLS:-$("$py" tests/cells.py cells)}
times=build/ci-times   # each cell's phase times and JUnit reports, for the report at the end

# Every test file in a suite, every suite run by some cell, the primary cell running them all.
"$py" tests/cells.py check || { echo "!! tests/cells.py check failed: a test file would run in no cell"; exit 2; }
rm -rf "$times"

# pip here runs with the project's constraints only (tests/constraints.txt): the machine's and the user's pip
# configuration keep only where packages come from (index, mirror, wheel folder, certificate); a configured
# constraint file (this project's machines cap torch at the releases on their disk: torch<=2.14.1), extra
# requirements or other pins are dropped, else a cell could not get its torch (tests/pip_env.py says why).
pip_env=()
while IFS= read -r -d '' arg; do pip_env+=("$arg"); done < <("$py" tests/pip_env.py tests/constraints.txt)
[ ${#pip_env[@]} -gt 0 ] || { echo "!! tests/pip_env.py failed: cannot set up pip"; exit 2; }
pip_q() { env "${pip_env[@]}" "$1/bin/pip" install -q --no-cache-dir "${@:2}"; }

# The torch version venv $1 holds ("none" without one).
torch_of() { "$1/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || echo none; }

free_disk() { df -Ph . | awk 'NR == 2 { print $4 " free on " $6 }'; }

# A venv this run creates gets the mark below (the functions run in $(...) subshells, so a file, not a
# variable); only marked venvs are ever removed.
mark=".made-by-matrix-$$"

# A new venv $1 with pip upgraded and the packages ${@:2}, tried three times from an empty folder.
new_venv() {
    local dir=$1 try
    for try in 1 2 3; do
        rm -rf "$dir"
        echo "== making $dir: ${*:2} (try $try; $(free_disk))" >&2
        if "$py" -m venv "$dir" && touch "$dir/$mark" && pip_q "$dir" --upgrade pip && { [ $# -eq 1 ] || pip_q "$dir" "${@:2}"; }; then
            return 0
        fi
        sleep $(( 15 * try ))
    done
    rm -rf "$dir"
    echo "!! could not make $dir ($(free_disk))" >&2
    return 1
}

# The venv with torch $1 alone, shared by the cells of that version.
torch_venv() {
    local version=$1 dir=".venv-torch$1"
    if ! { [ -x "$dir/bin/python" ] && [ "$(torch_of "$dir" | cut -d+ -f1)" = "$version" ]; }; then
        new_venv "$dir" "torch==$version" numpy || return 1
    fi
    echo "$dir"
}

# The 2.13-wheel cell: hpccomm as users install it.  The sdist and the wheel are built from the checkout
# (python -m build: the wheel from the sdist) into $wheel_cell/dist, the wheel is installed without -e in a
# venv made afresh each run, with torch and the MPI, test and frameworks extras, and the tests run from a
# copy of tests/, docs/, pyproject.toml and README.md (tests/test_docs.py reads its code blocks too) in
# $wheel_cell/run, where `import hpccomm` cannot find the checkout.
wheel_cell=build/wheel-cell
wheel_venv() {
    local dir=$1 version=$2 extra=$3 whl
    rm -rf "$wheel_cell" && mkdir -p "$wheel_cell/dist" "$wheel_cell/run" || return 1
    new_venv "$dir" build || return 1
    echo "== building the sdist and the wheel into $wheel_cell/dist" >&2
    env "${pip_env[@]}" "$dir/bin/python" -m build --outdir "$wheel_cell/dist" . > "$wheel_cell/build.log" 2>&1 \
        || { tail -20 "$wheel_cell/build.log" >&2; return 1; }
    whl=$(ls "$wheel_cell"/dist/hpccomm-*-py3-none-any.whl) || return 1
    if ! pip_q "$dir" "torch==$version" "$whl[$extra,test,frameworks]"; then   # once more, the network having dropped
        sleep 15; pip_q "$dir" "torch==$version" "$whl[$extra,test,frameworks]" || return 1
    fi
    tar -cf - --exclude=__pycache__ --exclude=tests/logs --exclude=tests/torch_suite/out --exclude=docs/_build \
        tests docs pyproject.toml README.md \
        | tar -xf - -C "$wheel_cell/run" || return 1
    echo "$dir"
}

# The venv of a cell: its MPI wheel, mpi4py and hpccomm (editable), torch from torch_venv; one made
# in the background this run (start_prefetch, below) as it is.
cell_venv() {
    local cell=$1 version=$2 extra=$3 dir
    if [ -e "$prefetched/$cell" ]; then
        echo ".venv-$cell"; return 0
    fi
    if [ "$cell" = 2.13-wheel ]; then
        wheel_venv ".venv-$cell" "$version" "$extra"; return
    fi
    if [ "$cell" = 2.13-openmpi ]; then   # the README's own install
        dir=.venv
        if [ ! -x "$dir/bin/python" ]; then
            new_venv "$dir" || return 1
        fi
        pip_q "$dir" "torch==$version" -e ".[$extra,test]" || return 1
        echo "$dir"; return 0
    fi
    local base site
    base=$(torch_venv "$version") || return 1
    dir=".venv-$cell"
    if [ ! -x "$dir/bin/python" ]; then
        new_venv "$dir" || return 1
    fi
    site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$root/$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/hpccomm-torch.pth"
    if ! pip_q "$dir" -e ".[$extra,test]"; then   # once more, the network having dropped, say
        sleep 15; pip_q "$dir" -e ".[$extra,test]" || return 1
    fi
    # torch's console script is in the torch venv's bin: the SLURM torchrun template runs it by name
    printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$root/$dir/bin/python" > "$dir/bin/torchrun"
    chmod +x "$dir/bin/torchrun"
    echo "$dir"
}

# The torch version cell $1 declares.
torch_version() { "$py" tests/cells.py spec "$1" 2>/dev/null | cut -d'|' -f1; }

# After the cell at position $2 of the run: remove the torch venv of version $1, and the cell venvs
# that see torch through it, where this run made them and no later cell of the run needs that version.
prune_torch() {
    local version=$1 after=$2 i=0 c v dir=".venv-torch$1"
    for c in $cells; do
        i=$(( i + 1 ))
        v=$(torch_version "$c")
        [ $i -gt "$after" ] && [ "$v" = "$version" ] && return 0
    done
    [ -e "$dir/$mark" ] || return 0
    for c in $cells; do
        v=$(torch_version "$c")
        [ "$v" = "$version" ] && [ -e ".venv-$c/$mark" ] && rm -rf ".venv-$c"
    done
    rm -rf "$dir"
    echo "== removed $dir and its cells' venvs: made by this run, needed by no later cell ($(free_disk))"
}

# The venvs of the cells after the first are made in the background while the first cell's tests run:
# their downloads and unpacking wait on the network and the disk, those tests on the CPU (in the
# foreground the installs took 47-88 s a cell: 2.15's torch 79-88 s, the wheel cell's build and
# frameworks 55 s, each 2.15 cell's MPI wheel and hpccomm 22-25 s).  Only when the run starts with the
# primary cell's CPU torch, and only up to the first CUDA torch's last cell, so that one CUDA torch at
# most is on disk at any time (the venvs of later versions are made when their cell comes, after the
# one before is removed).  It starts once the first cell's venv is made (two builds of the checkout at
# once would both write its egg-info).  A cell made in the background is marked in
# $times/prefetched/; the first cell that needs one waits for the whole background job; a cell whose
# venv the background could not make makes it itself as before (retried twice).
prefetch_cells="" prefetch_pid="" prefetch_log=$times/prefetch.log prefetched=$times/prefetched
primary_version=$(torch_version "$("$py" tests/cells.py cells | tr -s ' \n' '\n\n' | head -1)")
if [ "$(torch_version "${cells%% *}")" = "$primary_version" ]; then
    cuda="" skip=1
    for c in $cells; do
        [ -n "$skip" ] && { skip=""; continue; }   # the first cell makes its own venv, in the foreground
        v=$(torch_version "$c")
        if [ "$v" != "$primary_version" ]; then
            [ -z "$cuda" ] && cuda=$v
            [ "$v" != "$cuda" ] && break   # a second CUDA torch: made when its cell comes
        fi
        prefetch_cells="$prefetch_cells $c"
    done
fi

# The venvs of $prefetch_cells, one after the other (a torch venv with the first cell that needs it).
prefetch() {
    local c
    for c in $prefetch_cells; do
        echo "== $c: making its venv in the background ($(free_disk))"
        if cell_venv "$c" "$(torch_version "$c")" "$("$py" tests/cells.py spec "$c" | cut -d'|' -f2)" > /dev/null; then
            touch "$prefetched/$c"
        else
            echo "!! $c: could not make its venv in the background"
        fi
    done
    echo "== the background installs ended ($(free_disk))"
}

start_prefetch() {
    [ -n "$prefetch_cells" ] || return 0
    mkdir -p "$prefetched"
    echo "== making the venvs of$prefetch_cells in the background (log: $prefetch_log; $(free_disk))"
    prefetch_start=$SECONDS
    prefetch > "$prefetch_log" 2>&1 &
    prefetch_pid=$!
    trap '[ -n "$prefetch_pid" ] && { pkill -P "$prefetch_pid"; kill "$prefetch_pid"; } 2>/dev/null' EXIT
}

# Before cell $1 makes its venv: wait for the background installs, if they include it.
await_prefetch() {
    [ -n "$prefetch_pid" ] && [[ " $prefetch_cells " == *" $1 "* ]] || return 0
    local c made="" missed=""
    wait "$prefetch_pid"
    prefetch_pid=""
    for c in $prefetch_cells; do
        if [ -e "$prefetched/$c" ]; then made="$made $c"; else missed="$missed $c"; fi
    done
    echo "== made in the background, $(( SECONDS - prefetch_start )) s after it began:${made:- none}" >&2
    if [ -n "$missed" ]; then
        echo "!! not made in the background:$missed (each makes its venv when it comes); the log's end:" >&2
        tail -5 "$prefetch_log" >&2
    fi
}

declare -A RESULT
status=0 position=0
for cell in $cells; do
    position=$(( position + 1 ))
    if ! spec=$("$py" tests/cells.py spec "$cell"); then
        status=1; continue
    fi
    IFS='|' read -r version family sizes suites unit mark_expr <<<"$spec"
    start=$SECONDS
    mkdir -p "$times/$cell"
    echo "==== cell $cell: torch $version, $family ($(free_disk))"
    await_prefetch "$cell"   # (here, not in cell_venv: $(...) runs in a subshell, which cannot wait for it)
    venv=$(cell_venv "$cell" "$version" "$family") || venv=""
    [ $position -eq 1 ] && start_prefetch
    printf 'install\t%s\t%s\n' $(( SECONDS - start )) "$([ -n "$venv" ] && echo ok || echo failed)" \
        >> "$times/$cell/phases.tsv"
    if [ -n "$venv" ]; then   # the torch the cell really got, whatever pip was told
        got=$(torch_of "$venv")
        echo "== cell $cell: torch $got in $venv (declared $version)"
    fi
    if [ -n "$venv" ] && [ "${got%%+*}" != "$version" ]; then
        echo "!! cell $cell: its venv $venv has torch $got, not the declared $version: not run"
        RESULT[$cell]="wrong torch"; status=1
    elif [ -n "$venv" ]; then
        tests=tests
        [ "$cell" = 2.13-wheel ] && tests=$wheel_cell/run/tests
        ( . "$venv/bin/activate"
          export HPCCOMM_TEST_MPI=$family HPCCOMM_TEST_SIZES=$sizes HPCCOMM_TEST_SUITES=$suites \
              HPCCOMM_TEST_UNIT_SUITES=${unit:-none} HPCCOMM_TEST_MARK=$mark_expr HPCCOMM_TEST_TIMES=$root/$times/$cell
          [ "$cell" = 2.13-wheel ] && export HPCCOMM_TEST_DIST=$root/$wheel_cell/dist
          bash "$tests/run.sh" "$@" )
        if [ $? -eq 0 ]; then RESULT[$cell]=passed; else RESULT[$cell]=FAILED; status=1; fi
    else
        echo "!! cell $cell: could not make its venv"; RESULT[$cell]="install failed"; status=1
    fi
    if [ "$cell" = 2.13-wheel ] && [ -e ".venv-$cell/$mark" ]; then   # 1.5 GB, made afresh by every run
        rm -rf ".venv-$cell"
    fi
    prune_torch "$version" "$position"
    printf 'cell\t%s\t%s\n' $(( SECONDS - start )) "${RESULT[$cell]:-?}" >> "$times/$cell/phases.tsv"
done
"$py" tests/cells.py report "$times" $cells
[ $status -eq 0 ] && echo "== every cell passed" || echo "!! some cells failed"
exit $status
