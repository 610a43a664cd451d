// Lifecycle shared by every hypic service: common flags, logging, a gRPC server with the standard
// health service (grpc.health.v1) and server reflection, and a graceful drain on SIGINT/SIGTERM.
//
// Drain sequence: the first SIGINT/SIGTERM flips health to NOT_SERVING and makes
// Lifecycle::enter() refuse new calls (services answer UNAVAILABLE "<role> is shutting down");
// in-flight calls get up to --drain-seconds to finish; then the server shuts down, cancelling
// what is left. A second signal skips the wait.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include "proto/rpc/security.h"

namespace hypic::rpc {

/// Flags every service takes.
struct ServerFlags {
  std::string listen = "127.0.0.1:0";  ///< host:port to bind; port 0 picks a free one
  std::string port_file;               ///< if set, the bound port is written there once serving
  std::string log_level = "info";      ///< trace, debug, info, warn, error, critical, off
  double drain_seconds = 10.0;         ///< how long in-flight calls may finish after SIGTERM
  int parent_pid = 0;                  ///< if > 0, shut down when this process disappears
  std::string metrics_listen;          ///< host:port of the Prometheus /metrics endpoint (metrics.h); "" = none
  std::string metrics_port_file;       ///< if set, the metrics endpoint's bound port is written there
  TlsFlags tls;                        ///< --tls-* (security.h): TLS of the gRPC port, the metrics and channels
  std::string advertise;               ///< host:port others reach this service at, as it names itself in reports
  /// --tls-service-identity (internal services only, add_service_identity_flag): certificate identities allowed to
  /// call them under mutual TLS (security.h)
  std::vector<std::string> service_identities{kDefaultServiceIdentity};
};

/// The address a service names itself by (e.g. a scatter worker's built_by): --advertise-address when given, else
/// advertised_host(listen):port.
std::string self_address(const ServerFlags& flags, int port);

/// Registers --listen, --port-file, --log-level, --drain-seconds, --parent-pid, --metrics-listen,
/// --metrics-port-file and the --tls-* flags (security.h) on `app`.
void add_server_flags(CLI::App& app, ServerFlags& flags);

/// A byte-budget flag that may be "auto" (the service derives it from the machine): "auto" -> nullopt, else a byte size
/// as parse_byte_size (flags.h) reads it: decimal digits with an optional binary unit (k, kb, kib = 1024; m, g, t, p, e
/// likewise; "8GiB", "512MB", "1048576"). Throws std::invalid_argument naming the flag and the text for anything else
/// (blanks, signs, fractions, exponents, unknown units, values that do not fit in 64 bits).
std::optional<uint64_t> parse_byte_budget(const std::string& text, const std::string& flag);

/// A CLI11 check for such a flag: what parse_byte_budget accepts passes, anything else fails the parse at start-up
/// (CLI::ValidationError naming the flag and the value, before the service logs or binds anything).
CLI::Validator byte_budget_check();

/// Physical memory of this host (bytes; /proc/meminfo MemTotal, cgroup v2 memory.max when lower), 0 if unknown.
uint64_t host_memory_bytes();

/// What every service's main() does first after parsing its flags: logging (setup_logging) and the process-wide TLS
/// configuration (configure_tls, before any channel is made). Throws std::invalid_argument for a bad log level or
/// TLS file (naming the flag).
void init_service(const std::string& role, const ServerFlags& flags);

/// Configures spdlog: pattern "[time] [role] [level] message" on stderr; throws
/// std::invalid_argument for an unknown level name.
void setup_logging(const std::string& role, const std::string& level);

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (and every thread created after) and
/// ignores SIGPIPE. Call first thing in main(), before gRPC starts threads; run_server() then
/// receives the signals with sigwait.
void block_termination_signals();

/// What every service's main() does first, before gRPC starts: block_termination_signals(), and gRPC's client-channel
/// backup poll interval (GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS) set to 100 ms unless the environment sets it,
/// so that a channel whose peer restarted reconnects within about a second even while its calls fail fast.
void init_service_process();

/// Waits for SIGINT, SIGTERM or SIGHUP (blocked by block_termination_signals) or, with parent_pid > 0, for that
/// process to vanish. Returns the signal number, 0 for a vanished parent.
int wait_for_termination(int parent_pid);
/// True when another termination signal is pending (consumes it; does not wait): a second Ctrl-C during a drain.
bool termination_signal_pending();
/// Writes `port` to `path` atomically (a temporary file renamed), as --port-file and --metrics-port-file want.
/// Throws std::runtime_error naming the file when it cannot be written.
void write_port_file(const std::string& path, int port);

/// In-flight call accounting and the draining flag.
class Lifecycle {
 public:
  /// RAII registration of one in-flight call.
  class Call {
   public:
    explicit Call(Lifecycle* l) : l_(l) {}
    Call(Call&& o) noexcept : l_(o.l_) { o.l_ = nullptr; }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    Call& operator=(Call&&) = delete;
    ~Call();

