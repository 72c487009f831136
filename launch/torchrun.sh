#!/usr/bin/env bash
# Train with torchrun on one node or several: `torchrun ... -m xscale train CONFIG [overrides]`.
#
# Usage:
#   launch/torchrun.sh [options] CONFIG [section.key=value ...]
#
#   one node, 8 processes:     launch/torchrun.sh --nproc-per-node 8 configs/gpt2-small.yaml train.steps=1000
#   two nodes (run on each):   launch/torchrun.sh --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 CONFIG
#                              launch/torchrun.sh --nnodes 2 --node-rank 1 --master 10.0.0.1:29500 CONFIG
#   elastic, 1 to 2 nodes:     launch/torchrun.sh --nnodes 2 --min-nodes 1 --max-restarts 3 --master ... CONFIG
#   inside a Slurm job:        srun --ntasks-per-node=1 launch/torchrun.sh CONFIG    (see launch/slurm.sbatch)
#
# Options (each also read from the environment variable in brackets):
#   --nnodes N            nodes in the job [NNODES; in Slurm: SLURM_NNODES; default 1]
#   --min-nodes M         elastic: go on with as few as M nodes when others are lost, and take them back in when
#                         they return (torchrun --nnodes=M:N; each change is a restart, so --max-restarts > 0); the
#                         run keeps train.global_batch_size by gradient accumulation [MIN_NODES; default N]
#   --nproc-per-node P    processes per node [NPROC_PER_NODE; in Slurm: SLURM_GPUS_ON_NODE; else the number of
#                         GPUs nvidia-smi lists; else 1]
#   --node-rank R         this node's index; node 0 hosts the rendezvous [NODE_RANK; in Slurm: SLURM_NODEID]
#   --master ADDR[:PORT]  node 0's address [MASTER_ADDR, MASTER_PORT (29500); in Slurm: the first node's NodeAddr]
#   --rdzv-id ID          rendezvous id, the same on every node [RDZV_ID; default xscale-$SLURM_JOB_ID or xscale]
#   --max-restarts N      restart the workers up to N times after one fails; they resume from the latest
#                         checkpoint [MAX_RESTARTS; default 0]
#   --warm                fork the workers from a server that imported torch and xscale's training once, so a
#                         restart (--max-restarts) skips the imports [WARM=1; docs/reliability.md#warm-restarts-warm]
#   --module M            run `python -m M CONFIG ...` instead of `-m xscale train` (e.g. xscale.launcher.smoke)
#   --python PY           interpreter [PYTHON; default python3]
#   --print               print the command (shell-quoted) instead of running it
#
# One node uses --standalone rendezvous (a free local port); several nodes use c10d rendezvous on node 0,
# which is told it is the host (is_host), so it does not spend ~50 s deciding that itself.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "torchrun.sh: $*" >&2; exit 2; }

in_slurm() { [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_NODEID:-}" ]; }

gpu_count() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

# The first node of the job as an address: its NodeAddr (node names need not resolve), as an IPv4 address.
slurm_head_address() {
    local head address ip
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    address=$(scontrol show node "$head" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    address=${address:-$head}
    ip=$(getent ahostsv4 "$address" | awk 'NR == 1 {print $1}')
    echo "${ip:-$address}"
}

nnodes=${NNODES:-}
min_nodes=${MIN_NODES:-}
nproc=${NPROC_PER_NODE:-}
node_rank=${NODE_RANK:-}
master_addr=${MASTER_ADDR:-}
master_port=${MASTER_PORT:-}
rdzv_id=${RDZV_ID:-}
max_restarts=${MAX_RESTARTS:-0}
module=xscale
python=${PYTHON:-python3}
print_only=0
warm=${WARM:-0}
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage 0 ;;
        --nnodes) nnodes=${2:?--nnodes needs a value}; shift 2 ;;
        --min-nodes) min_nodes=${2:?--min-nodes needs a value}; shift 2 ;;
        --nproc-per-node) nproc=${2:?--nproc-per-node needs a value}; shift 2 ;;
        --node-rank) node_rank=${2:?--node-rank needs a value}; shift 2 ;;
        --master)
            master=${2:?--master needs ADDR[:PORT]}
            master_addr=${master%%:*}
            [ "$master" != "$master_addr" ] && master_port=${master#*:}
            shift 2 ;;
        --rdzv-id) rdzv_id=${2:?--rdzv-id needs a value}; shift 2 ;;
        --max-restarts) max_restarts=${2:?--max-restarts needs a value}; shift 2 ;;
        --module) module=${2:?--module needs a value}; shift 2 ;;
        --python) python=${2:?--python needs a value}; shift 2 ;;
        --print) print_only=1; shift ;;
        --warm) warm=1; shift ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "torchrun.sh: CONFIG is required" >&2; usage 2; }

