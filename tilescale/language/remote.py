"""Remote tile copies: ``T.copy(src, dst, dst_pe=e)`` (put) and ``T.copy(src, dst, src_pe=e)`` (get).

Example::

    T.copy(tile, B[bx * 64, 0], dst_pe=peer)     # shared/fragment/global -> peer's B
    T.copy(B[bx * 64, 0], tile, src_pe=peer)     # peer's B -> shared/fragment/global

The remote side must be a global tensor argument of the kernel that the caller passes as a
symmetric tensor. The copy is TileLang's own ``T.copy`` on a view of the peer's copy,
built from the peer-address table that the kernel receives as a hidden argument, so the
remote side gets every lowering TileLang has (vectorised stores, TMA bulk copies,
pipelining) and offsets and peers may be runtime values.

``dst_cta``/``src_cta`` do the same between the shared-memory tiles of the blocks of a
thread-block cluster (see ``tilescale.language.cluster``).

Kernels built with ``build_options(remote=<a device lowering>)`` lower a remote copy to
calls of its block-level put or get (``tilescale.comm.base.DeviceLowering``) on this rank's
address of the symmetric tensor and the peer's global rank (``pes[pe]``, see
``BuildContext.global_pe``): one call per contiguous run that both sides share (one
for whole trailing dimensions, one per row otherwise), clipped where a tile hangs over a
tensor's end. Extents must be constants; a local side in registers (fragment, local) is
staged through a shared-memory tile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import tilelang.language as tl
import tvm
from tvm import tirx

from tilescale.language.cluster import peer_tile
from tilescale.language.scale import as_written, current_context


def check_remote(buf: tirx.Buffer, pe: int | tirx.PrimExpr, what: str) -> None:
    """Raise unless ``buf`` can live on other ranks and a constant ``pe`` is a rank of the job.

    Example::

        check_remote(flags, peer, "T.signal's flag")

    Args:
        buf: The kernel's tensor argument that a remote operation reaches; it is recorded as a
            symmetric argument of the kernel being built.
        pe: The peer rank. A constant (int or IntImm) is checked against the world size; a runtime
            expression is not.
        what: The operation's name, used in error messages (e.g. ``"T.copy destination"``).

    Raises:
        TypeError: ``buf`` is not a global buffer (only tensor arguments live on other ranks).
        IndexError: a constant ``pe`` is outside ``[0, world)``.
    """
    if buf.scope() != "global":
        raise TypeError(
            f"{what} '{buf.name}' is a {buf.scope()} buffer; only global tensor arguments of the "
            "kernel (passed as symmetric tensors) live on other ranks"
        )
    ctx = current_context()
    ctx.remote_args[buf.name] = buf
    if isinstance(pe, int) and not 0 <= pe < ctx.world:
        raise IndexError(f"{what} '{buf.name}': peer {pe} out of range for world size {ctx.world}")
    if isinstance(pe, tirx.IntImm) and not 0 <= pe.value < ctx.world:
        raise IndexError(f"{what} '{buf.name}': peer {pe.value} out of range for world size {ctx.world}")


def remote_buffer(buf: tirx.Buffer, pe: int | tirx.PrimExpr, what: str) -> tirx.Buffer:
    """A view of rank ``pe``'s copy of the symmetric kernel argument ``buf``.

    Args:
        buf: A global tensor argument of the kernel, passed as a symmetric tensor.
        pe: The peer rank whose copy to view (constant or runtime expression).
        what: The operation's name, used in error messages.

    Returns:
        tirx.Buffer: A buffer with ``buf``'s shape, dtype and strides at rank ``pe``'s address, read
        from the kernel's hidden peer-address table of ``buf``.

    Raises:
        TypeError, IndexError: as :func:`check_remote`.
    """
    check_remote(buf, pe, what)
    table = current_context().peer_table(buf)
    strides = list(buf.strides) if len(buf.strides) else None
    return tl.make_tensor_from_addr(table[as_written(pe)], list(buf.shape), str(buf.dtype), strides=strides)


def _rebased(region: Any, view: Callable[[tirx.Buffer], tirx.Buffer], what: str, noun: str) -> Any:
    """``region`` (a buffer, an element or a region of it) on the buffer ``view`` gives for its own."""
    if isinstance(region, tirx.Buffer):
        return view(region)
    if isinstance(region, tirx.BufferLoad):
        return tirx.BufferLoad(view(region.buffer), region.indices)
    if isinstance(region, tirx.BufferRegion):
        return tirx.BufferRegion(view(region.buffer), region.region)
    raise TypeError(f"{what} must be a {noun}, a {noun} element or a {noun} region; got {type(region).__name__}")


def _extents(region: Any) -> tuple[tirx.Buffer, list[tirx.PrimExpr], list[int] | None]:
    """(buffer, start indices, extents) of a copy operand; extents None for a single element."""
    if isinstance(region, tirx.Buffer):
        return region, [tirx.IntImm("int32", 0) for _ in region.shape], [_const(d, region) for d in region.shape]
    if isinstance(region, tirx.BufferRegion):
        return region.buffer, [r.min for r in region.region], [_const(r.extent, region.buffer) for r in region.region]
    if isinstance(region, tirx.BufferLoad):
        return region.buffer, list(region.indices), None
    raise TypeError(f"T.copy operands must be tensors, tensor elements or regions; got {type(region).__name__}")


def _const(extent: tirx.PrimExpr, buf: tirx.Buffer) -> int:
    if not isinstance(extent, (int, tirx.IntImm)):
        raise NotImplementedError(f"remote copy of '{buf.name}' through device calls needs constant extents, "
                                  f"got {extent}")
    return int(extent)


def _run(buf: tirx.Buffer, extents: list[int]) -> int:
    """Elements of the longest contiguous runs a box of ``extents`` splits into in row-major ``buf``."""
    if len(buf.strides):
        analyzer = tvm.arith.Analyzer()
        for i, stride in enumerate(buf.strides):
            row_major = math.prod(buf.shape[i + 1:]) if i + 1 < len(buf.shape) else 1
            if not analyzer.can_prove_equal(stride, row_major):
                raise NotImplementedError(f"T.copy through device calls: '{buf.name}' is not a row-major tensor")
    run = 1
    for extent, dim in zip(reversed(extents), reversed(buf.shape), strict=True):
        run *= extent
        if not (isinstance(dim, tirx.IntImm) and extent == dim.value):
            break
    return run


def _pointer(buf: tirx.Buffer, at: list[tirx.PrimExpr], extent: int, access: str) -> tirx.PrimExpr:
    """Address of ``buf[at]`` for ``extent`` elements (an access pointer: TileLang's storage passes
    see what it covers, where an ``address_of`` of a large shared tile breaks them)."""
    offset = 0
    for i, index in enumerate(at):
        offset = offset + index * math.prod(buf.shape[i + 1:]) if i + 1 < len(buf.shape) else offset + index
    return buf.access_ptr(access, offset=offset, extent=extent)


def _in_bounds(buf: tirx.Buffer, at: list[tirx.PrimExpr], extents: list[int], run: int) -> tirx.PrimExpr | None:
    """Elements of the run of ``run`` elements at ``buf[at]`` that lie inside ``buf`` (a tile may
    hang over a tensor's end, as TileLang's copies allow), or None when that is all of them."""
    k, inner = len(extents) - 1, 1
    while inner * extents[k] < run:  # the run covers whole dimensions k+1.. and part of dimension k
        inner *= extents[k]
        k -= 1
    analyzer = tvm.arith.Analyzer()
    limits = [(at[j] + (run // inner if j == k else 1), buf.shape[j]) for j in range(k + 1)]
    if all(analyzer.can_prove(end <= dim) for end, dim in limits):
        return None
    count = tl.max(tl.min(buf.shape[k] - at[k], run // inner), 0) * inner
    inside = [at[j] < buf.shape[j] for j in range(k) if not analyzer.can_prove(at[j] < buf.shape[j])]
    for condition in inside:
        count = tl.if_then_else(condition, count, 0)
    return count


def _unravel(offset: tirx.PrimExpr, extents: list[int]) -> list[tirx.PrimExpr]:
    """Indices of element ``offset`` of a box of ``extents``, row-major."""
    return [(offset // math.prod(extents[i + 1:])) % e for i, e in enumerate(extents)]


def _call_copy(src: Any, dst: Any, pe: int | tirx.PrimExpr, put: bool) -> tirx.PrimExpr | None:
    """A remote copy as block-level puts (``put``) or gets of the backend's device lowering: one
    per contiguous run of both sides, local registers staged through shared memory."""
    lowering = current_context().lowering
    (sbuf, smin, sext), (dbuf, dmin, dext) = _extents(src), _extents(dst)
    remote = dbuf if put else sbuf
    check_remote(remote, pe, "T.copy destination" if put else "T.copy source")
    if sext is None and dext is None:
        sext = dext = [1] * len(sbuf.shape)
    sext = sext if sext is not None else [1] * (len(sbuf.shape) - len(dext)) + dext[-len(sbuf.shape):]
    dext = dext if dext is not None else [1] * (len(dbuf.shape) - len(sext)) + sext[-len(dbuf.shape):]
    count = math.prod(sext)
    if count != math.prod(dext):
        raise ValueError(f"T.copy through device calls: {sbuf.name}{sext} and {dbuf.name}{dext} differ in size")
    # The library reads and writes its local side by address: registers go through a shared tile.
    stage = None
    local = sbuf if put else dbuf
    if local.scope() not in ("global", "shared", "shared.dyn"):
        extents = sext if put else dext
        stage = tl.alloc_shared(list(extents), str(local.dtype))
        whole = ([0] * len(extents), list(extents))
        if put:
            tl.evaluate(tl.copy(src, stage))
            sbuf, (smin, sext) = stage, whole
        else:
            dbuf, (dmin, dext) = stage, whole
    run = math.gcd(_run(sbuf, sext), _run(dbuf, dext))
    target = current_context().global_pe(pe)
    elem_bytes = tvm.DataType(str(sbuf.dtype)).bits // 8
    call = lowering.put if put else lowering.get

    def one(offset: tirx.PrimExpr) -> tirx.PrimExpr:
        s_at = [m + i for m, i in zip(smin, _unravel(offset, sext), strict=True)]
        d_at = [m + i for m, i in zip(dmin, _unravel(offset, dext), strict=True)]
        limits = [n for n in (_in_bounds(sbuf, s_at, sext, run), _in_bounds(dbuf, d_at, dext, run)) if n is not None]
        valid = run if not limits else limits[0] if len(limits) == 1 else tl.min(*limits)
        nbytes = valid * elem_bytes
        return tl.call_extern("handle", call, _pointer(dbuf, d_at, run, "w"), _pointer(sbuf, s_at, run, "r"),
                              nbytes, target)

    fetched = stage is not None and not put  # the get lands in the stage, then goes to the registers
    if count == run:
        transfer = one(tirx.IntImm("int32", 0))
        if not fetched:
            return transfer
        tl.evaluate(transfer)
    else:
        with tl.serial(count // run) as k:
            tl.evaluate(one(k * run))
    return tl.copy(stage, dst) if fetched else None


def copy(src: Any, dst: Any, *, dst_pe: int | tirx.PrimExpr | None = None,
         src_pe: int | tirx.PrimExpr | None = None, dst_cta: int | tirx.PrimExpr | None = None,
         src_cta: int | tirx.PrimExpr | None = None, **kwargs: Any) -> tirx.PrimExpr | tirx.Stmt:
    """TileLang's ``T.copy``, plus ``dst_pe``/``src_pe`` (put into / get from a peer rank) and
    ``dst_cta``/``src_cta`` (put into / get from another block of the thread-block cluster).

    Example::

        T.copy(A[bx * 64, 0], tile)                          # local, exactly TileLang's copy
        T.copy(tile, B[bx * 64, 0], dst_pe=(rank + 1) % world)
        T.copy(tile, inbox, dst_cta=(cta_rank + 1) % cluster_size)

    Other keywords (``disable_tma``, ``coalesced_width``, ...) pass through to TileLang.

    Args:
        src: The source: a buffer, one of its elements or a region (``A[i, j]``, ``A[0:64, :]``).
        dst: The destination, in the same forms.
        dst_pe: Rank to write into: ``dst`` is taken as that rank's copy of a symmetric tensor argument.
        src_pe: Rank to read from: ``src`` is taken as that rank's copy of a symmetric tensor argument.
        dst_cta: Block (rank in the cluster) whose shared tile ``dst`` is written; TMA is disabled.
        src_cta: Block (rank in the cluster) whose shared tile ``src`` is read; TMA is disabled.
        **kwargs: Passed to TileLang's ``T.copy``. At most one of the four remote keywords may be
            given; none gives TileLang's local copy.

    Returns:
        The copy statement TileLang's ``T.copy`` returns. Under a device lowering
        (``build_options(remote=...)``) a remote copy is the lowering's put/get call(s), emitted
        into the kernel body, and the return is the single call, a final register copy, or None.

    Raises:
        ValueError: more than one remote side given, or (device lowering) the two sides differ in size.
        TypeError: the remote side is not a global tensor argument (or a shared tile, for ``*_cta``).
        IndexError: a constant peer or block index is out of range.
    """
    remote = {k: v for k, v in (("dst_pe", dst_pe), ("src_pe", src_pe), ("dst_cta", dst_cta),
                                ("src_cta", src_cta)) if v is not None}
    if len(remote) > 1:
        raise ValueError(f"T.copy takes one remote side (dst_pe or src_pe, not both; or dst_cta or src_cta), got "
                         f"{', '.join(remote)}: one side of a copy is local")
    if (dst_pe is not None or src_pe is not None) and current_context().lowering is not None:
        return _call_copy(src, dst, dst_pe if dst_pe is not None else src_pe, put=dst_pe is not None)
    if dst_pe is not None:
        dst = _rebased(dst, lambda b: remote_buffer(b, dst_pe, "T.copy destination"), "T.copy destination", "tensor")
    elif src_pe is not None:
        src = _rebased(src, lambda b: remote_buffer(b, src_pe, "T.copy source"), "T.copy source", "tensor")
    elif dst_cta is not None or src_cta is not None:
        if dst_cta is not None:
            dst = _rebased(dst, lambda b: peer_tile(b, dst_cta, "T.copy destination"), "T.copy destination", "tile")
        else:
            src = _rebased(src, lambda b: peer_tile(b, src_cta, "T.copy source"), "T.copy source", "tile")
        # A bulk (TMA) copy would take the peer's shared memory for global memory.
        kwargs["disable_tma"] = True
    return tl.copy(src, dst, **kwargs)
