#include "proto/rpc/server.h"

#include <algorithm>

#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include <fmt/format.h>
#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/metrics.h"
#include "proto/rpc/status.h"

namespace hypic::rpc {

void add_server_flags(CLI::App& app, ServerFlags& flags) {
  app.add_option("--listen", flags.listen, "host:port to listen on (port 0 picks a free port)")
      ->capture_default_str();
  app.add_option("--port-file", flags.port_file, "write the bound port to this file once serving");
  app.add_option("--log-level", flags.log_level, "trace|debug|info|warn|error|critical|off")->capture_default_str();
  app.add_option("--drain-seconds", flags.drain_seconds,
                 "grace period for in-flight calls after SIGTERM (0 .. 86400: a day)")
      ->capture_default_str()
      ->check(strict_real(0.0, 86400.0));
  add_strict_int_option(app, "--parent-pid", flags.parent_pid, 0, std::numeric_limits<int>::max(),
                        "exit when this process disappears (used by launchers; 0: none)");
  app.add_option("--metrics-listen", flags.metrics_listen,
                 "host:port of the Prometheus endpoint (GET /metrics; HTTPS with --tls-cert); port 0 picks one");
  app.add_option("--metrics-port-file", flags.metrics_port_file, "write the metrics endpoint's port to this file");
  add_tls_flags(app, flags.tls);
  app.add_option("--advertise-address", flags.advertise,
                 "host:port this service names itself by in reports (default: the --listen host, 127.0.0.1 for a "
                 "wildcard, and the bound port); e.g. the pod's DNS name in Kubernetes");
}

std::string self_address(const ServerFlags& flags, int port) {
  return flags.advertise.empty() ? advertised_host(flags.listen) + ":" + std::to_string(port) : flags.advertise;
}

void init_service(const std::string& role, const ServerFlags& flags) {
  setup_logging(role, flags.log_level);
  configure_tls(flags.tls);
  configure_service_identities(flags.service_identities);
  if (flags.tls.serving()) {
    spdlog::info("TLS on{}", flags.tls.client_ca.empty() ? "" : ", client certificates required (mTLS)");
  }
}

void setup_logging(const std::string& role, const std::string& level) {
  const auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    throw std::invalid_argument(fmt::format("--log-level: unknown level \"{}\"", level));
  }
  auto logger = std::make_shared<spdlog::logger>(role, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] %v");
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

namespace {
sigset_t termination_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  return set;
}
}  // namespace

void block_termination_signals() {
  sigset_t set = termination_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

void init_service_process() {
  block_termination_signals();
  // gRPC's backup poller (gRPC doc/environment_variables.md) drives a client channel's reconnection while no call is
  // polling it; at its default 5 s a channel whose calls fail fast while its peer is down (the OpenAI front's calls to
  // a restarted router) stayed in TRANSIENT_FAILURE for 5-10 s after the peer was back. A value the user set wins.
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", 0);
}

Lifecycle::Call::~Call() {
  if (!l_) return;
  std::lock_guard<std::mutex> lock(l_->mu_);
  if (--l_->active_ == 0) l_->idle_.notify_all();
}

Lifecycle::Call Lifecycle::enter() {
  if (draining_.load()) throw unavailable(fmt::format("{} is shutting down", role_));
  std::lock_guard<std::mutex> lock(mu_);
  ++active_;
  return Call(this);
}

bool Lifecycle::wait_idle(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_.wait_until(lock, deadline, [&] { return active_ == 0; });
}

size_t Lifecycle::active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return active_;
}

namespace {
void apply_common_args(grpc::ChannelArguments& args) {
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // A frozen peer (stopped, hung, its host gone) is found within about 2.5 s: a ping every second, answered within
  // 1.5 s, also while a call waits for data (no cap on pings without data), so its calls fail UNAVAILABLE and their
  // work is planned again (the peer's kernel still acknowledging TCP does not hide it).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 1500);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A peer that restarts is found again within about a second (gRPC's default backoff grows to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
}


}  // namespace

void write_port_file(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out) throw std::runtime_error(fmt::format("cannot write the port file {}: {}", tmp, std::strerror(errno)));
  }
  std::filesystem::rename(tmp, path);
}

int wait_for_termination(int parent_pid) {
  const sigset_t set = termination_set();
  for (;;) {
    timespec ts{0, 200 * 1000 * 1000};
    const int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig > 0) return sig;
    if (parent_pid > 0 && (getppid() != parent_pid) && kill(parent_pid, 0) != 0) return 0;
  }
}

bool termination_signal_pending() {
  const sigset_t set = termination_set();
  timespec ts{0, 0};
  return sigtimedwait(&set, nullptr, &ts) > 0;
}

