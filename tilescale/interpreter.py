"""The CPU execution path: run a tilescale kernel by interpreting its tile program with torch.

Why an interpreter: TileLang's C target cannot build fragments, ``T.gemm`` or the
distributed operations, and rewriting those for it would be a second compiler. The
program ``T.prim_func`` builds is already at the level the language is defined at (tile
copies, tile GEMMs, fills, reductions, parallel loops over tiles, the distributed
externs), so each of those is executed here as one torch operation on the tile. Parallel
loops run vectorised: their loop variables become broadcast index tensors. The result is
the same program, with the same tail (bounds) semantics as TileLang's lowering, fast
enough for tests and debugging, and a checker the GPU cannot be:

* an element access of a global tensor (local or a peer's) outside its shape raises
  ``IndexError`` naming the tensor, the index, the rank and the kernel's source line; a
  tile copy whose region lies entirely outside its tensor does too (a copy that only runs
  past the end is cut at the end, exactly as on the GPU);
* a wait that times out raises ``WaitTimeoutError`` listing every rank's pending wait,
  so a deadlock reads as a wait graph;
* a construct the interpreter does not know raises ``NotImplementedError`` naming it and
  its source line, never a wrong result.

Kernels built with a library's device-call lowering (a group spanning the nodes a CPU job
declares, see ``tilescale.comm.host_shm``) run too: their calls are executed by the roles
of ``tilescale.comm.base.DeviceLowering`` (put, get, signal, wait, fence, barrier, agree,
announce), a peer given as a global rank and reached at the address of the same offset in
its copy of the symmetric allocation, as a one-sided library would.

Blocks of a grid run one after another, or as threads when the kernel waits (``T.barrier``,
``T.agree``, ``T.wait``: a block may wait for another block, which must be alive). In a cluster launch
(``cluster_dims``) the blocks of each cluster run together as threads: their shared tiles
are reachable from each other (``dst_cta``/``src_cta`` copies resolve to the peer block's
tile, with the bounds checks of global tensors) and the cluster barrier is a barrier of
those threads. Code inside a block runs once per block, as TileLang's block-level
semantics say; thread-level code (``T.get_thread_binding``) sees thread 0 only.
"""

from __future__ import annotations

import collections
import contextlib
import math
import operator
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tilelang.ir import get_stmt_span, span_to_location
from tvm import arith, tirx

from tilescale import comm, runtime
from tilescale.errors import WaitTimeoutError
from tilescale.language.cluster import BARRIER_EXTERN, MAP_EXTERN
from tilescale.language.scale import AS_WRITTEN_CASTS, STATUS_PARAM
from tilescale.language.sync import ADDRESS_HELPERS, COUNT_CALL_EXTERN
from tilescale.protocol import (
    ARRIVALS_WORD,
    COMPARISON_TEXT,
    COMPARISONS,
    EPOCH_WORD,
    MISMATCH,
    SYNC_WORKSPACE_WORDS,
    WAIT_STATUS_FIELDS,
    sync_workspace_words,
)
from tilescale.symmetric import host_regions

_TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
    "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn,
}
_MATH = {
    "tirx.exp": torch.exp, "tirx.exp2": torch.exp2, "tirx.log": torch.log, "tirx.log2": torch.log2,
    "tirx.sqrt": torch.sqrt, "tirx.rsqrt": torch.rsqrt, "tirx.tanh": torch.tanh, "tirx.sigmoid": torch.sigmoid,
    "tirx.fabs": torch.abs, "tirx.abs": torch.abs, "tirx.floor": torch.floor, "tirx.ceil": torch.ceil,
    "tirx.round": torch.round, "tirx.sin": torch.sin, "tirx.cos": torch.cos, "tirx.erf": torch.erf,
}
# T.wait's comparisons by code.
_COMPARE = {COMPARISONS[name]: getattr(operator, name) for name in COMPARISONS}
_ELEMENT_ATOMICS = ("tl.atomic_add_elem_op", "tl.atomic_max_elem_op", "tl.atomic_min_elem_op")
# A spinning wait sleeps this long between looks, doubling up to the most: the ranks and blocks
# it waits for share the host's cores with it, and a wait that polls at the first pause for
# long takes their CPU time (a few waits spinning each use a core's worth on two cores).
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.0001, 0.001
# TILESCALE_CPU_JITTER_S: a block that signals then sleeps up to this long (uniformly at
# random), so that tests meet the interleavings a GPU's schedule gives (a peer
# running a call ahead while this rank still reads, flags raised out of order) on purpose.
_JITTER_ENV = "TILESCALE_CPU_JITTER_S"
# The roles of a device lowering's helpers (tilescale.comm.base.DeviceLowering).
_ROLES = ("put", "get", "signal", "warp_signal", "wait", "warp_wait", "fence", "barrier", "agree", "announce")


def _peer_address(address: int, pe: int, what: str) -> int:
    """Where global rank ``pe`` holds what this rank holds at ``address`` in a symmetric
    allocation: what a one-sided library's call does with a symmetric address and a PE."""
    for state in runtime.live_groups():
        for entry in list(state.allocations.values()):
            own = entry.allocation.peer_ptrs[state.rank]
            if own <= address < own + entry.allocation.nbytes:
                if pe not in state.ranks:
                    raise IndexError(f"rank {runtime.rank()}: {what} addresses rank {pe}, which is not in the "
                                     f"{state.describe()} of the symmetric tensor")
                return entry.allocation.peer_ptrs[state.ranks.index(pe)] + address - own
    raise IndexError(f"rank {runtime.rank()}: {what} at address {address:#x} is in no symmetric tensor")


def _torch_dtype(dtype: Any) -> torch.dtype:
    name = str(dtype)
    if name not in _TORCH_DTYPES:
        raise NotImplementedError(f"CPU path: dtype {name} is not supported")
    return _TORCH_DTYPES[name]


@dataclass
class _Memory:
    """A host memory area an address can fall in: a kernel argument or a symmetric copy."""

    start: int
    nbytes: int
    data: torch.Tensor  # uint8, covering the area
    label: str


@dataclass
class _Pointer:
    """An element address: the tensor viewed at that element and a name for messages."""

    flat: torch.Tensor  # one-element view
    label: str


class _Nodes:
    """What the interpreter reads from a kernel's TIR, read once per node: arrays (statements,
    indices, operands), call names and source lines. Reading them through TVM's FFI costs
    microseconds per element, and a kernel runs the same statements for every block and call.
    An entry is keyed by the node's address and keeps the node alive, so the key stays its own."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, tuple]] = {}
        self._scopes: dict[int, tuple[tirx.Buffer, str]] = {}
        self._constants: dict[int, tuple[tirx.IntImm, int | bool]] = {}
        self._calls: dict[int, tuple[Any, str, tuple]] = {}
        self._lines: dict[int, tuple[Any, str]] = {}

    def items(self, array: Any) -> tuple:
        """The elements of a TIR array, as a tuple."""
        found = self._items.get(array.__chandle__())
        if found is None:
            found = self._items[array.__chandle__()] = (array, tuple(array))
        return found[1]

    def constant(self, imm: tirx.IntImm) -> int | bool:
        """An integer constant's value (a bool for dtype bool)."""
        found = self._constants.get(imm.__chandle__())
        if found is None:
            value = bool(imm.value) if str(imm.dtype) == "bool" else int(imm.value)
            found = self._constants[imm.__chandle__()] = (imm, value)
        return found[1]

    def scope(self, buf: tirx.Buffer) -> str:
        """A buffer's memory scope ("global", "shared.dyn", "local.fragment", ...)."""
        found = self._scopes.get(buf.__chandle__())
        if found is None:
            found = self._scopes[buf.__chandle__()] = (buf, buf.scope())
        return found[1]

    def call(self, call: tirx.Call) -> tuple[str, tuple]:
        """A call's operation name and its arguments."""
        found = self._calls.get(call.__chandle__())
        if found is None:
            op = call.op
            name = op.name if hasattr(op, "name") else str(op)
            found = self._calls[call.__chandle__()] = (call, name, tuple(call.args))
        return found[1], found[2]

    def line(self, stmt: Any) -> str:
        """``file:line`` of the kernel source a statement comes from ("" if not recorded)."""
        found = self._lines.get(stmt.__chandle__())
        if found is None:
            location = span_to_location(get_stmt_span(stmt))
            found = self._lines[stmt.__chandle__()] = (stmt, f"{location[0]}:{location[1]}" if location else "")
        return found[1]


