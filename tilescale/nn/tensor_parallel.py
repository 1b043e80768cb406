"""Tensor-parallel linear layers whose communication is fused into their GEMMs.

Weights are split along the parallel dimension; activations, in one of Megatron-LM's two modes:

* ``sequence_parallel=True``: activations between layers are sharded by rows (their first
  dimension). ``ColumnParallelLinear``: ``y = all_gather(x) @ W_r.T + b_r``
  (``all_gather_gemm``), its backward reduce-scatters ``dy @ W_r`` (``gemm_reduce_scatter``);
  ``RowParallelLinear``: ``y = reduce_scatter(x @ W_r.T) + b`` (``gemm_reduce_scatter``), its
  backward ``all_gather_gemm(dy, W_r)``.
* ``sequence_parallel=False`` (plain tensor parallelism): the input of a column-parallel layer
  is replicated and its output sharded by columns, with no communication; its backward
  all-reduces ``dy @ W_r`` (``gemm_all_reduce``). ``RowParallelLinear``: ``y = all_reduce(x @
  W_r.T) + b`` (``gemm_all_reduce``); the output gradient is replicated, so its backward needs
  no communication.

So in both modes each layer's backward runs the other layer's forward op. Inputs may have any
leading dimensions (flattened to rows, restored on the output; in sequence-parallel mode the
first one is the sharded one, as in Megatron's (sequence, batch, hidden) layout). Example,
a Hugging Face Llama MLP (``gate_proj``, ``up_proj``, ``down_proj``) split over the job::

    gate_up = ts.nn.MergedColumnParallelLinear.from_linears([mlp.gate_proj, mlp.up_proj], sequence_parallel=False)
    down = ts.nn.RowParallelLinear.from_linear(mlp.down_proj, sequence_parallel=False)
    gate, up = gate_up(x).chunk(2, -1)        # x: (batch, seq, hidden), the same on every rank
    y = down(mlp.act_fn(gate) * up)           # (batch, seq, hidden), the same on every rank
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from tilescale import ops, runtime
from tilescale.nn._group import world_and_rank

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world, _ = world_and_rank(group)
    out = torch.empty(world * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _column_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None,
                    sequence_parallel: bool) -> torch.Tensor:
    """``x @ W_r.T + b_r`` over every rank's rows (gathered, sequence parallel) or over the
    replicated input (plain TP); ``x`` contiguous rows."""
    if not sequence_parallel:
        return x @ weight.T if bias is None else torch.addmm(bias, x, weight.T)  # bias in the GEMM
    y = ops.all_gather_gemm(x, weight, group=group)
    return y if bias is None else y.add_(bias)  # y is the op's own new tensor


def _row_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None,
                 sequence_parallel: bool) -> torch.Tensor:
    """``x @ W_r.T`` summed over ranks (reduce-scattered by rows, sequence parallel, or
    all-reduced, plain TP), plus the replicated bias; ``x`` contiguous rows."""
    reduce = ops.gemm_reduce_scatter if sequence_parallel else ops.gemm_all_reduce
    y = reduce(x, weight, group=group)
    return y if bias is None else y.add_(bias)  # y is the op's own new tensor


class _ColumnParallel(torch.autograd.Function):
    """:func:`_column_forward` and its backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):  # noqa: ANN001, ANN205 - autograd signature
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return _column_forward(x, weight, bias, group, sequence_parallel)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        group, sequence_parallel = ctx.group, ctx.sequence_parallel
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # Each rank's columns give a partial input gradient: summed, and scattered back to
            # the rows' owners in sequence-parallel mode.
            reduce = ops.gemm_reduce_scatter if sequence_parallel else ops.gemm_all_reduce
            dx = reduce(dy, weight.T.contiguous(), group=group)
        if ctx.needs_input_grad[1]:
            dw = dy.T @ (_all_gather_rows(x, group) if sequence_parallel else x)
        if ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None, None


