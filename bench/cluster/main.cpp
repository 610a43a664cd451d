// hypic-bench-cluster: end-to-end benchmark of a hypic cluster driven through its gRPC API.
//
// It starts local clusters through deploy/local_cluster.py (or drives one already running, --router) and
// measures, all in one run and on prompts from one seeded workload generator (bench/cluster/workload.h):
//   modes     the same prompts under `full`, `prefix` (warm: same order, and reordered) and `hypic` (warm,
//             reordered; cold; and a warm/cold mix at a hit ratio): client TTFT and end-to-end latency
//             p50/p90/p99, plus the router's TTFT split;
//   scaling   all-cold prompts on clusters with 1, 2, 4... scatter workers (the same prompts each time);
//   schedule  LPT vs round-robin (router --schedule) on deliberately uneven segment lengths: segment i is
//             long when i % W == 0, so round-robin stacks every long segment on one worker;
//   serving   (not in the default list; issue 25) per prompt A and reorders of it: hypic cold, warm from the
//             combine worker's device tier, from its host tier (after CombineWorker.ClearTiers{device}), from the
//             segment cache alone (after ClearTiers{device, host}; with the fetch bandwidth), then prefix cold /
//             same order / reordered and full; one row each (hypic_cold, hypic_warm_hot, hypic_warm_host,
//             hypic_warm_remote, prefix_cold, prefix_same, prefix_reordered, full);
//   load      open-loop Poisson arrivals at fixed rates with a warm/cold mix; the highest rate whose p90
//             TTFT stays under an SLO, per mode of --load-modes on the same arrival trace, with the p99
//             inter-token latency there (and of one request alone, before the load).
// Every request decodes exactly --max-tokens tokens (greedy, ignore_eos), so end-to-end latencies compare.
// Each labelled row checks what it claims: a "cold" request must reuse no segment, a "warm" one all of them
// (mismatches are counted in the output and make the exit status 3).
//
// Output: JSON (--out-json), a Markdown table on stdout (also --out-md). Exit status: 0 ok, 1 a cluster or
// request failure, 2 bad usage, 3 measurements done but some row's expectation did not hold.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/cluster/cluster_process.h"
#include "bench/cluster/report.h"
#include "bench/cluster/runner.h"
#include "bench/cluster/stats.h"
#include "bench/cluster/workload.h"
#include "engine/checkpoint/config.h"
#include "tokenizer/tokenizer.h"
#include "kernels/cpu/blas_env.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/server.h"
#include "proto/rpc/status.h"

namespace fs = std::filesystem;
namespace v1 = hypic::v1;
using nlohmann::json;
using namespace hypic::bench;
using namespace hypic::bench::cluster;

namespace {

struct Options {
  // cluster
  fs::path bin_dir, launcher = "deploy/local_cluster.py", model, tokenizer, work_dir;
  std::string python = "python3", router, scenarios = "modes,scaling,schedule,load";
  std::vector<std::string> launcher_args;
  double ready_timeout_s = 300, request_timeout_s = 600;
  int scatter_workers = 2;
  std::string worker_counts = "1,2,4";
  // workload
  uint64_t seed = 1;
  std::vector<fs::path> corpus;
  int query_tokens = 16, max_tokens = 8;
  // modes
  int prompts = 6, segments = 4;
  std::string segment_tokens = "512";
  double hit_ratio = 0.5;
  // scaling
  int scaling_requests = 4, scaling_segments = 8;
  std::string scaling_segment_tokens = "256";
  // schedule
  int schedule_requests = 4, long_tokens = 1024, short_tokens = 128;
  // serving
  int serving_prompts = 3, serving_segments = 8;
  std::string serving_segment_tokens = "2048";
  // load
  std::string load_modes = "hypic";
  std::string rates = "0.5,1,2,4";
  int load_requests = 16, load_segments = 4, load_pool = 16;
  std::string load_segment_tokens = "256";
  double load_hit_ratio = 0.5, slo_ms = 1000;
  bool all_rates = false;
  // output
  fs::path out_json, out_md;
};

/// Requests of one labelled row and what they should have reused.
struct Row {
  std::string name, mode;
  std::vector<RequestResult> results;
  std::vector<int> expected_reused;  // per request; -1 = not checked
  json extra = json::object();

  void add(RequestResult r, int expect) {
    results.push_back(std::move(r));
    expected_reused.push_back(expect);
  }
  int mismatches() const {
    int m = 0;
    for (size_t i = 0; i < results.size(); ++i) {
      if (results[i].ok && expected_reused[i] >= 0 && int(results[i].reused) != expected_reused[i]) ++m;
    }
    return m;
  }
  int errors() const {
    return int(std::count_if(results.begin(), results.end(), [](const RequestResult& r) { return !r.ok; }));
  }
  std::vector<double> ok_values(double RequestResult::*field) const {
    std::vector<double> v;
    for (const auto& r : results)
      if (r.ok) v.push_back(r.*field);
    return v;
  }
  Summary ttft() const { return summarize(ok_values(&RequestResult::client_ttft_ms)); }
  Summary e2e() const { return summarize(ok_values(&RequestResult::client_e2e_ms)); }
  /// Mean of a router TTFT phase over the successful requests.
  double server_mean(double (v1::TtftBreakdown::*phase)() const) const {
    double sum = 0;
    int n = 0;
    for (const auto& r : results) {
      if (!r.ok) continue;
      sum += (r.report.ttft().*phase)();
      ++n;
    }
    return n ? sum / n : 0.0;
  }
  std::string reuse_text() const {
    uint64_t reused = 0, segs = 0;
    for (const auto& r : results) {
      if (!r.ok) continue;
      reused += r.reused;
      segs += uint64_t(r.report.segments_size());
    }
    return fmt::format("{}/{}", reused, segs);
  }

  json to_json() const {
    json j = {{"name", name},
              {"mode", mode},
              {"requests", results.size()},
              {"errors", errors()},
              {"expectation_mismatches", mismatches()},
              {"ttft_ms", hypic::bench::to_json(ttft())},
              {"e2e_ms", hypic::bench::to_json(e2e())}};
    json errs = json::array();
    uint64_t reused = 0, segs = 0, tokens = 0;
    int ok = 0;
    for (const auto& r : results) {
      if (!r.ok) {
        if (errs.size() < 3) errs.push_back(r.error);
        continue;
      }
      ++ok;
      reused += r.reused;
      segs += uint64_t(r.report.segments_size());
      tokens += r.report.prompt_tokens();
    }
    j["error_examples"] = errs;
    j["segments"] = segs;
    j["segments_reused"] = reused;
    j["prompt_tokens_mean"] = ok ? double(tokens) / ok : 0.0;
    j["server_ttft_ms_mean"] = {{"router", server_mean(&v1::TtftBreakdown::router_ms)},
                                {"lookup", server_mean(&v1::TtftBreakdown::lookup_ms)},
                                {"scatter", server_mean(&v1::TtftBreakdown::scatter_ms)},
                                {"transfer", server_mean(&v1::TtftBreakdown::transfer_ms)},
                                {"splice", server_mean(&v1::TtftBreakdown::splice_ms)},
                                {"prefill", server_mean(&v1::TtftBreakdown::prefill_ms)},
                                {"first_decode", server_mean(&v1::TtftBreakdown::first_decode_ms)},
                                {"total", server_mean(&v1::TtftBreakdown::total_ms)}};
    j["delivery"] = delivery_json();
    j.update(extra);
    return j;
  }

