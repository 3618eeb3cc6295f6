"""The tests' etcd: ``EtcdCluster`` (peerstate.tools.etcd_cluster) once the etcd
binary is known to be there (Debian's etcd-server, which .ci/run installs):
without it the tests that need it are skipped, except under CI, where that is a
failure. The fixtures close every cluster they start. ``CuttableLink``: one
node's route to the store, which a test can cut; ``make_tls``: certificates for
a TLS cluster."""

import shutil
import socket
import threading

from helpers.listener import stop_accepting
from helpers.system import missing
from peerstate.tools.etcd_cluster import EtcdCluster as _EtcdCluster


def require_etcd() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        missing("etcd", "Debian: apt-get install etcd-server")
    return binary


def EtcdCluster(directory, members=1, tls=None):  # noqa: N802 - stands for the class
    require_etcd()
    return _EtcdCluster(directory, members, tls)


class CuttableLink:
    """A TCP forwarder on 127.0.0.1 (port 0) to ``target`` (HOST:PORT): what one node
    sees of the store. ``cut()`` closes every connection through it and refuses new
    ones, as when that node loses its route to the store and nobody else does."""

    def __init__(self, target):
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets = []
        self._lock = threading.Lock()
        self._cut = False
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._cut:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        with self._lock:
            self._cut = True
            sockets, self._sockets = self._sockets, []
        stop_accepting(self._listener, self._acceptor)
        for end in sockets:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()


def make_tls(directory):
    """A CA, a member certificate for 127.0.0.1 and a client certificate, as PEM files
    in ``directory`` (``ClusterTls``), made with the cryptography package."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from peerstate.tools.etcd_cluster import ClusterTls

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name, issuer_key, issuer_name, *, ca=False, usage=None, ip=False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        if ip:
            loopback = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
            builder = builder.add_extension(x509.SubjectAlternativeName([loopback]), critical=False)
        certificate = builder.sign(issuer_key or key, hashes.SHA256())
        paths = (directory / f"{name}.crt", directory / f"{name}.key")
        paths[0].write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        paths[1].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        paths[1].chmod(0o600)
        return key, subject, [str(p) for p in paths]

    ca_key, ca_name, (ca, _) = issue("peerstate-test-ca", None, None, ca=True)
    _, _, (server_cert, server_key) = issue("etcd-member", ca_key, ca_name, ip=True,
                                            usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    _, _, (client_cert, client_key) = issue("peerstate-agent", ca_key, ca_name, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    return ClusterTls(ca, server_cert, server_key, client_cert, client_key)
