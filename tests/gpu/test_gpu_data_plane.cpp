// The GPU-to-GPU data plane (transport/nccl_peer.h, Backend::device_block / allocate_entry): an entry received
// device to device is bit-identical to the same entry over gRPC (whose content is serialize_entry(host())); a
// receive without a sender, or given up, aborts within its deadline instead of hanging; a refused block is drained
// and the communicator stays usable. One-GPU cases run everywhere; two-GPU cases need two visible devices (skipped,
// saying so, otherwise). NCCL_NVLS_ENABLE is forced to 0 (NVLink multicast off).
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <filesystem>
#include <future>
#include <thread>

#include "engine/backend.h"
#include "engine/checkpoint/weights.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/segment.h"
#include "transport/nccl_peer.h"

namespace eng = hypic::engine;
namespace tr = hypic::transport;
using namespace std::chrono_literals;

namespace {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

const eng::ModelConfig& config() {
  static eng::ModelConfig c = [] {
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "hypic_gpu_data_plane_qwen3_next";
    if (!std::filesystem::exists(dir / "model.safetensors")) {
      eng::write_random_checkpoint(eng::load_config("tests/gpu/configs/qwen3_next_gpu.json"), 1234, dir,
                                   eng::DType::BF16, 0.05f);
    }
    return eng::load_config(dir);
  }();
  return c;
}

std::unique_ptr<eng::Backend> backend_on(int device) {
  static std::unique_ptr<eng::ModelWeights> w;
  if (!w) {
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "hypic_gpu_data_plane_qwen3_next";
    config();
    w = std::make_unique<eng::ModelWeights>(eng::load_weights(config(), dir));
  }
  eng::BackendOptions opt;
  opt.kv_pool_bytes = size_t(256) << 20;
  opt.max_sequences = 4;
  opt.max_batch_tokens = 2048;
  return eng::cuda::make_backend(eng::DeviceSpec{eng::BackendKind::Cuda, device}, config(), w.get(), opt);
}

std::vector<int32_t> ids_of(int n, int32_t base) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[size_t(i)] = (base + 7 * i) % 200 + 3;
  return ids;
}

// What the gRPC path delivers: the serialized host form of an entry.
std::string wire(const eng::ResidentEntry& e) { return eng::serialize_entry(*e.host()); }

tr::TransferLimits limits(std::chrono::milliseconds timeout, size_t chunk = size_t(1) << 20) {
  tr::TransferLimits l;
  l.chunk_bytes = chunk;
  l.deadline = std::chrono::steady_clock::now() + timeout;
  return l;
}

}  // namespace

TEST_CASE("data plane: an entry allocated for receiving equals the built one once its block is copied in",
          "[data-plane]") {
  auto b = backend_on(0);
  const std::vector<std::vector<int32_t>> segs{ids_of(97, 5), ids_of(1, 9)};
  const auto built = b->build_entries(segs, 8);
  for (const auto& e : built) {
    const auto src = b->device_block(*e);
    REQUIRE(src);
    auto [dst, block] = b->allocate_entry(e->header());
    CHECK(block.bytes == src->bytes);  // the same layout for the same tokens
    CHECK(block.device == 0);
    REQUIRE(cudaMemcpy(block.data, src->data, src->bytes, cudaMemcpyDeviceToDevice) == cudaSuccess);
    CHECK(wire(*dst) == wire(*e));
  }
  // Another model's header is refused, naming the fingerprint.
  eng::SegmentEntry other = built[0]->header();
  other.model_fingerprint = std::string(32, '0');
  CHECK_THROWS_AS(b->allocate_entry(other), eng::EntryError);
}

