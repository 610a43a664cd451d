// hypic-combine-worker: gathers segment entries, splices, decodes (hypic.v1.CombineWorker).
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "combine_worker/service.h"
#include "kernels/cpu/blas_env.h"
#include "proto/engine_rpc/engine_flags.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/server.h"

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);  // before OpenBLAS is used
  hypic::rpc::block_termination_signals();
  CLI::App app{"hypic combine worker: gathers segment entries, splices them with the query, decodes"};
  hypic::rpc::ServerFlags server;
  server.listen = "127.0.0.1:50071";
  hypic::rpc::add_server_flags(app, server);
  std::string model_dir, tokenizer_path;
  std::vector<std::string> caches;
  hypic::rpc::EngineFlags engine;
  uint64_t memory_tier_bytes = uint64_t{1} << 30;
  uint64_t put_queue_bytes = uint64_t{1} << 30;
  hypic::combine::CombineOptions opt;
  int gather_timeout_s = 300;
  app.add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)")->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json (detokenises the output, stop strings)")->required()
      ->check(CLI::ExistingFile);
  app.add_option("--cache", caches, "segment cache replica host:port (repeat for several; none: no caching)");
  hypic::rpc::add_engine_flags(app, engine, /*prefix_cache=*/true, /*inject_delay=*/false);
  app.add_option("--memory-tier-bytes", memory_tier_bytes, "own memory tier of segment entries (0 disables)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--put-queue-bytes", put_queue_bytes, "bytes of cache puts that may wait; more are dropped")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--chunk-bytes", opt.chunk_bytes, "size of streamed chunks")
      ->transform(CLI::AsSizeValue(false))
      ->check(CLI::Range(size_t{4096}, size_t{4} << 20))
      ->capture_default_str();
  app.add_option("--gather-timeout-seconds", gather_timeout_s, "longest wait for a request's segment entries")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--fetch-parallelism", opt.fetch_parallelism, "parallel segment-cache fetches per request")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  std::string nccl = "auto";
  int nccl_join_timeout_ms = 20000;
  app.add_option("--nccl", nccl,
                 "auto: accept NCCL communicators from scatter workers on other GPUs (entries device to device); "
                 "off: every entry over gRPC")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str();
  app.add_option("--nccl-join-timeout-ms", nccl_join_timeout_ms, "how long both ranks get to join a communicator")
      ->check(CLI::Range(100, 600000))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    hypic::rpc::init_service("combine", server);
    hypic::transport::disable_nvls();
    opt.gather_timeout = std::chrono::seconds(gather_timeout_s);
    opt.nccl = nccl == "auto";
    opt.nccl_join_timeout = std::chrono::milliseconds(nccl_join_timeout_ms);
    const auto backend = hypic::rpc::make_engine_backend(engine, model_dir);
    const auto tokenizer = hypic::engine::Tokenizer::load(tokenizer_path);
    spdlog::info("tokenizer {}", tokenizer_path);
    hypic::cache::SegmentCacheClient cache(caches);
    hypic::cache::AsyncCachePutter putter(cache, put_queue_bytes);
    hypic::combine::EntryMemoryTier tier(memory_tier_bytes);
    hypic::engine::EngineLoop loop(*backend, hypic::rpc::engine_loop_options(engine));
    hypic::rpc::Lifecycle life("combine worker");
    hypic::combine::CombineService svc({tokenizer, cache, putter, loop, tier, life, engine.compute_threads,
                                        engine.random_weights_seed}, opt);
    const int status = hypic::rpc::run_server(
        server, life,
        {"combine",
         {&svc},
         {"hypic.v1.CombineWorker"},
         [&](int port) { svc.set_address(hypic::rpc::self_address(server, port)); },
         {}});
    loop.stop();  // engine callbacks use the service: finish them before it goes away
    return status;
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return 1;
  }
}
