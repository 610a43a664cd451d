// The engine flags of both workers (scatter and combine): which device computes and its memory budgets, mapped to
// engine::BackendOptions / EngineLoopOptions, and the backend they make.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/engine_loop.h"

namespace hypic::rpc {

struct EngineFlags {
  std::string device;  ///< --device: cpu | cuda | cuda:N (default: engine::default_device())
  int compute_threads = 1;
  uint64_t kv_pool_bytes = 0;
  int64_t max_batch_tokens = 16384;
  int64_t max_build_tokens_decoding = 2048;
  int64_t max_pass_tokens_decoding = 2048;
  int64_t max_pass_tokens = -1;  ///< -1: auto (CPU backend 1024, CUDA 0 = its max_batch_tokens)
  bool concurrent_decode = true;  ///< CUDA: decode steps beside prefill passes (engine::BackendOptions)
  int decode_sms = -1;            ///< CUDA: SMs of the decode partition beside prefill, -1 auto (engine::BackendOptions)
  uint64_t random_weights_seed = 0;
  uint64_t prefix_cache_bytes = uint64_t{1} << 30;
  int inject_delay_ms = 0;  ///< scatter worker only (testing)
};

/// Adds --device, --compute-threads, --kv-pool-bytes, --max-batch-tokens, --max-build-tokens-decoding,
/// --max-pass-tokens[-decoding], --concurrent-decode, --decode-sms, --random-weights-seed (benchmark only)
/// and, when `prefix_cache` (combine worker), --prefix-cache-bytes; when `inject_delay` (scatter worker),
/// --inject-delay-ms (testing only). Their numbers are whole decimal numbers, the byte sizes with an optional binary
/// unit (proto/rpc/flags.h): anything else, or a value out of a flag's range, fails the parse with a
/// CLI::ValidationError naming the flag and the value, and leaves `flags` as it was.
void add_engine_flags(CLI::App& app, EngineFlags& flags, bool prefix_cache, bool inject_delay);

/// The backend the flags describe, loaded from `model_dir` (engine::make_backend), with a log line naming the
/// device, numerics, fingerprint and memory (and a warning when the weights are random: benchmark only).
/// Throws std::invalid_argument for a bad --device (naming it) and whatever loading throws.
std::unique_ptr<engine::Backend> make_engine_backend(const EngineFlags& flags, const std::filesystem::path& model_dir);

/// The engine loop options of the flags (--max-batch-tokens, --max-build-tokens-decoding, --max-pass-tokens[-decoding],
/// --inject-delay-ms) for `backend` (the automatic --max-pass-tokens depends on its kind).
engine::EngineLoopOptions engine_loop_options(const EngineFlags& flags, const engine::Backend& backend);

}  // namespace hypic::rpc
