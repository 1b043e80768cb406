"""Routing, on the sender: where each token goes, and the one check of expert ids.

A token routed to several experts of one rank crosses the link once (DeepEP's
deduplication): every (token, destination rank) pair is one row. ``routing`` gives each
pair its destination and its slot in the destination's receive buffer (one slot range per
source rank, token order, so senders never need the receivers' offsets), and each (token, k)
entry its order among this rank's entries naming the same expert (``expert_slot``): the
receiver adds its (source, expert) base to place the entry without a scan.

Work in O(tokens x topk): each block routes its own chunk of tokens (a scan per bin along the
chunk), and a second kernel adds what earlier chunks hold of each bin; a decode batch is one
chunk, one kernel, and where every rank sends at most a decode batch no kernel of its own: each
dispatch block routes its own tokens from every token's ids (``route_block``), one launch less
per call. (One block per bin scanning every token took 33 us at 4096 tokens, top-8 of 256
experts, one H100.)
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit

# Tokens per routing block: chunks of CHUNK_TOKENS (more per block past MAX_CHUNKS chunks,
# which bounds the prefix each block of the second kernel sums); a decode batch of at most
# DECODE_TOKENS is one chunk: one kernel.
CHUNK_TOKENS = 32
MAX_CHUNKS = 128
DECODE_TOKENS = 128
# Bins (ranks, experts, ids out of range) each block of the count kernel scans along its
# chunk: a grid of bin groups x chunks, so a decode batch's one chunk is still spread over
# SMs (its 128 tokens x 258 bins scanned by one block made the low-latency dispatch 25.6 ->
# 33.2 us replayed, one H100).
GROUP_BINS = 32
# Threads of a count block: four per token of its chunk (512 for a decode batch's 128 tokens:
# with 128 its scan and entries took the low-latency dispatch 23.5 -> 26.6 us, one H100).
THREADS_PER_TOKEN = 4
THREADS = 256


def route_chunks(tokens: int) -> tuple[int, int]:
    """``(chunk, chunks)``: tokens per routing block and blocks, for ``tokens`` (at least 1) tokens."""
    if tokens <= DECODE_TOKENS:
        return DECODE_TOKENS, 1
    chunk = CHUNK_TOKENS * -(-tokens // (CHUNK_TOKENS * MAX_CHUNKS))
    return chunk, -(-tokens // chunk)


def route_class(tokens: int) -> tuple[int, int]:
    """``(chunk, max_chunks)``: the routing kernels that route ``tokens`` (at least 1) tokens.

    The kernels take any token count (a dynamic size) and are built per class: a decode batch
    (one chunk of ``DECODE_TOKENS``), or chunks of ``route_chunks``' size, at most
    ``MAX_CHUNKS`` of them. Counts of one class share the kernels (one class per 4096 tokens
    past the decode batches), so a new token count compiles nothing.

    Args:
        tokens: This rank's tokens, at least 1.

    Returns:
        tuple[int, int]: tokens per chunk, and the most chunks (the rows of the ``counts`` scratch).
    """
    chunk, _ = route_chunks(tokens)
    return chunk, 1 if tokens <= DECODE_TOKENS else MAX_CHUNKS


def chunk_counts_shape(world: int, tokens: int, num_experts: int) -> tuple[int, int]:
    """Shape of the routing kernels' ``counts`` scratch for ``tokens`` tokens: a row per chunk
    of their class (``route_class``), a column per bin (ranks, experts, ids out of range)."""
    return route_class(tokens)[1], world + num_experts + 1


def _id(idx, t, k, num_experts):
    """Entry (t, k)'s expert id as int32, clamped to [-2, num_experts] first (ids of a wider
    type too), which keeps every bad id bad (no cast wraps one into range: 2**32 + 1 is not 1)
    and -1, an entry that names no expert, apart from them."""
    return T.Cast("int32", T.max(T.min(idx[t, k], num_experts), -2))


def _valid(e, num_experts):
    return T.And(e >= 0, e < num_experts)


def _bad(e, num_experts):
    """A clamped id out of range (-2 or num_experts): not -1 (no expert, as DeepEP's masked
    entries), nor a padding token's num_experts + 1."""
    return T.Or(e == -2, e == num_experts)


