"""Stopping a test's TCP listener whose accept() loop runs in a thread of its own."""

import socket
import threading


def stop_accepting(listener: socket.socket, acceptor: threading.Thread) -> None:
    """Close ``listener`` and end ``acceptor``, the thread blocked in its accept().
    shutdown first: close() alone leaves accept() blocked on the closed socket, and a
    restart of that call would accept on whatever socket reuses the descriptor number."""
    listener.shutdown(socket.SHUT_RDWR)
    acceptor.join()
    listener.close()
