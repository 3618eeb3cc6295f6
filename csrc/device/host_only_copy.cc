// Host-only build, the device copy engine's side: there is no device path, and
// every request for one says why (the core's store/ layer links this; the NCCL
// side is host_only_nccl.cc, above net/).
#include "common/device_copy.h"

namespace peerstate {

Status DeviceCopyEngine::create(std::unique_ptr<DeviceCopyEngine>* out) {
  out->reset();
  return Status(StatusCode::kUnavailable,
                "this peerstate build has no CUDA support (it was built without nvcc, or with "
                "PEERSTATE_CUDA=OFF); reinstall on a machine with the CUDA toolkit to snapshot "
                "GPU memory");
}

bool cuda_compiled() { return false; }
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }

}  // namespace peerstate
