#include "transport/nccl_peer.h"

#include <spdlog/spdlog.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
#include <cuda_runtime.h>
#endif
#if defined(HYPIC_WITH_NCCL) && HYPIC_WITH_NCCL
#include <nccl.h>
#endif

namespace hypic::transport {

using Clock = std::chrono::steady_clock;

std::chrono::steady_clock::time_point transfer_deadline(size_t bytes, std::chrono::milliseconds base,
                                                        double min_bytes_per_s) {
  const double s = min_bytes_per_s > 0 ? double(bytes) / min_bytes_per_s : 0.0;
  return Clock::now() + base + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

void disable_nvls() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* old = std::getenv("NCCL_NVLS_ENABLE");
    if (old && std::string_view(old) != "0") {
      spdlog::warn("NCCL_NVLS_ENABLE={} overridden to 0: NVLink multicast stays off (it can take a shared host's "
                   "GPUs out of service)",
                   old);
    }
    setenv("NCCL_NVLS_ENABLE", "0", 1);
  });
}

std::string device_uuid(int device) {
#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
  cudaDeviceProp prop{};
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    throw TransportError("device_uuid(cuda:" + std::to_string(device) + "): " + cudaGetErrorString(err));
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 16; ++i) {
    const auto b = static_cast<unsigned char>(prop.uuid.bytes[i]);
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
#else
  throw TransportError("device_uuid(cuda:" + std::to_string(device) + "): this build has no CUDA");
#endif
}

#if defined(HYPIC_WITH_NCCL) && HYPIC_WITH_NCCL

std::string nccl_unavailable_reason() { return {}; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z from 2.9 on.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

std::string new_unique_id() {
  disable_nvls();
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw TransportError(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  return std::string(id.internal, sizeof(id.internal));
}

constexpr size_t kScratchBytes = size_t(1) << 20;  // discard's chunks (grown when a sender's chunks are larger)

struct NcclPeer::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  bool pending = false;  // operations posted, not yet waited for
};

namespace {
std::string nccl_error(ncclComm_t comm, ncclResult_t r) {
  std::string s = ncclGetErrorString(r);
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  if (last && *last) s += std::string(" (") + last + ")";
  return s;
}
void check_cuda_t(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw TransportError(std::string(what) + ": " + cudaGetErrorString(e));
}
}  // namespace

std::unique_ptr<NcclPeer> NcclPeer::join(std::string_view unique_id, int rank, int device,
                                         std::chrono::milliseconds timeout) {
  disable_nvls();
  if (rank != 0 && rank != 1) throw TransportError("NcclPeer::join: rank must be 0 or 1, got " + std::to_string(rank));
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    throw TransportError("NcclPeer::join: the unique id has " + std::to_string(unique_id.size()) + " bytes, not " +
                         std::to_string(sizeof(id.internal)));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  check_cuda_t(cudaSetDevice(device), "NcclPeer::join: cudaSetDevice");
  auto impl = std::make_unique<Impl>();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; we poll with a deadline
  ncclResult_t r = ncclCommInitRankConfig(&impl->comm, 2, id, rank, &config);
  const auto deadline = Clock::now() + timeout;
  ncclResult_t state = r;
  while (state == ncclInProgress) {
    if (Clock::now() > deadline) {
      ncclCommAbort(impl->comm);
      throw TransportError("NCCL communicator: the other rank did not join within " +
                           std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (ncclCommGetAsyncError(impl->comm, &state) != ncclSuccess) break;
  }
  if (state != ncclSuccess) {
    const std::string why = nccl_error(impl->comm, state);
    if (impl->comm) ncclCommAbort(impl->comm);
    throw TransportError("NCCL communicator init (rank " + std::to_string(rank) + ", cuda:" + std::to_string(device) +
                         "): " + why);
  }
  try {
    check_cuda_t(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking), "NcclPeer: cudaStreamCreate");
    check_cuda_t(cudaEventCreateWithFlags(&impl->done, cudaEventDisableTiming), "NcclPeer: cudaEventCreate");
    check_cuda_t(cudaMallocAsync(&impl->scratch, kScratchBytes, impl->stream), "NcclPeer: scratch allocation");
    impl->scratch_bytes = kScratchBytes;
    check_cuda_t(cudaStreamSynchronize(impl->stream), "NcclPeer: scratch allocation");
  } catch (...) {
    ncclCommAbort(impl->comm);
    if (impl->scratch) cudaFreeAsync(impl->scratch, impl->stream);
    if (impl->done) cudaEventDestroy(impl->done);
    if (impl->stream) cudaStreamDestroy(impl->stream);
    throw;
  }
  auto peer = std::unique_ptr<NcclPeer>(new NcclPeer(std::move(impl), rank, device));
  // NCCL connects point-to-point channels lazily, on the first operation, which needs both ranks: a one-byte
  // exchange now makes that happen within the join's time, so that an entry's send never waits on a connection
  // whose other end is not receiving.
  TransferLimits hello;
  hello.chunk_bytes = 1;
  hello.deadline = std::max(deadline, Clock::now() + std::chrono::seconds(1));
  if (rank == 1) {
    peer->send(peer->impl_->scratch, 1, hello);
  } else {
    peer->recv(peer->impl_->scratch, 1, hello);
  }
  return peer;
}

NcclPeer::NcclPeer(std::unique_ptr<Impl> impl, int rank, int device)
    : impl_(std::move(impl)), rank_(rank), device_(device) {}

NcclPeer::~NcclPeer() {
  cudaSetDevice(device_);
  // Aborting never waits for the other rank (finalizing waits until both are quiescent, and the other one may be
  // gone or waiting on us); nothing is pending here unless a send was posted and never waited for.
  if (!broken_.load() && impl_->comm) ncclCommAbort(impl_->comm);
  if (impl_->scratch) cudaFreeAsync(impl_->scratch, impl_->stream);
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  if (impl_->done) cudaEventDestroy(impl_->done);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

std::string NcclPeer::broken_reason() const {
  std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(state_));
  return broken_reason_;
}

void NcclPeer::abort_soon(std::string why) {
  std::lock_guard<std::mutex> lock(state_);
  if (broken_.load()) return;
  if (busy_) {
    abort_reason_ = std::move(why);
    abort_requested_.store(true);
    return;
  }
  cudaSetDevice(device_);
  ncclCommAbort(impl_->comm);
  impl_->pending = false;
  broken_reason_ = std::move(why);
  broken_.store(true);
}

void NcclPeer::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(state_);
    if (!broken_.load()) {
      ncclCommAbort(impl_->comm);
      broken_reason_ = why;
      broken_.store(true);
    }
    impl_->pending = false;
    busy_ = false;
  }
  throw TransportError(why);
}

