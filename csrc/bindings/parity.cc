// Bindings for parity groups: the coder ((pointer, nbytes) pairs in, GIL released
// for the fold) and the holder's ParityStore.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "store/parity.h"
#include "store/parity_store.h"
#include "store/snapshot_store.h"

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

  m.def(
      "parity_pieces",
      [](const SnapshotStore& store, const py::object& version, size_t group_size) {
        std::shared_ptr<const Layout> layout = store.current_layout();
        if (!version.is_none()) {
          VersionView view;
          raise_if_error(store.view(version.cast<int64_t>(), &view));
          layout = view.layout;
        }
        py::list out;
        for (size_t piece = 0; piece + 1 < group_size; piece++) {
          const ParityPiece p = parity_piece(*layout, group_size, piece);
          out.append(py::make_tuple(p.first_chunk, p.end_chunk, p.region_offset, p.nbytes));
        }
        return out;
      },
      py::arg("store"), py::arg("version").none(true), py::arg("group_size"));

  py::class_<ParityStore, std::unique_ptr<ParityStore, ReleaseGilDeleter>>(m, "ParityStore")
      .def(py::init<size_t>(), py::kw_only(), py::arg("budget_bytes") = 0)
      .def("hold",
           [](ParityStore& p, const std::vector<int>& members, size_t index, size_t block_bytes) {
             call_without_gil([&] { return p.hold(members, index, block_bytes); });  // allocates and faults in
           },
           py::arg("members"), py::arg("index"), py::arg("block_bytes"))
      .def("committed", &ParityStore::committed)
      .def("drop_newer", [](ParityStore& p, int64_t version) {
        call_without_gil([&] { p.drop_newer(version); return Status::Ok(); });
      }, py::arg("version"))
      .def("bound_versions", &ParityStore::bound_versions, py::arg("newest"))
      .def_property_readonly("members", &ParityStore::members)
      .def_property_readonly("index", &ParityStore::self)
      .def_property_readonly("block_bytes", &ParityStore::block_bytes)
      .def("held_bytes", &ParityStore::held_bytes)
      .def("reserved_bytes", &ParityStore::reserved_bytes)
      .def_property_readonly("budget_bytes", &ParityStore::budget_bytes)
      .def("forget_rebuilt", &ParityStore::forget_rebuilt)
      .def("interrupt_waits", &ParityStore::interrupt_waits)
      .def("resume_waits", &ParityStore::resume_waits)
      .def(
          "block",
          [](const ParityStore& p, int64_t version) {
            std::shared_ptr<const ParityVersion> v;
            raise_if_error(p.get(version, &v));
            // A copy: the block may be reused while Python holds the result.
            return py::make_tuple(v->version, py::bytes(reinterpret_cast<const char*>(v->block.data()), p.block_bytes()));
          },
          py::arg("version") = -1);
}

}  // namespace peerstate::bindings
