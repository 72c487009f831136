#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine for the launcher tests (tests/e2e, pytest -m cluster).
#
#   bash .ci/cluster.sh up      # install if missing, start munged + slurmctld + slurmd node1/node2, wait idle
#   source "${XSCALE_CLUSTER_DIR:-/tmp/xscale-cluster}/env.sh"   # SLURM_CONF, XSCALE_TEST_CLUSTER=1
#   python -m pytest tests/e2e -m cluster -q
#   bash .ci/cluster.sh down    # stop exactly the daemons `up` started (pid files), remove the state
#   bash .ci/cluster.sh status
#
# Runs as root without systemd; idempotent (`up` on a running cluster only checks it, `down` on a stopped
# one does nothing). Everything lives under XSCALE_CLUSTER_DIR with its own ports (XSCALE_CLUSTER_PORT,
# default 17817 for slurmctld, +1 and +2 for the two slurmd), so several clusters can coexist.
set -euo pipefail

DIR=${XSCALE_CLUSTER_DIR:-/tmp/xscale-cluster}
PORT=${XSCALE_CLUSTER_PORT:-17817}
CPUS_PER_NODE=${XSCALE_CLUSTER_CPUS:-4}
HOST=$(hostname -s)
CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket
NODES=(node1 node2)

log() { echo "cluster.sh: $*" >&2; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        log "must run as root (it starts slurmd); try sudo"
        exit 1
    fi
}

# Debian's Open MPI: its libpmix is what srun --mpi=pmix loads, and it must be installed before slurmd starts.
OPENMPI_LIBRARY=/usr/lib/x86_64-linux-gnu/libmpi.so.40

install_missing() {
    local packages=()
    command -v munged >/dev/null || packages+=(munge)
    command -v slurmctld >/dev/null || packages+=(slurmctld)
    command -v slurmd >/dev/null || packages+=(slurmd)
    command -v sbatch >/dev/null || packages+=(slurm-client)
    [ -e "$OPENMPI_LIBRARY" ] || packages+=(openmpi-bin libopenmpi-dev)
    if [ ${#packages[@]} -gt 0 ]; then
        log "installing ${packages[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
    fi
    # MPICH from the package index (the dev extras): mpiexec next to the interpreter, and mpi4py, which loads
    # that MPICH first (MPI4PY_LIBMPI=libmpi.so.40 selects Open MPI instead).
    if ! python3 -c "import mpi4py" 2>/dev/null || ! command -v mpiexec >/dev/null; then
        log "installing mpich and mpi4py from the package index"
        python3 -m pip install -q mpich mpi4py
    fi
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_config() {
    mkdir -p "$DIR"/{etc,munge,state,log,run,spool,tmp}
    chmod 0755 "$DIR" "$DIR/munge"
    for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node" "$DIR/tmp/$node"; done
    if [ ! -f "$DIR/munge/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 0400 "$DIR/munge/munge.key"
    fi
    cat >"$CONF" <<EOF
ClusterName=xscale-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
TmpFS=$DIR/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=300
NodeName=node1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS_PER_NODE State=UNKNOWN
NodeName=node2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS_PER_NODE State=UNKNOWN
PartitionName=ci Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    cat >"$DIR/env.sh" <<EOF
export SLURM_CONF=$CONF
export XSCALE_TEST_CLUSTER=1
export XSCALE_CLUSTER_DIR=$DIR
EOF
}

nodes_idle() {
    local states
    states=$(SLURM_CONF=$CONF sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [ "$(grep -c ' idle$' <<<"$states")" = "${#NODES[@]}" ]
}

up() {
    need_root
    if alive "$DIR/run/slurmctld.pid" && nodes_idle; then
        log "already up ($DIR)"
        cat "$DIR/env.sh"
        return 0
    fi
    install_missing
    write_config
    if ! alive "$DIR/run/munged.pid"; then
        munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" \
            --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
    fi
    if ! alive "$DIR/run/slurmctld.pid"; then
        slurmctld -f "$CONF"
    fi
    for node in "${NODES[@]}"; do
        if ! alive "$DIR/run/slurmd-$node.pid"; then
            slurmd -f "$CONF" -N "$node"
        fi
    done
    for _ in $(seq 1 120); do
        if nodes_idle; then
            for node in "${NODES[@]}"; do
                SLURM_CONF=$CONF scontrol update nodename="$node" state=resume 2>/dev/null || true
            done
            # Idle is not enough: a job step must start on both nodes (credentials, ports, spool dirs).
            if ! SLURM_CONF=$CONF timeout 60 srun --nodes=2 --ntasks-per-node=1 --time=1 true; then
                log "nodes are idle but a two-node srun failed:"
                tail -n 20 "$DIR"/log/*.log >&2 || true
                return 1
            fi
            log "up: partition ci, nodes ${NODES[*]} idle and running steps; source $DIR/env.sh"
            cat "$DIR/env.sh"
            return 0
        fi
        sleep 0.5
    done
    log "nodes did not become idle within 60 s:"
    SLURM_CONF=$CONF sinfo -N >&2 || true
    tail -n 20 "$DIR"/log/*.log >&2 || true
    return 1
}

stop_pidfile() {
    local pidfile=$1 pid
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$pidfile"
}

down() {
    if [ ! -d "$DIR" ]; then
        log "not running ($DIR absent)"
        return 0
    fi
    # Jobs first, so that no step outlives its slurmd.
    if alive "$DIR/run/slurmctld.pid"; then
        SLURM_CONF=$CONF scancel --full --quiet --partition=ci 2>/dev/null || true
        sleep 1
    fi
    for node in "${NODES[@]}"; do stop_pidfile "$DIR/run/slurmd-$node.pid"; done
    stop_pidfile "$DIR/run/slurmctld.pid"
    stop_pidfile "$DIR/run/munged.pid"
    if [ "${XSCALE_CLUSTER_KEEP:-0}" = 1 ]; then
        log "down; logs kept in $DIR/log"
    else
        rm -rf "$DIR"
        log "down; removed $DIR"
    fi
}

status() {
    for name in munged slurmctld slurmd-node1 slurmd-node2; do
        if alive "$DIR/run/$name.pid"; then echo "$name: running ($(cat "$DIR/run/$name.pid"))"; else echo "$name: stopped"; fi
    done
    if [ -f "$CONF" ]; then SLURM_CONF=$CONF sinfo -N 2>/dev/null || true; fi
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
