// Bindings for the snapshot store and the checksum/copy utilities: type
// conversion, GIL release around anything that blocks, Status -> exception.
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings/common.h"
#include "core/crc32c.h"
#include "core/device_copy.h"
#include "core/parallel_copy.h"
#include "core/snapshot_store.h"
#include "core/thread_pool.h"

namespace py = pybind11;

namespace peerstate::bindings {
namespace {

using StoreHolder = std::unique_ptr<SnapshotStore, ReleaseGilDeleter>;

Crc32cImplementation parse_implementation(const std::string& name) {
  if (name == "auto") return Crc32cImplementation::kAuto;
  if (name == "hardware") return Crc32cImplementation::kHardware;
  if (name == "software") return Crc32cImplementation::kSoftware;
  raise_if_error(Status(StatusCode::kInvalidArgument,
                        "implementation must be 'auto', 'hardware' or 'software' (got '" + name + "')"));
  return Crc32cImplementation::kAuto;
}

}  // namespace

void bind_snapshot(py::module_& m) {
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
           [](SnapshotStore& s, const std::vector<py::tuple>& items) {
             std::vector<BufferRegistration> regs;
             for (const py::tuple& t : items) {
               if (t.size() != 4 && t.size() != 5)
                 raise_if_error(Status(StatusCode::kInvalidArgument,
                                       "each buffer is (name, pointer, nbytes, device[, dtype])"));
               regs.push_back(BufferRegistration{t[0].cast<std::string>(), reinterpret_cast<void*>(t[1].cast<uintptr_t>()),
                                                 t[2].cast<size_t>(), t[3].cast<int>(),
                                                 t.size() == 5 ? t[4].cast<std::string>() : std::string()});
             }
             call_without_gil([&] { return s.register_buffers(regs); });
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

  m.def("crc32c",
        [](py::buffer data, uint32_t crc, const std::string& implementation) {
          Crc32cImplementation impl = parse_implementation(implementation);
          py::buffer_info info = data.request();
          size_t nbytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
          py::gil_scoped_release release;
          return crc32c_extend(crc, info.ptr, nbytes, impl);
        },
        py::arg("data"), py::arg("crc") = 0, py::arg("implementation") = "auto");
  m.def("crc32c_hardware_available", &crc32c_hardware_available);
  m.def("cuda_compiled", &cuda_compiled);
  m.def("cuda_available", &cuda_available);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("available_cores", &available_cores);
  m.def("measure_parallel_memcpy",
        [](const std::vector<std::pair<uintptr_t, size_t>>& sources, size_t threads, size_t repeats,
           bool streaming) {
          std::vector<std::pair<const void*, size_t>> src;
          for (const auto& [ptr, n] : sources) src.emplace_back(reinterpret_cast<const void*>(ptr), n);
          double best = 0;
          call_without_gil([&] { return measure_parallel_memcpy(src, threads, repeats, streaming, &best); });
          return best;
        },
        py::arg("sources"), py::arg("threads"), py::arg("repeats") = 3, py::arg("streaming") = false);
}

}  // namespace peerstate::bindings
