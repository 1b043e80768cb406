"""What the library kernels share: launch sizing, dtype names, symmetric workspaces.

Workspaces and shape checks belong to a process group: they live in its state
(``tilescale.groups.GroupState``), which every op resolves from its ``group=`` first.
"""

from __future__ import annotations

import functools
import os

import tilelang  # noqa: F401 - makes TileLang's TVM importable as tvm
import torch
import tvm
from tvm import tirx

from tilescale import runtime
from tilescale.errors import call_signature
from tilescale.groups import GroupState
from tilescale.plans import PlanCache
from tilescale.symmetric import check_group, lookup

TORCH_TO_TL = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}

_signatures: dict[tuple, int] = {}

# The ops' call plans (see tilescale.plans): keyed by the op's name, its tensors' layout_key() or tensor_key(),
# its options and its group; a plan is what the op's first call of that key resolved.
op_plans = PlanCache(limit=1024)


def layout_key(t: torch.Tensor) -> tuple | None:
    """What an op's checks of the tensor ``t`` depend on (shape, dtype, device, contiguity): the
    part of an op's plan key that ``t`` gives, for tensors whose symmetric allocation (or not)
    changes nothing in the plan (a kernel's symmetric arguments are checked by address).

    Example::

        key = ("gemm_all_reduce", layout_key(a), layout_key(weight), group)   # a and weight checked once

    Anything but a tensor gives None: the op's first-call checks then say what is wrong.
    """
    if not isinstance(t, torch.Tensor):
        return None
    return t.shape, t.dtype, t.get_device(), t.is_contiguous()


def tensor_key(t: torch.Tensor) -> tuple | None:
    """:func:`layout_key` and the group of ``t``'s symmetric allocation (None if it has none),
    for ops whose plan depends on it (staged or in place).

    Example::

        key = ("all_reduce", tensor_key(x), algorithm, group)
    """
    found = lookup(t)
    return layout_key(t), found[0].group if found is not None else None


def tl_dtype(t: torch.Tensor) -> str:
    """TileLang's name of ``t``'s dtype; TypeError for dtypes the kernels do not handle."""
    if t.dtype not in TORCH_TO_TL:
        raise TypeError(f"dtype {t.dtype} is not supported; use one of {sorted(map(str, TORCH_TO_TL))}")
    return TORCH_TO_TL[t.dtype]


def check_input(t: torch.Tensor, name: str, contiguous: bool = True) -> None:
    """Inputs must be tensors on this rank's device, contiguous unless the op copies them.

    Args:
        t: The input.
        name: Its parameter name, for the messages.
        contiguous: Whether ``t`` must be contiguous (default True).

    Raises:
        TypeError: ``t`` is not a ``torch.Tensor``.
        ValueError: ``t`` is on another device than this rank's, or not contiguous.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dev, on = runtime.device(), t.device  # t.device makes a new object: read once
    if on != dev and (on.type != dev.type or dev.index is not None):
        raise ValueError(f"{name} is on {on}, but this rank computes on {dev}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one dimension (``t`` itself when it has one: no view made per call)."""
    return t if t.dim() == 1 else t.reshape(-1)


def poison_value(dtype: str) -> tirx.PrimExpr:
    """What a kernel fills its output with when its ranks disagreed on the call (``T.agree``),
    so that it cannot pass for a result: NaN, or an integer dtype's minimum."""
    return tirx.min_value(dtype) if dtype.startswith(("int", "uint")) else tirx.const(float("nan"), dtype)


def element_bytes(like: torch.Tensor | str) -> int:
    """Bytes of one element of a tensor, or of a TileLang dtype.

    Example::

        element_bytes("bfloat16")    # 2

    Args:
        like: A tensor or a TileLang dtype string.

    Returns:
        int: The element size in bytes.
    """
    return like.element_size() if isinstance(like, torch.Tensor) else tvm.DataType(like).bits // 8


