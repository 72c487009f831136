#!/usr/bin/env bash
# Train under an MPI launcher: `mpirun -n N python -m xscale train CONFIG [overrides]`, or the same ranks
# started by `srun --mpi=pmix`. Every rank learns its rank and world from MPI_COMM_WORLD (mpi4py) and rank 0
# broadcasts the torch.distributed rendezvous address (XSCALE_BOOTSTRAP=mpi), so no MASTER_ADDR is needed.
#
# Usage:
#   launch/mpirun.sh -n N [options] CONFIG [section.key=value ...]
#
#   8 ranks, two hosts:         launch/mpirun.sh -n 8 --hostfile hosts.txt configs/gpt2-small.yaml
#   in a Slurm allocation:      launch/mpirun.sh --srun -n 8 --ntasks-per-node 4 CONFIG
#   MPICH under Slurm:          launch/mpirun.sh --srun --mpi pmi2 -n 8 CONFIG
#
# Options:
#   -n, --np N              number of ranks (required)
#   --srun                  start the ranks with `srun --mpi=PLUGIN` instead of mpirun
#   --mpi PLUGIN            srun's MPI plugin: pmix (Open MPI, default) or pmi2 (MPICH)
#   --ntasks-per-node P     srun: ranks per node
#   --hostfile FILE         mpirun: the hosts to use
#   --launcher-arg ARG      one more argument for mpirun / srun (repeatable), e.g. --launcher-arg=--oversubscribe
#   --libmpi LIB            the MPI library mpi4py loads (MPI4PY_LIBMPI), e.g. libmpi.so.40 for Open MPI, when
#                           several are installed; it must belong to the launcher, or every rank is refused
#   --module M              run `python -m M CONFIG ...` instead of `-m xscale train`
#   --python PY             interpreter [PYTHON; default python3]
#   --print                 print the command (shell-quoted) instead of running it
# Environment: MPIRUN (the mpirun executable, default mpirun). Open MPI run as root gets --allow-run-as-root.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "mpirun.sh: $*" >&2; exit 2; }

ranks=
use_srun=0
mpi_plugin=pmix
tasks_per_node=
hostfile=
launcher_args=()
libmpi=
module=xscale
python=${PYTHON:-python3}
mpirun=${MPIRUN:-mpirun}
print_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage 0 ;;
        -n|--np) ranks=${2:?$1 needs a value}; shift 2 ;;
        --srun) use_srun=1; shift ;;
        --mpi) mpi_plugin=${2:?--mpi needs a value}; shift 2 ;;
        --ntasks-per-node) tasks_per_node=${2:?--ntasks-per-node needs a value}; shift 2 ;;
        --hostfile) hostfile=${2:?--hostfile needs a value}; shift 2 ;;
        --launcher-arg) launcher_args+=("${2:?--launcher-arg needs a value}"); shift 2 ;;
        --launcher-arg=*) launcher_args+=("${1#--launcher-arg=}"); shift ;;
        --libmpi) libmpi=${2:?--libmpi needs a value}; shift 2 ;;
        --module) module=${2:?--module needs a value}; shift 2 ;;
        --python) python=${2:?--python needs a value}; shift 2 ;;
        --print) print_only=1; shift ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "mpirun.sh: CONFIG is required" >&2; usage 2; }
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || die "-n N (the number of ranks, at least 1) is required, got '${ranks}'"
if [ -n "$tasks_per_node" ] && ! [[ "$tasks_per_node" =~ ^[1-9][0-9]*$ ]]; then
    die "--ntasks-per-node takes a positive integer, got '$tasks_per_node'"
fi

if [ "$use_srun" = 1 ]; then
    [ -z "$hostfile" ] || die "--hostfile is for mpirun; under --srun Slurm places the ranks"
    command=(srun "--mpi=$mpi_plugin" "--ntasks=$ranks" --kill-on-bad-exit=1)
    [ -z "$tasks_per_node" ] || command+=("--ntasks-per-node=$tasks_per_node")
else
    [ -z "$tasks_per_node" ] || die "--ntasks-per-node is for --srun; give mpirun a --hostfile or --launcher-arg"
    command=("$mpirun" -n "$ranks")
    if "$mpirun" --version 2>&1 | grep -q 'Open MPI' && [ "$(id -u)" = 0 ]; then
        command+=(--allow-run-as-root)
    fi
    [ -z "$hostfile" ] || command+=(--hostfile "$hostfile")
fi
command+=("${launcher_args[@]}")

# `env` sets the variables on every rank, whatever the launcher forwards to remote hosts.
command+=(env XSCALE_BOOTSTRAP=mpi)
[ -z "$libmpi" ] || command+=("MPI4PY_LIBMPI=$libmpi")
if [ "$module" = xscale ]; then
    command+=("$python" -m xscale train "$@")
else
    command+=("$python" -m "$module" "$@")
fi

if [ "$print_only" = 1 ]; then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi
exec "${command[@]}"
