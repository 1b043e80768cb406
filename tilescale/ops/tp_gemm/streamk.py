"""Stream-K for a fused GEMM kernel's last tiles: their K steps shared out evenly over one
extra block per SM, so the last wave leaves no SM idle (:class:`StreamK`, the schedule;
:func:`parts`, :func:`accumulate`, :func:`store_partial` and :func:`fold_partials`, its
device side; :func:`workspace`, the partial tiles' memory).

A kernel with a schedule runs its first ``tiles - sk.tiles`` tiles one block each, as without
it (data-parallel), then ``sk.blocks`` stream-K blocks: block ``j`` takes K steps ``[j * S //
B, (j + 1) * S // B)`` of the ``S = sk.tiles * sk.steps`` steps of the last tiles (tile by
tile, in order), so a block computes the end of one tile, whole tiles, then the start of one
more. The part with a tile's last K step finishes the tile: it adds the earlier parts'
partial accumulators (fp32, in block order: the same bits every call) and runs the kernel's
epilogue. Only a block's last part can stop before its tile's end, so each block stores at
most one partial (slot ``j`` of the workspace) and the finisher of a tile reads the slots of
the blocks before it that started the tile. A block computes its parts last to first, so
the partial it stores comes first and the tile it finishes (waiting) last; blocks start in
index order, so the blocks a finisher waits for are running or done and stored their
partials at their start (the CPU path runs blocks one after another).

A stored partial's flag counts the storing block's warps that hold the accumulator (under
TileLang's warp specialisation, its consumer warps: each signals once its stores are done);
the finisher's warps each wait for the full count, read, meet in a barrier of those warps,
and the flag goes back to zero for the next call (stream order): no call count needed, so
the same holds in CUDA-graph replays.
"""

from dataclasses import dataclass

import torch

import tilescale.language as T
from tilescale.groups import GroupState
from tilescale.ops._gemm import TileConfig


