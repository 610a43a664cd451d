// hypic-scatter-worker: standalone prefill of cold segments (hypic.v1.ScatterWorker).
#include <chrono>
#include <limits>

#include <CLI/CLI.hpp>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "proto/engine_rpc/engine_flags.h"
#include "kernels/cpu/blas_env.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/entry_mac.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/server.h"
#include "scatter_worker/service.h"

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);  // before OpenBLAS is used
  hypic::rpc::init_service_process();
  CLI::App app{"hypic scatter worker: prefills cold segments standalone and streams their entries"};
  hypic::rpc::ServerFlags server;
  server.listen = "127.0.0.1:50061";
  hypic::rpc::add_server_flags(app, server);
  hypic::rpc::add_service_identity_flag(app, server.service_identities);
  std::string cache_key_file, mac_scheme = "gmac";
  hypic::rpc::add_entry_mac_flag(app, cache_key_file, mac_scheme);
  std::vector<std::string> combines;
  app.add_option("--combine", combines,
                 "combine worker host:port this worker may deliver entries to, as the router names it (repeat); a "
                 "Prefill naming another is refused. None: any (not for a shared network)");
  int64_t max_segment_tokens = 32768;
  int max_segments = 256;
  hypic::rpc::add_strict_int_option(app, "--max-segment-tokens", max_segment_tokens, 1,
                                    std::numeric_limits<int64_t>::max(), "most token ids per segment")
      ->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--max-segments", max_segments, 1, std::numeric_limits<int>::max(),
                                    "most segments per Prefill call")
      ->capture_default_str();
  std::string model_dir;
  std::vector<std::string> caches;
  hypic::rpc::EngineFlags engine;
  size_t chunk_bytes = hypic::rpc::kChunkBytes;
  uint64_t put_queue_bytes = uint64_t{1} << 30;
  app.add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)")->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--cache", caches, "segment cache replica host:port (repeat for several; none: no caching)");
  hypic::cache::SegmentCacheClient::Options cache_options;
  hypic::cache::add_cache_client_flags(app, cache_options);
  hypic::rpc::add_engine_flags(app, engine, /*prefix_cache=*/false, /*inject_delay=*/true);
  hypic::rpc::add_strict_size_option(app, "--chunk-bytes", chunk_bytes, 4096, uint64_t{4} << 20,
                                     "size of streamed chunks")
      ->capture_default_str();
  hypic::rpc::add_strict_size_option(app, "--put-queue-bytes", put_queue_bytes, 0,
                                     std::numeric_limits<uint64_t>::max(),
                                     "bytes of cache puts that may wait; more are dropped")
      ->capture_default_str();
  hypic::worker::DataPlaneOptions data_plane;
  app.add_option("--entry-transport", data_plane.entry_transport,
                 "auto: entries go device to device over NCCL where the combine worker can take them (CUDA on "
                 "another GPU), else gRPC; grpc: always gRPC streaming")
      ->check(CLI::IsMember({"auto", "grpc"}))
      ->capture_default_str();
  hypic::rpc::add_strict_size_option(app, "--nccl-chunk-bytes", data_plane.nccl_chunk_bytes, 4096, uint64_t{1} << 32,
                                     "bytes per NCCL send")
      ->capture_default_str();
  int inject_transfer_stall_ms = 0;
  hypic::rpc::add_strict_int_option(app, "--inject-transfer-stall-ms", inject_transfer_stall_ms, 0, 600000,
                                    "TESTING ONLY: wait this long inside each NCCL delivery, after its header, before "
                                    "the send");
  CLI11_PARSE(app, argc, argv);
  data_plane.inject_transfer_stall = std::chrono::milliseconds(inject_transfer_stall_ms);
  try {
    hypic::rpc::init_service("scatter", server);
    hypic::rpc::log_caller_policy("scatter worker");
    hypic::rpc::configure_entry_mac(cache_key_file, "scatter worker", mac_scheme);
    hypic::transport::disable_nvls();
    const auto backend = hypic::rpc::make_engine_backend(engine, model_dir);
    if (backend->device_entries()) {
      // The wire form of each build goes through a pinned host block (Backend::copy_to_host): pin room for a few at
      // start-up, since pinning while builds run stalls the device (PinnedPool::reserve).
      const uint64_t pin = 4 * backend->entry_bytes(2048) + (uint64_t{1} << 30);
      const auto t0 = std::chrono::steady_clock::now();
      backend->reserve_host_blocks(pin);
      spdlog::info("pinned {:.1f} GiB of host memory for entry copies in {:.1f} s", double(pin) / double(1ull << 30),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    hypic::cache::SegmentCacheClient cache(caches, cache_options);
    if (cache.enabled()) spdlog::info("segment cache client: {}", hypic::cache::describe(cache_options));
    hypic::cache::AsyncCachePutter putter(cache, put_queue_bytes);
    hypic::engine::EngineLoop loop(*backend, hypic::rpc::engine_loop_options(engine, *backend));
    hypic::rpc::Lifecycle life("scatter worker");
    hypic::worker::ScatterService svc(loop, putter, life, chunk_bytes, engine.compute_threads,
                                      engine.random_weights_seed, data_plane);
    svc.set_allowed_combine_workers(combines);
    svc.set_limits(max_segment_tokens, max_segments);
    if (combines.empty()) {
      spdlog::warn("no --combine: entries are delivered to any combine_address a caller names");
    } else {
      spdlog::info("delivers only to the combine workers {}", fmt::join(combines, ", "));
    }
    const int status = hypic::rpc::run_server(
        server, life,
        {"scatter",
         {&svc},
         {"hypic.v1.ScatterWorker"},
         [&](int port) { svc.set_address(hypic::rpc::self_address(server, port)); },
         {}});
    loop.stop();  // build callbacks use the service: finish them before it goes away
    return status;
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return 1;
  }
}
