// hypic-openai's HTTP server (openai_front/http_server.h).
#include "openai_front/http_server.h"

#include <poll.h>

#include <cstdlib>
#include <ctime>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "proto/rpc/metrics.h"
#include "proto/rpc/status.h"

namespace hypic::openai {

using nlohmann::json;

// ---- ConnectionWatcher ------------------------------------------------------------------------------------------

ConnectionWatcher::ConnectionWatcher(std::chrono::milliseconds interval)
    : interval_(interval), thread_([this] { run(); }) {}

ConnectionWatcher::~ConnectionWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t ConnectionWatcher::watch(int fd, grpc::ClientContext* context) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  entries_.emplace(id, Entry{fd, context});
  return id;
}

bool ConnectionWatcher::unwatch(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  const bool gone = it->second.gone;
  entries_.erase(it);
  return gone;
}

void ConnectionWatcher::cancel_all() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, e] : entries_) e.context->TryCancel();
}

void ConnectionWatcher::run() {
  std::vector<uint64_t> ids;
  std::vector<pollfd> fds;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, interval_, [&] { return stop_; });
    if (stop_) break;
    ids.clear();
    fds.clear();
    for (const auto& [id, e] : entries_) {
      if (e.fd < 0 || e.gone) continue;
      ids.push_back(id);
      fds.push_back(pollfd{e.fd, POLLRDHUP, 0});
    }
    if (fds.empty()) continue;
    // Poll without the lock; an entry unwatched meanwhile (its socket maybe closed and reused) is skipped below, by
    // id, so a result for a reused descriptor never reaches another call.
    lock.unlock();
    const int n = ::poll(fds.data(), fds.size(), 0);
    lock.lock();
    if (n <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) continue;
      auto it = entries_.find(ids[i]);
      if (it == entries_.end() || it->second.gone) continue;
      it->second.gone = true;
      it->second.context->TryCancel();
    }
  }
}

// ---- metrics ----------------------------------------------------------------------------------------------------
// The one place the front records metrics (the shared registry of proto/rpc/metrics.h, served at --metrics-listen).

namespace {
struct FrontMetrics {
  rpc::Gauge& in_flight;
  static FrontMetrics& get() {
    static FrontMetrics m{rpc::MetricsRegistry::global().gauge(
        "hypic:openai_requests_in_flight", "Completion requests of the OpenAI front waiting for or streaming an answer")};
    return m;
  }
  /// One finished HTTP request to a completion endpoint: its endpoint, HTTP status, whether it streamed, its duration
  /// and, when it succeeded, the router's report.
  static void finished(Endpoint endpoint, int status, bool stream, double seconds, const v1::GenerateReport* report) {
    auto& reg = rpc::MetricsRegistry::global();
    const std::string ep = endpoint == Endpoint::Chat ? "chat" : "completions";
    reg.counter("hypic:openai_requests_total", "Completion requests answered by the OpenAI front",
                {{"endpoint", ep}, {"status", std::to_string(status)}, {"stream", stream ? "true" : "false"}})
        .inc();
    reg.histogram("hypic:openai_request_duration_seconds", "Arrival until the last byte of the answer",
                  rpc::latency_buckets_seconds(), {{"endpoint", ep}})
        .observe(seconds);
    if (report) {
      reg.counter("hypic:openai_prompt_tokens_total", "Prompt tokens of the requests answered", {{"endpoint", ep}})
          .inc(report->prompt_tokens());
      reg.counter("hypic:openai_generation_tokens_total", "Tokens generated for the requests answered",
                  {{"endpoint", ep}})
          .inc(report->completion_tokens());
    }
  }
};
}  // namespace

// ---- one Generate call ------------------------------------------------------------------------------------------

