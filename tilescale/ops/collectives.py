"""Collectives as tilescale kernels: every byte moves through remote tile copies over NVLink.

``all_gather`` pushes each rank's shard into every peer's output; ``reduce_scatter`` and
``all_reduce`` pull peers' data and reduce (floats in fp32, integers in their own type, so
integer sums are exact, wrapping on overflow as torch's do). Each kernel brackets its
exchange with device-scope barriers: the first (``T.agree``) says every rank's buffers are
ready to be written or read and that every rank passed the same call signature (operation,
shape, dtype, algorithm), the second that every exchange has landed (and that inputs may be
reused). Peers are visited starting at ``rank + 1`` so that no rank is read or written by
everyone at once.

Ranks that disagree: no rank reads or writes a peer's data in that call; each fills its
output with NaN (integer dtypes: the dtype's minimum) and every rank raises
:class:`tilescale.ShapeMismatchError` naming both calls (on the CPU path at the call; on
GPUs, which the host does not wait for, at the next tilescale launch, ``ts.synchronize()``
or ``ts.barrier()``).

Buffers are viewed as ``(rows, cols)`` with one row per rank where ranks own parts: a tile
that runs past the end of a row is cut there by TileLang's bounds checks instead of
spilling into the next rank's row.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

from collections.abc import Callable

import torch
import torch.distributed as dist

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit
from tilescale.op_launch import OpLaunch
from tilescale.ops._common import (
    check_input,
    launch_together,
    layout_key,
    op_plans,
    poison_value,
    signature,
    sm_count,
    staging,
    symmetric_in,
    tensor_key,
    tl_dtype,
    vector_width,
    workspace,
)

# Elements per tile and threads per block (benchmarks/copy_plans.py: direct 16-byte copies
# of 16384-element tiles by 256 threads were among the fastest for puts and gets).
BLOCK = 16384
THREADS = 256
# Reductions hold a tile in registers (fp32 accumulator + one peer's part).
REDUCE_BLOCK = 8192
# One-shot all-reduce (every rank reduces everything) up to this many bytes, two-shot above.
ONE_SHOT_MAX_BYTES = 256 * 1024


def accumulator(dtype: str) -> str:
    """The type a reduction of ``dtype`` sums in: integers in their own (exact), floats in fp32."""
    return dtype if dtype.startswith(("int", "uint")) else "float32"


@T.macro
def _poison(buf, row, base, extent, cols, value):
    """``buf[row, base:base + extent]``, cut at ``cols``, set to ``value``."""
    for j in T.Parallel(extent):
        if base + j < cols:
            buf[row, base + j] = value


@jit
def all_gather_kernel(world: int, dtype: str, vec: int, sms: int):
    """Put this rank's ``x`` into row ``rank`` of every rank's ``out`` (this rank's own included),
    then a barrier; ranks that disagree (``T.agree``) poison every row of ``out`` instead.

    Args:
        world: Ranks of the group the kernel is built for.
        dtype: TileLang dtype of the data.
        vec: Elements per 16-byte vector; the length is a multiple of it (a dynamic size).
        sms: Most blocks to launch (one per SM, so the barrier holds).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    n = T.dynamic("n_vectors") * vec
    grid = T.min(T.ceildiv(n, BLOCK), sms)

    @T.prim_func
    def main(x: T.Tensor((1, n), dtype), out: T.Tensor((world, n), dtype), sig: T.int32):
        with T.Kernel(grid, threads=THREADS) as bx:
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                agreed = T.alloc_local((1,), "int32")
                agreed[0] = T.agree(sig)
                for t in T.serial(T.ceildiv(T.ceildiv(n, BLOCK) - bx, grid)):
                    base = (bx + t * grid) * BLOCK
                    if agreed[0] == 1:
                        for p in T.serial(world):
                            T.copy(x[0:1, base:base + BLOCK], out[rank:rank + 1, base:base + BLOCK],
                                   dst_pe=(rank + 1 + p) % world)
                    else:
                        for r in T.serial(world):
                            _poison(out, r, base, BLOCK, n, poison_value(dtype))
                T.barrier()

    return main


@jit
def reduce_kernel(rows: int, dtype: str, vec: int, sms: int, mode: str):
    """Sum row ``r`` of the symmetric ``src`` over all ranks (r = this rank, or 0 if one row).

    ``mode``:
    * ``"scatter"``: the sum goes to this rank's ``out`` (reduce-scatter);
    * ``"push"``: the sum replaces row r of every rank's ``src`` (two-shot all-reduce, in
      place: rank r alone reads and writes row r, so no rank overwrites what another reads);
    * ``"local"`` (one row): every rank sums everything into ``out``, and after a barrier
      (everyone has read ``src``) copies it back into ``src`` (one-shot all-reduce, in place).

    Ranks that disagree (``T.agree``) poison the result (every row of ``src`` when pushing,
    else ``out``, which ``"local"`` then copies into ``src``).

    Args:
        rows: Rows of ``src``: the world size, or 1 for ``"local"``.
        dtype: TileLang dtype of the data; sums accumulate in :func:`accumulator`'s type.
        vec: Elements per 16-byte vector; the column count is a multiple of it (a dynamic size).
        sms: Most blocks to launch (one per SM, so the device barriers hold).
        mode: ``"scatter"``, ``"push"`` or ``"local"``, as above.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    cols = T.dynamic("col_vectors") * vec
    grid = T.min(T.ceildiv(cols, REDUCE_BLOCK), sms)
    tiles = T.ceildiv(cols, REDUCE_BLOCK)
    accum = accumulator(dtype)

    @T.prim_func
    def main(src: T.Tensor((rows, cols), dtype), out: T.Tensor((1, cols), dtype), sig: T.int32):
        with T.Kernel(grid, threads=THREADS) as bx:
            with T.Scale("device") as (rank, world):
                acc = T.alloc_fragment((1, REDUCE_BLOCK), accum)
                part = T.alloc_fragment((1, REDUCE_BLOCK), dtype)
                row = rank % rows
                agreed = T.alloc_local((1,), "int32")
                agreed[0] = T.agree(sig)
                for t in T.serial(T.ceildiv(tiles - bx, grid)):
                    base = (bx + t * grid) * REDUCE_BLOCK
                    if agreed[0] == 1:
                        T.clear(acc)
                        for p in T.serial(world):
                            T.copy(src[row, base], part, src_pe=(rank + p) % world)
                            for i, j in T.Parallel(1, REDUCE_BLOCK):
                                acc[i, j] += T.cast(part[i, j], accum)
                        T.copy(acc, part)
                        if mode == "push":
                            for p in T.serial(world):
                                T.copy(part, src[row, base], dst_pe=(rank + 1 + p) % world)
                        else:
                            T.copy(part, out[0, base])
                    elif mode == "push":
                        for r in T.serial(rows):
                            _poison(src, r, base, REDUCE_BLOCK, cols, poison_value(dtype))
                    else:
                        _poison(out, 0, base, REDUCE_BLOCK, cols, poison_value(dtype))
                T.barrier()
                if mode == "local":
                    for t in T.serial(T.ceildiv(tiles - bx, grid)):
                        base = (bx + t * grid) * REDUCE_BLOCK
                        T.copy(out[0:1, base:base + REDUCE_BLOCK], src[0:1, base:base + REDUCE_BLOCK])

    return main


def all_gather(x: torch.Tensor, out: torch.Tensor | None = None, *,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, like ``dist.all_gather_into_tensor``.

    Example::

        y = ts.ops.all_gather(x)             # (world * x.shape[0], *x.shape[1:])
        y = ts.ops.all_gather(x, group=tp)   # over the ranks of tp: (tp size * x.shape[0], ...)

    Args:
        x: this rank's part, contiguous, the same shape and dtype on every rank.
        out: optional, symmetric over ``group``; without it a cached symmetric buffer is used
            and a fresh tensor returned.
        group: the process group (None: the whole job).

    Returns:
        ``out``, or a new tensor of shape ``(group size * x.shape[0], *x.shape[1:])``.
    """
    key = ("all_gather", layout_key(x), layout_key(out) if out is not None else None,
           out.data_ptr() if out is not None else None, group)
    launch = op_plans.get(key) or op_plans.put(key, _all_gather_plan(x, out, group, key))
    return launch(x)


def _all_gather_plan(x: torch.Tensor, out: torch.Tensor | None, group: dist.ProcessGroup | None,
                     key: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-call part of all_gather calls like this one (plan ``key``), everything else checked and resolved."""
    check_input(x, "x")
    state = runtime.group_state(group)
    world = state.size
    shape = (world * x.shape[0], *x.shape[1:]) if x.dim() else (world,)
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype or not symmetric_in(out, state, "out")):
        raise ValueError(f"out must be a symmetric {x.dtype} tensor of shape {shape}")
    n = x.numel()
    target = out if out is not None else workspace(state, "all_gather.out", world * n, x.dtype)
    kernel = all_gather_kernel(world, tl_dtype(x), vector_width(n, x), sm_count(), group=group)
    rows, result, sig = target.view(world, n), target.view(shape), signature("all_gather", x)
    call = OpLaunch([(kernel, lambda t, o, s: (t[0].view(1, n), rows, sig))], group=group)

    def launch(x: torch.Tensor) -> torch.Tensor:
        call((x,))
        return out if out is not None else result.clone()

    launch_together(state, "all_gather", key)
    return launch


def reduce_scatter(x: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks and return this rank's slice of dim 0, like ``dist.reduce_scatter_tensor``.

    Example::

        y = ts.ops.reduce_scatter(x)             # (x.shape[0] // world, *x.shape[1:])
        y = ts.ops.reduce_scatter(x, group=tp)   # over the ranks of tp

    A symmetric ``x`` (over ``group``) is read in place by the peers; any other is first
    staged into a symmetric buffer.

    Args:
        x: contiguous, dim 0 divisible by the group size, the same shape on every rank.
        group: the process group (None: the whole job).

    Returns:
        A new tensor of shape ``(x.shape[0] // group size, *x.shape[1:])``.
    """
    key = ("reduce_scatter", tensor_key(x), group)
    launch = op_plans.get(key) or op_plans.put(key, _reduce_scatter_plan(x, group, key))
    return launch(x)


def _reduce_scatter_plan(x: torch.Tensor, group: dist.ProcessGroup | None,
                         key: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-call part of reduce_scatter calls like this one (plan ``key``), everything else checked and resolved."""
    check_input(x, "x")
    state = runtime.group_state(group)
    world = state.size
    if x.dim() == 0 or x.shape[0] % world:
        raise ValueError(f"reduce_scatter needs dim 0 ({tuple(x.shape)}) divisible by the group size {world}")
    staged = staging(state, x, "reduce_scatter.in")
    chunk = x.numel() // world
    shape = (x.shape[0] // world, *x.shape[1:])
    kernel = reduce_kernel(world, tl_dtype(x), vector_width(chunk, x), sm_count(), "scatter", group=group)
    sig = signature("reduce_scatter", x)
    call = OpLaunch([(kernel, lambda t, o, s: (t[0].view(world, chunk), o[0].view(1, chunk), sig))], [shape],
                    group=group)

    def launch(x: torch.Tensor) -> torch.Tensor:
        if staged is None:
            return call((x,))
        staged.copy_(x)
        return call((staged,))

    launch_together(state, "reduce_scatter", key)
    return launch


def all_reduce(x: torch.Tensor, algorithm: str | None = None, *,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks in place, like ``dist.all_reduce``; returns ``x``. Floats accumulate
    in fp32, integers in their own type (exact).

    Example::

        ts.ops.all_reduce(x)                          # one-shot when small, two-shot when large
        ts.ops.all_reduce(x, algorithm="two_shot")
        ts.ops.all_reduce(grad, group=dp)             # over the ranks of dp only

    A symmetric ``x`` (over ``group``) is reduced where it is, with no extra copies; any
    other ``x`` is staged through a symmetric buffer (and so is a two-shot ``x`` whose size
    the group size does not divide).

    Args:
        x: contiguous, the same shape and dtype on every rank.
        algorithm: ``"one_shot"``, ``"two_shot"``, or None (by size).
        group: the process group (None: the whole job).

    Returns:
        ``x``, holding the sum.
    """
    key = ("all_reduce", tensor_key(x), algorithm, group)
    launch = op_plans.get(key) or op_plans.put(key, _all_reduce_plan(x, algorithm, group, key))
    return launch(x)


def _all_reduce_plan(x: torch.Tensor, algorithm: str | None, group: dist.ProcessGroup | None,
                     key: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-call part of all_reduce calls like this one (plan ``key``), everything else checked and resolved."""
    check_input(x, "x")
    state = runtime.group_state(group)
    world = state.size
    algorithm = algorithm or ("one_shot" if x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES else "two_shot")
    if algorithm not in ("one_shot", "two_shot"):
        raise ValueError(f"algorithm must be 'one_shot' or 'two_shot', got {algorithm!r}")
    n = x.numel()
    sig = signature("all_reduce", x, algorithm)
    one_shot = algorithm == "one_shot"
    if one_shot:
        rows, chunk = 1, n
        buffer = None if symmetric_in(x, state, "x") else workspace(state, "all_reduce.in", n, x.dtype)
        scratch = workspace(state, "all_reduce.scratch", n, x.dtype).view(1, n)
        kernel = reduce_kernel(1, tl_dtype(x), vector_width(n, x), sm_count(), "local", group=group)
    else:  # reduced row r by rank r, pushed back into row r of every rank's src (``out`` unused)
        rows, chunk, scratch = world, -(-n // world), None
        in_place = symmetric_in(x, state, "x") and chunk * world == n
        buffer = None if in_place else workspace(state, "all_reduce.in", world * chunk, x.dtype)
        kernel = reduce_kernel(world, tl_dtype(x), vector_width(chunk, x), sm_count(), "push", group=group)
    # The source is x, or the buffer it is staged through (x copied in, the sum copied back).
    call = OpLaunch([(kernel, lambda t, o, s: (t[0].view(rows, chunk),
                                               scratch if one_shot else t[0].view(rows, chunk)[:1], sig))], group=group)
    staged = None if buffer is None else buffer[:n].view(x.shape)

    def launch(x: torch.Tensor) -> torch.Tensor:
        if staged is None:
            call((x,))
            return x
        staged.copy_(x)
        call((buffer,))
        x.copy_(staged)
        return x

    launch_together(state, "all_reduce", key)
    return launch