def _entries(own, i, topk, lo, hi):
    """Entries of chunk token i whose (clamped) ids are in [lo, hi) (unrolled over k)."""
    n = 0
    for k in range(topk):
        n = n + T.if_then_else(T.And(lo <= own[i, k], own[i, k] < hi), 1, 0)
    return n


def _earlier(own, i, k, e, topk):
    """Entries before k of chunk token i naming expert ``e`` (several only for repeated ids)."""
    n = 0
    for kk in range(topk - 1):
        n = n + T.if_then_else(T.And(kk < k, own[i, kk] == e), 1, 0)
    return n


def _earlier_chunks(counts, c, b, max_chunks):
    """``counts[0, b] + ... + counts[c - 1, b]``: unrolled over every chunk there may be, so
    that a thread's loads are all in flight at once (a loop would wait for each in turn)."""
    n = 0
    for i in range(max_chunks - 1):
        n = n + T.if_then_else(i < c, counts[i, b], 0)
    return n


@T.macro
def _totals(world, num_experts, total, b, send_counts, expert_counts, bad):
    """Store bin ``b``'s count over all tokens (``total``) where it belongs."""
    if b < world:
        send_counts[b] = total
    if T.And(b >= world, b < world + num_experts):
        expert_counts[b - world] = total
    if b == world + num_experts:
        bad[0] = total