class _RowParallel(torch.autograd.Function):
    """:func:`_row_forward` and its backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return _row_forward(x, weight, bias, group, sequence_parallel)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        group, sequence_parallel = ctx.group, ctx.sequence_parallel
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = ops.all_gather_gemm(dy, weight.T.contiguous(), group=group) if sequence_parallel else dy @ weight
        # The weight's and the bias's gradients need every row's output gradient: gathered in
        # sequence-parallel mode, so the replicated bias gets the whole sum on every rank.
        dy_all = _all_gather_rows(dy, group) if sequence_parallel and any(ctx.needs_input_grad[1:3]) else dy
        if ctx.needs_input_grad[1]:
            dw = dy_all.T @ x
        if ctx.needs_input_grad[2]:
            db = dy_all.sum(0)
        return dx, dw, db, None, None


def _shard(full: torch.Tensor, blocks: Sequence[int], dim: int, world: int, rank: int) -> torch.Tensor:
    """This rank's part of ``full`` along ``dim``: its slice of each of the consecutive ``blocks``
    (one block for a plain layer; gate and up each sharded on their own for a merged one)."""
    if bad := [b for b in blocks if b % world]:
        raise ValueError(f"dimension {dim} of the weight (blocks {list(blocks)}: {bad}) is not divisible by {world} "
                         "ranks")
    parts = [block.narrow(dim, rank * (block.shape[dim] // world), block.shape[dim] // world)
             for block in full.split(list(blocks), dim)]
    return torch.cat(parts, dim)


def _full_params(out_features: int, in_features: int, seed: int, weight: torch.Tensor | None,
                 bias: bool | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full (weight, bias or None): as given, or drawn as ``nn.Linear`` draws them from ``seed``
    (every rank draws the same and keeps its shard: no broadcast needed)."""
    g = torch.Generator().manual_seed(seed)
    bound = 1 / in_features**0.5
    if weight is None:
        weight = (torch.rand(out_features, in_features, generator=g) * 2 - 1) * bound
    if tuple(weight.shape) != (out_features, in_features):
        raise ValueError(f"weight must be ({out_features}, {in_features}), got {tuple(weight.shape)}")
    if bias is True:
        bias = (torch.rand(out_features, generator=g) * 2 - 1) * bound
    elif bias is False:
        bias = None
    elif tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must be ({out_features},), got {tuple(bias.shape)}")
    return weight.detach(), None if bias is None else bias.detach()


def _params_of(linears: Sequence[nn.Linear]) -> dict:
    """The constructor's ``weight``, ``bias`` and ``dtype`` from one or more ``nn.Linear`` of one input
    size (concatenated by output features)."""
    if len({lin.in_features for lin in linears}) != 1 or len({lin.bias is None for lin in linears}) != 1:
        raise ValueError("the linears must share in_features and all have a bias or none")
    if len({lin.weight.dtype for lin in linears}) != 1:
        raise TypeError(f"the linears' weights differ in dtype: {[lin.weight.dtype for lin in linears]}")
    bias = False if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    return dict(weight=torch.cat([lin.weight.detach() for lin in linears]), bias=bias, dtype=linears[0].weight.dtype)


