// The event-driven HTTP server (proto/rpc/http_server.h) on Boost.Beast / Boost.Asio.
#include "proto/rpc/http_server.h"

#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace hypic::rpc {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

// ---- small helpers ----------------------------------------------------------------------------------------------

namespace {
bool iequals(std::string_view a, std::string_view b) {
  return beast::iequals(beast::string_view(a.data(), a.size()), beast::string_view(b.data(), b.size()));
}
}  // namespace

std::string HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (iequals(k, name)) return v;
  }
  return {};
}

bool HttpRequest::has_header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (iequals(k, name)) return true;
  }
  return false;
}

std::string short_excerpt(std::string_view text, size_t max_bytes) {
  std::string out;
  size_t n = std::min(text.size(), max_bytes);
  // Back up to a UTF-8 character boundary (not inside a continuation byte).
  if (n < text.size()) {
    while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  }
  out.reserve(n + 3);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    out += (c < 0x20 || c == 0x7F) ? '?' : char(c);
  }
  if (n < text.size()) out += "...";
  return out;
}

void bound_heap_retention(int max_arenas) {
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  if (max_arenas > 0) mallopt(M_ARENA_MAX, max_arenas);
}

namespace {

/// A fixed set of threads running tasks in arrival order.
class Pool {
 public:
  Pool(size_t threads, const std::string& name) {
    for (size_t i = 0; i < threads; ++i) {
      threads_.emplace_back([this, name, i] {
        const std::string n = fmt::format("{}-{}", name, i).substr(0, 15);
        pthread_setname_np(pthread_self(), n.c_str());
        run();
      });
    }
  }
  ~Pool() { stop(); }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  /// Runs what is queued, then joins.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      try {
        task();
      } catch (const std::exception& e) {
        spdlog::error("http handler: {}", e.what());
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

const char* reason_text(int status) {
  return http::obsolete_reason(static_cast<http::status>(status)).data();
}

}  // namespace

// ---- the server's shared state ----------------------------------------------------------------------------------

class SessionBase;

struct HttpServer::Impl {
  // Declared so that the io_context (and the connections its pending handlers hold) goes first, while the options,
  // the budget and the TLS context the connections use are still alive.
  HttpServerOptions opt;
  HttpDispatcher dispatch;
  HttpErrorFormatter errors;
  std::optional<net::ssl::context> ssl;
  std::atomic<size_t> buffered{0};
  std::atomic<bool> stopping{false};
  bool started = false;
  mutable std::mutex mu;
  std::map<SessionBase*, std::weak_ptr<SessionBase>> sessions;
  std::unique_ptr<Pool> workers, control;
  std::vector<std::thread> io_threads;
  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  tcp::acceptor acceptor{ioc};

  Impl(HttpServerOptions o, HttpDispatcher d, HttpErrorFormatter e)
      : opt(std::move(o)), dispatch(std::move(d)), errors(std::move(e)) {}

  HttpResponse error(int status, const std::string& message) const {
    HttpResponse r = errors ? errors(status, message) : HttpResponse{status, "text/plain", message + "\n", {}, false};
    r.status = status;
    return r;
  }
  /// Reserves `n` bytes of the buffered-bytes budget; false when it would pass max_buffered_bytes.
  bool reserve(size_t n) {
    size_t cur = buffered.load();
    do {
      if (cur + n > opt.max_buffered_bytes) return false;
    } while (!buffered.compare_exchange_weak(cur, cur + n));
    return true;
  }
  void release(size_t n) { buffered.fetch_sub(n); }

  void do_accept();
  void on_accept(tcp::socket socket);
};

// ---- one connection ---------------------------------------------------------------------------------------------

class SessionBase : public std::enable_shared_from_this<SessionBase> {
 public:
  virtual ~SessionBase() = default;
  virtual void start(bool reject) = 0;
  /// Closes the connection (from any thread).
  virtual void close() = 0;
  /// When the connection began waiting for a request head; 0 while a request is being read or handled.
  std::atomic<int64_t> waiting_since{0};
};

namespace {

int64_t now_ns() { return std::chrono::steady_clock::now().time_since_epoch().count(); }

/// The body of a request in flight and its share of the buffered-bytes budget; freeing it trims the heap after a
/// large body.
struct Exchange {
  HttpRequest req;
  HttpServer::Impl* srv = nullptr;
  size_t reserved = 0;
  ~Exchange() {
    const size_t big = std::max(reserved, req.body.capacity());
    std::string().swap(req.body);
    if (reserved) srv->release(reserved);
    if (srv->opt.trim_after_bytes && big >= srv->opt.trim_after_bytes) malloc_trim(0);
  }
};

template <class Stream>
class Session : public SessionBase {
 public:
  Session(HttpServer::Impl* srv, Stream stream)
      : srv_(srv), stream_(std::move(stream)), buffer_(srv_->opt.max_header_bytes + (64 << 10)) {}

