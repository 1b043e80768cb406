"""Exceptions tilescale raises for failures that happen on the device."""

from __future__ import annotations


class WaitTimeoutError(RuntimeError):
    """A device-side wait (``T.wait`` or ``T.barrier``) did not see its value within the timeout.

    The message names the rank, the block, the flag and the expected and observed values.
    The job's synchronisation state is undefined afterwards: end the job.
    """


# Layout of the int64 record a timed-out device wait fills in (see tilescale.language.sync).
WAIT_STATUS_FIELDS = ("state", "rank", "block", "address", "comparison", "expected", "observed", "kind")
# T.wait comparison codes (tilescale.language.sync.COMPARISONS) as text.
COMPARISON_TEXT = ("==", "!=", ">=", ">", "<=", "<")


def describe_timeout(record: dict[str, int], flag_name: str | None = None, timeout_s: float | None = None) -> str:
    """The message of a :class:`WaitTimeoutError` for one status record."""
    what = "T.barrier()" if record["kind"] == 1 else "T.wait"
    flag = flag_name or f"flag at {record['address']:#x}"
    after = f" after {timeout_s:g} s" if timeout_s is not None else ""
    return (
        f"rank {record['rank']}, block {record['block']}: {what} timed out{after} waiting for "
        f"{flag} {COMPARISON_TEXT[record['comparison']]} {record['expected']} (observed {record['observed']}). "
        "A peer never signalled: did a rank skip a signal, crash, or run a different kernel sequence?"
    )
