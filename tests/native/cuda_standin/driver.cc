// Runs peerstate's SnapshotStore, with the CUDA device copy engine's own source,
// against the CUDA runtime stand-in: `driver SCENARIO`, exit 0 and "PASS" when
// every check held, else exit 1 with what differed. Scenarios:
//   snapshots    versions 1..12 of device buffers spanning many chunks (many
//                tickets in flight, events reused every version), each filled by
//                a slow "kernel" on the caller's stream just before the snapshot
//                (the copies must follow it: order_after_stream); every committed
//                version holds that version's bytes, and its checksums are those
//                of the bytes that landed (a wait that returned early fails this);
//   restore      an older version copied back onto the device buffers; a
//                corrupted one refused with the buffers untouched;
//   stream_error an asynchronous copy error surfaces as CudaError from wait(),
//                and the version never commits;
//   close        a closed store leaves no registration, event or stream behind,
//                and no copy touched unregistered host memory.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "store/snapshot_store.h"

using namespace peerstate;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    failures++;
  }
}

void check_ok(const Status& st, const std::string& what) { check(st.ok(), what + ": " + st.message()); }

struct Buffers {
  std::vector<void*> device;
  std::vector<size_t> sizes{(3u << 20) + 5, 600u << 10, 2u << 20};
  std::vector<unsigned char> host = std::vector<unsigned char>(1u << 20);
  cudaStream_t stream = nullptr;  // the "training" stream

