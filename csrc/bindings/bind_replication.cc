// Bindings for replication: replica store, tcp server and transport, the
// replicator, and the NCCL loader/transport. Types in, GIL released, errors out.
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "bindings/common.h"
#include "core/nccl_library.h"
#include "core/nccl_transport.h"
#include "core/replica_store.h"
#include "core/replication.h"
#include "core/tcp_transport.h"

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

TcpOptions tcp_options(const py::bytes& secret, int rank, size_t connections, long connect_timeout_ms,
                       long io_timeout_ms) {
  TcpOptions o;
  o.secret = secret;
  o.rank = rank;
  o.connections_per_peer = connections;
  o.connect_timeout_ms = connect_timeout_ms;
  o.io_timeout_ms = io_timeout_ms;
  return o;
}

NcclLibrary load_nccl() {
  NcclLibrary lib;
  call_without_gil([&] { return NcclLibrary::load(&lib); });
  return lib;
}

}  // namespace

py::dict meta_dict(const VersionMeta& meta) {
  py::list buffers, chunks;
  for (const BufferPlacement& b : meta.layout->buffers)
    buffers.append(py::make_tuple(b.name, b.nbytes, b.device, b.offset, b.dtype));
  for (const ChunkPlacement& c : meta.layout->chunks) chunks.append(py::make_tuple(c.offset, c.nbytes, c.device));
  py::dict d;
  d["source_rank"] = meta.source_rank;
  d["version"] = meta.version;
  d["nbytes"] = meta.layout->region_bytes;
  d["chunk_bytes"] = meta.layout->chunk_bytes;
  d["buffers"] = buffers;
  d["chunks"] = chunks;
  d["checksums"] = meta.checksums;
  return d;
}

