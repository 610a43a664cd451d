// The event-driven HTTP server (proto/rpc/http_server.h) over real loopback sockets: strict framing (duplicate or
// conflicting Content-Length 400, chunked 411, an oversized Content-Length 413 before the body is sent), pipelined
// requests answered in order, streams, slow-loris clients past the connection bound not delaying a probe, the header
// deadline closing them, a full worker pool not delaying the control lane, and short_excerpt. Deadlines are checked
// with generous margins; nothing here measures speed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "proto/rpc/http_server.h"

using namespace hypic::rpc;
using Clock = std::chrono::steady_clock;

namespace {

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& s) {
  return ::send(fd, s.data(), s.size(), MSG_NOSIGNAL) == ssize_t(s.size());
}

/// Reads until `until` appears in what was read, the peer closes, or `timeout` passes.
std::string read_until(int fd, const std::string& until, std::chrono::milliseconds timeout) {
  std::string out;
  const auto end = Clock::now() + timeout;
  while (out.find(until) == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(left)) <= 0) break;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  return out;
}

/// True when the peer closed the connection within `timeout` (reads EOF or a reset).
bool closed_within(int fd, std::chrono::milliseconds timeout) {
  const auto end = Clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(left)) <= 0) return false;
    char buf[4096];
    if (::recv(fd, buf, sizeof buf, 0) <= 0) return true;
  }
}

int status_of(const std::string& answer) {
  return answer.size() > 12 && answer.compare(0, 5, "HTTP/") == 0 ? std::atoi(answer.c_str() + 9) : 0;
}

/// A server with /echo (Worker: answers the body), /health (Control), /fast (Inline), /block (Worker: waits until
/// `release`), /stream (Worker: three pieces).
struct TestServer {
  std::atomic<bool> release{false};
  std::atomic<int> blocked{0};
  std::unique_ptr<HttpServer> server;
  int port = 0;

  explicit TestServer(HttpServerOptions opt) {
    server = std::make_unique<HttpServer>(
        std::move(opt),
        [this](const HttpRequest& head) {
          HttpRoute r;
          if (head.path == "/health") {
            r.lane = Lane::Control;
            r.handler = [](HttpRequest&, HttpReply& reply) { reply.send(HttpResponse{200, "text/plain", "ok", {}}); };
          } else if (head.path == "/fast") {
            r.handler = [](HttpRequest& q, HttpReply& reply) { reply.send(HttpResponse{200, "text/plain", q.target, {}}); };
          } else if (head.path == "/echo") {
            r.lane = Lane::Worker;
            r.handler = [](HttpRequest& q, HttpReply& reply) { reply.send(HttpResponse{200, "text/plain", q.body, {}}); };
          } else if (head.path == "/block") {
            r.lane = Lane::Worker;
            r.handler = [this](HttpRequest&, HttpReply& reply) {
              ++blocked;
              while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
              reply.send(HttpResponse{200, "text/plain", "done", {}});
            };
          } else if (head.path == "/stream") {
            r.lane = Lane::Worker;
            r.handler = [](HttpRequest&, HttpReply& reply) {
              if (!reply.begin_stream(200, "text/event-stream", {})) return;
              for (const char* piece : {"data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"}) {
                if (!reply.write(piece)) return;
              }
              reply.end_stream();
            };
          } else {
            r.needs_body = false;
            r.handler = [](HttpRequest&, HttpReply& reply) { reply.send(HttpResponse{404, "text/plain", "nope", {}}); };
          }
          return r;
        },
        [](int status, const std::string& message) { return HttpResponse{status, "text/plain", "E:" + message, {}}; });
    port = server->bind("127.0.0.1", 0);
    server->start();
  }
};

HttpServerOptions small_options() {
  HttpServerOptions o;
  o.io_threads = 2;
  o.worker_threads = 2;
  o.max_body_bytes = 1000;
  o.max_buffered_bytes = 4000;
  return o;
}

}  // namespace

