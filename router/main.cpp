// hypic-router: the public API of a hypic cluster (hypic.v1.Router).
#include <algorithm>
#include <filesystem>
#include <limits>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "engine/checkpoint/config.h"
#include "tokenizer/tokenizer.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/server.h"
#include "router/service.h"

int main(int argc, char** argv) {
  hypic::rpc::init_service_process();
  CLI::App app{"hypic router: tokenises, looks segments up, schedules cold ones, relays the combine worker's tokens"};
  hypic::rpc::ServerFlags server;
  server.listen = "127.0.0.1:50050";
  hypic::rpc::add_server_flags(app, server);
  std::string model_dir, tokenizer_path, policy = "lpt", numerics = "auto";
  hypic::router::RouterConfig cfg;
  auto& l = cfg.limits;
  int lookup_timeout_ms = 500, health_interval_ms = 1000, default_deadline_s = 600;
  app.add_option("--model", model_dir, "checkpoint directory (its config.json and weights headers give the "
                                       "fingerprint; weights are not loaded)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json")->required()->check(CLI::ExistingFile);
  app.add_option("--numerics", numerics,
                 "the workers' numerics, part of every digest: auto (learned from the first worker that answers; "
                 "workers of other numerics are refused) | cpu-fp32 | cuda-bf16")
      ->check(CLI::IsMember({"auto", "cpu-fp32", "cuda-bf16"}))
      ->capture_default_str();
  app.add_option("--scatter", cfg.scatter_workers, "scatter worker host:port (repeat; none: combine workers prefill)");
  app.add_option("--combine", cfg.combine_workers, "combine worker host:port (repeat)")->required();
  app.add_option("--cache", cfg.cache_replicas, "segment cache replica host:port (repeat; none: no caching)");
  app.add_option("--schedule", policy, "cold-segment assignment: lpt | round-robin")->capture_default_str();
  namespace hr = hypic::rpc;
  constexpr uint32_t kU32 = std::numeric_limits<uint32_t>::max();
  constexpr uint64_t kU64 = std::numeric_limits<uint64_t>::max();
  constexpr int kInt = std::numeric_limits<int>::max();
  hr::add_strict_int_option(app, "--max-concurrent-requests", l.max_concurrent_requests, 0, kU32, "admission limit")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-segments", l.max_segments, 0, kU32, "admission limit: segments per request")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-segment-tokens", l.max_segment_tokens, 0, kU32,
                            "admission limit: tokens per segment")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-prompt-tokens", l.max_prompt_tokens, 0, kU32,
                            "admission limit: segments + query tokens")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-segment-bytes", l.max_segment_bytes, 0, kU64,
                            "admission limit: text bytes per segment, checked before tokenising (0: 16 x "
                            "--max-segment-tokens)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-prompt-bytes", l.max_prompt_bytes, 0, kU64,
                            "admission limit: text bytes of all segments + the query, checked before tokenising (0: 16 "
                            "x --max-prompt-tokens)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-new-tokens", l.max_new_tokens, 0, kU32, "admission limit: sampling.max_tokens")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-model-len", l.max_model_len, 0, kU32,
                            "admission limit: prompt tokens + sampling.max_tokens of a request (0: the model's "
                            "max_position_embeddings from config.json, no limit where it gives none)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-seam-width", l.max_seam_width, 0, kInt,
                            "largest seam width a request may ask for")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--seam-width", l.default_seam_width, 0, kInt, "default seam width w")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-refresh-segments", l.max_refresh_segments, 0, kInt,
                            "largest query-aware refresh (cache.refresh_segments) and refresh tail "
                            "(cache.refresh_tail) a request may ask for")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--refresh-segments", l.default_refresh_segments, 0, kInt,
                            "default query-aware refresh of hypic requests: the k segments the query attends to most "
                            "are recomputed whole in context (0 = off)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--refresh-tail", l.default_refresh_tail, 0, kInt,
                            "default refresh tail of hypic requests: the last t segments are recomputed whole in "
                            "context (0 = off; questions about the documents' order need 2)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--default-max-tokens", l.default_max_tokens, 1, kInt,
                            "max_tokens when a request sets none")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--lookup-timeout-ms", lookup_timeout_ms, 1, kInt, "budget of the batch cache lookup")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--lease-ms", cfg.lease_ms, 0, kU32,
                            "longest cache lease of a lookup hit (leases are released when the request has its entries "
                            "or ends)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-scatter-attempts", cfg.max_scatter_attempts, 1, kInt,
                            "assignments per segment before the combine worker prefills it")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--default-deadline-seconds", default_deadline_s, 1, kInt,
                            "deadline of requests that carry none")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--health-interval-ms", health_interval_ms, 1, kInt, "worker health probing period")
      ->capture_default_str();
  int64_t combine_wait_ms = 10000;
  int tier_lookup_timeout_ms = 100;
  hr::add_strict_int_option(app, "--tier-lookup-timeout-ms", tier_lookup_timeout_ms, 1, 60000,
                            "budget of each combine worker's tier lookup (in parallel with the cache lookup); a worker "
                            "that misses it counts as holding nothing and is not asked for 5 s")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--combine-affinity-slack", cfg.combine_affinity_slack, 0, 1 << 20,
                            "a request goes to the combine worker holding most of its segments among those with at "
                            "most this many more active requests than the least busy one (0: always the least busy)")
      ->capture_default_str();
  // (at most a day: the wait is added to the system clock's nanoseconds, which a larger value would overflow)
  hr::add_strict_int_option(app, "--combine-wait-ms", combine_wait_ms, 0, int64_t{86'400'000},
                            "with no combine worker in rotation, how long a request waits for one to come back "
                            "(at most 86400000: a day; the request's deadline still bounds it)")
      ->capture_default_str();
  std::string auth_token_file;
  app.add_option("--auth-token-file", auth_token_file,
                 "accepted bearer tokens, one per line: Generate and GetServerInfo then require the metadata "
                 "'authorization: Bearer <token>' (UNAUTHENTICATED otherwise; health checks stay open)")
      ->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);
  try {
    hypic::rpc::init_service("router", server);
    if (!auth_token_file.empty()) cfg.auth = hypic::rpc::BearerTokens::load(auth_token_file);
    cfg.policy = hypic::router::parse_schedule_policy(policy);
    if (l.default_refresh_segments > l.max_refresh_segments)
      throw std::invalid_argument(fmt::format("--refresh-segments {} is above --max-refresh-segments {}",
                                              l.default_refresh_segments, l.max_refresh_segments));
    if (l.default_refresh_tail > l.max_refresh_segments)
      throw std::invalid_argument(fmt::format("--refresh-tail {} is above --max-refresh-segments {}",
                                              l.default_refresh_tail, l.max_refresh_segments));
    cfg.lookup_timeout = std::chrono::milliseconds(lookup_timeout_ms);
    cfg.health_interval = std::chrono::milliseconds(health_interval_ms);
    cfg.combine_wait = std::chrono::milliseconds(combine_wait_ms);
    cfg.tier_lookup_timeout = std::chrono::milliseconds(tier_lookup_timeout_ms);
    cfg.default_deadline = std::chrono::seconds(default_deadline_s);
    const auto config = hypic::engine::load_config(model_dir);
    if (l.max_model_len == 0 && config.max_position_embeddings > 0)
      l.max_model_len = uint32_t(std::min<int64_t>(config.max_position_embeddings, kU32));
    else if (config.max_position_embeddings > 0 && l.max_model_len > config.max_position_embeddings)
      spdlog::warn("--max-model-len {} is above the model's max_position_embeddings {}: prompts past the positions it "
                   "was trained for are answered, with degraded text",
                   l.max_model_len, config.max_position_embeddings);
    const auto tokenizer = hypic::engine::Tokenizer::load(tokenizer_path);
    hypic::router::RouterModel model{config, config.vocab_size, {}, numerics == "auto" ? "" : numerics};
    {
      std::error_code ec;
      auto dir = std::filesystem::absolute(model_dir, ec).lexically_normal();
      if (dir.has_relative_path() && !dir.has_filename()) dir = dir.parent_path();  // "models/x/" -> "models/x"
      model.path = dir.string();
      model.name = dir.filename().string();
    }
    for (const char* eos : {"<|endoftext|>", "<|im_end|>"}) {
      if (const int32_t id = tokenizer.token_to_id(eos); id >= 0) model.eos_ids.push_back(id);
    }
    if (tokenizer.vocab_size() > size_t(config.vocab_size)) {
      throw std::invalid_argument(fmt::format("--tokenizer: its {} ids do not fit the model's vocabulary of {}",
                                              tokenizer.vocab_size(), config.vocab_size));
    }
    spdlog::info("model config fingerprint {}, numerics {}, {} scatter workers, {} combine workers, {} cache "
                 "replicas, schedule {}",
                 config.fingerprint(), numerics, cfg.scatter_workers.size(), cfg.combine_workers.size(), cfg.cache_replicas.size(),
                 policy);
    spdlog::info("admission: {} tokens and {} bytes per segment, {} tokens and {} bytes per prompt, context {}",
                 l.max_segment_tokens, l.segment_bytes_limit(), l.max_prompt_tokens, l.prompt_bytes_limit(),
                 l.max_model_len ? fmt::format("{} tokens (prompt + max_tokens)", l.max_model_len) : "unlimited");
    hypic::rpc::Lifecycle life("router");
    hypic::router::RouterService svc(tokenizer, model, cfg, life);
    return hypic::rpc::run_server(server, life, {"router", {&svc}, {"hypic.v1.Router"}, {}, {}});
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return 1;
  }
}
