"""Gated activations of MoE experts, as one pass over the first GEMM's output.

Example::

    h = ts.ops.grouped_gemm(recv_x, w1, handle.row_expert)    # (rows, 2 * ffn): gate | up
    a = ts.ops.silu_and_mul(h)                                # (rows, ffn) = silu(gate) * up

Composed from torch ops (``silu(gate.float()) * up.float()``, cast back) the same result
takes five kernels and writes float32 twice; at an MoE layer's size (24576 rows, ffn 1408)
that is most of what the layer spends outside its GEMMs, dispatch and combine.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import torch

import tilescale.language as T
from tilescale.jit import jit
from tilescale.op_launch import MISSED, Direct, OpLaunch
from tilescale.ops._common import check_input, layout_key, tl_dtype
from tilescale.plans import PlanCache

# Each block: BLOCK_ROWS rows x BLOCK_COLS output columns, 16 elements a thread (vector loads
# of 16-bit values two 16-byte words wide).
BLOCK_ROWS = 8
BLOCK_COLS = 256
THREADS = 128

# A row count's calls: the first through the kernel's own call (a batch size seen once, as in
# prefill, teaches no launch), later ones through an OpLaunch (by layout of h), which learns its
# launch at its first two calls; then straight from C++ (op_launch.Direct: one site, a program
# per row count). Its own cache: a stream of row counts must not push other ops' plans out.
_launches = PlanCache()
_direct = Direct()
_SITE = ("silu_and_mul",)


def _silu(x):
    """``x * sigmoid(x)``."""
    return x * T.sigmoid(x)


@jit
def silu_and_mul_kernel(ffn: int, dtype: str):
    """``out[i, j] = silu(h[i, j]) * h[i, ffn + j]`` in float32, rounded once to ``dtype``.

    The row count is a dynamic size: one kernel serves every batch of rows.

    Args:
        ffn: Columns of ``out`` (``h`` has twice as many: the gate, then the up projection).
        dtype: TileLang dtype of ``h`` and ``out``.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    rows = T.dynamic("rows")

    @T.prim_func
    def main(h: T.Tensor((rows, 2 * ffn), dtype), out: T.Tensor((rows, ffn), dtype)):
        with T.Kernel(T.ceildiv(ffn, BLOCK_COLS), T.ceildiv(rows, BLOCK_ROWS), threads=THREADS) as (bx, by):
            for i, j in T.Parallel(BLOCK_ROWS, BLOCK_COLS):
                r, c = by * BLOCK_ROWS + i, bx * BLOCK_COLS + j
                if r < rows and c < ffn:
                    out[r, c] = T.cast(_silu(T.cast(h[r, c], "float32")) * T.cast(h[r, ffn + c], "float32"), dtype)

    return main


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Mixtral, Qwen-MoE, DeepSeek): ``silu(gate) * up`` of each row's halves.

    Example::

        a = ts.ops.silu_and_mul(h)   # h (rows, 2 * ffn) -> (rows, ffn)

    Computed in float32 and rounded once, as ``(silu(gate.float()) * up.float()).to(h.dtype)``
    (no autograd: for inference, or inside a function that defines its own backward). From a
    row count's fourth call on, a call goes straight to the launch learned at its second and
    third (``tilescale.op_launch.Direct``; 0.70-0.76x the host-time budget of 1.3 torch launches
    on one H100, README "Eager host cost").

    Args:
        h: (rows, 2 * ffn) contiguous float16 / bfloat16 / float32 rows: the gate projection in
            columns ``:ffn``, the up projection in ``ffn:`` (``h.chunk(2, -1)``).

    Returns:
        torch.Tensor: (rows, ffn) in ``h``'s dtype.

    Raises:
        ValueError: ``h`` is not 2-D with an even number of columns, or not contiguous.
        TypeError: ``h``'s dtype is not a floating one the kernels handle.
    """
    out = _direct(_SITE, (h,))  # a layout whose launch was learned: its first call made the checks
    if out is not MISSED:
        return out
    check_input(h, "h")
    if h.dim() != 2 or h.shape[1] % 2 or not h.dtype.is_floating_point:
        raise ValueError(f"silu_and_mul: h must be (rows, 2 * ffn) floating rows, got {tuple(h.shape)} {h.dtype}")
    rows, ffn = h.shape[0], h.shape[1] // 2
    if not (rows and ffn):
        return torch.empty(rows, ffn, dtype=h.dtype, device=h.device)
    key = layout_key(h)
    launch = _launches.get(key)
    if launch is None:  # the layout's first call: the kernel's own call
        _launches.put(key, False)
        out = torch.empty(rows, ffn, dtype=h.dtype, device=h.device)
        silu_and_mul_kernel(ffn, tl_dtype(h))(h, out)
        return out
    if launch is False:  # its second: from now on through a launch that learns
        kernel = silu_and_mul_kernel(ffn, tl_dtype(h))
        launch = _launches.put(key, OpLaunch([(kernel, lambda t, o, s: (t[0], o[0]))], [(rows, ffn)]))
    out = launch((h,))
    _direct.learn(_SITE, launch, (h,))  # once learned (outside captures): later calls go direct
    return out
