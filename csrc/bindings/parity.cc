// Bindings for the parity coder: (pointer, nbytes) pairs in, GIL released for the fold.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "store/parity.h"

namespace py = pybind11;

namespace peerstate::bindings {

void bind_parity(py::module_& m) {
  py::class_<ParityCoder, std::unique_ptr<ParityCoder, ReleaseGilDeleter>>(m, "ParityCoder")
      .def(py::init<size_t>(), py::arg("threads") = 1)
      .def_property_readonly("threads", &ParityCoder::threads)
      .def(
          "xor_blocks",
          [](const ParityCoder& self, std::pair<uintptr_t, size_t> destination,
             const std::vector<std::pair<uintptr_t, size_t>>& sources, bool accumulate) {
            std::vector<ParitySource> blocks;
            blocks.reserve(sources.size());
            for (const auto& [pointer, nbytes] : sources) blocks.emplace_back(reinterpret_cast<const void*>(pointer), nbytes);
            call_without_gil([&] {
              return self.xor_blocks(reinterpret_cast<void*>(destination.first), destination.second, blocks, accumulate);
            });
          },
          py::arg("destination"), py::arg("sources"), py::arg("accumulate") = false);
}

}  // namespace peerstate::bindings
