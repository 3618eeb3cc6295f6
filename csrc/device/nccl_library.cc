#include "device/nccl_library.h"

#include <dlfcn.h>

#include <cstdlib>

namespace peerstate {
namespace {

template <typename Fn>
bool bind(void* handle, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  return *out != nullptr;
}

// Resolves every entry point from `handle`; the name of the first missing one otherwise.
std::string bind_all(void* handle, NcclLibrary* lib) {
  if (!bind(handle, "ncclGetVersion", &lib->get_version)) return "ncclGetVersion";
  if (!bind(handle, "ncclGetUniqueId", &lib->get_unique_id)) return "ncclGetUniqueId";
  if (!bind(handle, "ncclCommInitRank", &lib->comm_init_rank)) return "ncclCommInitRank";
  if (!bind(handle, "ncclCommAbort", &lib->comm_abort)) return "ncclCommAbort";
  if (!bind(handle, "ncclCommDestroy", &lib->comm_destroy)) return "ncclCommDestroy";
  if (!bind(handle, "ncclCommGetAsyncError", &lib->comm_get_async_error)) return "ncclCommGetAsyncError";
  if (!bind(handle, "ncclSend", &lib->send)) return "ncclSend";
  if (!bind(handle, "ncclRecv", &lib->recv)) return "ncclRecv";
  if (!bind(handle, "ncclGroupStart", &lib->group_start)) return "ncclGroupStart";
  if (!bind(handle, "ncclGroupEnd", &lib->group_end)) return "ncclGroupEnd";
  if (!bind(handle, "ncclGetErrorString", &lib->get_error_string)) return "ncclGetErrorString";
  return "";
}

Status finish(void* handle, const std::string& origin, NcclLibrary* out) {
  NcclLibrary lib;
  lib.origin = origin;
  std::string missing = bind_all(handle, &lib);
  if (!missing.empty())
    return Status(StatusCode::kUnavailable, "the NCCL library at " + origin + " lacks " + missing +
                                                "; peerstate needs NCCL >= " +
                                                NcclLibrary::version_string(kMinimumNcclVersion));
  if (lib.get_version(&lib.version) != 0)
    return Status(StatusCode::kUnavailable, "ncclGetVersion failed in " + origin);
  if (lib.version < kMinimumNcclVersion)
    return Status(StatusCode::kUnavailable, "found NCCL " + NcclLibrary::version_string(lib.version) + " (" + origin +
                                                ") but peerstate needs NCCL >= " +
                                                NcclLibrary::version_string(kMinimumNcclVersion) +
                                                "; install a newer nvidia-nccl-cu12 or point PEERSTATE_NCCL_LIBRARY at one");
  *out = lib;
  return Status::Ok();
}

}  // namespace

std::string NcclLibrary::version_string(int code) {
  // NCCL_VERSION_CODE is X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before.
  if (code >= 10000)
    return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
  return std::to_string(code / 1000) + "." + std::to_string(code / 100 % 10) + "." + std::to_string(code % 100);
}

Status NcclLibrary::load(NcclLibrary* out) {
  if (const char* path = std::getenv("PEERSTATE_NCCL_LIBRARY"); path != nullptr && *path != '\0') {
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr)
      return Status(StatusCode::kUnavailable,
                    std::string("PEERSTATE_NCCL_LIBRARY=") + path + " could not be loaded: " + dlerror());
    return finish(handle, path, out);
  }
  if (dlsym(RTLD_DEFAULT, "ncclGetVersion") != nullptr) return finish(RTLD_DEFAULT, "the process (already loaded)", out);
  if (void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD); handle != nullptr)
    return finish(handle, "libnccl.so.2 (already loaded)", out);
  void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr)
    return Status(StatusCode::kUnavailable,
                  std::string("NCCL not found: no ncclGetVersion in the process and dlopen(\"libnccl.so.2\") failed (") +
                      dlerror() +
                      "); install NCCL (e.g. pip install nvidia-nccl-cu12, or import torch built with CUDA first) "
                      "or set PEERSTATE_NCCL_LIBRARY to its path");
  return finish(handle, "libnccl.so.2", out);
}

}  // namespace peerstate

#include "device/nccl_transport.h"

namespace peerstate {

Status nccl_unique_id(const NcclLibrary& nccl, NcclUniqueId* out) {
  int rc = nccl.get_unique_id(out);
  if (rc != 0) return Status(StatusCode::kUnavailable, std::string("ncclGetUniqueId failed: ") + nccl.get_error_string(rc));
  return Status::Ok();
}

}  // namespace peerstate
