"""What a communication backend provides to tilescale: the backend interface.

A backend owns symmetric memory: one allocation of the same size on every rank. What a
backend must provide, and where tilescale uses it:

1. **init / finalize**: ``__init__(group)`` joins the ranks of ``group`` (the whole job,
   or one process group: tilescale creates a backend per group, see ``tilescale.groups``;
   ``group`` carries rank and size within it, its global ranks, and a deadline-bounded
   ``exchange`` over a store prefix of its own, for bootstrap data such as NVSHMEM's
   unique id); :meth:`CommBackend.finalize` releases everything, allocations included,
   when the group is released (``tilescale.finalize`` releases every group).
2. **symmetric allocation**: :meth:`CommBackend.allocate`, collective, zeroed memory that
   every rank may write into as soon as the call returns.
3. **peer reachability**: :class:`SymmetricAllocation` ``peer_ptrs[r]`` is rank r's copy
   as an address this process can load from and store to, 0 where rank r is not
   load/store reachable; ``peer(r)`` is the same memory as a torch tensor.
4. **device-side lowering**: the lowerings of remote operations that kernels may use on
   this backend's memory (:attr:`CommBackend.lowerings`, checked at launch by
   :meth:`CommBackend.check_lowering`). ``"address"`` is the language's own: remote
   copies, signals, waits and barriers become loads and stores through ``peer_ptrs``, so
   a backend that hands out addresses (CUDA IPC on one node, POSIX shared memory on a
   CPU) needs no device library. A backend whose peers are not all load/store reachable
   also names a :class:`DeviceLowering`: CUDA helpers for put, get, signal, wait, fence
   and barrier built on its one-sided library, and the compiler and linker flags they
   need, and the loader of kernels built that way; kernels built with
   ``build_options(remote=<name>)`` call those helpers instead (see
   ``tilescale.comm.nvshmem.lowering`` for NVSHMEM's).

The lowering is a property of each group (:meth:`CommBackend.kernel_lowering`, one backend
per group): ``"address"`` when the group's ranks share a node, the backend's
:attr:`CommBackend.call_lowering` when they span nodes. Adding another vendor's one-sided
library is a new package under ``comm/`` registered in ``tilescale.comm`` (its backend and
its :class:`DeviceLowering`); the language and the jit do not change (comm/README.md).
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tilescale.comm.group import Group

# The language's own lowering: remote operations as loads and stores through peer addresses.
ADDRESS = "address"


class SymmetricAllocation(abc.ABC):
    """``nbytes`` bytes on every rank; ``peer_ptrs[r]`` is rank r's copy in this process.

    The allocation holds no reference to this rank's own copy: that copy is the tensor
    handed to the user, and the memory lives as long as its storage does.
    """

    def __init__(self, nbytes: int, peer_ptrs: list[int]):
        self.nbytes = nbytes
        self.peer_ptrs = peer_ptrs

    @abc.abstractmethod
    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s copy (``rank`` != own rank) as a uint8 tensor this process can read and write."""

    def dropped(self) -> None:
        """This rank's copy died (its storage was freed): a backend whose memory does not go with
        the storage may take it back, once that is safe for every rank."""