   private:
    Lifecycle* l_;
  };

  explicit Lifecycle(std::string role) : role_(std::move(role)) {}
  /// Registers a call; throws RpcError(UNAVAILABLE, "<role> is shutting down") once draining.
  Call enter();
  bool draining() const { return draining_.load(); }
  void begin_drain() { draining_.store(true); }
  /// Waits until no call is in flight or `deadline`; true if idle.
  bool wait_idle(std::chrono::steady_clock::time_point deadline);
  size_t active() const;
  const std::string& role() const { return role_; }

 private:
  std::string role_;
  std::atomic<bool> draining_{false};
  mutable std::mutex mu_;
  std::condition_variable idle_;
  size_t active_ = 0;
};

/// What run_server() needs to know about the service it hosts.
struct ServerSpec {
  std::string role;                          ///< "router", "scatter", "combine", "segment-cache"
  std::vector<grpc::Service*> services;      ///< registered in order
  std::vector<std::string> health_names;     ///< fully qualified service names reported SERVING
  /// Called once the port is known (before health turns SERVING), e.g. to learn the own address.
  std::function<void(int port)> on_bound;
  /// Called when the drain begins (after health went NOT_SERVING), e.g. to stop background work.
  std::function<void()> on_drain;
};

/// Builds and starts the server on flags.listen (TLS per flags.tls) with health checking and reflection enabled,
/// starts the metrics endpoint when flags.metrics_listen is set, writes the port files, marks the services SERVING, then blocks until a termination signal (or
/// the parent process vanishes) and drains as described above. Returns the process exit status
/// (0 after a clean drain). Throws std::runtime_error if the address cannot be bound.
int run_server(const ServerFlags& flags, Lifecycle& lifecycle, ServerSpec spec);

/// gRPC channel to host:port with the channel arguments hypic uses (large messages allowed,
/// keepalive so that a vanished peer is noticed within seconds), over TLS when the process's TLS configuration has
/// a CA (security.h, --tls-ca). gRPC gives channels of equal target and arguments one TCP connection between them:
/// `connection` > 0 makes a channel of its own connection (one more argument, hypic.connection = N), so that bulk
/// streams spread over several connections (SegmentCacheClient::Options::connections).
std::shared_ptr<grpc::Channel> make_channel(const std::string& target, int connection = 0);

/// Health status of `service` ("" for the whole server) at `target`, as the grpc.health.v1 enum
/// value (1 = SERVING); -1 when the call failed (the status is written to *error if given).
int check_health(const std::string& target, const std::string& service, std::chrono::milliseconds timeout,
                 std::string* error = nullptr);
/// Same on an existing channel.
int check_health(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                 std::chrono::milliseconds timeout, std::string* error = nullptr);

/// Host part of a listen address ("127.0.0.1:0" -> "127.0.0.1", "[::1]:5" -> "[::1]",
/// "0.0.0.0:7" -> "127.0.0.1" since a wildcard is not reachable as such).
std::string advertised_host(const std::string& listen);

/// A client context for a call made while serving `parent` (may be null): with a parent, the
/// parent's deadline and cancellation propagate to the call (gRPC propagation defaults); with
/// `timeout`, the deadline is additionally capped at now + timeout.
std::unique_ptr<grpc::ClientContext> make_client_context(const grpc::ServerContextBase* parent,
                                                         std::optional<std::chrono::milliseconds> timeout = {});

/// Milliseconds between two steady-clock time points, as double.
inline double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace hypic::rpc