class _ParallelLinear(nn.Module):
    """``y = x @ W.T + b`` with this rank's shard of W (split along ``shard_dim``, block by block)
    and a fused op; the shapes of inputs and outputs in :meth:`_output_lead`."""

    shard_dim: int
    function: type[torch.autograd.Function]
    compute: staticmethod  # the function's forward, for calls that record no gradient

    def __init__(self, in_features: int, out_features: int, blocks: Sequence[int], *, weight: torch.Tensor | None,
                 bias: bool | torch.Tensor, seed: int, dtype: torch.dtype, device: torch.device | None,
                 group: dist.ProcessGroup | None, sequence_parallel: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel
        self.world_size, self.rank = world_and_rank(group)
        full_weight, full_bias = _full_params(out_features, in_features, seed, weight, bias)
        device = device or runtime.device()
        shard = _shard(full_weight, blocks, self.shard_dim, self.world_size, self.rank)
        self.weight = nn.Parameter(shard.to(dtype=dtype, device=device))
        if full_bias is None:
            self.register_parameter("bias", None)
        else:  # split with the output features; replicated when those are whole (row parallel)
            b = _shard(full_bias, blocks, 0, self.world_size, self.rank) if self.shard_dim == 0 else full_bias.clone()
            self.bias = nn.Parameter(b.to(dtype=dtype, device=device))

    def _output_lead(self, lead: torch.Size) -> tuple[int, ...]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and x.dim() < 2:
            raise ValueError(f"sequence-parallel layers shard the input's first dimension: need (rows, ..., features), "
                             f"got {tuple(x.shape)}")
        lead = self._output_lead(x.shape[:-1])  # checked before any rank communicates
        rows = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()
        weight, bias = self.weight, self.bias
        if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad
                                        or bias is not None and bias.requires_grad):
            y = self.function.apply(rows, weight, bias, self.group, self.sequence_parallel)
        else:  # nothing to differentiate: no autograd node
            y = self.compute(rows, weight, bias, self.group, self.sequence_parallel)
        return y if x.dim() == 2 else y.reshape(*lead, y.shape[-1])  # 2-D: y has the output's shape

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, rank={self.rank} of {self.world_size}")


class _OneLinear:
    """The constructor and ``from_linear`` of the layers that shard one ``nn.Linear`` along
    their ``shard_dim`` (output features: column parallel; input features: row parallel)."""

    def __init__(self, in_features: int, out_features: int, *, weight: torch.Tensor | None = None,
                 bias: bool | torch.Tensor = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = True):
        sharded = out_features if self.shard_dim == 0 else in_features
        super().__init__(in_features, out_features, [sharded], weight=weight, bias=bias, seed=seed, dtype=dtype,
                         device=device, group=group, sequence_parallel=sequence_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: dist.ProcessGroup | None = None,
                    sequence_parallel: bool = True, device: torch.device | None = None) -> Self:
        """This rank's shard of ``linear`` (its weight's dtype) on ``device``: the weight rows
        and bias of its output features (column parallel), or its weight columns and the whole
        bias (row parallel).

        Example::

            up = ColumnParallelLinear.from_linear(mlp.up_proj, sequence_parallel=False)
            down = RowParallelLinear.from_linear(mlp.down_proj, sequence_parallel=False)

        Args:
            linear: The full layer (every rank may pass the same one); its weight's dtype is kept.
            group: The ranks the layer is split over; None: the whole job.
            sequence_parallel: As the constructor's (default True).
            device: Where the shard lives; None: this rank's device.

        Returns:
            A new layer of this class holding copies of this rank's shard (``linear`` is not changed).

        Raises:
            ValueError: the sharded features (``out_features`` column parallel, ``in_features`` row
                parallel) are not divisible by the group size.
        """
        return cls(linear.in_features, linear.out_features, **_params_of([linear]), device=device, group=group,
                   sequence_parallel=sequence_parallel)


class _ColumnParallelBase(_ParallelLinear):
    shard_dim = 0
    function = _ColumnParallel
    compute = staticmethod(_column_forward)

    def _output_lead(self, lead: torch.Size) -> tuple[int, ...]:
        # Sequence parallel: every rank's rows, rank by rank along the first dimension.
        return (self.world_size * lead[0], *lead[1:]) if self.sequence_parallel else tuple(lead)


