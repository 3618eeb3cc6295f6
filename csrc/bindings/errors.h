// Status -> Python exception, for every binding.
#pragma once

#include <pybind11/pybind11.h>

#include "core/status.h"

namespace peerstate::bindings {

// Raises the peerstate.Error subclass that matches st.code() (no-op when ok).
// Call with the GIL held, i.e. after a gil_scoped_release has ended.
void raise_if_error(const Status& st);

void bind_errors(pybind11::module_& m);
void bind_snapshot(pybind11::module_& m);

}  // namespace peerstate::bindings