  void start(bool reject) override {
    auto self = shared_from_this();
    net::dispatch(stream_.get_executor(), [this, self, reject] {
      fd_ = beast::get_lowest_layer(stream_).socket().native_handle();
      if constexpr (kTls) {
        waiting_since = now_ns();
        beast::get_lowest_layer(stream_).expires_after(srv_->opt.header_timeout);
        stream_.async_handshake(net::ssl::stream_base::server, [this, self, reject](beast::error_code ec) {
          if (ec) return hard_close();
          begin(reject);
        });
      } else {
        begin(reject);
      }
    });
  }

  void close() override {
    auto self = shared_from_this();
    net::post(stream_.get_executor(), [this, self] { hard_close(); });
  }

  // ---- replies from handlers (any thread) ----
  void reply_send(HttpResponse r, std::shared_ptr<Exchange> ex) {
    auto self = shared_from_this();
    net::post(stream_.get_executor(), [this, self, r = std::move(r), ex = std::move(ex)]() mutable {
      write_response(std::move(r), std::move(ex));
    });
  }
  bool reply_begin_stream(int status, std::string content_type, HttpHeaders headers, bool http10) {
    auto done = std::make_shared<std::promise<bool>>();
    auto fut = done->get_future();
    auto self = shared_from_this();
    net::post(stream_.get_executor(), [this, self, done, status, ct = std::move(content_type),
                                       headers = std::move(headers), http10]() mutable {
      if (closed_) return done->set_value(false);
      stream_res_ = std::make_unique<http::response<http::empty_body>>(static_cast<http::status>(status),
                                                                         http10 ? 10 : 11);
      auto& res = *stream_res_;
      res.set(http::field::content_type, ct);
      for (auto& [k, v] : headers) res.insert(k, v);
      if (http10) {
        res.keep_alive(false);
        keep_alive_ = false;
      } else {
        res.chunked(true);
        res.keep_alive(keep_alive_);
      }
      stream_chunked_ = !http10;
      stream_sr_ = std::make_unique<http::response_serializer<http::empty_body>>(res);
      beast::get_lowest_layer(stream_).expires_after(srv_->opt.write_timeout);
      http::async_write_header(stream_, *stream_sr_, [this, self, done](beast::error_code ec, size_t) {
        beast::get_lowest_layer(stream_).expires_never();
        if (ec) hard_close();
        done->set_value(!ec);
      });
    });
    return wait(fut);
  }
  bool reply_write(std::string_view data) {
    if (data.empty()) return true;
    auto done = std::make_shared<std::promise<bool>>();
    auto fut = done->get_future();
    auto buf = std::make_shared<std::string>(data);
    auto self = shared_from_this();
    net::post(stream_.get_executor(), [this, self, done, buf] {
      if (closed_) return done->set_value(false);
      beast::get_lowest_layer(stream_).expires_after(srv_->opt.write_timeout);
      auto on_done = [this, self, done, buf](beast::error_code ec, size_t) {
        beast::get_lowest_layer(stream_).expires_never();
        if (ec) hard_close();
        done->set_value(!ec);
      };
      if (stream_chunked_) net::async_write(stream_, http::make_chunk(net::buffer(*buf)), std::move(on_done));
      else net::async_write(stream_, net::buffer(*buf), std::move(on_done));
    });
    return wait(fut);
  }
  void reply_end_stream(std::shared_ptr<Exchange> ex, bool force_close) {
    auto self = shared_from_this();
    net::post(stream_.get_executor(), [this, self, ex = std::move(ex), force_close]() mutable {
      if (closed_) return;
      if (force_close) keep_alive_ = false;
      if (!stream_chunked_) return finish_exchange(std::move(ex), false);
      beast::get_lowest_layer(stream_).expires_after(srv_->opt.write_timeout);
      net::async_write(stream_, http::make_chunk_last(),
                       [this, self, ex = std::move(ex)](beast::error_code ec, size_t) mutable {
                         if (ec) return hard_close();
                         finish_exchange(std::move(ex), keep_alive_);
                       });
    });
  }

