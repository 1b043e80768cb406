"""The device protocol: the numbers kernels and the host agree on, defined once.

Example::

    from tilescale.protocol import COMPARISONS, EPOCH_WORD
    COMPARISONS["ge"]          # 2: the code T.wait passes for "ge"
    workspace[EPOCH_WORD]      # barriers completed so far, in a group's barrier workspace

The device side is ``tilescale/language/device.cuh`` (package data, placed at the top of
every generated kernel, with a device lowering's own helpers after it). It writes these
numbers as literals, so a generated kernel needs no tilescale header at compile time;
``tests/test_language.py`` checks the header against the constants here. The language
(``tilescale.language.sync``), the host (``tilescale.runtime``, ``tilescale.errors``) and the
CPU interpreter all use this module.
"""

from pathlib import Path

# T.wait's comparisons and their codes (tilescale::compare), and the codes as text.
COMPARISONS = {"eq": 0, "ne": 1, "ge": 2, "gt": 3, "le": 4, "lt": 5}
COMPARISON_TEXT = ("==", "!=", ">=", ">", "<=", "<")
# T.signal's operations: set or add.
SIGNAL_OPS = {"set": 0, "add": 1}

# The int64 record a failed device wait or agreement fills in (tilescale::report_failure).
WAIT_STATUS_FIELDS = ("state", "rank", "block", "address", "comparison", "expected", "observed", "kind")
# ``kind`` of a record: T.wait, T.barrier(), T.agree (then ``address`` is the peer rank and
# ``expected``/``observed`` are this rank's and the peer's call signatures).
WAIT, BARRIER, MISMATCH = 0, 1, 2

# A group's barrier workspace (int32 words per rank, tilescale::grid_barrier): three counters,
# each on its own 128-byte line (blocks arrived, barriers completed, arrivals from ranks),
# then T.agree's call signatures, two slots per rank of the group.
ARRIVED_WORD, EPOCH_WORD, ARRIVALS_WORD = 0, 32, 64
SYNC_WORKSPACE_WORDS = 96  # where the signatures start


def sync_workspace_words(world: int) -> int:
    """Words of the barrier workspace of a group of ``world`` ranks.

    Example::

        sync_workspace_words(4)     # 104
    """
    return SYNC_WORKSPACE_WORDS + 2 * world


# The device side of the protocol, and the address lowering's helpers.
DEVICE_HEADER = Path(__file__).parent / "language" / "device.cuh"
