#!/usr/bin/env python3
"""Starts a whole hypic cluster on loopback: segment cache replica(s), scatter workers, one combine
worker and the router, for one model and tokenizer.

Every service binds port 0 and reports the port it got through --port-file, so several clusters
can run side by side (parallel tests). The launcher waits until each service answers its gRPC
health check (through `hypic-client health`), then either waits for Ctrl-C / SIGTERM or runs the
command given after `--` (with {router} in its arguments replaced by the router's address and
HYPIC_ROUTER set in its environment) and exits with that command's status.

No process is left behind: each service runs in its own process group; on exit, Ctrl-C, SIGTERM,
a failed start or a service dying, every group gets SIGTERM, then SIGKILL after a grace period.
If the launcher itself is killed (even with SIGKILL) the services die with it: they are started
with PR_SET_PDEATHSIG (Linux) and --parent-pid.

Python 3.11 standard library only. Usable as a module (tests): LocalCluster(...) as a context
manager.

Example:
  deploy/local_cluster.py --bin-dir build/bin --model /tmp/demo --tokenizer tokenizer.json \\
      -- build/bin/hypic-client generate --router {router} --segment-file README.md --query "Summarise."
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the launcher's thread that started it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: --parent-pid still stops the service


class ClusterError(RuntimeError):
    """A service failed to start or died."""


class Service:
    """One service process."""

    def __init__(self, name: str, argv: list[str], work_dir: Path, health_service: str):
        self.name = name
        self.argv = argv
        self.health_service = health_service
        self.port_file = work_dir / f"{name}.port"
        self.log_path = work_dir / "logs" / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, same_port: bool = False) -> None:
        """Starts the process: on a free port (reported through the port file), or with same_port on the port it
        had before (a restart, so that the services that know its address find it again)."""
        self.port_file.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        listen = f"127.0.0.1:{self.port}" if same_port and self.port else "127.0.0.1:0"
        argv = self.argv + ["--listen", listen, "--port-file", str(self.port_file),
                            "--parent-pid", str(os.getpid())]
        try:
            # Several services share this host: one OpenBLAS thread each unless the user chose otherwise
            # (N services x N cores threads oversubscribe the CPU and slow every GEMM).
            env = dict(os.environ)
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent, env=env)
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait_port(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.port_file.exists():
                text = self.port_file.read_text().strip()
                if text:
                    self.port = int(text)
                    return
            if not self.alive():
                raise ClusterError(f"{self.name} exited with status {self.proc.returncode} before listening:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
        raise ClusterError(f"{self.name} did not report a port in time:\n{self.log_tail()}")


class LocalCluster:
    """The cluster: cache replica(s) (optional), N scatter workers, one combine worker, the router.

    extra_args maps a role ("cache", "scatter", "combine", "router") to extra command-line flags. device
    ("cpu", "cuda", "cuda:N") is passed to the scatter and combine workers as --device; None leaves their default
    (cuda:0 when the build has CUDA and a GPU is visible, else cpu).
    """

    def __init__(self, bin_dir: str | Path, model: str | Path, tokenizer: str | Path, scatter_workers: int = 2,
                 cache_replicas: int = 1, work_dir: str | Path | None = None,
                 extra_args: dict[str, list[str]] | None = None, ready_timeout: float = 120.0,
                 grace_seconds: float = 10.0, log_level: str = "info", device: str | None = None):
        self.bin_dir = Path(bin_dir)
        self.model = str(model)
        self.tokenizer = str(tokenizer)
        self.scatter_workers = scatter_workers
        self.cache_replicas = cache_replicas
        self._tmp = None
        if work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="hypic-cluster-")
            work_dir = self._tmp.name
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.extra = extra_args or {}
        self.ready_timeout = ready_timeout
        self.grace_seconds = grace_seconds
        self.log_level = log_level
        self.device = device
        self.services: dict[str, Service] = {}
        self.expected_down: set[str] = set()

    # ---- helpers ----
    def binary(self, name: str) -> str:
        path = self.bin_dir / name
        if not path.exists():
            raise ClusterError(f"{path} not found: pass --bin-dir, or build with scripts/build.sh")
        return str(path)

    def _common(self, role: str) -> list[str]:
        extra = self.extra.get(role, [])
        given = {a.split("=")[0] for a in extra if a.startswith("--")}
        flags = [] if "--log-level" in given else ["--log-level", self.log_level]
        if self.device is not None and role in ("scatter", "combine") and "--device" not in given:
            flags += ["--device", self.device]
        # Short drain so that teardown is quick (the services' default is 10 s), unless set explicitly.
        if "--drain-seconds" not in given:
            flags += ["--drain-seconds", "3"]
        return flags + extra

    def _start(self, svc: Service) -> Service:
        self.services[svc.name] = svc
        svc.start()
        return svc

    def _wait_ready(self, services: list[Service]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        for svc in services:
            svc.wait_port(deadline)
        for svc in services:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClusterError(f"{svc.name} at {svc.address} never became SERVING:\n{svc.log_tail()}")
                r = subprocess.run([self.binary("hypic-client"), "health", "--target", svc.address, "--service",
                                    svc.health_service, "--wait-seconds", str(min(remaining, 2.0))],
                                   capture_output=True, text=True)
                if r.returncode == 0:
                    break
                if not svc.alive():
                    raise ClusterError(f"{svc.name} exited with status {svc.proc.returncode}:\n{svc.log_tail()}")

    # ---- lifecycle ----
    def start(self) -> "LocalCluster":
        try:
            caches = [self._start(Service(f"cache-{i}", [self.binary("hypic-segment-cache")] + self._common("cache"),
                                          self.work_dir, "hypic.v1.SegmentCache"))
                      for i in range(self.cache_replicas)]
            self._wait_ready(caches)
            cache_flags = [f for c in caches for f in ("--cache", c.address)]
            workers = [self._start(Service(f"scatter-{i}", [self.binary("hypic-scatter-worker"), "--model", self.model]
                                           + cache_flags + self._common("scatter"),
                                           self.work_dir, "hypic.v1.ScatterWorker"))
                       for i in range(self.scatter_workers)]
            combine = self._start(Service("combine", [self.binary("hypic-combine-worker"), "--model", self.model,
                                                      "--tokenizer", self.tokenizer] + cache_flags
                                          + self._common("combine"), self.work_dir, "hypic.v1.CombineWorker"))
            self._wait_ready(workers + [combine])
            router = self._start(Service("router", [self.binary("hypic-router"), "--model", self.model,
                                                    "--tokenizer", self.tokenizer, "--combine", combine.address]
                                         + [f for w in workers for f in ("--scatter", w.address)] + cache_flags
                                         + self._common("router"), self.work_dir, "hypic.v1.Router"))
            self._wait_ready([router])
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def router_address(self) -> str:
        return self.services["router"].address

    def address(self, name: str) -> str:
        return self.services[name].address

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to one service (fault injection); it is then expected to be down."""
        self.expected_down.add(name)
        self.services[name].signal_group(sig)

    def restart(self, name: str) -> None:
        """Starts a service that was killed again, on its old address, and waits until it is SERVING (fault
        injection: the router and the workers find it again through their health probes). The old process group
        gets SIGKILL first if anything of it is left. Raises ClusterError if it does not come back in time."""
        svc = self.services[name]
        svc.signal_group(signal.SIGKILL)
        if svc.proc is not None:
            try:
                svc.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        svc.start(same_port=True)
        self._wait_ready([svc])
        self.expected_down.discard(name)

    def pid(self, name: str) -> int | None:
        """The process id of a running service (None when it is not running)."""
        svc = self.services[name]
        return svc.proc.pid if svc.alive() else None

    def wait_exit(self, name: str, timeout: float = 30.0) -> int:
        return self.services[name].proc.wait(timeout=timeout)

    def dead_services(self) -> list[str]:
        """Services that exited although nobody stopped them."""
        return [n for n, s in self.services.items() if not s.alive() and n not in self.expected_down]

    def fatal_dead_services(self) -> list[str]:
        """Dead services the cluster cannot serve without: the router and the combine worker. A scatter worker or
        a cache replica dying is a fault the cluster handles (segments are rebuilt on another scatter worker or by
        the combine worker; requests are computed without the cache), so the launcher reports it and goes on."""
        return [n for n in self.dead_services() if n in ("router", "combine")]

    def describe_exit(self, name: str) -> str:
        rc = self.services[name].proc.returncode if self.services[name].proc else None
        if rc is None:
            return f"{name} is running"
        return f"{name} exited with status {rc}" if rc >= 0 else f"{name} was killed by signal {-rc}"

    def stop(self) -> None:
        """SIGTERM to every process group (router first), SIGKILL to what is left after the grace period."""
        order = sorted(self.services.values(), key=lambda s: {"router": 0, "combine": 1}.get(s.name, 2))
        for svc in order:
            if svc.alive():
                svc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for svc in order:
            if svc.proc is None:
                continue
            try:
                svc.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Kill the whole group even if the leader exited (nothing of it may survive).
            svc.signal_group(signal.SIGKILL)
            try:
                svc.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_bin = Path(__file__).resolve().parent.parent / "build" / "bin"
    p.add_argument("--bin-dir", default=str(default_bin),
                   help=f"where the hypic binaries are (default {default_bin}, i.e. build/bin of this checkout)")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json")
    p.add_argument("--scatter-workers", type=int, default=2)
    p.add_argument("--cache-replicas", type=int, default=1, help="segment cache replicas (0: no cache)")
    p.add_argument("--work-dir", help="port files and logs/ (default: a temporary directory)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--device", help="where the scatter and combine workers compute: cpu | cuda | cuda:N "
                                    "(default: the workers' own default, cuda:0 when a GPU is visible, else cpu)")
    for role in ("cache", "scatter", "combine", "router"):
        p.add_argument(f"--{role}-arg", action="append", default=[], metavar="FLAG",
                       help=f"extra flag for the {role} service (repeat; use --{role}-arg=--flag=value)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run against the cluster")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    stop_signal = []

    def on_signal(signum, _frame):
        stop_signal.append(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    cluster = LocalCluster(args.bin_dir, args.model, args.tokenizer, args.scatter_workers, args.cache_replicas,
                           args.work_dir, {r: getattr(args, f"{r}_arg") for r in ("cache", "scatter", "combine",
                                                                                  "router")},
                           log_level=args.log_level, device=args.device)
    try:
        cluster.start()
        print(f"hypic cluster ready: router {cluster.router_address}", file=sys.stderr)
        for name, svc in cluster.services.items():
            print(f"  {name:10s} {svc.address}  log {svc.log_path}", file=sys.stderr)
        if command:
            argv = [a.replace("{router}", cluster.router_address) for a in command]
            env = dict(os.environ, HYPIC_ROUTER=cluster.router_address)
            child = subprocess.Popen(argv, env=env)
            reported: set[str] = set()
            while child.poll() is None:
                if stop_signal:
                    child.terminate()
                    child.wait()
                    return 130
                for n in cluster.dead_services():
                    if n not in reported:
                        reported.add(n)
                        print(f"local_cluster: {cluster.describe_exit(n)}; the cluster keeps serving without it"
                              if n not in cluster.fatal_dead_services() else
                              f"local_cluster: {cluster.describe_exit(n)}", file=sys.stderr)
                if cluster.fatal_dead_services():
                    child.terminate()
                    child.wait()
                    raise ClusterError("the cluster cannot serve any more: " +
                                       "; ".join(cluster.describe_exit(n) for n in cluster.fatal_dead_services()))
                time.sleep(0.1)
            # A command killed by a signal reports -signal; exit like a shell would (128 + signal).
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        print("Ctrl-C to stop", file=sys.stderr)
        reported_dead: set[str] = set()
        while not stop_signal:
            for n in cluster.dead_services():
                if n not in reported_dead:
                    reported_dead.add(n)
                    print(f"local_cluster: {cluster.describe_exit(n)}:\n{cluster.services[n].log_tail()}",
                          file=sys.stderr)
            if cluster.fatal_dead_services():
                return 1
            time.sleep(0.2)
        return 0
    except ClusterError as e:
        print(f"local_cluster: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