 private:
  static constexpr bool kTls = !std::is_same_v<Stream, beast::tcp_stream>;

  static bool wait(std::future<bool>& fut) {
    try {
      return fut.get();
    } catch (const std::future_error&) {  // the I/O threads stopped with the write queued
      return false;
    }
  }

  void begin(bool reject) {
    if (reject) {
      keep_alive_ = false;
      return write_response(srv_->error(503, "too many connections: try again later"), nullptr);
    }
    do_read();
  }

  void do_read() {
    if (closed_ || srv_->stopping) return hard_close();
    parser_.emplace();
    parser_->header_limit(uint32_t(srv_->opt.max_header_bytes));
    parser_->body_limit(srv_->opt.max_body_bytes);
    waiting_since = now_ns();
    beast::get_lowest_layer(stream_).expires_after(srv_->opt.header_timeout);
    auto self = shared_from_this();
    http::async_read_header(stream_, buffer_, *parser_, [this, self](beast::error_code ec, size_t) {
      waiting_since = 0;
      on_header(ec);
    });
  }

  /// A read error: the client closed, timed out, or sent something malformed.
  void read_failed(beast::error_code ec, bool in_body) {
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset ||
        ec == net::error::operation_aborted || ec == net::ssl::error::stream_truncated) {
      return hard_close();
    }
    keep_alive_ = false;
    if (ec == beast::error::timeout) {
      // A client that sent nothing on an idle connection is just closed; one stuck mid-request hears why.
      if (!in_body && buffer_.size() == 0) return hard_close();
      return write_response(srv_->error(408, in_body ? "the request body did not arrive in time"
                                                     : "the request head did not arrive in time"),
                            nullptr, /*after_timeout=*/true);
    }
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
      return write_response(srv_->error(431, fmt::format("the request head exceeds {} bytes",
                                                         srv_->opt.max_header_bytes)),
                            nullptr);
    }
    if (ec == http::error::body_limit) {
      return write_response(srv_->error(413, fmt::format("the request body exceeds the limit of {} bytes",
                                                         srv_->opt.max_body_bytes)),
                            nullptr);
    }
    if (ec == http::error::bad_content_length) {
      return write_response(srv_->error(400, "malformed HTTP request: conflicting or invalid Content-Length"),
                            nullptr);
    }
    write_response(srv_->error(400, "malformed HTTP request (" + short_excerpt(ec.message(), 80) + ")"), nullptr);
  }

