"""``tilescale run``: start the ranks of a tilescale program on this node.

::

    tilescale run -n 4 --cpu train.py --steps 10             # 4 ranks on the CPU path
    tilescale run -n 8 train.py                               # one rank per GPU
    tilescale run --nnodes 2 --node-rank 0 --master-addr gpu01 train.py   # once on every node
    tilescale run --launcher mpirun -n 4 train.py             # through MPICH's mpiexec
    tilescale run -n 2 --share-gpus check.py                  # 2 ranks on one GPU (correctness only)

Three launchers start the ranks:

``auto`` (the default)
    Our own spawner. Every local rank is ``sys.executable SCRIPT ARGS`` in its own session
    (so a rank's children can be stopped with it), with the torchrun variables (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) in its
    environment and stdin closed, and SIGKILL as its parent-death signal (no rank outlives
    the launcher, even one killed with SIGKILL). Reader threads copy each rank's stdout and
    stderr line by line to ours, prefixed ``[rank N] ``. The launcher fails fast: as soon as
    one rank exits non-zero or dies of a signal it names the rank, sends SIGTERM to the
    process groups of the others, SIGKILL after ``--timeout-kill`` seconds, and exits with
    that rank's status (128 + signal number for a signal). SIGINT/SIGTERM sent to the
    launcher are forwarded the same way, and it exits with 128 + that signal.
``torchrun``
    ``python -m torch.distributed.run`` with the same options.
``mpirun``
    The ``mpiexec`` of MPICH (hydra), one node only. The ranks learn their place from
    PMI_RANK/PMI_SIZE; only MASTER_ADDR/MASTER_PORT are added. For several nodes use
    ``launch/mpirun_multinode.sh`` or ``launch/slurm.sbatch`` (see ``launch/README.md``).

With ``auto`` and ``mpirun`` the launcher on the node of rank 0 hosts the job's store
(``tilescale.launch.rendezvous``): a taken ``--master-port`` is refused before any rank starts,
and every rank's exit is published there so that peers waiting for it raise at once. Every
launcher gives the ranks a launch id (TILESCALE_LAUNCH_ID: fresh per launch on one node, else
``--job-id`` or Slurm's job and step) that they check at rendezvous, and a key
(TILESCALE_JOB_KEY) that prefixes the job's names in /dev/shm: the launcher removes them once
the ranks are gone, and names of dead processes at its start.

Whatever the launcher, NVLink multicast stays off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are given to every rank, and a
different value exported by the user is overridden with a warning, since multicast objects
are a shared, scarce resource that must never be used on shared hosts. ``--cpu`` adds
TILESCALE_DEVICE=cpu; ``--share-gpus`` adds TILESCALE_SHARE_GPUS=1 (see ``tilescale.runtime``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch.distributed as dist

from tilescale.comm import host_shm
from tilescale.launch import rendezvous
from tilescale.launch.arguments import argument_problem, build_parser

PROG = "tilescale run"

# Variables that keep NVLink multicast (NVLS) off, with the value that means "off".
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# What the auto launcher sets for each rank; inherited values would mislead rank detection under mpirun.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# A port derived from a job id: 29500 + id % 20000, as srun's ranks derive theirs (environment.py).
PORT_BASE, PORT_SPAN = 29500, 20000
_POLL_S = 0.05
# How long the launcher's own store operations (publishing an exit) may take.
_STORE_TIMEOUT_S = 30.0

# Run in every rank's process before its program: ask the kernel to send signal argv[1] when
# the launcher dies (PR_SET_PDEATHSIG = 1), then check the launcher (pid argv[2]) did not die
# before that took effect, then become the program argv[3:] (the request survives exec).
_PARENT_DEATH_BOOT = """
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0) != 0:
    sys.exit("tilescale run: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[2]):
    sys.exit("tilescale run: the launcher exited before this process started")
os.execvp(sys.argv[3], sys.argv[3:])
"""


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _exit_status(returncode: int) -> int:
    """A shell-style exit status: a process killed by signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name} ({-returncode})"


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (found by binding port 0).

    Another process may take it before the ranks bind it; that race is accepted for a
    single-node run.

    Args:
        host: the address to bind.

    Returns:
        The port number.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.bind(address)
        return sock.getsockname()[1]


def dies_with_launcher(cmd: Sequence[str], signum: int) -> list[str]:
    """``cmd`` wrapped so that its process gets ``signum`` when this launcher dies (Linux).

    Example::

        subprocess.Popen(dies_with_launcher([sys.executable, "train.py"], signal.SIGKILL))

    The wrapper is a short Python that sets the parent-death signal and execs ``cmd``; the
    process keeps its pid. Must be started from the launcher's main thread: the kernel sends
    the signal when the *thread* that forked the process ends.

    Args:
        cmd: the command line.
        signum: the signal its process gets when the launcher dies.

    Returns:
        The wrapped command line.
    """
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-I", "-S", "-c", _PARENT_DEATH_BOOT, str(int(signum)), str(os.getpid()), *cmd]


