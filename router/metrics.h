// The router's Prometheus metrics (proto/rpc/metrics.h; served at /metrics with --metrics-listen). Names follow
// vLLM's (vllm:time_to_first_token_seconds -> hypic:time_to_first_token_seconds); the full list: deploy/README.md,
// "Metrics".
#pragma once
#include <chrono>
#include <string>

#include "proto/rpc/metrics.h"

namespace hypic::router {

/// References into the global registry, created once.
struct RouterMetrics {
  rpc::Histogram& ttft;              ///< hypic:time_to_first_token_seconds: arrival at the router -> first token
  rpc::Histogram& itl;               ///< hypic:inter_token_latency_seconds: between consecutive tokens relayed
  rpc::Histogram& e2e;               ///< hypic:e2e_request_latency_seconds: arrival -> report sent
  rpc::Gauge& running;               ///< hypic:num_requests_running: requests producing tokens
  rpc::Gauge& waiting;               ///< hypic:num_requests_waiting: admitted, no token yet (lookup/scatter/splice)
  rpc::Counter& prompt_tokens;       ///< hypic:prompt_tokens_total: segment + query tokens of finished requests
  rpc::Counter& generation_tokens;   ///< hypic:generation_tokens_total: tokens relayed to clients
  rpc::Counter& cache_queries;       ///< hypic:segment_cache_queries_total: segments looked up
  rpc::Counter& cache_hits;          ///< hypic:segment_cache_hits_total: of those, found warm
  rpc::Counter& cached_tokens;       ///< hypic:prompt_tokens_cached_total: tokens of segments reused (any source)
  rpc::Counter& success;             ///< hypic:request_success_total: requests that sent their report
  rpc::Counter& refused;             ///< hypic:requests_refused_total: over --max-concurrent-requests
  rpc::Counter& scatter_failures;    ///< hypic:scatter_failures_total: scatter-worker calls that failed
  rpc::Counter& combine_retries;     ///< hypic:combine_retries_total: requests planned again on another combine
                                     ///< worker after theirs was unavailable before starting

  static RouterMetrics& get();
  /// hypic:request_failures_total{code="..."}: requests that ended with that gRPC status code.
  static void count_failure(const std::string& code);
  /// hypic:segments_planned_total{source="..."}: segments by where their entry came from (common.proto
  /// SegmentSource names in lower case: cache, scatter, combine_memory, shared_build, repeat, local, ...).
  static void count_planned(const std::string& source);
};

}  // namespace hypic::router
