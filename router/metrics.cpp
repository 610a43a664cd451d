#include "router/metrics.h"

namespace hypic::router {

RouterMetrics& RouterMetrics::get() {
  auto& r = rpc::MetricsRegistry::global();
  const auto lat = rpc::latency_buckets_seconds();
  static RouterMetrics m{
      r.histogram("hypic:time_to_first_token_seconds", "Time to first token: arrival at the router to first token",
                  lat),
      r.histogram("hypic:inter_token_latency_seconds", "Time between consecutive generated tokens",
                  {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5}),
      r.histogram("hypic:e2e_request_latency_seconds", "Arrival at the router to the report", lat),
      r.gauge("hypic:num_requests_running", "Requests producing tokens"),
      r.gauge("hypic:num_requests_waiting", "Admitted requests without a token yet (lookup, scatter, splice)"),
      r.counter("hypic:prompt_tokens_total", "Prompt tokens (segments and query) of finished requests"),
      r.counter("hypic:generation_tokens_total", "Generated tokens relayed to clients"),
      r.counter("hypic:segment_cache_queries_total", "Segments looked up in the segment cache"),
      r.counter("hypic:segment_cache_hits_total", "Segments found warm in the segment cache"),
      r.counter("hypic:prompt_tokens_cached_total", "Prompt tokens of segments reused instead of computed"),
      r.counter("hypic:request_success_total", "Requests that finished with their report"),
      r.counter("hypic:requests_refused_total", "Requests refused over the concurrency limit"),
      r.counter("hypic:scatter_failures_total", "Scatter-worker calls that failed"),
      r.counter("hypic:combine_retries_total",
                "Requests planned again on another combine worker (or the same one back) after theirs was unavailable "
                "before starting or died before the first token"),
  };
  return m;
}

void RouterMetrics::count_failure(const std::string& code) {
  rpc::MetricsRegistry::global()
      .counter("hypic:request_failures_total", "Requests that ended with an error, by gRPC status code", {{"code", code}})
      .inc();
}

void RouterMetrics::count_planned(const std::string& source) {
  rpc::MetricsRegistry::global()
      .counter("hypic:segments_planned_total", "Segments of finished requests by where their entry came from",
               {{"source", source}})
      .inc();
}

}  // namespace hypic::router