class ColumnParallelLinear(_OneLinear, _ColumnParallelBase):
    """``y = x @ W.T + b`` with W and b split by output features: this rank's output columns.

    ``sequence_parallel=True``: ``x`` is this rank's rows, ``y`` every rank's rows (gathered
    in the GEMM); ``False``: ``x`` is the whole (replicated) input, ``y`` its rows. ``weight``
    (out_features, in_features) and ``bias`` (out_features,) are the full tensors (every rank
    may pass them; each keeps its shard); ``bias=True`` draws one, as ``weight=None`` draws
    the weight (from ``seed``). ``group``: the ranks the layer is split over (None: the job).

    Example::

        layer = ColumnParallelLinear(1024, 4096, dtype=torch.bfloat16)
        y = layer(x_rows)         # (rows, 1024) -> (world * rows, 4096 // world)
        layer = ColumnParallelLinear.from_linear(linear, sequence_parallel=False)
        y = layer(x)              # (batch, seq, in) -> (batch, seq, out // world)

    Args:
        in_features: Input features of the full layer.
        out_features: Output features of the full layer.
        weight: The full weight (out_features, in_features); None draws one from ``seed`` as
            ``nn.Linear`` initialises (every rank draws the same).
        bias: The full bias tensor, True to draw one, or False (default) for none.
        seed: Seed of the drawn parameters (default 0).
        dtype: The parameters' dtype (default bfloat16).
        device: Where the parameters live; None: this rank's device.
        group: The ranks the layer is split over; None: the whole job.
        sequence_parallel: See above (default True).

    Raises:
        ValueError: a parameter has the wrong shape, or ``out_features`` is not divisible by the group size.
    """


