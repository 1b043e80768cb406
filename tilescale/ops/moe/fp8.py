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

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import torch

import tilescale.language as T
from tilescale.jit import jit
from tilescale.op_launch import View
from tilescale.ops._common import check_input, tl_dtype

# A dispatch's rows: a tensor, or FP8 rows as a (values, scales) pair.
Rows = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
# Channels per scale, and e4m3's largest finite value (DeepEP's per-token, per-128-channel scaling).
BLOCK = 128
E4M3_MAX = 448.0
# Rows of a quantising block (each block one 128-channel scale group of them) and its threads.
QUANT_ROWS, QUANT_THREADS = 32, 128
_FP8 = "float8_e4m3fn"


@jit
def quantize_fp8_kernel(hidden: int, dtype: str, round_scale: bool = False):
    """Rows of ``x`` to packed FP8 rows in one pass: per row and 128-channel group, the scale
    ``max(amax, 1e-4) / 448`` (``round_scale``: rounded up to a power of two) and the values
    ``x / scale`` rounded to e4m3 (float32, IEEE division, round to nearest even).

    Args:
        hidden: Channels of a row, a multiple of 128 (the rows: any number, a dynamic size).
        dtype: TileLang dtype of ``x``.
        round_scale: Scales as powers of two (``2 ** ceil(log2(scale))``).

    Returns:
        The kernel's ``T.prim_func`` (``x``, then the packed rows viewed as e4m3 values and as
        float32 words); a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    width = packed_width(hidden)
    tokens = T.dynamic("tokens")

    @T.prim_func
    def main(x: T.Tensor((tokens, hidden), dtype), values: T.Tensor((tokens, width), _FP8),
             words: T.Tensor((tokens, width // 4), "float32")):
        with T.Kernel(hidden // BLOCK, T.ceildiv(tokens, QUANT_ROWS), threads=QUANT_THREADS) as (g, by):
            tile = T.alloc_fragment((QUANT_ROWS, BLOCK), "float32")
            scale = T.alloc_fragment((QUANT_ROWS,), "float32")
            for i, c in T.Parallel(QUANT_ROWS, BLOCK):  # rows past the last: zeros, never stored
                tile[i, c] = T.if_then_else(by * QUANT_ROWS + i < tokens,
                                            T.cast(x[T.min(by * QUANT_ROWS + i, tokens - 1), g * BLOCK + c], "float32"),
                                            T.float32(0))
            T.reduce_absmax(tile, scale, dim=1)
            for i in T.Parallel(QUANT_ROWS):
                scale[i] = T.max(scale[i], T.float32(1e-4)) / T.float32(E4M3_MAX)
            if round_scale:
                for i in T.Parallel(QUANT_ROWS):
                    scale[i] = T.exp2(T.ceil(T.log2(scale[i])))
            for i, c in T.Parallel(QUANT_ROWS, BLOCK):
                if by * QUANT_ROWS + i < tokens:
                    values[by * QUANT_ROWS + i, g * BLOCK + c] = T.cast(tile[i, c] / scale[i], _FP8)
            for i in T.Parallel(QUANT_ROWS):
                if by * QUANT_ROWS + i < tokens:
                    words[by * QUANT_ROWS + i, hidden // 4 + g] = scale[i]

    return main


def quantize_fp8(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` as e4m3 values with one float32 scale per 128 channels.

    One pass, one kernel (:func:`quantize_fp8_kernel`, compiled once per hidden size, dtype
    and ``round_scale``), computing in float32 with IEEE division what this torch expression
    states::

        blocks = x.float().view(tokens, hidden // 128, 128)
        scales = blocks.abs().amax(-1).clamp(min=1e-4) / 448     # a block of zeros: a tiny scale, values 0
        if round_scale:                                          # DeepEP's round_scale (UE8M0-ready scales)
            scales = torch.exp2(torch.ceil(torch.log2(scales)))
        values = (blocks / scales[..., None]).view(tokens, hidden).to(torch.float8_e4m3fn)

    (The same bits as that expression on the CPU, and on a GPU with 448 as a tensor; given
    the Python scalar, torch's CUDA division multiplies by its reciprocal, so its scales can
    be one float32 ulp off and a few values in 10^4 one e4m3 step: equally valid pairs.)

    Args:
        x: (tokens, hidden) floating rows on this rank's device, hidden a multiple of 128.
        round_scale: Round each scale up to a power of two (DeepEP's ``round_scale``: scales an
            8-bit exponent holds, as DeepGEMM's UE8M0 kernels take them). A block's largest value
            then maps into (224, 448] instead of to 448: e4m3's relative precision is the same,
            its range one power of two shorter at the small end.

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
    x = x.contiguous()
    check_input(x, "x")
    rows = torch.empty(tokens, packed_width(hidden), dtype=torch.uint8, device=x.device)
    if tokens:
        quantize_fp8_kernel(hidden, tl_dtype(x), round_scale)(x, *kernel_views(rows))
    return unpack(rows, hidden)


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
    rows = marked_rows(x)
    if rows is not None:
        return rows
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


def marked_rows(x: tuple) -> torch.Tensor | None:
    """The byte rows a pair is views of, as :func:`unpack` made them (no in-place reshape since);
    None for any other pair."""
    values, scales = x
    marked = getattr(values, "_ts_rows", None)
    if marked is not None and getattr(scales, "_ts_rows", None) is marked and _layout(values, scales) == marked[1]:
        return marked[0]
    return None


def kernel_views(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed byte rows as the FP8 kernels take them: the same bytes as e4m3 values and as
    float32 words (no copy; the scales are the words past ``hidden // 4``).

    Args:
        rows: (rows, packed_width(hidden)) uint8 rows (:func:`pack`).

    Returns:
        tuple[torch.Tensor, torch.Tensor]: (rows, width) ``float8_e4m3fn`` and (rows, width // 4) float32 views.
    """
    return rows.view(torch.float8_e4m3fn), rows.view(torch.float32)


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
    return mark(rows, rows[:, :hidden].view(torch.float8_e4m3fn), rows[:, hidden:].view(torch.float32))


