// Prometheus metrics (proto/rpc/metrics.h): values, the text exposition format (checked against hand-written
// expected text, per the format's specification), errors, and the /metrics endpoint over HTTP and HTTPS.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include <httplib.h>

#include "proto/rpc/metrics.h"
#include "proto/rpc/security.h"

namespace {

/// Sends `POST /metrics` with `body_header` and no body to 127.0.0.1:port over plain TCP and returns the status code
/// of the answer (0 when none came within 5 s).
int status_of_headers_only(int port, const std::string& body_header) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string req = "POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n" + body_header +
                            "\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[512];
      ssize_t n;
      while (answer.find("\r\n") == std::string::npos && (n = ::recv(fd, buf, sizeof buf, 0)) > 0)
        answer.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  // "HTTP/1.1 413 Payload Too Large"
  return answer.size() > 12 && answer.compare(0, 5, "HTTP/") == 0 ? std::atoi(answer.c_str() + 9) : 0;
}

}  // namespace

using namespace hypic::rpc;

TEST_CASE("metrics: counters, gauges and histograms render in the text format 0.0.4", "[metrics]") {
  MetricsRegistry r;
  r.counter("hypic:requests_total", "Requests.\nSecond line \\ backslash").inc(3);
  r.counter("hypic:requests_total", "ignored", {{"code", "OK"}}).inc();
  auto& c = r.counter("hypic:requests_total", "", {{"code", "UNAVAILABLE"}});
  c.inc(2);
  c.inc(-5);  // a counter never decreases
  c.inc(0.5);
  auto& g = r.gauge("hypic:queued_tokens", "Queued tokens", {{"worker", "a\"b\\c\nd"}});
  g.set(10);
  g.dec(4);
  g.inc(0.25);
  auto& h = r.histogram("hypic:ttft_seconds", "TTFT", {0.1, 1.0});
  for (double v : {0.05, 0.1, 0.5, 1.0, 7.0}) h.observe(v);
  r.gauge_fn("hypic:fn_gauge", "Computed", [] { return 42.0; });
  r.counter_fn("hypic:fn_total", "Computed counter", [] { return 7.0; });

  CHECK(c.value() == 2.5);
  CHECK(g.value() == 6.25);
  const auto snap = h.snapshot();
  CHECK(snap.cumulative == std::vector<uint64_t>{2, 4, 5});  // <= 0.1: 0.05 and 0.1; <= 1: + 0.5, 1.0; +Inf: all
  CHECK(snap.count == 5);
  CHECK(snap.sum == Approx(8.65));

  const std::string expected =
      "# HELP hypic:fn_gauge Computed\n"
      "# TYPE hypic:fn_gauge gauge\n"
      "hypic:fn_gauge 42\n"
      "# HELP hypic:fn_total Computed counter\n"
      "# TYPE hypic:fn_total counter\n"
      "hypic:fn_total 7\n"
      "# HELP hypic:queued_tokens Queued tokens\n"
      "# TYPE hypic:queued_tokens gauge\n"
      "hypic:queued_tokens{worker=\"a\\\"b\\\\c\\nd\"} 6.25\n"
      "# HELP hypic:requests_total Requests.\\nSecond line \\\\ backslash\n"
      "# TYPE hypic:requests_total counter\n"
      "hypic:requests_total 3\n"
      "hypic:requests_total{code=\"OK\"} 1\n"
      "hypic:requests_total{code=\"UNAVAILABLE\"} 2.5\n"
      "# HELP hypic:ttft_seconds TTFT\n"
      "# TYPE hypic:ttft_seconds histogram\n"
      "hypic:ttft_seconds_bucket{le=\"0.1\"} 2\n"
      "hypic:ttft_seconds_bucket{le=\"1\"} 4\n"
      "hypic:ttft_seconds_bucket{le=\"+Inf\"} 5\n"
      "hypic:ttft_seconds_sum 8.65\n"
      "hypic:ttft_seconds_count 5\n";
  CHECK(r.render() == expected);
}

TEST_CASE("metrics: the same name and labels give the same metric -- bad names and type clashes are refused",
          "[metrics]") {
  MetricsRegistry r;
  auto& a = r.counter("x_total", "x");
  auto& b = r.counter("x_total", "x");
  CHECK(&a == &b);
  CHECK(&r.counter("x_total", "x", {{"k", "v"}}) != &a);
  CHECK_THROWS_WITH(r.gauge("x_total", "x"), Catch::Contains("already registered as another type"));
  CHECK_THROWS_WITH(r.counter("1bad", "x"), Catch::Contains("not valid"));
  CHECK_THROWS_WITH(r.counter("bad-name", "x"), Catch::Contains("not valid"));
  CHECK_THROWS_WITH(r.counter("ok", "x", {{"le", "1"}}), Catch::Contains("label name \"le\""));
  CHECK_THROWS_WITH(r.counter("ok", "x", {{"__reserved", "1"}}), Catch::Contains("label name"));
  r.histogram("h", "h", {1, 2});
  CHECK_THROWS_WITH(r.histogram("h", "h", {1, 3}, {{"k", "v"}}), Catch::Contains("other bucket bounds"));
  CHECK_THROWS_AS(Histogram({2, 1}), std::invalid_argument);
  r.gauge_fn("g", "g", [] { return 1.0; });
  CHECK_THROWS_WITH(r.gauge("g", "g"), Catch::Contains("computed gauge"));
  // A computed value that throws renders as NaN instead of breaking the scrape.
  r.gauge_fn("boom", "b", []() -> double { throw std::runtime_error("store gone"); });
  CHECK(r.render().find("\nboom NaN\n") != std::string::npos);
}

