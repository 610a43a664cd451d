// hypic-combine-worker: gathers segment entries, splices, decodes (hypic.v1.CombineWorker).
#include <limits>
#include <stdexcept>
#include <string>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "combine_worker/budgets.h"
#include "combine_worker/service.h"
#include "kernels/cpu/blas_env.h"
#include "proto/engine_rpc/engine_flags.h"
#include "proto/rpc/chunks.h"
#include "proto/rpc/entry_mac.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/server.h"

int main(int argc, char** argv) {
  hypic::kernels::cpu::reexec_with_recommended_blas_core(argv);  // before OpenBLAS is used
  hypic::rpc::init_service_process();
  CLI::App app{"hypic combine worker: gathers segment entries, splices them with the query, decodes"};
  hypic::rpc::ServerFlags server;
  server.listen = "127.0.0.1:50071";
  hypic::rpc::add_server_flags(app, server);
  hypic::rpc::add_service_identity_flag(app, server.service_identities);
  std::string cache_key_file, mac_scheme = "gmac";
  hypic::rpc::add_entry_mac_flag(app, cache_key_file, mac_scheme);
  std::string model_dir, tokenizer_path;
  std::vector<std::string> caches;
  hypic::rpc::EngineFlags engine;
  std::string memory_tier_bytes = "auto", host_tier_bytes = "auto", put_queue_bytes = "auto",
              host_copy_queue_bytes = "auto";
  hypic::combine::CombineOptions opt;
  hypic::combine::add_request_limit_flags(app, opt.limits);
  int gather_timeout_s = 300;
  app.add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)")->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json (detokenises the output, stop strings)")->required()
      ->check(CLI::ExistingFile);
  app.add_option("--cache", caches, "segment cache replica host:port (repeat for several; none: no caching)");
  hypic::cache::SegmentCacheClient::Options cache_options;
  hypic::cache::add_cache_client_flags(app, cache_options);
  hypic::rpc::add_engine_flags(app, engine, /*prefix_cache=*/true, /*inject_delay=*/false);
  app.add_option("--memory-tier-bytes", memory_tier_bytes,
                 "device tier: segment entries resident on the backend (device memory on CUDA), a hit needs no copy "
                 "(0 disables; auto: the device memory left after weights, KV pool and workspace, minus a reserve; "
                 "CPU: an eighth of host memory, at least 1 GiB)")
      ->check(hypic::rpc::byte_budget_check())
      ->capture_default_str();
  app.add_option("--host-tier-bytes", host_tier_bytes,
                 "host tier (CUDA): pinned host copies of device entries, a hit costs one host-to-device copy "
                 "(0 disables; auto: a quarter of host memory)")
      ->check(hypic::rpc::byte_budget_check())
      ->capture_default_str();
  std::string request_entry_bytes = "auto";
  app.add_option("--request-entry-bytes", request_entry_bytes,
                 "device backends: the most device memory one request's entries take resident at once; a request "
                 "whose entries need more keeps them as pinned host blocks and its splice copies them in a group at a "
                 "time within this many bytes (auto or 0: no cap, what the device has free; a staged splice then takes "
                 "half of what is free less 512 MiB, at least four entries)")
      ->check(hypic::rpc::byte_budget_check())
      ->capture_default_str();
  app.add_option("--put-queue-bytes", put_queue_bytes,
                 "bytes of cache puts that may wait; more are dropped (auto: the larger of 1 GiB and 16 entries of 2048 tokens)")
      ->check(hypic::rpc::byte_budget_check())
      ->capture_default_str();
  app.add_option("--host-copy-queue-bytes", host_copy_queue_bytes,
                 "resident entries waiting for their host copy; more are dropped (auto: the larger of 1 GiB and 16 "
                 "entries of 2048 tokens)")
      ->check(hypic::rpc::byte_budget_check())
      ->capture_default_str();
  hypic::rpc::add_strict_size_option(app, "--chunk-bytes", opt.chunk_bytes, 4096, uint64_t{4} << 20,
                                     "size of streamed chunks")
      ->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--gather-timeout-seconds", gather_timeout_s, 1,
                                    std::numeric_limits<int>::max(), "longest wait for a request's segment entries")
      ->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--fetch-parallelism", opt.fetch_parallelism, 1, 64,
                                    "parallel segment-cache fetches per request")
      ->capture_default_str();
  std::string cache_fetch_policy = "auto";
  app.add_option("--cache-fetch-policy", cache_fetch_policy,
                 "a segment only the segment cache holds: auto: fetched, or prefilled here when this worker's measured "
                 "fetch and build rates say that is sooner (fetched after all if that prefill fails); always: fetched")
      ->check(CLI::IsMember({"auto", "always"}))
      ->capture_default_str();
  // A rate flag: 0 (unknown) or a finite value in [1e-6, 1e12] (NaN, inf and denormal rates have no usable inverse).
  const CLI::Validator rate_check(
      [](std::string& s) -> std::string {
        // Decimal only (hypic::rpc::parse_finite_real: no blanks, hex floats, inf or nan), as the other real flags.
        const auto v = hypic::rpc::parse_finite_real(s, -1e300, 1e300);
        if (!v) return "not a decimal number: '" + s + "'";
        if (!(*v == 0 || (*v >= 1e-6 && *v <= 1e12))) return "must be 0 or in [1e-6, 1e12], got '" + s + "'";
        return "";
      },
      "RATE");
  app.add_option("--fetch-rate-prior-mb-per-s", opt.fetch_prior_mb_per_s,
                 "auto: the cache fetch rate (MB/s per entry) to start from; this worker's timed fetches are averaged "
                 "in (0: unknown, fetch until both rates are known)")
      ->check(rate_check)
      ->capture_default_str();
  app.add_option("--build-rate-prior-tokens-per-s", opt.build_prior_tokens_per_s,
                 "--cache-fetch-policy auto and --staged-cold-policy auto: the entry build rate (tokens/s) to start "
                 "from; this worker's timed builds are averaged in (0: unknown)")
      ->check(rate_check)
      ->capture_default_str();
  std::string staged_cold = "auto";
  app.add_option("--staged-cold-policy", staged_cold,
                 "CUDA: a request whose entries are staged from host memory and whose cold segments were left to this "
                 "worker (no scatter worker took them): auto answers it by a full prefill where this worker's timed "
                 "builds, staged splices and full prefills say that is sooner (those entries are then built after the "
                 "first token); stage builds them first and stages them")
      ->check(CLI::IsMember({"auto", "stage"}))
      ->capture_default_str();
  app.add_option("--staged-rate-prior-gb-per-s", opt.staged_prior_gb_per_s,
                 "CUDA, --staged-cold-policy auto: the staged splice's rate (GB/s of host blocks, passes included) to "
                 "start from; this worker's staged splices are averaged in (0: unknown, the builds alone counted until "
                 "one was timed)")
      ->check(rate_check)
      ->capture_default_str();
  std::string nccl = "auto";
  int nccl_join_timeout_ms = 20000;
  app.add_option("--nccl", nccl,
                 "auto: accept NCCL communicators from scatter workers on other GPUs (entries device to device); "
                 "off: every entry over gRPC")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--nccl-join-timeout-ms", nccl_join_timeout_ms, 100, 600000,
                                    "how long both ranks get to join a communicator")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    hypic::rpc::init_service("combine", server);
    hypic::rpc::log_caller_policy("combine worker");
    hypic::rpc::configure_entry_mac(cache_key_file, "combine worker", mac_scheme);
    hypic::transport::disable_nvls();
    opt.gather_timeout = std::chrono::seconds(gather_timeout_s);
    opt.nccl = nccl == "auto";
    opt.cache_fetch_policy = hypic::combine::parse_cache_fetch_policy(cache_fetch_policy);
    opt.staged_cold_in_full = staged_cold == "auto";
    opt.nccl_join_timeout = std::chrono::milliseconds(nccl_join_timeout_ms);
    const auto device_tier_flag = hypic::rpc::parse_byte_budget(memory_tier_bytes, "--memory-tier-bytes");
    const auto host_tier_flag = hypic::rpc::parse_byte_budget(host_tier_bytes, "--host-tier-bytes");
    const auto put_queue_flag = hypic::rpc::parse_byte_budget(put_queue_bytes, "--put-queue-bytes");
    const auto copy_queue_flag = hypic::rpc::parse_byte_budget(host_copy_queue_bytes, "--host-copy-queue-bytes");
    opt.request_entry_bytes =
        hypic::rpc::parse_byte_budget(request_entry_bytes, "--request-entry-bytes").value_or(uint64_t{0});
    const auto backend = hypic::rpc::make_engine_backend(engine, model_dir);
    const auto tokenizer = hypic::engine::Tokenizer::load(tokenizer_path);
    spdlog::info("tokenizer {}", tokenizer_path);
    // Budgets: the flags, or derived from the model's entry size and what the backend left free (budgets.h).
    namespace hc = hypic::combine;
    hc::BudgetInputs in;
    in.device_entries = backend->device_entries();
    in.device_free = backend->memory().device_free;
    in.host_memory = hypic::rpc::host_memory_bytes();
    in.entry_bytes = backend->entry_bytes(hc::kTypicalSegmentTokens);
    in.wire_entry_bytes = hypic::engine::wire_entry_bytes(backend->config(), hc::kTypicalSegmentTokens);
    in.prefix_cache_bytes = engine.prefix_cache_bytes;
    in.fetch_parallelism = opt.fetch_parallelism;
    const hc::TierBudgets auto_budgets = hc::default_tier_budgets(in);
    hc::TierBudgets budgets;
    budgets.device_tier = device_tier_flag.value_or(auto_budgets.device_tier);
    budgets.host_tier = host_tier_flag.value_or(auto_budgets.host_tier);
    budgets.put_queue = put_queue_flag.value_or(auto_budgets.put_queue);
    budgets.host_copy_queue = copy_queue_flag.value_or(auto_budgets.host_copy_queue);
    if (!in.device_entries && budgets.host_tier > 0) {
      spdlog::info("--host-tier-bytes ignored: the {} backend keeps entries in host memory (its device tier)",
                   backend->numerics());
      budgets.host_tier = 0;
    }
    auto how = [](const std::optional<uint64_t>& flag) { return flag ? "set" : "auto"; };
    spdlog::info("entry size by part, {}: {}", backend->numerics(),
                 hc::describe_entry_parts(hypic::engine::EntryGeometry::of(backend->config()), hc::kTypicalSegmentTokens,
                                          in.device_entries ? 2 : 4));
    spdlog::info("device tier {} [{}{}]", hc::describe_budget(budgets.device_tier, in.entry_bytes),
                 how(device_tier_flag),
                 in.device_entries ? fmt::format("; {:.1f} GiB of device memory free after weights, KV pool and workspace",
                                                 double(in.device_free) / double(1ull << 30))
                                   : std::string("; host memory"));
    if (in.device_entries) {
      spdlog::info("host tier {} [{}; pinned host memory]", hc::describe_budget(budgets.host_tier, in.entry_bytes),
                   how(host_tier_flag));
      // A request whose entries do not all fit at once has them staged by its splice from pinned host blocks (more,
      // smaller forward passes, and every entry's bytes crossing PCIe on the critical path); one whose largest entry
      // does not fit either is answered by a full prefill. Said at start-up where a prompt of 16 segments of 2048
      // tokens or fewer is staged.
      const uint64_t room = hc::request_entry_room(in, budgets.device_tier);
      const uint64_t fit = in.entry_bytes ? room / in.entry_bytes : 0;
      if (fit < 16) {
        spdlog::warn("device memory for one request's entries: about {:.1f} GiB ({} entries of 2048 tokens, {} MB "
                     "each): a hypic request with more segments than that is staged by its splice from pinned host "
                     "blocks (hypic:combine_staged_requests_total), or answered by a full prefill where not even its "
                     "largest entry fits (hypic:combine_full_fallbacks_total); --prefix-cache-bytes (now {} MiB), "
                     "--kv-pool-bytes, --max-batch-tokens or a smaller --memory-tier-bytes leave more",
                     double(room) / double(1ull << 30), fit, in.entry_bytes / 1000000,
                     in.prefix_cache_bytes >> 20);
      }
    }
    spdlog::info("cache put queue {} [{}], host-copy queue {} [{}]",
                 hc::describe_budget(budgets.put_queue, in.wire_entry_bytes), how(put_queue_flag),
                 hc::describe_budget(budgets.host_copy_queue, in.entry_bytes), how(copy_queue_flag));
    hypic::cache::SegmentCacheClient cache(caches, cache_options);
    if (cache.enabled()) spdlog::info("segment cache client: {}", hypic::cache::describe(cache_options));
    hypic::cache::AsyncCachePutter putter(cache, budgets.put_queue);
    if (in.device_entries && budgets.host_tier > 0 && in.host_memory > 0 && budgets.host_tier > in.host_memory / 4 * 3) {
      throw std::invalid_argument(fmt::format("--host-tier-bytes: {} bytes of pinned memory is more than 3/4 of this "
                                              "host's {} bytes (pinned memory cannot be paged out)",
                                              budgets.host_tier, in.host_memory));
    }
    if (in.device_entries && budgets.host_tier > 0) {
      // Pinned once, now: pinning while requests run stalls the device (PinnedPool::reserve). The tier counts its
      // blocks' pinned pieces; a quarter more covers the blocks in flight (fetches, copies waiting for their wire
      // form); beyond that, pieces are pinned on demand.
      const uint64_t pin = budgets.host_tier + budgets.host_tier / 4;
      const auto t0 = std::chrono::steady_clock::now();
      backend->reserve_host_blocks(pin);
      spdlog::info("pinned {:.1f} GiB of host memory for host blocks in {:.1f} s", double(pin) / double(1ull << 30),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    hc::EntryMemoryTier tier(budgets.device_tier);
    hc::HostBlockTier host_tier(budgets.host_tier);
    hc::HostCopier copier(*backend, &host_tier, putter, budgets.host_copy_queue);
    hypic::engine::EngineLoop loop(*backend, hypic::rpc::engine_loop_options(engine, *backend));
    hypic::rpc::Lifecycle life("combine worker");
    hypic::combine::CombineService svc({tokenizer, cache, putter, loop, tier, host_tier, copier, life,
                                        engine.compute_threads, engine.random_weights_seed}, opt);
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
