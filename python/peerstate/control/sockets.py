"""This process's own sockets, found by inode and shut from outside their owner.

A blocked read of a library's client (gloo's, a TCPStore's) has no call that ends
it; ``shutdown(2)`` on its socket does (the read fails at once, as if the peer had
hung up). Sockets are recognised by inode (``/proc/self/fd``), so a reused
descriptor number is never touched. What a call connects is found either as the
difference of ``socket_inodes()`` before and after it (a scan of every
descriptor: for calls that open many, a gloo rendezvous), or, for one
connection, at ``lowest_free_descriptor()`` taken just before (two system
calls). Either may take in what another thread opened meanwhile: callers filter
it, or say so.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Iterator, Optional, Set, Tuple


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
    for sock in duplicates(lambda inode: inode in inodes):
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down by the peer


def lowest_free_descriptor() -> int:
    """The descriptor the next socket() of this process gets, unless another thread
    takes it first (POSIX: the lowest one not in use). Two system calls: finding a new
    connection this way costs nothing however many sockets the process holds (a worker
    of a large gloo group holds one per peer)."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


def connection_at(fd: int, port: int) -> Set[str]:
    """{the inode of descriptor ``fd``} if it is a socket connected to a peer's ``port``
    (a client's connection to a server there, not the server's end of it); else empty."""
    try:
        inode = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return set()  # not open
    sock = _duplicate(fd, inode)
    if sock is None:
        return set()
    with sock:
        try:
            connected = sock.getpeername()[1] == port
        except OSError:
            connected = False
    return {inode} if connected else set()


def duplicates(wanted: Callable[[str], bool]) -> Iterator[socket.socket]:
    """A duplicate of each socket of this process whose inode ``wanted`` accepts, closed
    once the caller is done with it (the owner's descriptor stays valid)."""
    for fd, inode in open_sockets():
        if not wanted(inode):
            continue
        sock = _duplicate(fd, inode)
        if sock is None:
            continue
        try:
            yield sock
        finally:
            sock.close()


def _duplicate(fd: int, inode: str) -> Optional[socket.socket]:
    """A socket object on a duplicate of ``fd`` if ``fd`` is still the socket ``inode``
    (the descriptor may have been closed and its number reused by another thread since it
    was read: the duplicate, not the number, is checked); else None."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None  # closed meanwhile
    try:
        same = inode.startswith("socket:") and f"socket:[{os.fstat(dup).st_ino}]" == inode
        if same:
            return socket.socket(fileno=dup)
    except OSError:
        pass
    os.close(dup)
    return None
