// Bindings for the tcp transport: server, transports, and raw region moves
// for tests and benchmarks. Types in, GIL released, errors out.
#include <pybind11/stl.h>

#include <array>
#include <cstring>
#include <memory>
#include <string>

#include "bindings/common.h"
#include "net/credentials.h"
#include "net/tcp_server.h"
#include "net/tcp_transport.h"

namespace py = pybind11;

namespace peerstate::bindings {
namespace {

// The inverse of meta_dict / SnapshotStore.version_info (offsets are recomputed, not trusted).
VersionMeta meta_from_dict(const py::dict& d, int source_rank) {
  VersionMeta meta;
  meta.source_rank = d.contains("source_rank") ? d["source_rank"].cast<int>() : source_rank;
  meta.version = d["version"].cast<int64_t>();
  meta.chunk_bytes = d["chunk_bytes"].cast<size_t>();
  for (const auto& item : d["buffers"]) {
    auto t = item.cast<py::tuple>();
    BufferPlacement b;
    b.name = t[0].cast<std::string>();
    b.nbytes = t[1].cast<size_t>();
    b.device = t[2].cast<int>();
    if (t.size() > 4) b.dtype = t[4].cast<std::string>();
    meta.buffers.push_back(b);
  }
  meta.checksums = d["checksums"].cast<std::vector<uint32_t>>();
  raise_if_error(finish_meta(&meta));
  return meta;
}

Status move_region(Transport& t, int peer, VersionMeta meta, uintptr_t region, bool sending) {
  ChunkQueue queue(meta.layout->chunks.size());
  TransferPlan plan{std::move(meta), reinterpret_cast<unsigned char*>(region), &queue};
  Status st = sending ? t.send(peer, plan) : t.receive(peer, plan);
  if (st.ok() && !queue.finished()) return Status(StatusCode::kInternal, "transfer ended with chunks missing");
  return st;
}

template <size_t N>
std::array<uint8_t, N> fixed_bytes(const py::bytes& value, const char* what) {
  const std::string s = value;
  if (s.size() != N)
    raise_if_error(Status(StatusCode::kInvalidArgument, std::string(what) + " must be " + std::to_string(N) +
                                                            " bytes, not " + std::to_string(s.size())));
  std::array<uint8_t, N> out;
  std::memcpy(out.data(), s.data(), N);
  return out;
}

template <size_t N>
py::bytes as_bytes(const std::array<uint8_t, N>& value) {
  return py::bytes(reinterpret_cast<const char*>(value.data()), N);
}

TcpOptions tcp_options(const Credentials& credentials, const std::string& protection, size_t connections,
                       long connect_timeout_ms, long io_timeout_ms) {
  TcpOptions o;
  o.credentials = credentials;
  raise_if_error(parse_protection(protection, &o.protection));
  o.connections_per_peer = connections;
  o.connect_timeout_ms = connect_timeout_ms;
  o.io_timeout_ms = io_timeout_ms;
  return o;
}

}  // namespace

void bind_net(py::module_& m) {
  py::class_<Credentials>(m, "Credentials")
      .def(py::init([](int rank, const py::bytes& private_key, const py::bytes& certificate, const py::bytes& job_key) {
             Credentials c;
             raise_if_error(Credentials::create(rank, fixed_bytes<32>(private_key, "private_key"),
                                                fixed_bytes<64>(certificate, "certificate"),
                                                fixed_bytes<32>(job_key, "job_key"), &c));
             return c;
           }),
           py::arg("rank"), py::arg("private_key"), py::arg("certificate"), py::arg("job_key"))
      .def_property_readonly("rank", &Credentials::rank)
      .def_property_readonly("private_key", [](const Credentials& c) { return as_bytes(c.private_key); })
      .def_property_readonly("certificate", [](const Credentials& c) { return as_bytes(c.certificate.signature); })
      .def_property_readonly("public_key", [](const Credentials& c) { return as_bytes(c.certificate.key); })
      .def_property_readonly("job_key", [](const Credentials& c) { return as_bytes(c.job_key); })
      .def("__repr__", [](const Credentials& c) { return "<Credentials of rank " + std::to_string(c.rank()) + ">"; });

  py::class_<JobAuthority>(m, "JobAuthority")
      .def(py::init([](const py::bytes& secret) {
             JobAuthority a;
             raise_if_error(JobAuthority::from_secret(secret, &a));
             return a;
           }),
           py::arg("secret"))
      .def_property_readonly("public_key", [](const JobAuthority& a) { return as_bytes(a.public_key()); })
      .def("certify",
           [](const JobAuthority& a, int rank, const py::bytes& private_key) {
             Signature s;
             raise_if_error(a.certify(rank, fixed_bytes<32>(private_key, "private_key"), &s));
             return as_bytes(s);
           },
           py::arg("rank"), py::arg("private_key"))
      .def("issue",
           [](const JobAuthority& a, int rank) {
             Credentials c;
             raise_if_error(a.issue(rank, &c));
             return c;
           },
           py::arg("rank"));

  py::class_<TcpServer, std::unique_ptr<TcpServer, ReleaseGilDeleter>>(m, "TcpServer")
      .def(py::init([](ReplicaStore* replicas, SnapshotStore* own, const Credentials& credentials,
                       const std::string& host, int port, long io_timeout_ms, const std::string& protection,
                       size_t max_handshaking, size_t max_handshaking_per_source, size_t max_per_peer,
                       size_t max_connections) {
             std::unique_ptr<TcpServer> server;
             TcpOptions o = tcp_options(credentials, protection, 1, 5000, io_timeout_ms);
             o.max_handshaking = max_handshaking;
             o.max_handshaking_per_source = max_handshaking_per_source;
             o.max_per_peer = max_per_peer;
             o.max_connections = max_connections;
             call_without_gil([&] { return TcpServer::start(o, host, port, replicas, own, &server); });
             return std::unique_ptr<TcpServer, ReleaseGilDeleter>(server.release());
           }),
           py::arg("replicas"), py::arg("own_store").none(true), py::kw_only(), py::arg("credentials"),
           py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::arg("io_timeout_ms") = 30000,
           py::arg("protection") = "authenticated", py::arg("max_handshaking") = TcpOptions().max_handshaking,
           py::arg("max_handshaking_per_source") = TcpOptions().max_handshaking_per_source,
           py::arg("max_per_peer") = TcpOptions().max_per_peer,
           py::arg("max_connections") = TcpOptions().max_connections, py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("serve", [](TcpServer& s, uint32_t index, SnapshotStore* store) { raise_if_error(s.serve(index, store)); },
           py::arg("index"), py::arg("store"), py::keep_alive<1, 3>())
      .def("hold_parity", [](TcpServer& s, ParityStore* parity) { raise_if_error(s.hold_parity(parity)); },
           py::arg("parity"), py::keep_alive<1, 2>())
      .def_property_readonly("port", &TcpServer::port)
      .def("stop", [](TcpServer& s) { call_without_gil([&] { s.stop(); return Status::Ok(); }); })
      .def("stats", [](const TcpServer& s) {
        TcpServerStats st = s.stats();
        py::dict d;
        d["accepted"] = st.accepted;
        d["rejected"] = st.rejected;
        d["refused"] = st.refused;
        d["evicted"] = st.evicted;
        d["active"] = st.active;
        return d;
      });

  py::class_<Transport, std::unique_ptr<Transport, ReleaseGilDeleter>>(m, "Transport")
      .def_property_readonly("name", &Transport::name)
      .def("abort", [](Transport& t) { call_without_gil([&] { t.abort(); return Status::Ok(); }); })
      .def("send_region",
           [](Transport& t, int peer, const py::dict& meta, uintptr_t region, int source_rank) {
             VersionMeta m = meta_from_dict(meta, source_rank);
             call_without_gil([&] { return move_region(t, peer, std::move(m), region, true); });
           },
           py::arg("peer"), py::arg("meta"), py::arg("region"), py::arg("source_rank") = -1)
      .def("receive_region",
           [](Transport& t, int peer, const py::dict& meta, uintptr_t region, int source_rank) {
             VersionMeta m = meta_from_dict(meta, source_rank);
             call_without_gil([&] { return move_region(t, peer, std::move(m), region, false); });
           },
           py::arg("peer"), py::arg("meta"), py::arg("region"), py::arg("source_rank") = -1)
      .def("describe",
           [](Transport& t, int peer, int source_rank, int64_t version, uint32_t store) {
             VersionMeta meta;
             call_without_gil([&] { return t.describe(peer, source_rank, version, store, &meta); });
             return meta_dict(meta);
           },
           py::arg("peer"), py::arg("source_rank"), py::arg("version"), py::arg("store") = 0);

  py::class_<TcpTransport, Transport, std::unique_ptr<TcpTransport, ReleaseGilDeleter>>(m, "TcpTransport")
      .def(py::init([](const Credentials& credentials, size_t connections_per_peer, long connect_timeout_ms,
                       long io_timeout_ms, const std::string& protection) {
             std::unique_ptr<TcpTransport> t;
             raise_if_error(TcpTransport::create(
                 tcp_options(credentials, protection, connections_per_peer, connect_timeout_ms, io_timeout_ms), &t));
             return std::unique_ptr<TcpTransport, ReleaseGilDeleter>(t.release());
           }),
           py::kw_only(), py::arg("credentials"), py::arg("connections_per_peer") = 4,
           py::arg("connect_timeout_ms") = 5000, py::arg("io_timeout_ms") = 30000,
           py::arg("protection") = "authenticated")
      .def("add_peer", &TcpTransport::add_peer);
}

}  // namespace peerstate::bindings