  void on_header(beast::error_code ec) {
    if (ec) return read_failed(ec, false);
    auto& msg = parser_->get();
    auto ex = std::make_shared<Exchange>();
    ex->srv = srv_;
    HttpRequest& req = ex->req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    req.path = req.target.substr(0, req.target.find('?'));
    req.version = msg.version();
    req.socket_fd = fd_;
    size_t content_lengths = 0;
    for (const auto& f : msg) {
      req.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
      if (f.name() == http::field::content_length) ++content_lengths;
    }
    keep_alive_ = msg.keep_alive();
    if (content_lengths > 1 || (content_lengths == 1 && req.header("Content-Length").find(',') != std::string::npos)) {
      keep_alive_ = false;
      return write_response(srv_->error(400, "malformed HTTP request: more than one Content-Length"), nullptr);
    }
    const bool has_body = !parser_->is_done();
    HttpRoute route;
    try {
      route = srv_->dispatch(req);
    } catch (const std::exception& e) {
      keep_alive_ = false;
      return write_response(srv_->error(500, "internal error"), nullptr);
    }
    if (!route.handler) {
      keep_alive_ = false;
      return write_response(srv_->error(500, "no handler"), nullptr);
    }
    if (!route.needs_body) {
      if (has_body) keep_alive_ = false;  // the body stays unread
      return run(std::move(route), std::move(ex));
    }
    if (parser_->chunked()) {
      keep_alive_ = false;
      return write_response(srv_->error(411, "chunked request bodies are not accepted: send Content-Length"), nullptr);
    }
    const uint64_t length = parser_->content_length().value_or(0);
    if (length > srv_->opt.max_body_bytes) {
      keep_alive_ = false;
      return write_response(srv_->error(413, fmt::format("the request body exceeds the limit of {} bytes",
                                                         srv_->opt.max_body_bytes)),
                            nullptr);
    }
    if (!has_body) return run(std::move(route), std::move(ex));
    if (!srv_->reserve(length)) {
      keep_alive_ = false;
      auto r = srv_->error(503, "the server holds too many request bodies: try again later");
      r.headers.emplace_back("Retry-After", "1");
      return write_response(std::move(r), nullptr);
    }
    ex->reserved = length;
    auto self = shared_from_this();
    auto read_body = [this, self, route = std::move(route), ex = std::move(ex)]() mutable {
      beast::get_lowest_layer(stream_).expires_after(srv_->opt.body_timeout);
      http::async_read(stream_, buffer_, *parser_,
                       [this, self, route = std::move(route), ex = std::move(ex)](beast::error_code ec, size_t) mutable {
                         beast::get_lowest_layer(stream_).expires_never();
                         if (ec) return read_failed(ec, true);
                         ex->req.body = std::move(parser_->get().body());
                         run(std::move(route), std::move(ex));
                       });
    };
    if (beast::iequals(req.header("Expect"), "100-continue")) {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      beast::get_lowest_layer(stream_).expires_after(srv_->opt.write_timeout);
      net::async_write(stream_, net::buffer(kContinue),
                       [this, self, read_body = std::move(read_body)](beast::error_code ec, size_t) mutable {
                         if (ec) return hard_close();
                         read_body();
                       });
      return;
    }
    read_body();
  }

  class Reply : public HttpReply {
   public:
    Reply(std::shared_ptr<Session> s, std::shared_ptr<Exchange> ex) : s_(std::move(s)), ex_(std::move(ex)) {}
    void send(HttpResponse r) override {
      if (state_ != 0) return;
      state_ = 3;
      s_->reply_send(std::move(r), ex_);
    }
    bool begin_stream(int status, std::string content_type, HttpHeaders headers) override {
      if (state_ != 0) return false;
      state_ = 1;
      return s_->reply_begin_stream(status, std::move(content_type), std::move(headers), ex_->req.version == 10);
    }
    bool write(std::string_view data) override { return state_ == 1 && s_->reply_write(data); }
    void end_stream() override { end(false); }
    void end(bool force_close) {
      if (state_ != 1) return;
      state_ = 2;
      s_->reply_end_stream(ex_, force_close);
    }
    bool answered() const { return state_ != 0; }
    bool streaming() const { return state_ == 1; }

   private:
    std::shared_ptr<Session> s_;
    std::shared_ptr<Exchange> ex_;
    int state_ = 0;  // 0 nothing, 1 streaming, 2 stream ended, 3 sent
  };

  void run(HttpRoute route, std::shared_ptr<Exchange> ex) {
    auto self = std::static_pointer_cast<Session>(shared_from_this());
    auto task = [self, handler = std::move(route.handler), ex]() mutable {
      Reply reply(self, ex);
      try {
        handler(ex->req, reply);
      } catch (const std::exception& e) {
        spdlog::error("{} {}: internal error: {}", ex->req.method, short_excerpt(ex->req.path), e.what());
        if (!reply.answered()) reply.send(self->srv_->error(500, std::string("internal error: ") + e.what()));
      }
      if (!reply.answered()) reply.send(self->srv_->error(500, "the handler did not answer"));
      if (reply.streaming()) {  // a stream the handler left open: the connection cannot be reused
        reply.end(true);
      }
    };
    switch (route.lane) {
      case Lane::Inline: return task();
      case Lane::Control: return srv_->control->post(std::move(task));
      case Lane::Worker: return srv_->workers->post(std::move(task));
    }
  }

