// A stand-in for the subset of the CUDA runtime API that peerstate's device copy
// engine (csrc/device/cuda/cuda_device_copy.cu) calls, for tests on machines
// with no GPU. The engine's own source is compiled as C++ against this header
// and linked with standin.cc, so the same engine code runs its snapshot,
// restore and ticket paths.
//
// Modelled: "device" memory is host memory from cudaMalloc, remembered as
// device memory so that a copy in the wrong direction is an error; each stream
// has a worker thread that runs its operations in order, each copy after a
// configurable delay (so a wait that returns before its copy landed is seen);
// events complete when the stream reaches their record, and the newest record
// is the one waited for, as in CUDA; an injected copy error is sticky and
// surfaces at the next synchronising call, as an asynchronous CUDA error does.
// Not modelled: DMA and its bandwidth, pinned-memory limits, concurrency of
// copy engines, the legacy default stream's implicit synchronisation with
// other blocking streams (the engine's stream is non-blocking), contexts.
#pragma once

#include <cstddef>

extern "C" {

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
} cudaError_t;

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};

#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02
#define cudaHostRegisterPortable 0x01

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetLastError(void);
const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);

cudaError_t cudaMalloc(void** ptr, size_t nbytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaHostRegister(void* ptr, size_t nbytes, unsigned int flags);
cudaError_t cudaHostUnregister(void* ptr);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t nbytes, enum cudaMemcpyKind kind,
                            cudaStream_t stream);

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);

// The stand-in's own controls, for the tests' driver.
struct standin_counters {
  long live_streams;
  long live_events;       // created and not destroyed
  long host_registrations;
  long device_allocations;
  long copies;            // asynchronous copies queued
  long unpinned_copies;   // of them, into or out of host memory that was not registered
};
void standin_set_copy_delay_us(unsigned int microseconds);
// The `nth` asynchronous copy from now (1 = the next) fails with an illegal
// address instead of copying; the error is sticky until standin_reset_error().
void standin_fail_copy(long nth);
void standin_reset_error(void);
// What a kernel would do: after `delay_us`, in stream order, fill `nbytes` of
// device memory at `ptr` with standin_pattern(value, i) at byte i.
cudaError_t standin_launch_fill(cudaStream_t stream, void* ptr, unsigned char value, size_t nbytes,
                                unsigned int delay_us);
struct standin_counters standin_read_counters(void);
// Runs run(arg) on `stream` in order with its other work: the NCCL stand-in
// queues its transfers here, as NCCL queues its kernels.
cudaError_t standin_stream_push(cudaStream_t stream, void (*run)(void*), void* arg);
// `value` plus the index of the byte's 4 KiB page: bytes copied from or to a
// wrong offset show.
static inline unsigned char standin_pattern(unsigned char value, size_t i) {
  return (unsigned char)(value + (i >> 12));
}
}
