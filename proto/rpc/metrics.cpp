#include "proto/rpc/metrics.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/http_server.h"
#include "proto/rpc/security.h"

namespace hypic::rpc {
namespace {

bool valid_metric_name(const std::string& n) {
  if (n.empty()) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool valid_label_name(const std::string& n) {
  if (n.empty() || n.rfind("__", 0) == 0) return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Text format escaping: label values escape backslash, double quote and newline; HELP escapes backslash and newline.
std::string escape(const std::string& s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (quote && c == '"') out += "\\\"";
    else out += c;
  }
  return out;
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);  // shortest text that reads back as the same double
}

std::string label_text(const MetricLabels& labels, const std::pair<std::string, std::string>* extra = nullptr) {
  if (labels.empty() && !extra) return {};
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    out += fmt::format("{}{}=\"{}\"", first ? "" : ",", k, escape(v, true));
    first = false;
  }
  if (extra) out += fmt::format("{}{}=\"{}\"", first ? "" : ",", extra->first, escape(extra->second, true));
  return out + "}";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (!std::isfinite(bounds_[i]) || (i > 0 && bounds_[i] <= bounds_[i - 1])) {
      throw std::invalid_argument("histogram bounds must be finite and strictly increasing");
    }
  }
}

void Histogram::observe(double v) {
  const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[b];
  sum_ += v;
  ++count_;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t run = 0;
  for (uint64_t c : counts_) s.cumulative.push_back(run += c);
  s.sum = sum_;
  s.count = count_;
  return s;
}

std::vector<double> latency_buckets_seconds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
          2.5,   5.0,    7.5,   10.0, 20.0, 40.0, 80.0};
}

MetricsRegistry& MetricsRegistry::global() {
  static MetricsRegistry r;
  return r;
}

MetricsRegistry::Family& MetricsRegistry::family(const std::string& name, Kind kind, const std::string& help,
                                                 const MetricLabels& labels) {
  if (!valid_metric_name(name)) throw std::invalid_argument(fmt::format("metric name \"{}\" is not valid", name));
  for (const auto& [k, v] : labels) {
    if (!valid_label_name(k) || k == "le") {
      throw std::invalid_argument(fmt::format("metric {}: label name \"{}\" is not valid", name, k));
    }
  }
  auto [it, inserted] = families_.try_emplace(name);
  Family& f = it->second;
  if (inserted) {
    f.kind = kind;
    f.help = help;
  } else if (f.kind != kind) {
    throw std::invalid_argument(fmt::format("metric {} is already registered as another type", name));
  }
  return f;
}

Counter& MetricsRegistry::counter(const std::string& name, const std::string& help, const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = family(name, Kind::kCounter, help, labels);
  if (f.fns.count(labels)) {
    throw std::invalid_argument(fmt::format("metric {} is already a computed counter for these labels", name));
  }
  auto& slot = f.counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& MetricsRegistry::gauge(const std::string& name, const std::string& help, const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = family(name, Kind::kGauge, help, labels);
  if (f.fns.count(labels)) {
    throw std::invalid_argument(fmt::format("metric {} is already a computed gauge for these labels", name));
  }
  auto& slot = f.gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

void MetricsRegistry::gauge_fn(const std::string& name, const std::string& help, std::function<double()> fn,
                               const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = family(name, Kind::kGauge, help, labels);
  if (f.gauges.count(labels)) {
    throw std::invalid_argument(fmt::format("metric {} is already a set gauge for these labels", name));
  }
  f.fns[labels] = std::move(fn);
}

void MetricsRegistry::counter_fn(const std::string& name, const std::string& help, std::function<double()> fn,
                                 const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = family(name, Kind::kCounter, help, labels);
  if (f.counters.count(labels)) {
    throw std::invalid_argument(fmt::format("metric {} is already a set counter for these labels", name));
  }
  f.fns[labels] = std::move(fn);
}

Histogram& MetricsRegistry::histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                      const MetricLabels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = family(name, Kind::kHistogram, help, labels);
  if (f.histograms.empty()) {
    f.bounds = bounds;
  } else if (f.bounds != bounds) {
    throw std::invalid_argument(fmt::format("metric {} is already registered with other bucket bounds", name));
  }
  auto& slot = f.histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(std::move(bounds));
  return *slot;
}

std::string MetricsRegistry::render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.kind == Kind::kCounter ? "counter" : f.kind == Kind::kGauge ? "gauge" : "histogram";
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, escape(f.help, false), name, type);
    for (const auto& [labels, c] : f.counters) out += fmt::format("{}{} {}\n", name, label_text(labels), format_value(c->value()));
    for (const auto& [labels, g] : f.gauges) out += fmt::format("{}{} {}\n", name, label_text(labels), format_value(g->value()));
    for (const auto& [labels, fn] : f.fns) {
      double v = std::nan("");
      try {
        v = fn();
      } catch (const std::exception& e) {
        spdlog::warn("metric {}: {}", name, e.what());
      }
      out += fmt::format("{}{} {}\n", name, label_text(labels), format_value(v));
    }
    for (const auto& [labels, h] : f.histograms) {
      const auto s = h->snapshot();
      for (size_t i = 0; i <= s.bounds.size(); ++i) {
        const std::pair<std::string, std::string> le{"le", i < s.bounds.size() ? format_value(s.bounds[i]) : "+Inf"};
        out += fmt::format("{}_bucket{} {}\n", name, label_text(labels, &le), s.cumulative[i]);
      }
      out += fmt::format("{}_sum{} {}\n", name, label_text(labels), format_value(s.sum));
      out += fmt::format("{}_count{} {}\n", name, label_text(labels), s.count);
    }
  }
  return out;
}