  void write_response(HttpResponse r, std::shared_ptr<Exchange> ex, bool after_timeout = false) {
    if (closed_) return;
    auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(r.status),
                                                                   ex && ex->req.version == 10 ? 10 : 11);
    res->set(http::field::content_type, r.content_type);
    for (auto& [k, v] : r.headers) res->insert(k, v);
    res->body() = std::move(r.body);
    if (r.close) keep_alive_ = false;
    res->keep_alive(keep_alive_);
    res->prepare_payload();
    if (after_timeout) beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(2));
    else beast::get_lowest_layer(stream_).expires_after(srv_->opt.write_timeout);
    auto self = shared_from_this();
    http::async_write(stream_, *res, [this, self, res, ex = std::move(ex)](beast::error_code ec, size_t) mutable {
      if (ec) return hard_close();
      finish_exchange(std::move(ex), keep_alive_);
    });
  }

  void finish_exchange(std::shared_ptr<Exchange> ex, bool keep) {
    ex.reset();  // the body is freed (and the heap trimmed) once the handler let go of it too
    stream_sr_.reset();
    stream_res_.reset();
    stream_chunked_ = false;
    beast::get_lowest_layer(stream_).expires_never();
    if (keep) return do_read();
    graceful_close();
  }

  void graceful_close() {
    if (closed_) return;
    if constexpr (kTls) {
      auto self = shared_from_this();
      beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(2));
      stream_.async_shutdown([this, self](beast::error_code) { hard_close(); });
    } else {
      beast::error_code ec;
      beast::get_lowest_layer(stream_).socket().shutdown(tcp::socket::shutdown_send, ec);
      // Let the client read the answer: drain what it still sends for at most 2 s in all, then close.
      beast::get_lowest_layer(stream_).expires_after(std::chrono::seconds(2));
      lingering();
    }
  }

  void lingering() {
    auto self = shared_from_this();
    auto buf = std::make_shared<std::array<char, 4096>>();
    beast::get_lowest_layer(stream_).async_read_some(net::buffer(*buf), [this, self, buf](beast::error_code ec, size_t) {
      if (ec) return hard_close();
      lingering();
    });
  }

  void hard_close() {
    if (closed_) return;
    closed_ = true;
    waiting_since = 0;
    beast::get_lowest_layer(stream_).cancel();
    beast::error_code ec;
    beast::get_lowest_layer(stream_).socket().shutdown(tcp::socket::shutdown_both, ec);
    // The descriptor itself is closed with the session (when no handler holds it), so a watcher polling it never
    // sees a reused number.
  }

  HttpServer::Impl* srv_;
  Stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::unique_ptr<http::response<http::empty_body>> stream_res_;
  std::unique_ptr<http::response_serializer<http::empty_body>> stream_sr_;
  bool stream_chunked_ = false;
  bool keep_alive_ = true;
  bool closed_ = false;
  int fd_ = -1;
};

}  // namespace

// ---- accepting --------------------------------------------------------------------------------------------------

void HttpServer::Impl::do_accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || stopping) return;
    if (!ec) on_accept(std::move(socket));
    else spdlog::warn("{}: accept: {}", opt.name, ec.message());
    if (ec == net::error::no_descriptors || ec == net::error::no_buffer_space) {
      // Out of descriptors: wait a moment instead of spinning.
      auto t = std::make_shared<net::steady_timer>(ioc, std::chrono::milliseconds(50));
      t->async_wait([this, t](beast::error_code) { do_accept(); });
      return;
    }
    do_accept();
  });
}

void HttpServer::Impl::on_accept(tcp::socket socket) {
  beast::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  bool reject = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = sessions.begin(); it != sessions.end();) {
      if (it->second.expired()) it = sessions.erase(it);
      else ++it;
    }
    if (sessions.size() >= opt.max_connections) {
      // Evict the connection that has waited longest for a request head (idle or slow); none: refuse this one.
      std::shared_ptr<SessionBase> victim;
      int64_t oldest = INT64_MAX;
      for (auto& [p, w] : sessions) {
        auto s = w.lock();
        const int64_t since = s ? s->waiting_since.load() : 0;
        if (s && since != 0 && since < oldest) {
          oldest = since;
          victim = std::move(s);
        }
      }
      if (victim) {
        victim->waiting_since = 0;
        sessions.erase(victim.get());
        victim->close();
      } else if (sessions.size() >= opt.max_connections + 64) {
        return;  // the socket closes here
      } else {
        reject = true;
      }
    }
  }
  std::shared_ptr<SessionBase> s;
  if (ssl) {
    s = std::make_shared<Session<beast::ssl_stream<beast::tcp_stream>>>(
        this, beast::ssl_stream<beast::tcp_stream>(beast::tcp_stream(std::move(socket)), *ssl));
  } else {
    s = std::make_shared<Session<beast::tcp_stream>>(this, beast::tcp_stream(std::move(socket)));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    sessions.emplace(s.get(), s);
  }
  s->start(reject);
}