class _Abort(Exception):
    """Another block of this launch failed: stop quietly, the first error is reported."""


class _Launch:
    """State shared by the blocks of one kernel launch."""

    def __init__(self, kernel: CpuKernel, memories: list[_Memory], blocks: int, threaded: bool,
                 status: torch.Tensor | None = None):
        self.kernel = kernel
        self.memories = memories
        # The wait-status record of the kernel's group (its ts_status argument).
        self.status = status
        self.blocks = blocks
        self.block_barrier = threading.Barrier(blocks) if threaded else None
        self.jitter_s = float(os.environ.get(_JITTER_ENV) or 0)
        self.jitter = random.Random() if self.jitter_s > 0 else None
        self.failed = threading.Event()
        self.lock = threading.Lock()
        cluster_size = math.prod(kernel.cluster_dims)
        self.cluster_barriers: dict[tuple, threading.Barrier] = \
            collections.defaultdict(lambda: threading.Barrier(cluster_size))
        self.cluster_tiles: dict[tuple, torch.Tensor] = {}
        # T.count_call: the call each counted state gave this launch, by the state's address.
        self.calls: dict[int, torch.Tensor] = {}

    def cluster_tile(self, cluster: tuple, rank: int, buf: tirx.Buffer, shape: list[int]) -> torch.Tensor:
        """Shared tile ``buf`` of block ``rank`` of ``cluster``, made on first use by either side."""
        with self.lock:
            key = (cluster, rank, buf)
            if key not in self.cluster_tiles:
                t = self.cluster_tiles[key] = torch.zeros(shape, dtype=_torch_dtype(buf.dtype))
                raw = t.view(-1).view(torch.uint8)
                self.memories.append(_Memory(t.data_ptr(), raw.numel(), raw,
                                             f"shared tile '{buf.name}' of cluster block {rank}"))
            return self.cluster_tiles[key]

    def abort(self) -> None:
        """Stop every block of the launch (one failed): break whatever they wait in."""
        self.failed.set()
        if self.block_barrier is not None:
            self.block_barrier.abort()
        with self.lock:
            for b in self.cluster_barriers.values():
                b.abort()

    def memory_at(self, address: int, nbytes: int, what: str, where: str) -> tuple[_Memory, int]:
        for m in self.memories:
            if m.start <= address < m.start + max(m.nbytes, 1):
                if address + nbytes > m.start + m.nbytes:
                    raise IndexError(f"rank {self.kernel.rank}: {what} runs past the end of {m.label}{where}")
                return m, address - m.start
        raise IndexError(f"rank {self.kernel.rank}: {what} at address {address:#x} is in no tensor of this job{where}")


