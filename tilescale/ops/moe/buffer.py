"""The MoE exchange's buffers, sized up front: ``Buffer``, as DeepEP's (host API, torch tensors in and out).

Example::

    buf = ts.ops.moe.Buffer(ep, max_tokens=4096, hidden=7168, topk=8, num_experts=256)
    recv_x, recv_w, counts, handle = buf.dispatch(x, topk_idx, topk_weights)   # any tokens <= 4096
    y = buf.combine(expert_out, recv_w, handle)
    buf.release()                                   # every rank of ep; ts.finalize() releases it too

No host state changes from call to call, so a step can be captured in a CUDA graph and
replayed. Each buffer keeps device-side counts of its dispatches and its combines. A source's
``arrived`` flag holds its dispatch count + 1, set once per call and compared for equality (so
it survives the count's wrap-around); a ``progress`` flag holds the groups sent so far in this
call, and its receiver puts it back to 0 after the last one. Dispatch reads its receive
buffers before its closing barrier, so the next call, which starts after that barrier on every
rank, may overwrite them and raise the flags again; combine alternates two sets of return rows
(``combine.py``). No opening barrier is needed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tilescale import runtime
from tilescale.errors import numbered_signature
from tilescale.jit import DistributedKernel
from tilescale.op_launch import MISSED, Direct, OpLaunch, Output
from tilescale.ops._common import (
    call_board,
    call_identity,
    check_input,
    check_same_across_ranks,
    launch_together,
    signature,
    sm_count,
    tl_dtype,
)
from tilescale.ops.moe.combine import combine_kernel
from tilescale.ops.moe.dispatch import dispatch_kernel, dispatch_plan
from tilescale.ops.moe.fp8 import (
    BLOCK,
    Rows,
    is_fp8,
    mark,
    marked_rows,
    pack,
    packed_width,
    pair_layout,
    pair_views,
    quantize_fp8,
    unpack,
)
from tilescale.ops.moe.layout import ROW_TILE
from tilescale.ops.moe.routing import (
    Routing,
    chunk_counts_shape,
    expert_ids,
    id_dtype,
    raise_bad_ids,
    router,
    routes_in_dispatch,
    watch_ids,
    withdraw_watch,
)
from tilescale.plans import PlanCache, capturing

_serial = itertools.count()  # keys of explicit buffers in their group's state
# Dispatch plans a buffer keeps (one per token count, mode and row size; the newest): a call
# whose plan was dropped makes it again, building no kernel (the kernels take any count).
PLANS_KEPT = 32


@dataclass
class _SendPlan:
    """What a dispatch (or re-dispatch) of one (tokens, hidden, dtype, mode) resolves at its first call.
    Its kernels take any token count (a dynamic size): plans of other counts share them."""

    # The routing kernels (where they run) and the dispatch kernel, launched by one call
    # (``Buffer._send_launch`` lists its tensors, scalars and outputs).
    send: OpLaunch
    routed: bool  # the routing kernels run in the call (else it passes known routes: a re-dispatch, no tokens)
    signature: int  # what the ranks must agree on, for the call board
    received: torch.Tensor  # the receive rows
    in_place: bool  # received rows left where they land (the call allocates no grouped rows)
    layout: bool  # its calls return the grouped layout (a re-dispatch's is scratch: it returns the rows alone)


@dataclass
class DispatchHandle:
    """What combine (and a re-dispatch along the same routes) needs: returned by a dispatch.

    Received row ``src * capacity + j`` is slot j of source rank ``src`` (``capacity``: the
    buffer's ``max_tokens``); rows and pairs are as the module ``tilescale.ops.moe`` describes.
    """

    tokens: int  # this rank's tokens (0 allowed)
    topk_idx: torch.Tensor  # (max(tokens, 1), topk) int32 expert ids this rank dispatched (-1: no expert, out
    # of range, or the padding row of no tokens)
    topk_w: torch.Tensor  # (max(tokens, 1), topk) float32 their routing weights
    expert_slot: torch.Tensor  # (max(tokens, 1), topk) order of entry (t, k) among this rank's entries of its expert
    dest: torch.Tensor  # (world, max(tokens, 1)) destination of pair (rank r, token t) at [r, t], or -1
    slot: torch.Tensor  # (world, max(tokens, 1)) the pair's slot at its destination (-1 where no pair)
    send_counts: torch.Tensor  # (world,) rows sent to each rank
    expert_send_counts: torch.Tensor  # (num_experts,) entries sent to each expert
    recv_counts: torch.Tensor  # (world,) rows received from each rank
    position: torch.Tensor  # (world * capacity, topk) grouped row of each received row's local experts, -1 if none
    counts: torch.Tensor  # (local_experts,) grouped rows holding tokens of each local expert
    offsets: torch.Tensor  # (local_experts,) first grouped row of each local expert
    row_expert: torch.Tensor  # (grouped rows,) local expert of each grouped row, -1 for rows holding no token
    source_row: torch.Tensor  # (grouped rows,) received row (source * capacity + slot) of each, -1 if none
    group: dist.ProcessGroup | None = None  # the expert-parallel group the dispatch ran over (None: the whole job)
    buffer: Buffer | None = None  # the buffer it went through (None: nothing was exchanged)
    # The dispatch's number through its buffer, alike on every rank: a combine signs it, so ranks
    # combining different dispatches (of the same shapes) get a ShapeMismatchError, not wrong sums.
    dispatch: int = 0

    @property
    def rows_per_expert(self) -> float:
        """The grouped rows a local expert holds on average where every rank sends as many
        tokens as this one (``tokens * topk / local experts``): ``ts.ops.grouped_gemm``'s
        ``rows_per_expert``, which picks its tile by it."""
        return self.tokens * self.topk_idx.shape[1] / self.counts.shape[0]


class Buffer:
    """Symmetric buffers for MoE dispatch and combine over one group, allocated once.

    Example::

        buf = ts.ops.moe.Buffer(ep, max_tokens=128, hidden=7168, topk=8, num_experts=256)
        recv_x, recv_w, counts, handle = buf.dispatch(x, topk_idx, topk_w, low_latency=True)
        y = buf.combine(expert_out, recv_w, handle)

    Args:
        group: the expert-parallel process group (None: the whole job); experts are split
            evenly over its ranks (expert ``e`` on rank ``e // (num_experts // size)``).
        max_tokens: the most tokens any rank passes to one dispatch, the same on every rank
            (DeepEP's ``num_max_dispatch_tokens_per_rank``); each rank passes any count up to
            it, 0 included, and a new count builds no kernel (the kernels take it at run time).
        hidden, topk, num_experts, dtype: what every dispatch through the buffer passes.
            ``torch.float8_e4m3fn``: FP8 dispatch (``tilescale.ops.moe.fp8``: e4m3 rows and
            per-128-channel float32 scales, passed as a ``(values, scales)`` pair or as bf16
            rows quantised on the way in), bf16 combine.
        in_place: keep two sets of receive rows, so that a dispatch can leave its rows where
            they land (``dispatch(..., in_place=True)``); False: one set, half the receive
            memory, and in-place dispatches raise ValueError. The same on every rank.

    Memory: receive rows, (sets, group size, max_tokens, hidden) of ``dtype`` (two sets with
    ``in_place``: an in-place dispatch's rows outlive its call; see ``dispatch.py``), two sets
    of return rows in the combine's dtype, and per-token metadata.

    Collective: every rank of the group constructs it with the same arguments (checked), and
    calls its methods in the same order. Calls that do not fit (more tokens, another top-k,
    hidden size or dtype) raise ValueError. Combines and re-dispatches of another hidden size
    or dtype (a layer's backward combines float32 weight gradients) get their own rows at
    first use, outside CUDA graph capture. :meth:`release` frees it; ``ts.finalize()``
    releases every buffer left.
    """

    def __init__(self, group: dist.ProcessGroup | None, max_tokens: int, hidden: int, topk: int, num_experts: int,
                 dtype: torch.dtype = torch.bfloat16, in_place: bool = True):
        self.state = state = runtime.group_state(group)
        self.group, self.world = group, state.size
        if max_tokens < 1 or hidden < 1 or not 1 <= topk <= num_experts or num_experts % state.size:
            raise ValueError(f"moe Buffer: need max_tokens >= 1, hidden >= 1, 1 <= topk <= num_experts and "
                             f"num_experts divisible by the group size {state.size}; got max_tokens={max_tokens}, "
                             f"hidden={hidden}, topk={topk}, num_experts={num_experts}")
        self.fp8 = dtype == torch.float8_e4m3fn
        if self.fp8 and hidden % BLOCK:
            raise ValueError(f"moe Buffer: FP8 rows need hidden divisible by {BLOCK}, got {hidden}")
        if not self.fp8:
            tl_dtype(torch.empty(0, dtype=dtype))  # TypeError for dtypes the kernels do not move
        self.max_tokens, self.hidden, self.topk, self.num_experts, self.dtype = (max_tokens, hidden, topk,
                                                                                  num_experts, dtype)
        self.sets = 2 if in_place else 1  # of receive rows: peers write a call's set at its call count % sets
        self.per_rank = num_experts // state.size
        hits = state.size * max_tokens * min(topk, self.per_rank)
        self.rows = -(-(hits + self.per_rank * (ROW_TILE - 1)) // ROW_TILE) * ROW_TILE  # grouped rows, worst case
        self.sms = sm_count()
        runtime.check_not_capturing(f"the MoE buffer of {max_tokens} tokens x {hidden} ({dtype})")
        check_same_across_ranks(state, "moe Buffer", [max_tokens, hidden, topk, num_experts, str(dtype),
                                                      f"SMs={self.sms}", f"in_place={in_place}"])
        # Everything peers write into this rank comes in the same sets as the receive rows.
        world, sets = state.size, self.sets
        meta = (sets, world, max_tokens, topk)
        self._idx, self._w = state.allocate(meta, torch.int32), state.allocate(meta, torch.float32)
        self._slot = state.allocate(meta, torch.int32)
        self._counts = state.allocate((sets, world), torch.int32)
        self._expert_counts = state.allocate((sets, world, self.per_rank), torch.int32)
        self._arrived = state.allocate((world,), torch.int32)
        self._flags = {}  # (ranges, progress) by mode and the plan's (blocks, groups): _flags_of
        self._rows_in: dict[tuple, torch.Tensor] = {}  # dispatch's receive rows by (hidden, dtype)
        self._rows_back: dict[tuple, torch.Tensor] = {}  # combine's two sets of return rows by (hidden, dtype)
        self._modes: set[bool] = set()  # dispatch modes (low_latency) whose agreement the ranks checked
        # This buffer's name in the group's build barriers (launch_together): the same on every rank.
        self._serial = state.comm.next_tag("moe buffer")
        # Sends by (tokens, hidden, dtype, mode, ...): a few host objects per token count (the
        # kernels are shared), the most recent counts' kept.
        self._plans = PlanCache(PLANS_KEPT)
        # Dispatch calls by their arguments' sizes, dtypes and mode: the send, after every check
        # one rank decides from those (``_call_plan``).
        self._dispatches = PlanCache(PLANS_KEPT)
        # combine's (kernel, return rows, signature, its OpLaunch per token count) by (hidden, dtype)
        self._combines_by: dict[tuple, tuple] = {}
        # Repeated calls straight to their learned programs (``op_launch.Direct``), at sites
        # ("dispatch", low_latency, in_place), ("combine", hidden, dtype) and ("redispatch",).
        self._direct = Direct()
        # FP8 rows travel as bytes (values, then scales), and come back bf16.
        self._receive_rows = received = self._received(*((packed_width(hidden), torch.uint8) if self.fp8
                                                          else (hidden, dtype)))
        for low_latency in (False, True):
            self._flags_of(low_latency, received)
        self._returned(hidden, torch.bfloat16 if self.fp8 else dtype)
        # An FP8 dispatch's grouped (values, scales) views, as its call makes them (fp8.mark).
        self._pair_layout = pair_layout(self.rows, hidden) if self.fp8 else None
        device = runtime.device()
        self._routes_end = 13 if device.type == "cuda" else 14  # a call's outputs past its routes (_send_launch)
        self._sends = torch.zeros(3, dtype=torch.int32, device=device)  # the dispatch's T.count_call state
        self._calls = 0  # dispatch kernels issued (the host's count; in-place rows are valid until the next)
        self._combines = torch.zeros(1, dtype=torch.int32, device=device)
        self._key = ("moe buffer", next(_serial))
        state.exchange(self._key, lambda: self)  # the group's release (ts.finalize) releases it
        self.released = False

    def __repr__(self) -> str:
        return (f"Buffer(max_tokens={self.max_tokens}, hidden={self.hidden}, topk={self.topk}, "
                f"num_experts={self.num_experts}, dtype={self.dtype}, in_place={self.sets == 2}, "
                f"{self.state.describe()}"
                f"{', released' if self.released else ''})")

    def fits(self, tokens: int, hidden: int, topk: int, num_experts: int, dtype: torch.dtype) -> bool:
        """Whether a dispatch of ``tokens`` x ``hidden`` rows, top-``topk`` of ``num_experts``, goes through.

        Args:
            tokens: This rank's tokens.
            hidden: Channels per row.
            topk: Experts per token.
            num_experts: Experts over the whole group.
            dtype: The rows' dtype (``torch.float8_e4m3fn`` for FP8 rows).

        Returns:
            bool: True when ``tokens <= max_tokens`` and the rest equal the buffer's.
        """
        return (tokens <= self.max_tokens and (hidden, topk, num_experts, dtype)
                == (self.hidden, self.topk, self.num_experts, self.dtype))

    def release(self) -> None:
        """Free the buffers (collective: every rank of the group calls it, after its last use).

        The ranks first meet (after this rank's queued GPU work), so no rank frees memory a
        peer may still write into. Handles of earlier dispatches can no longer be combined.
        """
        if self.released:
            return
        self._check_live()
        if self.state.backend.device_type == "cuda":
            torch.cuda.synchronize()
        self.state.comm.barrier()
        self._drop()

    def _drop(self) -> None:
        self.released = True
        for key in [k for k, v in self.state.exchanges.items() if v is self]:  # its own key, and the ops' cache
            del self.state.exchanges[key]
        self._flags, self._rows_in, self._rows_back, self._combines_by = {}, {}, {}, {}
        self._plans.clear()
        self._dispatches.clear()
        self._direct, self._receive_rows = Direct(), None
        self._idx = self._w = self._slot = self._counts = self._expert_counts = self._arrived = None

    def _check_live(self) -> None:
        if not self.released and self.state.released:  # the group went first (ts.finalize)
            self._drop()
        if self.released:
            raise RuntimeError(f"{self!r} is released: construct a new one")

    def _flags_of(self, low_latency: bool, received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``ranges`` and ``progress`` flags of dispatches in a mode into the receive rows
        ``received`` (``_received``): their shape is the plan's (blocks and groups:
        ``dispatch_plan``, by the rows' bytes), so rows of another size (a re-dispatch) may get
        their own, at first use."""
        row_bytes = received.shape[-1] * received.element_size()
        blocks, _, _, groups = dispatch_plan(self.world, self.max_tokens, self.sms, low_latency, row_bytes)
        key = (low_latency, blocks, groups)
        if key not in self._flags:
            runtime.check_not_capturing(f"the MoE buffer's flags of {blocks} blocks")
            sets, world = self.sets, self.world
            self._flags[key] = (self.state.allocate((sets, world, blocks, groups, 2), torch.int32),
                                self.state.allocate((sets, world, blocks), torch.int32))
        return self._flags[key]

    def _received(self, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Receive rows of a dispatch of ``hidden`` x ``dtype``, in the buffer's sets (alternate
        calls use alternate sets): slot j of source src at ``[set, src, j]``."""
        key = (hidden, dtype)
        if key not in self._rows_in:
            runtime.check_not_capturing(f"the MoE buffer's receive rows of {hidden} ({dtype})")
            self._rows_in[key] = self.state.allocate((self.sets, self.world, self.max_tokens, hidden), dtype)
        return self._rows_in[key]

    def _returned(self, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Combine's return rows of ``hidden`` x ``dtype``, two sets used by alternate calls."""
        key = (hidden, dtype)
        if key not in self._rows_back:
            runtime.check_not_capturing(f"the MoE buffer's return rows of {hidden} ({dtype})")
            self._rows_back[key] = self.state.allocate((2, self.world, self.max_tokens, hidden), dtype)
        return self._rows_back[key]

    def dispatch(self, x: Rows, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, low_latency: bool = False, in_place: bool = False,
                 ) -> tuple[Rows, torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send each token to the ranks of its experts; return the tokens grouped by local expert.

        Args:
            x: this rank's (tokens, hidden) rows, tokens <= ``max_tokens`` (0 allowed); for an
                FP8 buffer a ``(values, scales)`` pair (``quantize_fp8``) or rows to quantise.
            topk_idx: (tokens, topk) integer expert ids; -1: no expert (``ts.ops.moe_dispatch``).
            topk_weights: (tokens, topk) routing weights.
            low_latency: announce every row on its own (decode batches); the same on every rank.
            in_place: return the receive rows as they landed, with the grouped layout as an
                index (``ts.ops.moe_dispatch`` documents it); each rank chooses for itself.

        Returns:
            ``(recv_x, recv_w, counts, handle)`` as ``ts.ops.moe_dispatch`` documents; for FP8
            ``recv_x`` is a ``(values, scales)`` pair of views of the grouped (or received) bytes.
        """
        self._check_live()
        done = self._dispatch_direct(x, topk_idx, topk_weights, low_latency, in_place)
        if done is not MISSED:
            return done
        if self.fp8 and not is_fp8(x) and x.dtype != torch.float8_e4m3fn:
            x = quantize_fp8(x)
        values = x[0] if is_fp8(x) else x
        return self._dispatch(x, values, _check_routing(values, topk_idx, topk_weights, is_fp8(x)), topk_idx,
                              topk_weights, low_latency, in_place)

    def _dispatch(self, x: Rows, values: torch.Tensor, tokens: int, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, low_latency: bool, in_place: bool = False,
                  ) -> tuple[Rows, torch.Tensor, torch.Tensor, DispatchHandle]:
        """:meth:`dispatch` of rows whose shapes ``_check_routing`` has checked (``values``: ``x``'s
        values, ``tokens``: their rows), for ``ts.ops.moe_dispatch``, which checks them first.

        Everything one rank decides from the call's sizes and dtypes (the buffer fits, the mode's
        agreement at its first call, the ids' dtype, the kernels) is resolved at the first call
        of its key (:meth:`_call_plan`); later calls only move the tensors."""
        fp8 = values is not x
        key = (tokens, values.shape[1], values.dtype, fp8, topk_idx.shape[1], topk_idx.dtype, low_latency, in_place)
        plan = self._dispatches.get(key)
        if plan is None:
            plan = self._dispatches.put(key, self._call_plan(x, values, tokens, topk_idx, low_latency, in_place))
        sent = pack(x) if fp8 else x
        in_capture = capturing(values)
        if not plan.routed:  # no tokens: one row routed nowhere
            return self._dispatch_nothing(plan, sent, values, topk_weights, in_capture)
        ids = expert_ids(topk_idx, self.num_experts)
        weights = topk_weights.float().contiguous()
        # The routing kernels check the ids on the device; the check is read at the end of this
        # call or a later one (raise_bad_ids), queued behind the exchange; not in a graph.
        watch = watch_ids(topk_idx, self.num_experts) if not in_capture and ids.is_cuda else 0
        recv_x, layout, routes = self._send(plan, (sent, ids, weights), watch)
        if not in_capture and not ids.is_cuda:
            watch_ids(topk_idx, self.num_experts, bad=routes[5])
        if not in_capture and ids is topk_idx and weights is topk_weights:  # the caller's tensors, as they are
            self._direct.learn(("dispatch", low_latency, in_place), plan.send, (sent, ids, weights), self.state,
                               plan.signature)
        return self._routed(tokens, weights, recv_x, layout, routes, in_capture)

    def _dispatch_direct(self, x: Rows, topk_idx: torch.Tensor, topk_weights: torch.Tensor, low_latency: bool,
                         in_place: bool) -> tuple[Rows, torch.Tensor, torch.Tensor, DispatchHandle] | object:
        """A dispatch straight to the program learned on tensors of these layouts (rows, FP8 rows
        as a dispatch or ``quantize_fp8`` made them, ids and weights as the kernels take them:
        ``op_launch.Direct``), whose first call made every check one rank decides from them; the
        ranks' agreement is the kernels', as on every call. :data:`MISSED`: nothing done."""
        site = ("dispatch", low_latency, in_place)
        found = self._direct.find(site)
        if found is None:
            return MISSED
        sent = x if isinstance(x, torch.Tensor) else marked_rows(x) if is_fp8(x) and len(x) == 2 else None
        if sent is None:
            return MISSED
        watch = watch_ids(topk_idx, self.num_experts)  # sites exist on GPUs only: a pinned word the routing stores into
        try:
            out = self._direct(site, (sent, topk_idx, topk_weights), (watch,), found)
        except BaseException:  # a failed wait recorded, a refused launch: no kernel stores the word
            withdraw_watch()
            raise
        if out is MISSED:
            withdraw_watch()
            return MISSED
        recv_x, layout, routes = self._sent_outputs(out, in_place, self._receive_rows, views=self.fp8)
        return self._routed(sent.shape[0], topk_weights, recv_x, layout, routes, False)

    def _routed(self, tokens: int, weights: torch.Tensor, recv_x: Rows, layout: list[torch.Tensor],
                routes: list[torch.Tensor], in_capture: bool,
                ) -> tuple[Rows, torch.Tensor, torch.Tensor, DispatchHandle]:
        """A routed dispatch's result (``_send``'s rows, layout and routes; ``weights`` as sent)."""
        dest, slot, send_counts, expert_slot, expert_counts, *_, idx = routes  # *_: bad, on the CPU path
        handle = self._handle(tokens, idx, weights, expert_slot, dest, slot, send_counts, expert_counts, layout)
        if not in_capture:
            raise_bad_ids()
        return recv_x, layout[4], layout[0], handle

    def _call_plan(self, x: Rows, values: torch.Tensor, tokens: int, topk_idx: torch.Tensor, low_latency: bool,
                   in_place: bool) -> _SendPlan:
        """The plan of dispatches of ``tokens`` rows like ``values`` (``x``: FP8 rows where they
        differ) with ids like ``topk_idx``: every check one rank decides (in place, fits, the ids'
        dtype), the ranks' agreement on the mode at its first call, then the send (:meth:`_plan`)."""
        dtype = torch.float8_e4m3fn if values is not x else values.dtype
        if in_place and self.sets == 1:
            raise ValueError(f"moe dispatch: in place needs a buffer with two sets of receive rows, not {self!r}")
        if not self.fits(tokens, values.shape[1], topk_idx.shape[1], self.num_experts, dtype):
            raise ValueError(f"moe dispatch: {tokens} tokens x {values.shape[1]} ({dtype}), "
                             f"top-{topk_idx.shape[1]}, do not fit {self!r}")
        if low_latency not in self._modes:  # the ranks agree on the mode (at its first call; then on the device)
            check_same_across_ranks(self.state, "moe_dispatch", [self.max_tokens, self.hidden, self.topk,
                                                                 str(self.dtype), self.num_experts,
                                                                 f"low_latency={low_latency}", f"SMs={self.sms}"])
            self._modes.add(low_latency)
        # The dtype the routing reads the ids as: TypeError for ids of no integer dtype.
        return self._plan(tokens, pack(x) if self.fp8 else x, low_latency, id_dtype(topk_idx.dtype), in_place)

    def _dispatch_nothing(self, plan: _SendPlan, sent: torch.Tensor, values: torch.Tensor,
                          topk_weights: torch.Tensor, in_capture: bool,
                          ) -> tuple[Rows, torch.Tensor, torch.Tensor, DispatchHandle]:
        """A dispatch of no tokens from this rank (peers may send some): one row routed nowhere."""
        i32 = dict(dtype=torch.int32, device=values.device)
        dest, slot = torch.full((2, self.world, 1), -1, **i32)
        send_counts, expert_slot = torch.zeros(self.world, **i32), torch.zeros(1, self.topk, **i32)
        expert_counts, idx = torch.zeros(self.num_experts, **i32), torch.full((1, self.topk), -1, **i32)
        weights = _padded(topk_weights.float(), 0)
        recv_x, layout, _ = self._send(plan, (_padded(sent, 0), idx, weights, expert_slot, slot, send_counts,
                                              expert_counts))
        handle = self._handle(0, idx, weights, expert_slot, dest, slot, send_counts, expert_counts, layout)
        if not in_capture:
            raise_bad_ids()
        return recv_x, layout[4], layout[0], handle

    def _handle(self, tokens: int, idx: torch.Tensor, weights: torch.Tensor, expert_slot: torch.Tensor,
                dest: torch.Tensor, slot: torch.Tensor, send_counts: torch.Tensor, expert_counts: torch.Tensor,
                layout: list[torch.Tensor]) -> DispatchHandle:
        """The handle of the dispatch just sent: its routes and its grouped ``layout`` (``_send_launch``'s order)."""
        counts, offsets, recv_counts, position, _, source_row, row_expert = layout
        row_expert._ts_experts = self.per_rank  # a layout grouped_gemm need not check on the device
        return DispatchHandle(tokens, idx, weights, expert_slot, dest, slot, send_counts, expert_counts, recv_counts,
                              position, counts, offsets, row_expert, source_row, self.group, self, self._calls)

    def _plan(self, tokens: int, x: torch.Tensor, low_latency: bool, id_dtype: torch.dtype | None,
              in_place: bool = False) -> _SendPlan:
        """What every call sending ``tokens`` rows like ``x`` (expert ids of ``id_dtype`` to route;
        None: along known routes; ``in_place``: received rows left where they land) resolves
        alike (kernels, receive rows, flags, the call's signature, output sizes), made at the
        first such call: later ones skip that host work. Every call's agreement is the dispatch
        kernel's, on the device (``in_place`` is each rank's own: it changes no exchange)."""
        hidden, dtype = x.shape[1], x.dtype
        key = (tokens, hidden, dtype, low_latency, id_dtype, in_place)
        plan = self._plans.get(key)
        if plan is None:
            world, topk, held, rows = self.world, self.topk, max(tokens, 1), self.rows
            received = self._received(hidden, dtype)
            routed = bool(tokens and id_dtype)
            layout = id_dtype is not None  # a re-dispatch's rows follow a layout its dispatch returned
            ids_as = str(id_dtype).removeprefix("torch.")
            # Decode batches: the dispatch kernel routes its own tokens (one launch, not two).
            routes_itself = routed and routes_in_dispatch(self.max_tokens)
            kernel = dispatch_kernel(world, self.max_tokens, hidden, topk, self.per_rank, rows, tl_dtype(x), self.sms,
                                     low_latency, in_place=in_place, sets=self.sets,
                                     route_ids=ids_as if routes_itself else None, group=self.group)
            route = (router(world, tokens, topk, self.num_experts, ids_as, group=self.group)
                     if routed and not routes_itself else None)
            plan = self._plans.put(key, _SendPlan(
                send=self._send_launch(kernel, route, held, received,
                                       self._flags_of(low_latency, received), in_place, fp8_pair=self.fp8 and layout,
                                       layout=layout, routes_itself=routes_itself),
                routed=routed,
                # The call's identity names what every rank must agree on (not this rank's token
                # count): one set of receive rows, (ranks, max tokens, hidden), and their dtype.
                signature=signature("moe_dispatch", received[0], f"topk={topk}", f"experts={self.num_experts}",
                                    f"low_latency={low_latency}", f"SMs={self.sms}"),
                received=received, in_place=in_place, layout=layout))
            # The ranks meet once their kernels are built (a slow build must not time out the peers'
            # waits), once per buffer, mode and row type: not per token count or in_place, each rank's own.
            launch_together(self.state, "moe_dispatch", (self._serial, hidden, dtype, low_latency))
        return plan

    def _send_launch(self, kernel: DistributedKernel, route: Routing | None, held: int, received: torch.Tensor,
                     flags: tuple[torch.Tensor, torch.Tensor], in_place: bool, fp8_pair: bool = False,
                     layout: bool = True, routes_itself: bool = False) -> OpLaunch:
        """The routing kernels of ``route`` (None: the call passes known routes, or the dispatch
        kernel routes, ``routes_itself``) and the dispatch ``kernel``, in one ``OpLaunch`` with this
        buffer's ``received`` rows, ``flags`` and the rest bound. ``held``: the rows of the call's tensors.

        Routed, a call passes ``(x, ids, weights)`` and ``(bad_host, identity)``; else ``(x, ids,
        weights, expert_slot, slot, send_counts, expert_counts)`` and ``(identity,)``. Its outputs
        are the grouped layout (counts, offsets, received_counts, position, weight, source_row,
        row_expert), then where routed the routes (dest, slot, send_counts, expert_slot,
        expert_counts, bad, ids, and with routing kernels their chunk counts: ``route_count_kernel``
        says what each holds; pair (t, r) exists when token t has an expert on rank r, its slot at r
        is its order among this rank's tokens going to r), then the grouped rows unless
        ``in_place`` (the kernel's rows argument is then one row it never writes). The small ones
        are packed in one allocation. A call returns them all but the chunk counts, ``bad`` only
        on the CPU path (a GPU's count reaches the host word ``watch_ids`` gave), and the
        grouped layout only where ``layout`` (a re-dispatch returns its rows alone): the others
        are scratch. ``fp8_pair``: a dispatch of FP8 byte rows, whose grouped rows the call also
        returns as their ``(values, scales)`` views (``fp8.unpack``'s layout).
        """
        board, (ranges, progress) = call_board(self.state), flags
        bound = (received, self._idx, self._w, self._slot, self._counts, self._expert_counts, ranges, progress,
                 self._arrived, self._sends)
        world, topk, rows, i32 = self.world, self.topk, self.rows, torch.int32
        outputs = [Output(shape, dtype, packed=True, returned=layout) for shape, dtype in (
            ((self.per_rank,), i32), ((self.per_rank,), i32), ((world,), i32), ((world * self.max_tokens, topk), i32),
            ((rows,), torch.float32), ((rows,), i32), ((rows,), i32))]
        if route is not None or routes_itself:
            outputs += [Output(shape, i32, packed=True) for shape in (
                (world, held), (world, held), (world,), (held, topk), (self.num_experts,))]
            # The count of bad ids: on GPUs the routing stores it in the call's pinned host word (watch_ids).
            outputs += [Output((1,), i32, packed=True, returned=not received.is_cuda), Output((held, topk), i32,
                                                                                           packed=True)]
        if route is not None:
            outputs.append(Output(chunk_counts_shape(world, held, self.num_experts), i32, packed=True, returned=False))
        unused = torch.empty(1, received.shape[-1], dtype=received.dtype, device=received.device) if in_place else None
        views = []
        if not in_place:
            width = received.shape[-1]
            outputs.append(Output((rows, width), received.dtype))
            if fp8_pair:  # made with the outputs (in C++: no view op per call); pack() knows them
                views = pair_views(len(outputs) - 1, rows, self.hidden)

        def send(t: tuple, o: list, s: tuple) -> tuple:
            grouped = unused if in_place else o[-1]
            if routes_itself:  # the ids as passed; the routes are outputs
                return (*t, *o[7:14], *bound, *o[:7], grouped, board, s[0], s[1])
            if route is None:
                return (*t, *bound, *o[:7], grouped, board, s[0])
            dest, slot, send_counts, expert_slot, expert_counts, bad, ids, chunk_counts = o[7:15]
            return (t[0], ids, t[2], expert_slot, slot, send_counts, expert_counts, *bound, *o[:7], grouped, board,
                    s[1])

        steps = [] if route is None else [(route.count, lambda t, o, s: (t[1], *o[7:15], s[0]))]
        if route is not None and route.finish is not None:
            steps.append((route.finish, lambda t, o, s: (*o[8:15], s[0])))
        return OpLaunch([*steps, (kernel, send)], outputs, views=views, group=self.group)

    def _send(self, plan: _SendPlan, tensors: tuple, bad_host: int = 0,
              ) -> tuple[Rows, list[torch.Tensor], list[torch.Tensor]]:
        """One call of ``plan``'s kernels on ``tensors`` (``_send_launch``'s; ``bad_host`` where
        routed): the rows received (grouped, as an FP8 dispatch's ``(values, scales)`` pair, or in
        place the receive rows, (2 * world * max_tokens, hidden)), the grouped layout and the
        routes (where routed), as ``_send_launch`` orders them. The outputs are the caller's (a
        handle outlives the next call): new on every call."""
        ident = call_identity(self.state, plan.signature)[1]
        out = plan.send(tensors, (bad_host, ident) if plan.routed else (ident,))
        if not plan.layout:  # a re-dispatch: its grouped rows alone
            self._calls += 1
            return out, [], []
        return self._sent_outputs(out, plan.in_place, plan.received, bool(plan.send.views))

    def _sent_outputs(self, out: list[torch.Tensor], in_place: bool, received: torch.Tensor | None,
                      views: bool) -> tuple[Rows, list[torch.Tensor], list[torch.Tensor]]:
        """A send's outputs as its call returns them (``_send_launch``'s order, with the grouped
        layout) as ``_send`` returns them; the call counted. ``received``: its receive rows;
        ``views``: the outputs end with the FP8 rows' views."""
        self._calls += 1
        layout = out[:7]
        if in_place:
            recv_x = received.view(-1, received.shape[-1])
            layout[5]._ts_in_place = (self, self._calls, recv_x.shape[0])  # source_row, for check_in_place_rows
            if self.fp8:  # the received bytes' (values, scales)
                recv_x = unpack(recv_x, self.hidden)
        elif views:  # FP8: the grouped bytes' (values, scales), in the layout the views were made in
            recv_x = mark(out[-3], out[-2], out[-1], self._pair_layout)
        else:
            recv_x = out[-1]
        return recv_x, layout, out[7:self._routes_end]

    def redispatch(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Send the rows of ``x`` (tokens, any hidden) along the routes of ``handle``, grouped as
        it grouped them (see ``ts.ops.moe_redispatch``).

        Args:
            x: (tokens, hidden) rows, ``handle.tokens`` of them, contiguous on this rank's device; any
                hidden size and supported dtype.
            handle: The handle of a dispatch through this buffer.

        Returns:
            torch.Tensor: (rows, hidden) of ``x``'s dtype, grouped by local expert as the dispatch's ``recv_x``.

        Raises:
            ValueError: ``x`` is not (``handle.tokens``, hidden) or not contiguous on this rank's device.
            RuntimeError: the buffer is released.
        """
        routes = (handle.topk_idx, handle.topk_w, handle.expert_slot, handle.slot, handle.send_counts,
                  handle.expert_send_counts)
        out = self._direct(("redispatch",), (x, *routes))  # a learned layout: x's rows are the handle's tokens
        if out is not MISSED:
            self._calls += 1
            return out
        self._check_live()
        check_input(x, "x")
        if x.dim() != 2 or x.shape[0] != handle.tokens:
            raise ValueError(f"moe_redispatch: x must be (tokens={handle.tokens}, hidden), got {tuple(x.shape)}")
        plan = self._plan(handle.tokens, x, low_latency=False, id_dtype=None)
        sent = _padded(x, 0)
        recv_x = self._send(plan, (sent, *routes))[0]
        if sent is x and not capturing(x):
            self._direct.learn(("redispatch",), plan.send, (x, *routes), self.state, plan.signature)
        return recv_x

    def combine(self, expert_out: torch.Tensor, recv_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Weighted sum of each token's expert outputs, back on its source rank in its order
        (see ``ts.ops.moe_combine``).

        Args:
            expert_out: (rows, hidden) expert outputs in the dispatch's grouped order (``rows``: the
                buffer's grouped rows, as ``recv_x`` has), contiguous on this rank's device.
            recv_weights: (rows,) routing weights of the grouped rows (the dispatch's ``recv_w``).
            handle: The handle of a dispatch through this buffer.

        Returns:
            torch.Tensor: (handle.tokens, hidden) of ``expert_out``'s dtype, in this rank's token order.

        Raises:
            ValueError: wrong shapes, or an earlier dispatch found expert ids out of range.
            RuntimeError: the buffer is released.
        """
        out = self._combine_direct(expert_out, recv_weights, handle)
        if out is not MISSED:
            return out
        in_capture = capturing(expert_out)
        if not in_capture:
            raise_bad_ids()  # a bad expert id of an earlier dispatch, if the device has reported it by now
        self._check_live()
        check_input(expert_out, "expert_out")
        check_input(recv_weights, "recv_weights")
        rows, hidden = expert_out.shape
        if rows != self.rows or recv_weights.shape != (rows,):
            raise ValueError(f"expert_out must be ({self.rows}, hidden) and recv_weights ({self.rows},), got "
                             f"{tuple(expert_out.shape)} and {tuple(recv_weights.shape)}")
        tokens = handle.tokens
        key = (hidden, expert_out.dtype)
        plan = self._combines_by.get(key)
        if plan is None:  # the first combine of these rows: its kernel (any token count), return rows and signature
            back = self._returned(hidden, expert_out.dtype)  # expert_out's hidden size and dtype may differ from x's
            plan = self._combines_by[key] = (
                combine_kernel(self.world, self.max_tokens, hidden, self.topk, rows, tl_dtype(expert_out), self.sms,
                               group=self.group),
                back, signature("moe_combine", back, f"topk={self.topk}"), {})
            launch_together(self.state, "moe_combine", (self._serial, hidden, expert_out.dtype))
        kernel, back, sig, calls = plan
        call = calls.get(tokens)
        if call is None:  # per token count: the output's rows (and the kernel's count) differ
            call = calls[tokens] = OpLaunch(
                [(kernel, lambda t, o, s: (*t[:6], back, o[0], self._combines, s[0]))], [(max(tokens, 1), hidden)],
                group=self.group)
        weights = recv_weights.float().contiguous()
        tensors = (expert_out, weights, handle.position, handle.recv_counts, handle.dest, handle.slot)
        out = call(tensors, (numbered_signature(sig, handle.dispatch, "dispatch"),))  # ranks must agree on which
        if tokens and weights is recv_weights and not in_capture:
            self._direct.learn(("combine", *key), call, tensors)  # its one scalar: the signature, no call number
        return out if tokens else out[:0]

    def _combine_direct(self, expert_out: torch.Tensor, recv_weights: torch.Tensor,
                        handle: DispatchHandle) -> torch.Tensor | object:
        """A combine straight to the program learned on tensors of these layouts (``op_launch.Direct``),
        signed with its dispatch's number as every combine (its one scalar: combines take no call
        number); then the id check of earlier dispatches. :data:`MISSED`: nothing done."""
        if not handle.tokens or not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 2:
            return MISSED  # no tokens: the learned layouts of one token would match
        key = (expert_out.shape[1], expert_out.dtype)
        plan = self._combines_by.get(key)
        site = ("combine", *key)
        found = None if plan is None else self._direct.find(site)
        if found is None:
            return MISSED
        tensors = (expert_out, recv_weights, handle.position, handle.recv_counts, handle.dest, handle.slot)
        out = self._direct(site, tensors, (numbered_signature(plan[2], handle.dispatch, "dispatch"),), found)
        if out is not MISSED:
            raise_bad_ids()  # after the launch: the peers' combines wait for this one
        return out


def check_in_place_rows(index: torch.Tensor, rows: int) -> None:
    """Raise RuntimeError if ``index`` is the ``source_row`` of an in-place dispatch whose
    receive rows a later dispatch through the same buffer may have overwritten (peers write
    that set again once this rank's next dispatch is under way), or whose buffer is released;
    ValueError if the rows it is used with (``rows`` of them) are fewer than that dispatch's
    receive rows (another tensor than its ``recv_x``: the index would read past its end).

    Args:
        index: a grouped GEMM's row index (any other tensor passes).
        rows: rows of the tensor the index gathers from.
    """
    owner = getattr(index, "_ts_in_place", None)
    if owner is None:
        return
    buf, call, received = owner
    if buf.released or buf._calls != call:
        later = "it is released" if buf.released else f"{buf._calls - call} later dispatch(es) went through it"
        raise RuntimeError(f"these rows of an in-place dispatch are no longer valid: {later} ({buf!r}), so peers "
                           "may have written its receive rows again. Use in-place rows before the next dispatch "
                           "through the same buffer, or copy them (recv_x[handle.source_row]) first.")
    if rows < received:
        raise ValueError(f"grouped_gemm: index is an in-place dispatch's handle.source_row, into its {received} "
                         f"receive rows, but x has {rows}: pass that dispatch's recv_x")


def _check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, fp8: bool = False) -> int:
    """This rank's shapes (checked locally; the ranks' agreement is the buffer's and the kernels'); its tokens.
    FP8 values (``fp8``) may have any strides: ``pack`` moves them into byte rows where they are not already."""
    check_input(x, "x", contiguous=not fp8)
    if x.dim() != 2:
        raise ValueError(f"moe_dispatch: x must be (tokens, hidden), got {tuple(x.shape)}")
    if topk_idx.shape != topk_weights.shape or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"moe_dispatch: topk_idx {tuple(topk_idx.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (tokens={x.shape[0]}, topk)")
    return x.shape[0]


def _padded(t: torch.Tensor, value: float) -> torch.Tensor:
    """``t`` contiguous, or for no rows one row of ``value``: the kernels' inputs hold at least one row."""
    return t.contiguous() if t.shape[0] else torch.full((1, *t.shape[1:]), value, dtype=t.dtype, device=t.device)