def port_for_job(job_id: str) -> int:
    """The rendezvous port a multi-node job derives from the id all its nodes share.

    Example::

        port_for_job("123456")   # 29500 + 123456 % 20000 = 32956

    Args:
        job_id: the id every node of the job knows (``--job-id``, or Slurm's).

    Returns:
        A port in [29500, 49500).
    """
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def shared_job_id(environ: Mapping[str, str]) -> str | None:
    """An id every node of a job knows without being told: Slurm's job (and step) id.

    Args:
        environ: the environment to read (``os.environ``).

    Returns:
        ``"<job>"`` or ``"<job>.<step>"``, or None outside Slurm.
    """
    if "SLURM_JOB_ID" not in environ:
        return None
    step = environ.get("SLURM_STEP_ID")
    return environ["SLURM_JOB_ID"] + (f".{step}" if step else "")


def default_nproc(cpu: bool) -> int:
    """One rank per CUDA GPU that torch sees, or one rank on the CPU path.

    Args:
        cpu: whether the ranks run on the CPU path.

    Returns:
        The number of ranks.
    """
    if cpu:
        return 1
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def extra_env(environ: Mapping[str, str], cpu: bool, share_gpus: bool = False, nproc: int = 1) -> dict[str, str]:
    """The variables every launcher adds for the ranks: multicast off, unbuffered output, device,
    and one intra-op thread per rank where several share a node (as torchrun does).

    A multicast variable the user exported with another value is overridden, with a warning.

    Args:
        environ: the launcher's environment (``os.environ``).
        cpu: whether the ranks run on the CPU path (``TILESCALE_DEVICE=cpu``).
        share_gpus: whether ranks may share GPUs (``TILESCALE_SHARE_GPUS=1``).
        nproc: ranks on this node; above 1, ``OMP_NUM_THREADS=1`` unless the user set it
            (each rank's torch would otherwise start a thread per core, and they would
            oversubscribe the node's cores).

    Returns:
        The variables to add.
    """
    extra = dict(MULTICAST_OFF)
    for name, off in MULTICAST_OFF.items():
        if name in environ and environ[name] != off:
            _say(
                f"warning: overriding {name}={environ[name]} with {name}={off}: "
                "NVLink multicast must stay off on shared hosts"
            )
    extra["PYTHONUNBUFFERED"] = "1"
    if nproc > 1 and "OMP_NUM_THREADS" not in environ:
        extra["OMP_NUM_THREADS"] = "1"
    if cpu:
        extra["TILESCALE_DEVICE"] = "cpu"
    if share_gpus:
        extra["TILESCALE_SHARE_GPUS"] = "1"
    return extra


class _SignalTrap:
    """While active, SIGINT/SIGTERM sent to the launcher are recorded instead of ending it.

    ``signum`` is the first signal received; ``pending`` the ones not yet forwarded.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.pending: list[int] = []
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self.pending.append(signum)

    def __enter__(self) -> _SignalTrap:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *_exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


# --- the auto launcher -----------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)

    def join_readers(self, timeout: float) -> None:
        """Wait (bounded: a leftover child of the rank may hold its pipes open) for its output."""
        deadline = time.monotonic() + timeout
        for reader in self.readers:
            reader.join(max(0.0, deadline - time.monotonic()))


def _pump(pipe: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with lock:
                out.write(f"{prefix}{line}\n")
                out.flush()


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    # The rank leads its own process group (start_new_session); an unreaped rank keeps the
    # group id valid, so this cannot hit an unrelated group.
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # the rank moved itself to another group
            os.killpg(proc.pid, signum)


def _stop(ranks: Sequence[_Rank], signum: int, grace: float) -> None:
    """Send ``signum`` to every running rank's process group, SIGKILL what is left after ``grace`` s."""
    for r in ranks:
        _signal_group(r.proc, signum)
    deadline = time.monotonic() + grace
    while any(r.proc.poll() is None for r in ranks) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for r in ranks:
        _signal_group(r.proc, signal.SIGKILL)
    for r in ranks:
        r.proc.wait()