TEST_CASE("http server: framing is strict and refusals come before the body", "[http]") {
  TestServer t(small_options());
  auto ask = [&](const std::string& request) {
    const int fd = connect_to(t.port);
    REQUIRE(fd >= 0);
    REQUIRE(send_all(fd, request));
    const std::string a = read_until(fd, "\r\n\r\n", std::chrono::seconds(5));
    ::close(fd);
    return a;
  };
  CHECK(status_of(ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")) == 200);
  // Two Content-Length fields, equal or not, and a list: 400.
  CHECK(status_of(ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc")) == 400);
  CHECK(status_of(ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabc")) == 400);
  CHECK(status_of(ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 3\r\n\r\nabc")) == 400);
  CHECK(status_of(ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")) == 400);
  // Content-Length over the limit: 413 with only the head sent; chunked: 411.
  CHECK(status_of(ask("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")) == 413);
  CHECK(status_of(ask("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")) == 411);
  // A head over the limit: 431; garbage: 400 whose message quotes little.
  CHECK(status_of(ask("GET /fast HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n")) == 431);
  const std::string garbage = ask(std::string(5000, '\x01') + "\r\n\r\n");
  CHECK(status_of(garbage) == 400);
  CHECK(garbage.size() < 600);
  // Expect: 100-continue gets its interim answer before the body.
  const int fd = connect_to(t.port);
  REQUIRE(send_all(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"));
  CHECK(status_of(read_until(fd, "\r\n\r\n", std::chrono::seconds(5))) == 100);
  REQUIRE(send_all(fd, "hi"));
  const std::string a = read_until(fd, "\r\n\r\nhi", std::chrono::seconds(5));
  CHECK(status_of(a) == 200);
  ::close(fd);
}

TEST_CASE("http server: pipelined requests are answered in order", "[http]") {
  TestServer t(small_options());
  const int fd = connect_to(t.port);
  REQUIRE(fd >= 0);
  // A slow worker request first, then an inline one: the second answer must still come second.
  REQUIRE(send_all(fd,
                   "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirst"
                   "GET /fast?second HTTP/1.1\r\nHost: x\r\n\r\n"
                   "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
                   "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nfifth"));
  const std::string all = read_until(fd, "fifth", std::chrono::seconds(10));
  ::close(fd);
  const size_t a = all.find("first"), b = all.find("/fast?second"), c = all.find("data: [DONE]"), d = all.find("fifth");
  REQUIRE(a != std::string::npos);
  REQUIRE(b != std::string::npos);
  REQUIRE(c != std::string::npos);
  REQUIRE(d != std::string::npos);
  CHECK(a < b);
  CHECK(b < c);
  CHECK(c < d);
  CHECK(all.find("Transfer-Encoding: chunked") != std::string::npos);
}

TEST_CASE("http server: slow clients past the bound neither block a probe nor stay open", "[http]") {
  HttpServerOptions o = small_options();
  o.max_connections = 16;
  o.header_timeout = std::chrono::milliseconds(1500);
  TestServer t(o);
  // 64 slow-loris clients: each sends part of a head and then a byte now and then.
  std::vector<int> slow;
  for (int i = 0; i < 64; ++i) {
    const int fd = connect_to(t.port);
    REQUIRE(fd >= 0);
    send_all(fd, "GET /fast HTTP/1.1\r\nHost: x\r\nX-Slow: ");
    slow.push_back(fd);
  }
  for (int round = 0; round < 5; ++round) {
    for (int fd : slow) send_all(fd, "a");
    const auto t0 = Clock::now();
    const int fd = connect_to(t.port);
    REQUIRE(fd >= 0);
    REQUIRE(send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::string a = read_until(fd, "ok", std::chrono::seconds(5));
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    ::close(fd);
    CHECK(status_of(a) == 200);
    CHECK(ms < 1000);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(t.server->connections() <= o.max_connections + 1);
  // Whoever is still open is closed by the header deadline (1.5 s; a generous margin here).
  const auto deadline = std::chrono::seconds(8);
  int closed = 0;
  for (int fd : slow) closed += closed_within(fd, std::chrono::duration_cast<std::chrono::milliseconds>(deadline));
  CHECK(closed == int(slow.size()));
  for (int fd : slow) ::close(fd);
}

TEST_CASE("http server: a full worker pool delays neither the control lane nor inline routes", "[http]") {
  TestServer t(small_options());  // 2 workers
  std::vector<int> busy;
  for (int i = 0; i < 4; ++i) {
    const int fd = connect_to(t.port);
    REQUIRE(send_all(fd, "GET /block HTTP/1.1\r\nHost: x\r\n\r\n"));
    busy.push_back(fd);
  }
  while (t.blocked < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (const char* path : {"/health", "/fast"}) {
    const int fd = connect_to(t.port);
    REQUIRE(send_all(fd, std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n"));
    CHECK(status_of(read_until(fd, "\r\n\r\n", std::chrono::seconds(3))) == 200);
    ::close(fd);
  }
  t.release = true;
  for (int fd : busy) {
    CHECK(status_of(read_until(fd, "done", std::chrono::seconds(10))) == 200);
    ::close(fd);
  }
}

TEST_CASE("http server: bodies held at once are bounded", "[http]") {
  HttpServerOptions o = small_options();  // bodies <= 1000 bytes, 4000 held at once
  TestServer t(o);
  // Four clients announce 1000-byte bodies and send none: the fifth is refused with 503 before its body.
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) {
    const int fd = connect_to(t.port);
    REQUIRE(send_all(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"));
    held.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const int fd = connect_to(t.port);
  REQUIRE(send_all(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"));
  CHECK(status_of(read_until(fd, "\r\n\r\n", std::chrono::seconds(5))) == 503);
  ::close(fd);
  for (int h : held) ::close(h);
}

TEST_CASE("short_excerpt keeps a short, printable prefix", "[http]") {
  CHECK(short_excerpt("abc") == "abc");
  CHECK(short_excerpt(std::string(100, 'x'), 10) == std::string(10, 'x') + "...");
  CHECK(short_excerpt("a\nb\x01", 10) == "a?b?");
  CHECK(short_excerpt("\xc3\xa9\xc3\xa9", 3) == "\xc3\xa9...");  // not cut inside a character
}