@dataclass(frozen=True)
class DeviceLowering:
    """How remote operations lower to a one-sided library's device calls (``build_options(remote=name)``).

    Example (NVSHMEM's, in ``tilescale.comm.nvshmem.lowering``)::

        DeviceLowering("nvshmem", NVSHMEM_PRELUDE, put="tilescale::nvshmem_put_block", ...,
                       compile_flags=nvshmem_compile_flags, link=nvshmem_link_flags,
                       loader="tilescale.comm.nvshmem.loader:NvshmemKernel")

    ``prelude`` is CUDA source (after tilescale's own prelude) defining the helpers named
    below, each a block-level operation that every thread of the block calls. ``pe`` is a
    rank of the library's own numbering (the job's global rank): the language passes
    ``pes[p]`` for rank ``p`` of the kernel's group, and the helpers that address every
    rank of the group take the table ``pes`` itself (``pes[p]``, ``p < world``):

    * ``put(dst, src, nbytes, pe)``: ``dst`` is this rank's address of a symmetric buffer,
      ``src`` local (global or shared memory); ``src`` may be rewritten on return (as after
      a remote ``T.copy``), the data is delivered by the next signal or fence; ``nbytes <=
      0`` does nothing (a run past a tensor's end).
    * ``get(dst, src, nbytes, pe)``: ``src`` symmetric; the data is in ``dst`` on return;
      ``nbytes <= 0`` does nothing.
    * ``signal(flag, value, op, pe)``: int32 ``flag`` (symmetric) set (op 0) or added to
      (op 1) on ``pe`` after this block's earlier puts are delivered there.
    * ``warp_signal(flag, value, op, pe)``: the same per warp, called by the warps that run
      ``T.signal(..., scope="warp")`` only (not every thread of the block): lane 0 of each
      signals after that warp's earlier puts are delivered.
    * ``wait(flag, cmp, value, status, rank, timeout_ns)``: bounded wait on this rank's flag,
      reporting a timeout like ``tilescale::block_wait``.
    * ``warp_wait(...)``: the same per warp, called by the warps that run
      ``T.wait(..., scope="warp")`` only: lane 0 of each spins, the warp acquires.
    * ``fence()``: this block's earlier puts are complete.
    * ``barrier(workspace, rank, world, status, timeout_ns, pes)``: every block of every rank.
    * ``agree(workspace, rank, world, status, timeout_ns, signature, pes)``: ``T.agree``, that
      barrier with the ranks' call signatures compared (``tilescale::agree_with`` does it).
    * ``announce(board, rank, world, ident, pes)``: ``T.announce``, int64 ``ident`` into slot
      ``rank`` of every rank's ``board`` (this rank's address); ``wait`` and ``warp_wait`` take
      ``(board, world, ident)`` after their arguments for ``T.wait(..., agree=)``.

    ``compile_flags()`` are nvcc flags for the device compile (include paths, ``-rdc=true``),
    ``link()`` the device-link inputs (``-L... -lnvshmem_device``), ``loader``
    (``"module:Class"``) the class that compiles and launches such kernels on a GPU:
    ``Class(func, out_idx, **compile_kwargs)``, callable like a TileLang kernel. On the CPU
    path tilescale's interpreter runs them instead, by the roles above.
    """

    name: str
    prelude: str
    put: str
    get: str
    signal: str
    warp_signal: str
    wait: str
    warp_wait: str
    fence: str
    barrier: str
    agree: str
    announce: str
    compile_flags: Callable[[], list[str]]
    link: Callable[[], list[str]]
    loader: str

    def load(self, func: Any, out_idx: list[int], **compile_kwargs: Any) -> Any:
        """Compile ``func`` (built with this lowering) for the GPU: an object called like a TileLang kernel.

        Example::

            kernel = lowering.load(func, [])      # tilescale.jit does this
        """
        module, name = self.loader.split(":")
        return getattr(importlib.import_module(module), name)(func, out_idx, **compile_kwargs)


def _provider(lowering: str) -> str:
    from tilescale.comm import backend_with_lowering  # the registry imports this module

    return backend_with_lowering(lowering)


class CommBackend(abc.ABC):
    """Symmetric allocation and reachability for one process group.

    Example (what ``tilescale.init`` and ``tilescale.empty`` do)::

        backend = tilescale.comm.create("cuda_ipc", group, "cuda")
        local, allocation = backend.allocate(4096, group.next_tag("alloc"))
        backend.check_lowering("address")          # before launching an address-lowered kernel
        backend.finalize()

    ``parent`` is the whole job's backend when ``group`` is a smaller process group (for
    state a library keeps once per process, such as NVSHMEM's), None for the job's own.
    """

    name: str
    device_type: str
    # Lowerings of remote operations that kernels may use on this backend's memory (see module docs).
    lowerings: tuple[str, ...] = (ADDRESS,)
    # The device-call lowering for groups whose ranks span nodes; None: this backend has none.
    call_lowering: str | None = None

    def __init__(self, group: Group, parent: CommBackend | None = None):
        self.group = group
        self.parent = parent

    @abc.abstractmethod
    def allocate(self, nbytes: int, tag: str) -> tuple[torch.Tensor, SymmetricAllocation]:
        """Collectively allocate ``nbytes`` zeroed bytes on every rank (``tag`` is unique per call).

        Returns this rank's copy as a uint8 tensor and the allocation describing all copies.
        """

    def check_lowering(self, lowering: str) -> None:
        """Raise unless kernels whose remote operations are lowered as ``lowering`` can run here.

        Example::

            backend.check_lowering("nvshmem")   # RuntimeError on cuda_ipc: no NVSHMEM heap
        """
        if lowering not in self.lowerings:
            raise RuntimeError(
                f"this kernel's remote operations are lowered as '{lowering}', which backend '{self.name}' cannot "
                f"serve (it supports {', '.join(self.lowerings)}); "
                + (f"start the job with backend='{_provider(lowering)}'" if lowering != ADDRESS
                   else "rebuild the kernel")
            )

    @property
    def spans_nodes(self) -> bool:
        """Whether the group's ranks are on more than one node (as the launcher declared them)."""
        return self.group.local_world_size != self.group.world_size

    def kernel_lowering(self) -> str:
        """The lowering ``tilescale.jit`` builds this group's kernels with (one of :attr:`lowerings`):
        peer addresses when its ranks share a node, :attr:`call_lowering` when they span nodes.

        Example::

            backend.kernel_lowering()   # "address" for a TP group inside a node, "nvshmem" for EP across nodes
        """
        if not self.spans_nodes:
            return ADDRESS
        if self.call_lowering is None:
            raise RuntimeError(f"the group of ranks {self.group.ranks} spans nodes, and backend '{self.name}' has no "
                               "device-call lowering for peers without an address")
        return self.call_lowering

    def finalize(self) -> None:
        """Release what the backend holds beyond the memory the user's tensors keep alive (library
        state; allocations too where their lifetime cannot follow the tensors, as on NVSHMEM)."""
