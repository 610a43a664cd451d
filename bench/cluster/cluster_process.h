// A local hypic cluster started for the benchmark through the project's launcher
// (deploy/local_cluster.py: segment cache, N scatter workers, one combine worker, the router on loopback).
//
// Process hygiene: the launcher runs in its own process group with PR_SET_PDEATHSIG = SIGTERM, so it
// stops its services if the benchmark dies, even by SIGKILL (the launcher in turn starts each service
// with PR_SET_PDEATHSIG and --parent-pid). install_termination_handler() makes SIGINT / SIGTERM / SIGHUP
// stop every running cluster before the benchmark exits.
#pragma once
#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace hypic::bench {

struct ClusterSpec {
  std::string python = "python3";          ///< interpreter of the launcher (looked up in PATH)
  std::filesystem::path launcher;          ///< deploy/local_cluster.py
  std::filesystem::path bin_dir;           ///< where the hypic-* binaries are
  std::filesystem::path model;             ///< checkpoint directory
  std::filesystem::path tokenizer;         ///< tokenizer.json
  int scatter_workers = 2;                 ///< >= 0
  std::vector<std::string> launcher_args;  ///< extra launcher flags, e.g. "--router-arg=--schedule=round-robin"
  std::filesystem::path work_dir;          ///< the launcher's log (launcher.log) and its work dir (cluster/)
  double ready_timeout_s = 300;            ///< longest wait for "hypic cluster ready"
};

/// A running cluster; stopped by stop() or the destructor. Not copyable or movable.
class LaunchedCluster {
 public:
  /// Starts the launcher (from the calling thread, which must outlive the cluster: PR_SET_PDEATHSIG is
  /// tied to it) and waits until it reports the router's address. Throws std::invalid_argument for a bad
  /// spec (missing launcher or binaries, scatter_workers < 0) and std::runtime_error when the launcher
  /// exits or times out before the cluster is ready (the message ends with the tail of its log).
  explicit LaunchedCluster(const ClusterSpec& spec);
  ~LaunchedCluster();
  LaunchedCluster(const LaunchedCluster&) = delete;
  LaunchedCluster& operator=(const LaunchedCluster&) = delete;

  /// host:port of the router.
  const std::string& router() const { return router_; }
  /// SIGTERM to the launcher (which stops every service), then waits for it; SIGKILL after 60 s.
  /// Returns the launcher's exit status (-1 if it had to be killed). Idempotent.
  int stop();
  /// The launcher's log (service addresses and log paths, errors).
  std::filesystem::path log_path() const { return spec_.work_dir / "launcher.log"; }

 private:
  ClusterSpec spec_;
  pid_t pid_ = -1;
  std::string router_;
};

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread and starts a thread that, when one arrives,
/// refuses any further LaunchedCluster (its constructor then throws std::runtime_error), stops every one
/// still running and exits the process with status 128 + signal. Call first
/// thing in main(), before any other thread exists (threads created later inherit the blocked mask).
void install_termination_handler();

/// Last `lines` lines of a text file ("(no log)" if it cannot be read).
std::string tail_of(const std::filesystem::path& path, int lines);

}  // namespace hypic::bench
