"""Routing, on the sender: where each token goes, and the one check of expert ids.

A token routed to several experts of one rank crosses the link once (DeepEP's
deduplication): every (token, destination rank) pair is one row. ``route_kernel`` gives each
pair its destination and its slot in the destination's receive buffer (one slot range per
source rank, token order, so senders never need the receivers' offsets), and each (token, k)
entry its order among this rank's entries naming the same expert (``expert_slot``): the
receiver adds its (source, expert) base to place the entry without a scan.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import functools
from dataclasses import dataclass

import numpy as np
import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit

# Routing scans take tokens in chunks of (up to) SCAN_ROWS x SCAN_COLS: each row scanned by a
# warp, then the row totals (a two-level scan: TileLang's scan gives a whole line to one warp).
SCAN_ROWS = 32
SCAN_COLS = 128
SCAN_THREADS = 512
# Routing blocks resident per SM (at most 64 registers a thread for 2): the blocks, one per
# rank and expert, then fit in one wave on an H100 up to 264 of them, and each SM has twice
# the warps to hide its loads behind (one block per SM: 57 us at 4096 tokens, top-8 of 256
# experts, one H100; two: 45-47 us).
ROUTE_BLOCKS_PER_SM = 2


def _id(idx, t, k, num_experts):
    """Entry (t, k)'s expert id as int32, ids of a wider type clamped to [-1, num_experts]
    first, which keeps every bad id bad: no cast wraps one into range (2**32 + 1 is not 1)."""
    return T.Cast("int32", T.max(T.min(idx[t, k], num_experts), -1))


def _entries(idx, t, topk, lo, hi, num_experts):
    """Entries k of token t whose expert id is in [lo, hi) (unrolled over k)."""
    n = 0
    for k in range(topk):
        e = _id(idx, t, k, num_experts)
        n = n + T.if_then_else(T.And(lo <= e, e < hi), 1, 0)
    return n


def _token_hits(idx, t, b, world, num_experts, topk):
    """What block b of the routing kernel counts for token t: whether it goes to rank b
    (b < world), its entries naming expert b - world, or (last block) its ids out of range."""
    per_rank = num_experts // world
    return T.if_then_else(
        b < world, T.min(_entries(idx, t, topk, b * per_rank, b * per_rank + per_rank, num_experts), 1),
        T.if_then_else(b < world + num_experts, _entries(idx, t, topk, b - world, b - world + 1, num_experts),
                       topk - _entries(idx, t, topk, 0, num_experts, num_experts)))


def _earlier(idx, t, k, expert, topk, num_experts):
    """Entries before k of token t naming ``expert`` (several only for repeated ids)."""
    n = 0
    for kk in range(topk - 1):
        n = n + T.if_then_else(T.And(kk < k, _id(idx, t, kk, num_experts) == expert), 1, 0)
    return n


@jit
def route_kernel(world: int, tokens: int, topk: int, num_experts: int, id_dtype: str = "int32"):
    """Block r < world: which tokens go to rank r (``dest``), their slots there in token
    order (``slot``), how many (``send_counts[r]``); pair index ``r * tokens + t``.
    Block world + e: the order of each (token, k) entry naming expert e among this rank's
    entries naming it, in (token, k) order (``expert_slot``), and how many
    (``expert_counts[e]``). The last block counts the ids outside [0, num_experts) into
    ``bad[0]``: those are routed nowhere, their ``expert_slot`` -1; and writes the int32 ids
    the dispatch sends (``ids``: -1 for those). Where ``bad_host`` is not 0 it also stores
    that count at host address ``bad_host`` (a pinned, device-mapped word the host watches:
    no copy to bring the check back). ``topk_idx`` is read as passed (``id_dtype``:
    int32 or int64), so the caller's ids need no conversion kernel. Every element of every
    output is written (the caller allocates them unfilled).

    Args:
        world: Ranks of the group.
        tokens: This rank's tokens (at least 1; the caller routes no tokens without a kernel).
        topk: Experts per token.
        num_experts: Experts over the whole group.
        id_dtype: ``"int32"`` (default) or ``"int64"``, the dtype of ``topk_idx``.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    scan_rows = min(SCAN_ROWS, -(-tokens // SCAN_COLS))  # fewer for few tokens
    chunk = scan_rows * SCAN_COLS

    @T.prim_func
    def main(topk_idx: T.Tensor((tokens, topk), id_dtype), dest: T.Tensor((world * tokens,), "int32"),
             slot: T.Tensor((world * tokens,), "int32"), send_counts: T.Tensor((world,), "int32"),
             expert_slot: T.Tensor((tokens, topk), "int32"), expert_counts: T.Tensor((num_experts,), "int32"),
             bad: T.Tensor((1,), "int32"), ids: T.Tensor((tokens, topk), "int32"), bad_host: T.int64):
        with T.Kernel(world + num_experts + 1, threads=SCAN_THREADS) as b:
            T.annotate_min_blocks_per_sm(ROUTE_BLOCKS_PER_SM)
            hits = T.alloc_shared((scan_rows, SCAN_COLS), "int32")  # per token: 0/1 (rank), entries (expert)
            prefix = T.alloc_shared((scan_rows, SCAN_COLS), "int32")  # inclusive, along each row
            row_end = T.alloc_shared((scan_rows,), "int32")  # inclusive prefix of the row totals
            done = T.alloc_local((1,), "int32")  # counted in earlier chunks
            done[0] = 0
            for c in T.serial(T.ceildiv(tokens, chunk)):
                for i, j in T.Parallel(scan_rows, SCAN_COLS):
                    u = c * chunk + i * SCAN_COLS + j
                    hits[i, j] = T.if_then_else(
                        u < tokens, _token_hits(topk_idx, T.min(u, tokens - 1), b, world, num_experts, topk), 0)
                T.cumsum(src=hits, dst=prefix, dim=1)
                for i in T.Parallel(scan_rows):
                    row_end[i] = prefix[i, SCAN_COLS - 1]
                T.cumsum(src=row_end, dim=0)
                # Exclusive prefix of token (i, j): done + row_end[i] - prefix[i, -1] + prefix[i, j] - hits[i, j].
                if b < world:
                    for i, j in T.Parallel(scan_rows, SCAN_COLS):
                        u = c * chunk + i * SCAN_COLS + j
                        if u < tokens:
                            dest[b * tokens + u] = T.if_then_else(hits[i, j] > 0, b, -1)
                        if u < tokens:
                            slot[b * tokens + u] = T.if_then_else(
                                hits[i, j] > 0, done[0] + row_end[i] - prefix[i, SCAN_COLS - 1] + prefix[i, j] - 1, -1)
                elif b < world + num_experts:
                    for i, j, k in T.Parallel(scan_rows, SCAN_COLS, topk):
                        u = c * chunk + i * SCAN_COLS + j
                        t = T.min(u, tokens - 1)
                        # The token's ids are read again only where it names this expert (hits,
                        # in shared memory): 1 token in num_experts / topk, not every one.
                        if u < tokens and hits[i, j] > 0 and _id(topk_idx, t, k, num_experts) == b - world:
                            expert_slot[t, k] = (done[0] + row_end[i] - prefix[i, SCAN_COLS - 1] + prefix[i, j]
                                                 - hits[i, j] + T.if_then_else(
                                                     hits[i, j] > 1,
                                                     _earlier(topk_idx, t, k, b - world, topk, num_experts), 0))
                else:  # entries of ids out of range get no expert slot (written, so no output needs a fill)
                    for i, j, k in T.Parallel(scan_rows, SCAN_COLS, topk):
                        u = c * chunk + i * SCAN_COLS + j
                        t = T.min(u, tokens - 1)
                        e = _id(topk_idx, t, k, num_experts)
                        if u < tokens:
                            ids[t, k] = T.if_then_else(T.And(e >= 0, e < num_experts), e, -1)
                        if u < tokens and T.Or(e < 0, e >= num_experts):
                            expert_slot[t, k] = -1
                done[0] = done[0] + row_end[scan_rows - 1]
            if b < world:
                send_counts[b] = done[0]
            elif b < world + num_experts:
                expert_counts[b - world] = done[0]
            else:
                bad[0] = done[0]
                if bad_host != 0:
                    T.make_tensor_from_addr(bad_host, [1], "int32")[0] = done[0]

    return main


def expert_ids(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The expert ids as the routing kernel reads them: int32 and int64 ids as passed (the
    kernel clamps and casts them, the one check of id values), other integer types widened
    to one of those, keeping every value (TypeError for other dtypes).

    Args:
        topk_idx: (tokens, topk) expert ids of any integer dtype.
        num_experts: Experts over the whole group (the routing kernel checks ids against it).

    Returns:
        torch.Tensor: ``topk_idx`` contiguous if int32 or int64, else converted to int64 (types wider
        than int32) or int32.

    Raises:
        TypeError: ``topk_idx`` is not of an integer dtype.
    """
    wide = _wider_than_int32(topk_idx.dtype)
    if topk_idx.dtype in (torch.int32, torch.int64):
        return topk_idx.contiguous()
    return topk_idx.to(torch.int64 if wide else torch.int32)  # uint64 ids past 2**63 turn negative: bad


@functools.cache
def _wider_than_int32(dtype: torch.dtype) -> bool:
    """Whether integer ``dtype`` holds values int32 does not (TypeError for other dtypes): once per dtype."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"moe_dispatch: topk_idx must hold integer expert ids, got {dtype}")
    info, i32 = torch.iinfo(dtype), torch.iinfo(torch.int32)
    return info.min < i32.min or info.max > i32.max


@dataclass
class _IdCheck:
    """The routing kernel's count of out-of-range expert ids for one call, read when ready."""

    bad: np.ndarray  # (1,) int32: on GPUs a pinned host word the routing kernel stores into, -1 until it does
    host: torch.Tensor | None  # that pinned word (None on the CPU path), reused once the check is read
    idx: torch.Tensor  # the call's expert ids, for the message
    num_experts: int


_id_checks: list[_IdCheck] = []
# Pinned words of finished checks and their numpy views, for the next calls (a new pinned
# allocation per call cost a low-latency dispatch + combine 4% of its host time, one H200).
_spare: list[tuple[torch.Tensor, np.ndarray]] = []


def watch_ids(bad: torch.Tensor, idx: torch.Tensor, num_experts: int) -> int:
    """Queue the device's id check of this call, without waiting for it.

    On GPUs the routing kernel stores its count straight into a pinned host word that holds
    -1 until then (a 4-byte store, seen whole): no copy, no event. On the CPU path the kernel
    has run by the time the call returns, and ``bad`` is read as it is.

    Args:
        bad: (1,) int32 count of out-of-range ids the routing kernel writes.
        idx: The call's expert ids as passed (kept for the error message).
        num_experts: Experts over the whole group.

    Returns:
        int: The host word's address for the routing kernel's ``bad_host`` (0 on the CPU
        path); :func:`raise_bad_ids` raises for the check once the count has landed.
    """
    if not bad.is_cuda:
        _id_checks.append(_IdCheck(bad.numpy(), None, idx, num_experts))
        return 0
    if _spare:
        host, word = _spare.pop()
    else:
        host = torch.empty(1, dtype=torch.int32, device="cpu", pin_memory=True)
        word = host.numpy()
    word[0] = -1
    _id_checks.append(_IdCheck(word, host, idx, num_experts))
    return host.data_ptr()


def raise_bad_ids() -> None:
    """Raise for the first finished id check that found ids out of range (finished checks are dropped)."""
    while _id_checks and _id_checks[0].bad[0] >= 0:
        check = _id_checks.pop(0)
        found = int(check.bad[0])
        if check.host is not None:
            _spare.append((check.host, check.bad))
        if found:
            low, high = int(check.idx.min()), int(check.idx.max())
            raise ValueError(f"moe_dispatch: rank {runtime.rank()}: expert ids must be in [0, {check.num_experts}); "
                             f"got {low}..{high} ({found} out of range, not sent)")
