// The HTTP(S) server of hypic-openai: OpenAI-compatible endpoints in front of a hypic router (hypic.v1.Router.Generate,
// server streaming). Request parsing and answer shapes live in openai_front/api.h; this file owns the I/O: the
// routes on the event-driven HTTP server (proto/rpc/http_server.h: a few I/O threads, per-connection deadlines, a
// bound on connections and on buffered bodies), bearer-token checks, the gRPC calls to the router, server-sent
// events, client disconnects and the graceful drain.
//
// Where requests run: completions on a worker pool of --http-threads threads (the gRPC calls block; more requests
// wait in order, their connections held); /health on its own small control pool, its router check shared by
// concurrent probes (one check at a time, its result reused for 250 ms), so neither slow clients nor a full worker
// pool delay it; /v1/models and every refusal (401, 404, 405, 411, 413) on the I/O threads, before any body is
// read.
//
// Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id}, GET /health
// (200 when the router answers its gRPC health check as SERVING, 503 otherwise or while draining). Every error is
// OpenAI's {"error": {message, type, param, code}}. With bearer tokens configured every path but /health needs
// `Authorization: Bearer <token>` (401 authentication_error otherwise).
//
// Client disconnects: every Generate call in flight is registered with a ConnectionWatcher, which polls the HTTP
// connection's socket (every 100 ms) for the peer's hang-up and then cancels the gRPC call (ClientContext::TryCancel),
// so the router stops working for a client that left, whether it was waiting for the first token or reading a stream.
// A failed write to the client cancels it too. (A client that half-closes its side after sending the request,
// shutdown(SHUT_WR), counts as gone: OpenAI clients do not.) Requests whose status is recorded as 499 in the metrics
// are those whose client left.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "tokenizer/tokenizer.h"
#include "hypic/v1/router.grpc.pb.h"
#include "openai_front/api.h"
#include "proto/rpc/http_server.h"
#include "proto/rpc/security.h"
#include "proto/rpc/server.h"

namespace hypic::openai {

/// Cancels gRPC calls whose HTTP client went away: a thread polls the registered sockets for POLLRDHUP / POLLHUP /
/// POLLERR every `interval` and calls TryCancel() on the call's context. Thread-safe.
class ConnectionWatcher {
 public:
  explicit ConnectionWatcher(std::chrono::milliseconds interval = std::chrono::milliseconds(100));
  ~ConnectionWatcher();
  ConnectionWatcher(const ConnectionWatcher&) = delete;
  ConnectionWatcher& operator=(const ConnectionWatcher&) = delete;

  /// Starts watching socket `fd` (< 0: nothing is polled, the id is still valid) for the call of `context`, which
  /// must stay alive until unwatch(id) returns. Returns the registration id.
  uint64_t watch(int fd, grpc::ClientContext* context);
  /// Stops watching; after it returns the context is never touched again. Returns true when the watcher had seen the
  /// client hang up (and cancelled the call).
  bool unwatch(uint64_t id);
  /// Cancels every registered call (the end of a drain).
  void cancel_all();

 private:
  struct Entry {
    int fd;
    grpc::ClientContext* context;
    bool gone = false;
  };
  void run();

  std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t next_id_ = 1;
  std::map<uint64_t, Entry> entries_;
  std::thread thread_;
};

/// Configuration of the front (main.cpp fills it from the flags).
struct FrontConfig {
  std::string model_name = "hypic";          ///< the id /v1/models lists and requests must name (or omit)
  std::chrono::milliseconds request_timeout{std::chrono::seconds(600)};  ///< deadline of each Generate call
  size_t max_body_bytes = 16u << 20;         ///< larger request bodies get 413 (before they are read)
  size_t http_threads = 64;                  ///< completion requests handled at once (the worker pool)
  size_t io_threads = 2;                     ///< threads running every connection's I/O
  size_t max_connections = 1024;             ///< open connections (a new one evicts the longest idle)
  size_t max_buffered_bytes = 256u << 20;    ///< request bodies held at once (503 above); >= max_body_bytes
  std::chrono::milliseconds header_timeout{std::chrono::seconds(10)};  ///< a request head within this
  std::chrono::milliseconds body_timeout{std::chrono::seconds(60)};    ///< a body within this after its head
  std::chrono::milliseconds write_timeout{std::chrono::seconds(60)};   ///< each write to a client within this
  rpc::BearerTokens auth;                    ///< accepted client tokens; empty: no authentication
  std::string router_token;                  ///< sent to the router as `authorization: Bearer <token>` ("" none)
  /// Serve HTTPS with these PEM files (cert and key both set); client_ca set: client certificates required.
  std::string tls_cert, tls_key, tls_client_ca;
};

/// The server. Construct, bind(), start(); on shutdown begin_drain(), wait_idle(), cancel_in_flight(), stop().
class OpenAIFront {
 public:
  /// `router`: channel to the router (rpc::make_channel, honouring the process's TLS configuration). Throws
  /// std::runtime_error when the TLS certificate or key is refused.
  OpenAIFront(FrontConfig config, engine::Tokenizer tokenizer, std::shared_ptr<grpc::Channel> router);
  ~OpenAIFront();
  OpenAIFront(const OpenAIFront&) = delete;
  OpenAIFront& operator=(const OpenAIFront&) = delete;

  /// Binds host:port (port 0 picks a free one) and returns the port. Throws std::runtime_error when it cannot bind.
  int bind(const std::string& host, int port);
  /// Starts the I/O threads and the pools; returns once the server accepts connections.
  void start();
  /// Health turns 503 and new completion requests get 503 "shutting down"; calls in flight go on.
  void begin_drain();
  /// Waits until no completion call is in flight or `deadline`; true when idle.
  bool wait_idle(std::chrono::steady_clock::time_point deadline);
  /// Completion calls in flight.
  size_t in_flight() const;
  /// Cancels every call in flight (their clients get an error, a stream its error event).
  void cancel_in_flight();
  /// Stops the server and joins its threads.
  void stop();

 private:
  rpc::HttpRoute route(const rpc::HttpRequest& head);
  void handle_generate(Endpoint endpoint, rpc::HttpRequest& req, rpc::HttpReply& reply);
  void handle_health(rpc::HttpReply& reply);
  void handle_models(const rpc::HttpRequest& req, rpc::HttpReply& reply);
  /// The router's health (rpc::check_health's code, `error` its text), shared by concurrent callers.
  int router_health(std::string* error);

  FrontConfig cfg_;
  engine::Tokenizer tokenizer_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Router::Stub> stub_;
  ConnectionWatcher watcher_;
  rpc::Lifecycle life_{"openai front"};
  std::unique_ptr<rpc::HttpServer> server_;
  int64_t started_at_ = 0;
  std::mutex health_mu_;
  std::condition_variable health_cv_;
  bool health_checking_ = false;
  std::chrono::steady_clock::time_point health_at_{};
  int health_code_ = -1;
  std::string health_error_;
};

}  // namespace hypic::openai
