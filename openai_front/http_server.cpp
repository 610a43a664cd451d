// hypic-openai's HTTP server (openai_front/http_server.h).
#include "openai_front/http_server.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>
#include <ctime>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
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

namespace {
/// Numeric host and port of a socket address, as httplib writes them into Request (getnameinfo, NI_NUMERICHOST).
bool numeric_address(const sockaddr_storage& addr, socklen_t len, std::string& host, int& port) {
  char h[NI_MAXHOST], s[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, h, sizeof h, s, sizeof s,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  host = h;
  port = std::atoi(s);
  return true;
}
}  // namespace

int connection_socket(const httplib::Request& req) {
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
  if (req.ssl) return SSL_get_fd(req.ssl);
#endif
  // httplib does not hand the socket to handlers; find the descriptor whose two ends are the request's.
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  int found = -1;
  while (dirent* ent = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(ent->d_name, &end, 10);
    if (end == ent->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    struct stat st;
    if (fstat(int(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage local{}, peer{};
    socklen_t llen = sizeof local, plen = sizeof peer;
    if (getsockname(int(fd), reinterpret_cast<sockaddr*>(&local), &llen) != 0) continue;
    if (getpeername(int(fd), reinterpret_cast<sockaddr*>(&peer), &plen) != 0) continue;
    std::string lhost, phost;
    int lport = 0, pport = 0;
    if (!numeric_address(local, llen, lhost, lport) || !numeric_address(peer, plen, phost, pport)) continue;
    if (lport == req.local_port && pport == req.remote_port && phost == req.remote_addr &&
        (req.local_addr.empty() || lhost == req.local_addr)) {
      found = int(fd);
      break;
    }
  }
  closedir(dir);
  return found;
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

void reply_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status();
  if (e.status() == 401) res.set_header("WWW-Authenticate", "Bearer");
  if (e.status() == 429 || e.status() == 503) res.set_header("Retry-After", "1");
  res.set_content(dump_json(e.body()), "application/json");
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

/// What a streamed answer carries along between the handler and httplib's content provider.
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
bool write_stream(StreamState& st, httplib::DataSink& sink) {
  const Endpoint ep = st.request.endpoint;
  const bool usage = st.request.include_usage;
  bool first_chunk = true;
  auto send = [&](const std::string& event) {
    if (sink.write(event.data(), event.size())) return true;
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
  sink.done();
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
  if (!cfg_.tls_cert.empty()) {
    auto ssl = std::make_unique<httplib::SSLServer>(cfg_.tls_cert.c_str(), cfg_.tls_key.c_str(),
                                                    cfg_.tls_client_ca.empty() ? nullptr : cfg_.tls_client_ca.c_str());
    if (!ssl->is_valid()) throw std::runtime_error("--tls-cert/--tls-key: the certificate or key was refused");
    server_ = std::move(ssl);
  } else {
    server_ = std::make_unique<httplib::Server>();
  }
  install_routes();
}

OpenAIFront::~OpenAIFront() { stop(); }

void OpenAIFront::install_routes() {
  auto& svr = *server_;
  const size_t threads = cfg_.http_threads;
  svr.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  svr.set_payload_max_length(cfg_.max_body_bytes);

  // No SO_REUSEPORT (httplib's default): a second process on this port must fail to start, not share it.
  svr.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    // Runs before the body is read. httplib bounds a body by Content-Length only, so a chunked one could grow
    // without limit: refused (OpenAI clients send Content-Length).
    if (req.has_header("Transfer-Encoding")) {
      reply_error(res, ApiError(411, "invalid_request_error",
                                "chunked request bodies are not accepted: send Content-Length (at most "
                                "--max-body-bytes)",
                                "", "length_required"));
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.path == "/health" || !cfg_.auth.enabled()) return httplib::Server::HandlerResponse::Unhandled;
    const std::string header = req.get_header_value("Authorization");
    if (cfg_.auth.accepts(header)) return httplib::Server::HandlerResponse::Unhandled;
    reply_error(res, ApiError(401, "authentication_error",
                              header.empty() ? "Missing bearer token: send the header 'Authorization: Bearer <token>'"
                                             : "Incorrect API key provided",
                              "", "invalid_api_key"));
    return httplib::Server::HandlerResponse::Handled;
  });

  svr.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Endpoint::Chat, req, res);
  });
  svr.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Endpoint::Completions, req, res);
  });
  svr.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) { handle_models(req, res); });
  svr.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) { handle_models(req, res); });
  svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) { handle_health(res); });

  // Every error without a body of ours (unknown path, wrong method, a body over the limit, a malformed HTTP
  // request) gets one in OpenAI's shape.
  svr.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const bool known = req.path == "/v1/chat/completions" || req.path == "/v1/completions" ||
                       req.path == "/v1/models" || req.path.rfind("/v1/models/", 0) == 0 || req.path == "/health";
    if (res.status == 404 && known) {
      const bool post = req.path == "/v1/chat/completions" || req.path == "/v1/completions";
      res.status = 405;
      res.set_header("Allow", post ? "POST" : "GET");
      reply_error(res, ApiError(405, "invalid_request_error",
                                fmt::format("{} {} is not allowed (use {})", req.method, req.path, post ? "POST" : "GET"),
                                "", "method_not_allowed"));
    } else if (res.status == 404) {
      reply_error(res, ApiError(404, "invalid_request_error", fmt::format("Invalid URL ({} {})", req.method, req.path),
                                "", "unknown_url"));
    } else if (res.status == 413) {
      reply_error(res, ApiError(413, "invalid_request_error",
                                fmt::format("the request body exceeds the limit of {} bytes (--max-body-bytes)",
                                            cfg_.max_body_bytes),
                                "", "request_too_large"));
    } else if (res.status >= 500) {
      reply_error(res, ApiError(res.status, "server_error", fmt::format("HTTP {}", res.status)));
    } else {
      reply_error(res, ApiError(res.status, "invalid_request_error",
                                fmt::format("malformed HTTP request (HTTP {})", res.status)));
    }
    return httplib::Server::HandlerResponse::Handled;
  }));
  svr.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    spdlog::error("{} {}: internal error: {}", req.method, req.path, what);
    reply_error(res, ApiError(500, "server_error", "internal error: " + what, "", "internal_error"));
  });
}