class MergedColumnParallelLinear(_ColumnParallelBase):
    """Several column-parallel projections of one input in one GEMM, each split on its own.

    The output on each rank is ``[shard of projection 0, shard of projection 1, ...]``, so
    ``gate, up = y.chunk(2, -1)`` splits a merged SwiGLU input on every rank (as vLLM's layer
    does). ``output_sizes``: each projection's output features; ``weight`` the projections'
    full weights concatenated by rows (and ``bias`` likewise). Other arguments as
    :class:`ColumnParallelLinear`.

    Example::

        gate_up = MergedColumnParallelLinear.from_linears([mlp.gate_proj, mlp.up_proj], sequence_parallel=False)
        gate, up = gate_up(x).chunk(2, -1)       # each (..., ffn // world)

    Args:
        in_features: Input features of the full layer.
        output_sizes: Each projection's output features.
        weight: The full weights concatenated by rows (sum(output_sizes), in_features); None draws one from ``seed`` as
            ``nn.Linear`` initialises (every rank draws the same).
        bias: The full bias tensor, True to draw one, or False (default) for none.
        seed: Seed of the drawn parameters (default 0).
        dtype: The parameters' dtype (default bfloat16).
        device: Where the parameters live; None: this rank's device.
        group: The ranks the layer is split over; None: the whole job.
        sequence_parallel: See above (default True).

    Raises:
        ValueError: a parameter has the wrong shape, or a projection's output size is not divisible by the group size.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], *, weight: torch.Tensor | None = None,
                 bias: bool | torch.Tensor = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = True):
        super().__init__(in_features, sum(output_sizes), list(output_sizes), weight=weight, bias=bias, seed=seed,
                         dtype=dtype, device=device, group=group, sequence_parallel=sequence_parallel)
        self.output_sizes = list(output_sizes)

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], *, group: dist.ProcessGroup | None = None,
                     sequence_parallel: bool = True,
                     device: torch.device | None = None) -> MergedColumnParallelLinear:
        """This rank's shards of ``linears`` (one input size; weights and biases) in one layer.

        Example::

            gate_up = MergedColumnParallelLinear.from_linears([mlp.gate_proj, mlp.up_proj])

        Args:
            linears: The full projections, one input size, all with a bias or none, one weight dtype.
            group: The ranks the layer is split over; None: the whole job.
            sequence_parallel: As the constructor's (default True).
            device: Where the shards live; None: this rank's device.

        Returns:
            MergedColumnParallelLinear: A new layer holding copies of this rank's shard of each projection.

        Raises:
            ValueError: the linears differ in ``in_features`` or in having a bias, or an output size is
                not divisible by the group size.
            TypeError: the linears' weights differ in dtype.
        """
        return cls(linears[0].in_features, [lin.out_features for lin in linears], **_params_of(linears),
                   device=device, group=group, sequence_parallel=sequence_parallel)


class RowParallelLinear(_OneLinear, _ParallelLinear):
    """``y = x @ W.T + b`` with W split by input features: ``x`` holds this rank's input columns.

    The partial products are summed over ranks: ``sequence_parallel=True`` reduce-scatters
    them by rows (``y`` is this rank's rows: the first dimension divided by the world size),
    ``False`` all-reduces them (``y`` whole on every rank). The bias is whole on every rank,
    added after the sum; its gradient is the whole sum on every rank in both modes. Other
    arguments as :class:`ColumnParallelLinear`.

    Example::

        layer = RowParallelLinear(4096, 1024, dtype=torch.bfloat16)
        y = layer(h)              # h: (M, 4096 // world) -> y: (M // world, 1024)
        layer = RowParallelLinear.from_linear(linear, sequence_parallel=False)
        y = layer(h)              # (batch, seq, in // world) -> (batch, seq, out)

    Args:
        in_features: Input features of the full layer.
        out_features: Output features of the full layer.
        weight: The full weight (out_features, in_features); None draws one from ``seed`` as
            ``nn.Linear`` initialises (every rank draws the same).
        bias: The full bias tensor, True to draw one, or False (default) for none.
        seed: Seed of the drawn parameters (default 0).
        dtype: The parameters' dtype (default bfloat16).
        device: Where the parameters live; None: this rank's device.
        group: The ranks the layer is split over; None: the whole job.
        sequence_parallel: See above (default True).

    Raises:
        ValueError: a parameter has the wrong shape, or ``in_features`` is not divisible by the group size.
    """

    shard_dim = 1
    function = _RowParallel
    compute = staticmethod(_row_forward)

    def _output_lead(self, lead: torch.Size) -> tuple[int, ...]:
        if not self.sequence_parallel:
            return tuple(lead)
        if lead[0] % self.world_size:
            raise ValueError(f"sequence-parallel RowParallelLinear scatters the first dimension ({lead[0]}) over "
                             f"{self.world_size} ranks: it must be divisible")
        return (lead[0] // self.world_size, *lead[1:])


class TensorParallelMLP(nn.Module):
    """``down(gelu(up(x)))`` with ``up`` column parallel and ``down`` row parallel, sequence parallel.

    Example::

        mlp = TensorParallelMLP(1024, 4096, dtype=torch.bfloat16)
        y = mlp(x_rows)           # x_rows, y: this rank's (rows, 1024)

    Args:
        hidden: The model dimension (input and output features).
        ffn: The hidden dimension, divisible by the group size.
        up: The full up-projection weight (ffn, hidden); None draws one from ``seed``.
        down: The full down-projection weight (hidden, ffn); None draws one from ``seed + 1``.
        seed: Seed of the drawn weights (default 0).
        dtype: The parameters' dtype (default bfloat16).
        device: Where the parameters live; None: this rank's device.
        group: The ranks the layer is split over; None: the whole job.
    """

    def __init__(self, hidden: int, ffn: int, *, up: torch.Tensor | None = None, down: torch.Tensor | None = None,
                 seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, ffn, weight=up, seed=seed, dtype=dtype, device=device, group=group)
        self.down = RowParallelLinear(ffn, hidden, weight=down, seed=seed + 1, dtype=dtype, device=device, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(gelu(up(x)))``.

        Args:
            x: This rank's rows, ``(rows, ..., hidden)``.

        Returns:
            torch.Tensor: This rank's rows of the output, ``x``'s shape.
        """
        return self.down(nn.functional.gelu(self.up(x)))