  Buffers() {
    for (size_t n : sizes) {
      void* p = nullptr;
      cudaMalloc(&p, n);
      device.push_back(p);
    }
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  ~Buffers() {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    for (void* p : device) cudaFree(p);
  }
  static unsigned char pattern(int64_t version, size_t buffer) {
    return static_cast<unsigned char>(1 + (version * 7 + buffer * 13) % 251);
  }
  // A slow kernel per device buffer on the training stream; the host buffer directly.
  void fill(int64_t version) {
    for (size_t b = 0; b < device.size(); b++)
      standin_launch_fill(stream, device[b], pattern(version, b), sizes[b], 3000);
    for (size_t i = 0; i < host.size(); i++) host[i] = standin_pattern(pattern(version, device.size()), i);
  }
  std::vector<BufferRegistration> registration() const {
    std::vector<BufferRegistration> regs;
    regs.push_back({"host", const_cast<unsigned char*>(host.data()), host.size(), kHostDevice, "u8"});
    for (size_t b = 0; b < device.size(); b++)
      regs.push_back({"device" + std::to_string(b), device[b], sizes[b], 0, "u8"});
    return regs;
  }
  bool holds(int64_t version) const {
    for (size_t b = 0; b < device.size(); b++) {
      const unsigned char* p = static_cast<const unsigned char*>(device[b]);
      for (size_t i = 0; i < sizes[b]; i++)
        if (p[i] != standin_pattern(pattern(version, b), i)) return false;
    }
    return true;
  }
};

// A store with `buffers` registered.
std::unique_ptr<SnapshotStore> open_store(const Buffers& buffers) {
  SnapshotStoreOptions options;
  options.chunk_bytes = 512u << 10;
  options.max_versions = 3;
  options.threads = 2;
  std::unique_ptr<SnapshotStore> store;
  check_ok(SnapshotStore::create(options, &store), "create");
  if (store) check_ok(store->register_buffers(buffers.registration()), "register");
  return store;
}

// Every buffer of committed `version` holds its pattern, and every checksum is of the bytes held.
void check_version(SnapshotStore& store, const Buffers& buffers, int64_t version) {
  VersionView view;
  check_ok(store.view(version, &view), "view " + std::to_string(version));
  if (view.data == nullptr) return;
  const Layout& layout = *view.layout;
  for (const BufferPlacement& b : layout.buffers) {
    const size_t index = b.name == "host" ? buffers.device.size() : std::stoul(b.name.substr(6));
    size_t wrong = 0;
    for (size_t i = 0; i < b.nbytes; i++)
      wrong += view.data[b.offset + i] != standin_pattern(Buffers::pattern(version, index), i);
    check(wrong == 0, "version " + std::to_string(version) + ": " + std::to_string(wrong) + " bytes of " + b.name +
                          " are not the bytes it held when the snapshot was taken");
  }
  for (size_t c = 0; c < layout.chunks.size(); c++)
    check(chunk_checksum(layout, c, view.data) == view.checksums[c],
          "version " + std::to_string(version) + ": chunk " + std::to_string(c) +
              " was checksummed before its copy landed");
}

void snapshots(SnapshotStore& store, Buffers& buffers, int64_t upto) {
  standin_set_copy_delay_us(400);
  for (int64_t v = 1; v <= upto; v++) {
    buffers.fill(v);
    check_ok(store.snapshot(v, reinterpret_cast<uintptr_t>(buffers.stream)), "snapshot " + std::to_string(v));
    check_ok(store.wait(), "wait " + std::to_string(v));
    check_version(store, buffers, v);
  }
}

int scenario_snapshots() {
  Buffers buffers;
  auto store = open_store(buffers);
  snapshots(*store, buffers, 12);
  check(store->committed_versions().size() == 3, "three versions kept");
  return 0;
}

int scenario_restore() {
  Buffers buffers;
  auto store = open_store(buffers);
  snapshots(*store, buffers, 3);
  buffers.fill(99);  // the live buffers move on
  cudaStreamSynchronize(buffers.stream);
  size_t written = 0;
  check_ok(store->restore(2, true, &written), "restore 2");
  check(buffers.holds(2), "the device buffers hold version 2 after its restore");
  check(written > 0, "the restore wrote bytes");
  check_ok(store->snapshot(3, reinterpret_cast<uintptr_t>(buffers.stream)), "snapshot 3 again");
  check_ok(store->wait(), "wait 3");
  VersionView view;
  check_ok(store->view(3, &view), "view 3");
  const size_t device_chunk = view.layout->chunks.size() - 1;  // device chunks follow the host's
  view.mutable_data[view.layout->chunks[device_chunk].offset] ^= 0x40;
  view = VersionView();
  buffers.fill(98);
  cudaStreamSynchronize(buffers.stream);
  const Status st = store->restore(3);
  check(st.code() == StatusCode::kChecksumMismatch, "a corrupt version is refused: " + st.message());
  check(buffers.holds(98), "a refused restore leaves the device buffers as they were");
  return 0;
}

int scenario_stream_error() {
  Buffers buffers;
  auto store = open_store(buffers);
  snapshots(*store, buffers, 1);
  buffers.fill(2);
  standin_fail_copy(3);
  Status st = store->snapshot(2, reinterpret_cast<uintptr_t>(buffers.stream));
  if (st.ok()) st = store->wait();
  check(st.code() == StatusCode::kCudaError && st.message().find("cudaErrorIllegalAddress") != std::string::npos,
        "a copy's asynchronous error is the snapshot's CudaError: " + st.message());
  const std::vector<int64_t> committed = store->committed_versions();
  check(committed == std::vector<int64_t>{1}, "the failed version did not commit");
  standin_reset_error();
  return 0;
}

int scenario_close() {
  {
    Buffers buffers;
    auto store = open_store(buffers);
    snapshots(*store, buffers, 4);
    check(standin_read_counters().host_registrations > 0, "the store's regions are registered while it holds them");
    check_ok(store->close(), "close");
  }
  const standin_counters counters = standin_read_counters();
  check(counters.host_registrations == 0, std::to_string(counters.host_registrations) + " host registrations left");
  check(counters.live_events == 0, std::to_string(counters.live_events) + " events left");
  check(counters.live_streams == 0, std::to_string(counters.live_streams) + " streams left");
  check(counters.device_allocations == 0, std::to_string(counters.device_allocations) + " device allocations left");
  check(counters.copies > 0 && counters.unpinned_copies == 0,
        std::to_string(counters.unpinned_copies) + " of " + std::to_string(counters.copies) +
            " copies into or out of unregistered host memory");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string name = argc > 1 ? argv[1] : "";
  if (name == "snapshots") scenario_snapshots();
  else if (name == "restore") scenario_restore();
  else if (name == "stream_error") scenario_stream_error();
  else if (name == "close") scenario_close();
  else {
    std::fprintf(stderr, "usage: driver snapshots|restore|stream_error|close\n");
    return 2;
  }
  if (failures == 0) std::printf("PASS %s\n", name.c_str());
  return failures == 0 ? 0 : 1;
}
