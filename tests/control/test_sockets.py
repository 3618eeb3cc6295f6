"""This process's sockets, found by inode: a descriptor number closed and reused by
another socket meanwhile is never mistaken for the one that was found."""

import os
import socket

from peerstate.control import sockets


def _inode(sock: socket.socket) -> str:
    return os.readlink(f"/proc/self/fd/{sock.fileno()}")


def test_a_socket_found_by_inode_is_duplicated_and_shut_and_its_owner_sees_it():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with client, server:
            assert _inode(client) in sockets.socket_inodes()
            port = listener.getsockname()[1]
            assert sockets.connection_at(client.fileno(), port) == {_inode(client)}
            assert sockets.connection_at(server.fileno(), port) == set()  # the server's end of it
            sockets.shutdown({_inode(client)})
            assert client.recv(1) == b""                # shut: its reads end at once


def test_a_descriptor_number_reused_by_another_socket_is_left_alone():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        first = socket.create_connection(listener.getsockname())
        fd, inode = first.fileno(), _inode(first)
        listener.accept()[0].close()
        first.close()
        second = socket.create_connection(listener.getsockname())  # the lowest free number: first's
        peer, _ = listener.accept()
        with second, peer:
            assert second.fileno() == fd and _inode(second) != inode
            assert sockets._duplicate(fd, inode) is None
            with sockets._duplicate(fd, _inode(second)) as same:
                assert same.getsockname() == second.getsockname()
            sockets.shutdown({inode})
            peer.sendall(b"y")
            assert second.recv(1) == b"y"              # not shut on the old inode's account