namespace {

/// Bodies at least this large are parsed (and tokenised) on a thread of their own (see handle_generate).
constexpr size_t kFreshThreadBodyBytes = 1 << 20;

/// Longest error message sent (a message quoting client input is cut, so a 2 MB body is never echoed).
constexpr size_t kMaxErrorMessageBytes = 1024;

/// The HTTP response of an error in OpenAI's shape (WWW-Authenticate on 401, Retry-After on 429 and 503).
rpc::HttpResponse error_response(const ApiError& e) {
  rpc::HttpResponse r;
  r.status = e.status();
  if (e.status() == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
  if (e.status() == 429 || e.status() == 503) r.headers.emplace_back("Retry-After", "1");
  r.content_type = "application/json";
  const std::string_view what = e.what();
  r.body = what.size() <= kMaxErrorMessageBytes
               ? dump_json(e.body())
               : dump_json(ApiError(e.status(), e.type(), rpc::short_excerpt(what, kMaxErrorMessageBytes), e.param(),
                                    e.code())
                               .body());
  return r;
}

void reply_error(rpc::HttpReply& reply, const ApiError& e, const std::string& request_id = {}) {
  rpc::HttpResponse r = error_response(e);
  if (!request_id.empty()) r.headers.emplace_back("X-Request-Id", request_id);
  reply.send(std::move(r));
}

rpc::HttpResponse json_response(const json& body, const std::string& request_id = {}) {
  rpc::HttpResponse r;
  r.content_type = "application/json";
  r.body = dump_json(body);
  if (!request_id.empty()) r.headers.emplace_back("X-Request-Id", request_id);
  return r;
}

/// A Generate call to the router: its context (deadline, bearer token), the reader, the registration with the
/// connection watcher and with the drain accounting. Destroying it cancels a call that has not finished.
class RouterCall {
 public:
  RouterCall(v1::Router::Stub& stub, const v1::GenerateRequest& request, std::chrono::milliseconds timeout,
             const std::string& router_token, ConnectionWatcher& watcher, int client_fd, rpc::Lifecycle& life)
      : life_call_(life.enter()), watcher_(watcher) {
    ctx_.set_deadline(std::chrono::system_clock::now() + timeout);
    rpc::add_bearer(ctx_, router_token);
    watch_id_ = watcher_.watch(client_fd, &ctx_);
    reader_ = stub.Generate(&ctx_, request);
    FrontMetrics::get().in_flight.inc();
  }
  ~RouterCall() {
    watcher_.unwatch(watch_id_);
    if (!finished_) {
      ctx_.TryCancel();
      finish();
    }
    FrontMetrics::get().in_flight.dec();
  }
  RouterCall(const RouterCall&) = delete;
  RouterCall& operator=(const RouterCall&) = delete;

  bool read(v1::GenerateResponse* msg) {
    if (finished_ || read_done_) return false;
    if (reader_->Read(msg)) return true;
    read_done_ = true;
    return false;
  }
  /// Reads what is left and finishes the call (once); returns its status.
  const grpc::Status& finish() {
    if (!finished_) {
      v1::GenerateResponse drop;
      while (read(&drop)) {
      }
      status_ = reader_->Finish();
      finished_ = true;
      client_gone_ = watcher_.unwatch(watch_id_) || client_gone_;
    }
    return status_;
  }
  /// The client went away (a failed write): cancel the call.
  void client_gone() {
    client_gone_ = true;
    ctx_.TryCancel();
  }
  bool client_left() const { return client_gone_; }

 private:
  rpc::Lifecycle::Call life_call_;
  ConnectionWatcher& watcher_;
  grpc::ClientContext ctx_;
  uint64_t watch_id_ = 0;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  bool read_done_ = false;
  bool finished_ = false;
  bool client_gone_ = false;
  grpc::Status status_;
};

/// What a streamed answer carries along.
struct StreamState {
  std::unique_ptr<RouterCall> call;
  ParsedRequest request;
  ResponseMeta meta;
  v1::GenerateResponse first;
  std::chrono::steady_clock::time_point arrived;
  std::string request_id;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

/// Writes the whole event stream of a call (the first event already read). Returns false when the client went away.
bool write_stream(StreamState& st, rpc::HttpReply& reply) {
  const Endpoint ep = st.request.endpoint;
  const bool usage = st.request.include_usage;
  bool first_chunk = true;
  auto send = [&](const std::string& event) {
    if (reply.write(event)) return true;
    st.call->client_gone();
    return false;
  };
  // Chat streams open with the assistant role (OpenAI's first chunk: delta {role, content ""}).
  if (ep == Endpoint::Chat) {
    if (!send(sse_event(stream_text_chunk(ep, st.meta, "", true, usage)))) return false;
    first_chunk = false;
  }
  std::optional<v1::GenerateReport> report;
  v1::GenerateResponse msg = std::move(st.first);
  bool have = true;
  while (have) {
    if (msg.has_delta() && !msg.delta().text().empty()) {
      if (!send(sse_event(stream_text_chunk(ep, st.meta, msg.delta().text(), first_chunk, usage)))) return false;
      first_chunk = false;
    } else if (msg.has_report()) {
      report = msg.report();
    }
    have = st.call->read(&msg);
  }
  const grpc::Status& status = st.call->finish();
  int http_status = 200;
  if (status.ok() && report) {
    if (!send(sse_event(stream_finish_chunk(ep, st.meta, *report, st.request.prompt, usage)))) return false;
    if (usage && !send(sse_event(stream_usage_chunk(ep, st.meta, *report, st.request.prompt)))) return false;
  } else {
    const ApiError e = status.ok() ? ApiError(502, "server_error", "the router ended the stream without a report", "",
                                              "bad_gateway")
                                   : map_grpc_status(status, st.request);
    http_status = e.status();
    spdlog::info("[req {}] stream ended with an error: {} {}", st.request_id, e.status(), e.what());
    if (!send(sse_event(e.body()))) return false;
  }
  if (!send("data: [DONE]\n\n")) return false;
  reply.end_stream();
  FrontMetrics::finished(ep, http_status, true, seconds_since(st.arrived), report ? &*report : nullptr);
  if (report) {
    spdlog::info("[req {}] streamed: {} segments, {} prompt tokens, {} generated ({}), ttft {:.1f} ms, {:.1f} ms in all",
                 st.request_id, report->segments_size(), report->prompt_tokens(), report->completion_tokens(),
                 finish_reason_name(report->finish_reason()), report->ttft().total_ms(),
                 seconds_since(st.arrived) * 1000);
  }
  return true;
}

}  // namespace

// ---- the server -------------------------------------------------------------------------------------------------

OpenAIFront::OpenAIFront(FrontConfig config, engine::Tokenizer tokenizer, std::shared_ptr<grpc::Channel> router)
    : cfg_(std::move(config)), tokenizer_(std::move(tokenizer)), channel_(std::move(router)),
      stub_(v1::Router::NewStub(channel_)), started_at_(int64_t(std::time(nullptr))) {
  rpc::HttpServerOptions opt;
  opt.name = "openai";
  opt.io_threads = cfg_.io_threads;
  opt.worker_threads = cfg_.http_threads;
  opt.control_threads = 2;
  opt.max_connections = cfg_.max_connections;
  opt.max_body_bytes = cfg_.max_body_bytes;
  opt.max_buffered_bytes = std::max(cfg_.max_buffered_bytes, cfg_.max_body_bytes);
  opt.header_timeout = cfg_.header_timeout;
  opt.body_timeout = cfg_.body_timeout;
  opt.write_timeout = cfg_.write_timeout;
  opt.tls_cert = cfg_.tls_cert;
  opt.tls_key = cfg_.tls_key;
  opt.tls_client_ca = cfg_.tls_client_ca;
  const size_t max_body = cfg_.max_body_bytes;
  // The server's own refusals (malformed requests, limits, timeouts) in OpenAI's shape.
  auto errors = [max_body](int status, const std::string& message) {
    if (status == 413) {
      return error_response(ApiError(
          413, "invalid_request_error",
          fmt::format("the request body exceeds the limit of {} bytes (--max-body-bytes)", max_body), "",
          "request_too_large"));
    }
    if (status == 411) {
      return error_response(ApiError(411, "invalid_request_error",
                                     "chunked request bodies are not accepted: send Content-Length (at most "
                                     "--max-body-bytes)",
                                     "", "length_required"));
    }
    if (status == 503) return error_response(ApiError(503, "server_error", message, "", "service_unavailable"));
    if (status >= 500) return error_response(ApiError(status, "server_error", message, "", "internal_error"));
    return error_response(ApiError(status, "invalid_request_error", message));
  };
  try {
    server_ = std::make_unique<rpc::HttpServer>(std::move(opt), [this](const rpc::HttpRequest& head) {
      return route(head);
    }, errors);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("--tls-cert/--tls-key: {}", e.what()));
  }
}

OpenAIFront::~OpenAIFront() { stop(); }

rpc::HttpRoute OpenAIFront::route(const rpc::HttpRequest& req) {
  rpc::HttpRoute r;
  // Refusals are answered at once, before the body is read.
  auto refuse = [&](ApiError e, std::vector<std::pair<std::string, std::string>> headers = {}) {
    r.lane = rpc::Lane::Inline;
    r.needs_body = false;
    r.handler = [e = std::move(e), headers = std::move(headers)](rpc::HttpRequest&, rpc::HttpReply& reply) {
      rpc::HttpResponse res = error_response(e);
      for (auto& h : headers) res.headers.push_back(h);
      reply.send(std::move(res));
    };
    return r;
  };
  // A chunked body could grow without a bound known in advance: refused (OpenAI clients send Content-Length).
  if (req.has_header("Transfer-Encoding")) {
    return refuse(ApiError(411, "invalid_request_error",
                           "chunked request bodies are not accepted: send Content-Length (at most --max-body-bytes)",
                           "", "length_required"));
  }
  if (req.path != "/health" && cfg_.auth.enabled()) {
    const std::string header = req.header("Authorization");
    if (!cfg_.auth.accepts(header)) {
      return refuse(ApiError(401, "authentication_error",
                             header.empty() ? "Missing bearer token: send the header 'Authorization: Bearer <token>'"
                                            : "Incorrect API key provided",
                             "", "invalid_api_key"));
    }
  }
  const bool post_path = req.path == "/v1/chat/completions" || req.path == "/v1/completions";
  const bool get_path = req.path == "/v1/models" || req.path.rfind("/v1/models/", 0) == 0 || req.path == "/health";
  if (post_path && req.method == "POST") {
    const Endpoint ep = req.path == "/v1/chat/completions" ? Endpoint::Chat : Endpoint::Completions;
    r.lane = rpc::Lane::Worker;
    r.handler = [this, ep](rpc::HttpRequest& q, rpc::HttpReply& reply) { handle_generate(ep, q, reply); };
    return r;
  }
  if (get_path && req.method == "GET" && !(req.path == "/v1/models/")) {
    if (req.path == "/health") {
      r.lane = rpc::Lane::Control;
      r.handler = [this](rpc::HttpRequest&, rpc::HttpReply& reply) { handle_health(reply); };
    } else {
      r.lane = rpc::Lane::Inline;
      r.handler = [this](rpc::HttpRequest& q, rpc::HttpReply& reply) { handle_models(q, reply); };
    }
    return r;
  }
  const std::string method = rpc::short_excerpt(req.method, 16), path = rpc::short_excerpt(req.path, 128);
  if (post_path || get_path) {
    const char* allow = post_path ? "POST" : "GET";
    return refuse(ApiError(405, "invalid_request_error",
                           fmt::format("{} {} is not allowed (use {})", method, path, allow), "", "method_not_allowed"),
                  {{"Allow", allow}});
  }
  return refuse(ApiError(404, "invalid_request_error", fmt::format("Invalid URL ({} {})", method, path), "",
                         "unknown_url"));
}

int OpenAIFront::bind(const std::string& host, int port) {
  try {
    return server_->bind(host, port);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("--listen: cannot listen on {}:{} (address in use or invalid?): {}", host,
                                         port, e.what()));
  }
}

