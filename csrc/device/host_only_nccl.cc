// Host-only build, the NCCL transport's side: there is none, and every request
// for one says why.
#include "device/nccl_transport.h"

namespace peerstate {

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

}  // namespace peerstate
