// Runs peerstate's nccl transport (its own source) between two processes over
// the NCCL and CUDA stand-ins, libnccl loaded through peerstate's loader:
//   nccl_driver send SCENARIO IDFILE   rank 0: makes the unique id, writes it to
//                                      IDFILE, sends 9 chunks of device memory
//   nccl_driver recv SCENARIO IDFILE   rank 1: reads the id, then per SCENARIO
//     transfer  receives every chunk; each lands at its offset, the queue is done;
//     abort     aborts from another thread once the first chunk landed: kAborted,
//               every chunk given back;
//     killed    prints FIRST once the first chunk landed (the test kills the
//               sender then): the receive fails within its timeout, no hang;
//     timeout   never receives (the sender must time out and abort).
// Each side prints "RESULT <status code> <message>" and, when its checks held, PASS.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "device/nccl_transport.h"

using namespace peerstate;

namespace {

constexpr size_t kChunkBytes = 256u << 10;
constexpr size_t kBytes = 9 * kChunkBytes - 1000;

unsigned char expected(size_t i) { return static_cast<unsigned char>(1 + (i * 131 + i / 4096) % 251); }

int done(bool ok, const Status& st) {
  std::printf("RESULT %d %s\n", static_cast<int>(st.code()), st.message().c_str());
  if (ok) std::printf("PASS\n");
  std::fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: nccl_driver send|recv transfer|abort|killed|timeout IDFILE\n");
    return 2;
  }
  const std::string role = argv[1], scenario = argv[2], idfile = argv[3];
  const bool sender = role == "send";
  NcclLibrary nccl;
  Status st = NcclLibrary::load(&nccl);
  if (!st.ok()) return done(false, st);
  NcclUniqueId id{};
  if (sender) {
    if (!(st = nccl_unique_id(nccl, &id)).ok()) return done(false, st);
    std::ofstream(idfile + ".part", std::ios::binary).write(id.internal, sizeof(id.internal));
    std::rename((idfile + ".part").c_str(), idfile.c_str());
  } else {
    std::ifstream(idfile, std::ios::binary).read(id.internal, sizeof(id.internal));
  }
  const long timeout_ms = scenario == "timeout" || scenario == "killed" ? 3000 : 60000;
  std::unique_ptr<Transport> transport;
  if (!(st = create_nccl_transport(nccl, id, 2, sender ? 0 : 1, 0, timeout_ms, &transport)).ok())
    return done(false, st);
  if (!sender && scenario == "timeout") {
    std::this_thread::sleep_for(std::chrono::seconds(60));  // the test ends this process
    return 0;
  }

  void* region = nullptr;
  cudaMalloc(&region, kBytes);
  unsigned char* bytes = static_cast<unsigned char*>(region);
  for (size_t i = 0; i < kBytes; i++) bytes[i] = sender ? expected(i) : 0;
  BufferRegistration buffer{"weights", region, kBytes, 0, "u8"};
  auto layout = std::make_shared<Layout>();
  if (!(st = build_layout({buffer}, kChunkBytes, layout.get())).ok()) return done(false, st);
  TransferPlan plan;
  plan.meta.layout = layout;
  plan.region = bytes;
  ChunkQueue queue(layout->chunks.size());
  plan.queue = &queue;

  if (sender) {
    st = transport->send(1, plan);
    const bool ok = scenario == "transfer" ? st.ok() && queue.finished()
                    : scenario == "timeout" ? st.code() == StatusCode::kTimeout && queue.done_count() == 0
                                            : !st.ok();  // abort: the receiver went away part way
    return done(ok, st);
  }
  if (scenario == "transfer") {
    st = transport->receive(0, plan);
    size_t wrong = 0;
    for (size_t i = 0; i < kBytes; i++) wrong += bytes[i] != expected(i);
    if (wrong != 0) std::fprintf(stderr, "%zu bytes differ from what was sent\n", wrong);
    return done(st.ok() && queue.finished() && wrong == 0, st);
  }
  std::thread receiving([&] { st = transport->receive(0, plan); });
  while (*static_cast<volatile unsigned char*>(bytes) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::printf("FIRST\n");
  std::fflush(stdout);
  if (scenario == "abort") transport->abort();
  receiving.join();
  const bool ok = scenario == "abort" ? st.code() == StatusCode::kAborted && queue.done_count() == 0
                                      : !st.ok() && queue.done_count() == 0;
  return done(ok, st);
}
