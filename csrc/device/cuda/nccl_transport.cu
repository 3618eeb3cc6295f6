// The nccl transport (see device/nccl_transport.h for the contract).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "device/nccl_transport.h"

namespace peerstate {
namespace {

class NcclTransport final : public Transport {
 public:
  NcclTransport(const NcclLibrary& nccl, NcclComm comm, cudaStream_t stream, int device, long timeout_ms)
      : nccl_(nccl), comm_(comm), stream_(stream), device_(device), timeout_ms_(timeout_ms) {}

  ~NcclTransport() override {
    if (!aborted_.load()) nccl_.comm_destroy(comm_);
    cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "nccl"; }

  Status send(int peer, const TransferPlan& plan) override { return transfer(peer, plan, true); }
  Status receive(int peer, const TransferPlan& plan) override { return transfer(peer, plan, false); }

  Status describe(int, int, int64_t, uint32_t, VersionMeta*) override {
    return Status(StatusCode::kUnavailable, "the nccl transport moves chunk bytes only; ask over tcp for metadata");
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aborted_.exchange(true)) nccl_.comm_abort(comm_);
  }

 private:
  Status nccl_status(int rc, const char* what) {
    if (rc == 0) return Status::Ok();
    return Status(aborted_.load() ? StatusCode::kAborted : StatusCode::kConnectionError,
                  std::string(what) + " failed: " + nccl_.get_error_string(rc));
  }

  Status transfer(int peer, const TransferPlan& plan, bool sending) {
    if (aborted_.load()) return Status(StatusCode::kAborted, "nccl transport aborted");
    if (cudaSetDevice(device_) != cudaSuccess) return Status(StatusCode::kCudaError, "cudaSetDevice failed");
    const Layout& layout = *plan.meta.layout;
    std::vector<uint32_t> taken;
    uint32_t c;
    // Both sides walk the chunks in the same order, so every ncclSend meets its ncclRecv.
    // try_take: the chunks this call takes stay in progress until the group's stream
    // work is done, so a blocking take() would wait for them forever.
    PEERSTATE_RETURN_IF_ERROR(nccl_status(nccl_.group_start(), "ncclGroupStart"));
    while (plan.queue->try_take(&c)) {
      const ChunkPlacement& chunk = layout.chunks[c];
      unsigned char* place = plan.region + chunk.offset - plan.region_base;
      int rc = sending ? nccl_.send(place, chunk.nbytes, kNcclUint8, peer, comm_, stream_)
                       : nccl_.recv(place, chunk.nbytes, kNcclUint8, peer, comm_, stream_);
      taken.push_back(c);
      if (rc != 0) {
        (void)nccl_.group_end();
        for (uint32_t t : taken) plan.queue->give_back(t);
        return nccl_status(rc, sending ? "ncclSend" : "ncclRecv");
      }
    }
    const Status grouped = nccl_status(nccl_.group_end(), "ncclGroupEnd");
    const Status st = grouped.ok() ? wait_stream() : grouped;
    for (uint32_t t : taken) {
      if (st.ok())
        plan.queue->complete(t);
      else
        plan.queue->give_back(t);
    }
    return st;
  }

  // Polls instead of cudaStreamSynchronize so that a dead peer ends in a
  // bounded time (and abort() from another thread is noticed).
  Status wait_stream() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
    for (;;) {
      cudaError_t err = cudaStreamQuery(stream_);
      // An abort ends the communicator's work early, and the stream then completes as if
      // it had finished: a transfer is done only if no abort came before its end was seen
      // (abort() sets the flag before it aborts the communicator).
      if (err == cudaSuccess)
        return aborted_.load() ? Status(StatusCode::kAborted, "nccl transport aborted") : Status::Ok();
      if (err != cudaErrorNotReady)
        return Status(StatusCode::kCudaError, std::string("nccl transfer stream failed: ") + cudaGetErrorString(err));
      if (aborted_.load()) return Status(StatusCode::kAborted, "nccl transport aborted");
      int async = 0;
      if (nccl_.comm_get_async_error(comm_, &async) == 0 && async != 0 && async != 7 /* ncclInProgress */) {
        const Status failed = nccl_status(async, "nccl communicator");
        // A failed communicator's work never ends on its own, and destroying it would wait for
        // that work: only an abort frees the stream (NCCL's documented way out of an error).
        abort();
        return Status(failed.code(), failed.message() + "; the communicator was aborted");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        return Status(StatusCode::kTimeout, "nccl transfer did not finish within " + std::to_string(timeout_ms_) +
                                                " ms; the communicator was aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  const NcclLibrary nccl_;
  NcclComm comm_;
  cudaStream_t stream_;
  const int device_;
  const long timeout_ms_;
  std::mutex mutex_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

Status nccl_transport_built() { return Status::Ok(); }

Status create_nccl_transport(const NcclLibrary& nccl, const NcclUniqueId& id, int nranks, int rank, int device,
                             long timeout_ms, std::unique_ptr<Transport>* out) {
  out->reset();
  if (cudaSetDevice(device) != cudaSuccess)
    return Status(StatusCode::kUnavailable, "cannot use CUDA device " + std::to_string(device));
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    return Status(StatusCode::kCudaError, "cudaStreamCreate failed");
  NcclComm comm = nullptr;
  int rc = nccl.comm_init_rank(&comm, nranks, id, rank);
  if (rc != 0) {
    cudaStreamDestroy(stream);
    return Status(StatusCode::kConnectionError, std::string("ncclCommInitRank failed: ") + nccl.get_error_string(rc));
  }
  out->reset(new NcclTransport(nccl, comm, stream, device, timeout_ms));
  return Status::Ok();
}

}  // namespace peerstate
