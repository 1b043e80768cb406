# Environment for one rank of a multi-node tilescale job: NVSHMEM, rendezvous interface, multicast off.
#
# Sourced (not run) by every rank just before it starts Python -- launch/slurm.sbatch and
# launch/mpirun_multinode.sh do it -- so that per-rank choices (the NIC) can use the rank's
# local index. Every setting below only fills in a value the user has not exported, except
# the multicast switches, which are always forced off. See launch/README.md.
#
# Knobs of this file (export them before launching):
#   TILESCALE_NVSHMEM_TRANSPORT  ibgda (default) | ibrc | ucx: how NVSHMEM reaches other nodes
#   TILESCALE_SOCKET_IFNAME      the network interface that routes between the nodes (e.g. bond0,
#                                eth0): used for every TCP bootstrap (NVSHMEM, NCCL, gloo)
#   TILESCALE_NICS               the RDMA NICs of a node in GPU order, e.g. "mlx5_0 mlx5_1 ...":
#                                local rank i then uses NIC i (NVSHMEM_HCA_LIST)
# shellcheck shell=bash

# NVLink multicast (NVLS) stays off, always: multicast objects are a scarce resource shared by
# every job on a host, and tilescale must never use them on shared machines.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1

# Bootstrap. A program that exchanges NVSHMEM's unique id itself (as DeepEP and nvshmem4py do,
# over torch.distributed) boots through the UID bootstrap, which opens TCP sockets between the
# nodes on NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME; a wrong or unroutable interface makes the
# initialisation hang or fail. NVSHMEM_BOOTSTRAP itself (PMI by default; MPI, SHMEM, UID,
# plugin) only matters to a program that calls plain nvshmem_init(), so it is left alone:
# export NVSHMEM_BOOTSTRAP=MPI    # e.g. for such a program started by mpirun
if [ -n "${TILESCALE_SOCKET_IFNAME:-}" ]; then
    export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-$TILESCALE_SOCKET_IFNAME}"
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$TILESCALE_SOCKET_IFNAME}"
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$TILESCALE_SOCKET_IFNAME}"
fi

# Remote transport. ibgda: GPU-initiated RDMA (InfiniBand GPUDirect Async), what DeepEP uses;
# needs ConnectX NICs and GPU memory registration (nvidia_peermem or DMA-BUF, see the README).
# ibrc: RDMA driven by a CPU proxy thread, works wherever verbs work. ucx: through UCX
# (e.g. for networks without verbs). Both IB transports need the rest of the IB stack.
case "${TILESCALE_NVSHMEM_TRANSPORT:-ibgda}" in
    ibgda) export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-ibrc}" NVSHMEM_IB_ENABLE_IBGDA="${NVSHMEM_IB_ENABLE_IBGDA:-1}" ;;
    ibrc) export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-ibrc}" NVSHMEM_IB_ENABLE_IBGDA="${NVSHMEM_IB_ENABLE_IBGDA:-0}" ;;
    ucx) export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-ucx}" NVSHMEM_IB_ENABLE_IBGDA="${NVSHMEM_IB_ENABLE_IBGDA:-0}" ;;
    *)
        echo "nvshmem_env.sh: TILESCALE_NVSHMEM_TRANSPORT must be ibgda, ibrc or ucx, not '$TILESCALE_NVSHMEM_TRANSPORT'" >&2
        return 2
        ;;
esac

# Symmetric heap per GPU (NVSHMEM's default is 1 GiB). Every tilescale.empty/zeros tensor and
# the ops' workspaces live in it; too small a heap fails the allocation, not the kernel.
export NVSHMEM_SYMMETRIC_SIZE="${NVSHMEM_SYMMETRIC_SIZE:-4G}"

# GPU-NIC affinity: each GPU should use the NIC on its own PCIe switch. NVSHMEM picks by PCIe
# distance, which can hand two GPUs the same NIC when a switch holds two of each; naming the
# NIC per local rank avoids that. (NVSHMEM_ENABLE_NIC_PE_MAPPING=1 with NVSHMEM_HCA_PE_MAPPING
# does the same by PE index, but indexes by the node-local PE, which the UID bootstrap does
# not always know.) Check the pairing with `nvidia-smi topo -m`.
local_rank="${LOCAL_RANK:-${SLURM_LOCALID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-}}}}"
if [ -n "${TILESCALE_NICS:-}" ] && [ -n "$local_rank" ] && [ -z "${NVSHMEM_HCA_LIST:-}" ]; then
    read -r -a nics <<< "$TILESCALE_NICS"
    export NVSHMEM_HCA_LIST="${nics[$((local_rank % ${#nics[@]}))]}:1"
    unset nics
fi
unset local_rank
