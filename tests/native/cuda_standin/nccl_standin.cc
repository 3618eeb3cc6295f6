// An NCCL stand-in for tests on machines with no GPU: the entry points
// peerstate's loader binds (device/nccl_library.cc), between processes over
// loopback sockets, on the CUDA stand-in's "device" memory (host memory) and
// streams. Loaded through the same loader (PEERSTATE_NCCL_LIBRARY), so the nccl
// transport's own source (device/cuda/nccl_transport.cu, built as C++) runs its
// chunking, ordering, abort and error paths between real processes.
//
// Modelled: a unique id names the root's bootstrap listener (the process that
// made it serves the address table until every rank joined, as NCCL's
// bootstrap does); each rank connects to every other once per direction;
// ncclSend/ncclRecv inside ncclGroupStart/End run, at ncclGroupEnd, as one
// operation on the caller's stream, in order per peer and direction; a send
// completes when the receiver has the bytes (an acknowledgement per message);
// a length that differs from the matching receive's, or a peer gone, sets the
// communicator's asynchronous error and leaves the stream operation hanging
// until ncclCommAbort, as a failed NCCL kernel does. For tests of a transfer cut
// part way: PEERSTATE_NCCL_STANDIN_HOLD_AFTER=n makes a sender stop after its n-th
// message has landed and hold until its peer goes away (so an abort or a kill
// lands in the middle of the transfer whatever the machine's load);
// PEERSTATE_NCCL_STANDIN_DELAY_US delays each send.
// Not modelled: collectives, devices, NVLink/IB transports, ncclCommInitRank's
// non-blocking config, and the bandwidth of anything.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