std::pair<std::string, int> split_host_port(const std::string& address, const std::string& flag) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    throw std::invalid_argument(fmt::format("{}: \"{}\" is not host:port", flag, address));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty()) host = "0.0.0.0";
  const std::string p = address.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos || std::stoi(p) > 65535) {
    throw std::invalid_argument(fmt::format("{}: port \"{}\" of \"{}\" is not a number in [0, 65535]", flag, p, address));
  }
  return {host, std::stoi(p)};
}

struct MetricsServer::Impl {
  std::unique_ptr<HttpServer> server;
};

MetricsServer::MetricsServer(const std::string& listen, MetricsRegistry& registry) : impl_(std::make_unique<Impl>()) {
  const auto [host, port] = split_host_port(listen, "--metrics-listen");
  HttpServerOptions opt;
  opt.name = "metrics";
  opt.io_threads = 1;
  opt.worker_threads = 1;
  opt.control_threads = 1;
  opt.max_connections = 64;  // scrapers; an idle or slow one is evicted by a new one
  opt.max_header_bytes = 8 << 10;
  opt.max_body_bytes = 0;
  opt.max_buffered_bytes = 0;
  opt.header_timeout = std::chrono::seconds(5);
  opt.write_timeout = std::chrono::seconds(10);
  opt.trim_after_bytes = 0;
  const TlsMaterial& tls = tls_material();
  if (tls.serving()) {
    opt.tls_cert = tls.cert_path;
    opt.tls_key = tls.key_path;
    opt.tls_client_ca = tls.client_ca_path;
  }
  auto text = [](int status, std::string body) {
    HttpResponse r;
    r.status = status;
    r.body = std::move(body);
    return r;
  };
  auto dispatch = [&registry, text](const HttpRequest& req) {
    HttpRoute route;  // everything is answered on the I/O thread: rendering the registry does not block
    // Scrapes carry no body: one is refused before it is read, so nobody can make a service buffer an upload.
    if (req.has_header("Transfer-Encoding") ||
        (req.has_header("Content-Length") && req.header("Content-Length") != "0")) {
      route.needs_body = false;
      route.handler = [text](HttpRequest&, HttpReply& reply) {
        reply.send(text(413, "the metrics endpoint takes no request body\n"));
      };
    } else if (req.path == "/metrics" && req.method == "GET") {
      route.handler = [&registry](HttpRequest&, HttpReply& reply) {
        HttpResponse r;
        r.content_type = "text/plain; version=0.0.4; charset=utf-8";
        r.body = registry.render();
        reply.send(std::move(r));
      };
    } else if (req.path == "/healthz" && req.method == "GET") {
      route.handler = [text](HttpRequest&, HttpReply& reply) { reply.send(text(200, "ok\n")); };
    } else {
      const int status = req.path == "/metrics" || req.path == "/healthz" ? 405 : 404;
      route.handler = [text, status](HttpRequest&, HttpReply& reply) {
        reply.send(text(status, status == 405 ? "use GET\n" : "not found: /metrics or /healthz\n"));
      };
    }
    return route;
  };
  try {
    impl_->server = std::make_unique<HttpServer>(std::move(opt), std::move(dispatch),
                                                 [text](int status, const std::string& message) {
                                                   return text(status, message + "\n");
                                                 });
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("--metrics-listen: {}", e.what()));
  }
  try {
    port_ = impl_->server->bind(host, port);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("--metrics-listen: cannot listen on {} (address in use or invalid?): {}",
                                         listen, e.what()));
  }
  impl_->server->start();
}

MetricsServer::~MetricsServer() { impl_->server->stop(); }

}  // namespace hypic::rpc