void bind_replication(py::module_& m) {
  py::class_<ReplicaStore, std::unique_ptr<ReplicaStore, ReleaseGilDeleter>>(m, "ReplicaStore")
      .def(py::init([](size_t budget_bytes, int device) {
             std::unique_ptr<ReplicaStore> store;
             raise_if_error(ReplicaStore::create(budget_bytes, device, &store));
             return std::unique_ptr<ReplicaStore, ReleaseGilDeleter>(store.release());
           }),
           py::kw_only(), py::arg("budget_bytes") = 0, py::arg("device") = -1)
      .def_property_readonly("device", &ReplicaStore::device)
      .def("reserve", [](ReplicaStore& r, int source_rank, size_t bytes_per_version) {
        call_without_gil([&] { return r.reserve(source_rank, bytes_per_version); });  // allocates and faults in
      })
      .def("committed", &ReplicaStore::committed)
      .def("drop_newer", &ReplicaStore::drop_newer, py::arg("version"))
      .def("held_bytes", &ReplicaStore::held_bytes)
      .def("reserved_bytes", &ReplicaStore::reserved_bytes)
      .def_property_readonly("budget_bytes", &ReplicaStore::budget_bytes)
      .def("info", [](const ReplicaStore& r, int source_rank) {
        std::shared_ptr<const ReplicaVersion> v;
        raise_if_error(r.get(source_rank, -1, &v));
        return meta_dict(v->meta);
      })
      .def("stored_bytes", [](const ReplicaStore& r, int source_rank) {
        std::shared_ptr<const ReplicaVersion> v;
        raise_if_error(r.get(source_rank, -1, &v));
        // A copy: the committed replica may be replaced while Python holds the result.
        const size_t n = v->meta.layout->region_bytes;
        if (v->region.device() == kHostDevice) return py::bytes(reinterpret_cast<const char*>(v->region.data()), n);
        std::string host(n, '\0');
        DeviceCopy copy{host.data(), v->region.data(), n};
        call_without_gil([&] { return r.engine()->to_host(v->region.device(), &copy, 1); });
        return py::bytes(host);
      });

  py::class_<TcpServer, std::unique_ptr<TcpServer, ReleaseGilDeleter>>(m, "TcpServer")
      .def(py::init([](ReplicaStore* replicas, SnapshotStore* own, const py::bytes& secret, int rank,
                       const std::string& host, int port, long io_timeout_ms) {
             std::unique_ptr<TcpServer> server;
             TcpOptions o = tcp_options(secret, rank, 1, 5000, io_timeout_ms);
             call_without_gil([&] { return TcpServer::start(o, host, port, replicas, own, &server); });
             return std::unique_ptr<TcpServer, ReleaseGilDeleter>(server.release());
           }),
           py::arg("replicas"), py::arg("own_store").none(true), py::kw_only(), py::arg("secret"),
           py::arg("rank"), py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::arg("io_timeout_ms") = 30000,
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def_property_readonly("port", &TcpServer::port)
      .def("stop", [](TcpServer& s) { call_without_gil([&] { s.stop(); return Status::Ok(); }); })
      .def("stats", [](const TcpServer& s) {
        TcpServerStats st = s.stats();
        py::dict d;
        d["accepted"] = st.accepted;
        d["rejected"] = st.rejected;
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
      .def("describe", [](Transport& t, int peer, int source_rank, int64_t version) {
        VersionMeta meta;
        call_without_gil([&] { return t.describe(peer, source_rank, version, &meta); });
        return meta_dict(meta);
      });

  py::class_<TcpTransport, Transport, std::unique_ptr<TcpTransport, ReleaseGilDeleter>>(m, "TcpTransport")
      .def(py::init([](const py::bytes& secret, int rank, size_t connections_per_peer, long connect_timeout_ms,
                       long io_timeout_ms) {
             std::unique_ptr<TcpTransport> t;
             raise_if_error(TcpTransport::create(
                 tcp_options(secret, rank, connections_per_peer, connect_timeout_ms, io_timeout_ms), &t));
             return std::unique_ptr<TcpTransport, ReleaseGilDeleter>(t.release());
           }),
           py::kw_only(), py::arg("secret"), py::arg("rank"), py::arg("connections_per_peer") = 4,
           py::arg("connect_timeout_ms") = 5000, py::arg("io_timeout_ms") = 30000)
      .def("add_peer", &TcpTransport::add_peer);

  py::class_<Replicator, std::unique_ptr<Replicator, ReleaseGilDeleter>>(m, "Replicator")
      .def(py::init([](SnapshotStore* store, Transport* transport, int rank) {
             return std::unique_ptr<Replicator, ReleaseGilDeleter>(new Replicator(store, transport, rank));
           }),
           py::arg("store"), py::arg("transport"), py::arg("rank"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("replicate", [](Replicator& r, int64_t version, const std::vector<int>& holders) {
        call_without_gil([&] { return r.replicate(version, holders); });
      })
      .def("wait", [](Replicator& r, int64_t version) {
        std::vector<HolderResult> results;
        call_without_gil([&] { return r.wait(version, &results); });
        py::list out;
        for (const HolderResult& h : results) out.append(py::make_tuple(h.holder, exception_object(h.status)));
        return out;
      })
      .def("in_flight_version", [](const Replicator& r) -> py::object {
        int64_t v = r.in_flight_version();
        return v < 0 ? py::none() : py::cast(v);
      })
      .def("pull",
           [](Replicator& r, const std::vector<py::tuple>& sources, int64_t version) {
             std::vector<PullSource> from;
             for (const py::tuple& t : sources) {
               if (t.size() != 2 && t.size() != 4)
                 raise_if_error(Status(StatusCode::kInvalidArgument, "each source is (peer, rank[, pid, region])"));
               PullSource s{t[0].cast<int>(), t[1].cast<int>()};
               if (t.size() == 4) {
                 s.pid = t[2].cast<int>();
                 s.region = t[3].cast<uintptr_t>();
               }
               from.push_back(s);
             }
             int64_t pulled = -1;
             PullStats stats;
             call_without_gil([&] { return r.pull(from, version, &pulled, &stats); });
             return py::make_tuple(pulled, stats.chunks, stats.chunks_from_memory);
           },
           py::arg("sources"), py::arg("version") = -1);

  m.def("hmac_sha256", [](const py::bytes& key, const py::bytes& data) {
    std::string k = key, d = data;
    Digest out = hmac_sha256(k.data(), k.size(), d.data(), d.size());
    return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
  });
  m.def("nccl_load", [] {
    NcclLibrary lib = load_nccl();
    py::dict d;
    d["version"] = NcclLibrary::version_string(lib.version);
    d["version_code"] = lib.version;
    d["origin"] = lib.origin;
    return d;
  });
  m.def("nccl_unique_id", [] {
    NcclLibrary lib = load_nccl();
    NcclUniqueId id;
    raise_if_error(nccl_unique_id(lib, &id));
    return py::bytes(id.internal, sizeof(id.internal));
  });
  m.def("nccl_transport",
        [](const py::bytes& unique_id, int nranks, int rank, int device, long timeout_ms) {
          std::string raw = unique_id;
          if (raw.size() != sizeof(NcclUniqueId::internal))
            raise_if_error(Status(StatusCode::kInvalidArgument, "an NCCL unique id has 128 bytes"));
          NcclLibrary lib = load_nccl();
          NcclUniqueId id;
          std::memcpy(id.internal, raw.data(), raw.size());
          std::unique_ptr<Transport> t;
          call_without_gil([&] { return create_nccl_transport(lib, id, nranks, rank, device, timeout_ms, &t); });
          return std::unique_ptr<Transport, ReleaseGilDeleter>(t.release());
        },
        py::arg("unique_id"), py::arg("nranks"), py::arg("rank"), py::arg("device"), py::arg("timeout_ms") = 60000);
}

}  // namespace peerstate::bindings
