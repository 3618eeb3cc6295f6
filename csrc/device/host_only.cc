// Host-only build: there is no device path, and every request for one says why.
#include "common/device_copy.h"
#include "device/nccl_transport.h"

namespace peerstate {

Status DeviceCopyEngine::create(std::unique_ptr<DeviceCopyEngine>* out) {
  out->reset();
  return Status(StatusCode::kUnavailable,
                "this peerstate build has no CUDA support (it was built without nvcc, or with "
                "PEERSTATE_CUDA=OFF); reinstall on a machine with the CUDA toolkit to snapshot "
                "GPU memory");
}

Status nccl_transport_built() {
  return Status(StatusCode::kUnavailable,
                "this peerstate build has no CUDA support, so no nccl transport; use the tcp transport "
                "or reinstall on a machine with the CUDA toolkit");
}

Status create_nccl_transport(const NcclLibrary&, const NcclUniqueId&, int, int, int, long,
                             std::unique_ptr<Transport>* out) {
  out->reset();
  return nccl_transport_built();
}

bool cuda_compiled() { return false; }
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }

}  // namespace peerstate
