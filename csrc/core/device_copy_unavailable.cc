// Host-only build: there is no device path, and every request for one says why.
#include "core/device_copy.h"

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
