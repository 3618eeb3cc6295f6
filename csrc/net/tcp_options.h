// Options shared by the two ends of the tcp transport (tcp_server.h, tcp_transport.h).
#pragma once

#include <cstddef>
#include <string>

namespace peerstate {

struct TcpOptions {
  std::string secret;               // the job secret; required, at least 16 bytes
  int rank = -1;                    // this rank
  size_t connections_per_peer = 4;  // client side
  long connect_timeout_ms = 5000;
  long io_timeout_ms = 30000;       // per transfer step; also the handshake bound x 1/6
};

}  // namespace peerstate
