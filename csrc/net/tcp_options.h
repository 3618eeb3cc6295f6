// Options shared by the two ends of the tcp transport (tcp_server.h, tcp_transport.h).
#pragma once

#include <cstddef>
#include <string>

#include "net/credentials.h"
#include "net/wire.h"

namespace peerstate {

struct TcpOptions {
  Credentials credentials;          // what this end proves (its rank's); required
  FrameProtection protection = FrameProtection::kAuthenticated;  // both ends must agree
  size_t connections_per_peer = 4;  // client side
  long connect_timeout_ms = 5000;
  // Per transfer step; also how long a server keeps an idle authenticated
  // connection (a client reopens one idle for half of it before use).
  long io_timeout_ms = 30000;
  // Server side: connections still in their handshake (in all, and from one
  // source address), connections of one authenticated peer, and all
  // connections. A newcomer over a handshake cap is admitted and the oldest
  // handshake of its own source, or of the source holding most, is closed
  // (tcp_server.h says why); over the other caps the newcomer is closed at
  // once. Each kind is logged once per second.
  size_t max_handshaking = 64;
  // An honest node has one handshake in flight per rank's transport (it opens its
  // connections to a peer one at a time): 8 on an 8-GPU node, half this share.
  size_t max_handshaking_per_source = 16;
  size_t max_per_peer = 16;
  size_t max_connections = 256;
};

}  // namespace peerstate
