// Bindings for replication: the replica store and the replicator. Types in,
// GIL released, errors out.
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings/common.h"
#include "replication/process_memory.h"
#include "replication/replicator.h"
#include "store/process_index.h"
#include "store/replica_store.h"

namespace py = pybind11;

namespace peerstate::bindings {

namespace {

VersionMeta decode(const py::bytes& bytes) {
  VersionMeta meta;
  raise_if_error(decode_meta(std::string(bytes), &meta));
  return meta;
}

// (store, source_rank, version, region, nbytes, meta bytes) per entry.
py::list entry_tuples(const std::vector<ProcessIndex::Entry>& entries) {
  py::list out;
  for (const ProcessIndex::Entry& e : entries)
    out.append(py::make_tuple(e.store, e.source_rank, e.version, e.region, e.nbytes, py::bytes(e.meta)));
  return out;
}

}  // namespace

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
      .def("bound_versions", &ReplicaStore::bound_versions, py::arg("newest"))
      .def("held_bytes", &ReplicaStore::held_bytes)
      .def("reserved_bytes", &ReplicaStore::reserved_bytes)
      .def_property_readonly("budget_bytes", &ReplicaStore::budget_bytes)
      .def("info", [](const ReplicaStore& r, int source_rank) {
        std::shared_ptr<const ReplicaVersion> v;
        raise_if_error(r.get(source_rank, -1, &v));
        return meta_dict(v->meta);
      })
      .def("index_into",
           [](ReplicaStore& r, std::shared_ptr<ProcessIndex> index, uint32_t tag) { r.index_into(std::move(index), tag); },
           py::arg("index"), py::arg("tag"))
      .def("adopt_from_process",
           [](ReplicaStore& r, int pid, uintptr_t region, const py::bytes& meta) {
             VersionMeta decoded = decode(meta);
             call_without_gil([&] { return adopt_replica_from_process(pid, region, decoded, &r); });
           },
           py::arg("pid"), py::arg("region"), py::arg("meta"))
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

  py::class_<PullSource>(m, "PullSource")
      .def(py::init([](int peer, int rank, uint32_t store, int pid, uintptr_t region) {
             return PullSource{peer, rank, store, pid, region};
           }),
           py::arg("peer"), py::arg("rank"), py::kw_only(), py::arg("store") = 0, py::arg("pid") = 0,
           py::arg("region") = 0)
      .def_readonly("peer", &PullSource::peer)
      .def_readonly("rank", &PullSource::rank)
      .def_readonly("store", &PullSource::store)
      .def_readonly("pid", &PullSource::pid)
      .def_readonly("region", &PullSource::region);

  py::class_<Replicator, std::unique_ptr<Replicator, ReleaseGilDeleter>>(m, "Replicator")
      .def(py::init([](SnapshotStore* store, Transport* transport, int rank) {
             return std::unique_ptr<Replicator, ReleaseGilDeleter>(new Replicator(store, transport, rank));
           }),
           py::arg("store"), py::arg("transport"), py::arg("rank"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("replicate", [](Replicator& r, int64_t version, const std::vector<int>& holders) {
        call_without_gil([&] { return r.replicate(version, holders); });
      })
      .def("push_pieces",
           [](Replicator& r, int64_t version, const std::vector<int>& members, size_t index, const ParityStore* own,
              long wait_ms) {
             call_without_gil([&] { return r.push_pieces(version, members, index, own, wait_ms); });
           },
           py::arg("version"), py::arg("members"), py::arg("index"), py::arg("own").none(true) = nullptr,
           py::arg("wait_ms") = 30000, py::keep_alive<1, 5>())
      .def("rebuild_piece",
           [](Replicator& r, ParityStore* parity, int lost_rank, int64_t version) {
             call_without_gil([&] { return r.rebuild_piece(parity, lost_rank, version); });
           },
           py::arg("parity"), py::arg("lost_rank"), py::arg("version"))
      .def("pull_pieces",
           [](Replicator& r, const std::vector<int>& members, size_t lost, int64_t version) {
             int64_t pulled = -1;
             call_without_gil([&] { return r.pull_pieces(members, lost, version, &pulled); });
             return pulled;
           },
           py::arg("members"), py::arg("lost"), py::arg("version"))
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
           [](Replicator& r, const std::vector<PullSource>& sources, int64_t version, const py::object& meta) {
             int64_t pulled = -1;
             PullStats stats;
             VersionMeta known;
             if (!meta.is_none()) known = decode(meta.cast<py::bytes>());
             call_without_gil([&] {
               return r.pull(sources, version, &pulled, &stats, meta.is_none() ? nullptr : &known);
             });
             return py::make_tuple(pulled, stats.chunks, stats.chunks_from_memory);
           },
           py::arg("sources"), py::arg("version") = -1, py::arg("meta") = py::none());

  py::class_<ProcessIndex, std::shared_ptr<ProcessIndex>>(m, "ProcessIndex")
      .def(py::init<>())
      .def_property_readonly("address", &ProcessIndex::address)
      .def("entries", [](const ProcessIndex& index) { return entry_tuples(index.entries()); });
  m.def(
      "read_process_index",
      [](int pid, uintptr_t address) {
        std::vector<ProcessIndex::Entry> entries;
        call_without_gil([&] { return read_process_index(pid, address, &entries); });
        return entry_tuples(entries);
      },
      py::arg("pid"), py::arg("address"));
}

}  // namespace peerstate::bindings