def pair_views(of: int, rows: int, hidden: int) -> list[View]:
    """The ``(values, scales)`` of an ``OpLaunch`` call's output ``of``, (rows, packed_width(hidden))
    bytes, as views the call makes with its outputs (no view op per call): :func:`unpack`'s layout.

    Example::

        OpLaunch(steps, [Output((rows, packed_width(hidden)), torch.uint8)], views=pair_views(0, rows, hidden))
    """
    width = packed_width(hidden)
    return [View(of, (rows, hidden), torch.float8_e4m3fn, (width, 1)),
            View(of, (rows, hidden // BLOCK), torch.float32, (width // 4, 1), hidden // 4)]


def mark(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
         layout: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``, views of the packed ``rows`` as :func:`unpack` lays them out, marked
    so that :func:`pack` gives ``rows`` back at once while both keep this layout (the checks of
    any other pair cost several microseconds of each dispatch's host time); a tensor made from
    either view has no such mark. ``layout``: the views' layout where the caller knows it
    (:func:`pair_layout`; None: read from them)."""
    values._ts_rows = scales._ts_rows = (rows, _layout(values, scales) if layout is None else layout)
    return values, scales


def pair_layout(rows: int, hidden: int) -> tuple:
    """The layout (:func:`_layout`'s) of the views :func:`pair_views` makes of ``rows`` packed rows
    of ``hidden`` channels in an allocation of their own (storage offset 0): known before the views
    are, so a call that makes them need not read it back from them."""
    values, scales = pair_views(0, rows, hidden)
    return (values.shape, values.strides, values.offset, scales.shape, scales.strides, scales.offset)


def _layout(values: torch.Tensor, scales: torch.Tensor) -> tuple:
    """What an in-place reshape (``t_``, ``as_strided_``, ...) of an FP8 pair's views would change."""
    return (values.shape, values.stride(), values.storage_offset(),
            scales.shape, scales.stride(), scales.storage_offset())
