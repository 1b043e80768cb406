"""Exceptions tilescale raises for failures that happen on the device, and how they are described."""

from __future__ import annotations

import zlib

# The status record's layout and codes are the device protocol's (re-exported for the host).
from tilescale.protocol import BARRIER, COMPARISON_TEXT, MISMATCH, WAIT, WAIT_STATUS_FIELDS  # noqa: F401


class WaitTimeoutError(RuntimeError):
    """A device-side wait (``T.wait`` or ``T.barrier``) did not see its value within the timeout.

    The message names the rank, the block, the flag and the expected and observed values.
    The job's synchronisation state is undefined afterwards: end the job.
    """


class ShapeMismatchError(ValueError):
    """Ranks called a collective operation with different shapes, dtypes or operations.

    Found on the device, in the call itself (``T.agree``, or ``T.wait(..., agree=)``), before
    the call reads what peers sent. Raised on every rank, naming this rank's call and the first
    peer whose call differs; that call's output is not a result. The job's synchronisation
    state is undefined afterwards: end the job.
    """


class GroupedLayoutError(ValueError):
    """``ts.ops.grouped_gemm`` was given a row layout of the caller's own that breaks its
    contract (an expert id past the weights', a tile mixing experts, an index past ``x``'s
    rows): the rows the message names came out wrong. Found on the device, without a host
    synchronisation; raised at the next grouped GEMM, ``ts.synchronize()`` or ``ts.finalize()``.
    """


# What each call signature this process computed stands for, to name a peer's call in messages.
_described: dict[int, str] = {}


def call_signature(description: str) -> int:
    """A positive 31-bit number standing for ``description`` (an operation and its shapes),
    remembered so that a :class:`ShapeMismatchError` can print it.

    Example::

        sig = call_signature("all_reduce (8,) float32 one_shot")   # pass to the kernel, for T.agree
    """
    sig = zlib.crc32(description.encode()) & 0x7FFFFFFF
    _described[sig] = description
    return sig


# Numbered signatures: a call's signature combined with the number of what it acts on (which
# dispatch a combine brings back). Modulo the prime 2**31 - 1 the combination inverts, so a
# peer's numbered signature decodes to its call without any record of the numbers signed.
_NUMBERED_MOD = 0x7FFFFFFF
_NUMBERED_MUL = 0x5BD1E995 % _NUMBERED_MOD
_NUMBERED_INV = pow(_NUMBERED_MUL, -1, _NUMBERED_MOD)
_last_numbers: dict[str, int] = {}  # per kind (e.g. "dispatch"), the last number this process signed with


def numbered_signature(sig: int, number: int, kind: str) -> int:
    """``sig`` (:func:`call_signature`) for a call acting on ``kind`` number ``number``, so that
    ranks acting on different ones disagree (``T.agree``) although their shapes match.

    Example::

        sig = numbered_signature(combine_sig, handle.dispatch, "dispatch")   # which dispatch is combined

    Args:
        sig: The call's signature.
        number: The number of what it acts on, counted alike on every rank (>= 0).
        kind: What is numbered, for messages ("... of dispatch #5").

    Returns:
        int: A positive 31-bit number; :class:`ShapeMismatchError` messages decode it back.
    """
    _last_numbers[kind] = number
    return (sig * _NUMBERED_MUL + number) % _NUMBERED_MOD or _NUMBERED_MOD


def _description(sig: int) -> str | None:
    """What ``sig`` stands for: a call this process signed, or one numbered within 256 of the
    last number of its kind this process used (None if neither)."""
    found = _described.get(sig)
    if found is not None:
        return found
    for kind, last in _last_numbers.items():
        for number in range(max(0, last - 256), last + 257):
            base = (sig % _NUMBERED_MOD - number) * _NUMBERED_INV % _NUMBERED_MOD
            if base in _described:
                return f"{_described[base]} of {kind} #{number}"
    return None


def describe_timeout(record: dict[str, int], flag_name: str | None = None, timeout_s: float | None = None) -> str:
    """The message of a :class:`WaitTimeoutError` for one status record.

    Args:
        record: One wait-status record (``kind``, ``rank``, ``block``, ``address``, ``comparison``,
            ``expected``, ``observed``), as the device wrote it.
        flag_name: The flag's name if known (e.g. ``"flags[3]"``); None names it by address.
        timeout_s: The wait's bound in seconds, mentioned if given.

    Returns:
        str: One message naming the rank, block, operation (``T.wait`` or ``T.barrier()``), the
        awaited condition and the value observed.
    """
    what = "T.barrier()" if record["kind"] == BARRIER else "T.wait"
    flag = flag_name or f"flag at {record['address']:#x}"
    after = f" after {timeout_s:g} s" if timeout_s is not None else ""
    return (
        f"rank {record['rank']}, block {record['block']}: {what} timed out{after} waiting for "
        f"{flag} {COMPARISON_TEXT[record['comparison']]} {record['expected']} (observed {record['observed']}). "
        "A peer never signalled: did a rank skip a signal, crash, run a different kernel sequence, or get "
        "here later than this bound (the first call of a kernel of your own, or of a MoE op, compiles its "
        "kernels with no host barrier before: on a loaded host raise TILESCALE_WAIT_TIMEOUT_S)?"
    )


def describe_mismatch(record: dict[str, int]) -> str:
    """The message of a :class:`ShapeMismatchError` for one status record."""
    mine, theirs = record["expected"], record["observed"]
    own = _description(mine) or f"a call with signature {mine:#x}"
    other = _description(theirs)
    peer = f"rank {record['address']}"
    passed = f"{peer}: {other}" if other is not None else \
        f"{peer} passed a different shape, dtype or operation (signature {theirs:#x}, not a call this rank has made)"
    return (f"ranks called a collective with different arguments (rank {record['rank']}: {own}; {passed}); "
            "that call's output is not a result")
