#include <Python.h>

#include <array>
#include <stdexcept>

#include "bindings/common.h"

namespace py = pybind11;

namespace peerstate::bindings {
namespace {

constexpr size_t kCodes = static_cast<size_t>(StatusCode::kInternal) + 1;
std::array<PyObject*, kCodes> g_exceptions{};

// A C++ carrier so that raise_if_error may be called anywhere pybind11 translates exceptions.
struct StatusException : std::runtime_error {
  StatusCode code;
  StatusException(StatusCode c, const std::string& m) : std::runtime_error(m), code(c) {}
};

PyObject* new_exception(py::module_& m, const char* name, PyObject* bases, const char* doc) {
  std::string qualified = std::string("peerstate._C.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(type));
  return type;
}

void register_translator() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      PyErr_SetString(g_exceptions[static_cast<size_t>(e.code)], e.what());
    }
  });
}

}  // namespace

void raise_if_error(const Status& st) {
  if (st.ok()) return;
  throw StatusException(st.code(), st.message());
}

py::object exception_object(const Status& st) {
  if (st.ok()) return py::none();
  return py::reinterpret_borrow<py::object>(g_exceptions[static_cast<size_t>(st.code())])(st.message());
}

void bind_errors(py::module_& m) {
  PyObject* base = new_exception(m, "Error", PyExc_Exception, "Root of every peerstate error.");
  g_exceptions.fill(base);
  py::list codes;
  auto add = [&](StatusCode code, const char* code_name, const char* name, const char* builtin, const char* doc) {
    PyObject* also = *builtin ? PyDict_GetItemString(PyEval_GetBuiltins(), builtin) : nullptr;
    if (*builtin && also == nullptr) throw std::runtime_error(std::string("no Python builtin ") + builtin);
    PyObject* bases = also ? PyTuple_Pack(2, base, also) : PyTuple_Pack(1, base);
    g_exceptions[static_cast<size_t>(code)] = new_exception(m, name, bases, doc);
    Py_DECREF(bases);
    codes.append(py::make_tuple(static_cast<int>(code), code_name, name, builtin, doc));
  };
#define PEERSTATE_BIND_STATUS(code, exception, builtin, doc) add(StatusCode::code, #code, #exception, builtin, doc);
  PEERSTATE_STATUS_CODES(PEERSTATE_BIND_STATUS)
#undef PEERSTATE_BIND_STATUS
  // (value, code, exception, builtin base or "", doc) for every code but kOk, in table order.
  m.attr("status_codes") = codes;

  register_translator();
}

void import_errors() {
  py::module_ core = py::module_::import("peerstate._C");
  g_exceptions.fill(core.attr("Error").ptr());
#define PEERSTATE_IMPORT_STATUS(code, exception, builtin, doc) \
  g_exceptions[static_cast<size_t>(StatusCode::code)] = core.attr(#exception).ptr();
  PEERSTATE_STATUS_CODES(PEERSTATE_IMPORT_STATUS)
#undef PEERSTATE_IMPORT_STATUS
  // The classes live as long as peerstate._C, which sys.modules keeps.
  register_translator();
}

}  // namespace peerstate::bindings
