#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for hpccomm's tests.
#
#   bash tests/slurm/cluster.sh start    # install if needed, start munged, slurmctld, slurmd n1 and n2
#   bash tests/slurm/cluster.sh stop     # stop the daemons it started (by recorded PID)
#   bash tests/slurm/cluster.sh env      # the SLURM_CONF line for clients
#
# Everything lives under $HPCCOMM_TEST_SLURM_DIR (default /tmp/hpccomm-slurm): config,
# munge key and socket, state, spool, logs, PID files.  Clients find the cluster
# with SLURM_CONF=$HPCCOMM_TEST_SLURM_DIR/slurm.conf.  Ports: $HPCCOMM_TEST_SLURM_PORT (the
# controller's, default 6917) and the next two for the nodes.
#
# Needs root (slurmd runs jobs as their user) and, when SLURM is not installed,
# apt-get (Debian's slurmctld slurmd slurm-client munge libpmix-dev).  Exit
# status 0 when the cluster is up with both nodes idle; otherwise non-zero with
# the reason on stderr (the tests print it when they skip).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DIR=${HPCCOMM_TEST_SLURM_DIR:-/tmp/hpccomm-slurm}
PORT=${HPCCOMM_TEST_SLURM_PORT:-6917}
PACKAGES="slurmctld slurmd slurm-client munge libpmix-dev"
export SLURM_CONF=$DIR/slurm.conf

die() { echo "cluster.sh: $*" >&2; exit 1; }

install_packages() {
    local missing=()
    for p in $PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "SLURM packages missing (${missing[*]}) and not root to install them"
    command -v apt-get >/dev/null || die "SLURM packages missing (${missing[*]}) and no apt-get"
    echo "cluster.sh: installing ${missing[*]}" >&2
    # libpmix-dev ships the unversioned libpmix.so that srun --mpi=pmix loads.
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" >"$DIR/apt.log" 2>&1 || {
        apt-get update -q >>"$DIR/apt.log" 2>&1 &&
        apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$DIR/apt.log" 2>&1
    } || die "apt-get install ${missing[*]} failed (see $DIR/apt.log)"
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    for _ in $(seq $((limit * 5))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    die "$what did not come up in ${limit}s"
}

nodes_idle() {
    [ "$(sinfo -h -N -o '%N %t' | grep -c ' idle$')" -eq 2 ]
}

port_free() {
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

start() {
    [ "$(id -u)" -eq 0 ] || die "needs root (slurmd runs jobs as their user; the daemons run as root here)"
    if alive "$DIR/slurmctld.pid" && nodes_idle; then
        echo "cluster.sh: already running in $DIR" >&2; return 0
    fi
    stop 2>/dev/null || true
    mkdir -p "$DIR"
    install_packages
    for p in $PORT $((PORT + 1)) $((PORT + 2)); do
        port_free "$p" || die "port $p is in use; set HPCCOMM_TEST_SLURM_PORT to another base port"
    done
    # A fresh cluster each time: no node states or jobs left from an earlier run.
    rm -rf "$DIR"/{state,spool,tmp}
    mkdir -p "$DIR"/{state,log,spool,tmp/n1,tmp/n2}
    install -d -o munge -g munge -m 755 "$DIR/munge"
    local mem
    mem=$(awk '/MemTotal/ {print int($2 / 1024 / 4)}' /proc/meminfo)
    sed -e "s|@DIR@|$DIR|g" -e "s|@PORT_CTLD@|$PORT|" -e "s|@PORT_N1@|$((PORT + 1))|" \
        -e "s|@PORT_N2@|$((PORT + 2))|" -e "s|@MEM@|$mem|g" \
        -e "s|@FIRST_JOB@|$(( $(date +%s) % 50000000 + 1000 ))|" "$here/slurm.conf.in" >"$SLURM_CONF"
    cp "$here/gres.conf" "$DIR/gres.conf"

    # munged with its own key, socket and PID file.
    [ -s "$DIR/munge/munge.key" ] || {
        dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge/munge.key" status=none
        chown munge:munge "$DIR/munge/munge.key"; chmod 400 "$DIR/munge/munge.key"
    }
    runuser -u munge -- /usr/sbin/munged --socket="$DIR/munge/munge.socket" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || die "munged failed to start (see $DIR/munge/munged.log)"
    wait_for 10 munged munge -S "$DIR/munge/munge.socket" -n

    slurmctld -c || die "slurmctld failed to start (see $DIR/log/slurmctld.log)"
    wait_for 20 slurmctld scontrol ping
    for n in n1 n2; do
        slurmd -N "$n" || die "slurmd -N $n failed to start (see $DIR/log/slurmd-$n.log)"
    done
    wait_for 30 "nodes n1 and n2 (idle)" nodes_idle
    echo "cluster.sh: up in $DIR (SLURM_CONF=$SLURM_CONF)" >&2
}

stop_pid() {  # stop_pid PIDFILE NAME
    [ -s "$1" ] || return 0
    local pid; pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && { echo "cluster.sh: $2 ($pid) did not stop; killing it" >&2; kill -9 "$pid"; }
    fi
    rm -f "$1"
}

stop() {
    # Jobs first (their steps belong to the slurmd's), then the daemons.
    if alive "$DIR/slurmctld.pid"; then
        scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    fi
    stop_pid "$DIR/slurmd-n1.pid" "slurmd n1"
    stop_pid "$DIR/slurmd-n2.pid" "slurmd n2"
    stop_pid "$DIR/slurmctld.pid" slurmctld
    stop_pid "$DIR/munge/munged.pid" munged
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "SLURM_CONF=$SLURM_CONF" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
