// Prometheus metrics shared by every hypic service: a process-wide registry of counters, gauges and histograms,
// rendered in the Prometheus text exposition format 0.0.4, and the HTTP(S) endpoint that serves it at /metrics
// (started by run_server() when --metrics-listen is given; TLS with the process's --tls-cert, security.h).
//
// Names follow vLLM's where one exists (vllm:time_to_first_token_seconds -> hypic:time_to_first_token_seconds);
// counters end in _total, times are in seconds and sizes in bytes (Prometheus' base units). The list of metrics and
// what moves them: deploy/README.md, "Metrics".
#pragma once
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace hypic::rpc {

/// Label name -> value of one time series (ordered, so the same set always renders the same way).
using MetricLabels = std::map<std::string, std::string>;

/// A monotonically increasing value (Prometheus counter). Thread-safe, lock-free.
class Counter {
 public:
  /// Adds `v` (must be >= 0; negative amounts are ignored, since a counter never decreases).
  void inc(double v = 1.0) {
    if (v > 0) value_.fetch_add(v, std::memory_order_relaxed);
  }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// A value that goes up and down (Prometheus gauge). Thread-safe, lock-free.
class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void inc(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  void dec(double v = 1.0) { value_.fetch_sub(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// Observations counted into cumulative buckets (Prometheus histogram): bucket i counts observations <= bounds[i],
/// plus +Inf, a sum and a count. Thread-safe (a mutex per histogram).
class Histogram {
 public:
  /// `bounds`: strictly increasing finite upper bounds. Throws std::invalid_argument otherwise.
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  ///< one per bound, then +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative), last = above every bound
  double sum_ = 0;
  uint64_t count_ = 0;
};

/// Bucket bounds for latencies in seconds, 1 ms to 80 s (vLLM's TTFT buckets extended below 10 ms).
std::vector<double> latency_buckets_seconds();

/// The metrics of a process. Metrics are created on first use and live as long as the registry; the references
/// returned stay valid. Asking again for the same name and labels returns the same metric.
class MetricsRegistry {
 public:
  /// The process-wide registry that /metrics serves.
  static MetricsRegistry& global();

  /// Throws std::invalid_argument for a name that is not a valid Prometheus metric name, a label name that is not
  /// valid, or a name already registered as another type (or a histogram with other bounds).
  Counter& counter(const std::string& name, const std::string& help, const MetricLabels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const MetricLabels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                       const MetricLabels& labels = {});
  /// A gauge computed at each scrape by `fn` (e.g. bytes held by a store; called on the scraping thread, so it must
  /// be thread-safe). Registering the same name and labels again replaces the function.
  void gauge_fn(const std::string& name, const std::string& help, std::function<double()> fn,
                const MetricLabels& labels = {});
  /// A counter read at each scrape from `fn` (a monotonic count kept elsewhere, e.g. a component's own atomic).
  /// Same rules as gauge_fn.
  void counter_fn(const std::string& name, const std::string& help, std::function<double()> fn,
                  const MetricLabels& labels = {});

  /// All metrics in the text exposition format 0.0.4, families sorted by name.
  std::string render() const;

 private:
  enum class Kind { kCounter, kGauge, kHistogram };
  struct Family {
    Kind kind;
    std::string help;
    std::vector<double> bounds;  // histograms
    std::map<MetricLabels, std::unique_ptr<Counter>> counters;
    std::map<MetricLabels, std::unique_ptr<Gauge>> gauges;
    std::map<MetricLabels, std::function<double()>> fns;  // computed at each scrape (gauge_fn, counter_fn)
    std::map<MetricLabels, std::unique_ptr<Histogram>> histograms;
  };
  Family& family(const std::string& name, Kind kind, const std::string& help, const MetricLabels& labels);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

/// The HTTP(S) server of /metrics (and /healthz, answering "ok"): the event-driven HttpServer (http_server.h) on one
/// I/O thread, at most 64 connections (a new one evicts the longest idle), heads within 5 s, no request bodies
/// (413 before reading one).
class MetricsServer {
 public:
  /// Binds `listen` (host:port; port 0 picks one) and starts serving `registry`. Serves HTTPS when the process's TLS
  /// configuration (security.h) has a serving certificate, requiring client certificates when it has a client CA.
  /// Throws std::runtime_error when the address cannot be bound, std::invalid_argument for a malformed address.
  MetricsServer(const std::string& listen, MetricsRegistry& registry);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  int port() const { return port_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

/// Splits "host:port" ("[::1]:80" for IPv6) into host and port. Throws std::invalid_argument naming `flag` when
/// there is no port or it is not a number in [0, 65535].
std::pair<std::string, int> split_host_port(const std::string& address, const std::string& flag);

}  // namespace hypic::rpc