void NcclPeer::post(bool is_send, void* data, size_t bytes, const TransferLimits& limits) {
  const char* verb = is_send ? "ncclSend" : "ncclRecv";
  if ((is_send && rank_ != 1) || (!is_send && rank_ != 0)) {
    throw TransportError(std::string(verb) + " on rank " + std::to_string(rank_) +
                         ": rank 1 sends and rank 0 receives");
  }
  if (limits.chunk_bytes == 0) throw TransportError(std::string(verb) + ": chunk_bytes must be > 0");
  {
    std::lock_guard<std::mutex> lock(state_);
    if (broken_.load()) throw TransportError("NCCL communicator is broken: " + broken_reason_);
    if (busy_) throw TransportError(std::string(verb) + ": another transfer is still pending on this communicator");
    busy_ = true;
  }
  if (cudaSetDevice(device_) != cudaSuccess) fail(std::string(verb) + ": cudaSetDevice failed");
  char* p = static_cast<char*>(data);
  const bool into_scratch = !is_send && data == nullptr;
  for (size_t off = 0; off < bytes; off += limits.chunk_bytes) {
    const size_t n = std::min(limits.chunk_bytes, bytes - off);
    void* at = into_scratch ? impl_->scratch : p + off;
    ncclResult_t r = is_send ? ncclSend(at, n, ncclUint8, 1 - rank_, impl_->comm, impl_->stream)
                             : ncclRecv(at, n, ncclUint8, 1 - rank_, impl_->comm, impl_->stream);
    // A nonblocking communicator may still be enqueueing: wait (bounded) until it took the operation.
    while (r == ncclInProgress) {
      if (Clock::now() > limits.deadline) fail(std::string(verb) + ": enqueueing did not finish by the deadline");
      if (limits.give_up && limits.give_up()) fail(std::string(verb) + ": given up (the call it serves ended)");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      if (ncclCommGetAsyncError(impl_->comm, &r) != ncclSuccess) break;
    }
    if (r != ncclSuccess) fail(std::string(verb) + ": " + nccl_error(impl_->comm, r));
  }
  if (cudaEventRecord(impl_->done, impl_->stream) != cudaSuccess) fail(std::string(verb) + ": cudaEventRecord failed");
  impl_->pending = true;
}