namespace {

enum : int { ncclSuccess = 0, ncclSystemError = 2, ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6 };
constexpr char kMagic[8] = {'p', 's', 'n', 'c', 'c', 'l', '0', '1'};
constexpr int kBootstrapTimeoutMs = 60000;

struct UniqueId {
  char magic[8];
  uint16_t port;  // the root's bootstrap listener on 127.0.0.1
  char rest[118];
};
static_assert(sizeof(UniqueId) == 128, "ncclUniqueId is 128 bytes");

bool write_all(int fd, const void* data, size_t nbytes) {
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    const ssize_t n = ::send(fd, p, nbytes, MSG_NOSIGNAL);
    if (n <= 0) return false;
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
  return true;
}

bool read_all(int fd, void* data, size_t nbytes) {
  char* p = static_cast<char*>(data);
  while (nbytes > 0) {
    const ssize_t n = ::recv(fd, p, nbytes, 0);
    if (n <= 0) return false;
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
  return true;
}

bool readable_within(int fd, int timeout_ms) {
  pollfd pfd{fd, POLLIN, 0};
  return ::poll(&pfd, 1, timeout_ms) == 1;
}

int listener(uint16_t* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

struct Hello {
  int32_t nranks, rank;
  uint16_t port;
};

// The root's bootstrap: the first hello names nranks; once every rank said
// hello, each gets the table of listener ports by rank.
void serve_bootstrap(int fd) {
  std::vector<int> clients;
  std::vector<uint16_t> ports;
  int nranks = -1;
  while (nranks < 0 || static_cast<int>(clients.size()) < nranks) {
    if (!readable_within(fd, kBootstrapTimeoutMs)) break;
    const int client = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
    Hello hello{};
    if (client < 0 || !read_all(client, &hello, sizeof(hello))) break;
    if (nranks < 0) {
      nranks = hello.nranks;
      ports.assign(static_cast<size_t>(nranks), 0);
    }
    if (hello.rank >= 0 && hello.rank < nranks) ports[static_cast<size_t>(hello.rank)] = hello.port;
    clients.push_back(client);
  }
  for (int client : clients) {
    if (static_cast<int>(clients.size()) == nranks) write_all(client, ports.data(), ports.size() * sizeof(uint16_t));
    ::close(client);
  }
  ::close(fd);
}

struct Op {
  bool send;
  char* buffer;
  size_t nbytes;
  int peer;
};

}  // namespace

struct ncclComm {
  int rank = 0, nranks = 0;
  std::vector<int> out, in;  // per peer: the connection this rank sends on, and receives on
  std::mutex mutex;
  std::condition_variable changed;
  bool aborted = false;
  std::atomic<int> async_error{ncclSuccess};

  void fail(int error) {
    int expected = ncclSuccess;
    async_error.compare_exchange_strong(expected, error);
    // A failed NCCL kernel does not end: the stream waits until the communicator is aborted.
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [this] { return aborted; });
  }
};

namespace {

thread_local int t_group_depth = 0;
thread_local std::vector<Op>* t_group = nullptr;
thread_local std::vector<std::pair<ncclComm*, cudaStream_t>> t_group_targets;

struct Launch {
  ncclComm* comm;
  std::vector<Op> ops;
};

// One operation on the stream: each (peer, direction) runs its messages in
// order on a thread of its own; the operation ends when all of them have.
void run_launch(void* arg) {
  std::unique_ptr<Launch> launch(static_cast<Launch*>(arg));
  ncclComm* comm = launch->comm;
  std::map<std::pair<int, bool>, std::vector<Op>> lanes;
  for (const Op& op : launch->ops) lanes[{op.peer, op.send}].push_back(op);
  const char* env = std::getenv("PEERSTATE_NCCL_STANDIN_DELAY_US");
  const long delay = env != nullptr ? std::atol(env) : 0;
  const char* hold_env = std::getenv("PEERSTATE_NCCL_STANDIN_HOLD_AFTER");
  const long hold_after = hold_env != nullptr ? std::atol(hold_env) : 0;
  std::vector<std::thread> threads;
  for (auto& lane : lanes) {
    threads.emplace_back([comm, delay, hold_after, &lane] {
      long sent = 0;
      for (const Op& op : lane.second) {
        if (op.send && hold_after > 0 && sent == hold_after) {
          const int fd = comm->out[static_cast<size_t>(op.peer)];
          readable_within(fd, 120000);  // the peer's end closing (an abort, a kill) makes it readable
          return comm->fail(ncclRemoteError);
        }
        sent++;
        const uint64_t nbytes = op.nbytes;
        char ack = 1;
        if (op.send) {
          if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
          const int fd = comm->out[static_cast<size_t>(op.peer)];
          if (!write_all(fd, &nbytes, sizeof(nbytes)) || !write_all(fd, op.buffer, op.nbytes) ||
              !read_all(fd, &ack, 1) || ack != 1)
            return comm->fail(ack == 0 ? ncclInvalidUsage : ncclRemoteError);
        } else {
          const int fd = comm->in[static_cast<size_t>(op.peer)];
          uint64_t announced = 0;
          if (!read_all(fd, &announced, sizeof(announced))) return comm->fail(ncclRemoteError);
          if (announced != nbytes) {
            ack = 0;
            write_all(fd, &ack, 1);
            return comm->fail(ncclInvalidUsage);
          }
          if (!read_all(fd, op.buffer, op.nbytes) || !write_all(fd, &ack, 1)) return comm->fail(ncclRemoteError);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
}

int enqueue(const Op& op, ncclComm* comm, cudaStream_t stream) {
  if (comm == nullptr || op.peer < 0 || op.peer >= comm->nranks || op.peer == comm->rank) return ncclInvalidArgument;
  {
    std::lock_guard<std::mutex> lock(comm->mutex);
    if (comm->aborted) return ncclInvalidUsage;
  }
  if (t_group_depth == 0) {
    standin_stream_push(stream, run_launch, new Launch{comm, {op}});
    return ncclSuccess;
  }
  if (t_group == nullptr) t_group = new std::vector<Op>();
  t_group->push_back(op);
  t_group_targets.emplace_back(comm, stream);
  return ncclSuccess;
}

}  // namespace

extern "C" {

typedef struct ncclComm* ncclComm_t;

int ncclGetVersion(int* version) {
  *version = 22304;  // what the stand-in claims to be: 2.23.4
  return ncclSuccess;
}

const char* ncclGetErrorString(int result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclSystemError: return "unhandled system error (stand-in)";
    case ncclInvalidArgument: return "invalid argument (stand-in)";
    case ncclInvalidUsage: return "invalid usage (stand-in)";
    case ncclRemoteError: return "remote process exited or there was a network error (stand-in)";
  }
  return "unknown result (stand-in)";
}

int ncclGetUniqueId(UniqueId* id) {
  uint16_t port = 0;
  const int fd = listener(&port);
  if (fd < 0) return ncclSystemError;
  std::memset(id, 0, sizeof(*id));
  std::memcpy(id->magic, kMagic, sizeof(kMagic));
  id->port = port;
  std::random_device random;
  for (char& c : id->rest) c = static_cast<char>(random());
  std::thread(serve_bootstrap, fd).detach();
  return ncclSuccess;
}

int ncclCommInitRank(ncclComm_t* out, int nranks, UniqueId id, int rank) {
  if (std::memcmp(id.magic, kMagic, sizeof(kMagic)) != 0 || nranks < 1 || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  uint16_t port = 0;
  const int own = listener(&port);
  const int root = own < 0 ? -1 : connect_to(id.port);
  std::vector<uint16_t> ports(static_cast<size_t>(nranks));
  const Hello hello{nranks, rank, port};
  const bool booted = root >= 0 && write_all(root, &hello, sizeof(hello)) && readable_within(root, kBootstrapTimeoutMs) &&
                      read_all(root, ports.data(), ports.size() * sizeof(uint16_t));
  if (root >= 0) ::close(root);
  if (!booted) {
    if (own >= 0) ::close(own);
    return ncclSystemError;
  }
  auto comm = std::make_unique<ncclComm>();
  comm->rank = rank;
  comm->nranks = nranks;
  comm->out.assign(static_cast<size_t>(nranks), -1);
  comm->in.assign(static_cast<size_t>(nranks), -1);
  bool ok = true;
  for (int peer = 0; ok && peer < nranks; peer++) {  // the listeners' backlogs take these before any accept
    if (peer == rank) continue;
    const int fd = connect_to(ports[static_cast<size_t>(peer)]);
    const int32_t me = rank;
    ok = fd >= 0 && write_all(fd, &me, sizeof(me));
    comm->out[static_cast<size_t>(peer)] = fd;
  }
  for (int accepted = 0; ok && accepted < nranks - 1; accepted++) {
    int32_t from = -1;
    const int fd = readable_within(own, kBootstrapTimeoutMs) ? ::accept4(own, nullptr, nullptr, SOCK_CLOEXEC) : -1;
    ok = fd >= 0 && read_all(fd, &from, sizeof(from)) && from >= 0 && from < nranks && from != rank;
    if (ok) comm->in[static_cast<size_t>(from)] = fd;
  }
  ::close(own);
  if (!ok) {
    for (int fd : comm->out) if (fd >= 0) ::close(fd);
    for (int fd : comm->in) if (fd >= 0) ::close(fd);
    return ncclSystemError;
  }
  *out = comm.release();
  return ncclSuccess;
}

int ncclCommGetAsyncError(ncclComm_t comm, int* error) {
  *error = comm->async_error.load();
  return ncclSuccess;
}

// Ends every operation in flight (their sockets are shut down) and every later
// call fails. The descriptors are closed by ncclCommDestroy, which a caller that
// aborted may skip: the stand-in then leaks them, which a test process can afford.
int ncclCommAbort(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(comm->mutex);
  comm->aborted = true;
  for (int fd : comm->out) if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  for (int fd : comm->in) if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  comm->changed.notify_all();
  return ncclSuccess;
}

int ncclCommDestroy(ncclComm_t comm) {
  for (int fd : comm->out) if (fd >= 0) ::close(fd);
  for (int fd : comm->in) if (fd >= 0) ::close(fd);
  delete comm;
  return ncclSuccess;
}

int ncclGroupStart() {
  t_group_depth++;
  return ncclSuccess;
}

int ncclGroupEnd() {
  if (t_group_depth == 0) return ncclInvalidUsage;
  if (--t_group_depth > 0 || t_group == nullptr) return ncclSuccess;
  std::unique_ptr<std::vector<Op>> ops(t_group);
  t_group = nullptr;
  // One launch per (communicator, stream), as NCCL launches a group's work.
  std::map<std::pair<ncclComm*, cudaStream_t>, Launch*> launches;
  for (size_t i = 0; i < ops->size(); i++) {
    Launch*& launch = launches[t_group_targets[i]];
    if (launch == nullptr) launch = new Launch{t_group_targets[i].first, {}};
    launch->ops.push_back((*ops)[i]);
  }
  t_group_targets.clear();
  for (auto& entry : launches) standin_stream_push(entry.first.second, run_launch, entry.second);
  return ncclSuccess;
}

int ncclSend(const void* buffer, size_t count, int datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
  if (datatype != 1) return ncclInvalidArgument;  // ncclUint8: the only type peerstate sends
  return enqueue(Op{true, const_cast<char*>(static_cast<const char*>(buffer)), count, peer}, comm, stream);
}

int ncclRecv(void* buffer, size_t count, int datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
  if (datatype != 1) return ncclInvalidArgument;
  return enqueue(Op{false, static_cast<char*>(buffer), count, peer}, comm, stream);
}

}  // extern "C"
