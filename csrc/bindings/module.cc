// peerstate._C: the native core. Each subsystem registers its own bindings.
#include "bindings/common.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "peerstate native core (see peerstate/_C.pyi)";
  peerstate::bindings::bind_errors(m);
  peerstate::bindings::bind_snapshot(m);
  peerstate::bindings::bind_net(m);
  peerstate::bindings::bind_replication(m);
  peerstate::bindings::bind_device(m);
  peerstate::bindings::bind_liveness(m);
  peerstate::bindings::bind_parity(m);
}