void OpenAIFront::start() { server_->start(); }

void OpenAIFront::begin_drain() { life_.begin_drain(); }

bool OpenAIFront::wait_idle(std::chrono::steady_clock::time_point deadline) { return life_.wait_idle(deadline); }

size_t OpenAIFront::in_flight() const { return life_.active(); }

void OpenAIFront::cancel_in_flight() { watcher_.cancel_all(); }

void OpenAIFront::stop() {
  if (server_) server_->stop();
}

int OpenAIFront::router_health(std::string* error) {
  std::unique_lock<std::mutex> lock(health_mu_);
  const auto fresh = [&] {
    return health_at_ != std::chrono::steady_clock::time_point{} &&
           std::chrono::steady_clock::now() - health_at_ < std::chrono::milliseconds(250);
  };
  if (!fresh()) {
    if (health_checking_) {
      health_cv_.wait(lock, [&] { return !health_checking_; });
    } else {
      health_checking_ = true;
      lock.unlock();
      std::string err;
      int code = -1;
      try {
        code = rpc::check_health(channel_, "hypic.v1.Router", std::chrono::milliseconds(2000), &err);
      } catch (const std::exception& e) {
        err = e.what();
      }
      lock.lock();
      health_code_ = code;
      health_error_ = err;
      health_at_ = std::chrono::steady_clock::now();
      health_checking_ = false;
      health_cv_.notify_all();
    }
  }
  *error = health_error_;
  return health_code_;
}

