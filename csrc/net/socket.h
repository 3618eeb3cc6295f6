// Sockets with deadlines, for the tcp transport.
//
// Every blocking call takes a deadline and returns kTimeout when it passes;
// kConnectionError when the peer closes or resets. A socket may watch a
// CancelSignal: firing it makes every call blocked on the socket (connect
// included) return kAborted at once, which is how a transport aborts.
// shutdown() wakes calls blocked on a connected socket, from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "common/deadline.h"
#include "common/status.h"

namespace peerstate {

// A one-shot, thread-safe "stop waiting" flag that poll() can watch (an eventfd).
class CancelSignal {
 public:
  CancelSignal();
  ~CancelSignal();
  CancelSignal(const CancelSignal&) = delete;
  CancelSignal& operator=(const CancelSignal&) = delete;
  void fire();
  int fd() const { return fd_; }

 private:
  int fd_;
};

// One thread owns a Socket (every call but shutdown()); shutdown() may come from any
// thread at any time, close() included: the two are serialised, so a shutdown() never
// reaches a descriptor number close() has given back (the process may have reused it
// for another socket already: a server thread's close and a stop()'s shutdown raced so).
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept
      : fd_(other.fd_), cancel_fd_(other.cancel_fd_), closing_(std::move(other.closing_)) {
    other.fd_ = -1;
  }
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  bool valid() const { return fd_ >= 0; }
  // Blocking calls also return (kAborted) when `cancel` fires. It must outlive the socket.
  void watch(const CancelSignal& cancel) { cancel_fd_ = cancel.fd(); }
  int fd() const { return fd_; }
  // Whether an idle connection can no longer be used: the peer closed it, or
  // sent bytes nobody asked for. Never blocks.
  bool stale() const;
  // Peer address as "host:port" (for log lines).
  std::string peer_name() const;

  Status send_all(const void* data, size_t nbytes, Deadline deadline);
  Status recv_all(void* data, size_t nbytes, Deadline deadline);
  // Receives between 1 and `max` bytes (what has arrived), waiting for the first.
  Status recv_some(void* data, size_t max, size_t* got, Deadline deadline);

  void shutdown();  // any thread, even racing close(); wakes blocked callers
  void close();     // the owner's thread

 private:
  friend Status connect_to(const std::string&, int, Deadline, Socket*, const CancelSignal*);
  int fd_ = -1;
  int cancel_fd_ = -1;
  // Held by close() while it gives the number back and by shutdown(); a pointer so that
  // a Socket moves (a moved-from Socket has none, and no descriptor either).
  std::unique_ptr<std::mutex> closing_ = std::make_unique<std::mutex>();
};

// Binds host:port (port 0 picks a free one) and listens. `bound_port` gets the port.
Status listen_on(const std::string& host, int port, Socket* out, int* bound_port);
// Waits for one connection on `listener` until the deadline.
Status accept_from(Socket& listener, Deadline deadline, Socket* out);
// Connects; `cancel` (optional) aborts the wait and is watched by the new socket.
Status connect_to(const std::string& host, int port, Deadline deadline, Socket* out,
                  const CancelSignal* cancel = nullptr);

}  // namespace peerstate
