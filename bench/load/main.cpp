// hypic-bench-load: many concurrent Generate streams against a running router, counting what happened to
// every request (issue 15's load test and the traffic of its chaos run, bench/load/run_load.py).
//
// --streams N client threads each send requests one after another (until --requests in all, or for
// --duration-s) over --channels gRPC channels. Prompts come from a fixed pool of --pool prompts of random token
// ids (the tokenizer's ordinary ids), so requests mix cache hits and misses; decoding is greedy with ignore_eos,
// so every request of one prompt must produce the same tokens whatever was cached or rebuilt: a different
// output is counted as a mismatch (a corrupt or wrong entry). A request refused by admission
// (RESOURCE_EXHAUSTED) is counted as refused, not failed; the stream waits --refused-backoff-ms and goes on.
//
// Pause protocol (for restarting an idle combine worker): while the file --pause-file exists no stream starts a
// new request; every 100 ms the file --status-file gets {"in_flight": n, "sent": n, "done": n}.
//
// Output: JSON on stdout (or --out-json): requests sent, by status code, accepted (all but refused), finished
// (OK), failed after acceptance by code with a sample of messages and each failure's time, mismatches, peak
// requests in flight, client TTFT and end-to-end latency summaries of the OK requests (ms), wall time.
// Exit status: 0 when every accepted request finished and no output mismatched, 1 otherwise, 2 bad usage.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "bench/cluster/runner.h"
#include "bench/cluster/stats.h"
#include "bench/cluster/workload.h"
#include "proto/rpc/flags.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
namespace v1 = hypic::v1;
using namespace hypic::bench;
using Clock = std::chrono::steady_clock;