def spawn_ranks(
    script: str,
    script_args: Sequence[str],
    *,
    nproc: int,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
    extra: Mapping[str, str],
    grace: float,
    store: dist.Store | None = None,
) -> int:
    """Start ``nproc`` local ranks of ``script``, stream their output, and fail fast.

    Every rank gets SIGKILL if the launcher dies (see :func:`dies_with_launcher`); each
    rank's exit is published in ``store`` (the job's, when this launcher hosts it) as soon as
    it is seen. Returns 0 when every rank exits 0, else the exit status of the first failing rank.

    Args:
        script: the program.
        script_args: its arguments.
        nproc: the ranks on this node.
        node_rank: this node's index; its ranks are ``node_rank * nproc`` on.
        nnodes: the number of nodes.
        master_addr: the address of the job's store.
        master_port: its port.
        extra: variables added for every rank (:func:`extra_env`).
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        store: the job's store when this launcher hosts it, else None.

    Returns:
        The exit status.
    """
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    base.update(extra)
    base.update(
        WORLD_SIZE=str(nnodes * nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    lock = threading.Lock()
    ranks: list[_Rank] = []
    with _SignalTrap() as trap:
        try:
            for local_rank in range(nproc):
                rank = node_rank * nproc + local_rank
                proc = subprocess.Popen(
                    dies_with_launcher([sys.executable, script, *script_args], signal.SIGKILL),
                    env={**base, "RANK": str(rank), "LOCAL_RANK": str(local_rank)},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
                r = _Rank(rank, proc)
                for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                    reader = threading.Thread(target=_pump, args=(pipe, f"[rank {rank}] ", out, lock), daemon=True)
                    reader.start()
                    r.readers.append(reader)
                ranks.append(r)
            return _monitor(ranks, trap, lock, grace, store)
        finally:
            _stop(ranks, signal.SIGTERM, grace)
            for r in ranks:
                r.join_readers(timeout=2.0)


def _monitor(ranks: Sequence[_Rank], trap: _SignalTrap, lock: threading.Lock, grace: float,
             store: dist.Store | None) -> int:
    published: set[int] = set()
    while True:
        if trap.signum is not None:
            with lock:
                _say(f"received {signal.Signals(trap.signum).name}; stopping all ranks")
            _stop(ranks, trap.signum, grace)
            return 128 + trap.signum
        codes = [r.proc.poll() for r in ranks]
        for r, code in zip(ranks, codes, strict=True):
            if code is not None and r.rank not in published and store is not None:
                # Ranks waiting for this one raise at once, naming it, instead of at their deadline.
                rendezvous.publish_exit(store, r.rank, code)
                published.add(r.rank)
        for r, code in zip(ranks, codes, strict=True):
            if code:
                r.join_readers(timeout=1.0)  # let its last words (a traceback) come out first
                with lock:
                    _say(f"rank {r.rank} (pid {r.proc.pid}) {_describe_exit(code)}; stopping the other ranks")
                _stop(ranks, signal.SIGTERM, grace)
                return _exit_status(code)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(_POLL_S)


# --- torchrun and mpirun ---------------------------------------------------------------


def _run_forwarding(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run a launcher in its own session, forward SIGINT/SIGTERM to it, return its exit status.

    The launcher stops its own ranks on those signals, so there is no SIGKILL escalation here
    (killing torchrun or mpiexec would orphan the ranks); signal it again to insist. It gets
    SIGTERM if this process dies.
    """
    with _SignalTrap() as trap:
        proc = subprocess.Popen(dies_with_launcher(cmd, signal.SIGTERM), env=dict(env), start_new_session=True)
        while proc.poll() is None:
            while trap.pending:
                proc.send_signal(trap.pending.pop(0))
            time.sleep(_POLL_S)
    return 128 + trap.signum if trap.signum is not None else _exit_status(proc.returncode)


def run_torchrun(
    script: str,
    script_args: Sequence[str],
    *,
    nproc: int,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
    extra: Mapping[str, str],
) -> int:
    """Start the ranks through ``python -m torch.distributed.run``; return its exit status.

    Args: those of :func:`spawn_ranks` but ``grace`` and ``store`` (torchrun's agent hosts its own).

    Returns:
        torchrun's exit status.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--nnodes", str(nnodes),
        "--node-rank", str(node_rank),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--tee", "3",
        script, *script_args,
    ]  # fmt: skip
    return _run_forwarding(cmd, {**os.environ, **extra})


def find_mpiexec() -> str | None:
    """MPICH's mpiexec: ``TILESCALE_MPIEXEC`` if set, else the one beside this Python (the
    ``mpich`` wheel), else the first on PATH.

    Returns:
        Its path, or None when there is none.
    """
    if os.environ.get("TILESCALE_MPIEXEC"):
        named = os.environ["TILESCALE_MPIEXEC"]
        return shutil.which(named) or named
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def run_mpirun(
    script: str,
    script_args: Sequence[str],
    *,
    nproc: int,
    master_addr: str,
    master_port: int,
    extra: Mapping[str, str],
) -> int:
    """Start ``nproc`` ranks on this node through MPICH's hydra ``mpiexec``; return its exit status.

    Args: those of :func:`spawn_ranks` for one node (``nproc`` ranks), but ``grace`` and ``store``.

    Returns:
        mpiexec's exit status.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        _say('no mpiexec found (next to this Python or on PATH); install MPICH with: pip install "tilescale[mpi]"')
        return 2
    if not (os.path.isfile(mpiexec) and os.access(mpiexec, os.X_OK)):
        _say(f"TILESCALE_MPIEXEC={mpiexec}: no such executable file (unset it to use the mpiexec beside this Python)")
        return 2
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" in version.stdout + version.stderr:
        _say(f'{mpiexec} is Open MPI\'s; --launcher mpirun needs MPICH: pip install "tilescale[mpi]"')
        return 2
    genv = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), **extra}
    cmd = [mpiexec, "-n", str(nproc), "-prepend-rank"]
    for name, value in genv.items():
        cmd += ["-genv", name, value]
    cmd += [sys.executable, script, *script_args]
    # Hydra passes our whole environment on: drop torchrun variables so ranks detect MPI.
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    code = _run_forwarding(cmd, env)
    if code:
        _say(f"mpirun exited with code {code}")
    return code


# --- command line ----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tilescale`` console script; returns the exit status.

    Args:
        argv: the arguments after the program name; None: ``sys.argv[1:]``.

    Returns:
        The exit status (0 when every rank exited 0, 2 for bad arguments, else the first failure's).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        parser.exit(2, f"{PROG}: error: {problem}\n")
    if not Path(args.script).is_file():
        _say(f"script not found: {args.script}")
        return 2
    if args.launcher == "mpirun" and args.nnodes > 1:
        _say(
            "--launcher mpirun starts ranks on this node only; for --nnodes > 1 use "
            "launch/mpirun_multinode.sh with a hostfile, or launch/slurm.sbatch (see launch/README.md)"
        )
        return 2
    if args.nnodes > 1 and args.master_addr in ("127.0.0.1", "localhost", "::1"):
        _say(f"warning: --nnodes {args.nnodes} with --master-addr {args.master_addr}; other nodes cannot reach it")

    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc(args.cpu)
    job_id = args.job_id or (shared_job_id(os.environ) if args.nnodes > 1 else None)
    port = args.master_port
    if port is None and args.nnodes > 1:
        if job_id is None:
            _say(f"--nnodes {args.nnodes} needs --master-port PORT or --job-id ID, the same on every node "
                 "(nothing the nodes share names the job: no SLURM_JOB_ID)")
            return 2
        port = port_for_job(job_id)
    launch_id = job_id or (f"{args.master_addr}:{port}" if args.nnodes > 1 else uuid.uuid4().hex[:12])
    job_key = uuid.uuid4().hex[:12]  # this node's: the prefix of the job's files in /dev/shm
    extra = extra_env(os.environ, args.cpu, args.share_gpus, nproc)
    extra.update({rendezvous.LAUNCH_ID_VAR: launch_id, rendezvous.JOB_KEY_VAR: job_key})
    stale = host_shm.remove_stale()
    if stale:
        _say(f"removed {len(stale)} shared-memory name(s) that dead jobs left in {host_shm.SHM_DIR}")
    store = None
    if args.launcher == "torchrun":  # its agent hosts the store itself
        if port is None:
            try:
                port = free_port(args.master_addr)
            except OSError as err:
                _say(f"cannot find a free port on --master-addr {args.master_addr}: {err}")
                return 2
    else:
        # The auto and mpirun launchers host the job's store on the node of rank 0: the port is
        # taken before any rank starts, and the store outlives any rank.
        extra.update({rendezvous.HOSTED_VAR: "1", "TORCHELASTIC_USE_AGENT_STORE": "True"})
        if args.node_rank == 0:
            try:
                store = rendezvous.host_store(port or 0, launch_id, _STORE_TIMEOUT_S)
            except rendezvous.PortInUseError as err:
                _say(str(err))
                return 2
            port = store.port
    where = {"nproc": nproc, "master_addr": args.master_addr, "master_port": port, "extra": extra}
    placement = {"node_rank": args.node_rank, "nnodes": args.nnodes, **where}
    try:
        if args.launcher == "mpirun":
            return run_mpirun(args.script, args.script_args, **where)
        if args.launcher == "torchrun":
            return run_torchrun(args.script, args.script_args, **placement)
        return spawn_ranks(args.script, args.script_args, grace=args.timeout_kill, store=store, **placement)
    finally:
        left = host_shm.remove_job(job_key)
        if left:
            _say(f"removed {len(left)} shared-memory name(s) the ranks left in {host_shm.SHM_DIR}")