int OpenAIFront::bind(const std::string& host, int port) {
  const int bound = port == 0 ? server_->bind_to_any_port(host) : (server_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    throw std::runtime_error(fmt::format("--listen: cannot listen on {}:{} (address in use or invalid?)", host, port));
  }
  return bound;
}

void OpenAIFront::start() {
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  while (!server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

void OpenAIFront::begin_drain() { life_.begin_drain(); }

bool OpenAIFront::wait_idle(std::chrono::steady_clock::time_point deadline) { return life_.wait_idle(deadline); }

size_t OpenAIFront::in_flight() const { return life_.active(); }

void OpenAIFront::cancel_in_flight() { watcher_.cancel_all(); }

void OpenAIFront::stop() {
  if (!server_) return;
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void OpenAIFront::handle_health(httplib::Response& res) {
  if (life_.draining()) {
    reply_error(res, ApiError(503, "server_error", "the OpenAI front is shutting down", "", "service_unavailable"));
    return;
  }
  std::string error;
  const int st = rpc::check_health(channel_, "hypic.v1.Router", std::chrono::milliseconds(2000), &error);
  if (st == 1) {
    res.set_content(dump_json(json{{"status", "ok"}, {"router", "SERVING"}}), "application/json");
    return;
  }
  if (st >= 0) error = st == 2 ? "NOT_SERVING" : st == 3 ? "SERVICE_UNKNOWN" : "UNKNOWN";
  reply_error(res, ApiError(503, "server_error", "the router is not serving: " + error, "", "service_unavailable"));
}

void OpenAIFront::handle_models(const httplib::Request& req, httplib::Response& res) {
  const json model{{"id", cfg_.model_name}, {"object", "model"}, {"created", started_at_}, {"owned_by", "hypic"}};
  if (req.matches.size() > 1) {
    if (req.matches[1] != cfg_.model_name) {
      reply_error(res, ApiError(404, "invalid_request_error",
                                fmt::format("The model `{}` does not exist", std::string(req.matches[1])), "model",
                                "model_not_found"));
      return;
    }
    res.set_content(dump_json(model), "application/json");
    return;
  }
  res.set_content(dump_json(json{{"object", "list"}, {"data", json::array({model})}}), "application/json");
}

void OpenAIFront::handle_generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
  const auto arrived = std::chrono::steady_clock::now();
  ParsedRequest parsed;
  try {
    ParseOptions opts;
    opts.model_name = cfg_.model_name;
    parsed = parse_request(endpoint, req.body, tokenizer_, opts);
  } catch (const ApiError& e) {
    reply_error(res, e);
    FrontMetrics::finished(endpoint, e.status(), false, seconds_since(arrived), nullptr);
    return;
  }
  const std::string request_id = parsed.request_id.empty() ? rpc::make_request_id() : parsed.request_id;
  res.set_header("X-Request-Id", request_id);
  const ResponseMeta meta{response_id(endpoint, request_id), int64_t(std::time(nullptr)), cfg_.model_name};

  std::unique_ptr<RouterCall> call;
  try {
    call = std::make_unique<RouterCall>(*stub_, to_generate_request(parsed, request_id), cfg_.request_timeout,
                                        cfg_.router_token, watcher_, connection_socket(req), life_);
  } catch (const rpc::RpcError&) {  // draining
    reply_error(res, ApiError(503, "server_error", "the OpenAI front is shutting down", "", "service_unavailable"));
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
    else spdlog::info("[req {}] {} -> {} {}", request_id, req.path, e.status(), e.what());
    reply_error(res, e);
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
      else spdlog::info("[req {}] {} -> {} {}", request_id, req.path, e.status(), e.what());
      reply_error(res, e);
      FrontMetrics::finished(endpoint, call->client_left() ? 499 : e.status(), false, seconds_since(arrived), nullptr);
      return;
    }
    res.set_content(dump_json(completion_response(endpoint, meta, text, *report, parsed.prompt)), "application/json");
    FrontMetrics::finished(endpoint, 200, false, seconds_since(arrived), &*report);
    spdlog::info("[req {}] {}: {} segments, {} prompt tokens, {} generated ({}), ttft {:.1f} ms, {:.1f} ms in all",
                 request_id, req.path, report->segments_size(), report->prompt_tokens(), report->completion_tokens(),
                 finish_reason_name(report->finish_reason()), report->ttft().total_ms(),
                 seconds_since(arrived) * 1000);
    return;
  }

  // Streaming: from here on the status is 200 and errors travel as an error event before [DONE].
  // httplib would gzip a text/* body for a client accepting it, buffering the events until the end: an event stream
  // must go out as written, so the request's Accept-Encoding is dropped (the Request object is httplib's own,
  // non-const, local to the connection).
  const_cast<httplib::Request&>(req).headers.erase("Accept-Encoding");
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  auto state = std::make_shared<StreamState>();
  state->call = std::move(call);
  state->request = std::move(parsed);
  state->meta = meta;
  state->first = std::move(first);
  state->arrived = arrived;
  state->request_id = request_id;
  res.set_chunked_content_provider(
      "text/event-stream",
      [state](size_t, httplib::DataSink& sink) {
        if (!write_stream(*state, sink)) {
          spdlog::info("[req {}] client disconnected mid-stream: cancelled", state->request_id);
          FrontMetrics::finished(state->request.endpoint, 499, true, seconds_since(state->arrived), nullptr);
          return false;
        }
        return true;
      },
      [state](bool) {
        // Whatever happened (done, client gone, server stopping), the call ends here: a call not finished yet is
        // cancelled by RouterCall's destructor.
        state->call.reset();
      });
}

}  // namespace hypic::openai