  /// How the scatter-built entries reached the combine worker: segments by transport ("grpc", "nccl"), the mean
  /// transfer per segment (combine-side, header to acceptance) and bytes moved, and of the summed transfer time per
  /// request the part exposed in TTFT (its transfer phase: after the last cold segment's compute) and the part
  /// hidden behind compute (the rest, at least 0).
  json delivery_json() const {
    std::map<std::string, uint64_t> by_transport;
    double transfer_ms = 0, bytes = 0, hidden_ms = 0, exposed_ms = 0;
    uint64_t delivered = 0;
    int requests = 0;
    for (const auto& r : results) {
      if (!r.ok) continue;
      double sum = 0;
      bool any = false;
      for (const auto& sr : r.report.segments()) {
        if (sr.transport().empty()) continue;
        any = true;
        ++by_transport[sr.transport()];
        ++delivered;
        transfer_ms += sr.transfer_ms();
        bytes += double(sr.transfer_bytes());
        sum += sr.transfer_ms();
      }
      if (!any) continue;
      ++requests;
      exposed_ms += r.report.ttft().transfer_ms();
      hidden_ms += std::max(0.0, sum - r.report.ttft().transfer_ms());
    }
    json t = json::object();
    for (const auto& [k, v] : by_transport) t[k] = v;
    return {{"segments_by_transport", t},
            {"transfer_ms_per_segment", delivered ? transfer_ms / double(delivered) : 0.0},
            {"transfer_bytes_per_segment", delivered ? bytes / double(delivered) : 0.0},
            {"transfer_ms_exposed_per_request", requests ? exposed_ms / requests : 0.0},
            {"transfer_ms_hidden_per_request", requests ? hidden_ms / requests : 0.0}};
  }
};

/// Everything the scenarios share.
class Bench {
 public:
  Bench(Options opt, const hypic::engine::Tokenizer& tok, SegmentSource source)
      : opt_(std::move(opt)), tok_(tok), src_(std::move(source)) {}

  json run_modes();
  json run_scaling();
  json run_schedule();
  json run_serving();
  json run_load();

  std::vector<std::string> notes;
  std::string fingerprint;
  int mismatches = 0;
  std::atomic<bool> request_failures{false};

 private:
  /// A cluster to measure on: a fresh local one, or the external --router.
  struct Target {
    std::unique_ptr<LaunchedCluster> local;
    std::string address;
    std::unique_ptr<v1::Router::Stub> stub;
    v1::ServerInfo info;
  };
  Target cluster(int scatter_workers, std::vector<std::string> launcher_args, const std::string& tag);
  std::vector<int32_t> fresh_segment(const LengthSpec& len) { return src_.fresh(src_.draw_length(len)); }
  Prompt fresh_prompt(int n, const LengthSpec& len) {
    Prompt p;
    for (int i = 0; i < n; ++i) p.segments.push_back(fresh_segment(len));
    p.query = src_.fresh(opt_.query_tokens);
    return p;
  }
  RequestResult send(Target& t, const Prompt& p, const std::string& mode, const std::string& id) {
    RequestOptions ro;
    ro.mode = mode;
    ro.max_tokens = opt_.max_tokens;
    ro.timeout_s = opt_.request_timeout_s;
    ro.request_id = id;
    RequestResult r = run_request(*t.stub, p, ro);
    if (!r.ok) {
      request_failures = true;
      std::cerr << fmt::format("request {} ({}) failed: {}\n", id, mode, r.error);
    }
    return r;
  }
  /// Untimed requests that take first-use costs (connections, allocations) out of the measurements.
  void warm_up(Target& t, const std::vector<std::string>& modes, const LengthSpec& len, int n) {
    for (const auto& m : modes) send(t, fresh_prompt(n, len), m, fmt::format("warmup-{}-{}", m, warmups_++));
  }
  json finish_rows(const std::vector<Row>& rows) {
    json out = json::array();
    for (const auto& r : rows) {
      mismatches += r.mismatches();
      out.push_back(r.to_json());
    }
    return out;
  }
  std::string run_id(const std::string& what) { return fmt::format("bench-{}-{}", what, ids_++); }
  /// CombineWorker.ClearTiers on every combine worker the router names; the entries dropped, summed.
  json clear_tiers(Target& t, bool device, bool host);
  /// Adds to `counts` ("device", "host", "none") the fastest combine-worker tier holding each segment of `ref`'s
  /// report (CombineWorker.LookupEntries on every combine worker); a failed lookup is logged and counts nothing.
  void count_tiers(Target& t, const RequestResult& ref, json& counts);