TEST_CASE("data plane: an entry sent over NCCL is bit-identical to the same entry over gRPC", "[data-plane]") {
  if (device_count() < 2) {
    WARN("skipped: needs 2 GPUs, " << device_count() << " visible");
    return;
  }
  auto sender = backend_on(0);
  auto receiver = backend_on(1);
  const std::string uid = tr::new_unique_id();
  auto rank1 = std::async(std::launch::async, [&] { return tr::NcclPeer::join(uid, 1, 0, 30s); });
  auto rank0 = tr::NcclPeer::join(uid, 0, 1, 30s);
  auto peer1 = rank1.get();
  CHECK(std::string(getenv("NCCL_NVLS_ENABLE")) == "0");

  const std::vector<std::vector<int32_t>> segs{ids_of(300, 1), ids_of(64, 2), ids_of(1, 3)};
  const auto built = sender->build_entries(segs, 8);
  for (size_t chunk : {size_t(1) << 20, size_t(4096)}) {  // one chunk per entry, and many
    for (const auto& e : built) {
      const auto src = sender->device_block(*e);
      REQUIRE(src);
      auto [dst, block] = receiver->allocate_entry(e->header());
      REQUIRE(block.bytes == src->bytes);
      auto sent = std::async(std::launch::async, [&] { peer1->send(src->data, src->bytes, limits(30s, chunk)); });
      rank0->recv(block.data, block.bytes, limits(30s, chunk));
      sent.get();
      const std::string over_grpc = wire(*e);
      CHECK(wire(*dst) == over_grpc);
      // And what the combine worker makes of the gRPC bytes (import) is the same entry.
      auto imported = receiver->import_entry(std::make_shared<eng::SegmentEntry>(eng::deserialize_entry(over_grpc)));
      CHECK(wire(*imported) == over_grpc);
    }
  }

  // A refused block is drained: the communicator stays in step and carries the next entry intact.
  const auto src = sender->device_block(*built[0]);
  auto drained = std::async(std::launch::async, [&] { peer1->send(src->data, src->bytes, limits(30s)); });
  rank0->discard(src->bytes, limits(30s));
  drained.get();
  auto [dst, block] = receiver->allocate_entry(built[0]->header());
  auto sent = std::async(std::launch::async, [&] { peer1->send(src->data, src->bytes, limits(30s)); });
  rank0->recv(block.data, block.bytes, limits(30s));
  sent.get();
  CHECK(wire(*dst) == wire(*built[0]));
  CHECK_FALSE(rank0->broken());
  CHECK_FALSE(peer1->broken());
}

TEST_CASE("data plane: a receive with no sender aborts at its deadline -- give_up aborts at once", "[data-plane]") {
  if (device_count() < 2) {
    WARN("skipped: needs 2 GPUs, " << device_count() << " visible");
    return;
  }
  auto receiver = backend_on(1);
  for (int variant = 0; variant < 2; ++variant) {
    const std::string uid = tr::new_unique_id();
    auto rank1 = std::async(std::launch::async, [&] { return tr::NcclPeer::join(uid, 1, 0, 30s); });
    auto rank0 = tr::NcclPeer::join(uid, 0, 1, 30s);
    auto peer1 = rank1.get();
    const std::vector<std::vector<int32_t>> seg{ids_of(40, 1)};
    auto [dst, block] = receiver->allocate_entry(receiver->build_entries(seg, 8)[0]->header());
    auto l = limits(variant == 0 ? 1500ms : 60s);
    const auto t0 = std::chrono::steady_clock::now();
    if (variant == 1) l.give_up = [t0] { return std::chrono::steady_clock::now() - t0 > 300ms; };
    // The sender never sends (it "died"): the receive must not hang.
    CHECK_THROWS_AS(rank0->recv(block.data, block.bytes, l), tr::TransportError);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(s < (variant == 0 ? 10.0 : 5.0));
    CHECK(rank0->broken());
    CHECK_THROWS_AS(rank0->recv(block.data, block.bytes, limits(1s)), tr::TransportError);  // never used again
    peer1->abort_soon("test over");
    CHECK(peer1->broken());
  }
}

TEST_CASE("data plane: a join whose other rank never comes fails at its timeout", "[data-plane]") {
  const std::string uid = tr::new_unique_id();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(tr::NcclPeer::join(uid, 0, 0, 1500ms), tr::TransportError);
  CHECK(std::chrono::steady_clock::now() - t0 < 15s);
}
