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
"""

from __future__ import annotations

from typing import Any

import tilelang.language as tl
from tvm import tirx

from tilescale.language.cluster import on_peer_cta
from tilescale.language.scale import current_context


def remote_buffer(buf: tirx.Buffer, pe: int | tirx.PrimExpr, what: str) -> tirx.Buffer:
    """A view of rank ``pe``'s copy of the symmetric kernel argument ``buf``."""
    if buf.scope() != "global":
        raise TypeError(
            f"{what} '{buf.name}' is a {buf.scope()} buffer; only global tensor arguments of the "
            "kernel (passed as symmetric tensors) live on other ranks"
        )
    ctx = current_context()
    if isinstance(pe, int) and not 0 <= pe < ctx.world:
        raise IndexError(f"{what} '{buf.name}': peer {pe} out of range for world size {ctx.world}")
    if isinstance(pe, tirx.IntImm) and not 0 <= pe.value < ctx.world:
        raise IndexError(f"{what} '{buf.name}': peer {pe.value} out of range for world size {ctx.world}")
    table = ctx.peer_table(buf)
    strides = list(buf.strides) if len(buf.strides) else None
    return tl.make_tensor_from_addr(table[pe], list(buf.shape), str(buf.dtype), strides=strides)


def _on_peer(region: Any, pe: int | tirx.PrimExpr, what: str) -> Any:
    if isinstance(region, tirx.Buffer):
        return remote_buffer(region, pe, what)
    if isinstance(region, tirx.BufferLoad):
        return tirx.BufferLoad(remote_buffer(region.buffer, pe, what), region.indices)
    if isinstance(region, tirx.BufferRegion):
        return tirx.BufferRegion(remote_buffer(region.buffer, pe, what), region.region)
    raise TypeError(f"{what} must be a tensor, a tensor element or a tensor region; got {type(region).__name__}")


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
    """
    remote = {k: v for k, v in (("dst_pe", dst_pe), ("src_pe", src_pe), ("dst_cta", dst_cta),
                                ("src_cta", src_cta)) if v is not None}
    if len(remote) > 1:
        raise ValueError(f"T.copy takes one remote side (dst_pe or src_pe, not both; or dst_cta or src_cta), got "
                         f"{', '.join(remote)}: one side of a copy is local")
    if dst_pe is not None:
        dst = _on_peer(dst, dst_pe, "T.copy destination")
    elif src_pe is not None:
        src = _on_peer(src, src_pe, "T.copy source")
    elif dst_cta is not None or src_cta is not None:
        if dst_cta is not None:
            dst = on_peer_cta(dst, dst_cta, "T.copy destination")
        else:
            src = on_peer_cta(src, src_cta, "T.copy source")
        # A bulk (TMA) copy would take the peer's shared memory for global memory.
        kwargs["disable_tma"] = True
    return tl.copy(src, dst, **kwargs)