  Options opt_;
  const hypic::engine::Tokenizer& tok_;
  SegmentSource src_;
  int warmups_ = 0, ids_ = 0;
};

Bench::Target Bench::cluster(int scatter_workers, std::vector<std::string> launcher_args, const std::string& tag) {
  Target t;
  if (!opt_.router.empty()) {
    t.address = opt_.router;
  } else {
    ClusterSpec spec;
    spec.python = opt_.python;
    spec.launcher = opt_.launcher;
    spec.bin_dir = opt_.bin_dir;
    spec.model = opt_.model;
    spec.tokenizer = opt_.tokenizer;
    spec.scatter_workers = scatter_workers;
    spec.launcher_args = opt_.launcher_args;
    spec.launcher_args.insert(spec.launcher_args.end(), launcher_args.begin(), launcher_args.end());
    spec.work_dir = opt_.work_dir / tag;
    spec.ready_timeout_s = opt_.ready_timeout_s;
    std::cerr << fmt::format("[bench] starting a cluster: {} scatter worker(s) {}\n", scatter_workers,
                             fmt::join(launcher_args, " "));
    t.local = std::make_unique<LaunchedCluster>(spec);
    t.address = t.local->router();
  }
  t.stub = v1::Router::NewStub(hypic::rpc::make_channel(t.address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const grpc::Status st = t.stub->GetServerInfo(&ctx, v1::GetServerInfoRequest{}, &t.info);
  if (!st.ok()) throw std::runtime_error(fmt::format("GetServerInfo at {}: {}", t.address, hypic::rpc::describe(st)));
  fingerprint = t.info.model_fingerprint();
  return t;
}

json Bench::run_modes() {
  const LengthSpec len = parse_length_spec(opt_.segment_tokens, "--segment-tokens");
  Target t = cluster(opt_.scatter_workers, {}, "modes");
  std::cerr << fmt::format("[bench] modes: {} prompts of {} segments\n", opt_.prompts, opt_.segments);
  warm_up(t, {"hypic", "prefix", "full"}, len, opt_.segments);
  const int n = opt_.segments;
  const int k = int(std::lround(opt_.hit_ratio * n));
  std::vector<Row> rows = {{"full", "full"},
                           {"prefix, warm, same order", "prefix"},
                           {"prefix, warm, reordered", "prefix"},
                           {"hypic, warm, reordered", "hypic"},
                           {"hypic, cold", "hypic"},
                           {fmt::format("hypic, mixed ({}/{} warm)", k, n), "hypic"},
                           {"prefix, cold", "prefix"}};
  enum { kFull, kPrefixSame, kPrefixReordered, kHypicWarm, kHypicCold, kHypicMixed, kPrefixCold };
  for (int i = 0; i < opt_.prompts; ++i) {
    // A: the prompt as first seen; B: the same segments in another order with another query (what a
    // RAG system sends when retrieval ranks the same documents differently); C: k of A's segments and
    // n - k new ones.
    Prompt a = fresh_prompt(n, len);
    const std::vector<int32_t> q2 = src_.fresh(opt_.query_tokens);
    Prompt b{a.segments, q2};
    for (int tries = 0; tries < 16 && n > 1 && b.segments == a.segments; ++tries) shuffle(b.segments, src_.rng());
    Prompt c{a.segments, q2};
    shuffle(c.segments, src_.rng());
    c.segments.resize(size_t(k));
    for (int j = k; j < n; ++j) c.segments.push_back(fresh_segment(len));
    shuffle(c.segments, src_.rng());
    Prompt a2{a.segments, q2};
    int common_head = 0;
    while (common_head < n && b.segments[size_t(common_head)] == a.segments[size_t(common_head)]) ++common_head;

    // Order matters: hypic cold must see A's segments first; the prefix rows need A's chain checkpointed.
    rows[kHypicCold].add(send(t, a, "hypic", run_id("hypic-cold")), 0);
    rows[kHypicWarm].add(send(t, b, "hypic", run_id("hypic-warm")), n);
    rows[kHypicMixed].add(send(t, c, "hypic", run_id("hypic-mixed")), k);
    rows[kPrefixCold].add(send(t, a, "prefix", run_id("prefix-cold")), 0);
    rows[kPrefixSame].add(send(t, a2, "prefix", run_id("prefix-same")), n);
    rows[kPrefixReordered].add(send(t, b, "prefix", run_id("prefix-reordered")), common_head);
    rows[kFull].add(send(t, b, "full", run_id("full")), 0);
    std::cerr << fmt::format("[bench] modes: prompt {}/{} done\n", i + 1, opt_.prompts);
  }
  return {{"scatter_workers", t.info.scatter_workers_size()},
          {"prompts", opt_.prompts},
          {"segments_per_prompt", n},
          {"segment_tokens", opt_.segment_tokens},
          {"query_tokens", opt_.query_tokens},
          {"hit_ratio", opt_.hit_ratio},
          {"rows", finish_rows(rows)}};
}

json Bench::run_scaling() {
  const LengthSpec len = parse_length_spec(opt_.scaling_segment_tokens, "--scaling-segment-tokens");
  std::vector<int> counts;
  for (double c : parse_positive_list(opt_.worker_counts, "--worker-counts")) {
    if (c != std::floor(c)) throw std::invalid_argument(fmt::format("--worker-counts: {} is not an integer", c));
    counts.push_back(int(c));
  }
  std::vector<Prompt> prompts;  // the same all-cold prompts for every worker count (each cluster starts empty)
  for (int i = 0; i < opt_.scaling_requests; ++i) prompts.push_back(fresh_prompt(opt_.scaling_segments, len));
  std::vector<Row> rows;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  for (int w : counts) {
    Target t = cluster(w, {}, fmt::format("scaling-{}", w));
    warm_up(t, {"hypic"}, len, opt_.scaling_segments);
    Row row{fmt::format("{} scatter worker{}", w, w == 1 ? "" : "s"), "hypic"};
    for (size_t i = 0; i < prompts.size(); ++i) row.add(send(t, prompts[i], "hypic", run_id("scaling")), 0);
    row.extra = {{"scatter_workers", w}, {"cpu_cores", cores}};
    rows.push_back(std::move(row));
    std::cerr << fmt::format("[bench] scaling: {} workers done\n", w);
  }
  const int max_w = *std::max_element(counts.begin(), counts.end());
  if (unsigned(max_w) + 1 > cores) {
    notes.push_back(fmt::format(
        "scaling: this host has {} CPU core(s) for up to {} scatter workers plus the combine worker, router and "
        "cache. At most {} scatter workers compute in parallel; rows with more workers than cores share them, so "
        "their differences reflect the cluster's coordination overhead and its share of a contended CPU, not "
        "parallel speedup (which needs a core or a GPU per worker).",
        cores, max_w, cores));
  }
  return {{"segments_per_prompt", opt_.scaling_segments},
          {"segment_tokens", opt_.scaling_segment_tokens},
          {"cpu_cores", cores},
          {"rows", finish_rows(rows)}};
}

/// The most tokens any one worker built for a request (its share of the cold work), from the report.
int64_t max_worker_tokens(const RequestResult& r) {
  std::map<std::string, int64_t> per;
  for (const auto& s : r.report.segments()) per[s.built_by()] += s.num_tokens();
  int64_t m = 0;
  for (const auto& [w, n] : per) m = std::max(m, n);
  return m;
}

json Bench::run_schedule() {
  const int w = opt_.scatter_workers;
  if (w < 2) throw std::invalid_argument("--scatter-workers must be >= 2 for the schedule scenario");
  const int n = 2 * w;
  std::vector<Prompt> prompts;
  for (int i = 0; i < opt_.schedule_requests; ++i) {
    Prompt p;
    for (int j = 0; j < n; ++j) p.segments.push_back(src_.fresh(j % w == 0 ? opt_.long_tokens : opt_.short_tokens));
    p.query = src_.fresh(opt_.query_tokens);
    prompts.push_back(std::move(p));
  }
  std::vector<Row> rows;
  for (const std::string policy : {"lpt", "round-robin"}) {
    Target t = cluster(w, {"--router-arg=--schedule=" + policy}, "schedule-" + policy);
    if (t.info.schedule_policy() != policy) {
      throw std::runtime_error(fmt::format("the router reports schedule policy '{}', expected '{}'",
                                           t.info.schedule_policy(), policy));
    }
    warm_up(t, {"hypic"}, LengthSpec{opt_.short_tokens, opt_.short_tokens}, n);
    Row row{policy, "hypic"};
    std::vector<double> max_tokens;
    for (const auto& p : prompts) {
      row.add(send(t, p, "hypic", run_id("schedule")), 0);
      if (row.results.back().ok) max_tokens.push_back(double(max_worker_tokens(row.results.back())));
    }
    row.extra = {{"policy", policy}, {"max_worker_tokens", to_json(summarize(max_tokens))}};
    rows.push_back(std::move(row));
    std::cerr << fmt::format("[bench] schedule: {} done\n", policy);
  }
  return {{"scatter_workers", w},
          {"segments_per_prompt", n},
          {"long_tokens", opt_.long_tokens},
          {"short_tokens", opt_.short_tokens},
          {"pattern", fmt::format("segment i has {} tokens when i % {} == 0, else {}", opt_.long_tokens, w,
                                  opt_.short_tokens)},
          {"ideal_max_worker_tokens", opt_.long_tokens + opt_.short_tokens},
          {"rows", finish_rows(rows)}};
}

/// The --load-modes list: modes among hypic, prefix and full, each once. Throws std::invalid_argument otherwise.
std::vector<std::string> parse_load_modes(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string m;
  while (std::getline(ss, m, ',')) {
    if (m != "hypic" && m != "prefix" && m != "full") {
      throw std::invalid_argument(fmt::format("--load-modes: unknown mode '{}' (hypic, prefix, full)", m));
    }
    if (std::find(out.begin(), out.end(), m) != out.end()) {
      throw std::invalid_argument(fmt::format("--load-modes: '{}' given twice", m));
    }
    out.push_back(m);
  }
  if (out.empty()) throw std::invalid_argument("--load-modes: the list is empty");
  return out;
}

/// "combine_memory" for SEGMENT_SOURCE_COMBINE_MEMORY.
std::string source_name(v1::SegmentSource s) {
  std::string n = v1::SegmentSource_Name(s);
  if (n.rfind("SEGMENT_SOURCE_", 0) == 0) n = n.substr(15);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return n.empty() ? fmt::format("source_{}", int(s)) : n;
}

/// Segments by source over a row's successful requests, {"combine_memory": 8, "cache": 2, ...}.
json sources_json(const Row& row) {
  std::map<std::string, uint64_t> by;
  for (const auto& r : row.results) {
    if (!r.ok) continue;
    for (const auto& sr : r.report.segments()) ++by[source_name(sr.source())];
  }
  json j = json::object();
  for (const auto& [k, v] : by) j[k] = v;
  return j;
}

/// The warm entries' fetches of a row (SegmentReport.fetch_ms / fetch_bytes: the copy that made an entry resident
/// for the splice, from the combine worker's host tier or the segment cache). Per segment: GB/s = bytes / ms / 1e6,
/// averaged over the segments that fetched something; per request: the bytes fetched, the summed and the longest
/// fetch time, and the request's bandwidth both ways (bytes / summed ms: as if the fetches ran one after another;
/// bytes / longest ms: as if they all overlapped), averaged over the requests that fetched something.
json fetch_json(const Row& row) {
  double gbps_sum = 0, bytes_sum = 0, ms_sum_sum = 0, ms_max_sum = 0, req_gbps_serial = 0, req_gbps_overlap = 0;
  uint64_t segs = 0;
  int requests = 0;
  for (const auto& r : row.results) {
    if (!r.ok) continue;
    double bytes = 0, ms_sum = 0, ms_max = 0;
    bool any = false;
    for (const auto& sr : r.report.segments()) {
      if (sr.fetch_bytes() == 0 && sr.fetch_ms() <= 0) continue;
      any = true;
      bytes += double(sr.fetch_bytes());
      ms_sum += sr.fetch_ms();
      ms_max = std::max(ms_max, sr.fetch_ms());
      if (sr.fetch_ms() > 0) {
        gbps_sum += double(sr.fetch_bytes()) / sr.fetch_ms() / 1e6;
        ++segs;
      }
    }
    if (!any) continue;
    ++requests;
    bytes_sum += bytes;
    ms_sum_sum += ms_sum;
    ms_max_sum += ms_max;
    if (ms_sum > 0) req_gbps_serial += bytes / ms_sum / 1e6;
    if (ms_max > 0) req_gbps_overlap += bytes / ms_max / 1e6;
  }
  const auto mean = [](double v, double n) { return n > 0 ? v / n : 0.0; };
  return {{"fetch_segments", segs},
          {"fetch_requests", requests},
          {"fetch_gbps_per_segment", mean(gbps_sum, double(segs))},
          {"fetch_bytes_per_request", mean(bytes_sum, requests)},
          {"fetch_ms_sum_per_request", mean(ms_sum_sum, requests)},
          {"fetch_ms_max_per_request", mean(ms_max_sum, requests)},
          {"fetch_gbps_per_request_sum_ms", mean(req_gbps_serial, requests)},
          {"fetch_gbps_per_request_max_ms", mean(req_gbps_overlap, requests)}};
}

/// Inter-token latencies of every successful request of a row, pooled.
std::vector<double> row_itl(const Row& row) {
  std::vector<double> v;
  for (const auto& r : row.results) {
    if (!r.ok) continue;
    const auto d = inter_token_ms(r);
    v.insert(v.end(), d.begin(), d.end());
  }
  return v;
}

/// A fresh order of `segs` (different from it when there are at least two distinct segments).
std::vector<std::vector<int32_t>> reordered(const std::vector<std::vector<int32_t>>& segs, std::mt19937_64& rng) {
  auto out = segs;
  for (int tries = 0; tries < 16 && out.size() > 1 && out == segs; ++tries) shuffle(out, rng);
  return out;
}

int common_head(const std::vector<std::vector<int32_t>>& a, const std::vector<std::vector<int32_t>>& b) {
  int k = 0;
  while (size_t(k) < a.size() && size_t(k) < b.size() && a[size_t(k)] == b[size_t(k)]) ++k;
  return k;
}

json Bench::clear_tiers(Target& t, bool device, bool host) {
  if (t.info.combine_workers_size() == 0) throw std::runtime_error("the router names no combine worker (ServerInfo)");
  uint64_t dropped_device = 0, dropped_host = 0;
  double settle_ms = 0;
  for (const auto& w : t.info.combine_workers()) {
    auto stub = v1::CombineWorker::NewStub(hypic::rpc::make_channel(w.address()));
    // First the worker's background work settles: host copies made (host tier) and cache puts sent, as they would
    // have been by the time a later request comes (they are asynchronous by design). At most 120 s.
    const auto s0 = std::chrono::steady_clock::now();
    for (;;) {
      grpc::ClientContext ictx;
      ictx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::WorkerInfo info;
      const grpc::Status ist = stub->GetWorkerInfo(&ictx, v1::WorkerInfoRequest{}, &info);
      if (!ist.ok()) {
        throw std::runtime_error(
            fmt::format("CombineWorker.GetWorkerInfo at {}: {}", w.address(), hypic::rpc::describe(ist)));
      }
      if (info.host_copies_pending() == 0 && info.cache_puts_pending() == 0) break;
      if (std::chrono::steady_clock::now() - s0 > std::chrono::seconds(120)) {
        notes.push_back(fmt::format("combine worker {}: host copies / cache puts still pending after 120 s ({} / {})",
                                    w.address(), info.host_copies_pending(), info.cache_puts_pending()));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    settle_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ClearTiersRequest req;
    req.set_device(device);
    req.set_host(host);
    v1::ClearTiersResponse resp;
    const grpc::Status st = stub->ClearTiers(&ctx, req, &resp);
    if (!st.ok()) {
      throw std::runtime_error(
          fmt::format("CombineWorker.ClearTiers at {}: {}", w.address(), hypic::rpc::describe(st)));
    }
    dropped_device += resp.device_entries_dropped();
    dropped_host += resp.host_entries_dropped();
  }
  return {{"device_entries_dropped", dropped_device}, {"host_entries_dropped", dropped_host}, {"settle_ms", settle_ms}};
}

void Bench::count_tiers(Target& t, const RequestResult& ref, json& counts) {
  if (!ref.ok) return;
  v1::LookupEntriesRequest req;
  for (const auto& sr : ref.report.segments()) {
    req.add_digests(hypic::rpc::digest_bytes(hypic::rpc::digest_from_hex(sr.digest_hex())));
  }
  std::vector<int> best(size_t(req.digests_size()), int(v1::ENTRY_TIER_NONE));
  for (const auto& w : t.info.combine_workers()) {
    auto stub = v1::CombineWorker::NewStub(hypic::rpc::make_channel(w.address()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::LookupEntriesResponse resp;
    const grpc::Status st = stub->LookupEntries(&ctx, req, &resp);
    if (!st.ok()) {
      std::cerr << fmt::format("[bench] CombineWorker.LookupEntries at {}: {}\n", w.address(),
                               hypic::rpc::describe(st));
      return;
    }
    for (int i = 0; i < resp.tiers_size() && size_t(i) < best.size(); ++i) {
      const int tier = resp.tiers(i);
      if (tier != v1::ENTRY_TIER_NONE && (best[size_t(i)] == v1::ENTRY_TIER_NONE || tier < best[size_t(i)])) {
        best[size_t(i)] = tier;
      }
    }
  }
  for (int tier : best) {
    const char* k = tier == v1::ENTRY_TIER_DEVICE     ? "device"
                    : tier == v1::ENTRY_TIER_HOST     ? "host"
                    : tier == v1::ENTRY_TIER_BUILDING ? "building"
                                                      : "none";
    counts[k] = counts.value(k, 0) + 1;
  }
}

json Bench::run_serving() {
  const LengthSpec len = parse_length_spec(opt_.serving_segment_tokens, "--serving-segment-tokens");
  // The rows measure each source as it is: hypic_warm_remote fetches from the segment cache (its GB/s), so the
  // combine worker's --cache-fetch-policy auto, which may prefill such segments instead once it has timed both, is
  // pinned to always here unless the caller set it (--launcher-arg=--combine-arg=--cache-fetch-policy=...).
  const bool policy_given = std::any_of(opt_.launcher_args.begin(), opt_.launcher_args.end(), [](const std::string& a) {
    return a.find("--cache-fetch-policy") != std::string::npos;
  });
  std::vector<std::string> pin;
  if (!policy_given) pin.push_back("--combine-arg=--cache-fetch-policy=always");
  Target t = cluster(opt_.scatter_workers, pin, "serving");
  const int n = opt_.serving_segments;
  std::cerr << fmt::format("[bench] serving: {} prompts of {} segments\n", opt_.serving_prompts, n);
  warm_up(t, {"hypic", "prefix", "full"}, len, n);
  enum { kHypicCold, kHypicHot, kHypicHost, kHypicRemote, kPrefixCold, kPrefixSame, kPrefixReordered, kFull, kRows };
  std::vector<Row> rows = {{"hypic_cold", "hypic"},       {"hypic_warm_hot", "hypic"},    {"hypic_warm_host", "hypic"},
                           {"hypic_warm_remote", "hypic"}, {"prefix_cold", "prefix"},     {"prefix_same", "prefix"},
                           {"prefix_reordered", "prefix"}, {"full", "full"}};
  const std::vector<std::string> expectations = {
      "0 reused: A's segments, first seen",
      "n reused: a reorder of A, every entry in the combine worker's device tier",
      "n reused: a reorder of A after ClearTiers{device}: from the combine worker's host tier (CUDA) or the segment "
      "cache (no host tier: CPU)",
      "n reused: a reorder of A after ClearTiers{device, host}: from the segment cache service",
      "0 reused: A's order, no prefix checkpoint yet",
      "n reused: A's order again with another query, after prefix_cold",
      "the head B shares with A's order reused (prefix checkpoints)",
      "0 reused: B computed whole in context"};
  std::vector<json> tiers(kRows, json::object());
  json cleared = json::array();
  for (int i = 0; i < opt_.serving_prompts; ++i) {
    // A: fresh segments; B, B2, B3: other orders of them; every request with a query of its own.
    Prompt a = fresh_prompt(n, len);
    auto q = [&] { return src_.fresh(opt_.query_tokens); };
    const Prompt b{reordered(a.segments, src_.rng()), q()};
    const Prompt b2{reordered(a.segments, src_.rng()), q()};
    const Prompt b3{reordered(a.segments, src_.rng()), q()};

    rows[kHypicCold].add(send(t, a, "hypic", run_id("serving-hypic-cold")), 0);
    const RequestResult& cold = rows[kHypicCold].results.back();  // its report names A's digests
    count_tiers(t, cold, tiers[kHypicHot]);
    rows[kHypicHot].add(send(t, b, "hypic", run_id("serving-hypic-hot")), n);
    json c1 = clear_tiers(t, true, false);
    count_tiers(t, cold, tiers[kHypicHost]);
    rows[kHypicHost].add(send(t, b2, "hypic", run_id("serving-hypic-host")), n);
    json c2 = clear_tiers(t, true, true);
    count_tiers(t, cold, tiers[kHypicRemote]);
    rows[kHypicRemote].add(send(t, b3, "hypic", run_id("serving-hypic-remote")), n);
    cleared.push_back({{"prompt", i}, {"before_hypic_warm_host", c1}, {"before_hypic_warm_remote", c2}});

    rows[kPrefixCold].add(send(t, Prompt{a.segments, q()}, "prefix", run_id("serving-prefix-cold")), 0);
    rows[kPrefixSame].add(send(t, Prompt{a.segments, q()}, "prefix", run_id("serving-prefix-same")), n);
    rows[kPrefixReordered].add(send(t, Prompt{b.segments, q()}, "prefix", run_id("serving-prefix-reordered")),
                               common_head(a.segments, b.segments));
    rows[kFull].add(send(t, Prompt{b.segments, q()}, "full", run_id("serving-full")), 0);
    std::cerr << fmt::format("[bench] serving: prompt {}/{} done\n", i + 1, opt_.serving_prompts);
  }
  for (int k = 0; k < kRows; ++k) {
    Row& r = rows[size_t(k)];
    const Summary ttft = r.ttft();
    r.extra = {{"row", r.name},
               {"ttft_ms_p50", ttft.p50},
               {"ttft_ms_p90", ttft.p90},
               {"unexpected", r.mismatches() + r.errors()},
               {"expected", expectations[size_t(k)]},
               {"sources", sources_json(r)},
               {"itl_ms", to_json(summarize(row_itl(r)))}};
    r.extra.update(fetch_json(r));
    if (k == kHypicHot || k == kHypicHost || k == kHypicRemote) r.extra["combine_tiers_before"] = tiers[size_t(k)];
  }
  const json host_sources = sources_json(rows[kHypicHost]);
  if (!host_sources.contains("combine_host")) {
    notes.push_back(fmt::format("serving: no hypic_warm_host entry came from the combine worker's host tier (sources: "
                                "{}); the CPU backend has no host tier (budget 0), so after ClearTiers{{device}} the "
                                "entries come from the segment cache, as in hypic_warm_remote. The row still checks "
                                "that all n segments are reused.",
                                host_sources.dump()));
  }
  std::string device;
  for (const auto& w : t.info.combine_workers()) device += (device.empty() ? "" : ",") + w.device();
  return {{"scatter_workers", t.info.scatter_workers_size()},
          {"combine_devices", device},
          {"prompts", opt_.serving_prompts},
          {"segments_per_prompt", n},
          {"segment_tokens", opt_.serving_segment_tokens},
          {"query_tokens", opt_.query_tokens},
          {"max_tokens", opt_.max_tokens},
          {"order", "per prompt: hypic_cold(A), hypic_warm_hot(B), ClearTiers{device}, hypic_warm_host(B2), "
                    "ClearTiers{device,host}, hypic_warm_remote(B3), prefix_cold(A), prefix_same(A), "
                    "prefix_reordered(B), full(B); B, B2, B3 are reorders of A's segments; every request has a "
                    "fresh query"},
          {"tiers_cleared", cleared},
          {"rows", finish_rows(rows)}};
}

json Bench::run_load() {
  const LengthSpec len = parse_length_spec(opt_.load_segment_tokens, "--load-segment-tokens");
  const std::vector<double> rates = [&] {
    auto r = parse_positive_list(opt_.rates, "--rates");
    std::sort(r.begin(), r.end());
    return r;
  }();
  const std::vector<std::string> modes = parse_load_modes(opt_.load_modes);
  const int n = opt_.load_segments;
  if (opt_.load_pool < n) throw std::invalid_argument("--load-pool must be >= --load-segments");
  Target t = cluster(opt_.scatter_workers, {}, "load");
  std::vector<std::vector<int32_t>> pool;
  for (int i = 0; i < opt_.load_pool; ++i) pool.push_back(fresh_segment(len));

  // Unloaded reference: one request alone (the load's prompt shape, all cold, mode hypic) after an untimed one.
  warm_up(t, {"hypic"}, len, n);
  Row unloaded{"unloaded", "hypic"};
  unloaded.add(send(t, fresh_prompt(n, len), "hypic", run_id("load-unloaded")), 0);
  const Summary unloaded_itl = summarize(row_itl(unloaded));

  // One arrival trace per rate (prompts, their warm count, Poisson arrival times), the same for every mode.
  struct Trace {
    double rate;
    std::vector<Prompt> prompts;
    std::vector<int> warm;
    std::vector<double> arrivals;
  };
  std::vector<Trace> traces;
  for (double rate : rates) {
    Trace tr{rate, {}, {}, {}};
    for (int i = 0; i < opt_.load_requests; ++i) {
      Prompt p;
      std::vector<size_t> idx(pool.size());
      for (size_t j = 0; j < idx.size(); ++j) idx[j] = j;
      shuffle(idx, src_.rng());
      int warm = 0;
      for (int j = 0; j < n; ++j) {
        if (uniform_unit(src_.rng()) < opt_.load_hit_ratio) {
          p.segments.push_back(pool[idx[size_t(warm++)]]);
        } else {
          p.segments.push_back(fresh_segment(len));
        }
      }
      p.query = src_.fresh(opt_.query_tokens);
      tr.prompts.push_back(std::move(p));
      tr.warm.push_back(warm);
    }
    tr.arrivals = poisson_arrivals(rate, opt_.load_requests, src_.rng());
    traces.push_back(std::move(tr));
  }

  json modes_out = json::array();
  for (const std::string& mode : modes) {
    // The warm pool: sent once per mode (untimed, in that mode) so that it is cached for it.
    for (int i = 0; i < opt_.load_pool; i += n) {
      Prompt p{{pool.begin() + i, pool.begin() + std::min(opt_.load_pool, i + n)}, src_.fresh(opt_.query_tokens)};
      send(t, p, mode, fmt::format("warmup-pool-{}-{}", mode, i));
    }
    std::vector<Row> rows;
    std::optional<double> best;
    bool all_passed_so_far = true;
    for (const Trace& tr : traces) {
      const double rate = tr.rate;
      std::vector<RequestResult> results(tr.prompts.size());
      std::vector<double> done_at(tr.prompts.size(), 0);
      std::vector<std::thread> threads;
      std::cerr << fmt::format("[bench] load: {} requests at {} req/s (Poisson), mode {}\n", tr.prompts.size(), rate,
                               mode);
      std::vector<std::string> ids;
      for (size_t i = 0; i < tr.prompts.size(); ++i) ids.push_back(run_id("load-" + mode));
      const auto start = std::chrono::steady_clock::now();
      for (size_t i = 0; i < tr.prompts.size(); ++i) {
        std::this_thread::sleep_until(start + std::chrono::microseconds(int64_t(tr.arrivals[i] * 1e6)));
        threads.emplace_back([&, i] {
          results[i] = send(t, tr.prompts[i], mode, ids[i]);
          done_at[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        });
      }
      for (auto& th : threads) th.join();
      Row row{fmt::format("{:g} req/s", rate), mode};
      // hypic: the pool's segments are warm; full: nothing is reused; prefix: not checked (a prefix checkpoint hits
      // only when a prompt starts with segments in an order already sent, pool or load, which depends on timing).
      for (size_t i = 0; i < results.size(); ++i) {
        row.add(std::move(results[i]), mode == "hypic" ? tr.warm[i] : mode == "full" ? 0 : -1);
      }
      const double span = *std::max_element(done_at.begin(), done_at.end());
      const Summary ttft = row.ttft();
      const Summary itl = summarize(row_itl(row));
      const bool pass = row.errors() == 0 && ttft.n > 0 && ttft.p90 <= opt_.slo_ms;
      row.extra = {{"offered_rate", rate},
                   {"achieved_rate", span > 0 ? double(row.results.size() - size_t(row.errors())) / span : 0.0},
                   {"duration_s", span},
                   {"meets_slo", pass},
                   {"itl_ms", to_json(itl)},
                   {"itl_ms_p99", itl.p99}};
      rows.push_back(std::move(row));
      if (pass && all_passed_so_far) best = rate;
      all_passed_so_far = all_passed_so_far && pass;
      if (!pass && !opt_.all_rates) {
        std::cerr << fmt::format("[bench] load ({}): p90 TTFT {:.0f} ms > SLO {:.0f} ms (or errors) at {} req/s; "
                                 "higher rates skipped\n",
                                 mode, ttft.p90, opt_.slo_ms, rate);
        break;
      }
    }
    // The figures at the highest rate meeting the SLO, else at the lowest rate.
    size_t at = 0;
    for (size_t i = 0; i < rows.size(); ++i)
      if (best && rows[i].extra["offered_rate"].get<double>() == *best) at = i;
    const double ttft_p90 = rows[at].ttft().p90;
    const double itl_p99 = rows[at].extra["itl_ms_p99"].get<double>();
    const double at_rate = rows[at].extra["offered_rate"].get<double>();
    modes_out.push_back({{"mode", mode},
                         {"qps_at_slo", best ? json(*best) : json(nullptr)},
                         {"figures_at_rate", at_rate},
                         {"ttft_ms_p90", ttft_p90},
                         {"itl_ms_p99", itl_p99},
                         {"rows", finish_rows(rows)}});
    std::cerr << fmt::format("[bench] load: mode {} done\n", mode);
  }
  if (std::find(modes.begin(), modes.end(), "prefix") != modes.end()) {
    notes.push_back("load, prefix mode: the warm pool is sent in prefix mode too, in chunks of --load-segments in pool "
                    "order, but the load's prompts take their warm segments from the pool in random order, so a "
                    "prefix checkpoint hits only when a prompt starts with a pool chunk's leading segments in the "
                    "same order (or with an earlier load prompt's): prefix rows reuse little, and their reuse is not "
                    "checked.");
  }
  json out = {{"scatter_workers", t.info.scatter_workers_size()},
              {"segments_per_request", n},
              {"segment_tokens", opt_.load_segment_tokens},
              {"hit_ratio", opt_.load_hit_ratio},
              {"warm_pool_segments", opt_.load_pool},
              {"requests_per_rate", opt_.load_requests},
              {"arrivals", "Poisson (exponential gaps), open loop: a request is sent at its arrival time whatever is "
                           "pending; the same prompts and arrival times for every mode"},
              {"slo_p90_ttft_ms", opt_.slo_ms},
              {"load_modes", modes},
              {"itl_ms_p99_unloaded", unloaded_itl.p99},
              {"unloaded_reference", finish_rows({unloaded})[0]},
              {"modes", modes_out}};
  // The single-mode keys of before, from the first mode.
  out["mode"] = modes_out[0]["mode"];
  out["max_rate_meeting_slo"] = modes_out[0]["qps_at_slo"];
  out["rows"] = modes_out[0]["rows"];
  return out;
}

std::string model_summary(const hypic::engine::ModelConfig& c) {
  return fmt::format("{}, hidden {}, {} layers ({} linear attention, {} full attention), vocabulary {}", c.model_type,
                     c.hidden_size, c.num_hidden_layers, c.num_linear_layers(), c.num_attention_layers(), c.vocab_size);
}

}  // namespace

int main(int argc, char** argv) {
  install_termination_handler();
  CLI::App app{"hypic-bench-cluster: TTFT and latency of a hypic cluster by mode, scatter-worker count, schedule "
               "policy and load, measured through its gRPC API"};
  Options o;
  std::string self_dir = fs::canonical("/proc/self/exe").parent_path().string();
  o.bin_dir = self_dir;
  using hypic::rpc::add_strict_int_option;
  using hypic::rpc::strict_real;
  app.add_option("--model", o.model, "checkpoint directory served by the clusters")->required()->check(CLI::ExistingDirectory);
  app.add_option("--tokenizer", o.tokenizer, "tokenizer.json")->required()->check(CLI::ExistingFile);
  app.add_option("--bin-dir", o.bin_dir, "where the hypic-* service binaries are (default: next to this binary)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--launcher", o.launcher, "the local launcher")->capture_default_str();
  app.add_option("--python", o.python, "Python interpreter for the launcher")->capture_default_str();
  app.add_option("--launcher-arg", o.launcher_args,
                 "extra launcher flag for every cluster (repeat), e.g. --launcher-arg=--scatter-arg=--compute-threads=2");
  app.add_option("--router", o.router,
                 "measure an already running cluster at host:port instead of starting local ones (the scaling and "
                 "schedule scenarios, which restart clusters, are then skipped)");
  app.add_option("--work-dir", o.work_dir, "cluster logs (default: a new directory under /tmp, removed on success)");
  app.add_option("--scenarios", o.scenarios,
                 "comma-separated subset of modes,scaling,schedule,serving,load (serving is not in the default list)")
      ->capture_default_str();
  add_strict_int_option(app, "--scatter-workers", o.scatter_workers, 0, 1024,
                        "scatter workers for the modes, schedule, serving and load scenarios (0: the combine worker "
                        "prefills cold segments itself; schedule needs >= 2)")
      ->capture_default_str();
  app.add_option("--worker-counts", o.worker_counts, "scatter-worker counts of the scaling scenario")->capture_default_str();
  constexpr double kWeekS = 604800;  // the longest wait or deadline in seconds, as the services' timeouts
  app.add_option("--ready-timeout-s", o.ready_timeout_s, "longest wait for a cluster to start")
      ->check(strict_real(0.001, kWeekS))
      ->capture_default_str();
  app.add_option("--request-timeout-s", o.request_timeout_s, "deadline of each request")
      ->check(strict_real(0.001, kWeekS))
      ->capture_default_str();
  add_strict_int_option(app, "--seed", o.seed, 0, std::numeric_limits<uint64_t>::max(), "workload seed")
      ->capture_default_str();
  app.add_option("--corpus", o.corpus, "text file(s) to cut segments from (repeat); default: random token ids")
      ->check(CLI::ExistingFile);
  add_strict_int_option(app, "--query-tokens", o.query_tokens, 1, 1 << 20, "tokens per query")->capture_default_str();
  add_strict_int_option(app, "--max-tokens", o.max_tokens, 1, 4096, "tokens decoded per request")
      ->capture_default_str();
  add_strict_int_option(app, "--prompts", o.prompts, 1, 100000, "modes: prompts per mode")->capture_default_str();
  add_strict_int_option(app, "--segments", o.segments, 1, 4096, "modes: segments per prompt")->capture_default_str();
  app.add_option("--segment-tokens", o.segment_tokens, "modes: tokens per segment, N or MIN:MAX")->capture_default_str();
  app.add_option("--hit-ratio", o.hit_ratio, "modes: warm fraction of the mixed row")->check(strict_real(0, 1))
      ->capture_default_str();
  add_strict_int_option(app, "--scaling-requests", o.scaling_requests, 1, 100000, "scaling: prompts per worker count")
      ->capture_default_str();
  add_strict_int_option(app, "--scaling-segments", o.scaling_segments, 1, 4096, "scaling: cold segments per prompt")
      ->capture_default_str();
  app.add_option("--scaling-segment-tokens", o.scaling_segment_tokens, "scaling: tokens per segment, N or MIN:MAX")
      ->capture_default_str();
  add_strict_int_option(app, "--schedule-requests", o.schedule_requests, 1, 100000, "schedule: prompts per policy")
      ->capture_default_str();
  add_strict_int_option(app, "--long-tokens", o.long_tokens, 1, 1 << 20, "schedule: tokens of the long segments")
      ->capture_default_str();
  add_strict_int_option(app, "--short-tokens", o.short_tokens, 1, 1 << 20, "schedule: tokens of the short segments")
      ->capture_default_str();
  add_strict_int_option(app, "--serving-prompts", o.serving_prompts, 1, 100000,
                        "serving: prompts (each gives one request per row)")
      ->capture_default_str();
  add_strict_int_option(app, "--serving-segments", o.serving_segments, 1, 4096, "serving: segments per prompt")
      ->capture_default_str();
  app.add_option("--serving-segment-tokens", o.serving_segment_tokens, "serving: tokens per segment, N or MIN:MAX")
      ->capture_default_str();
  app.add_option("--load-modes", o.load_modes,
                 "load: modes run on the same arrival trace, comma-separated subset of hypic,prefix,full")
      ->capture_default_str();
  app.add_option("--rates", o.rates, "load: offered request rates (req/s), comma-separated")->capture_default_str();
  add_strict_int_option(app, "--load-requests", o.load_requests, 1, 100000, "load: requests per rate")
      ->capture_default_str();
  add_strict_int_option(app, "--load-segments", o.load_segments, 1, 4096, "load: segments per request")
      ->capture_default_str();
  app.add_option("--load-segment-tokens", o.load_segment_tokens, "load: tokens per segment, N or MIN:MAX")
      ->capture_default_str();
  app.add_option("--load-hit-ratio", o.load_hit_ratio, "load: probability that a segment is warm")
      ->check(strict_real(0, 1))->capture_default_str();
  add_strict_int_option(app, "--load-pool", o.load_pool, 1, 100000, "load: warm segments cached before the load")
      ->capture_default_str();
  app.add_option("--slo-ms", o.slo_ms, "load: p90 TTFT objective")
      ->check(strict_real(0.001, 86400000))  // up to a day
      ->capture_default_str();
  app.add_flag("--all-rates", o.all_rates, "load: keep going after a rate misses the SLO");
  std::vector<std::string> user_notes;
  app.add_option("--note", user_notes, "a line for the report's notes (repeat), e.g. the commit measured");
  app.add_option("--out-json", o.out_json, "write the results as JSON here");
  app.add_option("--out-md", o.out_md, "write the Markdown tables here (they are printed on stdout too)");
  CLI11_PARSE(app, argc, argv);

  bool own_work_dir = false;
  try {
    std::set<std::string> wanted;
    {
      std::stringstream ss(o.scenarios);
      std::string s;
      while (std::getline(ss, s, ',')) {
        if (s != "modes" && s != "scaling" && s != "schedule" && s != "serving" && s != "load") {
          throw std::invalid_argument(
              fmt::format("--scenarios: unknown scenario '{}' (modes, scaling, schedule, serving, load)", s));
        }
        wanted.insert(s);
      }
      if (wanted.empty()) throw std::invalid_argument("--scenarios: empty");
    }
    // Validate size flags before any cluster starts.
    parse_length_spec(o.segment_tokens, "--segment-tokens");
    parse_length_spec(o.scaling_segment_tokens, "--scaling-segment-tokens");
    parse_length_spec(o.load_segment_tokens, "--load-segment-tokens");
    parse_length_spec(o.serving_segment_tokens, "--serving-segment-tokens");
    parse_load_modes(o.load_modes);
    parse_positive_list(o.rates, "--rates");
    parse_positive_list(o.worker_counts, "--worker-counts");
    if (o.router.empty() && !fs::is_regular_file(o.launcher)) {
      throw std::invalid_argument(fmt::format("--launcher {}: no such file (run from the repository root or pass "
                                              "--launcher)",
                                              o.launcher.string()));
    }
    if (o.work_dir.empty()) {
      char tmpl[] = "/tmp/hypic-bench-cluster.XXXXXX";
      if (!mkdtemp(tmpl)) throw std::runtime_error("cannot create a work directory under /tmp");
      o.work_dir = tmpl;
      own_work_dir = true;
    }
    // Several single-threaded services share the host: one BLAS thread each unless the user says otherwise.
    setenv("OPENBLAS_NUM_THREADS", "1", 0);
    const char* core_env = std::getenv("OPENBLAS_CORETYPE");
    const std::string rec = hypic::kernels::cpu::recommended_blas_core();
    const std::string services_core =
        core_env ? std::string(core_env) + " (OPENBLAS_CORETYPE)"
                 : (rec.empty() ? hypic::kernels::cpu::blas_core_name() : rec + " (services re-exec with it)");

    const auto config = hypic::engine::load_config(o.model);
    const auto tokenizer = hypic::engine::Tokenizer::load(o.tokenizer);
    SegmentSource source = o.corpus.empty() ? SegmentSource::random_ids(tokenizer, o.seed)
                                            : SegmentSource::corpus(tokenizer, o.corpus, o.seed);
    const std::string source_description = source.description();
    Bench bench(o, tokenizer, std::move(source));
    if (!o.router.empty()) {
      for (const char* s : {"scaling", "schedule"}) {
        if (wanted.erase(s)) bench.notes.push_back(fmt::format("{}: skipped (it restarts clusters; --router given)", s));
      }
    }

    std::string command;
    for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
    json out = {{"benchmark", "hypic-bench-cluster"},
                {"date_utc", utc_now()},
                {"command", command},
                {"host",
                 {{"cpu", cpu_model()},
                  {"cores", std::max(1u, std::thread::hardware_concurrency())},
                  {"openblas_core", services_core},
                  {"openblas_num_threads", std::string(std::getenv("OPENBLAS_NUM_THREADS"))},
                  {"loadavg_1min_at_start", load_average()}}},
                {"model", {{"dir", o.model.string()}, {"summary", model_summary(config)}}},
                {"workload",
                 {{"source", source_description}, {"seed", o.seed}, {"query_tokens", o.query_tokens}, {"max_tokens", o.max_tokens}}},
                {"scenarios", json::object()}};
    const auto t0 = std::chrono::steady_clock::now();
    for (const char* s : {"modes", "scaling", "schedule", "serving", "load"}) {
      if (!wanted.count(s)) continue;
      const std::string name = s;
      json r = name == "modes"      ? bench.run_modes()
               : name == "scaling"  ? bench.run_scaling()
               : name == "schedule" ? bench.run_schedule()
               : name == "serving"  ? bench.run_serving()
                                    : bench.run_load();
      out["scenarios"][name] = std::move(r);
    }
    out["host"]["loadavg_1min_at_end"] = load_average();
    const double busy = out["host"]["loadavg_1min_at_start"].get<double>();
    if (busy > 0.5 * std::max(1u, std::thread::hardware_concurrency())) {
      bench.notes.push_back(fmt::format("the host was already busy when the benchmark started (1-minute load average "
                                        "{:.1f} on {} cores, before any cluster ran): absolute times are noisy; "
                                        "compare rows within a scenario.",
                                        busy, std::max(1u, std::thread::hardware_concurrency())));
    }
    out["wall_seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out["model"]["fingerprint"] = bench.fingerprint;
    out["workload"]["source"] = source_description;
    std::vector<std::string> notes = user_notes;
    notes.insert(notes.end(), bench.notes.begin(), bench.notes.end());
    out["notes"] = notes;
    out["expectation_mismatches"] = bench.mismatches;

    const std::string md = markdown(out);
    std::cout << md << std::flush;
    if (!o.out_json.empty()) {
      std::ofstream f(o.out_json);
      f << out.dump(2) << "\n";
      if (!f) throw std::runtime_error(fmt::format("cannot write {}", o.out_json.string()));
    }
    if (!o.out_md.empty()) {
      std::ofstream f(o.out_md);
      f << md;
      if (!f) throw std::runtime_error(fmt::format("cannot write {}", o.out_md.string()));
    }
    if (bench.request_failures) {
      std::cerr << fmt::format("hypic-bench-cluster: some requests failed; cluster logs kept in {}\n", o.work_dir.string());
      return 1;
    }
    if (bench.mismatches > 0) {
      std::cerr << fmt::format("hypic-bench-cluster: {} request(s) reused a different number of segments than their "
                               "row claims (see UNEXPECTED in the tables); logs in {}\n",
                               bench.mismatches, o.work_dir.string());
      return 3;
    }
    if (own_work_dir) fs::remove_all(o.work_dir);
    return 0;
  } catch (const std::invalid_argument& e) {
    std::cerr << "hypic-bench-cluster: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "hypic-bench-cluster: " << e.what() << "\n";
    if (!o.work_dir.empty()) std::cerr << "cluster logs: " << o.work_dir.string() << "\n";
    return 1;
  }
}
