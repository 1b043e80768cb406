#!/bin/bash
# Start a tilescale program on several nodes with mpirun: one rank per GPU, every rank with the
# NVSHMEM environment of launch/nvshmem_env.sh.
#
#   launch/mpirun_multinode.sh HOSTFILE GPUS_PER_NODE SCRIPT [ARGS...]
#
#   HOSTFILE        one node per line; the first one hosts rank 0 and the rendezvous.
#                   Open MPI: "gpu01 slots=8"; MPICH: "gpu01:8".
#   GPUS_PER_NODE   ranks per node (one per GPU; rank i of a node uses GPU i).
#
# Works with Open MPI's mpirun and MPICH's (hydra) mpiexec, told apart by `--version`.
# Environment it reads (all optional):
#   MPIRUN          the launcher (default: mpirun on PATH)
#   PYTHON          the Python every rank runs (default: python3 on PATH here; the same
#                   path must exist on every node, e.g. a virtualenv on a shared file system)
#   MASTER_ADDR     rendezvous host (default: the first host of HOSTFILE)
#   MASTER_PORT     rendezvous port (default 29500)
#   TILESCALE_NVSHMEM_TRANSPORT, TILESCALE_SOCKET_IFNAME, TILESCALE_NICS, NVSHMEM_*: see nvshmem_env.sh
#
# Example, two nodes of 8 H200 with 8 ConnectX-7 NICs each:
#   TILESCALE_SOCKET_IFNAME=bond0 TILESCALE_NICS="mlx5_0 mlx5_1 mlx5_2 mlx5_3 mlx5_4 mlx5_5 mlx5_6 mlx5_7" \
#       launch/mpirun_multinode.sh hosts.txt 8 benchmarks/scaling.py --worker ...

set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,/^$/s/^# \{0,1\}//p' "$0" >&2
    exit 2
fi
hostfile=$1
per_node=$2
shift 2
[ -r "$hostfile" ] || { echo "mpirun_multinode.sh: cannot read hostfile $hostfile" >&2; exit 2; }

MPIRUN=${MPIRUN:-mpirun}
PYTHON=${PYTHON:-$(command -v python3)}
# The first host of the file, without ":slots" (MPICH) or " slots=N" (Open MPI).
MASTER_ADDR=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ { sub(/:.*/, "", $1); print $1; exit }' "$hostfile")}
MASTER_PORT=${MASTER_PORT:-29500}
# One id for this launch, checked by every rank at rendezvous: ranks of another job given the
# same port are refused instead of joining this one.
TILESCALE_LAUNCH_ID=${TILESCALE_LAUNCH_ID:-mpirun:$(hostname):$$:$(date +%s%N)}
export MASTER_ADDR MASTER_PORT TILESCALE_LAUNCH_ID PYTHONUNBUFFERED=1
# Installed with tilescale (package data), so every node finds the same file.
env_file=$("$PYTHON" -c 'import os, tilescale.launch as l; print(os.path.join(os.path.dirname(l.__file__), "nvshmem_env.sh"))')

# Every rank: source the environment (per rank: it picks the NIC by local rank), then exec Python.
rank_cmd=(bash -c 'source "$1" && shift && exec "$@"' tilescale-rank "$env_file" "$PYTHON" "$@")

if "$MPIRUN" --version 2>&1 | grep -q "Open MPI"; then
    # Open MPI forwards only the variables named with -x: forward everything these settings read.
    forward=()
    for name in $(compgen -e); do
        case "$name" in
            PATH | LD_LIBRARY_PATH | PYTHONPATH | VIRTUAL_ENV | PYTHONUNBUFFERED | MASTER_ADDR | MASTER_PORT | \
                CUDA_* | NCCL_* | NVSHMEM_* | TILESCALE_* | TORCH_* | GLOO_* | UCX_*) forward+=(-x "$name") ;;
        esac
    done
    # --bind-to none: tilescale binds each rank to its GPU; CPU binding is left to the user.
    exec "$MPIRUN" --hostfile "$hostfile" --map-by "ppr:${per_node}:node" --bind-to none "${forward[@]}" "${rank_cmd[@]}"
else
    # MPICH hydra passes the whole environment on (-genvall).
    exec "$MPIRUN" -f "$hostfile" -ppn "$per_node" -genvall "${rank_cmd[@]}"
fi
