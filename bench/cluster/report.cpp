// The cluster benchmark's report (contract in report.h).
#include "bench/cluster/report.h"

#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace hypic::bench::cluster {

using json = nlohmann::json;

namespace {

std::string ms(double v) { return fmt::format("{:.0f}", v); }

}  // namespace

std::string markdown(const json& j) {
  std::ostringstream o;
  o << fmt::format("# hypic cluster benchmark\n\n");
  o << fmt::format("- date (UTC): {}\n- host: {} ({} CPU cores), services' OpenBLAS kernels: {}, "
                   "OPENBLAS_NUM_THREADS={}\n",
                   j["date_utc"].get<std::string>(), j["host"]["cpu"].get<std::string>(), j["host"]["cores"].get<int>(),
                   j["host"]["openblas_core"].get<std::string>(), j["host"]["openblas_num_threads"].get<std::string>());
  o << fmt::format("- host load average (1 min) at start / end: {:.2f} / {:.2f}; wall time {:.0f} s\n",
                   j["host"]["loadavg_1min_at_start"].get<double>(), j["host"]["loadavg_1min_at_end"].get<double>(),
                   j["wall_seconds"].get<double>());
  o << fmt::format("- model: {} ({}), fingerprint {}\n", j["model"]["dir"].get<std::string>(),
                   j["model"]["summary"].get<std::string>(), j["model"]["fingerprint"].get<std::string>());
  o << fmt::format("- workload: {}; seed {}; queries of {} tokens; {} generated tokens per request (greedy)\n",
                   j["workload"]["source"].get<std::string>(), j["workload"]["seed"].get<uint64_t>(),
                   j["workload"]["query_tokens"].get<int>(), j["workload"]["max_tokens"].get<int>());
  o << "- TTFT and E2E are measured by the client (call start to first token / to end of stream), in ms; "
       "the split is the router's mean per phase.\n";
  const auto& sc = j["scenarios"];
  auto split = [](const json& r) {
    const auto& s = r["server_ttft_ms_mean"];
    return fmt::format("{} / {} / {} / {} / {} / {}", ms(s["router"]), ms(s["lookup"]), ms(s["scatter"]),
                       ms(s["transfer"]), ms(s["splice"].get<double>() + s.value("prefill", 0.0)),
                       ms(s["first_decode"]));
  };
  auto lat = [](const json& r, const char* key) {
    const auto& s = r[key];
    return fmt::format("{} | {} | {}", ms(s["p50"]), ms(s["p90"]), ms(s["p99"]));
  };
  auto reuse = [](const json& r) {
    std::string s = fmt::format("{}/{}", r["segments_reused"].get<uint64_t>(), r["segments"].get<uint64_t>());
    if (r["errors"].get<int>() > 0) s += fmt::format(", {} errors", r["errors"].get<int>());
    if (r["expectation_mismatches"].get<int>() > 0) s += fmt::format(", {} UNEXPECTED", r["expectation_mismatches"].get<int>());
    return s;
  };
  if (sc.contains("modes")) {
    const auto& m = sc["modes"];
    o << fmt::format("\n## Modes on the same prompts ({} scatter workers; {} prompts of {} segments x {} tokens)\n\n",
                     m["scatter_workers"].get<int>(), m["prompts"].get<int>(), m["segments_per_prompt"].get<int>(),
                     m["segment_tokens"].get<std::string>());
    o << "| mode | n | TTFT p50 | p90 | p99 | E2E p50 | p90 | p99 | reused segments | split: router / lookup / scatter / "
         "transfer / splice (full, prefix: prefill) / first decode |\n|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : m["rows"]) {
      o << fmt::format("| {} | {} | {} | {} | {} | {} |\n", r["name"].get<std::string>(), r["ttft_ms"]["n"].get<int>(),
                       lat(r, "ttft_ms"), lat(r, "e2e_ms"), reuse(r), split(r));
    }
    o << "\n`reordered`: the segments of the cold prompt in another order with another query (the prompt `full` "
         "also runs); `same order`: the cold prompt's segments in the same order with another query.\n";
  }
  if (sc.contains("scaling")) {
    const auto& s = sc["scaling"];
    o << fmt::format("\n## Cold-path scaling ({} cold segments x {} tokens per prompt, the same prompts each time)\n\n",
                     s["segments_per_prompt"].get<int>(), s["segment_tokens"].get<std::string>());
    o << "| scatter workers | n | TTFT p50 | p90 | p99 | E2E p50 | p90 | p99 | scatter phase (mean) | reused segments |\n"
         "|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : s["rows"]) {
      o << fmt::format("| {} | {} | {} | {} | {} | {} |\n", r["scatter_workers"].get<int>(), r["ttft_ms"]["n"].get<int>(),
                       lat(r, "ttft_ms"), lat(r, "e2e_ms"), ms(r["server_ttft_ms_mean"]["scatter"]), reuse(r));
    }
  }
  if (sc.contains("schedule")) {
    const auto& s = sc["schedule"];
    o << fmt::format("\n## LPT vs round-robin on uneven segments ({} scatter workers; {})\n\n",
                     s["scatter_workers"].get<int>(), s["pattern"].get<std::string>());
    o << "| policy | n | TTFT p50 | p90 | p99 | E2E p50 | p90 | p99 | scatter phase (mean) | busiest worker's tokens "
         "(mean) |\n|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : s["rows"]) {
      o << fmt::format("| {} | {} | {} | {} | {} | {:.0f} |\n", r["policy"].get<std::string>(),
                       r["ttft_ms"]["n"].get<int>(), lat(r, "ttft_ms"), lat(r, "e2e_ms"),
                       ms(r["server_ttft_ms_mean"]["scatter"]), r["max_worker_tokens"]["mean"].get<double>());
    }
    o << fmt::format("\nA balanced split gives the busiest worker {} tokens.\n", s["ideal_max_worker_tokens"].get<int>());
  }
  if (sc.contains("serving")) {
    const auto& m = sc["serving"];
    o << fmt::format("\n## Serving rows ({} scatter workers, combine worker on {}; {} prompts of {} segments x {} "
                     "tokens)\n\n",
                     m["scatter_workers"].get<int>(), m["combine_devices"].get<std::string>(), m["prompts"].get<int>(),
                     m["segments_per_prompt"].get<int>(), m["segment_tokens"].get<std::string>());
    o << "| row | n | TTFT p50 | p90 | p99 | E2E p50 | p90 | p99 | reused segments | unexpected | sources | fetch GB/s "
         "(per segment) | fetch MB per request | split: router / lookup / scatter / transfer / splice (full, prefix: "
         "prefill) / first decode |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : m["rows"]) {
      std::string sources;
      for (const auto& [k, v] : r["sources"].items()) {
        sources += fmt::format("{}{} {}", sources.empty() ? "" : ", ", k, v.get<uint64_t>());
      }
      const bool fetched = r["fetch_segments"].get<uint64_t>() > 0;
      const std::string gbps = fetched ? fmt::format("{:.2f}", r["fetch_gbps_per_segment"].get<double>()) : "-";
      const std::string mb = fetched ? fmt::format("{:.1f}", r["fetch_bytes_per_request"].get<double>() / 1e6) : "-";
      o << fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", r["row"].get<std::string>(),
                       r["ttft_ms"]["n"].get<int>(), lat(r, "ttft_ms"), lat(r, "e2e_ms"), reuse(r),
                       r["unexpected"].get<int>(), sources, gbps, mb, split(r));
    }
    o << "\nA: fresh segments; B: A's segments in another order; `hypic_warm_host` after CombineWorker.ClearTiers"
         "{device}, `hypic_warm_remote` after ClearTiers{device, host} (each with a fresh reorder of A); every "
         "request has a fresh query. `unexpected`: requests whose reused count differs from the row's expectation, "
         "plus failed requests.\n";
  }
  if (sc.contains("load")) {
    const auto& l = sc["load"];
    o << fmt::format("\n## Sustained load ({} scatter workers; {} requests per rate, {} segments x {} tokens, "
                     "each warm with probability {:g}; open-loop Poisson arrivals, the same trace for every mode)\n\n",
                     l["scatter_workers"].get<int>(), l["requests_per_rate"].get<int>(),
                     l["segments_per_request"].get<int>(), l["segment_tokens"].get<std::string>(),
                     l["hit_ratio"].get<double>());
    const json modes = l.contains("modes") ? l["modes"]
                                            : json::array({{{"mode", "hypic"}, {"rows", l["rows"]},
                                                            {"qps_at_slo", l["max_rate_meeting_slo"]}}});
    const auto rate_text = [](const json& v) {
      return v.is_null() ? std::string("none of the rates tried") : fmt::format("{:g} req/s", v.get<double>());
    };
    if (l.contains("modes")) {
      o << fmt::format("| mode | highest rate with p90 TTFT <= {} ms | at rate | TTFT p90 | ITL p99 |\n"
                       "|---|---|---|---|---|\n",
                       ms(l["slo_p90_ttft_ms"]));
      for (const auto& md : modes) {
        o << fmt::format("| {} | {} | {:g} | {} | {:.1f} |\n", md["mode"].get<std::string>(), rate_text(md["qps_at_slo"]),
                         md["figures_at_rate"].get<double>(), ms(md["ttft_ms_p90"]), md["itl_ms_p99"].get<double>());
      }
      o << fmt::format("\nTTFT p90 and ITL p99 at the highest rate meeting the SLO (else at the lowest rate); ITL p99 "
                       "of one request alone (mode hypic, before the load): {:.1f} ms.\n",
                       l["itl_ms_p99_unloaded"].get<double>());
    }
    for (const auto& md : modes) {
      o << fmt::format("\n### Mode `{}`\n\n", md["mode"].get<std::string>());
      o << fmt::format("| offered req/s | achieved req/s | n | TTFT p50 | p90 | p99 | E2E p50 | p90 | p99 | ITL p99 | "
                       "reused segments | p90 TTFT <= {} ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
                       ms(l["slo_p90_ttft_ms"]));
      for (const auto& r : md["rows"]) {
        const std::string itl = r.contains("itl_ms_p99") ? fmt::format("{:.1f}", r["itl_ms_p99"].get<double>()) : "-";
        o << fmt::format("| {:g} | {:.2f} | {} | {} | {} | {} | {} | {} |\n", r["offered_rate"].get<double>(),
                         r["achieved_rate"].get<double>(), r["ttft_ms"]["n"].get<int>(), lat(r, "ttft_ms"),
                         lat(r, "e2e_ms"), itl, reuse(r), r["meets_slo"].get<bool>() ? "yes" : "no");
      }
      o << fmt::format("\nHighest offered rate meeting the SLO (p90 TTFT <= {} ms, no errors): {}\n",
                       ms(l["slo_p90_ttft_ms"]), rate_text(md["qps_at_slo"]));
    }
  }
  if (!j["notes"].empty()) {
    o << "\n## Notes\n\n";
    for (const auto& n : j["notes"]) o << "- " << n.get<std::string>() << "\n";
  }
  return o.str();
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto p = line.find(':');
      if (p != std::string::npos) return line.substr(line.find_first_not_of(' ', p + 1));
    }
  }
  return "unknown CPU";
}

double load_average() {
  double l[1];
  return getloadavg(l, 1) == 1 ? l[0] : -1.0;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace hypic::bench::cluster
