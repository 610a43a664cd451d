// hypic-segment-cache: the segment cache service (hypic.v1.SegmentCache).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <limits>
#include <spdlog/spdlog.h>

#include "proto/rpc/chunks.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/server.h"
#include "segment_cache/service.h"

int main(int argc, char** argv) {
  hypic::rpc::init_service_process();
  CLI::App app{"hypic segment cache: content-addressed store of serialized segment entries"};
  hypic::rpc::ServerFlags server;
  server.listen = "127.0.0.1:50051";
  hypic::rpc::add_server_flags(app, server);
  hypic::rpc::add_service_identity_flag(app, server.service_identities);
  hypic::cache::StoreOptions store;
  std::string disk_dir;
  size_t chunk_bytes = hypic::rpc::kChunkBytes;
  uint32_t max_lease_ms = 60000;
  std::string memory_bytes = "auto";
  app.add_option("--memory-bytes", memory_bytes,
                 "memory-tier budget (e.g. 2GiB, 512MB); auto: a quarter of this host's memory, at least 1 GiB")
      ->check(hypic::rpc::byte_budget_check())
      ->capture_default_str();
  app.add_option("--disk-dir", disk_dir, "enable the disk tier in this directory (entries survive restarts)");
  constexpr uint32_t kU32 = std::numeric_limits<uint32_t>::max();
  hypic::rpc::add_strict_size_option(app, "--disk-bytes", store.disk_budget_bytes, 0,
                                     std::numeric_limits<uint64_t>::max(), "disk-tier budget")
      ->capture_default_str();
  hypic::rpc::add_strict_size_option(app, "--chunk-bytes", chunk_bytes, 4096, uint64_t{4} << 20,
                                     "size of streamed chunks")
      ->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--max-lease-ms", max_lease_ms, 0, kU32, "longest lease a Lookup may ask for")
      ->capture_default_str();
  app.add_option("--max-leased-fraction", store.max_leased_fraction,
                 "leased entries may hold at most this fraction of --memory-bytes; hits past it are not leased")
      ->check(hypic::rpc::strict_real(0.0, 1.0))
      ->capture_default_str();
  size_t max_queued_events = 65536;
  hypic::rpc::add_strict_int_option(app, "--max-queued-events", max_queued_events, 1,
                                    std::numeric_limits<size_t>::max(),
                                    "WatchEvents: events a subscriber may fall behind before its stream is ended "
                                    "(RESOURCE_EXHAUSTED)")
      ->capture_default_str();
  uint32_t max_put_wait_ms = 30000;
  hypic::rpc::add_strict_int_option(app, "--max-put-wait-ms", max_put_wait_ms, 0, kU32,
                                    "a Put that would put the bytes being received past --memory-bytes waits at most "
                                    "this long (or its deadline) for other puts to end, then is refused with "
                                    "RESOURCE_EXHAUSTED")
      ->capture_default_str();
  uint32_t put_idle_ms = 30000;
  hypic::rpc::add_strict_int_option(app, "--put-idle-ms", put_idle_ms, 0, kU32,
                                    "a Put whose sender sends nothing for this long (before its header, or between "
                                    "messages once admitted) is cancelled, freeing its thread and its share of the "
                                    "receive budget (0: never; else at least 1000: a message must arrive well within "
                                    "it)")
      ->check([](const std::string& v) {  // after the strict transform: plain decimal in [0, 2^32 - 1]
        return v == "0" || std::stoull(v) >= 1000 ? std::string()
                                                   : v + " is not 0 or a whole number of milliseconds from 1000";
      })
      ->capture_default_str();
  bool shared_memory = true;
  uint64_t shared_memory_min_bytes = uint64_t{1} << 20;
  app.add_option("--shared-memory", shared_memory,
                 "hold memory-tier entries of at least --shared-memory-min-bytes in sealed memfds, which readers on "
                 "this host (same PID namespace and user) map instead of streaming them over gRPC; others stream as "
                 "before")
      ->capture_default_str();
  hypic::rpc::add_strict_size_option(app, "--shared-memory-min-bytes", shared_memory_min_bytes, 0,
                                     std::numeric_limits<uint64_t>::max(),
                                     "smallest entry held in a sealed memfd with --shared-memory")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    hypic::rpc::init_service("segment-cache", server);
    hypic::rpc::log_caller_policy("segment cache");
    const auto memory = hypic::rpc::parse_byte_budget(memory_bytes, "--memory-bytes");
    if (memory && *memory == 0) throw std::invalid_argument("--memory-bytes: must be > 0 (the memory tier holds every entry)");
    store.memory_budget_bytes = memory ? *memory : std::max<uint64_t>(uint64_t{1} << 30, hypic::rpc::host_memory_bytes() / 4);
    if (!memory) spdlog::info("--memory-bytes auto: a quarter of this host's {} bytes of memory", hypic::rpc::host_memory_bytes());
    store.disk_dir = disk_dir;
    store.shared_memory_min_bytes = shared_memory ? shared_memory_min_bytes : std::numeric_limits<uint64_t>::max();
    hypic::cache::SegmentStore st(store);
    hypic::rpc::Lifecycle life("segment cache");
    hypic::cache::SegmentCacheService svc(st, life, chunk_bytes, max_lease_ms, max_queued_events,
                                          std::chrono::milliseconds(max_put_wait_ms),
                                          std::chrono::milliseconds(put_idle_ms));
    spdlog::info("memory budget {} bytes (leases up to {:.0f}% of it){}; puts wait for room up to {} ms, idle ones are "
                 "cancelled after {}; {}",
                 store.memory_budget_bytes, 100.0 * store.max_leased_fraction,
                 disk_dir.empty() ? std::string(", no disk tier")
                                  : fmt::format(", disk tier {} ({} bytes)", disk_dir, store.disk_budget_bytes),
                 max_put_wait_ms, put_idle_ms ? fmt::format("{} ms", put_idle_ms) : std::string("never"),
                 shared_memory ? fmt::format("entries of at least {} bytes in sealed memfds for readers on this host",
                                             shared_memory_min_bytes)
                               : std::string("no shared memory"));
    return hypic::rpc::run_server(server, life, {"segment-cache", {&svc}, {"hypic.v1.SegmentCache"}, {}, {}});
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return 1;
  }
}
