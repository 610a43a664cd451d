// An event-driven HTTP/1.1 server (Boost.Beast on Boost.Asio) for the endpoints hypic serves over HTTP(S): the
// OpenAI-compatible front (openai_front/http_server.h) and every service's /metrics (proto/rpc/metrics.h).
//
// Built to hold under hostile clients:
//  - a fixed number of I/O threads run every connection (no thread per connection); handlers that block (a gRPC
//    call) run on a bounded worker pool (Lane::Worker) or a small control pool (Lane::Control, e.g. /health), never
//    on an I/O thread, so one slow lane cannot delay another;
//  - each request's head must arrive within header_timeout (counted from the moment the server starts waiting for
//    it, so an idle keep-alive connection is closed after it too) and its body within body_timeout; each write must
//    complete within write_timeout. A slow-loris client is closed when its deadline passes;
//  - at most max_connections connections are open: a new one evicts the connection that has waited longest for a
//    request head (an idle or slow client); when every connection is busy with a request it gets 503 and is closed;
//  - heads are limited to max_header_bytes (431 above); a Content-Length over max_body_bytes gets 413 before one
//    byte of the body is read; bodies held at once (read or being handled) are limited to max_buffered_bytes across
//    connections (503 with Retry-After above, before the body is read); chunked request bodies get 411;
//  - a duplicate or conflicting Content-Length, or any malformed request, gets 400 and the connection is closed;
//    error messages never quote more than a short prefix of what the client sent (short_excerpt);
//  - pipelined requests on a keep-alive connection are answered one after the other, in order;
//  - after a body of at least trim_after_bytes is freed the heap is trimmed (malloc_trim), so a burst of large
//    requests does not leave the process's resident memory high (see also bound_heap_retention).
#pragma once
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hypic::rpc {

/// Header fields as received or to send, in order (names as written; compare case-insensitively).
using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

/// One request. Handlers get it complete (head and body).
struct HttpRequest {
  std::string method;   ///< "GET", "POST", ...
  std::string target;   ///< as sent: path and query
  std::string path;     ///< target up to '?'
  int version = 11;     ///< 10 = HTTP/1.0, 11 = HTTP/1.1
  HttpHeaders headers;
  std::string body;
  /// The connection's socket descriptor (to poll for the client hanging up while the request is handled); valid
  /// while the handler runs.
  int socket_fd = -1;

  /// The first field named `name` (case-insensitive), "" when absent.
  std::string header(std::string_view name) const;
  bool has_header(std::string_view name) const;
};

/// A whole response. Content-Length is set by the server.
struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain";
  std::string body;
  HttpHeaders headers;  ///< extra fields (not Content-Length / Transfer-Encoding / Connection)
  bool close = false;   ///< close the connection after it
};

/// How a handler answers. Exactly one of send() or begin_stream()...end_stream() per request; thread-safe (the
/// calls are carried to the connection's I/O strand). A handler that returns without answering gets a 500.
class HttpReply {
 public:
  virtual ~HttpReply() = default;
  /// Queues the whole response; does not wait for it to be written.
  virtual void send(HttpResponse response) = 0;
  /// Writes the head of a streamed response (HTTP/1.1: chunked; HTTP/1.0: the connection closes at its end) and
  /// waits until it is written. Returns false when the client is gone or the write timed out. Only from a pool lane
  /// (Lane::Worker / Lane::Control): it blocks.
  virtual bool begin_stream(int status, std::string content_type, HttpHeaders headers) = 0;
  /// Writes `data` as the next piece of the stream and waits until it is written (at most write_timeout). Returns
  /// false when the client is gone, the write timed out or the server stops.
  virtual bool write(std::string_view data) = 0;
  /// Ends the stream (the last chunk) without waiting.
  virtual void end_stream() = 0;
};

using HttpHandler = std::function<void(HttpRequest& request, HttpReply& reply)>;

