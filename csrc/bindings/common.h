// What every binding file shares: Status -> Python exception, GIL-free
// calls and destruction, and the version-metadata dict.
#pragma once

#include <pybind11/pybind11.h>

#include "common/status.h"
#include "store/version_meta.h"

namespace peerstate::bindings {

// Raises the peerstate.Error subclass that matches st.code() (no-op when ok).
// Call with the GIL held, i.e. after a gil_scoped_release has ended.
void raise_if_error(const Status& st);
// The exception object st would raise (None when ok), for results that report
// several outcomes at once.
pybind11::object exception_object(const Status& st);

// Deletes a native object without the GIL: destructors that join threads or
// wait for copies must not block other Python threads.
struct ReleaseGilDeleter {
  template <typename T>
  void operator()(T* object) const {
    if (PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      delete object;
    } else {
      delete object;
    }
  }
};

// Runs fn() (returning Status) with the GIL released, then raises its error.
template <typename Fn>
void call_without_gil(Fn&& fn) {
  Status st;
  {
    pybind11::gil_scoped_release release;
    st = fn();
  }
  raise_if_error(st);
}

// A version's metadata as the dict version_info(), info() and describe() return:
// {source_rank, version, nbytes, chunk_bytes, buffers: [(name, nbytes, device,
// offset, dtype)], chunks: [(offset, nbytes, device)], checksums}.
pybind11::dict meta_dict(const VersionMeta& meta);

// Creates the exception classes in `m` (peerstate._C) from the status table.
void bind_errors(pybind11::module_& m);
// For a second extension module: raise_if_error raises peerstate._C's classes
// (imported here), so that both modules' errors are one hierarchy.
void import_errors();
void bind_snapshot(pybind11::module_& m);
void bind_net(pybind11::module_& m);
void bind_replication(pybind11::module_& m);
void bind_device(pybind11::module_& m);
void bind_liveness(pybind11::module_& m);
void bind_parity(pybind11::module_& m);

}  // namespace peerstate::bindings
