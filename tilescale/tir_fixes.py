"""Workarounds for what the pinned TileLang (0.1.15) compiles wrong for distributed kernels,
applied by ``ts.jit`` to every kernel it builds.

Loops of zero or one iteration. A serial loop whose extent is index arithmetic that can
be 0 or 1 but nothing else, such as a grid-stride loop over fewer items than blocks::

    for q in T.serial(T.ceildiv(tokens - bx, blocks)):    # tokens < blocks: 0 or 1 step

is compiled as exactly one iteration: the extent's check disappears from the CUDA source,
so blocks that should do nothing run the body (with out-of-range indices). The CPU path
runs such loops right, so its tests cannot see it; found on an H200, where it broke the
MoE receive kernel. :func:`guard_unit_loops` rewrites each such loop into one iteration
under an explicit ``if extent > 0``, which TileLang keeps.

Reads of what other ranks write during the launch. TileLang declares every pointer
argument ``__restrict__``, and ``const`` when the kernel never stores to it by that name.
That lets nvcc load it through the non-coherent cache and move the loads before a wait:
on an H200 a kernel read the zeros of a fresh buffer before the wait for the peers'
counts ended. A kernel that waits for other ranks (``T.wait``, ``T.barrier()``, ``T.agree``) reads
data they write while it runs, under any of its arguments' names, so inside
:func:`coherent_reads` such kernels are generated without either qualifier
(:func:`coherent_arguments`).

Index arithmetic with a subtracted variable. An index such as ``flags[(rank - p) % world]`` or
``x[(rank - p) // 4]``, ``p`` a loop variable, is compiled into a closed form that drops
``rank`` (found on 4x H100, where an all-gather GEMM's pushers put every rank's rows to the
same peers). :func:`keep_index_arithmetic` puts each such division or modulo of an index
(or of a let-bound value, which TileLang inlines into indices) behind a cast
(:func:`tilescale.language.scale.as_written`), which TileLang cannot rewrite.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import tvm_ffi
from tilelang.engine import register_cuda_postproc
from tvm import arith, ir, tirx

from tilescale.language.scale import as_written


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


def _subtracts_a_variable(dividend: tirx.PrimExpr) -> bool:
    """Whether ``dividend`` is linear in one of its variables with a negative coefficient."""
    variables: list[tirx.Var] = []
    tirx.stmt_functor.post_order_visit(dividend, lambda n: variables.append(n) if isinstance(n, tirx.Var) else None)
    for var in variables:
        coefficients = arith.detect_linear_equation(dividend, [var])
        if len(coefficients) == 2 and isinstance(coefficients[0], tirx.IntImm) and coefficients[0].value < 0:
            return True
    return False


def _kept(index: tirx.PrimExpr) -> tirx.PrimExpr:
    """``index`` with each division or modulo whose dividend subtracts a variable behind ``as_written``."""

    def rewrite(node: tirx.PrimExpr) -> tirx.PrimExpr | None:
        if isinstance(node, (tirx.FloorMod, tirx.FloorDiv)) and _subtracts_a_variable(node.a):
            return as_written(node)
        return None

    return tirx.stmt_functor.ir_transform(tirx.Evaluate(index), None, rewrite,
                                          ["tirx.FloorMod", "tirx.FloorDiv"]).value


def keep_index_arithmetic(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every buffer index's ``a // b`` and ``a % b``, where ``a`` subtracts a
    variable (``rank - p``), computed as written (:func:`tilescale.language.scale.as_written`);
    also in the values of let bindings, which TileLang inlines into the indices that use them.

    Example::

        flags[(rank - p) % 4]              # becomes: flags[as_written((rank - p) % 4)]
        peer = (rank + 3 - p) % 4          # becomes: peer = as_written((rank + 3 - p) % 4)
    """

    def rewrite(node: tirx.Stmt | tirx.PrimExpr) -> tirx.Stmt | tirx.PrimExpr | None:
        if isinstance(node, (tirx.Bind, tirx.Let)):
            value = _kept(node.value)
            if value.same_as(node.value):
                return None
            return tirx.Bind(node.var, value) if isinstance(node, tirx.Bind) else tirx.Let(node.var, value, node.body)
        indices = [_kept(i) for i in node.indices]
        if all(new.same_as(old) for new, old in zip(indices, node.indices, strict=True)):
            return None
        if isinstance(node, tirx.BufferLoad):
            return tirx.BufferLoad(node.buffer, indices, node.predicate)
        return tirx.BufferStore(node.buffer, node.value, indices, node.predicate)

    body = tirx.stmt_functor.ir_transform(func.body, None, rewrite,
                                          ["tirx.BufferLoad", "tirx.BufferStore", "tirx.Bind", "tirx.Let"])
    return func if body.same_as(func.body) else func.with_body(body)


_WAITS = re.compile(r"tilescale::\w*(?:wait|barrier|agree)\w*\(")
_QUALIFIED_POINTER = re.compile(r"(?:const )?(\w+)\* __restrict__ ")
_POSTPROC = "tilelang_callback_cuda_postproc"


def coherent_arguments(code: str) -> str:
    """``code`` (CUDA TileLang generated) with plain pointer arguments if its kernel waits for
    other ranks, else unchanged.

    Example::

        coherent_arguments(src)    # "const int* __restrict__ counts" -> "int* counts"
    """
    return _QUALIFIED_POINTER.sub(r"\1* ", code) if _WAITS.search(code) else code


@contextlib.contextmanager
def coherent_reads() -> Iterator[None]:
    """Apply :func:`coherent_arguments` to the CUDA TileLang generates inside this block (after
    it, whatever post-processing was registered before runs as it did)."""
    previous = tvm_ffi.get_global_func(_POSTPROC, allow_missing=True)

    def postproc(code: str, target: object) -> str:
        code = coherent_arguments(code)
        return previous(code, target) if previous is not None else code

    register_cuda_postproc(postproc)
    try:
        yield
    finally:
        register_cuda_postproc(previous if previous is not None else (lambda code, target: code))
