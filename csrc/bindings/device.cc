// Bindings for the device path: what the build and the machine have, and the
// NCCL loader and transport (loaded at run time; see device/nccl_library.h).
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

#include "bindings/common.h"
#include "common/device_copy.h"
#include "device/nccl_library.h"
#include "device/nccl_transport.h"

namespace py = pybind11;

namespace peerstate::bindings {
namespace {

NcclLibrary load_nccl() {
  NcclLibrary lib;
  call_without_gil([&] { return NcclLibrary::load(&lib); });
  return lib;
}

}  // namespace

void bind_device(py::module_& m) {
  m.def("cuda_compiled", &cuda_compiled);
  m.def("cuda_available", &cuda_available);
  m.def("cuda_device_count", &cuda_device_count);
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
          raise_if_error(nccl_transport_built());  // before looking for NCCL: the build's answer comes first
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