class _Block:
    """Executes the statements of one block."""

    def __init__(self, launch: _Launch, env: dict, block_id: int, cluster: tuple = (), cta_rank: int = 0):
        self.launch = launch
        self.env = env
        self.block_id = block_id
        self.cluster = cluster
        self.cta_rank = cta_rank
        self._parallel_vars: set = set()  # the loop variables of the T.Parallel nest running now
        self.rank = launch.kernel.rank
        self.nodes = launch.kernel.nodes
        self.line = ""

    # ---- diagnostics -------------------------------------------------------------------
    def _where(self) -> str:
        return f" (kernel line {self.line})" if self.line else ""

    def unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"CPU path: {what} is not supported{self._where()}")

    # ---- buffers -----------------------------------------------------------------------
    def tensor(self, buf: tirx.Buffer) -> torch.Tensor:
        t = self.env.get(buf)
        if t is None:
            # Views of an address (a peer's copy) follow the address variable, which a loop
            # may rebind: resolve them at every use rather than caching them.
            t = self._declare(buf)
        return t

    def label(self, buf: tirx.Buffer) -> str:
        return self.env.get(("label", buf), buf.name)

    def _declare(self, buf: tirx.Buffer) -> torch.Tensor:
        base = self.env.get(buf.data)
        if base is None:
            raise self.unsupported(f"buffer '{buf.name}' with no storage")
        shape = [int(self.eval(s)) for s in self.nodes.items(buf.shape)]
        dtype = _torch_dtype(buf.dtype)
        if isinstance(base, int):  # an address, e.g. from a peer table
            nbytes = math.prod(shape) * dtype.itemsize
            memory, offset = self.launch.memory_at(base, nbytes, f"tensor view '{buf.name}'", self._where())
            self.env[("label", buf)] = memory.label
            return memory.data[offset:offset + nbytes].view(dtype).view(shape)
        elif isinstance(base, torch.Tensor):
            t = base.view(dtype).view(shape)
        else:
            raise self.unsupported(f"storage of buffer '{buf.name}'")
        self.env[buf] = t
        return t

    def _check_bounds(self, buf: tirx.Buffer, t: torch.Tensor, idx: list[Any]) -> None:
        if self.nodes.scope(buf) != "global":
            return
        for d, (i, n) in enumerate(zip(idx, t.shape, strict=True)):
            if isinstance(i, torch.Tensor) and i.numel() == 0:  # a masked store that stores nothing
                continue
            lo, hi = (int(i.min()), int(i.max())) if isinstance(i, torch.Tensor) else (int(i), int(i))
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise IndexError(
                    f"rank {self.rank}: {self.label(buf)} index {bad} out of bounds in dimension {d} "
                    f"(shape {tuple(t.shape)}){self._where()}"
                )

    def load(self, node: tirx.BufferLoad) -> Any:
        t = self.tensor(node.buffer)
        idx = [self.eval(i) for i in self.nodes.items(node.indices)]
        self._check_bounds(node.buffer, t, idx)
        value = t[tuple(torch.as_tensor(i) if isinstance(i, torch.Tensor) else int(i) for i in idx)]
        return value

    def store(self, node: tirx.BufferStore) -> None:
        t = self.tensor(node.buffer)
        idx = [self.eval(i) for i in self.nodes.items(node.indices)]
        self._check_bounds(node.buffer, t, idx)
        value = self.eval(node.value)
        key = tuple(i if isinstance(i, torch.Tensor) else int(i) for i in idx)
        if any(isinstance(i, torch.Tensor) for i in key):
            shape = torch.broadcast_shapes(*[i.shape for i in key if isinstance(i, torch.Tensor)])
            key = tuple(i.expand(shape) if isinstance(i, torch.Tensor) else i for i in key)
            if isinstance(value, torch.Tensor):
                value = value.expand(shape) if value.dim() else value
        t[key] = torch.as_tensor(value).to(t.dtype) if isinstance(value, torch.Tensor) else value

    # ---- regions and tile operations -----------------------------------------------------
    def region(self, call: tirx.Call) -> tuple[tirx.Buffer, list[int], list[int]]:
        args = self.nodes.call(call)[1]
        load = args[0]
        starts = [int(self.eval(i)) for i in self.nodes.items(load.indices)]
        extents = [int(self.eval(e)) for e in args[2:]]
        if len(extents) < len(starts):  # leading dimensions of extent 1 may be left out
            extents = [1] * (len(starts) - len(extents)) + extents
        return load.buffer, starts, extents

    def _window(self, buf: tirx.Buffer, starts: list[int], extents: list[int]):
        """The part of a region inside its tensor: (view, slices into the region)."""
        t = self.tensor(buf)
        inside, within = [], []
        for s, e, n in zip(starts, extents, t.shape, strict=True):
            lo, hi = max(s, 0), min(s + e, n)
            if hi <= lo:
                if self.nodes.scope(buf) == "global":
                    raise IndexError(
                        f"rank {self.rank}: tile of {self.label(buf)} at {starts} (extent {extents}) lies "
                        f"entirely outside its shape {tuple(t.shape)}{self._where()}"
                    )
                return None, None
            inside.append(slice(lo, hi))
            within.append(slice(lo - s, hi - s))
        return t[tuple(inside)], tuple(within)

    def copy(self, src_call: tirx.Call, dst_call: tirx.Call) -> None:
        src_buf, src_start, src_ext = self.region(src_call)
        dst_buf, dst_start, dst_ext = self.region(dst_call)
        if math.prod(src_ext) != math.prod(dst_ext):
            raise self.unsupported(f"T.copy between regions of {src_ext} and {dst_ext} elements")
        src_view, src_within = self._window(src_buf, src_start, src_ext)
        dst_view, dst_within = self._window(dst_buf, dst_start, dst_ext)
        if dst_view is None:
            return
        # As on the GPU: elements read outside the source are zeros, writes outside the
        # destination are dropped.
        tile = torch.zeros(src_ext, dtype=self.tensor(dst_buf).dtype)
        if src_view is not None:
            tile[src_within] = src_view.to(tile.dtype)
        dst_view.copy_(tile.view(dst_ext)[dst_within])

    def atomic_add(self, src_call: tirx.Call, dst_call: tirx.Call) -> None:
        """Tile ``T.atomic_add(dst, src)``: the part of ``dst`` inside its tensor gains ``src``."""
        dst_buf, dst_start, dst_ext = self.region(dst_call)
        tile = self._whole(src_call).reshape(dst_ext)
        dst_view, dst_within = self._window(dst_buf, dst_start, dst_ext)
        if dst_view is None:
            return
        with self.launch.kernel.atomic():
            dst_view.add_(tile[dst_within].to(dst_view.dtype))

    def fill(self, region_call: tirx.Call, value: Any) -> None:
        view, _ = self._window(*self.region(region_call))
        if view is not None:
            view.fill_(self.eval(value))

    def cumsum(self, args: list[Any]) -> None:
        """``T.cumsum(src, dst, dim, reverse)`` on shared tiles: an inclusive scan."""
        src, _ = self._window(*self.region(args[0]))
        dst, _ = self._window(*self.region(args[1]))
        dim, reverse = int(self.eval(args[2])), bool(self.eval(args[3]))
        values = src.flip(dim) if reverse else src
        scanned = torch.cumsum(values, dim=dim)
        dst.copy_(scanned.flip(dim) if reverse else scanned)

    def gemm(self, args: list[Any]) -> None:
        a = self._whole(args[0])
        b = self._whole(args[1])
        c = self._whole(args[2])
        trans_a, trans_b = bool(self.eval(args[3])), bool(self.eval(args[4]))
        clear = bool(self.eval(args[9])) if len(args) > 9 else False
        a = a.float().T if trans_a else a.float()
        b = b.float().T if trans_b else b.float()
        product = (a @ b).to(c.dtype)
        if clear:
            c.copy_(product)
        else:
            c.add_(product)

    def _whole(self, region_call: Any) -> torch.Tensor:
        buf, starts, extents = self.region(region_call)
        t = self.tensor(buf)
        view = t[tuple(slice(s, s + e) for s, e in zip(starts, extents, strict=True))]
        return view.reshape([e for e in extents if e != 1] or [1]) if view.dim() > 2 else view

    def reduce(self, args: list[Any]) -> None:
        src, dst = self._whole(args[0]), self._whole(args[1])
        kind, dim, clear = str(args[2].value), int(self.eval(args[3])), bool(self.eval(args[4]))
        x = src.float()
        ops = {
            "sum": lambda: x.sum(dim), "max": lambda: x.amax(dim), "min": lambda: x.amin(dim),
            "abssum": lambda: x.abs().sum(dim), "absmax": lambda: x.abs().amax(dim),
        }
        if kind not in ops:
            raise self.unsupported(f"T.reduce of kind '{kind}'")
        r = ops[kind]().view(dst.shape)
        if not clear:
            combine = {"sum": torch.add, "abssum": torch.add, "max": torch.maximum, "absmax": torch.maximum,
                       "min": torch.minimum}[kind]
            r = combine(dst.float(), r)
        dst.copy_(r.to(dst.dtype))

    # ---- distributed operations ----------------------------------------------------------
    def pointer(self, expr: Any) -> _Pointer:
        if isinstance(expr, tirx.Call) and expr.op.name in ("tirx.address_of", "tl.access_ptr"):
            load = expr.args[0]
            t = self.tensor(load.buffer)
            idx = [int(self.eval(i)) for i in self.nodes.items(load.indices)]
            self._check_bounds(load.buffer, t, idx)
            flat_index = sum(i * s for i, s in zip(idx, t.stride(), strict=True))
            flat = t.as_strided((1,), (1,), t.storage_offset() + flat_index)
            return _Pointer(flat, f"{self.label(load.buffer)}[{', '.join(map(str, idx))}]")
        raise self.unsupported(f"pointer argument {expr}")

    def signal(self, ptr: _Pointer, value: int, op: int) -> None:
        with self.launch.kernel.atomic():
            if op == 0:
                ptr.flat[0] = value
            else:
                ptr.flat[0] += value
        if self.launch.jitter:
            time.sleep(self.launch.jitter.uniform(0, self.launch.jitter_s))

    def wait(self, ptr: _Pointer, cmp: int, expected: int, agree: tuple[torch.Tensor, int] | None = None) -> None:
        what = f"T.wait({ptr.label} {COMPARISON_TEXT[cmp]} {expected}) in block {self.block_id}"

        def done() -> bool:  # a disagreement ends the wait, as on the GPU; the host raises it
            holds = _COMPARE[cmp](int(ptr.flat[0]), expected)
            return (agree is not None and self.disagrees(*agree)) or holds

        self.launch.kernel.spin(done, lambda: int(ptr.flat[0]), what, self.launch)

    def disagrees(self, board: torch.Tensor, ident: int) -> bool:
        """As ``tilescale::disagrees``: a rank announced this call number with another signature
        (recorded in the wait-status record, which ends every wait of the job)."""
        status = self.launch.status
        with self.launch.lock:
            if int(status[0]) != 0:
                return True
            world = board.numel() // 2
            row = board[(ident >> 32) % 2 * world:][:world]
            for peer, theirs in enumerate(row.tolist()):
                if theirs >> 32 == ident >> 32 and theirs != ident:
                    self._record_mismatch(peer, ident & 0x7FFFFFFF, theirs & 0x7FFFFFFF)
                    return True
        return False

    def _record_mismatch(self, peer: int, mine: int, theirs: int) -> None:
        record = dict(state=1, rank=self.rank, block=self.block_id, address=peer, comparison=0, expected=mine,
                      observed=theirs, kind=MISMATCH)
        self.launch.status.copy_(torch.tensor([record[f] for f in WAIT_STATUS_FIELDS]))

    def announce(self, table: torch.Tensor, rank: int, ident: int) -> None:
        """``T.announce``: ``ident`` into slot ``rank`` (this rank's in the kernel's group) of every
        rank's board (row: call number % 2)."""
        world = len(table)
        for address in table.tolist():
            memory, offset = self.launch.memory_at(int(address), 16 * world, "board", self._where())
            memory.data[offset:offset + 16 * world].view(torch.int64)[(ident >> 32) % 2 * world + rank] = ident

    def barrier(self, table: torch.Tensor, rank: int, world: int) -> None:
        """``T.barrier()`` of every block of the ``world`` ranks of ``table`` (the kernel's group;
        ``rank`` is this rank's index in it)."""
        launch = self.launch
        leader = True
        if launch.block_barrier is not None:
            leader = self._block_barrier() == 0
        if leader:
            kernel = launch.kernel
            words = self._sync_words(table)
            mine = words[rank]
            epoch = int(mine[EPOCH_WORD])
            with kernel.atomic():
                for w in words:
                    w[ARRIVALS_WORD] += 1
            target = world * (epoch + 1)
            kernel.spin(lambda: int(mine[ARRIVALS_WORD]) >= target, lambda: int(mine[ARRIVALS_WORD]),
                        f"T.barrier() #{epoch + 1} (arrivals >= {target})", launch)
            mine[EPOCH_WORD] = epoch + 1
        if launch.block_barrier is not None:
            self._block_barrier()

    def _sync_words(self, table: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's barrier workspace (int32 words), from the kernel's table of them."""
        nbytes = 4 * sync_workspace_words(len(table))
        areas = [self.launch.memory_at(int(a), nbytes, "barrier workspace", "") for a in table.tolist()]
        return [memory.data[offset:offset + nbytes].view(torch.int32) for memory, offset in areas]

    def agree(self, table: torch.Tensor, rank: int, world: int, signature: int) -> int:
        """``T.agree``: as ``tilescale::grid_agree``, block 0 puts the call's signature into every
        rank's workspace, a barrier, then the signatures received compared with this one; a
        difference is recorded in the wait-status record."""
        words = self._sync_words(table)
        mine = words[rank]
        slots = SYNC_WORKSPACE_WORDS + int(mine[EPOCH_WORD]) % 2 * world  # before the barrier: one epoch
        if self.block_id == 0:
            for w in words:
                w[slots + rank] = signature
        self.barrier(table, rank, world)
        status = self.launch.status
        with self.launch.lock:
            if int(status[0]) != 0:
                return 0
            for peer, theirs in enumerate(mine[slots:slots + world].tolist()):
                if theirs != signature:
                    self._record_mismatch(peer, signature, theirs)
                    return 0
        return 1

    def _block_barrier(self) -> int:
        # No timeout here: a timed-out threading.Barrier breaks for every thread. The bounded
        # waits are the cross-rank spins; a failing block aborts this barrier for the others.
        try:
            return self.launch.block_barrier.wait()
        except threading.BrokenBarrierError:
            raise _Abort() from None

    def span(self, expr: Any, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` bytes at an access pointer (``tvm_access_ptr``) or ``address_of``, as uint8."""
        if isinstance(expr, tirx.Call) and expr.op.name == "tirx.tvm_access_ptr":
            t = self.env.get(expr.args[1])
            if not isinstance(t, torch.Tensor) or not t.is_contiguous():
                raise self.unsupported(f"access pointer into {expr.args[1]}")
            dtype = _torch_dtype(expr.args[0].dtype)
            flat = t.view(-1).view(dtype)
            start = int(self.eval(expr.args[2]))
            return flat[start:].view(torch.uint8)[:nbytes]
        flat = self.pointer(expr).flat
        rest = flat.untyped_storage().nbytes() // flat.element_size() - flat.storage_offset()
        return flat.as_strided((rest,), (1,)).view(torch.uint8)[:nbytes]

    def on_peer(self, local: torch.Tensor, pe: int, what: str) -> torch.Tensor:
        """Global rank ``pe``'s copy of the symmetric bytes ``local`` (uint8)."""
        address = _peer_address(local.data_ptr(), pe, what)
        memory, offset = self.launch.memory_at(address, local.numel(), what, self._where())
        return memory.data[offset:offset + local.numel()]

    def device_call(self, role: str, args: list[Any]) -> Any:
        """A device lowering's helper, by its role (``tilescale.comm.base.DeviceLowering``)."""
        if role in ("put", "get"):
            nbytes = int(self.eval(args[2]))
            if nbytes <= 0:  # a run past the tensor's end
                return None
            dst, src = self.span(args[0], nbytes), self.span(args[1], nbytes)
            pe = int(self.eval(args[3]))
            if role == "put":
                self.on_peer(dst, pe, "put destination").copy_(src)
            else:
                dst.copy_(self.on_peer(src, pe, "get source"))
        elif role in ("signal", "warp_signal"):
            op, pe = int(self.eval(args[2])), int(self.eval(args[3]))
            value = int(self.eval(args[1])) * (self.launch.kernel.warps if role == "warp_signal" and op == 1 else 1)
            flag = self.on_peer(self.span(args[0], 4), pe, "signal flag").view(torch.int32)
            self.signal(_Pointer(flag, f"flag on rank {pe}"), value, op)
        elif role in ("wait", "warp_wait"):
            self.extern(ADDRESS_HELPERS["wait"], args)  # the same arguments: a local flag
        elif role == "fence":
            pass  # host memory through one coherent address space: program order is enough
        elif role in ("barrier", "agree"):
            pes = self.env[args[-1]].tolist()
            world = int(self.eval(args[2]))
            own = int(self.env[args[0]][int(self.eval(args[1]))])
            table = torch.tensor([_peer_address(own, pe, "barrier workspace") for pe in pes[:world]])
            if role == "barrier":
                return self.barrier(table, int(self.eval(args[1])), world)
            return self.agree(table, int(self.eval(args[1])), world, int(self.eval(args[5])))
        elif role == "announce":
            pes, world = self.env[args[4]].tolist(), int(self.eval(args[2]))
            board = self.span(args[0], 16 * world)
            table = torch.tensor([_peer_address(board.data_ptr(), pe, "board") for pe in pes[:world]])
            self.announce(table, int(self.eval(args[1])), int(self.eval(args[3])))
        return None

    def extern(self, name: str, args: list[Any]) -> None:
        role = self.launch.kernel.device_roles.get(name)
        if role is not None:
            self.device_call(role, args)
        elif name in (ADDRESS_HELPERS["signal"], ADDRESS_HELPERS["local_signal"]):
            self.signal(self.pointer(args[0]), int(self.eval(args[1])), int(self.eval(args[2])))
        elif name in (ADDRESS_HELPERS["warp_signal"], ADDRESS_HELPERS["local_warp_signal"]):  # once per warp
            op = int(self.eval(args[2]))
            value = int(self.eval(args[1])) * (self.launch.kernel.warps if op == 1 else 1)
            self.signal(self.pointer(args[0]), value, op)
        elif name in (ADDRESS_HELPERS["wait"], ADDRESS_HELPERS["warp_wait"]):  # one pass per block runs all warps
            agree = None
            if len(args) > 6:  # T.wait(..., agree=(board, ident)): the whole board, and the identity
                agree = (self.tensor(args[6].args[0].buffer), int(self.eval(args[8])))
            self.wait(self.pointer(args[0]), int(self.eval(args[1])), int(self.eval(args[2])), agree)
        elif name == ADDRESS_HELPERS["announce"]:
            self.announce(self.env[args[0]], int(self.eval(args[1])), int(self.eval(args[3])))
        elif name == ADDRESS_HELPERS["fence"]:
            pass  # host memory through one coherent address space: program order is enough
        elif name == ADDRESS_HELPERS["barrier"]:
            self.barrier(self.env[args[0]], int(self.eval(args[1])), int(self.eval(args[2])))
        elif name == BARRIER_EXTERN:
            self.cluster_barrier()
        elif name == COUNT_CALL_EXTERN:
            self.count_call(self.env[args[0]], int(self.eval(args[1])), self.env[args[3]])
        else:
            raise self.unsupported(f"call to '{name}'")

    def count_call(self, state: torch.Tensor, step: int, call: torch.Tensor) -> None:
        """``T.count_call``: every block of the launch gets the call after the one ``state``
        counts (its number and flag target), and the launch advances ``state`` once. Here the
        first block to get here advances it and the launch keeps the call for its other blocks,
        so a launch that stops early (a wait that timed out ends the CPU path's blocks) still
        advances it once, as a GPU's, whose every block runs to its end."""
        with self.launch.lock:
            counted = self.launch.calls.get(state.data_ptr())
            if counted is None:
                state[:2] += torch.tensor([1, step], dtype=torch.int32)  # int32: wraps as on the GPU
                counted = self.launch.calls[state.data_ptr()] = state[:2].clone()
        call[:2] = counted

    def cluster_barrier(self) -> None:
        # The threads of one cluster; clusters never wait for each other.
        try:
            with self.launch.lock:
                barrier = self.launch.cluster_barriers[self.cluster]
            barrier.wait()
        except threading.BrokenBarrierError:
            raise _Abort() from None

    def cluster_address(self, base: tirx.Call, cta: Any) -> int:
        """``mapa``: the address of the element ``base`` points at, in block ``cta``'s tile."""
        load = base.args[0]
        size = math.prod(self.launch.kernel.cluster_dims)
        rank = int(self.eval(cta))
        if not 0 <= rank < size:
            raise IndexError(f"rank {self.rank}: block {rank} of the cluster named for shared tile "
                             f"'{load.buffer.name}' is out of range for a cluster of {size} blocks{self._where()}")
        shape = [int(self.eval(d)) for d in load.buffer.shape]
        t = self.launch.cluster_tile(self.cluster, rank, load.buffer, shape)
        offset = sum(int(self.eval(i)) * st for i, st in zip(load.indices, t.stride(), strict=True))
        return t.data_ptr() + offset * t.element_size()

    # ---- statements ----------------------------------------------------------------------
    def run(self, stmt: Any) -> None:
        if self.launch.failed.is_set():
            raise _Abort()
        self._locate(stmt)
        if isinstance(stmt, tirx.SeqStmt):
            for s in self.nodes.items(stmt.seq):
                self.run(s)
        elif isinstance(stmt, tirx.Bind):
            self.env[stmt.var] = self.eval(stmt.value)
        elif isinstance(stmt, tirx.BufferStore):
            self.store(stmt)
        elif isinstance(stmt, tirx.Evaluate):
            self.evaluate(stmt.value)
        elif isinstance(stmt, tirx.For):
            self.loop(stmt)
        elif isinstance(stmt, tirx.IfThenElse):
            cond = self.eval(stmt.condition)
            if isinstance(cond, torch.Tensor) and cond.numel() > 1:
                raise self.unsupported("an if on a per-element condition inside T.Parallel")
            if bool(cond):
                self.run(stmt.then_case)
            elif stmt.else_case is not None:
                self.run(stmt.else_case)
        elif isinstance(stmt, tirx.DeclBuffer):
            pass  # buffers are resolved where they are used (see tensor())
        elif isinstance(stmt, tirx.AllocBuffer):
            self.allocate(stmt.buffer)
        elif isinstance(stmt, tirx.SBlockRealize):
            for buf in stmt.block.alloc_buffers:
                self.allocate(buf)
            self.run(stmt.block.body)
        elif isinstance(stmt, tirx.AttrStmt):
            self.run(stmt.body)
        elif isinstance(stmt, tirx.AssertStmt):
            if not bool(self.eval(stmt.condition)):
                raise AssertionError(f"rank {self.rank}: kernel assertion failed{self._where()}")
        else:
            raise self.unsupported(f"statement {type(stmt).__name__}")

    def _locate(self, stmt: Any) -> None:
        line = self.nodes.line(stmt) if not isinstance(stmt, tirx.SeqStmt) else ""
        if line:
            self.line = line

    def allocate(self, buf: tirx.Buffer) -> None:
        shape = [int(self.eval(s)) for s in self.nodes.items(buf.shape)]
        if self.launch.kernel.clustered and self.nodes.scope(buf).startswith("shared"):
            # Other blocks of the cluster may reach this tile (and may have reached it first).
            self.env[buf] = self.launch.cluster_tile(self.cluster, self.cta_rank, buf, shape)
        else:
            self.env[buf] = torch.zeros(shape, dtype=_torch_dtype(buf.dtype))
        self.env[buf.data] = self.env[buf]  # for access pointers (device calls' local sides)

    def loop(self, stmt: tirx.For) -> None:
        extent = int(self.eval(stmt.extent))
        start = int(self.eval(stmt.min))
        if stmt.kind == tirx.ForKind.PARALLEL:
            self.parallel(stmt)
            return
        if stmt.kind == tirx.ForKind.THREAD_BINDING:
            raise self.unsupported("a thread binding inside a block")
        for i in range(start, start + extent):
            self.env[stmt.loop_var] = i
            self.run(stmt.body)

    def parallel(self, stmt: tirx.For) -> None:
        # A nest of T.Parallel loops becomes one vectorised step: loop variables are index
        # tensors, broadcast against each other.
        nest = []
        body = stmt
        while isinstance(body, tirx.For) and body.kind == tirx.ForKind.PARALLEL:
            nest.append(body)
            body = body.body
        for axis, loop in enumerate(nest):
            shape = [1] * len(nest)
            shape[axis] = int(self.eval(loop.extent))
            self.env[loop.loop_var] = torch.arange(int(self.eval(loop.min)), int(self.eval(loop.min)) + shape[axis])\
                .view(shape)
        self._parallel_vars = {loop.loop_var for loop in nest}
        self.parallel_body(body)
        self._parallel_vars = set()
        for loop in nest:
            self.env.pop(loop.loop_var, None)

    def parallel_body(self, stmt: Any) -> None:
        self._locate(stmt)
        if isinstance(stmt, tirx.SeqStmt):
            for s in self.nodes.items(stmt.seq):
                self.parallel_body(s)
        elif isinstance(stmt, (tirx.BufferStore, tirx.Bind)):
            self.run(stmt)
            if isinstance(stmt, tirx.Bind):  # a value per element, like the loop variables
                self._parallel_vars.add(stmt.var)
        elif isinstance(stmt, tirx.For) and stmt.kind in (tirx.ForKind.SERIAL, tirx.ForKind.UNROLLED):
            # A loop inside the nest runs its steps in order, each for every element at once:
            # what each GPU thread does for its own elements, where no element reads another's
            # values written in the loop (a race on the GPU too).
            start, extent = self.eval(stmt.min), self.eval(stmt.extent)
            if isinstance(start, torch.Tensor) or isinstance(extent, torch.Tensor):
                raise self.unsupported("a loop inside T.Parallel whose bounds differ per element")
            for i in range(int(start), int(start) + int(extent)):
                self.env[stmt.loop_var] = i
                self.parallel_body(stmt.body)
            self.env.pop(stmt.loop_var, None)
        elif (atomic := self._element_atomic(stmt)) is not None:
            self.parallel_atomic(atomic, None)
        elif isinstance(stmt, tirx.IfThenElse) and stmt.else_case is None:
            # Masked store: evaluate the condition per element, store where it holds.
            cond = self.eval(stmt.condition)
            if not isinstance(cond, torch.Tensor):
                if bool(cond):
                    self.parallel_body(stmt.then_case)
                return
            if isinstance(stmt.then_case, tirx.BufferStore):
                self.masked_store(stmt.then_case, cond)
            elif (atomic := self._element_atomic(stmt.then_case)) is not None:
                self.parallel_atomic(atomic, cond)
            else:
                raise self.unsupported("a conditional block inside T.Parallel")
        else:
            raise self.unsupported(f"{type(stmt).__name__} inside T.Parallel")

    @contextlib.contextmanager
    def _elements_where(self, mask: torch.Tensor | None) -> Iterator[int]:
        """While the block runs, the T.Parallel nest's loop variables are the index tensors of
        the elements where ``mask`` holds (None: every element); yields their count. As on the
        GPU, a guarded statement evaluates its indices and value only there (a guarded load past
        a row's end reads nothing)."""
        loops = [v for v in self._parallel_vars if isinstance(self.env.get(v), torch.Tensor)]
        shape = torch.broadcast_shapes(*([] if mask is None else [mask.shape]), *[self.env[v].shape for v in loops])
        keep = torch.ones(shape, dtype=torch.bool) if mask is None else mask.expand(shape)
        saved = {v: self.env[v] for v in loops}
        try:
            for v in loops:
                self.env[v] = saved[v].expand(shape)[keep]
            yield int(keep.sum())
        finally:
            self.env.update(saved)

    def _element_indices(self, buf: tirx.Buffer, t: torch.Tensor, indices: Any, n: int) -> list[torch.Tensor]:
        """``indices`` of ``buf`` (its tensor ``t``) for the ``n`` elements of :meth:`_elements_where`, checked."""
        idx = [self.eval(i) for i in self.nodes.items(indices)]
        idx = [i if isinstance(i, torch.Tensor) else torch.full((n,), int(i)) for i in idx]
        self._check_bounds(buf, t, idx)
        return idx

    def masked_store(self, node: tirx.BufferStore, mask: torch.Tensor) -> None:
        with self._elements_where(mask) as n:
            t = self.tensor(node.buffer)
            idx = self._element_indices(node.buffer, t, node.indices, n)
            value = self.eval(node.value)
            t[tuple(idx)] = torch.as_tensor(value).to(t.dtype) if isinstance(value, torch.Tensor) else value

    def _element_atomic(self, stmt: Any) -> tirx.Call | None:
        """The element atomic (``T.atomic_add(buf[i], v)`` and its max / min) ``stmt`` evaluates, else None."""
        found = (isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tirx.Call)
                 and self.nodes.call(stmt.value)[0] in _ELEMENT_ATOMICS)
        return stmt.value if found else None

    def parallel_atomic(self, call: tirx.Call, mask: torch.Tensor | None) -> None:
        """An element atomic for every element of the T.Parallel nest (where ``mask`` holds):
        each element's update applied, also where several name one address (as the GPU's
        atomics are; a plain store would keep one of them)."""
        name, args = self.nodes.call(call)
        ptr = args[0]
        if not (isinstance(ptr, tirx.Call) and ptr.op.name in ("tirx.address_of", "tl.access_ptr")):
            raise self.unsupported(f"atomic on {ptr}")
        load = ptr.args[0]
        t = self.tensor(load.buffer)
        if not t.is_contiguous():
            raise self.unsupported("an atomic on a non-contiguous tile inside T.Parallel")
        with self._elements_where(mask) as n:
            idx = self._element_indices(load.buffer, t, load.indices, n)
            value = self.eval(args[1])
            value = (value.reshape(-1) if isinstance(value, torch.Tensor) else torch.full((n,), value)).to(t.dtype)
            flat = sum(i.long() * s for i, s in zip(idx, t.stride(), strict=True)).reshape(-1)
            view = t.view(-1)
            with self.launch.kernel.atomic():
                if name == "tl.atomic_add_elem_op":
                    view.index_add_(0, flat, value)
                else:
                    view.scatter_reduce_(0, flat, value, "amax" if name == "tl.atomic_max_elem_op" else "amin")

    def evaluate(self, call: Any) -> None:
        if not isinstance(call, tirx.Call):
            self.eval(call)
            return
        name, args = self.nodes.call(call)
        if name == "tl.tileop.copy":
            self.copy(args[0], args[1])
        elif name == "tl.tileop.fill":
            self.fill(args[0], args[1])
        elif name == "tl.tileop.gemm":
            self.gemm(args)
        elif name == "tl.tileop.reduce":
            self.reduce(args)
        elif name == "tl.tileop.cumsum":
            self.cumsum(args)
        elif name == "tl.tileop.atomicadd":
            self.atomic_add(args[0], args[1])
        elif name == "tirx.call_extern":
            self.extern(str(args[0].value), args[1:])
        elif name in _ELEMENT_ATOMICS:
            ptr, value = self.pointer(args[0]), self.eval(args[1])
            with self.launch.kernel.atomic():
                old = ptr.flat[0].item()
                new = {"tl.atomic_add_elem_op": lambda: old + value, "tl.atomic_max_elem_op": lambda: max(old, value),
                       "tl.atomic_min_elem_op": lambda: min(old, value)}[name]()
                ptr.flat[0] = new
        elif name in ("tl.sync_threads", "tirx.tvm_storage_sync", "tl.fence_proxy_async"):
            pass  # one thread per block: nothing to synchronise inside it
        elif name == "tl.cluster_sync":
            self.cluster_barrier()
        else:
            raise self.unsupported(f"operation '{name}'")

    # ---- expressions ---------------------------------------------------------------------
    def eval(self, e: Any) -> Any:  # noqa: C901 - one dispatch over TIR's expression kinds
        if isinstance(e, (int, float, bool)):
            return e
        if isinstance(e, tirx.IntImm):
            return self.nodes.constant(e)
        if isinstance(e, tirx.FloatImm):
            return float(e.value)
        if isinstance(e, tirx.StringImm):
            return e.value
        if isinstance(e, tirx.Var):
            if e not in self.env:
                raise self.unsupported(f"free variable '{e.name}'")
            return self.env[e]
        if isinstance(e, tirx.BufferLoad):
            return self.load(e)
        binary = _BINARY.get(type(e))
        if binary is not None:
            return binary(self.eval(e.a), self.eval(e.b))
        if isinstance(e, tirx.Not):
            a = self.eval(e.a)
            return ~a if isinstance(a, torch.Tensor) else not a
        if isinstance(e, tirx.Select):
            return _select(self.eval(e.condition), self.eval(e.true_value), self.eval(e.false_value))
        if isinstance(e, tirx.Cast):
            return _cast(self.eval(e.value), str(e.dtype))
        if isinstance(e, tirx.Let):
            self.env[e.var] = self.eval(e.value)
            return self.eval(e.body)
        if isinstance(e, tirx.Call):
            return self.call(e)
        raise self.unsupported(f"expression {type(e).__name__}")

    def call(self, e: tirx.Call) -> Any:
        name, args = self.nodes.call(e)
        if name in _MATH:
            x = self.eval(args[0])
            return _MATH[name](x if isinstance(x, torch.Tensor) else torch.tensor(float(x)))
        if name == "tirx.if_then_else":
            return _select(self.eval(args[0]), self.eval(args[1]), self.eval(args[2]))
        if name == "tirx.reinterpret":
            return int(self.eval(args[0]))
        if name == "tl.launch_thread_idx":
            return 0
        if name == "tl.block_rank_in_cluster":
            return self.cta_rank
        if name == "tirx.call_extern" and args[0].value in AS_WRITTEN_CASTS.values():  # as_written
            return self.eval(args[1])
        if name == "tirx.call_extern" and args[0].value == MAP_EXTERN:
            return self.cluster_address(args[1], args[2])
        if name == "tirx.call_extern" and self.launch.kernel.device_roles.get(args[0].value) == "agree":
            return self.device_call("agree", list(args[1:]))
        if name == "tirx.call_extern" and args[0].value == ADDRESS_HELPERS["agree"]:
            return self.agree(self.env[args[1]], int(self.eval(args[2])), int(self.eval(args[3])),
                              int(self.eval(args[6])))
        if name == "tirx.pow":
            return self.eval(args[0]) ** self.eval(args[1])
        raise self.unsupported(f"call to '{name}'")


