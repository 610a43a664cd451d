// hypic-bench-cache-fetch: how fast entries at real model size come out of a segment cache on this host, streamed over
// gRPC or mapped from the cache's sealed memfds (SegmentCacheClient::Options::shared_memory; the cache's
// --shared-memory), by the number of TCP connections the client spreads its calls over (Options::connections) and the
// number of fetches in flight at once (the combine worker's --fetch-parallelism).
//
//   build/bin/hypic-segment-cache --listen 127.0.0.1:0 --port-file /tmp/port --memory-bytes 4GiB &
//   build/bin/hypic-bench-cache-fetch --cache 127.0.0.1:$(cat /tmp/port) [--entry-mb 232] [--entries 8] [--parallel 8]
//                           [--connections 1,2,4,8] [--transports grpc,shared_memory] [--reps 3] [--json out.json]
//                           [--md out.md] [--consumer-checksum true]
//
// Puts --entries entries of --entry-mb MB (1e6 bytes) of random bytes (fresh digests, one token id each), then for
// each transport and connection count makes a new client, which puts every entry again, one after another (a
// worker's AsyncCachePutter: streamed, or a sealed memfd the cache adopts; timed), then fetches every entry --reps
// times, --parallel at once (a round: all entries, as a request of that many cache-only segments does), each entry's
// bytes handed into a buffer of its own (get_stream, the combine worker's path without the entry parse; with
// --consumer-checksum also hashed there, as the parse hashes what it copies) with the checksum (and MAC, with
// --cache-key-file as the workers take it) verified. A shared_memory row checks that every
// fetch was mapped (the cache on this host with its default --shared-memory true), else fails naming why. Reports
// per transport and connection count the best and median round's wall time, the aggregate GB/s (1e9 bytes), the
// median fetch's ms and the median put's ms, as JSON on stdout (and --json) and a markdown table on stderr (and
// --md). Not a test: run it by hand; the machine's load moves the figures, so compare rows of one run.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/entry_mac.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/metrics.h"
#include "segment_cache/client.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Segment cache fetch throughput by client connections and fetches in flight"};
  std::string cache, json_out, md_out, key_file, mac_scheme = "gmac";
  double entry_mb = 232;
  int entries = 8, parallel = 8, reps = 3;
  std::vector<int> connections{1, 2, 4, 8};
  std::vector<std::string> transports{"grpc", "shared_memory"};
  app.add_option("--cache", cache, "host:port of a running hypic-segment-cache")->required();
  app.add_option("--entry-mb", entry_mb, "entry size, MB (1e6 bytes); 232: a 2048-token Qwen3.5-35B-A3B entry")
      ->check(CLI::Range(0.001, 4000.0))
      ->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--entries", entries, 1, 4096, "entries put, then fetched in each round")
      ->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--parallel", parallel, 1, 256, "fetches in flight at once")->capture_default_str();
  hypic::rpc::add_strict_int_option(app, "--reps", reps, 1, 1000, "rounds per connection count")->capture_default_str();
  app.add_option("--connections", connections, "connection counts to compare (comma separated)")
      ->delimiter(',')
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--transports", transports, "transports to compare (comma separated: grpc, shared_memory)")
      ->delimiter(',')
      ->check(CLI::IsMember({"grpc", "shared_memory"}))
      ->capture_default_str();
  bool consumer_checksum = false;
  app.add_option("--consumer-checksum", consumer_checksum,
                 "the consumer also hashes each piece it copies (XXH3, as the combine worker's entry parse does)")
      ->capture_default_str();
  hypic::rpc::add_entry_mac_flag(app, key_file, mac_scheme);
  app.add_option("--json", json_out, "also write the JSON result here");
  app.add_option("--md", md_out, "also write the markdown table here");
  CLI11_PARSE(app, argc, argv);

  try {
    spdlog::set_default_logger(spdlog::stderr_color_mt("bench"));  // (stdout carries the JSON alone)
    hypic::rpc::configure_entry_mac(key_file, "bench", mac_scheme);
    const auto bytes = uint64_t(entry_mb * 1e6);
    // The entries: random bytes (incompressible; gRPC does not compress here anyway), fresh digests.
    std::mt19937_64 rng(std::random_device{}());
    std::string payload(bytes, '\0');
    for (size_t i = 0; i + 8 <= payload.size(); i += 8) {
      const uint64_t v = rng();
      std::memcpy(payload.data() + i, &v, 8);
    }
    std::vector<hypic::rpc::Digest> digests(static_cast<size_t>(entries));
    std::vector<int32_t> ids(static_cast<size_t>(entries));
    {
      hypic::cache::SegmentCacheClient put_client({cache});
      for (int e = 0; e < entries; ++e) {
        for (auto& b : digests[size_t(e)]) b = uint8_t(rng());
        ids[size_t(e)] = int32_t(e);
        payload[0] = char(e);  // (each entry's bytes differ)
        put_client.put({digests[size_t(e)], std::span<const int32_t>(&ids[size_t(e)], 1)}, payload);
      }
    }

    nlohmann::json result;
    result["tool"] = "hypic-bench-cache-fetch";
    result["cache"] = cache;
    result["entry_bytes"] = bytes;
    result["entries"] = entries;
    result["parallel"] = parallel;
    result["reps"] = reps;
    result["host_threads"] = std::thread::hardware_concurrency();
    result["rows"] = nlohmann::json::array();
    std::string md = fmt::format(
        "| transport | connections | round best ms | round median ms | GB/s (best round) | fetch median ms "
        "| fetch GB/s (median) | put median ms |\n|---|---|---|---|---|---|---|---|\n");
    std::vector<std::string> buffers(static_cast<size_t>(parallel));
    auto& mapped = hypic::rpc::MetricsRegistry::global().counter(
        "hypic:cache_fetched_total", "", {{"transport", "shared_memory"}});  // (the client's own counter)
    for (const auto& transport : transports)
    for (const int conns : connections) {
      hypic::cache::SegmentCacheClient::Options opt;
      opt.connections = conns;
      opt.shared_memory = transport == "shared_memory";
      hypic::cache::SegmentCacheClient client({cache}, opt);
      // Every entry put again by this client, one after another (as a worker's AsyncCachePutter sends them): replaced
      // in place, timed.
      std::vector<double> puts;
      for (int e = 0; e < entries; ++e) {
        payload[0] = char(e);
        const auto p0 = Clock::now();
        client.put({digests[size_t(e)], std::span<const int32_t>(&ids[size_t(e)], 1)}, payload);
        puts.push_back(std::chrono::duration<double, std::milli>(Clock::now() - p0).count());
      }
      const double mapped_before = mapped.value();
      std::vector<double> rounds, fetches;
      std::mutex fetches_mu;
      for (int r = 0; r < reps; ++r) {
        std::atomic<int> next{0};
        std::atomic<bool> failed{false};
        std::string error;
        const auto t0 = Clock::now();
        std::vector<std::thread> threads;
        for (int w = 0; w < parallel; ++w) {
          threads.emplace_back([&, w] {
            std::string& buf = buffers[size_t(w)];
            for (int e; (e = next.fetch_add(1)) < entries && !failed;) {
              try {
                const auto f0 = Clock::now();
                size_t at = 0;
                XXH3_state_t* hash = XXH3_createState();
                XXH3_64bits_reset(hash);
                struct Free {
                  XXH3_state_t* h;
                  ~Free() { XXH3_freeState(h); }
                } free_hash{hash};
                const bool found = client.get_stream(
                    {digests[size_t(e)], std::span<const int32_t>(&ids[size_t(e)], 1)},
                    [&](uint64_t total) {
                      buf.resize(total);
                      at = 0;
                    },
                    [&](std::string_view chunk) {
                      if (at + chunk.size() > buf.size()) throw std::runtime_error("more bytes than announced");
                      std::memcpy(buf.data() + at, chunk.data(), chunk.size());
                      if (consumer_checksum) XXH3_64bits_update(hash, chunk.data(), chunk.size());
                      at += chunk.size();
                    },
                    nullptr, bytes);
                if (!found || at != bytes) throw std::runtime_error(fmt::format("entry {} not fetched whole", e));
                const double ms = std::chrono::duration<double, std::milli>(Clock::now() - f0).count();
                std::lock_guard<std::mutex> lock(fetches_mu);
                fetches.push_back(ms);
              } catch (const std::exception& ex) {
                std::lock_guard<std::mutex> lock(fetches_mu);
                if (!failed.exchange(true)) error = ex.what();
              }
            }
          });
        }
        for (auto& t : threads) t.join();
        if (failed) throw std::runtime_error(fmt::format("{} connection(s): {}", conns, error));
        rounds.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
      const double mapped_n = mapped.value() - mapped_before;
      if (opt.shared_memory && mapped_n != double(entries) * reps) {
        throw std::runtime_error(fmt::format(
            "shared_memory: {} of {} fetches were mapped (the rest streamed): is the cache on this host, with "
            "--shared-memory true and entries of at least its --shared-memory-min-bytes? (its log says)",
            mapped_n, entries * reps));
      }
      const double best = *std::min_element(rounds.begin(), rounds.end()), med = median(rounds);
      const double fetch_med = median(fetches);
      const double gbps = double(bytes) * entries / (best * 1e6), fetch_gbps = double(bytes) / (fetch_med * 1e6);
      result["rows"].push_back({{"transport", transport},
                                {"connections", conns},
                                {"round_ms_best", best},
                                {"round_ms_median", med},
                                {"round_ms_all", rounds},
                                {"gb_per_s_best_round", gbps},
                                {"fetch_ms_median", fetch_med},
                                {"fetch_gb_per_s_median", fetch_gbps},
                                {"put_ms_median", median(puts)}});
      md += fmt::format("| {} | {} | {:.0f} | {:.0f} | {:.2f} | {:.0f} | {:.2f} | {:.0f} |\n", transport, conns, best,
                        med, gbps, fetch_med, fetch_gbps, median(puts));
    }
    const std::string head =
        fmt::format("{} entries of {:.1f} MB, {} fetches in flight, {} rounds each, {} host threads\n\n", entries,
                    double(bytes) / 1e6, parallel, reps, std::thread::hardware_concurrency());
    std::cerr << head << md;
    if (!md_out.empty()) {
      std::ofstream f(md_out);
      f << head << md;
      if (!f) throw std::runtime_error("cannot write " + md_out);
    }
    if (!json_out.empty()) {
      std::ofstream f(json_out);
      f << result.dump(1) << "\n";
      if (!f) throw std::runtime_error("cannot write " + json_out);
    }
    std::cout << result.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hypic-bench-cache-fetch: %s\n", e.what());
    return 1;
  }
}