int run_server(const ServerFlags& flags, Lifecycle& lifecycle, ServerSpec spec) {
  // One reference to the gRPC library held for the process's life: without it the builder's destructor drops the
  // last one, and grpc_shutdown joins gRPC's executor threads, one of which can sit up to 10 s in epoll_wait after
  // traffic (a service took 9.8 s to exit after logging "stopped"). The process exits with the library up instead.
  static const bool grpc_held = (grpc_init(), true);
  (void)grpc_held;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, server_credentials(), &port);
  // gRPC binds with SO_REUSEPORT by default, so a second service on a port in use would silently share it (the
  // kernel splitting connections between them): a port in use must fail the start instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);  // clients ping every 1 s
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  for (grpc::Service* s : spec.services) builder.RegisterService(s);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    throw std::runtime_error(fmt::format("--listen: cannot listen on {} (address in use or invalid?)", flags.listen));
  }
  if (spec.on_bound) spec.on_bound(port);
  std::unique_ptr<MetricsServer> metrics;
  if (!flags.metrics_listen.empty()) {
    auto& reg = MetricsRegistry::global();
    reg.gauge("hypic:service_info", "1, labelled with the service's role", {{"role", spec.role}}).set(1);
    metrics = std::make_unique<MetricsServer>(flags.metrics_listen, reg);
    if (!flags.metrics_port_file.empty()) write_port_file(flags.metrics_port_file, metrics->port());
    spdlog::info("metrics on {}://{}:{}/metrics", tls_material().serving() ? "https" : "http",
                 split_host_port(flags.metrics_listen, "--metrics-listen").first, metrics->port());
  }
  auto* health = server->GetHealthCheckService();
  for (const auto& name : spec.health_names) health->SetServingStatus(name, true);
  health->SetServingStatus(true);
  if (!flags.port_file.empty()) write_port_file(flags.port_file, port);
  spdlog::info("{} serving on {} (port {})", spec.role, flags.listen, port);

  const int sig = wait_for_termination(flags.parent_pid);
  if (sig == 0) {
    spdlog::warn("parent process {} vanished: shutting down", flags.parent_pid);
  } else {
    spdlog::info("signal {} received: draining (up to {:.1f} s, a second signal stops at once)", sig,
                 flags.drain_seconds);
  }
  lifecycle.begin_drain();
  health->SetServingStatus(false);
  if (spec.on_drain) spec.on_drain();

  // Wait for in-flight calls, polling for a second signal.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(flags.drain_seconds * 1000));
  while (sig != 0 && std::chrono::steady_clock::now() < deadline) {
    if (lifecycle.wait_idle(std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(100)))) {
      break;
    }
    if (termination_signal_pending()) {
      spdlog::warn("second signal: stopping without waiting for {} in-flight calls", lifecycle.active());
      break;
    }
  }
  if (lifecycle.active() > 0) spdlog::warn("cancelling {} in-flight calls", lifecycle.active());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  server->Wait();
  metrics.reset();
  spdlog::info("{} stopped", spec.role);
  return 0;
}

std::shared_ptr<grpc::Channel> make_channel(const std::string& target, int connection) {
  grpc::ChannelArguments args;
  apply_common_args(args);
  if (connection > 0) args.SetInt("hypic.connection", connection);
  if (!tls_material().server_name.empty()) args.SetSslTargetNameOverride(tls_material().server_name);
  return grpc::CreateCustomChannel(target, channel_credentials(), args);
}

int check_health(const std::string& target, const std::string& service, std::chrono::milliseconds timeout,
                 std::string* error) {
  return check_health(make_channel(target), service, timeout, error);
}

int check_health(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                 std::chrono::milliseconds timeout, std::string* error) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status st = stub->Check(&ctx, req, &resp);
  if (!st.ok()) {
    if (error) *error = describe(st);
    return -1;
  }
  return static_cast<int>(resp.status());
}

std::unique_ptr<grpc::ClientContext> make_client_context(const grpc::ServerContextBase* parent,
                                                         std::optional<std::chrono::milliseconds> timeout) {
  auto ctx = parent ? grpc::ClientContext::FromServerContext(*parent) : std::make_unique<grpc::ClientContext>();
  if (timeout) {
    auto deadline = std::chrono::system_clock::now() + *timeout;
    if (parent && parent->deadline() < deadline) deadline = parent->deadline();
    ctx->set_deadline(deadline);
  }
  return ctx;
}

std::string advertised_host(const std::string& listen) {
  std::string host = listen;
  if (!listen.empty() && listen.front() == '[') {
    host = listen.substr(0, listen.find(']') + 1);
  } else if (auto colon = listen.rfind(':'); colon != std::string::npos) {
    host = listen.substr(0, colon);
  }
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "localhost") return "127.0.0.1";
  return host;
}

namespace {
std::string byte_budget_refusal(const std::string& text) {
  return flag_value_refusal(text, "auto or a byte size in [0, 2^64) (" + std::string(kByteSizeForm) +
                                      "; 8GiB, 512MB, 1048576)");
}
}  // namespace

std::optional<uint64_t> parse_byte_budget(const std::string& text, const std::string& flag) {
  if (text == "auto") return std::nullopt;
  if (const auto v = parse_byte_size(text, 0, UINT64_MAX)) return v;
  throw std::invalid_argument(flag + ": " + byte_budget_refusal(text));
}

CLI::Validator byte_budget_check() {
  return CLI::Validator(
      [](std::string& v) {
        return v == "auto" || parse_byte_size(v, 0, UINT64_MAX) ? std::string() : byte_budget_refusal(v);
      },
      "auto|SIZE", "BYTE_BUDGET");
}

uint64_t host_memory_bytes() {
  uint64_t total = 0;
  std::ifstream mi("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (mi >> key >> kib) {
    std::getline(mi, unit);
    if (key == "MemTotal:") {
      total = kib * 1024;
      break;
    }
  }
  // A container's limit: cgroup v2, else v1 (whose "no limit" is a huge number, above the host's memory anyway).
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream cg(path);
    std::string lim;
    if (!(cg >> lim) || lim == "max") continue;
    try {
      const uint64_t l = std::stoull(lim);
      if (l > 0 && (total == 0 || l < total)) total = l;
    } catch (const std::exception&) {
    }
  }
  return total;
}

}  // namespace hypic::rpc
