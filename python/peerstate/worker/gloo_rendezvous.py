"""Ending a gloo rendezvous or a gloo group's waits from outside it, by their sockets.

gloo offers no call that wakes a rendezvous or an operation blocked on a peer
(``ProcessGroups`` says which waits these reach, and which none does). What
does: ``shutdown(2)`` on the connected sockets (the blocked read fails with
"Connection closed by peer"), and, for a pair whose peer was to connect and
never will, a connection to the listener that writes the sequence number the
pair waits for, then hangs up. Sockets are recognised by inode
(``/proc/self/fd``), so a reused descriptor number is never touched.

``FormationWatch`` gives up a rendezvous that makes no progress: the group's
timeout cannot be the bound, because gloo keeps the timeout a group was
created under for its point-to-point waits (see ``ProcessGroups.form``).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Callable, Optional, Set

from peerstate.control.sockets import duplicates


def end_connect_waits(before: Set[str], size: int) -> None:
    """Connect to every listening socket opened since ``before`` and write each of the
    sequence numbers 0..``size``-1 (gloo's ``sequence_number_t``, native order), then
    hang up: the pairs of a gloo rendezvous waiting for a dead peer to connect stop
    waiting. Never blocks long: local connections, each bounded by a second."""
    listeners = []
    for sock in duplicates(lambda inode: inode not in before):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                listeners.append((sock.family, sock.getsockname()))
        except OSError:
            pass  # closed meanwhile
    for family, address in listeners:
        for sequence in range(size):
            try:
                with socket.socket(family, socket.SOCK_STREAM) as hangup:
                    hangup.settimeout(1.0)
                    hangup.connect(address)
                    hangup.sendall(struct.pack("=q", sequence))
            except OSError:
                break  # the listener closed meanwhile: its rendezvous failed already


class FormationWatch:
    """Calls ``give_up()`` once, from its own thread, when ``progress()`` (a count that
    grows as the rendezvous completes groups) has not changed for ``seconds``; never
    after the ``with`` block ends. ``seconds`` None: watches nothing. ``give_up`` must
    not block long (it ends the rendezvous's waits: ``ProcessGroups``)."""

    def __init__(self, seconds: Optional[float], progress: Callable[[], int], give_up: Callable[[], None]) -> None:
        self.seconds = seconds
        self._progress, self._give_up = progress, give_up
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.gave_up = False

    def __enter__(self) -> "FormationWatch":
        if self.seconds is not None:
            self._thread = threading.Thread(target=self._watch, name="peerstate-formation-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        seen, since = self._progress(), time.monotonic()
        while not self._done.wait(self.seconds / 8):
            now = self._progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= self.seconds:
                self.gave_up = True
                self._give_up()
                return