@jit
def route_count_kernel(world: int, chunk: int, max_chunks: int, topk: int, num_experts: int,
                       id_dtype: str = "int32"):
    """Routing within each chunk of tokens (``route_class``), one block per chunk and group of
    ``GROUP_BINS`` bins (bins: ranks, then experts, then ids out of range): where each token
    goes and each entry's order, counted from the chunk's first token; and each chunk's count
    per bin (``counts[c, b]``), from which :func:`route_finish_kernel` adds what earlier
    chunks hold. A single chunk's values are final: this kernel then also writes the totals.

    Outputs (pair ``[r, t]``: token t, rank r): ``dest`` (r where token t goes to rank r, else
    -1), ``slot`` (its order among this rank's tokens going to r, token order), ``expert_slot``
    (entry (t, k)'s order among this rank's entries naming its expert, (token, k) order; -1 for
    ids outside [0, num_experts), which are routed nowhere), ``ids`` (the int32 ids the
    dispatch sends, -1 for those); totals: ``send_counts[r]``, ``expert_counts[e]``, ``bad[0]``
    (ids out of range, also stored at host address ``bad_host`` where it is not 0: a pinned,
    device-mapped word the host watches). An id of -1 names no expert (DeepEP's masked entry):
    routed nowhere like a bad id, but not counted as one. ``topk_idx`` is read as passed (``id_dtype``: int32
    or int64), so the caller's ids need no conversion kernel. Every element of every output is
    written (the caller allocates them unfilled).

    The token count is a dynamic size (at least 1, at most ``chunk * max_chunks``; the caller
    routes no tokens without a kernel): one kernel per class of counts (``route_class``).

    Args:
        world: Ranks of the group.
        chunk: Tokens per block (``route_class``).
        max_chunks: The most chunks (``route_class``); 1: a single chunk, whose values are final.
        topk: Experts per token.
        num_experts: Experts over the whole group.
        id_dtype: ``"int32"`` (default) or ``"int64"``, the dtype of ``topk_idx``.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    tokens = T.dynamic("tokens")
    chunks = T.ceildiv(tokens, chunk)
    bins = world + num_experts + 1
    per_rank = num_experts // world
    final = max_chunks == 1

    @T.prim_func
    def main(topk_idx: T.Tensor((tokens, topk), id_dtype), dest: T.Tensor((world, tokens), "int32"),
             slot: T.Tensor((world, tokens), "int32"), send_counts: T.Tensor((world,), "int32"),
             expert_slot: T.Tensor((tokens, topk), "int32"), expert_counts: T.Tensor((num_experts,), "int32"),
             bad: T.Tensor((1,), "int32"), ids: T.Tensor((tokens, topk), "int32"),
             counts: T.Tensor((max_chunks, bins), "int32"), bad_host: T.int64):
        with T.Kernel(T.ceildiv(bins, GROUP_BINS), chunks, threads=min(512, THREADS_PER_TOKEN * chunk)) as (g, c):
            own = T.alloc_shared((chunk, topk), "int32")  # the chunk's ids, clamped; past the last token: none
            hits = T.alloc_shared((GROUP_BINS, chunk), "int32")  # per bin of the group and token, then its prefix
            lo = g * GROUP_BINS
            for i, k in T.Parallel(chunk, topk):
                own[i, k] = T.if_then_else(c * chunk + i < tokens,
                                           _id(topk_idx, T.min(c * chunk + i, tokens - 1), k, num_experts),
                                           num_experts + 1)
            if g == 0:
                for i, k in T.Parallel(chunk, topk):
                    if c * chunk + i < tokens:
                        ids[c * chunk + i, k] = T.if_then_else(_valid(own[i, k], num_experts), own[i, k], -1)
                    if c * chunk + i < tokens and T.Or(own[i, k] < 0, own[i, k] >= num_experts):
                        expert_slot[c * chunk + i, k] = -1  # bad or no expert: no entry anywhere
            T.fill(hits, 0)
            # Each entry marks its bins for its token: 1 for its rank, its expert's entries in
            # the token for its expert; entries of one token mark a bin alike.
            for i, k in T.Parallel(chunk, topk):
                e = own[i, k]
                if _valid(e, num_experts) and lo <= e // per_rank and e // per_rank < lo + GROUP_BINS:
                    hits[e // per_rank - lo, i] = 1
                if _valid(e, num_experts) and lo <= world + e and world + e < lo + GROUP_BINS:
                    hits[world + e - lo, i] = _entries(own, i, topk, e, e + 1)
                if _bad(e, num_experts) and lo <= world + num_experts and world + num_experts < lo + GROUP_BINS:
                    hits[world + num_experts - lo, i] = (_entries(own, i, topk, -2, -1)
                                                         + _entries(own, i, topk, num_experts, num_experts + 1))
            T.cumsum(src=hits, dim=1)  # inclusive, along the chunk's tokens
            for b in T.Parallel(GROUP_BINS):
                if lo + b < bins:
                    counts[c, lo + b] = hits[b, chunk - 1]
            if final:
                for b in T.Parallel(GROUP_BINS):
                    _totals(world, num_experts, hits[b, chunk - 1], lo + b, send_counts, expert_counts, bad)
                if bad_host != 0 and lo <= bins - 1 and bins - 1 < lo + GROUP_BINS:
                    T.make_tensor_from_addr(bad_host, [1], "int32")[0] = hits[bins - 1 - lo, chunk - 1]
            for b, i in T.Parallel(GROUP_BINS, chunk):  # rank lo + b
                goes = _entries(own, i, topk, (lo + b) * per_rank, (lo + b + 1) * per_rank) > 0
                if c * chunk + i < tokens and lo + b < world:
                    dest[lo + b, c * chunk + i] = T.if_then_else(goes, lo + b, -1)
                if c * chunk + i < tokens and lo + b < world:
                    slot[lo + b, c * chunk + i] = T.if_then_else(goes, hits[b, i] - 1, -1)
            for i, k in T.Parallel(chunk, topk):
                e = own[i, k]
                if (c * chunk + i < tokens and _valid(e, num_experts)
                        and lo <= world + e and world + e < lo + GROUP_BINS):
                    expert_slot[c * chunk + i, k] = (hits[world + e - lo, i] - _entries(own, i, topk, e, e + 1)
                                                     + _earlier(own, i, k, e, topk))

    return main


@jit
def route_finish_kernel(world: int, chunk: int, topk: int, num_experts: int):
    """The second routing kernel, for more than one chunk: each chunk's block adds to its
    tokens' ``slot`` and ``expert_slot`` what earlier chunks hold of their bins (the sum of
    their ``counts`` rows); the last chunk's block writes the totals (``send_counts``,
    ``expert_counts``, ``bad``, and the bad-id count at host address ``bad_host`` where that
    is not 0). Arguments as :func:`route_count_kernel`'s (``MAX_CHUNKS`` rows of ``counts``).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    tokens = T.dynamic("tokens")
    chunks = T.ceildiv(tokens, chunk)
    bins = world + num_experts + 1
    padded = 32 * -(-bins // 32)  # whole warps of bins (the layout of a ragged count does not lower)

    @T.prim_func
    def main(slot: T.Tensor((world, tokens), "int32"), send_counts: T.Tensor((world,), "int32"),
             expert_slot: T.Tensor((tokens, topk), "int32"), expert_counts: T.Tensor((num_experts,), "int32"),
             bad: T.Tensor((1,), "int32"), ids: T.Tensor((tokens, topk), "int32"),
             counts: T.Tensor((MAX_CHUNKS, bins), "int32"), bad_host: T.int64):
        with T.Kernel(chunks, threads=THREADS) as c:
            base = T.alloc_shared((padded,), "int32")  # what chunks before c hold of each bin
            for b in T.Parallel(padded):
                base[b] = _earlier_chunks(counts, c, T.min(b, bins - 1), MAX_CHUNKS)
            if c == chunks - 1:
                for b in T.Parallel(padded):
                    _totals(world, num_experts, base[b] + counts[c, T.min(b, bins - 1)], b, send_counts, expert_counts,
                            bad)
                if bad_host != 0:
                    T.make_tensor_from_addr(bad_host, [1], "int32")[0] = base[bins - 1] + counts[c, bins - 1]
            for r, i in T.Parallel(world, chunk):
                if c * chunk + i < tokens and slot[r, T.min(c * chunk + i, tokens - 1)] >= 0:
                    slot[r, c * chunk + i] = slot[r, c * chunk + i] + base[r]
            for i, k in T.Parallel(chunk, topk):
                if c * chunk + i < tokens and ids[T.min(c * chunk + i, tokens - 1), k] >= 0:
                    expert_slot[c * chunk + i, k] = (expert_slot[c * chunk + i, k]
                                                     + base[world + ids[c * chunk + i, k]])

    return main


def routes_in_dispatch(capacity: int) -> bool:
    """Whether the dispatch kernel routes its own tokens (:func:`route_block`) instead of the
    routing kernels running first: where a rank sends at most ``DECODE_TOKENS`` tokens (every
    token's ids fit a block's shared memory), which saves a kernel launch per call.

    Args:
        capacity: The most tokens a rank sends (the buffer's ``max_tokens``).

    Returns:
        bool: True where the dispatch kernel routes.
    """
    return capacity <= DECODE_TOKENS


@T.macro
def route_block(topk_idx, held, b, chunk, world, num_experts, dest, slot, send_counts, expert_slot, expert_counts,
                bad, ids, bad_host):
    """The routes of dispatch block ``b``'s own tokens ``b * chunk ..`` (``dest``, ``slot``,
    ``expert_slot``, ``ids``, as :func:`route_count_kernel` defines them), and what the block
    sends first: block b < world, rank b's totals (``send_counts[b]`` and its experts'
    ``expert_counts``); block 0, the bad-id count (``bad``, and at host address ``bad_host``
    where it is not 0). Every block reads every token's ids (at most ``DECODE_TOKENS`` x topk,
    :func:`routes_in_dispatch`) and counts what it needs from them, so no block waits for
    another. The caller syncs the block before reading what this writes.

    Args:
        topk_idx: (held, topk) expert ids as passed (int32 or int64).
        held: This rank's tokens (a dynamic size, at least 1).
        b: The block's index.
        chunk: Tokens per block.
        world: Ranks of the group.
        num_experts: Experts over the whole group.
        dest, slot, send_counts, expert_slot, expert_counts, bad, ids: The routes, written here.
        bad_host: A pinned host word's address for the bad-id count, or 0.
    """
    capacity, topk = DECODE_TOKENS, topk_idx.shape[1]  # tiles of the class's most tokens, as its one routing chunk
    per_rank = num_experts // world
    own = T.alloc_shared((capacity, topk), "int32")  # every token's clamped ids; past the last token: none
    upto = T.alloc_shared((world, capacity), "int32")  # tokens up to each going to each rank
    before = T.alloc_shared((topk, capacity), "int32")  # one token's: earlier entries naming its entries' experts
    hist = T.alloc_shared((per_rank,), "int32")  # rank b's experts' entries (b < world)
    found = T.alloc_shared((1,), "int32")  # bad ids (block 0)
    for t, k in T.Parallel(capacity, topk):
        own[t, k] = T.if_then_else(t < held, _id(topk_idx, T.min(t, held - 1), k, num_experts), num_experts + 1)
    for r, t in T.Parallel(world, capacity):
        upto[r, t] = T.if_then_else(_entries(own, t, topk, r * per_rank, (r + 1) * per_rank) > 0, 1, 0)
    T.cumsum(src=upto, dim=1)  # inclusive, along the tokens
    for i in T.serial(chunk):
        if b * chunk + i < held:
            for r in T.Parallel(world):
                dest[r, b * chunk + i] = T.if_then_else(
                    _entries(own, b * chunk + i, topk, r * per_rank, (r + 1) * per_rank) > 0, r, -1)
                slot[r, b * chunk + i] = T.if_then_else(
                    _entries(own, b * chunk + i, topk, r * per_rank, (r + 1) * per_rank) > 0,
                    upto[r, b * chunk + i] - 1, -1)
            for k, u in T.Parallel(topk, capacity):
                before[k, u] = T.if_then_else(
                    u < b * chunk + i,
                    _entries(own, u, topk, own[b * chunk + i, k], own[b * chunk + i, k] + 1), 0)
            T.cumsum(src=before, dim=1)
            for k in T.Parallel(topk):
                ids[b * chunk + i, k] = T.if_then_else(_valid(own[b * chunk + i, k], num_experts),
                                                       own[b * chunk + i, k], -1)
                expert_slot[b * chunk + i, k] = T.if_then_else(
                    _valid(own[b * chunk + i, k], num_experts),
                    before[k, capacity - 1] + _earlier(own, b * chunk + i, k, own[b * chunk + i, k], topk), -1)
    if b < world:
        T.fill(hist, 0)
        for t, k in T.Parallel(capacity, topk):
            if b * per_rank <= own[t, k] and own[t, k] < (b + 1) * per_rank:
                T.atomic_add(hist[own[t, k] - b * per_rank], 1)
        for e in T.Parallel(per_rank):
            expert_counts[b * per_rank + e] = hist[e]
        send_counts[b] = upto[b, capacity - 1]
    if b == 0:
        T.fill(found, 0)
        for t, k in T.Parallel(capacity, topk):
            if _bad(own[t, k], num_experts):
                T.atomic_add(found[0], 1)
        bad[0] = found[0]
        if bad_host != 0:
            T.make_tensor_from_addr(bad_host, [1], "int32")[0] = found[0]


@dataclass(frozen=True)
class Routing:
    """The routing kernels of one shape: :func:`route_count_kernel`, then (more than one chunk)
    :func:`route_finish_kernel`. Called with the count kernel's arguments."""

    count: Callable
    finish: Callable | None

    def __call__(self, topk_idx: torch.Tensor, dest: torch.Tensor, slot: torch.Tensor, send_counts: torch.Tensor,
                 expert_slot: torch.Tensor, expert_counts: torch.Tensor, bad: torch.Tensor, ids: torch.Tensor,
                 counts: torch.Tensor, bad_host: int) -> None:
        self.count(topk_idx, dest, slot, send_counts, expert_slot, expert_counts, bad, ids, counts, bad_host)
        if self.finish is not None:
            self.finish(slot, send_counts, expert_slot, expert_counts, bad, ids, counts, bad_host)


def router(world: int, tokens: int, topk: int, num_experts: int, id_dtype: str = "int32",
            group: object = None) -> Routing:
    """The routing kernels for ``tokens`` tokens (at least 1), built for ``group``'s size: those
    of their class (``route_class``), which route any count of the class.

    Example::

        route = router(world, tokens, topk, num_experts, "int64")
        counts = torch.empty(chunk_counts_shape(world, tokens, num_experts), dtype=torch.int32)
        route(topk_idx, dest, slot, send_counts, expert_slot, expert_counts, bad, ids, counts, 0)

    Args:
        world, topk, num_experts, id_dtype: as :func:`route_count_kernel`'s.
        tokens: This rank's tokens, at least 1 (``dest`` and ``slot`` are (world, tokens)).
        group: the process group the kernels are built for (None: the whole job).

    Returns:
        Routing: launches both kernels (one for a single chunk); ``counts`` is int32 scratch of
        :func:`chunk_counts_shape`.
    """
    chunk, max_chunks = route_class(tokens)
    count = route_count_kernel(world, chunk, max_chunks, topk, num_experts, id_dtype, group=group)
    several = max_chunks > 1
    return Routing(count, route_finish_kernel(world, chunk, topk, num_experts, group=group) if several else None)


def expert_ids(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The expert ids as the routing kernel reads them: int32 and int64 ids as passed (the
    kernel clamps and casts them, the one check of id values), other integer types widened
    to one of those, keeping every value (TypeError for other dtypes).

    Args:
        topk_idx: (tokens, topk) expert ids of any integer dtype.
        num_experts: Experts over the whole group (the routing kernel checks ids against it).

    Returns:
        torch.Tensor: ``topk_idx`` contiguous if int32 or int64, else converted to :func:`id_dtype`.

    Raises:
        TypeError: ``topk_idx`` is not of an integer dtype.
    """
    read_as = id_dtype(topk_idx.dtype)
    return topk_idx.contiguous() if read_as == topk_idx.dtype else topk_idx.to(read_as)  # uint64 past 2**63: bad


@functools.cache
def id_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the routing kernel reads expert ids of ``dtype`` as: int32 and int64 as they are,
    other integer types the one of those that keeps every value (once per dtype).

    Raises:
        TypeError: ``dtype`` is not an integer dtype.
    """
    if dtype in (torch.int32, torch.int64):
        return dtype
    return torch.int64 if _wider_than_int32(dtype) else torch.int32


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


def watch_ids(idx: torch.Tensor, num_experts: int, bad: torch.Tensor | None = None) -> int:
    """Queue the device's id check of a call, without waiting for it.

    On GPUs, before the call: the routing kernel stores its count straight into a pinned host
    word that holds -1 until then (a 4-byte store, seen whole): no copy, no event. On the CPU
    path, after the call (the kernel has run by the time it returns): ``bad`` is read as it is.

    Args:
        idx: The call's expert ids as passed (kept for the error message).
        num_experts: Experts over the whole group.
        bad: The CPU path: the (1,) int32 count of out-of-range ids the routing kernel wrote.

    Returns:
        int: The host word's address for the routing kernel's ``bad_host`` (0 on the CPU
        path); :func:`raise_bad_ids` raises for the check once the count has landed.
    """
    if bad is not None:
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


def withdraw_watch() -> None:
    """Forget the check :func:`watch_ids` queued last: its call launched nothing (a direct call
    that missed, ``tilescale.op_launch.Direct``), so no kernel will store its count."""
    check = _id_checks.pop()
    if check.host is not None:
        _spare.append((check.host, check.bad))


def raise_bad_ids() -> None:
    """Raise for the first finished id check that found ids out of range (finished checks are dropped)."""
    while _id_checks and _id_checks[0].bad[0] >= 0:
        check = _id_checks.pop(0)
        found = int(check.bad[0])
        if check.host is not None:
            _spare.append((check.host, check.bad))
        if found:
            low, high = int(check.idx.min()), int(check.idx.max())
            raise ValueError(f"moe_dispatch: rank {runtime.rank()}: expert ids must be in [0, {check.num_experts}) "
                             f"or -1 (no expert); got {low}..{high} ({found} out of range, not sent)")
