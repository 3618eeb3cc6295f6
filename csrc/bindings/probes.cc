// peerstate._probes: the core's utilities that tests and benchmarks measure or
// check directly (checksums, the HMAC, the parallel copy, where libcrypto came
// from), in a module of their own so that the package's _C carries only what
// the package uses. Errors raise _C's exception classes (import_errors).
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "common/crc32c.h"
#include "common/parallel_copy.h"
#include "common/crypto.h"
#include "common/thread_pool.h"

namespace py = pybind11;

namespace peerstate::bindings {
namespace {

Crc32cImplementation parse_implementation(const std::string& name) {
  if (name == "auto") return Crc32cImplementation::kAuto;
  if (name == "hardware") return Crc32cImplementation::kHardware;
  if (name == "software") return Crc32cImplementation::kSoftware;
  raise_if_error(Status(StatusCode::kInvalidArgument,
                        "implementation must be 'auto', 'hardware' or 'software' (got '" + name + "')"));
  return Crc32cImplementation::kAuto;
}

void bind_probes(py::module_& m) {
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
  m.def("crypto_library", [] {
    std::string origin;
    raise_if_error(crypto_library(&origin));
    return origin;
  });
  // One core's rate, in bytes per second (best of `repeats`), of a frame protection over
  // `nbytes` of payload, fed in the transport's 256 KiB pieces: "authenticated" runs the
  // payload through the AES-256-GCM tag as additional data, "encrypted" encrypts it in
  // place as well. What each end of a protected transfer spends beyond plain TCP
  // (bench/replication.py's ceiling).
  m.def("frame_protection_throughput",
        [](const std::string& protection, size_t nbytes, int repeats) {
          if (protection != "authenticated" && protection != "encrypted") {
            raise_if_error(Status(StatusCode::kInvalidArgument,
                                  "protection must be 'authenticated' or 'encrypted' (got '" + protection + "')"));
          }
          const bool encrypt = protection == "encrypted";
          std::vector<uint8_t> payload(nbytes, 0x5a);
          uint8_t key[Aead::kKeyBytes] = {1};
          uint8_t nonce[Aead::kNonceBytes] = {0};
          uint8_t tag[Aead::kTagBytes];
          double best = 0;
          call_without_gil([&]() -> Status {
            std::unique_ptr<Aead> aead;
            PEERSTATE_RETURN_IF_ERROR(Aead::create(key, /*sealing=*/true, &aead));
            constexpr size_t kPiece = 256 << 10;
            for (int round = 0; round < std::max(repeats, 1); ++round) {
              nonce[0] = static_cast<uint8_t>(round);
              auto start = std::chrono::steady_clock::now();
              PEERSTATE_RETURN_IF_ERROR(aead->begin(nonce));
              for (size_t at = 0; at < nbytes; at += kPiece) {
                size_t n = std::min(kPiece, nbytes - at);
                PEERSTATE_RETURN_IF_ERROR(encrypt ? aead->update(payload.data() + at, payload.data() + at, n)
                                                  : aead->aad(payload.data() + at, n));
              }
              PEERSTATE_RETURN_IF_ERROR(aead->seal(tag));
              double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
              best = std::max(best, nbytes / seconds);
            }
            return Status();
          });
          return best;
        },
        py::arg("protection"), py::arg("nbytes") = size_t{64} << 20, py::arg("repeats") = 5);
  m.def("hmac_sha256", [](const py::bytes& key, const py::bytes& data) {
    std::string k = key, d = data;
    Digest out;
    raise_if_error(hmac_sha256(k.data(), k.size(), d.data(), d.size(), &out));
    return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
  });
}

}  // namespace
}  // namespace peerstate::bindings

PYBIND11_MODULE(_probes, m) {
  m.doc() = "peerstate's measurement and test hooks (see peerstate/_probes.pyi); not used by the package";
  peerstate::bindings::import_errors();
  peerstate::bindings::bind_probes(m);
}