def vector_width(numel: int, like: torch.Tensor | str) -> int:
    """Elements per 16-byte vector that evenly divide ``numel``: the kernels' sizes are
    ``vectors * width``, so TileLang can prove 16-byte accesses aligned and in bounds.

    Also the ``coalesced_width`` of a row copy (``T.copy(..., coalesced_width=)``): left to
    itself TileLang first splits a row among the block's threads and vectorises what each
    gets, so a row that is not a multiple of threads x 16 bytes (every packed FP8 row, bf16
    rows of 2880 or 3584) moves in 1- to 8-byte pieces; a fixed width keeps 16-byte accesses
    and guards the last vectors.

    Args:
        numel: Elements the kernel moves (a row's, for a row copy).
        like: A tensor of the kernel's dtype (its element size), or the TileLang dtype.

    Returns:
        int: A power of two, at most ``16 // element_size``, dividing ``numel`` (1 at worst).
    """
    width = max(1, 16 // element_bytes(like))
    while numel % width:
        width //= 2
    return width


def sm_count() -> int:
    """Blocks a persistent kernel launches at most: one per SM, so every block is resident
    and device-scope barriers cannot deadlock."""
    return _sm_count(runtime.device())


@functools.cache
def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def workspace(state: GroupState, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A symmetric scratch tensor of the group, reused across calls (allocating it is collective).

    Args:
        state: The group's state.
        key: What the scratch is for; one tensor per (key, numel, dtype).
        numel: Elements.
        dtype: Element type.

    Returns:
        torch.Tensor: A 1-D symmetric tensor, contents unspecified (the same one at later calls).
    """
    k = (key, numel, dtype)
    found = state.workspaces.get(k)
    if found is None:
        found = state.workspaces[k] = state.allocate((numel,), dtype)
    return found


def symmetric_in(t: torch.Tensor, state: GroupState, name: str) -> bool:
    """Whether ``t`` is symmetric over the group of ``state``; ValueError if it is symmetric over another.

    Args:
        t: The tensor.
        state: The group's state.
        name: Its parameter name, for the message.

    Returns:
        bool: Whether ``t`` is (a view of) a symmetric tensor of this group.

    Raises:
        ValueError: ``t`` is symmetric over another group.
    """
    found = lookup(t)
    if found is not None:
        check_group(found[0].group, state, name)
    return found is not None


def staging(state: GroupState, t: torch.Tensor, key: str, name: str = "x") -> torch.Tensor | None:
    """None when ``t`` is symmetric over the group (peers read it in place), else a symmetric
    workspace of the group, viewed as ``t``, that calls copy ``t`` into (reused across calls).

    Example::

        staged = staging(state, x, "reduce_scatter.in")     # at the first call of a shape
        src = x if staged is None else staged.copy_(x)       # at every call

    Args:
        state: The group's state.
        t: The op's input.
        key: The workspace's key (:func:`workspace`).
        name: ``t``'s parameter name, for the message.

    Returns:
        None, or a symmetric tensor of ``t``'s shape and dtype (contents unspecified).
    """
    if symmetric_in(t, state, name):
        return None
    return workspace(state, key, t.numel(), t.dtype).view(t.shape)


def signature(op: str, t: torch.Tensor, *details: object) -> int:
    """The call signature of ``op`` on ``t`` (its shape and dtype) and ``details``, for ``T.agree``
    (see ``tilescale.language.sync``): kernels compare it across ranks on every call.

    Example::

        sig = signature("all_reduce", x, "one_shot")    # a kernel's scalar argument

    Args:
        op: The op's name.
        t: The tensor whose shape and dtype the signature names.
        *details: Anything else the ranks must agree on (plan, tile, ...), by ``str``.

    Returns:
        int: A positive 31-bit number (:func:`tilescale.errors.call_signature`), cached per distinct call.
    """
    key = (op, tuple(t.shape), t.dtype, details)
    sig = _signatures.get(key)
    if sig is None:  # once per distinct call: later calls cost a dict lookup
        text = " ".join([op, str(tuple(t.shape)), str(t.dtype).removeprefix("torch."), *map(str, details)])
        sig = _signatures[key] = call_signature(text)
    return sig


def call_identity(state: GroupState, sig: int) -> tuple[torch.Tensor, int]:
    """The group's call board and this call's identity on it, for kernels whose ranks meet in
    flags: they ``T.announce`` the identity and wait with ``agree=(board, identity)``, so a
    rank whose call differs ends the waits with a ShapeMismatchError instead of a timeout.

    Example::

        board, ident = call_identity(state, signature("gemm_all_reduce", a, n))   # kernel arguments

    The identity is ``(call number << 32) | sig``; the call number counts this process's calls
    on the group, through here and through ``op_launch.Direct`` (one counter), so it is the same
    on every rank of the group for the same call.
    A CUDA graph replays the number it captured, which every rank's graph replays alike.

    Args:
        state: The group's state.
        sig: The call's signature (:func:`signature`).

    Returns:
        tuple[torch.Tensor, int]: The board (symmetric int64, ``2 * size`` slots) and the identity.
    """
    board = state.workspaces.get(("call board",))
    if board is None:
        board = call_board(state)
    counter = state.call_counter
    counter.value = counter.value % 0x7FFFFFFF + 1
    return board, (counter.value << 32) | sig


def call_board(state: GroupState) -> torch.Tensor:
    """The group's call board (:func:`call_identity`), allocated, collectively, at first use.

    Example::

        peer_ptrs(call_board(state))     # its peer table made before a CUDA graph capture
    """
    key = ("call board",)
    if key not in state.workspaces:
        runtime.check_not_capturing(f"the call board of the {state.describe()}")
        state.workspaces[key] = state.allocate((2 * state.size,), torch.int64)  # 0: no call announced
    return state.workspaces[key]


def check_same_across_ranks(state: GroupState, what: str, value: list, every_call: bool = False) -> None:
    """Ranks must agree on the shapes: checked at a shape's first call (a host round trip,
    before its buffers are allocated), or at ``every_call`` (for calls that launch no kernel).

    Every later call is compared on the device by the op's kernels (``T.agree``, or the call
    board: :func:`call_identity`), which raise ShapeMismatchError on every rank.

    Args:
        state: The group's state.
        what: The op's name, for the message and the check's key.
        value: What every rank must pass alike (JSON-like values).
        every_call: Exchange at every call, not only at the first of ``value``.

    Raises:
        ValueError: the ranks' values differ (every rank raises, naming each rank's).
    """
    key = (what, *value)
    if key in state.verified and not every_call:
        return
    values = state.comm.exchange(state.comm.next_tag(what), value)
    if any(v != value for v in values):
        detail = "; ".join(f"rank {r}: {v}" for r, v in zip(state.ranks, values, strict=True))
        where = "" if state.whole_job else f" of the {state.describe()}"
        raise ValueError(f"{what}: shapes differ across ranks{where} ({detail})")
    state.verified.add(key)


def build_timeout_s() -> float:
    """How long a rank waits for its peers to build a new plan's kernels (``TILESCALE_BUILD_TIMEOUT_S``,
    default 600: a cold compile of several kernels, many jobs compiling on one host)."""
    return float(os.environ.get("TILESCALE_BUILD_TIMEOUT_S", "600"))


def launch_together(state: GroupState, what: str, key: tuple) -> None:
    """A host barrier of the group once a new plan's kernels are built, before their first launch.

    Compiling a plan's kernels can take a rank a minute longer than its peers (a cold cache,
    many jobs compiling on one host). Without this, the peers' kernels would wait on the device
    for it past the wait bound (``TILESCALE_WAIT_TIMEOUT_S``) and fail with WaitTimeoutError
    though nothing is wrong; with it they wait on the host, where the bound is the build's
    (:func:`build_timeout_s`) and a peer that exits is named at once. Only at a plan's first
    call, and only in ops that every rank of the group calls alike (not one-sided puts).

    Once per plan key and group: a rank that builds a plan again on its own (its plan caches
    emptied when it freed symmetric memory, at a moment of its own) meets no one, as its peers,
    launching from their cached plans, would not come.

    Example::

        launch = make_plan(...)                         # compiles the kernels
        launch_together(state, "all_gather_gemm", key)  # every rank has them
        launch(...)

    Args:
        state: The group's state.
        what: The op's name, for the barrier's tag (and a timeout's message).
        key: The plan's key (:mod:`tilescale.plans`).

    Raises:
        TimeoutError: a peer did not finish building within :func:`build_timeout_s`, naming it.
        PeerExitedError: a peer exited while this rank waited.
    """
    if state.size > 1 and key not in state.launched:
        state.comm.barrier(state.comm.next_tag(f"{what}: kernels built"), timeout_s=build_timeout_s())
    state.launched.add(key)
