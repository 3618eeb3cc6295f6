// Bindings for the liveness ticker a worker runs beside its Python heartbeat.
#include <memory>
#include <string>

#include "bindings/common.h"
#include "common/liveness_ticker.h"

namespace py = pybind11;

namespace peerstate::bindings {

void bind_liveness(py::module_& m) {
  py::class_<LivenessTicker, std::unique_ptr<LivenessTicker, ReleaseGilDeleter>>(m, "LivenessTicker")
      .def(py::init([](const std::string& path, size_t offset, double interval_seconds) {
             std::unique_ptr<LivenessTicker> ticker;
             int interval_ms = static_cast<int>(interval_seconds * 1000.0);
             call_without_gil([&] { return LivenessTicker::start(path, offset, interval_ms, &ticker); });
             return std::unique_ptr<LivenessTicker, ReleaseGilDeleter>(ticker.release());
           }),
           py::arg("path"), py::arg("offset"), py::arg("interval_seconds"))
      .def("stop", [](LivenessTicker& t) { call_without_gil([&] { t.stop(); return Status::Ok(); }); })
      .def_property_readonly("count", &LivenessTicker::count);
}

}  // namespace peerstate::bindings