if in_slurm; then
    nnodes=${nnodes:-${SLURM_NNODES:-1}}
    node_rank=${node_rank:-$SLURM_NODEID}
    nproc=${nproc:-${SLURM_GPUS_ON_NODE:-}}
    rdzv_id=${rdzv_id:-xscale-$SLURM_JOB_ID}
    if [ -z "$master_addr" ] && [ "${nnodes}" -gt 1 ]; then
        master_addr=$(slurm_head_address)
    fi
    if [ -z "$master_port" ]; then
        # Per job and per restart, so a requeued job never meets its predecessor's store.
        master_port=$((20000 + (SLURM_JOB_ID * 16 + ${SLURM_RESTART_COUNT:-0}) % 20000))
    fi
fi
nnodes=${nnodes:-1}
node_rank=${node_rank:-0}
rdzv_id=${rdzv_id:-xscale}
if [ -z "$nproc" ] || [ "$nproc" = 0 ]; then
    nproc=$(gpu_count)
    [ "$nproc" -gt 0 ] || nproc=1
fi
min_nodes=${min_nodes:-$nnodes}
for number in "$nnodes" "$min_nodes" "$nproc" "$node_rank" "$max_restarts"; do
    [[ "$number" =~ ^[0-9]+$ ]] || die "--nnodes, --min-nodes, --nproc-per-node, --node-rank and --max-restarts take integers, got '$number'"
done
if [ "$nnodes" -lt 1 ] || [ "$nproc" -lt 1 ]; then
    die "--nnodes and --nproc-per-node must be at least 1"
fi
if [ "$min_nodes" -lt 1 ] || [ "$min_nodes" -gt "$nnodes" ]; then
    die "--min-nodes $min_nodes must lie in 1..$nnodes (--nnodes)"
fi
if [ "$min_nodes" -lt "$nnodes" ] && [ "$max_restarts" = 0 ]; then
    die "--min-nodes $min_nodes < --nnodes $nnodes needs --max-restarts > 0: torchrun restarts the workers on the nodes left"
fi
[ "$node_rank" -lt "$nnodes" ] || die "--node-rank $node_rank is outside $nnodes nodes (0..$((nnodes - 1)))"

command=("$python" -m xscale.launcher.torchrun)
[ "$warm" = 1 ] && command+=("--warm=torch,xscale.commands.train")
command+=("--nproc-per-node=$nproc" "--max-restarts=$max_restarts")
nodes_range=$nnodes
[ "$min_nodes" -lt "$nnodes" ] && nodes_range=$min_nodes:$nnodes
if [ "$nnodes" = 1 ]; then
    command+=(--standalone)
else
    [ -n "$master_addr" ] || die "$nnodes nodes need node 0's address: --master ADDR[:PORT] or MASTER_ADDR"
    is_host=0
    [ "$node_rank" = 0 ] && is_host=1
    command+=("--nnodes=$nodes_range" --rdzv-backend=c10d "--rdzv-endpoint=$master_addr:${master_port:-29500}"
              "--rdzv-id=$rdzv_id" "--rdzv-conf=is_host=$is_host")
fi
if [ "$module" = xscale ]; then
    command+=(-m xscale train "$@")
else
    command+=(-m "$module" "$@")
fi

if [ "$print_only" = 1 ]; then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi
exec "${command[@]}"
