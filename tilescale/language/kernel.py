"""``T.prim_func`` and ``T.Kernel`` for distributed kernels.

``T.prim_func`` builds the function exactly as TileLang does, then appends the hidden
parameters its distributed operations asked for (peer-address tables of symmetric
arguments, rank, wait status and timeout) and records them in the ``tilescale.hidden``
attribute so ``tilescale.jit`` can bind them per call. A function without distributed
operations comes out unchanged. ``T.Kernel`` is TileLang's, with tilescale's device
helpers in the prelude.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import tilelang.language as tl
from tvm import tirx

from tilescale.language.scale import ADDRESS, BuildContext, building, open_context
from tilescale.language.sync import PRELUDE


def Kernel(*blocks: int | tirx.PrimExpr, threads: int | list[int] | tuple[int, ...] | None = None,  # noqa: N802
           prelude: str | None = None, cluster_dims: int | tuple[int, int, int] | list[int] | None = None) -> Any:
    """TileLang's ``T.Kernel`` with tilescale's device helpers available to the kernel.

    Example::

        with T.Kernel(T.ceildiv(M, 64), threads=128) as bx:
            ...

    Args:
        *blocks: The grid extents (one to three, constants or expressions), as in TileLang.
        threads: Threads per block (an int or up to three extents); None takes TileLang's default.
        prelude: Extra CUDA source placed after tilescale's device helpers (and the device
            lowering's, if one is active); None adds nothing.
        cluster_dims: Thread-block cluster shape, needed for ``T.Scale("cta_cluster")``,
            ``dst_cta``/``src_cta`` copies and cluster barriers; None launches no clusters.

    Returns:
        TileLang's kernel launch frame; ``with ... as bx`` (or ``as (bx, by)``) binds the block indices.
    """
    ctx = open_context()
    lowering = ctx.lowering if ctx is not None else None
    device_calls = lowering.prelude if lowering is not None else ""
    return tl.Kernel(*blocks, threads=threads, prelude=PRELUDE + device_calls + (prelude or ""),
                     cluster_dims=cluster_dims)


Kernel.__dict__.update(tl.Kernel.__dict__)  # keep TileLang's launch-factory mark


class _DumpForTileLangErrorsOnly(logging.Filter):
    """Drops TileLang's dump of its generated builder source (``Failed to build prim_func``,
    ~165 lines for an op's kernel) when the build failed on one of tilescale's own checks,
    such as a constant peer index out of range: their messages say what is wrong and where."""

    def filter(self, record: logging.LogRecord) -> bool:
        tb = sys.exc_info()[2]  # logged while TileLang handles the build's exception
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return tb is None or not tb.tb_frame.f_code.co_filename.startswith(os.path.dirname(__file__))


logging.getLogger("tilelang.language.eager.builder").addFilter(_DumpForTileLangErrorsOnly())


def _with_hidden_params(func: tirx.PrimFunc, ctx: BuildContext) -> tirx.PrimFunc:
    if not ctx.peer_tables and not ctx.scalars and ctx.sync is None and ctx.pes is None:
        return func if ctx.remote == ADDRESS else func.with_attr("tilescale.remote", ctx.remote)
    params = list(func.params)
    buffer_map = dict(func.buffer_map)
    arguments = list(buffer_map.values())
    hidden: dict[str, str] = {}
    for name, (arg, table) in ctx.peer_tables.items():
        if not any(arg.same_as(b) for b in arguments):
            raise TypeError(
                f"remote access to '{name}': only tensor arguments of the kernel can be symmetric "
                "(allocate the tensor with tilescale.empty and pass it in)"
            )
        var = tirx.Var(table.name, "handle")
        params.append(var)
        buffer_map[var] = table
        hidden[table.name] = name
    for table in (ctx.sync, ctx.pes):  # the group's, bound by the jit
        if table is not None:
            var = tirx.Var(table.name, "handle")
            params.append(var)
            buffer_map[var] = table
            hidden[table.name] = ""
    body, renamed = func.body, {}
    for name, var in ctx.scalars.items():
        if var.name != name:  # a macro parameter it was passed to renamed it; the jit binds it by name
            renamed[var] = tirx.Var(name, var.dtype)
        params.append(renamed.get(var, var))
        hidden[name] = ""
    if renamed:
        body = tirx.stmt_functor.substitute(body, renamed)
    out = tirx.PrimFunc(params, body, func.ret_type, buffer_map, func.attrs)
    out = out.with_attr("tilescale.hidden", hidden).with_attr("tilescale.world_size", ctx.world)
    # Symmetric arguments that device calls reach by this rank's address (no peer table): the
    # jit still checks them, and takes the kernel's group from them.
    by_address = [name for name in ctx.remote_args if name not in ctx.peer_tables]
    if by_address:
        out = out.with_attr("tilescale.symmetric", by_address)
    if ctx.remote != ADDRESS:
        out = out.with_attr("tilescale.remote", ctx.remote)
    if hasattr(func, "orig_func"):
        out.orig_func = func.orig_func
    return out


def prim_func(func: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """TileLang's ``T.prim_func`` that also accepts tilescale's distributed operations.

    Example::

        @T.prim_func
        def main(A: T.Tensor((M, N), "float16"), B: T.Tensor((M, N), "float16")):
            ...

    Args:
        func: The kernel function; None when used with keywords (``@T.prim_func(...)``).
        **kwargs: Passed to TileLang's ``T.prim_func``. With ``eager_jit`` set, the function goes
            to TileLang unchanged (no tilescale build context).

    Returns:
        The ``PrimFunc``, with the hidden parameters its distributed operations need (peer-address
        tables, the group's sync and rank tables, scalars such as rank and timeout) appended after the
        user's; or a decorator when ``func`` is None.

    Raises:
        TypeError: a remote operation reaches a tensor that is not an argument of the kernel.
        RuntimeError: another tilescale ``T.prim_func`` is being built in this thread.
    """

    def build(f: Callable[..., Any]) -> Any:
        if kwargs.get("eager_jit"):
            return tl.prim_func(f, **kwargs)
        with building() as ctx:
            built = tl.prim_func(f, **kwargs)
        return _with_hidden_params(built, ctx)

    return build(func) if func is not None else build