void NcclPeer::wait(const TransferLimits& limits) {
  if (!impl_->pending) return;
  for (;;) {
    const cudaError_t q = cudaEventQuery(impl_->done);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) fail(std::string("NCCL transfer: ") + cudaGetErrorString(q));
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(impl_->comm, &async) != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      fail("NCCL transfer: " + nccl_error(impl_->comm, async));
    }
    if (abort_requested_.load()) {
      std::string why;
      {
        std::lock_guard<std::mutex> lock(state_);
        why = abort_reason_;
      }
      fail("NCCL transfer aborted: " + why);
    }
    if (limits.give_up && limits.give_up()) fail("NCCL transfer given up (the call it serves ended)");
    if (Clock::now() > limits.deadline) fail("NCCL transfer did not complete by its deadline");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  std::lock_guard<std::mutex> lock(state_);
  impl_->pending = false;
  busy_ = false;
  if (abort_requested_.load() && !broken_.load()) {  // asked while the transfer ran, which then completed: abort now
    ncclCommAbort(impl_->comm);
    broken_reason_ = abort_reason_;
    broken_.store(true);
  }
}

void NcclPeer::post_send(const void* data, size_t bytes, const TransferLimits& limits) {
  post(true, const_cast<void*>(data), bytes, limits);
}

void NcclPeer::send(const void* data, size_t bytes, const TransferLimits& limits) {
  post_send(data, bytes, limits);
  wait(limits);
}

void NcclPeer::recv(void* data, size_t bytes, const TransferLimits& limits) {
  if (!data && bytes) throw TransportError("ncclRecv: null destination");
  post(false, data, bytes, limits);
  wait(limits);
}

void NcclPeer::discard(size_t bytes, const TransferLimits& limits) {
  const size_t need = std::min(bytes, limits.chunk_bytes);
  if (need > impl_->scratch_bytes) {
    // Stream-ordered on this peer's stream: a plain cudaFree / cudaMalloc would synchronize the whole device
    // (every worker's stream, and any receive still waiting for a sender).
    cudaSetDevice(device_);
    if (impl_->scratch) cudaFreeAsync(impl_->scratch, impl_->stream);
    impl_->scratch = nullptr;
    impl_->scratch_bytes = 0;
    check_cuda_t(cudaMallocAsync(&impl_->scratch, need, impl_->stream), "NcclPeer::discard: scratch allocation");
    check_cuda_t(cudaStreamSynchronize(impl_->stream), "NcclPeer::discard: scratch allocation");
    impl_->scratch_bytes = need;
  }
  post(false, nullptr, bytes, limits);
  wait(limits);
}

#else  // no NCCL in this build: every entry travels over gRPC

std::string nccl_unavailable_reason() {
#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
  return "this build has no NCCL data plane (NCCL was not found at configure time)";
#else
  return "this build has no NCCL data plane (configured without CUDA)";
#endif
}

std::string nccl_version() { return {}; }

std::string new_unique_id() { throw TransportError(nccl_unavailable_reason()); }

struct NcclPeer::Impl {};

std::unique_ptr<NcclPeer> NcclPeer::join(std::string_view, int, int, std::chrono::milliseconds) {
  throw TransportError(nccl_unavailable_reason());
}
NcclPeer::NcclPeer(std::unique_ptr<Impl> impl, int rank, int device)
    : impl_(std::move(impl)), rank_(rank), device_(device) {}
NcclPeer::~NcclPeer() = default;
std::string NcclPeer::broken_reason() const { return nccl_unavailable_reason(); }
void NcclPeer::abort_soon(std::string) {}
void NcclPeer::fail(const std::string& why) { throw TransportError(why); }
void NcclPeer::post(bool, void*, size_t, const TransferLimits&) { throw TransportError(nccl_unavailable_reason()); }
void NcclPeer::wait(const TransferLimits&) { throw TransportError(nccl_unavailable_reason()); }
void NcclPeer::post_send(const void*, size_t, const TransferLimits&) { throw TransportError(nccl_unavailable_reason()); }
void NcclPeer::send(const void*, size_t, const TransferLimits&) { throw TransportError(nccl_unavailable_reason()); }
void NcclPeer::recv(void*, size_t, const TransferLimits&) { throw TransportError(nccl_unavailable_reason()); }
void NcclPeer::discard(size_t, const TransferLimits&) { throw TransportError(nccl_unavailable_reason()); }

#endif

}  // namespace hypic::transport