@dataclass(frozen=True)
class StreamK:
    """A kernel's last ``tiles`` tiles (in its tile order), of ``steps`` K steps each, computed
    by ``blocks`` stream-K blocks (one per SM) after its whole-tile blocks.

    Example::

        StreamK(204, 64, 132)    # 1500 x 7168 in 128x256 tiles, K = 4096: 1 whole wave, then 98-99 steps per SM
    """

    tiles: int
    steps: int
    blocks: int

    def __post_init__(self) -> None:
        if min(self.tiles, self.steps, self.blocks) < 1 or self.tiles * self.steps < self.blocks:
            raise ValueError(f"bad stream-K schedule {self}: every block needs a K step")

    @property
    def parts(self) -> int:
        """Most tiles a block touches: a block's steps may begin and end inside tiles."""
        per_block = -(-self.tiles * self.steps // self.blocks)
        return -(-per_block // self.steps) + 1


def workspace(state: GroupState, key: tuple, sk: StreamK, tile: TileConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial tiles (fp32, a ``block_M`` x ``block_N`` slot per stream-K block) and
    their flags (zero between calls) for the kernel of ``key``, made at first use; not
    symmetric: only this GPU's blocks use them. Calls of one kernel share it, as its
    exchange's buffers are shared: one stream at a time."""

    def create() -> tuple[torch.Tensor, torch.Tensor]:
        from tilescale import runtime

        runtime.check_not_capturing(f"the stream-K workspace of {key}")
        device = runtime.device()
        return (torch.empty(sk.blocks * tile.block_M, tile.block_N, dtype=torch.float32, device=device),
                torch.zeros(sk.blocks, dtype=torch.int32, device=device))

    return state.exchange(("tp_gemm", "streamk", *key, sk, tile), create)


def parts(sk: StreamK, block, p):
    """(stream-K tile, first K step, end K step) of part ``p`` of stream-K block ``block``; the
    part is empty where the first step is not below the end."""
    total = sk.tiles * sk.steps
    start = block * total // sk.blocks
    stop = (block + 1) * total // sk.blocks
    tile = start // sk.steps + p
    return tile, T.max(start - tile * sk.steps, 0), T.min(stop - tile * sk.steps, sk.steps)


@T.macro
def accumulate(A, a_row, W, w_row, a, w, acc, k0, k1, cfg: TileConfig):
    """``acc = A[a_row:+BM, steps k0..k1) @ W[w_row:+BN, same].T`` through the shared tiles ``a``, ``w``."""
    T.clear(acc)
    for k in T.Pipelined(k1 - k0, num_stages=cfg.stages):
        T.copy(A[a_row, (k0 + k) * cfg.block_K], a)
        T.copy(W[w_row, (k0 + k) * cfg.block_K], w)
        T.gemm(a, w, acc, transpose_B=True, policy=cfg.warp_policy)


@T.macro
def store_partial(ws, flags, block, acc, cfg: TileConfig):
    """Stream-K block ``block``'s partial tile into its workspace slot, then its flag: each warp
    that holds part of the accumulator adds 1 once its own stores are done."""
    for i, j in T.Parallel(cfg.block_M, cfg.block_N):
        ws[block * cfg.block_M + i, j] = acc[i, j]
    T.signal(flags[block], 1, op="add", scope="warp")


@T.macro
def fold_partials(ws, flags, first, count, acc, cfg: TileConfig):
    """Add to ``acc`` the partials that stream-K blocks ``first .. first + count - 1`` stored, in
    block order; once every warp has read them, their flags go back to zero."""
    for q in T.serial(count):
        # Every warp of the storing block has added 1 (the warps holding the accumulator).
        T.wait(flags[first + q], "ge", cfg.threads // 32, scope="warp")
        for i, j in T.Parallel(cfg.block_M, cfg.block_N):
            acc[i, j] += ws[(first + q) * cfg.block_M + i, j]
    T.sync_threads()  # every warp holding the accumulator is past its waits and reads
    for q in T.serial(count):
        flags[first + q] = 0


@T.macro
def run_tiles(block, whole, sk: StreamK, cfg: TileConfig, acc, ws, flags, work, finish, env):
    """A stream-K kernel's block ``block``: below ``whole``, the whole tile of that index;
    above, its parts of the last ``sk.tiles`` tiles (numbered from ``whole`` on). The kernel's
    ``work(tile, k0, k1, env)`` fills ``acc`` with K steps ``k0..k1`` of a tile (after any
    wait for its operands) and ``finish(tile, env)`` is its epilogue for a whole tile in
    ``acc``; ``env``: what they need of the kernel (its tensors, rank). Both run at one place
    of the program, so the K loop's shared tiles are pipelined once.

    Example::

        with T.Kernel(whole + sk.blocks, threads=cfg.threads) as b:
            ...
            run_tiles(b, whole, sk, cfg, acc, ws, flags, work, finish, SimpleNamespace(C=C, a=a, w=w))
    """
    total = sk.tiles * sk.steps
    streamed = block - whole  # the stream-K block's number, where >= 0
    for r in T.serial(sk.parts):
        # Last part first: a block's last part (a tile's start, stored as a partial) is what
        # the next blocks' finishers wait for, and its first part (a tile's end, which it
        # finishes) waits for the earlier blocks' last parts. In order, block j could finish
        # its first tile only once block j - 1 had done all its work: a chain over every block.
        p = sk.parts - 1 - r
        tile, k0, k1 = parts(sk, streamed, p)
        whole_tile = block < whole
        if T.if_then_else(whole_tile, p == 0, k0 < k1):
            work(T.if_then_else(whole_tile, block, whole + tile), T.if_then_else(whole_tile, 0, k0),
                 T.if_then_else(whole_tile, sk.steps, k1), env)
            if T.if_then_else(whole_tile, False, k1 < sk.steps):
                store_partial(ws, flags, streamed, acc, cfg)
            else:
                # The blocks before this one that hold steps of the tile, from the one with its first step.
                first = ((tile * sk.steps + 1) * sk.blocks - 1) // total
                fold_partials(ws, flags, first, T.if_then_else(whole_tile, 0, streamed - first), acc, cfg)
                finish(T.if_then_else(whole_tile, block, whole + tile), env)


@T.macro
def store_tile(acc, out, C, row, col, cfg: TileConfig):
    """The whole tile in ``acc`` into ``C[row:+BM, col:+BN]`` by ``cfg``'s epilogue (``out``: its
    shared tile where the epilogue stages through shared memory)."""
    if cfg.epilogue == "shared":
        T.copy(acc, out)
        T.copy(out, C[row, col])
    else:
        T.copy(acc, C[row, col])