/// Where a handler runs.
enum class Lane {
  Inline,   ///< on the I/O thread: must not block (and may only send()); /metrics, /v1/models, errors
  Control,  ///< the control pool (control_threads): short blocking work that must not queue behind Worker, /health
  Worker,   ///< the worker pool (worker_threads): long blocking work, e.g. a generation
};

/// What to do with a request whose head has been read.
struct HttpRoute {
  Lane lane = Lane::Inline;
  HttpHandler handler;
  /// false: answer without reading the body (a refusal: 401, 404, ...); the connection closes after the answer
  /// when a body was announced.
  bool needs_body = true;
};

/// Picks the route of a request from its head (the body is empty then). Runs on an I/O thread: must not block.
using HttpDispatcher = std::function<HttpRoute(const HttpRequest& head)>;
/// Formats the server's own errors (400, 408, 411, 413, 431, 500, 503) in the caller's shape. `message` is safe to
/// show (it quotes at most a short excerpt of client input).
using HttpErrorFormatter = std::function<HttpResponse(int status, const std::string& message)>;

struct HttpServerOptions {
  std::string name = "http";                       ///< in log lines and thread names
  size_t io_threads = 2;                           ///< threads running every connection's I/O
  size_t worker_threads = 16;                      ///< Lane::Worker handlers at once (more wait in order)
  size_t control_threads = 2;                      ///< Lane::Control handlers at once
  size_t max_connections = 1024;                   ///< open connections (see the file comment)
  size_t max_header_bytes = 16 << 10;              ///< request line + header fields; 431 above
  size_t max_body_bytes = 1 << 20;                 ///< Content-Length above: 413 before reading
  size_t max_buffered_bytes = 256u << 20;          ///< bodies held at once, all connections; 503 above
  size_t trim_after_bytes = 1 << 20;               ///< malloc_trim after freeing a body this large (0: never)
  std::chrono::milliseconds header_timeout{10000}; ///< a request head (or the TLS handshake) within this
  std::chrono::milliseconds body_timeout{60000};   ///< a body within this (from the end of its head)
  std::chrono::milliseconds write_timeout{60000};  ///< each write (a response, a stream piece) within this
  /// HTTPS with these PEM files (both set); tls_client_ca set: a client certificate signed by it is required.
  std::string tls_cert, tls_key, tls_client_ca;
};

/// The server. Construct (validates TLS material), bind(), start(); stop() (or the destructor) closes every
/// connection and joins every thread. Thread-safe.
class HttpServer {
 public:
  /// Throws std::runtime_error when the TLS certificate, key or CA file is refused, std::invalid_argument for a
  /// zero thread count or connection bound.
  HttpServer(HttpServerOptions options, HttpDispatcher dispatcher, HttpErrorFormatter errors);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  /// Binds host:port (port 0 picks a free one; no SO_REUSEPORT: a port in use is an error) and returns the port.
  /// Throws std::runtime_error when it cannot bind.
  int bind(const std::string& host, int port);
  /// Starts the I/O threads and the pools and accepts connections; returns at once.
  void start();
  /// Closes the listener and every connection, waits for running handlers to return, joins every thread.
  void stop();
  /// Open connections (for tests and metrics).
  size_t connections() const;

  struct Impl;  ///< internal (http_server.cpp)

 private:
  std::unique_ptr<Impl> impl_;
};

/// `text` cut to at most `max_bytes` (at a UTF-8 character boundary) with "..." appended when cut, and control
/// characters shown as '?': safe to quote client input in an error message or a log line.
std::string short_excerpt(std::string_view text, size_t max_bytes = 64);

/// Keeps glibc's heap from holding on to memory freed after large requests: fixes the mmap threshold at 256 KiB (no
/// dynamic raise, so every large buffer is mmapped and returned to the system when freed) and caps the malloc arenas
/// at `max_arenas`. Call once at the start of main(), before threads start. No effect on other C libraries.
void bound_heap_retention(int max_arenas = 4);

}  // namespace hypic::rpc
