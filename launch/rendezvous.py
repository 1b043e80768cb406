"""The job's store: who hosts it, how ranks join it, and how a rank's exit reaches the others.

Every rank meets the others through one c10d ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``.
``tilescale run`` hosts it itself on the node of rank 0 (``TILESCALE_STORE_HOSTED=1`` tells the
ranks so): the port is taken before any rank starts, so a second job given the same port is
refused at once, the store outlives a crashed rank 0, and the launcher publishes every rank's
exit in it. Under other launchers rank 0 hosts it (torchrun's agent hosts its own).

The host writes the job's *launch id* (``TILESCALE_LAUNCH_ID``, or what the launcher gives,
see :func:`tilescale.launch.environment.detect`) under :data:`LAUNCH_KEY`; a rank that finds
another id there has met a foreign job's store and raises :class:`ForeignJobError` naming
the port, before writing anything into it.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

LAUNCH_ID_VAR = "TILESCALE_LAUNCH_ID"
HOSTED_VAR = "TILESCALE_STORE_HOSTED"
# This node's launcher: the prefix of the job's files in /dev/shm, so that it can remove them.
JOB_KEY_VAR = "TILESCALE_JOB_KEY"
LAUNCH_KEY = "tilescale/launch_id"
# How often a rank that waits for others says so, and the slice of one connection attempt.
PROGRESS_S = 5.0
_CONNECT_SLICE_S = 2.0
# A store client's connect, once nothing listens, retries inside torch with a jittered
# backoff (a 2 s attempt took 3-6 s): connect() first checks with a plain socket that
# something accepts at the address, every _PROBE_PAUSE_S, so its progress is said on time.
_PROBE_S, _PROBE_PAUSE_S = 1.0, 0.1


class PortInUseError(RuntimeError):
    """The rendezvous port is taken on this node (by another job, or any other program)."""


class ForeignJobError(RuntimeError):
    """The store at the rendezvous address belongs to another launch."""


def port_in_use_message(port: int) -> str:
    """The error for a taken ``port``: what to do about it.

    Args:
        port: the port.

    Returns:
        The message.
    """
    return (
        f"port {port} is already in use on this node (another job's store?); give another --master-port / "
        "MASTER_PORT, or leave --master-port out for a free one"
    )


def host_store(port: int, launch_id: str, timeout_s: float) -> dist.TCPStore:
    """Host the job's store on ``port`` of every local interface (0: a free port, see ``.port``).

    Example::

        store = host_store(0, "3f2a9c0e1b7d", 300)   # store.port is the port taken

    Raises :class:`PortInUseError` naming the port when it is taken.

    Args:
        port: the port, 0 for a free one.
        launch_id: this launch's id, written for ranks to check (:func:`verify_launch`).
        timeout_s: the store's timeout for waits on it.

    Returns:
        The store (its server lives as long as this object).
    """
    try:
        store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    except dist.DistNetworkError as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            raise PortInUseError(port_in_use_message(port)) from None
        raise
    store.set(LAUNCH_KEY, launch_id)
    return store


class Progress:
    """Calls ``say(seconds waited)`` at most every ``every`` seconds of a wait.

    Example::

        progress = Progress(5.0)
        while not ready():
            progress.tick(lambda s: print(f"waited {s:.0f} s"))
    """

    def __init__(self, every: float):
        self.every = every
        self.start = time.monotonic()
        self.said = 0.0

    def elapsed(self) -> float:
        """Seconds since the wait began.

        Returns:
            The seconds.
        """
        return time.monotonic() - self.start

    def tick(self, say_it: Callable[[float], None] | None) -> None:
        """Call ``say_it(seconds waited)`` if ``every`` seconds passed since it was last called.

        Args:
            say_it: the callback; None: nothing is said.
        """
        elapsed = self.elapsed()
        if elapsed - self.said >= self.every:
            if say_it is not None:
                say_it(elapsed)
            self.said = elapsed


def connect(addr: str, port: int, timeout_s: float, say_it: Callable[[float], None] | None = None,
            every: float = PROGRESS_S) -> dist.TCPStore:
    """A client of the store at ``addr:port``, retrying until ``timeout_s``; ``say_it(seconds)``
    is called every ``every`` seconds of waiting (to tell the user who is being waited for).

    Example::

        store = connect("10.0.0.1", 29500, 300, lambda s: print(f"waited {s:.0f} s"))

    Args:
        addr: the host of the store.
        port: its port.
        timeout_s: seconds to keep retrying.
        say_it: called with the seconds waited, every ``every`` seconds; None: silent.
        every: seconds between calls of ``say_it``.

    Returns:
        The client.
    """
    progress = Progress(every)
    while True:
        left = timeout_s - progress.elapsed()
        if _accepts(addr, port, max(0.1, min(_PROBE_S, left))):
            try:
                store = dist.TCPStore(addr, port, None, False,
                                      timedelta(seconds=max(0.1, min(_CONNECT_SLICE_S, every, left))))
            except dist.DistNetworkError:
                pass
            else:
                store.set_timeout(timedelta(seconds=timeout_s))
                return store
        if progress.elapsed() >= timeout_s:
            raise TimeoutError(
                f"no store answered at {addr}:{port} within {timeout_s:g} s (is rank 0, or the launcher "
                "of its node, running, and MASTER_ADDR/MASTER_PORT right?)"
            )
        progress.tick(say_it)
        time.sleep(_PROBE_PAUSE_S)


def _accepts(addr: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a connection at ``addr:port`` within ``timeout_s`` (the
    connection is closed at once; a store's server ignores it)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def verify_launch(store: dist.Store, launch_id: str, where: str, timeout_s: float,
                  say_it: Callable[[float], None] | None = None, every: float = PROGRESS_S) -> None:
    """Raise :class:`ForeignJobError` unless the store's launch id is ``launch_id`` (waiting for
    the host to write it). Reads only, so a rank of another job leaves nothing behind.

    Example::

        verify_launch(store, "3f2a9c0e1b7d", "127.0.0.1:29500", 300)

    Args:
        store: the job's store.
        launch_id: this rank's launch id.
        where: ``addr:port``, for the messages.
        timeout_s: seconds to wait for the host to write its id.
        say_it: called with the seconds waited, every ``every`` seconds; None: silent.
        every: seconds between calls of ``say_it``.
    """
    progress = Progress(every)
    while not store.check([LAUNCH_KEY]):
        if progress.elapsed() >= timeout_s:
            raise TimeoutError(f"the store at {where} never received its job's launch id within {timeout_s:g} s")
        progress.tick(say_it)
        time.sleep(0.01)
    found = store.get(LAUNCH_KEY).decode()
    if found != launch_id:
        raise ForeignJobError(
            f"the store at {where} belongs to another job (launch id {found!r}, this rank's {launch_id!r}): "
            f"two jobs were given port {where.rsplit(':', 1)[1]}; give each job its own --master-port / MASTER_PORT"
        )


def exit_key(rank: int) -> str:
    """The store key under which rank ``rank``'s exit is published.

    Args:
        rank: the global rank.

    Returns:
        The key.
    """
    return f"tilescale/exited/{rank}"


def publish_exit(store: dist.Store, rank: int, code: int | None) -> None:
    """Record in ``store`` that ``rank`` has exited (``code`` None: not known yet, e.g. at exit).

    Best effort: a store that is gone (its host has exited) is ignored.

    Args:
        store: the job's store.
        rank: the global rank that exited.
        code: its exit status, or None when not known yet.
    """
    with contextlib.suppress(Exception):  # c10d raises its own error types, by version
        store.set(exit_key(rank), "" if code is None else str(code))


def linger(store: dist.Store, ranks: list[int], seconds: float) -> None:
    """Wait until each of ``ranks`` has published its exit, at most ``seconds``: what a rank
    that hosts the store does at exit, so that peers waiting for it read that it exited
    rather than lose the store.

    Args:
        store: the job's store.
        ranks: the ranks to wait for.
        seconds: the most to wait.
    """
    deadline = time.monotonic() + seconds
    with contextlib.suppress(Exception):  # c10d raises its own error types, by version
        while time.monotonic() < deadline and not store.check([exit_key(r) for r in ranks]):
            time.sleep(0.02)


def describe_exit(value: str) -> str:
    """What a published exit value says, e.g. ``exited with code 0``.

    Args:
        value: the value under :func:`exit_key`.

    Returns:
        The words, for an error message.
    """
    if not value:
        return "exited"
    code = int(value)
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def say(message: str) -> None:
    """One line on stderr, flushed (the progress of a wait).

    Args:
        message: the line.
    """
    print(f"tilescale: {message}", file=sys.stderr, flush=True)
