#include "proto/engine_rpc/engine_flags.h"

#include <spdlog/spdlog.h>

#include <limits>

#include "proto/rpc/flags.h"

namespace hypic::rpc {

void add_engine_flags(CLI::App& app, EngineFlags& f, bool prefix_cache, bool inject_delay) {
  constexpr int kInt = std::numeric_limits<int>::max();
  constexpr int64_t kI64 = std::numeric_limits<int64_t>::max();
  constexpr uint64_t kU64 = std::numeric_limits<uint64_t>::max();
  f.device = engine::default_device().name();
  app.add_option("--device", f.device,
                 "where the engine computes: cpu | cuda | cuda:N (default: cuda:0 when this build has CUDA and a GPU "
                 "is visible, else cpu)")
      ->capture_default_str();
  add_strict_int_option(app, "--compute-threads", f.compute_threads, 1, kInt,
                        "CPU backend: threads running a batch's segments / sequences in parallel")
      ->capture_default_str();
  add_strict_size_option(app, "--kv-pool-bytes", f.kv_pool_bytes, 0, kU64,
                         "CUDA backend: KV-cache pool of all sequences (0: 40% of the device memory free after the "
                         "weights)")
      ->capture_default_str();
  add_strict_int_option(app, "--max-build-tokens-decoding", f.max_build_tokens_decoding, 1, kI64,
                        "most tokens of one batch of entry builds while sequences are decoding (a decode step runs "
                        "between two batches; at most --max-batch-tokens)")
      ->capture_default_str();
  add_strict_int_option(app, "--max-pass-tokens-decoding", f.max_pass_tokens_decoding, 0, kI64,
                        "chunked prefill: most tokens of one forward pass of a splice while sequences are decoding "
                        "(they take a decode step between two passes); 0 = never cut a splice")
      ->capture_default_str();
  add_strict_int_option(app, "--max-pass-tokens", f.max_pass_tokens, -1, kI64,
                        "most tokens of one forward pass of a splice when no sequence decodes: a cancelled or expired "
                        "request stops at the end of its pass (-1 = auto: 1024 on the CPU backend, 0 on CUDA; 0 = the "
                        "backend's largest pass)")
      ->capture_default_str();
  app.add_option("--concurrent-decode", f.concurrent_decode,
                 "CUDA backend: running sequences take their decode steps on a stream of their own beside prefill "
                 "passes (false: between passes, chunked by --max-pass-tokens-decoding and --max-build-tokens-decoding)")
      ->capture_default_str();
  add_strict_int_option(app, "--decode-sms", f.decode_sms, -1, 100000,
                        "CUDA backend, with --concurrent-decode: SMs set aside for decode steps while a splice or "
                        "entry build runs beside them (green contexts; rounded up to 8 on Hopper); the prefill takes "
                        "the rest then, the whole device otherwise (-1 = auto: about an eighth of the device, none "
                        "where the driver cannot; 0 = no partition)")
      ->capture_default_str();
  add_strict_int_option(app, "--max-batch-tokens", f.max_batch_tokens, 1, kI64,
                        "most tokens of one forward pass: entry builds queued together are batched up to it (CUDA: "
                        "longer prefills are chunked)")
      ->capture_default_str();
  add_strict_int_option(app, "--random-weights-seed", f.random_weights_seed, 0, kU64,
                        "BENCHMARK ONLY (CUDA): ignore the safetensors and make seeded random weights from config.json "
                        "on the device; text is meaningless (0: load the real weights)");
  if (prefix_cache) {
    add_strict_size_option(app, "--prefix-cache-bytes", f.prefix_cache_bytes, 0, kU64, "prefix-mode state checkpoints")
        ->capture_default_str();
  }
  if (inject_delay) {
    add_strict_int_option(app, "--inject-delay-ms", f.inject_delay_ms, 0, kInt,
                          "TESTING ONLY: each build runs this much longer (a sleep at its start; widens "
                          "fault-injection windows)");
  }
}

std::unique_ptr<engine::Backend> make_engine_backend(const EngineFlags& f, const std::filesystem::path& model_dir) {
  engine::DeviceSpec device;
  try {
    device = engine::DeviceSpec::parse(f.device);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("--device: ") + e.what());
  }
  engine::BackendOptions o;
  o.prefix_cache_bytes = f.prefix_cache_bytes;
  o.kv_pool_bytes = f.kv_pool_bytes;
  o.max_batch_tokens = f.max_batch_tokens;
  o.concurrent_decode = f.concurrent_decode;
  o.decode_sms = f.decode_sms;
  o.random_weights_seed = f.random_weights_seed;
  o.cpu_threads = f.compute_threads;
  auto backend = engine::make_backend(device, model_dir, o);
  const engine::BackendMemory m = backend->memory();
  spdlog::info("model {} on {} ({}), fingerprint {}, weights {:.1f} MiB", model_dir.string(), backend->device().name(),
               backend->numerics(), backend->fingerprint(), double(m.weights) / double(1 << 20));
  if (f.random_weights_seed != 0)
    spdlog::warn("BENCHMARK ONLY: random weights (seed {}) instead of the checkpoint's: the text is meaningless",
                 f.random_weights_seed);
  return backend;
}

engine::EngineLoopOptions engine_loop_options(const EngineFlags& f, const engine::Backend& backend) {
  engine::EngineLoopOptions o;
  o.max_build_tokens = f.max_batch_tokens;
  o.max_build_tokens_decoding = f.max_build_tokens_decoding;
  o.max_pass_tokens_decoding = f.max_pass_tokens_decoding;
  // Auto: on the CPU a pass of 1024 tokens takes about a second or less for the models it serves, so a cancelled
  // request stops within about that; CUDA passes (max_batch_tokens) are fast enough as they are.
  o.max_pass_tokens = f.max_pass_tokens >= 0 ? f.max_pass_tokens : backend.device().kind == engine::BackendKind::Cpu ? 1024 : 0;
  o.inject_delay = std::chrono::milliseconds(f.inject_delay_ms);
  return o;
}

}  // namespace hypic::rpc