def _floordiv(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.div(torch.as_tensor(a), b, rounding_mode="floor")
    return a // b


def _floormod(a: Any, b: Any) -> Any:
    return torch.remainder(torch.as_tensor(a), b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) \
        else a % b


def _div(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return int(a / b)  # C semantics: truncation toward zero
    if any(isinstance(x, torch.Tensor) and not x.is_floating_point() for x in (a, b)) and \
            not any(isinstance(x, float) or isinstance(x, torch.Tensor) and x.is_floating_point() for x in (a, b)):
        return torch.div(torch.as_tensor(a), b, rounding_mode="trunc")  # integers (e.g. a register): C division
    return a / b


def _min(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)


def _max(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def _and(a: Any, b: Any) -> Any:
    return (a & b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else (a and b)


def _or(a: Any, b: Any) -> Any:
    return (a | b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else (a or b)


def _select(cond: Any, a: Any, b: Any) -> Any:
    if isinstance(cond, torch.Tensor) and cond.numel() != 1:  # no element (a mask that holds nowhere) or many
        return torch.where(cond, torch.as_tensor(a), torch.as_tensor(b))
    return a if bool(cond) else b


def _cast(value: Any, dtype: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(_torch_dtype(dtype))
    if dtype.startswith("int") or dtype.startswith("uint"):
        return int(value)
    if dtype == "bool":
        return bool(value)
    return float(torch.tensor(value, dtype=_torch_dtype(dtype)))


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b, tirx.Mul: lambda a, b: a * b,
    tirx.FloorDiv: _floordiv, tirx.FloorMod: _floormod, tirx.Div: _div, tirx.Mod: _floormod,
    tirx.Min: _min, tirx.Max: _max, tirx.EQ: lambda a, b: a == b, tirx.NE: lambda a, b: a != b,
    tirx.LT: lambda a, b: a < b, tirx.LE: lambda a, b: a <= b, tirx.GT: lambda a, b: a > b,
    tirx.GE: lambda a, b: a >= b, tirx.And: _and, tirx.Or: _or,
}


class CpuKernel:
    """A ``T.prim_func`` made callable on the CPU path with the same arguments as on a GPU."""

    def __init__(self, func: tirx.PrimFunc):
        self.func = func
        self.params = list(func.params)
        # Which tensor arguments must be contiguous, as the host code TileLang compiles checks.
        self.compact = {p: _compact(func.buffer_map[p]) for p in self.params if p in func.buffer_map}
        self.rank = runtime.rank()
        self.nodes = _Nodes()
        self.grid, self.body = self._split_grid(func.body)
        self.cluster_dims = _cluster_dims(self.body)
        self.clustered = math.prod(self.cluster_dims) > 1
        script = func.script()
        # The helpers of the kernel's device lowering (none for the address lowering), by name.
        lowering = comm.device_lowering(str(func.attrs.get("tilescale.remote", comm.ADDRESS)) if func.attrs else
                                        comm.ADDRESS)
        self.device_roles = {getattr(lowering, role): role for role in _ROLES} if lowering is not None else {}
        # Blocks that wait for each other (barriers, or flags another block may set) run as threads.
        waits = ("barrier", "agree", "wait", "warp_wait")
        names = [ADDRESS_HELPERS[r] for r in waits] + [getattr(lowering, r) for r in waits if lowering is not None]
        self.threaded = any(f'"{name}"' in script for name in names)
        self._refuse_thread_level_code()
        self.warps = self._threads() // 32

    def _threads(self) -> int:
        """Threads per block, as the kernel declares them (``T.Kernel(..., threads=)``)."""
        threads = [1]

        def visit(node: Any) -> None:
            if isinstance(node, tirx.SBlock) and "tl.launch_threads" in node.annotations:
                threads[0] = math.prod(int(t) for t in node.annotations["tl.launch_threads"])

        tirx.stmt_functor.post_order_visit(self.body, visit)
        return threads[0]

    def _refuse_thread_level_code(self) -> None:
        # Every kernel binds threadIdx (tx, ty, tz); code that *uses* it is per-thread code,
        # which a block-at-a-time interpreter would run for thread 0 only: refuse it.
        thread_vars, used = set(), set()

        def visit(node: Any) -> None:
            if isinstance(node, tirx.Bind) and isinstance(node.value, tirx.Call) \
                    and getattr(node.value.op, "name", "") == "tl.launch_thread_idx":
                thread_vars.add(node.var)
            elif isinstance(node, tirx.Var):
                used.add(node)

        tirx.stmt_functor.post_order_visit(self.body, visit)
        if thread_vars & used:
            raise NotImplementedError(
                "CPU path: thread-level code (T.get_thread_binding / threadIdx) is not supported; the CPU path "
                "runs each block once, as TileLang's block-level operations define"
            )

    def _split_grid(self, body: Any) -> tuple[list[tirx.For], Any]:
        grid = []
        while True:
            if isinstance(body, tirx.SBlockRealize) and body.block.name_hint == "root":
                body = body.block.body
            elif isinstance(body, tirx.For) and body.kind == tirx.ForKind.THREAD_BINDING \
                    and body.thread_binding.thread_tag.startswith("blockIdx"):
                grid.append(body)
                body = body.body
            else:
                return grid, body

    def get_kernel_source(self) -> str:
        """The interpreted program (TVMScript), in place of generated device source."""
        return self.func.script()

    def _bind(self, args: tuple) -> tuple[dict, list[_Memory]]:
        env: dict = {}
        memories: list[_Memory] = []
        names: dict[int, str] = {}
        for param, arg in zip(self.params, args, strict=True):
            buf = self.func.buffer_map.get(param)
            if buf is None:
                env[param] = arg
                continue
            if not isinstance(arg, torch.Tensor):
                raise TypeError(f"argument '{buf.name}' must be a torch.Tensor")
            if arg.device.type != "cpu":
                raise ValueError(f"argument '{buf.name}' is on {arg.device}; the CPU path runs on CPU tensors")
            _check_argument(buf, self.compact[param], arg)
            for dim, size in zip(buf.shape, arg.shape, strict=True):
                _solve(buf.name, dim, int(size), env)
            env[buf] = arg
            env[buf.data] = arg
            storage = arg.untyped_storage()
            names.setdefault(storage.data_ptr(), buf.name)
            data = torch.empty(0, dtype=torch.uint8).set_(storage)
            memories.append(_Memory(storage.data_ptr(), storage.nbytes(), data, buf.name))
        for state in runtime.live_groups():  # the kernel's group's barrier workspace is one of them
            sync = state.sync_workspace
            memories.append(_Memory(sync.data_ptr(), sync.nbytes, sync.view(torch.uint8), "the barrier workspace"))
        for start, nbytes, data, owner_ptr, peer in host_regions():
            label = f"{names.get(owner_ptr, 'a symmetric tensor')} on rank {peer}"
            memories.append(_Memory(start, nbytes, data, label))
        return env, memories

    def atomic(self):
        """A job-wide lock: read-modify-writes of shared memory from several ranks."""
        return runtime.current().backend.job_lock()  # host_shm: the CPU path's backend

    def spin(self, done: Callable[[], bool], observe: Callable[[], int], what: str, launch: _Launch) -> None:
        """Wait until ``done()``; on timeout raise with every rank's pending wait. As on a GPU, a
        failure already in the wait-status record (ranks disagreeing) ends the wait at once."""
        if done():
            return
        rt = runtime.current()
        store = rt.group.store
        key = f"cpu-waits/{rt.group.rank}"
        with launch.lock:
            store.set(key, what)
        start, timeout = time.monotonic(), rt.wait_timeout_ns / 1e9
        pause = _FIRST_PAUSE_S
        try:
            while not done():
                if launch.failed.is_set():
                    raise _Abort()
                if launch.status[0] != 0:
                    return  # the kernel runs on, as on a GPU; the host raises the record's error
                if time.monotonic() - start > timeout:
                    with launch.lock:
                        pending = [store.get(f"cpu-waits/{r}").decode() if store.check([f"cpu-waits/{r}"]) else ""
                                   for r in range(rt.group.world_size)]
                    graph = "; ".join(f"rank {r}: {p or 'not waiting'}" for r, p in enumerate(pending))
                    raise WaitTimeoutError(
                        f"rank {rt.group.rank}: {what} timed out after {timeout:g} s (observed {observe()}). "
                        f"Pending waits: {graph}"
                    )
                time.sleep(pause)
                pause = min(2 * pause, _MAX_PAUSE_S)
        finally:
            with launch.lock:
                store.set(key, "")

    def _status(self, env: dict) -> torch.Tensor:
        """The wait-status record the kernel is given (its group's), by the address bound to ``ts_status``."""
        address = next((env[p] for p in self.params if p.name == STATUS_PARAM and p in env), None)
        for state in runtime.live_groups():
            if state.wait_status.data_ptr() == address:
                return state.wait_status
        return runtime.current().wait_status  # a kernel without waits: never written

    def __call__(self, *args: Any) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"kernel takes {len(self.params)} arguments, got {len(args)}")
        env, memories = self._bind(args)
        extents = [int(_Block(_Launch(self, memories, 1, False), env, 0).eval(f.extent)) for f in self.grid]
        blocks = math.prod(extents)
        launch = _Launch(self, memories, blocks, self.threaded and blocks > 1, self._status(env))
        tags = [loop.thread_binding.thread_tag[-1] for loop in self.grid]
        sizes = dict(zip(tags, extents, strict=True))
        for axis, d in zip("xyz", self.cluster_dims, strict=True):
            if sizes.get(axis, 1) % d:
                raise ValueError(f"grid extent {sizes.get(axis, 1)} along {axis} is not a multiple of cluster "
                                 f"dimension {d}; CUDA cannot launch that grid")

        def place(block_id: int) -> tuple[dict, tuple, int]:
            local = dict(env)
            coords = {"x": 0, "y": 0, "z": 0}
            rest = block_id
            for loop, tag, n in zip(reversed(self.grid), reversed(tags), reversed(extents), strict=True):
                local[loop.loop_var] = coords[tag] = rest % n
                rest //= n
            (x, y, z), (cx, cy, cz) = (coords[t] for t in "xyz"), self.cluster_dims
            return local, (x // cx, y // cy, z // cz), x % cx + cx * (y % cy + cy * (z % cz))

        def run_block(block_id: int) -> None:
            local, cluster, cta_rank = place(block_id)
            with torch.no_grad():  # kernels are not differentiable; their arguments may be (parameters)
                _Block(launch, local, block_id, cluster, cta_rank).run(self.body)

        self._run(launch, blocks, place, run_block)
        # Blocks ran to completion here, so a difference T.agree recorded is known now: raise it
        # at the call, not at the next launch as on a GPU.
        runtime.check_device_waits()

    def _run(self, launch: _Launch, blocks: int, place: Callable, run_block: Callable[[int], None]) -> None:
        if launch.block_barrier:
            groups = [list(range(blocks))]
        elif self.clustered:
            by_cluster: dict[tuple, list[int]] = collections.defaultdict(list)
            for b in range(blocks):
                by_cluster[place(b)[1]].append(b)
            groups = list(by_cluster.values())
        else:
            for b in range(blocks):
                run_block(b)
            return
        for group in groups:
            _run_together(launch, group, run_block)


def _run_together(launch: _Launch, group: list[int], run_block: Callable[[int], None]) -> None:
    """Run the blocks of ``group`` as threads (they wait for each other); raise the first error."""
    errors: list[BaseException] = []

    def worker(b: int) -> None:
        try:
            run_block(b)
        except _Abort:
            if not launch.failed.is_set():  # never finish a launch silently short of blocks
                errors.append(RuntimeError(f"CPU path: block {b} stopped without an error being recorded"))
        except BaseException as err:  # reported by the launching thread
            errors.append(err)
            launch.abort()

    threads = [threading.Thread(target=worker, args=(b,), daemon=True) for b in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _cluster_dims(body: Any) -> tuple[int, int, int]:
    """The ``cluster_dims`` launch annotation of a kernel, (1, 1, 1) without one."""
    found: list[tuple[int, int, int]] = []

    def visit(node: Any) -> None:
        if isinstance(node, tirx.SBlock) and "cluster_dims" in node.annotations:
            found.append(tuple(int(d) for d in node.annotations["cluster_dims"]))

    tirx.stmt_functor.post_order_visit(body, visit)
    return found[0] if found else (1, 1, 1)


def _check_argument(buf: tirx.Buffer, compact: bool, arg: torch.Tensor) -> None:
    """Raise, as TileLang's compiled host code does on a GPU, where ``arg`` is not the tensor ``buf``
    declares: its rank, dtype and layout. Sizes are checked as they bind (``_solve``)."""
    if arg.dim() != len(buf.shape):
        raise ValueError(f"argument '{buf.name}' has {arg.dim()} dimensions; the kernel declares "
                         f"{len(buf.shape)} ({_shape_text(buf.shape)})")
    if arg.dtype != _torch_dtype(buf.dtype):
        raise TypeError(f"argument '{buf.name}' is {arg.dtype}; the kernel declares {buf.dtype}")
    if compact and not arg.is_contiguous():
        raise ValueError(f"argument '{buf.name}' is not contiguous; the kernel reads it as a compact array")


def _compact(buf: tirx.Buffer) -> bool:
    """Whether ``buf``'s strides are its shape's row-major ones (TileLang spells them out)."""
    if not buf.strides:  # TVM's default: compact
        return True
    analyzer, inner = arith.Analyzer(), 1
    for dim, stride in zip(reversed(buf.shape), reversed(buf.strides), strict=True):
        if not analyzer.can_prove_equal(stride, inner):
            return False
        inner = inner * dim
    return True


def _shape_text(shape: Any) -> str:
    return "(" + ", ".join(str(dim) for dim in shape) + ")"


def _solve(name: str, dim: Any, size: int, env: dict) -> None:
    """Bind the shape variable in ``dim`` (``n`` or ``n * c``) from a tensor's size, or check it against
    its earlier binding or the constant ``dim`` is."""
    if isinstance(dim, tirx.Mul) and isinstance(dim.a, tirx.Var) and isinstance(dim.b, tirx.IntImm):
        if size % int(dim.b.value):
            raise ValueError(f"argument '{name}': size {size} is not a multiple of {int(dim.b.value)} "
                             f"as the kernel requires ({dim})")
        var, value = dim.a, size // int(dim.b.value)
    elif isinstance(dim, tirx.Var):
        var, value = dim, size
    else:
        if isinstance(dim, tirx.IntImm) and int(dim.value) != size:
            raise ValueError(f"argument '{name}' has size {size} where the kernel declares {int(dim.value)}")
        return
    bound = env.setdefault(var, value)
    if bound != value:
        raise ValueError(f"argument '{name}' gives {var.name} = {value}; an earlier argument gave {bound}")
