"""The command line of ``tilescale run`` (see :mod:`tilescale.launch.cli` for what it does)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    """The ``tilescale`` argument parser.

    Returns:
        The parser of ``tilescale run ...``.
    """
    parser = argparse.ArgumentParser(prog="tilescale", description="Tools for tilescale programs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="start the ranks of a program",
        description="Start the ranks of SCRIPT on this node (run it once per node for several nodes).",
    )
    run.add_argument(
        "-n", "--nproc-per-node", type=int, metavar="N",
        help="ranks on this node (default: the number of CUDA GPUs, 1 without GPUs or with --cpu)",
    )  # fmt: skip
    run.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    run.add_argument("--node-rank", type=int, default=0, help="rank of this node, 0..nnodes-1 (default 0)")
    run.add_argument("--master-addr", default="127.0.0.1", help="address of the node of rank 0 (default 127.0.0.1)")
    run.add_argument(
        "--master-port", type=int,
        help="rendezvous port (default: a free port on one node; on several, one derived from the job id)",
    )  # fmt: skip
    run.add_argument(
        "--job-id", metavar="ID",
        help="the job's id, the same on every node: the ranks check they belong to one launch by it, and "
        "--nnodes > 1 derives the port from it (default: fresh per launch on one node; under Slurm "
        "SLURM_JOB_ID.SLURM_STEP_ID)",
    )  # fmt: skip
    run.add_argument(
        "--launcher", choices=("auto", "torchrun", "mpirun"), default="auto",
        help="auto: tilescale's own spawner (default); torchrun; mpirun: MPICH's mpiexec, one node",
    )  # fmt: skip
    run.add_argument("--cpu", action="store_true", help="run on the CPU path (sets TILESCALE_DEVICE=cpu)")
    run.add_argument(
        "--share-gpus", action="store_true",
        help="allow more ranks than GPUs, ranks taking GPUs round-robin (sets TILESCALE_SHARE_GPUS=1): "
        "checks multi-rank correctness on fewer GPUs; timings then mean nothing",
    )  # fmt: skip
    run.add_argument(
        "--timeout-kill", type=float, default=5.0, metavar="SECONDS",
        help="auto launcher: grace period between SIGTERM and SIGKILL when stopping ranks (default 5)",
    )  # fmt: skip
    run.add_argument("script", metavar="SCRIPT", help="the Python script every rank runs")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for SCRIPT")
    return parser


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with parsed ``tilescale run`` arguments beyond what argparse checks.

    Args:
        args: the parsed arguments of the ``run`` command.

    Returns:
        The message, or None when they are fine.
    """
    if args.nnodes < 1:
        return "--nnodes must be at least 1"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in 0..{args.nnodes - 1}"
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        return "--nproc-per-node must be at least 1"
    if args.master_port is not None and not 0 < args.master_port < 65536:
        return "--master-port must be in 1..65535"
    if args.timeout_kill < 0:
        return "--timeout-kill must not be negative"
    return None