namespace {

const char* code_name(int code) {
  static const char* names[] = {"OK",           "CANCELLED",         "UNKNOWN",        "INVALID_ARGUMENT",
                                "DEADLINE_EXCEEDED", "NOT_FOUND",    "ALREADY_EXISTS", "PERMISSION_DENIED",
                                "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                                "UNIMPLEMENTED", "INTERNAL",          "UNAVAILABLE",    "DATA_LOSS",
                                "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? names[code] : "?";
}

struct Shared {
  std::mutex mu;
  std::map<std::string, int64_t> by_status;
  std::map<std::string, int64_t> failed_by_code;
  nlohmann::json failures = nlohmann::json::array();  // first 200: {t_s, prompt, code, message}
  std::vector<double> ttft, e2e;
  std::vector<std::vector<int32_t>> reference;  // per pool prompt: the first OK output
  int64_t mismatches = 0, finished = 0, refused = 0;
  nlohmann::json mismatch_samples = nlohmann::json::array();
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hypic-bench-load: concurrent Generate streams against a router; counts every request's outcome"};
  std::string router, tokenizer_path, out_json, pause_file, status_file, segment_tokens = "16:48", mode = "hypic";
  int streams = 1000, channels = 8, pool_size = 32, segments = 2, query_tokens = 8, max_tokens = 4;
  int64_t requests = 0;
  double duration_s = 0, timeout_s = 300, backoff_ms = 50;
  uint64_t seed = 1;
  app.add_option("--router", router, "router address host:port")->required();
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json (prompts use its ordinary ids)")->required();
  using hypic::rpc::add_strict_int_option;
  using hypic::rpc::strict_real;
  constexpr int kIntMax = std::numeric_limits<int>::max();
  constexpr double kWeekS = 604800;  // the longest duration or deadline in seconds, as the services' timeouts
  add_strict_int_option(app, "--streams", streams, 1, kIntMax, "concurrent client streams (threads)")
      ->capture_default_str();
  add_strict_int_option(app, "--channels", channels, 1, kIntMax, "gRPC channels the streams share")
      ->capture_default_str();
  add_strict_int_option(app, "--requests", requests, 0, std::numeric_limits<int64_t>::max(),
                        "requests in all (default: one per stream unless --duration-s)");
  app.add_option("--duration-s", duration_s, "send for this long instead of a request count")
      ->check(strict_real(0, kWeekS));
  add_strict_int_option(app, "--pool", pool_size, 1, kIntMax, "distinct prompts")->capture_default_str();
  add_strict_int_option(app, "--segments", segments, 1, kIntMax, "segments per prompt")->capture_default_str();
  app.add_option("--segment-tokens", segment_tokens, "segment length: N or MIN:MAX")->capture_default_str();
  add_strict_int_option(app, "--query-tokens", query_tokens, 1, kIntMax, "query tokens")->capture_default_str();
  add_strict_int_option(app, "--max-tokens", max_tokens, 1, kIntMax, "tokens decoded per request")
      ->capture_default_str();
  app.add_option("--mode", mode, "cache mode of every request")->capture_default_str();
  app.add_option("--timeout-s", timeout_s, "deadline of each request")
      ->capture_default_str()
      ->check(strict_real(0.001, kWeekS));
  app.add_option("--refused-backoff-ms", backoff_ms, "pause of a stream after RESOURCE_EXHAUSTED")
      ->capture_default_str()
      ->check(strict_real(0, 3600000));  // at most an hour
  add_strict_int_option(app, "--seed", seed, 0, std::numeric_limits<uint64_t>::max(), "workload seed")
      ->capture_default_str();
  app.add_option("--pause-file", pause_file, "no new request starts while this file exists");
  app.add_option("--status-file", status_file, "written every 100 ms: in_flight, sent, done");
  app.add_option("--out-json", out_json, "also write the JSON result here");
  CLI11_PARSE(app, argc, argv);
  try {
    if (requests == 0 && duration_s <= 0) requests = streams;
    const auto tokenizer = hypic::engine::Tokenizer::load(tokenizer_path);
    SegmentSource src = SegmentSource::random_ids(tokenizer, seed);
    const LengthSpec len = parse_length_spec(segment_tokens, "--segment-tokens");
    std::vector<Prompt> pool(static_cast<size_t>(pool_size));
    for (auto& p : pool) {
      for (int s = 0; s < segments; ++s) p.segments.push_back(src.fresh(src.draw_length(len)));
      p.query = src.fresh(query_tokens);
    }
    std::vector<std::shared_ptr<grpc::Channel>> chans;
    std::vector<std::unique_ptr<v1::Router::Stub>> stubs;
    for (int c = 0; c < channels; ++c) {
      grpc::ChannelArguments args;
      args.SetInt("hypic.bench.channel", c);  // distinct args: distinct connections
      args.SetMaxReceiveMessageSize(64 << 20);
      chans.push_back(grpc::CreateCustomChannel(router, grpc::InsecureChannelCredentials(), args));
      stubs.push_back(v1::Router::NewStub(chans.back()));
    }
    Shared sh;
    sh.reference.resize(pool.size());
    std::atomic<int64_t> next{0}, in_flight{0}, peak{0}, done{0};
    std::atomic<bool> stop{false};
    const auto t0 = Clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
    auto paused = [&] { return !pause_file.empty() && fs::exists(pause_file); };

    std::thread status_thread;
    if (!status_file.empty()) {
      status_thread = std::thread([&] {
        while (!stop.load()) {
          {
            std::ofstream f(status_file + ".tmp");
            f << nlohmann::json{{"in_flight", in_flight.load()}, {"sent", next.load()}, {"done", done.load()},
                                {"t_s", elapsed()}}.dump() << "\n";
          }
          std::error_code ec;
          fs::rename(status_file + ".tmp", status_file, ec);
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      });
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < streams; ++t) {
      threads.emplace_back([&, t] {
        while (true) {
          while (paused() && !stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          if (duration_s > 0 && elapsed() >= duration_s) return;
          const int64_t i = next.fetch_add(1);
          if (requests > 0 && i >= requests) return;
          const size_t pi = size_t(i % int64_t(pool.size()));
          RequestOptions opt;
          opt.mode = mode;
          opt.max_tokens = max_tokens;
          opt.timeout_s = timeout_s;
          opt.request_id = fmt::format("load-{}", i);
          const int64_t now_in = in_flight.fetch_add(1) + 1;
          for (int64_t p = peak.load(); now_in > p && !peak.compare_exchange_weak(p, now_in);) {
          }
          const double t_start = elapsed();
          RequestResult r = run_request(*stubs[size_t(t) % stubs.size()], pool[pi], opt);
          in_flight.fetch_sub(1);
          done.fetch_add(1);
          std::unique_lock lock(sh.mu);
          const std::string code = r.ok ? "OK" : (r.status_code ? code_name(r.status_code) : "STREAM_ERROR");
          ++sh.by_status[code];
          if (r.ok) {
            ++sh.finished;
            sh.ttft.push_back(r.client_ttft_ms);
            sh.e2e.push_back(r.client_e2e_ms);
            if (sh.reference[pi].empty()) {
              sh.reference[pi] = r.token_ids;
            } else if (sh.reference[pi] != r.token_ids) {
              ++sh.mismatches;
              if (sh.mismatch_samples.size() < 20)
                sh.mismatch_samples.push_back({{"prompt", pi}, {"request", i}, {"expected", sh.reference[pi]},
                                               {"got", r.token_ids}});
            }
          } else if (r.status_code == int(grpc::StatusCode::RESOURCE_EXHAUSTED)) {
            ++sh.refused;
            lock.unlock();
            std::this_thread::sleep_for(std::chrono::microseconds(int64_t(backoff_ms * 1000)));
          } else {
            ++sh.failed_by_code[code];
            if (sh.failures.size() < 200)
              sh.failures.push_back({{"t_start_s", t_start}, {"t_end_s", elapsed()}, {"prompt", pi},
                                     {"request", i}, {"code", code}, {"message", r.error}});
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    stop.store(true);
    if (status_thread.joinable()) status_thread.join();

    const int64_t sent = std::min<int64_t>(next.load(), requests > 0 ? requests : next.load());
    int64_t failed = 0;
    for (const auto& [k, v] : sh.failed_by_code) failed += v;
    nlohmann::json out = {
        {"router", router},
        {"streams", streams},
        {"channels", channels},
        {"pool_prompts", pool_size},
        {"prompt_tokens", pool.front().tokens()},
        {"max_tokens", max_tokens},
        {"mode", mode},
        {"requests_sent", sent},
        {"by_status", sh.by_status},
        {"refused_resource_exhausted", sh.refused},
        {"accepted", sent - sh.refused},
        {"finished_ok", sh.finished},
        {"failed_after_acceptance", failed},
        {"failed_by_code", sh.failed_by_code},
        {"failures", sh.failures},
        {"output_mismatches", sh.mismatches},
        {"mismatch_samples", sh.mismatch_samples},
        {"peak_in_flight", peak.load()},
        {"ttft_ms", to_json(summarize(sh.ttft))},
        {"e2e_ms", to_json(summarize(sh.e2e))},
        {"wall_s", elapsed()},
    };
    const std::string text = out.dump(2);
    std::cout << text << "\n";
    if (!out_json.empty()) std::ofstream(out_json) << text << "\n";
    std::fprintf(stderr,
                 "hypic-bench-load: %lld sent, %lld refused (RESOURCE_EXHAUSTED), %lld finished, %lld failed after "
                 "acceptance, %lld mismatched outputs, peak %lld in flight, TTFT p50 %.1f ms p99 %.1f ms, %.1f s\n",
                 (long long)sent, (long long)sh.refused, (long long)sh.finished, (long long)failed,
                 (long long)sh.mismatches, (long long)peak.load(), out["ttft_ms"]["p50"].get<double>(),
                 out["ttft_ms"]["p99"].get<double>(), elapsed());
    return failed == 0 && sh.mismatches == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hypic-bench-load: error: %s\n", e.what());
    return 2;
  }
}
