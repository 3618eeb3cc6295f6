// Socket::shutdown() from another thread racing the owner's close(): what
// TcpServer::stop() and evict() do to a connection whose thread is ending. Built
// with ThreadSanitizer (tests/native/test_units.py), which reports an
// unsynchronised pair of accesses whichever way the threads happen to interleave;
// a twin built with the guard taken out of shutdown() shows that it would.
#include <sys/socket.h>

#include <thread>

#include <gtest/gtest.h>

#include "net/socket.h"

namespace peerstate {
namespace {

TEST(SocketRace, ShutdownFromAnotherThreadAndTheOwnersCloseAreSerialised) {
  for (int i = 0; i < 100; ++i) {
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    Socket owner(fds[0]);
    Socket peer(fds[1]);
    std::thread stopper([&owner] { owner.shutdown(); });
    owner.close();
    stopper.join();
    EXPECT_FALSE(owner.valid());
  }
}

TEST(SocketRace, AMovedFromSocketNeitherClosesNorShutsAnything) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  Socket first(fds[0]);
  Socket peer(fds[1]);
  Socket second(std::move(first));
  first.shutdown();
  first.close();
  char byte = 'x';
  ASSERT_TRUE(peer.send_all(&byte, 1, deadline_after_ms(1000)).ok());
  char got = 0;
  ASSERT_TRUE(second.recv_all(&got, 1, deadline_after_ms(1000)).ok());  // still open, not shut
  EXPECT_EQ(got, 'x');
  first = std::move(second);  // a moved-from Socket takes another's descriptor and guard
  first.shutdown();
  EXPECT_FALSE(first.recv_all(&got, 1, deadline_after_ms(1000)).ok());
}

}  // namespace
}  // namespace peerstate
