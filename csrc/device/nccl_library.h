// NcclLibrary: libnccl, found at run time, never linked.
//
// Search order: the path in PEERSTATE_NCCL_LIBRARY if set (and nothing else);
// otherwise symbols already in the process (dlsym(RTLD_DEFAULT), so the copy
// torch loaded is reused), then an already-loaded libnccl.so.2
// (RTLD_NOLOAD), then dlopen("libnccl.so.2"). The version must be at least
// kMinimumNcclVersion. Failures are kUnavailable with a message that says
// what was searched and what was found. This file includes no NCCL header:
// the few types it needs are ABI-stable and declared here.
#pragma once

#include <cstddef>
#include <string>

#include "common/status.h"

namespace peerstate {

constexpr int kMinimumNcclVersion = 21800;  // 2.18.0, as NCCL_VERSION_CODE encodes it

struct NcclUniqueId {
  char internal[128];
};
using NcclComm = struct NcclCommOpaque*;
using NcclStream = void*;  // cudaStream_t
enum NcclDataType : int { kNcclUint8 = 1 };

struct NcclLibrary {
  int version = 0;
  std::string origin;  // where it was found, for messages
  int (*get_version)(int*) = nullptr;
  int (*get_unique_id)(NcclUniqueId*) = nullptr;
  int (*comm_init_rank)(NcclComm*, int, NcclUniqueId, int) = nullptr;
  int (*comm_abort)(NcclComm) = nullptr;
  int (*comm_destroy)(NcclComm) = nullptr;
  int (*comm_get_async_error)(NcclComm, int*) = nullptr;
  int (*send)(const void*, size_t, int, int, NcclComm, NcclStream) = nullptr;
  int (*recv)(void*, size_t, int, int, NcclComm, NcclStream) = nullptr;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  const char* (*get_error_string)(int) = nullptr;

  // Finds and checks libnccl as described above.
  static Status load(NcclLibrary* out);
  // "2.21.5" from 22105.
  static std::string version_string(int code);
};

}  // namespace peerstate