// ---- HttpServer -------------------------------------------------------------------------------------------------

HttpServer::HttpServer(HttpServerOptions options, HttpDispatcher dispatcher, HttpErrorFormatter errors) {
  if (options.io_threads == 0 || options.worker_threads == 0 || options.control_threads == 0 ||
      options.max_connections == 0) {
    throw std::invalid_argument("http server: thread counts and the connection bound must be positive");
  }
  impl_ = std::make_unique<Impl>(std::move(options), std::move(dispatcher), std::move(errors));
  auto& o = impl_->opt;
  if (!o.tls_cert.empty() || !o.tls_key.empty()) {
    impl_->ssl.emplace(net::ssl::context::tls_server);
    auto& ctx = *impl_->ssl;
    ctx.set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 |
                    net::ssl::context::no_sslv3 | net::ssl::context::no_tlsv1 | net::ssl::context::no_tlsv1_1 |
                    net::ssl::context::single_dh_use);
    try {
      ctx.use_certificate_chain_file(o.tls_cert);
      ctx.use_private_key_file(o.tls_key, net::ssl::context::pem);
      if (!o.tls_client_ca.empty()) {
        ctx.load_verify_file(o.tls_client_ca);
        ctx.set_verify_mode(net::ssl::verify_peer | net::ssl::verify_fail_if_no_peer_cert);
      }
    } catch (const boost::system::system_error& e) {
      throw std::runtime_error(fmt::format("the TLS certificate, key or client CA was refused ({})", e.what()));
    }
  }
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind(const std::string& host, int port) {
  auto& a = impl_->acceptor;
  try {
    tcp::resolver resolver(impl_->ioc);
    const auto results = resolver.resolve(host, std::to_string(port), tcp::resolver::passive | tcp::resolver::numeric_service);
    if (results.empty()) throw std::runtime_error("no address");
    const tcp::endpoint ep = *results.begin();
    a.open(ep.protocol());
    a.set_option(net::socket_base::reuse_address(true));
    a.bind(ep);
    a.listen(net::socket_base::max_listen_connections);
    return a.local_endpoint().port();
  } catch (const std::exception& e) {
    beast::error_code ignored;
    a.close(ignored);
    throw std::runtime_error(fmt::format("cannot listen on {}:{} ({})", host, port, e.what()));
  }
}

void HttpServer::start() {
  auto& im = *impl_;
  if (im.started) return;
  im.started = true;
  im.workers = std::make_unique<Pool>(im.opt.worker_threads, im.opt.name + "-work");
  im.control = std::make_unique<Pool>(im.opt.control_threads, im.opt.name + "-ctl");
  im.work.emplace(net::make_work_guard(im.ioc));
  im.do_accept();
  for (size_t i = 0; i < im.opt.io_threads; ++i) {
    im.io_threads.emplace_back([this, i] {
      const std::string n = fmt::format("{}-io-{}", impl_->opt.name, i).substr(0, 15);
      pthread_setname_np(pthread_self(), n.c_str());
      impl_->ioc.run();
    });
  }
}

void HttpServer::stop() {
  if (!impl_) return;
  auto& im = *impl_;
  if (im.stopping.exchange(true)) return;
  net::post(im.ioc, [&im] {
    beast::error_code ignored;
    im.acceptor.close(ignored);
  });
  std::vector<std::shared_ptr<SessionBase>> open;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    for (auto& [p, w] : im.sessions) {
      if (auto s = w.lock()) open.push_back(std::move(s));
    }
    im.sessions.clear();
  }
  for (auto& s : open) s->close();
  open.clear();
  // Handlers still running see their writes fail (the I/O threads still run), then return.
  if (im.workers) im.workers->stop();
  if (im.control) im.control->stop();
  im.work.reset();
  im.ioc.stop();
  for (auto& t : im.io_threads) {
    if (t.joinable()) t.join();
  }
  im.io_threads.clear();
}

size_t HttpServer::connections() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  size_t n = 0;
  for (auto& [p, w] : impl_->sessions) n += !w.expired();
  return n;
}

}  // namespace hypic::rpc
