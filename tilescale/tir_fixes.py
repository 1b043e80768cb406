"""Workarounds for miscompilations of the pinned TileLang (0.1.15), applied by ``ts.jit``
to every kernel before TileLang compiles it.

Loops of zero or one iteration. A serial loop whose extent is index arithmetic that can
be 0 or 1 but nothing else, such as a grid-stride loop over fewer items than blocks::

    for q in T.serial(T.ceildiv(tokens - bx, blocks)):    # tokens < blocks: 0 or 1 step

is compiled as exactly one iteration: the extent's check disappears from the CUDA source,
so blocks that should do nothing run the body (with out-of-range indices). The CPU path
runs such loops right, so its tests cannot see it; found on an H200, where it broke the
MoE receive kernel. :func:`guard_unit_loops` rewrites each such loop into one iteration
under an explicit ``if extent > 0``, which TileLang keeps.
"""

from __future__ import annotations

from tvm import arith, ir, tirx


def _bind_ranges(body: tirx.Stmt) -> arith.Analyzer:
    """An analyzer that knows the range of every thread index, loop variable and let value
    of ``body`` (visited in program order, so each range can use the enclosing ones)."""
    analyzer = arith.Analyzer()

    def visit(node: object) -> bool:
        if isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
            analyzer.bind(node.node.var, ir.Range.from_min_extent(0, node.value))
        elif isinstance(node, tirx.For):
            analyzer.bind(node.loop_var, ir.Range.from_min_extent(node.min, node.extent))
        elif isinstance(node, tirx.Bind):
            analyzer.bind(node.var, node.value)
        return True

    tirx.stmt_functor.pre_order_visit(body, visit)
    return analyzer


def _is_unit_loop(loop: tirx.For, analyzer: arith.Analyzer) -> bool:
    """Whether ``loop`` is serial with a computed extent that is 0 or 1, never more."""
    if loop.kind != tirx.ForKind.SERIAL or isinstance(loop.extent, tirx.IntImm):
        return False
    bound = analyzer.const_int_bound(loop.extent)
    return bound.max_value == 1 and bound.min_value <= 0


def guard_unit_loops(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every loop of 0 or 1 iteration written as one iteration under ``if``.

    Example::

        for q in T.serial(T.ceildiv(8 - bx, 13)):      # becomes: for q in T.serial(1):
            A[bx + q * 13] = 1                         #              if (8 - bx + 12) // 13 > 0: ...
    """
    analyzer = _bind_ranges(func.body)

    def rewrite(node: tirx.Stmt) -> tirx.Stmt | None:
        if not _is_unit_loop(node, analyzer):
            return None
        guarded = tirx.IfThenElse(node.extent > 0, node.body, None)
        return tirx.For(node.loop_var, node.min, 1, node.kind, guarded, node.thread_binding, node.annotations,
                        node.step)

    body = tirx.stmt_functor.ir_transform(func.body, None, rewrite, ["tirx.For"])
    return func if body.same_as(func.body) else func.with_body(body)
