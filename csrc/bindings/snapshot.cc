// Bindings for the snapshot store: type conversion, GIL release around
// anything that blocks, Status -> exception.
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings/common.h"
#include "store/snapshot_store.h"

namespace py = pybind11;

namespace peerstate::bindings {
namespace {

using StoreHolder = std::unique_ptr<SnapshotStore, ReleaseGilDeleter>;


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

void bind_snapshot(py::module_& m) {
  py::class_<BufferRegistration>(m, "BufferRegistration")
      .def(py::init([](std::string name, uintptr_t pointer, size_t nbytes, int device, std::string dtype) {
             return BufferRegistration{std::move(name), reinterpret_cast<void*>(pointer), nbytes, device,
                                       std::move(dtype)};
           }),
           py::arg("name"), py::arg("pointer"), py::arg("nbytes"), py::arg("device") = kHostDevice,
           py::arg("dtype") = "")
      .def_readonly("name", &BufferRegistration::name)
      .def_property_readonly("pointer", [](const BufferRegistration& b) { return reinterpret_cast<uintptr_t>(b.ptr); })
      .def_readonly("nbytes", &BufferRegistration::nbytes)
      .def_readonly("device", &BufferRegistration::device)
      .def_readonly("dtype", &BufferRegistration::dtype);

  py::class_<SnapshotStore, StoreHolder>(m, "SnapshotStore")
      .def(py::init([](size_t threads, size_t chunk_bytes, size_t max_versions, size_t budget_bytes,
                       bool checksums) {
             SnapshotStoreOptions o;
             o.threads = threads;
             o.chunk_bytes = chunk_bytes;
             o.max_versions = max_versions;
             o.budget_bytes = budget_bytes;
             o.checksums = checksums;
             std::unique_ptr<SnapshotStore> store;
             raise_if_error(SnapshotStore::create(o, &store));
             return StoreHolder(store.release());
           }),
           py::kw_only(), py::arg("threads") = 0, py::arg("chunk_bytes") = size_t(4) << 20,
           py::arg("max_versions") = 2, py::arg("budget_bytes") = 0, py::arg("checksums") = true)
      .def("register_buffers",
           [](SnapshotStore& s, const std::vector<BufferRegistration>& buffers) {
             call_without_gil([&] { return s.register_buffers(buffers); });
           })
      .def("unregister", [](SnapshotStore& s, const std::vector<std::string>& names) {
        call_without_gil([&] { return s.unregister(names); });
      })
      .def("snapshot",
           [](SnapshotStore& s, int64_t version, uintptr_t after_stream, bool gated) {
             call_without_gil([&] { return s.snapshot(version, after_stream, gated); });
           },
           py::arg("version"), py::arg("after_stream") = 0, py::arg("gated") = false)
      .def("validated", &SnapshotStore::validated, py::arg("count"))
      .def("cancel", [](SnapshotStore& s) {
        py::gil_scoped_release release;
        s.cancel();
      })
      .def("buffer_names", &SnapshotStore::buffer_names)
      .def("region_address", &SnapshotStore::region_address, py::arg("version"))
      .def("index_into",
           [](SnapshotStore& s, std::shared_ptr<ProcessIndex> index, uint32_t tag, int32_t rank) {
             s.index_into(std::move(index), tag, rank);
           },
           py::arg("index"), py::arg("tag"), py::arg("rank"))
      .def("wait", [](SnapshotStore& s) { call_without_gil([&] { return s.wait(); }); })
      .def("restore", [](SnapshotStore& s, int64_t version, bool verify) {
        size_t written = 0;
        call_without_gil([&] { return s.restore(version, verify, &written); });
        return written;
      }, py::arg("version"), py::arg("verify") = true)
      .def("drop_newer", [](SnapshotStore& s, int64_t version) {
        call_without_gil([&] { return s.drop_newer(version); });
      })
      .def("allocate", [](SnapshotStore& s) { call_without_gil([&] { return s.allocate(); }); })
      .def("close", [](SnapshotStore& s) { call_without_gil([&] { return s.close(); }); })
      .def("committed_versions", &SnapshotStore::committed_versions)
      .def("in_flight_version", [](const SnapshotStore& s) -> py::object {
        int64_t v = s.in_flight_version();
        return v < 0 ? py::none() : py::cast(v);
      })
      .def("memory", [](const SnapshotStore& s) {
        MemoryReport r = s.memory();
        py::dict d;
        d["registered_bytes"] = r.registered_bytes;
        d["bytes_per_version"] = r.bytes_per_version;
        d["held_bytes"] = r.held_bytes;
        d["budget_bytes"] = r.budget_bytes;
        d["versions"] = r.versions;
        return d;
      })
      .def("version_info", [](const SnapshotStore& s, int64_t version) {
        VersionView v;
        raise_if_error(s.view(version, &v));
        return meta_dict(meta_of(-1, v));
      })
      .def("stored_bytes", [](const SnapshotStore& s, int64_t version) {
        VersionView v;
        raise_if_error(s.view(version, &v));
        return py::memoryview::from_memory(v.mutable_data, static_cast<py::ssize_t>(v.nbytes), false);
      }, py::keep_alive<0, 1>())
      .def_property_readonly("threads", [](const SnapshotStore& s) { return s.options().threads; })
      .def_property_readonly("chunk_bytes", [](const SnapshotStore& s) { return s.options().chunk_bytes; })
      .def_property_readonly("max_versions", [](const SnapshotStore& s) { return s.options().max_versions; })
      .def_property_readonly("budget_bytes", [](const SnapshotStore& s) { return s.options().budget_bytes; })
      .def_property_readonly("checksums", [](const SnapshotStore& s) { return s.options().checksums; });
}

}  // namespace peerstate::bindings
