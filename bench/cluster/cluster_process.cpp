#include "bench/cluster/cluster_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

namespace hypic::bench {

namespace {

std::mutex g_mu;
std::set<pid_t> g_launchers;  // launchers started and not yet reaped
bool g_terminating = false;   // a termination signal arrived: no new launcher may start

/// Absolute path of `name` from PATH (or `name` itself when it contains a slash); empty if not found.
std::string which(const std::string& name) {
  if (name.find('/') != std::string::npos) return access(name.c_str(), X_OK) == 0 ? name : std::string();
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

/// Waits up to `timeout` for `pid` to exit; its exit status, or -2 if still running, -1 if already reaped
/// elsewhere.
int wait_for(pid_t pid, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() >= until) return -2;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

/// SIGTERM, wait, SIGKILL: the launcher's own teardown sends SIGTERM to every service, waits its grace
/// period (10 s) and SIGKILLs what is left, so 60 s covers a complete clean stop.
int terminate_launcher(pid_t pid) {
  kill(pid, SIGTERM);
  int rc = wait_for(pid, std::chrono::seconds(60));
  if (rc == -2) {
    kill(-pid, SIGKILL);
    rc = wait_for(pid, std::chrono::seconds(10));
    if (rc >= 0) rc = -1;
  }
  return rc;
}

}  // namespace

std::string tail_of(const std::filesystem::path& path, int lines) {
  std::ifstream in(path);
  if (!in) return "(no log)";
  std::deque<std::string> last;
  std::string line;
  while (std::getline(in, line)) {
    last.push_back(line);
    if (int(last.size()) > lines) last.pop_front();
  }
  std::string out;
  for (const auto& l : last) out += l + "\n";
  return out;
}

LaunchedCluster::LaunchedCluster(const ClusterSpec& spec) : spec_(spec) {
  namespace fs = std::filesystem;
  if (!fs::is_regular_file(spec.launcher)) {
    throw std::invalid_argument(fmt::format("--launcher {}: no such file", spec.launcher.string()));
  }
  for (const char* b : {"hypic-segment-cache", "hypic-scatter-worker", "hypic-combine-worker", "hypic-router",
                        "hypic-client"}) {
    if (!fs::exists(spec.bin_dir / b)) {
      throw std::invalid_argument(fmt::format("--bin-dir {}: {} not found (build it first)", spec.bin_dir.string(), b));
    }
  }
  if (spec.scatter_workers < 0) {
    throw std::invalid_argument(fmt::format("scatter workers must be >= 0, got {}", spec.scatter_workers));
  }
  const std::string python = which(spec.python);
  if (python.empty()) throw std::invalid_argument(fmt::format("--python {}: not found in PATH", spec.python));
  fs::create_directories(spec.work_dir);

  std::vector<std::string> args = {python,
                                   spec.launcher.string(),
                                   "--bin-dir",
                                   spec.bin_dir.string(),
                                   "--model",
                                   spec.model.string(),
                                   "--tokenizer",
                                   spec.tokenizer.string(),
                                   "--scatter-workers",
                                   std::to_string(spec.scatter_workers),
                                   "--work-dir",
                                   (spec.work_dir / "cluster").string(),
                                   "--log-level",
                                   "warn"};
  args.insert(args.end(), spec.launcher_args.begin(), spec.launcher_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  const int log_fd = open(log_path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) throw std::runtime_error(fmt::format("cannot create {}", log_path().string()));
  const pid_t parent = getpid();
  std::unique_lock<std::mutex> lock(g_mu);  // the termination thread sees the pid as soon as it exists
  if (g_terminating) {
    close(log_fd);
    throw std::runtime_error("interrupted: not starting another cluster");
  }
  const pid_t pid = fork();
  if (pid < 0) {
    close(log_fd);
    throw std::runtime_error("fork failed");
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);  // the benchmark blocks termination signals for sigwait
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(log_fd);
  pid_ = pid;
  g_launchers.insert(pid);
  lock.unlock();

  const std::string marker = "hypic cluster ready: router ";
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(spec.ready_timeout_s * 1000));
  std::string failure;
  for (;;) {
    std::ifstream in(log_path());
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(marker, 0) == 0) router_ = line.substr(marker.size());
    }
    if (!router_.empty()) break;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      {
        std::lock_guard<std::mutex> l(g_mu);
        g_launchers.erase(pid_);
      }
      pid_ = -1;
      failure = fmt::format("the launcher exited with status {} before the cluster was ready",
                            WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
      break;
    }
    if (std::chrono::steady_clock::now() >= until) {
      failure = fmt::format("the cluster was not ready after {} s", spec.ready_timeout_s);
      stop();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!failure.empty()) {
    throw std::runtime_error(fmt::format("{} ({} scatter workers); {}:\n{}", failure, spec.scatter_workers,
                                         log_path().string(), tail_of(log_path(), 40)));
  }
}

LaunchedCluster::~LaunchedCluster() { stop(); }

int LaunchedCluster::stop() {
  if (pid_ < 0) return 0;
  const int rc = terminate_launcher(pid_);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_launchers.erase(pid_);
  }
  pid_ = -1;
  return rc;
}

void install_termination_handler() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    sigwait(&set, &sig);
    const char msg[] = "\nhypic-bench-cluster: interrupted, stopping the clusters\n";
    (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
    std::set<pid_t> pids;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      g_terminating = true;
      pids = g_launchers;
    }
    for (pid_t pid : pids) terminate_launcher(pid);
    _exit(128 + sig);
  }).detach();
}

}  // namespace hypic::bench