void OpenAIFront::handle_health(rpc::HttpReply& reply) {
  if (life_.draining()) {
    reply_error(reply, ApiError(503, "server_error", "the OpenAI front is shutting down", "", "service_unavailable"));
    return;
  }
  std::string error;
  const int st = router_health(&error);
  if (life_.draining()) {
    reply_error(reply, ApiError(503, "server_error", "the OpenAI front is shutting down", "", "service_unavailable"));
    return;
  }
  if (st == 1) {
    reply.send(json_response(json{{"status", "ok"}, {"router", "SERVING"}}));
    return;
  }
  if (st >= 0) error = st == 2 ? "NOT_SERVING" : st == 3 ? "SERVICE_UNKNOWN" : "UNKNOWN";
  reply_error(reply, ApiError(503, "server_error", "the router is not serving: " + error, "", "service_unavailable"));
}

void OpenAIFront::handle_models(const rpc::HttpRequest& req, rpc::HttpReply& reply) {
  const json model{{"id", cfg_.model_name}, {"object", "model"}, {"created", started_at_}, {"owned_by", "hypic"}};
  const std::string prefix = "/v1/models/";
  if (req.path.rfind(prefix, 0) == 0) {
    const std::string id = req.path.substr(prefix.size());
    if (id != cfg_.model_name) {
      reply_error(reply, ApiError(404, "invalid_request_error",
                                  fmt::format("The model `{}` does not exist", rpc::short_excerpt(id, 128)), "model",
                                  "model_not_found"));
      return;
    }
    reply.send(json_response(model));
    return;
  }
  reply.send(json_response(json{{"object", "list"}, {"data", json::array({model})}}));
}

