"""FP8 rows for the dispatch, in DeepEP's layout: e4m3 values and one float32 scale per 128 channels.

Example::

    x_fp8, scales = ts.ops.moe.quantize_fp8(x)                 # (tokens, hidden), (tokens, hidden // 128)
    recv, recv_w, counts, handle = ts.ops.moe_dispatch((x_fp8, scales), topk_idx, topk_w, num_experts)
    recv_fp8, recv_scales = recv                               # grouped as bf16 rows are
    h = ts.ops.grouped_gemm(recv_fp8, w1, handle.row_expert, scales=recv_scales)

The dispatch moves each token's e4m3 values and scales as one row of bytes (``hidden * 33 /
32`` bytes against ``2 * hidden`` for bf16) through the same kernel; the grouped result is
handed back as two views of that byte tensor, without a copy. ``quantize_fp8`` writes its
pair in that layout too, so the dispatch reads it where it is; a pair of separate tensors is
packed into it first (one copy of the rows). Combine stays bf16.
"""

from __future__ import annotations

import torch

# A dispatch's rows: a tensor, or FP8 rows as a (values, scales) pair.
Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# Channels per scale, and e4m3's largest finite value (DeepEP's per-token, per-128-channel scaling).
BLOCK = 128
E4M3_MAX = 448.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` as e4m3 values with one float32 scale per 128 channels.

    Args:
        x: (tokens, hidden) floating rows, hidden a multiple of 128.

    Returns:
        ``(values, scales)``: (tokens, hidden) ``torch.float8_e4m3fn`` and (tokens, hidden //
        128) float32, with ``x ~= values * scales`` per 128-channel block: views of one byte
        row per token, values then scales (:func:`unpack`; rows of ``packed_width(hidden)``
        bytes), which the dispatch moves as they are (no packing copy). ``.contiguous()``
        gives separate tensors.
    """
    tokens, hidden = x.shape
    if hidden % BLOCK:
        raise ValueError(f"FP8 rows need hidden divisible by {BLOCK}, got {hidden}")
    values, scales = unpack(torch.empty(tokens, packed_width(hidden), dtype=torch.uint8, device=x.device), hidden)
    blocks = x.float().view(tokens, hidden // BLOCK, BLOCK)
    # A block of zeros keeps a tiny scale rather than 0 (no division by zero, values stay 0).
    scales.copy_(blocks.abs().amax(-1).clamp(min=1e-4) / E4M3_MAX)
    values.copy_((blocks / scales[..., None]).view(tokens, hidden))  # the cast to e4m3 as .to() makes it
    return values, scales


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``values * scales`` per 128-channel block, as ``dtype`` (the inverse of :func:`quantize_fp8`).

    Args:
        values: (rows, hidden) e4m3 values (any strides, e.g. a dispatch's grouped view).
        scales: (rows, hidden // 128) float32 scales.
        dtype: the result's dtype.

    Returns:
        (rows, hidden) contiguous ``dtype`` rows.
    """
    rows, hidden = values.shape
    if tuple(scales.shape) != (rows, hidden // BLOCK):
        raise ValueError(f"scales must be ({rows}, {hidden // BLOCK}), got {tuple(scales.shape)}")
    blocks = values.float().view(rows, hidden // BLOCK, BLOCK) * scales.float()[..., None]
    return blocks.view(rows, hidden).to(dtype)


def is_fp8(x: object) -> bool:
    """Whether a dispatch input is FP8 rows: a ``(values, scales)`` pair."""
    return isinstance(x, tuple)


def pack(x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """FP8 rows as one byte row per token (values, then scales): what the dispatch kernel moves.
    A pair that already is views of such rows (:func:`unpack`'s, e.g. a dispatch's output)
    gives those bytes back without a copy."""
    values, scales = x
    if values.dim() != 2 or values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise TypeError(f"FP8 rows are (values: float8_e4m3fn (tokens, hidden), scales: float32 (tokens, hidden // "
                        f"{BLOCK})), got {values.dtype} {tuple(values.shape)} and {scales.dtype}")
    if values.shape[1] % BLOCK or tuple(scales.shape) != (values.shape[0], values.shape[1] // BLOCK):
        raise ValueError(f"FP8 scales must be (tokens, hidden // {BLOCK}) for values {tuple(values.shape)}, "
                         f"got {tuple(scales.shape)}")
    n, hidden = values.shape
    width = packed_width(hidden)
    if (values.stride() == (width, 1) and scales.stride() == (width // 4, 1)
            and values.storage_offset() + hidden == scales.storage_offset() * 4
            and values.untyped_storage().data_ptr() == scales.untyped_storage().data_ptr()):
        return values.view(torch.uint8).as_strided((n, width), (width, 1))
    return torch.cat([values.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)


def packed_width(hidden: int) -> int:
    """Bytes of one packed FP8 row of ``hidden`` channels."""
    return hidden + 4 * (hidden // BLOCK)


def unpack(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of packed byte rows as ``(values, scales)``: no copy (rows keep the packed stride).

    Args:
        rows: (rows, packed_width(hidden)) uint8 rows (:func:`pack`).
        hidden: Channels per row.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: (rows, hidden) ``float8_e4m3fn`` values and (rows, hidden // 128)
        float32 scales, views of ``rows``.
    """
    return rows[:, :hidden].view(torch.float8_e4m3fn), rows[:, hidden:].view(torch.float32)
