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
  auto sub = [&](StatusCode code, const char* name, PyObject* builtin, const char* doc) {
    PyObject* bases = builtin ? PyTuple_Pack(2, base, builtin) : PyTuple_Pack(1, base);
    g_exceptions[static_cast<size_t>(code)] = new_exception(m, name, bases, doc);
    Py_DECREF(bases);
  };
  sub(StatusCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
      "An argument was unusable; nothing changed.");
  sub(StatusCode::kNotFound, "NotFoundError", PyExc_LookupError,
      "A version, buffer or peer that does not exist.");
  sub(StatusCode::kChecksumMismatch, "ChecksumMismatchError", nullptr,
      "Stored bytes failed their CRC32C; nothing was written.");
  sub(StatusCode::kRegistrationMismatch, "RegistrationMismatchError", nullptr,
      "A version's layout differs from the registered buffers; nothing was written.");
  sub(StatusCode::kBudgetExceeded, "BudgetExceededError", nullptr,
      "The memory budget would be exceeded; nothing was registered.");
  sub(StatusCode::kBusy, "BusyError", nullptr, "Conflicts with an operation in flight.");
  sub(StatusCode::kUnavailable, "UnavailableError", nullptr,
      "A capability this build or machine lacks (CUDA, NCCL).");
  sub(StatusCode::kCudaError, "CudaError", nullptr, "A CUDA runtime call failed.");
  sub(StatusCode::kTimeout, "TimeoutError", PyExc_TimeoutError, "A deadline passed.");
  sub(StatusCode::kAborted, "AbortedError", nullptr, "Cancelled by abort() or close().");
  sub(StatusCode::kConnectionError, "PeerConnectionError", PyExc_ConnectionError,
      "A peer closed, reset or could not be reached.");
  sub(StatusCode::kAuthenticationError, "AuthenticationError", nullptr,
      "A peer failed the job-secret challenge.");
  sub(StatusCode::kProtocolError, "ProtocolError", nullptr,
      "A peer sent a malformed or out-of-bounds message.");
  sub(StatusCode::kOutOfMemory, "OutOfMemoryError", PyExc_MemoryError, "An allocation failed.");
  sub(StatusCode::kInternal, "InternalError", nullptr, "A bug in peerstate; please report it.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      PyErr_SetString(g_exceptions[static_cast<size_t>(e.code)], e.what());
    }
  });
}

}  // namespace peerstate::bindings