void OpenAIFront::handle_generate(Endpoint endpoint, rpc::HttpRequest& req, rpc::HttpReply& reply) {
  const auto arrived = std::chrono::steady_clock::now();
  ParsedRequest parsed;
  try {
    ParseOptions opts;
    opts.model_name = cfg_.model_name;
    if (req.body.size() < kFreshThreadBodyBytes) {
      parsed = parse_request(endpoint, req.body, tokenizer_, opts);
    } else {
      // The tokenizer keeps per-thread working buffers (tokenizer/tokenizer.cpp) as large as the largest text the
      // thread has tokenised: parsed on a worker, a 15 MiB body would leave ~120 MB on each of the --http-threads
      // workers. A large body is parsed on a thread of its own, whose buffers are freed when it ends.
      std::exception_ptr error;
      std::thread([&] {
        try {
          parsed = parse_request(endpoint, req.body, tokenizer_, opts);
        } catch (...) {
          error = std::current_exception();
        }
      }).join();
      if (error) std::rethrow_exception(error);
    }
  } catch (const ApiError& e) {
    reply_error(reply, e);
    FrontMetrics::finished(endpoint, e.status(), false, seconds_since(arrived), nullptr);
    return;
  }
  // The body is not needed past parsing: free it now (a 15 MiB body would otherwise live as long as a stream).
  std::string().swap(req.body);
  const std::string request_id = parsed.request_id.empty() ? rpc::make_request_id() : parsed.request_id;
  const ResponseMeta meta{response_id(endpoint, request_id), int64_t(std::time(nullptr)), cfg_.model_name};

  std::unique_ptr<RouterCall> call;
  try {
    call = std::make_unique<RouterCall>(*stub_, to_generate_request(parsed, request_id), cfg_.request_timeout,
                                        cfg_.router_token, watcher_, req.socket_fd, life_);
  } catch (const rpc::RpcError&) {  // draining
    reply_error(reply, ApiError(503, "server_error", "the OpenAI front is shutting down", "", "service_unavailable"),
                request_id);
    FrontMetrics::finished(endpoint, 503, parsed.stream, seconds_since(arrived), nullptr);
    return;
  }

  // Read up to the first event: errors found before any token (bad fields, admission limits) get their own HTTP
  // status, also for streams.
  v1::GenerateResponse first;
  if (!call->read(&first)) {
    const grpc::Status status = call->finish();
    const ApiError e = status.ok() ? ApiError(502, "server_error", "the router answered nothing", "", "bad_gateway")
                                   : map_grpc_status(status, parsed);
    if (call->client_left()) spdlog::info("[req {}] client disconnected before the first token: cancelled", request_id);
    else spdlog::info("[req {}] {} -> {} {}", request_id, req.path, e.status(), rpc::short_excerpt(e.what(), 300));
    reply_error(reply, e, request_id);
    FrontMetrics::finished(endpoint, call->client_left() ? 499 : e.status(), parsed.stream, seconds_since(arrived),
                           nullptr);
    return;
  }

  if (!parsed.stream) {
    std::string text;
    std::optional<v1::GenerateReport> report;
    v1::GenerateResponse msg = std::move(first);
    do {
      if (msg.has_delta()) text += msg.delta().text();
      else if (msg.has_report()) report = msg.report();
    } while (call->read(&msg));
    const grpc::Status status = call->finish();
    if (!status.ok() || !report) {
      const ApiError e = status.ok() ? ApiError(502, "server_error", "the router sent no report", "", "bad_gateway")
                                     : map_grpc_status(status, parsed);
      if (call->client_left()) spdlog::info("[req {}] client disconnected: cancelled", request_id);
      else spdlog::info("[req {}] {} -> {} {}", request_id, req.path, e.status(), rpc::short_excerpt(e.what(), 300));
      reply_error(reply, e, request_id);
      FrontMetrics::finished(endpoint, call->client_left() ? 499 : e.status(), false, seconds_since(arrived), nullptr);
      return;
    }
    reply.send(json_response(completion_response(endpoint, meta, text, *report, parsed.prompt), request_id));
    FrontMetrics::finished(endpoint, 200, false, seconds_since(arrived), &*report);
    spdlog::info("[req {}] {}: {} segments, {} prompt tokens, {} generated ({}), ttft {:.1f} ms, {:.1f} ms in all",
                 request_id, req.path, report->segments_size(), report->prompt_tokens(), report->completion_tokens(),
                 finish_reason_name(report->finish_reason()), report->ttft().total_ms(),
                 seconds_since(arrived) * 1000);
    return;
  }

  // Streaming: from here on the status is 200 and errors travel as an error event before [DONE]. Each event is
  // written as it comes (no compression, no buffering); a failed or timed-out write cancels the call.
  StreamState st;
  st.call = std::move(call);
  st.request = std::move(parsed);
  st.meta = meta;
  st.first = std::move(first);
  st.arrived = arrived;
  st.request_id = request_id;
  const bool opened = reply.begin_stream(
      200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}, {"X-Request-Id", request_id}});
  if (!opened) st.call->client_gone();
  if (!opened || !write_stream(st, reply)) {
    spdlog::info("[req {}] client disconnected mid-stream: cancelled", st.request_id);
    FrontMetrics::finished(st.request.endpoint, 499, true, seconds_since(st.arrived), nullptr);
  }
  // Whatever happened, the call ends here: a call not finished yet is cancelled by RouterCall's destructor.
  st.call.reset();
}

}  // namespace hypic::openai