TEST_CASE("metrics: concurrent increments are all counted", "[metrics]") {
  MetricsRegistry r;
  auto& c = r.counter("n_total", "n");
  auto& h = r.histogram("h", "h", latency_buckets_seconds());
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        c.inc();
        h.observe(0.003);
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK(c.value() == 40000);
  CHECK(h.snapshot().count == 40000);
}

TEST_CASE("metrics: host:port parsing names the flag", "[metrics]") {
  CHECK(split_host_port("127.0.0.1:9100", "--m") == std::pair<std::string, int>{"127.0.0.1", 9100});
  CHECK(split_host_port("[::1]:0", "--m") == std::pair<std::string, int>{"::1", 0});
  CHECK(split_host_port(":80", "--m") == std::pair<std::string, int>{"0.0.0.0", 80});
  CHECK_THROWS_WITH(split_host_port("localhost", "--m"), Catch::Contains("--m") && Catch::Contains("host:port"));
  CHECK_THROWS_WITH(split_host_port("h:70000", "--m"), Catch::Contains("[0, 65535]"));
  CHECK_THROWS_WITH(split_host_port("h:8x", "--m"), Catch::Contains("not a number"));
}

TEST_CASE("metrics endpoint: GET /metrics serves the registry over HTTP", "[metrics]") {
  configure_tls(TlsMaterial{});
  MetricsRegistry r;
  r.counter("hypic:served_total", "s").inc(5);
  MetricsServer server("127.0.0.1:0", r);
  REQUIRE(server.port() > 0);
  httplib::Client cli("127.0.0.1", server.port());
  auto res = cli.Get("/metrics");
  REQUIRE(res);
  CHECK(res->status == 200);
  CHECK(res->get_header_value("Content-Type") == "text/plain; version=0.0.4; charset=utf-8");
  CHECK(res->body == r.render());
  r.counter("hypic:served_total", "s").inc();
  res = cli.Get("/metrics");
  REQUIRE(res);
  CHECK(res->body.find("hypic:served_total 6\n") != std::string::npos);
  CHECK(cli.Get("/nope")->status == 404);
  // A body is refused before it is read (so an upload cannot make a service buffer it), chunked or not. The
  // requests announce a body but send only their headers: the 413 must come without a byte of it (a client that
  // sent the body could see the reset of a close over unread bytes instead of the answer).
  CHECK(status_of_headers_only(server.port(), "Content-Length: 100000") == 413);
  CHECK(status_of_headers_only(server.port(), "Transfer-Encoding: chunked") == 413);
  CHECK(httplib::Client("127.0.0.1", server.port()).Get("/metrics")->status == 200);
  // The port is taken: a second server on it fails with a clear error.
  CHECK_THROWS_WITH(MetricsServer("127.0.0.1:" + std::to_string(server.port()), r),
                    Catch::Contains("cannot listen"));
}

TEST_CASE("metrics endpoint: HTTPS with the process's certificate, client certificates when mTLS is on",
          "[metrics][tls]") {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("hypic-test-certs-metrics-" + std::to_string(::getpid()))).string();
  struct Remove {
    std::string d;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove_all(d, ec);
    }
  } remove{dir};
  REQUIRE(std::system(("'" HYPIC_SOURCE_DIR "/scripts/make_certs.sh' '" + dir + "' >/dev/null").c_str()) == 0);
  TlsFlags f;
  f.cert = dir + "/server.crt";
  f.key = dir + "/server.key";
  configure_tls(f);
  MetricsRegistry r;
  r.gauge("hypic:up", "u").set(1);
  {
    MetricsServer server("127.0.0.1:0", r);
    httplib::SSLClient cli("127.0.0.1", server.port());
    cli.set_ca_cert_path((dir + "/ca.crt").c_str());
    cli.enable_server_certificate_verification(true);
    auto res = cli.Get("/metrics");
    REQUIRE(res);
    CHECK(res->body == r.render());
    httplib::Client plain("127.0.0.1", server.port());  // plain HTTP to a TLS port gets no answer
    CHECK_FALSE(plain.Get("/metrics"));
  }
  f.client_ca = dir + "/ca.crt";
  configure_tls(f);
  {
    MetricsServer server("127.0.0.1:0", r);
    httplib::SSLClient anonymous("127.0.0.1", server.port());
    anonymous.set_ca_cert_path((dir + "/ca.crt").c_str());
    anonymous.enable_server_certificate_verification(true);
    CHECK_FALSE(anonymous.Get("/metrics"));  // no client certificate
    httplib::SSLClient cli("127.0.0.1", server.port(), dir + "/client.crt", dir + "/client.key");
    cli.set_ca_cert_path((dir + "/ca.crt").c_str());
    cli.enable_server_certificate_verification(true);
    auto res = cli.Get("/metrics");
    REQUIRE(res);
    CHECK(res->status == 200);
  }
  configure_tls(TlsMaterial{});
}
