"""``all_gather_gemm``: the column-parallel GEMM whose gathered rows arrive while it runs,
moved by the copy engines or by SM pusher blocks (the package's docstring says how)."""

from collections.abc import Callable

import torch
import torch.distributed as dist

from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.jit import kernel_lowering
from tilescale.language.scale import ADDRESS
from tilescale.op_launch import OpLaunch
from tilescale.ops._common import (
    call_board,
    call_identity,
    check_same_across_ranks,
    op_plans,
    signature,
    tl_dtype,
)
from tilescale.ops._gemm import TileConfig
from tilescale.ops.tp_gemm.exchange import _exchange, _gather_exchange, _StreamWrites
from tilescale.ops.tp_gemm.kernels import ag_own_gemm_kernel, ag_peer_gemm_kernel, announce_kernel
from tilescale.ops.tp_gemm.plan import (
    AgreedLaunch,
    _cached_call,
    _check_pair,
    _choose,
    _fused_plan,
    _fused_wins,
    choose_push_blocks,
    choose_tile,
    chunk_tiles,
    gemm_alone,
)
from tilescale.plans import capturing
from tilescale.symmetric import peer_ptrs

_stream_writes: _StreamWrites | None = None

# A plan's per-call part: (a_shard, weight) -> the output, (world * M_local, N_local).
GatherLaunch = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _copy_engine_gather(state: GroupState, a_shard: torch.Tensor, weight: torch.Tensor, tile: TileConfig,
                        sig: int) -> GatherLaunch:
    """The all-gather GEMM with copies as producer, resolved once for ``a_shard``'s and ``weight``'s
    layout: its exchange, kernels, copies and flag addresses. Each call: on the main stream, the
    own segment's GEMM (:func:`ag_own_gemm_kernel`, no pushers) starts at once; meanwhile, on a
    high-priority side stream, :func:`announce_kernel` announces the call (``sig``: its signature
    on the call board, :func:`call_identity`) and this rank's rows go chunk by chunk into every
    peer's gather buffer (``rank - 1, rank - 2, ...``), each chunk followed by a stream-ordered
    write of the call's epoch to its flag there. The main stream then waits for those copies and
    runs the peers' segments (:func:`ag_peer_gemm_kernel`), whose tiles wait for their chunks and
    check the senders' announcements.

    Waiting for this rank's own copies before the waiting kernel is what keeps it free of
    deadlock whoever executes a copy (a device-to-device copy may run on SMs): the copies
    never wait for a kernel that waits, so every rank's rows arrive.

    A peer whose call differs is found by the peer kernels' waits, after the copies have
    landed: the copies are sized by this rank's shape, and cannot be checked before they are
    issued without a round trip. They stay in bounds because they only ever write the peer's
    copy of this rank's own exchange: a symmetric allocation, the same size on every rank
    (``symmetric.empty`` checks that), keyed by everything that sizes or places a copy (rows
    padded, K, dtype, tile height, chunk), and a copy covers at most ``padded`` rows of this
    rank's segment of one buffer set. A peer running another shape does not read that
    exchange in this call, and one running the same exchange (rows padded alike) gets the
    announcement, with a different signature, before the flags: ShapeMismatchError.
    """
    global _stream_writes
    world, rank, group = state.size, state.rank, state.process_group
    (m, k), n = a_shard.shape, weight.shape[0]
    bm, dtype = tile.block_M, tl_dtype(a_shard)
    padded = -(-m // bm) * bm
    own = ag_own_gemm_kernel(world, dtype, m, padded, k, n, 0, tile, group=group)
    # Each segment's tiles are clipped at its end: the output's rows need no copy.
    own_call = OpLaunch([(own, lambda t, o, s: (*t, o[0].view(world, m, n)))], [(world * m, n)], group=group)
    if world == 1:  # nothing to gather, no peer to agree with
        return lambda a_shard, weight: own_call((a_shard, weight))
    per_copy = chunk_tiles(padded // bm, k, bm, a_shard.element_size())
    chunks = -(-(padded // bm) // per_copy)
    ex = _gather_exchange(state, ("ag-ce", padded, k, a_shard.dtype, bm, per_copy), world * padded, k, a_shard.dtype,
                          world * chunks)
    peers = ag_peer_gemm_kernel(world, dtype, m, padded, k, n, per_copy, tile, "epoch", group=group)
    announce = announce_kernel(world, group=group)
    on_gpu = ex.stream is not None
    if on_gpu:
        _stream_writes = _stream_writes or _StreamWrites()
    # Per copy: the rows it sends, its destination in each buffer set (calls alternate) and its flag
    # (an address for a stream-ordered write on GPUs, the peer's flags and the index on the CPU path).
    copies = []
    for step in range(1, world):
        peer = (rank - step) % world
        for c in range(chunks):
            rows = slice(c * per_copy * bm, min(m, (c + 1) * per_copy * bm))
            dsts = [ex.peer_buffers[peer][s * world * padded + rank * padded + rows.start:
                                          s * world * padded + rank * padded + rows.stop] for s in (0, 1)]
            index = rank * chunks + c
            flag = ex.peer_flags[peer].data_ptr() + index * ex.flags.element_size() if on_gpu else \
                (ex.peer_flags[peer], index)
            copies.append((rows, dsts, flag))
    gathered = [ex.buffers[s * world * padded:(s + 1) * world * padded] for s in (0, 1)]

    def launch(a_shard: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ident = call_identity(state, sig)  # every call: the peer kernel checks the ranks agree on it
        ex.calls += 1
        epoch, buffer_set = ex.calls, ex.calls % 2
        if on_gpu:
            main = torch.cuda.current_stream()
            ex.stream.wait_stream(main)  # a_shard is ready, and the previous call is done with the buffers
            with torch.cuda.stream(ex.stream):  # before the own GEMM, so that it gets an SM before the GEMM takes all
                announce(*ident, group=group)
        else:
            announce(*ident, group=group)
        out = own_call((a_shard, weight))
        if on_gpu:
            with torch.cuda.stream(ex.stream):
                for rows, dsts, flag in copies:
                    dsts[buffer_set].copy_(a_shard[rows])
                    _stream_writes(ex.stream, flag, epoch)
            main.wait_stream(ex.stream)
        else:  # CPU path: each copy is done before its flag is set; stores reach the peer in order
            for rows, dsts, (flags, index) in copies:
                dsts[buffer_set].copy_(a_shard[rows])
                flags[index] = epoch
        peers(gathered[buffer_set], weight, out.view(world, m, n), ex.flags, epoch, *ident, group=group)
        return out

    return launch


def _sm_gather(state: GroupState, a_shard: torch.Tensor, weight: torch.Tensor, tile: TileConfig, push_blocks: int,
               sig: int) -> GatherLaunch:
    """The all-gather GEMM with SM pushers, resolved once for ``a_shard``'s and ``weight``'s
    layout (its exchange, peer tables and kernels: made outside any capture, so a CUDA graph
    can capture a call later). Each call: :func:`ag_own_gemm_kernel` (the pushers, which
    announce the call first, and the own segment), then :func:`ag_peer_gemm_kernel` (the
    peers' segments, counted flags, waits checking the announcements); ``sig``: the call's
    signature on the call board (:func:`call_identity`). Call counts and flag targets live
    on the device, so a CUDA graph can capture it. Pushers write only the peers' copies of
    this rank's own exchange, sized alike on every rank, so a peer whose call differs is
    never written out of bounds."""
    world, group = state.size, state.process_group
    (m, k), n = a_shard.shape, weight.shape[0]
    bm, dtype = tile.block_M, tl_dtype(a_shard)
    padded = -(-m // bm) * bm
    ex = _exchange(state, ("ag", padded, k, a_shard.dtype, bm), (world * padded, k), a_shard.dtype,
                   world * padded // bm)
    peer_ptrs(ex.buffers), peer_ptrs(ex.flags), peer_ptrs(call_board(state))  # peer tables
    board = call_board(state)
    # Each segment's tiles are clipped at its end: the output's rows need no copy. The peers'
    # kernel (none for one rank) follows in the same call.
    steps = [(ag_own_gemm_kernel(world, dtype, m, padded, k, n, push_blocks, tile, group=group),
              lambda t, o, s: (t[0], ex.buffers, t[1], o[0].view(world, m, n), ex.flags, ex.state, board, s[0]))]
    if world > 1:
        steps.append((ag_peer_gemm_kernel(world, dtype, m, padded, k, n, 1, tile, "state", group=group),
                      lambda t, o, s: (ex.buffers, t[1], o[0].view(world, m, n), ex.flags, ex.state, board, s[0])))
    return AgreedLaunch(OpLaunch(steps, [(world * m, n)], group=group), state, sig)


PRODUCERS = ("copy_engine", "sm")
# Each rank's rows from which the copy engines move them by default (eager, peers mapped). At
# 2 ranks (2026-11-27, producers interleaved in one run) the copy engines lost where rows were
# few: 1.6x the SM pushers' time at 6 MB per rank, 1.10-1.12x at 8 MB on 2x H200 and 2x H100,
# 1.02-1.03x at 15 MB; at 25-34 MB it went either way (0.98-1.03x); at 67 and 134 MB they won
# (0.99x, 0.95x on 2x H100): their fixed cost per ~8 MB chunk, host-issued copies and flag
# writes, pays off only where the GEMM runs long enough to need every SM.
COPY_ENGINE_MIN_BYTES = 48 << 20


def default_producer(row_bytes: int, capturing: bool, mapped: bool) -> str:
    """The producer an ``all_gather_gemm`` call takes when none is named.

    Example::

        default_producer(64 << 20, capturing=False, mapped=True)    # "copy_engine"
        default_producer(8 << 20, capturing=False, mapped=True)     # "sm"

    Args:
        row_bytes: This rank's rows (``a_shard``) in bytes.
        capturing: Whether the call is being captured in a CUDA graph (the copy engines' flag
            values are counted on the host: not capturable).
        mapped: Whether every peer's memory is mapped in this process (the copies need it).

    Returns:
        str: ``"copy_engine"`` for eager calls with mapped peers and at least
        ``COPY_ENGINE_MIN_BYTES`` of rows, else ``"sm"``.
    """
    return "copy_engine" if mapped and not capturing and row_bytes >= COPY_ENGINE_MIN_BYTES else "sm"


def all_gather_gemm(a_shard: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                    tile: TileConfig | None = None, push_blocks: int | None = None,
                    producer: str | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``all_gather(a_shard) @ weight.T`` with the gather overlapped with the GEMM.

    Example::

        y = ts.ops.all_gather_gemm(x_rows, w_cols)     # (world * rows, N_local)

    ``a_shard``: this rank's rows (M_local, K), the same shape on every rank; ``weight``:
    this rank's (N_local, K). ``tile``: the fused kernel's GEMM tile (:func:`choose_tile`).
    ``producer``: who moves the rows in the fused plan: ``"sm"`` (``push_blocks`` blocks of
    the GEMM kernel push the rows; counts its calls on the device, so it can be captured in a
    CUDA graph) or ``"copy_engine"`` (copies and flag writes on a side stream, the GEMM keeps
    every SM; eager calls only); None: :func:`default_producer`. ``group``: the
    tensor-parallel process group (None: the whole job); ``world`` is its size.

    Fused calls whose ranks differ (shapes, dtype, tile, producer) raise
    ``ts.ShapeMismatchError`` on every rank; zero rows on every rank give an empty result.

    Args:
        a_shard: This rank's rows, (M_local, K), the same shape on every rank.
        weight: This rank's weight columns, (N_local, K), ``a_shard``'s dtype.
        plan: ``"fused"`` (tilescale kernels), ``"unfused"`` (cuBLAS + NCCL) or None: then
            ``TILESCALE_TP_PLAN``, else unfused for a group of one rank (the GEMM alone), by the link
            arithmetic on GPUs and from ``FUSED_MIN_ROWS`` output rows on the CPU path.
        tile: The fused kernels' GEMM tile; None picks one with :func:`choose_tile`.
        push_blocks: Pushing blocks of the ``"sm"`` producer; None picks them per shape
            (:func:`choose_push_blocks`: 4 to 32, so that they leave the GEMM its waves).
        producer: ``"copy_engine"``, ``"sm"`` or None (:func:`default_producer`).
        group: The tensor-parallel process group; None is the whole job.

    Returns:
        torch.Tensor: (world * M_local, N_local), rank r's rows at ``[r * M_local:(r + 1) * M_local]``.

    Raises:
        TypeError: ``a_shard`` and ``weight`` differ in dtype, or the dtype is not supported (on GPUs
            the fused plan takes bfloat16 / float16: other dtypes run unfused by default).
        ValueError: not 2-D tensors with the same K, not contiguous on this rank's device, or an
            unknown ``plan``, ``push_blocks`` < 1, an unknown ``producer``, or ``"copy_engine"`` where the
            peers' memory is not mapped; or the ranks' shapes or dtype differ at a shape's first call
            (checked on the host).
        RuntimeError: ``producer="copy_engine"`` inside a CUDA graph capture.
        ts.ShapeMismatchError: a later fused call differs across ranks (checked on the device).
    """
    # Calls reuse its plan; a capture may take another producer than eager calls.
    key, out = _cached_call("all_gather_gemm", a_shard, weight, plan, tile, group, push_blocks, producer)
    if out is not None:
        return out
    in_capture = capturing(a_shard)
    _check_pair(a_shard, weight)
    if push_blocks is not None and push_blocks < 1:
        raise ValueError(f"push_blocks must be positive, got {push_blocks}")
    if producer not in (None, *PRODUCERS):
        raise ValueError(f"producer must be one of {PRODUCERS} or None, got {producer!r}")
    state = runtime.group_state(group)
    world = state.size
    (m, k), n = a_shard.shape, weight.shape[0]
    check_same_across_ranks(state, "all_gather_gemm", [m, k, n, str(a_shard.dtype)], every_call=m == 0)
    if m == 0:
        return a_shard.new_empty(0, n)
    tile = tile or choose_tile(m, n, kernels=(1, world - 1))
    padded = -(-m // tile.block_M) * tile.block_M
    seg_tiles = padded // tile.block_M * -(-n // tile.block_N)  # own segment, then the peers' in a second kernel
    wins = _fused_wins(2 * world * m * k * n, [seg_tiles, (world - 1) * seg_tiles],
                       (world - 1) * m * k * a_shard.element_size())
    if _choose(plan, world * m, wins, group, a_shard.dtype) == "unfused":
        if world == 1:
            return op_plans.put(key, gemm_alone)(a_shard, weight)

        def launch(a_shard: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            gathered = torch.empty(world * m, k, dtype=a_shard.dtype, device=a_shard.device)
            dist.all_gather_into_tensor(gathered, a_shard, group=group)
            return gathered @ weight.T

        return op_plans.put(key, launch)(a_shard, weight)
    # The copies need the peers' buffers mapped here (one node, no NVSHMEM calls).
    mapped = kernel_lowering(group) in (None, ADDRESS)
    producer = producer or default_producer(m * k * a_shard.element_size(), in_capture, mapped)
    if producer == "copy_engine":
        if in_capture:
            raise RuntimeError("all_gather_gemm(producer='copy_engine') cannot be captured in a CUDA graph: its flag "
                               "values are counted on the host; capture producer='sm' (the default in a capture)")
        if not mapped:
            raise ValueError("all_gather_gemm(producer='copy_engine') needs every peer's memory mapped in this "
                             "process; with NVSHMEM calls between the ranks use producer='sm' (the default there)")
    push_blocks = push_blocks or choose_push_blocks(m, k, n, world, tile, a_shard.element_size())
    sig = signature("all_gather_gemm", a_shard, f"N={n}", tile,
                    producer if producer == "copy_engine" else f"sm push_blocks={push_blocks}")
    if producer == "copy_engine":
        if a_shard.is_cuda:  # made now, so that a capture later finds the SM plan ready
            _sm_gather(state, a_shard, weight, tile, push_blocks, sig)
        gather = _copy_engine_gather(state, a_shard, weight, tile, sig)
    else:
        gather = _sm_gather(state, a_shard, weight, tile, push_blocks, sig)

    return _fused_plan(state, key, "all_gather_gemm", gather)(a_shard, weight)
