"""This process's own sockets, found by inode and shut from outside their owner.

A blocked read of a library's client (gloo's, a TCPStore's) has no call that ends
it; ``shutdown(2)`` on its socket does (the read fails at once, as if the peer had
hung up). Sockets are recognised by inode (``/proc/self/fd``), so a reused
descriptor number is never touched: take ``socket_inodes()`` before and after
the call that connects, and the difference is what it opened (with whatever
another thread opened meanwhile: callers filter it, or say so).
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Iterator, Set, Tuple


def open_sockets() -> Iterator[Tuple[int, str]]:
    """(descriptor, "socket:[inode]") for every socket this process has open now."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (or the listdir's own descriptor)
        if link.startswith("socket:"):
            yield int(fd), link


def socket_inodes() -> Set[str]:
    return {inode for _, inode in open_sockets()}


def shutdown(inodes: Set[str]) -> None:
    """shutdown(2) the connected sockets among ``inodes`` (listening ones are left
    alone: gloo treats a failed accept() as fatal)."""
    for _, sock in duplicates(lambda inode: inode in inodes):
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down by the peer


def connected_to(inodes: Set[str], port: int) -> Set[str]:
    """Those of ``inodes`` connected to a peer's ``port`` (a client's connections to a
    server there, not the server's ends of them)."""
    found = set()
    for inode, sock in duplicates(lambda inode: inode in inodes):
        try:
            if sock.getpeername()[1] == port:
                found.add(inode)
        except OSError:
            pass  # not connected
    return found


def duplicates(wanted: Callable[[str], bool]) -> Iterator[Tuple[str, socket.socket]]:
    """(inode, a duplicate) of each socket of this process whose inode ``wanted``
    accepts, the duplicate closed once the caller is done with it (the owner's
    descriptor stays valid)."""
    for fd, inode in open_sockets():
        if not wanted(inode):
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        try:
            yield inode, sock
        finally:
            sock.close()
