// hypic-openai: an OpenAI-compatible HTTP(S) front for a hypic cluster (openai_front/README.md).
//
//   hypic-openai --router HOST:PORT --tokenizer tokenizer.json [--listen 127.0.0.1:8000] [--model-name NAME]
//                [--auth-token-file FILE] [--router-token-file FILE] [--tls-cert FILE --tls-key FILE] ...
//
// Exit status: 0 after a clean shutdown (SIGTERM/SIGINT, or the --parent-pid process gone); 1 when it cannot start
// (bad flag value, unreadable tokenizer or token file, address in use).
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "openai_front/http_server.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/http_server.h"
#include "proto/rpc/metrics.h"
#include "proto/rpc/security.h"
#include "proto/rpc/server.h"
#include "proto/rpc/status.h"

namespace {

/// The model's name as the router reports it (ServerInfo.model_name: its checkpoint directory's name); "" when the
/// router does not answer within `patience`.
std::string router_model_name(const std::shared_ptr<grpc::Channel>& channel, const std::string& token,
                              std::chrono::milliseconds patience) {
  auto stub = hypic::v1::Router::NewStub(channel);
  const auto until = std::chrono::steady_clock::now() + patience;
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    hypic::rpc::add_bearer(ctx, token);
    hypic::v1::ServerInfo info;
    const grpc::Status st = stub->GetServerInfo(&ctx, hypic::v1::GetServerInfoRequest{}, &info);
    if (st.ok()) {
      if (info.model_name().empty()) spdlog::warn("the router reports no model name; serving as \"hypic\" (set --model-name)");
      return info.model_name();
    }
    if (std::chrono::steady_clock::now() >= until) {
      spdlog::warn("the router did not tell its model's name ({}); serving as \"hypic\" (set --model-name)",
                   hypic::rpc::describe(st));
      return "";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Large request bodies are mmapped and returned when freed, and the heap is trimmed after each (http_server.h):
  // resident memory comes back down after a burst of 15 MiB requests.
  hypic::rpc::bound_heap_retention();
  hypic::rpc::init_service_process();
  CLI::App app{"hypic OpenAI front: /v1/chat/completions, /v1/completions, /v1/models and /health over HTTP(S), "
               "answered by a hypic router"};
  hypic::rpc::ServerFlags server;
  server.listen = "127.0.0.1:8000";
  hypic::rpc::add_server_flags(app, server);
  std::string router, tokenizer_path, model_name, auth_token_file, router_token_file;
  double request_timeout_s = 600;
  size_t max_body_bytes = 16u << 20, http_threads = 64, io_threads = 2, max_connections = 1024,
         max_buffered_bytes = 256u << 20;
  double header_timeout_s = 10, body_timeout_s = 60, write_timeout_s = 60;
  app.add_option("--router", router, "the router's host:port")->required();
  app.add_option("--tokenizer", tokenizer_path,
                 "tokenizer.json, the same file as the router's (prompts are sent as token ids)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--model-name", model_name,
                 "the model id /v1/models lists and requests may name (default: the router's model directory's "
                 "name, or \"hypic\" when the router does not say)");
  app.add_option("--request-timeout-seconds", request_timeout_s,
                 "deadline of each completion request at the router (0.001 .. 604800: a week)")
      ->capture_default_str()
      ->check(hypic::rpc::strict_real(0.001, 604800.0));
  namespace hr = hypic::rpc;
  hr::add_strict_int_option(app, "--max-body-bytes", max_body_bytes, 1024, size_t{1} << 30,
                            "largest request body accepted (413 above)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--http-threads", http_threads, 1, 4096,
                            "completion requests handled at once (worker threads; each stream holds one, more wait in "
                            "order)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--io-threads", io_threads, 1, 64,
                            "threads running every connection's I/O (event-driven)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-connections", max_connections, 1, size_t{1} << 20,
                            "open HTTP connections; past it a new one closes the longest idle (or gets 503 when all "
                            "are busy)")
      ->capture_default_str();
  hr::add_strict_int_option(app, "--max-buffered-bytes", max_buffered_bytes, 1024, size_t{1} << 40,
                            "request bodies held at once, all connections together (503 above, before reading); at "
                            "least --max-body-bytes")
      ->capture_default_str();
  app.add_option("--header-timeout-seconds", header_timeout_s,
                 "a request head (or an idle keep-alive connection's next one, or a TLS handshake) must arrive "
                 "within this; slower clients are closed")
      ->capture_default_str()
      ->check(hypic::rpc::strict_real(0.05, 3600.0));
  app.add_option("--body-timeout-seconds", body_timeout_s, "a request body must arrive within this after its head")
      ->capture_default_str()
      ->check(hypic::rpc::strict_real(0.05, 3600.0));
  app.add_option("--write-timeout-seconds", write_timeout_s,
                 "each write to a client (an answer, a stream event) must complete within this, else the "
                 "connection is closed and its request cancelled")
      ->capture_default_str()
      ->check(hypic::rpc::strict_real(0.05, 3600.0));
  app.add_option("--auth-token-file", auth_token_file,
                 "accepted bearer tokens, one per line: every path but /health then needs 'Authorization: Bearer "
                 "<token>' (401 otherwise)")
      ->check(CLI::ExistingFile);
  app.add_option("--router-token-file", router_token_file,
                 "the bearer token sent to the router (first token of the file), for a router with --auth-token-file")
      ->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);

  try {
    hypic::rpc::init_service("openai", server);
    const auto [host, port] = hypic::rpc::split_host_port(server.listen, "--listen");
    hypic::openai::FrontConfig cfg;
    cfg.request_timeout = std::chrono::milliseconds(int64_t(request_timeout_s * 1000));
    cfg.max_body_bytes = max_body_bytes;
    cfg.http_threads = http_threads;
    cfg.io_threads = io_threads;
    cfg.max_connections = max_connections;
    cfg.max_buffered_bytes = std::max(max_buffered_bytes, max_body_bytes);
    cfg.header_timeout = std::chrono::milliseconds(int64_t(header_timeout_s * 1000));
    cfg.body_timeout = std::chrono::milliseconds(int64_t(body_timeout_s * 1000));
    cfg.write_timeout = std::chrono::milliseconds(int64_t(write_timeout_s * 1000));
    if (!auth_token_file.empty()) cfg.auth = hypic::rpc::BearerTokens::load(auth_token_file, "--auth-token-file");
    if (!router_token_file.empty()) {
      cfg.router_token = hypic::rpc::read_token_file(router_token_file, "--router-token-file");
    }
    const auto& tls = hypic::rpc::tls_material();
    if (tls.serving()) {
      cfg.tls_cert = tls.cert_path;
      cfg.tls_key = tls.key_path;
      cfg.tls_client_ca = tls.client_ca_path;
    }
    auto tokenizer = hypic::engine::Tokenizer::load(tokenizer_path);
    auto channel = hypic::rpc::make_channel(router);
    cfg.model_name = model_name;
    if (cfg.model_name.empty()) cfg.model_name = router_model_name(channel, cfg.router_token, std::chrono::seconds(5));
    if (cfg.model_name.empty()) cfg.model_name = "hypic";
    const std::string served_name = cfg.model_name;
    if (!hypic::openai::ChatTokens::from(tokenizer).available()) {
      spdlog::warn("--tokenizer has no <|im_start|>/<|im_end|> tokens: /v1/chat/completions will refuse requests");
    }

    std::unique_ptr<hypic::rpc::MetricsServer> metrics;
    if (!server.metrics_listen.empty()) {
      hypic::rpc::MetricsRegistry::global()
          .gauge("hypic:service_info", "1, labelled with the service's role", {{"role", "openai"}})
          .set(1);
      metrics = std::make_unique<hypic::rpc::MetricsServer>(server.metrics_listen,
                                                            hypic::rpc::MetricsRegistry::global());
      if (!server.metrics_port_file.empty()) hypic::rpc::write_port_file(server.metrics_port_file, metrics->port());
    }

    hypic::openai::OpenAIFront front(std::move(cfg), std::move(tokenizer), channel);
    const int bound = front.bind(host, port);
    front.start();
    if (!server.port_file.empty()) hypic::rpc::write_port_file(server.port_file, bound);
    spdlog::info("openai front serving {} on {}:{} (--listen {}), router {}, model \"{}\"{}", tls.serving() ? "HTTPS" : "HTTP",
                 host, bound, server.listen, router, served_name,
                 auth_token_file.empty() ? "" : ", bearer tokens required");

    const int sig = hypic::rpc::wait_for_termination(server.parent_pid);
    if (sig == 0) {
      spdlog::warn("parent process {} vanished: shutting down", server.parent_pid);
    } else {
      spdlog::info("signal {} received: draining (up to {:.1f} s, a second signal stops at once)", sig,
                   server.drain_seconds);
    }
    front.begin_drain();
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(int64_t(server.drain_seconds * 1000));
    while (sig != 0 && std::chrono::steady_clock::now() < deadline) {
      if (front.wait_idle(std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(100)))) break;
      if (hypic::rpc::termination_signal_pending()) {
        spdlog::warn("second signal: stopping without waiting for {} requests in flight", front.in_flight());
        break;
      }
    }
    if (front.in_flight() > 0) spdlog::warn("cancelling {} requests in flight", front.in_flight());
    // Cancel until nothing is left (a call registered just as the drain began is caught by the next round).
    for (int round = 0; round < 50; ++round) {
      front.cancel_in_flight();
      if (front.wait_idle(std::chrono::steady_clock::now() + std::chrono::milliseconds(100))) break;
    }
    front.stop();
    spdlog::info("openai front stopped");
    return 0;
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return 1;
  }
}
