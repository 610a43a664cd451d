#!/usr/bin/env python3
"""Starts a whole hypic cluster on loopback: segment cache replica(s), scatter workers, one combine
worker, the router and, with --http, the OpenAI-compatible HTTP front (hypic-openai), for one model
and tokenizer.

Ports: every service binds a free port (port 0) and reports it through --port-file, so several
clusters can run side by side (parallel tests), unless you fix it: --router-port, --cache-port
(a,b,... one per replica), --scatter-ports a,b,..., --combine-port, --http-port. The router
defaults to 127.0.0.1:50050 (hypic-client's and hypic-router's default) when that port is free, else
it takes a free one and says so; --router-port 0 always picks a free one. The launcher sets
--listen, --port-file and --parent-pid itself: pass them through --ROLE-arg and it refuses to start.
When the services have --metrics-listen (the Prometheus endpoint), each one also gets a metrics
port (127.0.0.1:0, read back through --metrics-port-file).

The launcher waits until each service answers its gRPC health check (through `hypic-client
health`; the HTTP front: its port accepts connections), then either waits for Ctrl-C / SIGTERM or
runs the command given after `--` and exits with that command's status. In the command, these
placeholders are replaced by addresses (host:port), and the same values are in its environment:

  {router}                        HYPIC_ROUTER
  {cache} {cache0} {cache1} ...   HYPIC_CACHE HYPIC_CACHE0 ...  (replicas; {cache} is the first)
  {caches}                        HYPIC_CACHES                  (every replica, comma-separated)
  {scatter0} {scatter1} ...       HYPIC_SCATTER0 ...            ({scatter} the first, {scatters} all)
  {combine}                       HYPIC_COMBINE
  {http}                          HYPIC_HTTP                    (with --http)
  {metrics} {metrics_router} {metrics_cache0} {metrics_scatter0} {metrics_combine} {metrics_http} ...
                                  HYPIC_METRICS ...             (metrics endpoints; {metrics} is the router's)
  {work_dir}                      HYPIC_WORK_DIR                (port files, logs/, cluster.json)

The same addresses are written to WORK_DIR/cluster.json.

Logs: WORK_DIR/logs/<service>.log. Without --work-dir the work dir is a new temporary directory,
removed at exit when everything went well and KEPT when something failed (a service that did not
start or died, a command that failed); the launcher then prints where the logs are.

No process is left behind: each service runs in its own process group; on exit, Ctrl-C, SIGTERM,
a failed start or the router or the combine worker dying, every group gets SIGTERM, then SIGKILL
after a grace period. If the launcher itself is killed (even with SIGKILL) the services die with
it: they are started with PR_SET_PDEATHSIG (Linux) and --parent-pid.

Python 3.11 standard library only. Usable as a module (tests): LocalCluster(...) as a context
manager; its addresses() gives the placeholders' values.

Example:
  deploy/local_cluster.py --bin-dir build/bin --model /tmp/demo --tokenizer tokenizer.json \\
      -- build/bin/hypic-client generate --router {router} --segment-file README.md --query "Summarise."
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
DEFAULT_ROUTER_PORT = 50050  # hypic-router's own default --listen and hypic-client's default --router
HOST = "127.0.0.1"
ROLES = ("cache", "scatter", "combine", "router", "http")
BINARIES = {"cache": "hypic-segment-cache", "scatter": "hypic-scatter-worker", "combine": "hypic-combine-worker",
            "router": "hypic-router", "http": "hypic-openai"}
PORT_OPTIONS = {"cache": "--cache-port", "scatter": "--scatter-ports", "combine": "--combine-port",
                "router": "--router-port", "http": "--http-port"}
# Flags the launcher sets on every service; given again through --ROLE-arg they would be given twice.
RESERVED_FLAGS = ("--listen", "--port-file", "--parent-pid", "--metrics-listen", "--metrics-port-file")
# Placeholders the launcher knows (an unavailable one, e.g. {http} without --http, is an error).
PLACEHOLDER_RE = re.compile(r"\{(router|caches?|cache\d+|scatters?|scatter\d+|combine|http|work_dir|"
                            r"metrics(?:_(?:router|cache\d*|scatter\d*|combine|http))?)\}")


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the launcher's thread that started it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: --parent-pid still stops the service


def foreground_group(pgid: int) -> tuple[int, int] | None:
    """Makes process group `pgid` the terminal's foreground group when stdin is a terminal; returns what to restore
    (restore_foreground), else None."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd):
            return None
        previous = os.tcgetpgrp(fd)
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may not change it otherwise
        try:
            os.tcsetpgrp(fd, pgid)
        finally:
            signal.signal(signal.SIGTTOU, old)
        return fd, previous
    except (OSError, ValueError):
        return None


def restore_foreground(saved: tuple[int, int] | None) -> None:
    if saved is None:
        return
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(*saved)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


def end_command_group(pgid: int, grace: float = 3.0) -> None:
    """Ends what is left of the command's process group (background children it started): SIGTERM, then SIGKILL
    after `grace` seconds."""
    def alive() -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    if not alive():
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ClusterError(RuntimeError):
    """A service failed to start or died."""


class UsageError(ClusterError):
    """The launcher was given options it cannot honour (a reserved flag, a bad port list, a missing binary)."""


def port_free(port: int, host: str = HOST) -> bool:
    """True when nothing listens on host:port. (gRPC servers bind with SO_REUSEPORT, so a second one could share
    a port that a server holds; this probe binds without it, so it fails while any server holds the port.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as the services have it: connections in TIME_WAIT do not make the port look busy, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _port_lock():
    """Serialises "is the port free? start the service on it" between launchers on this host (two launchers
    starting at once could otherwise both see a fixed port free and, through SO_REUSEPORT, both bind it)."""
    path = Path(tempfile.gettempdir()) / f"hypic-local-cluster-ports-{os.getuid()}.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Service:
    """One service process."""

    def __init__(self, name: str, role: str, argv: list[str], work_dir: Path, health_service: str | None,
                 fixed_port: int = 0, metrics: bool = False):
        self.name = name
        self.role = role
        self.argv = argv
        self.health_service = health_service  # None: an HTTP service, ready when its port accepts connections
        self.fixed_port = fixed_port
        self.metrics = metrics
        self.port_file = work_dir / f"{name}.port"
        self.metrics_port_file = work_dir / f"{name}.metrics.port"
        self.log_path = work_dir / "logs" / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def metrics_address(self) -> str | None:
        return f"{HOST}:{self.metrics_port}" if self.metrics_port else None

    def start(self, same_port: bool = False) -> None:
        """Starts the process: on its fixed port, else a free one (reported through the port file); with same_port
        on the port it had before (a restart, so that the services that know its address find it again)."""
        self.port_file.unlink(missing_ok=True)
        self.metrics_port_file.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        port = self.port if same_port and self.port else self.fixed_port
        argv = self.argv + ["--listen", f"{HOST}:{port}", "--port-file", str(self.port_file),
                            "--parent-pid", str(os.getpid())]
        if self.metrics:
            mport = self.metrics_port if same_port and self.metrics_port else 0
            argv += ["--metrics-listen", f"{HOST}:{mport}", "--metrics-port-file", str(self.metrics_port_file)]
        try:
            # Several services share this host: one OpenBLAS thread each unless the user chose otherwise
            # (N services x N cores threads oversubscribe the CPU and slow every GEMM).
            env = dict(os.environ)
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
            # NVLink multicast stays off wherever NCCL may run (the services force it too): on a shared GPU host a
            # program using it can take every GPU of the host out of service.
            env["NCCL_NVLS_ENABLE"] = "0"
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent, env=env)
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e.strerror})"

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _read_port(path: Path) -> int | None:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text else None

    def wait_port(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            port = self._read_port(self.port_file)
            if port is not None:
                self.port = port
                if self.metrics:
                    self.metrics_port = self._read_port(self.metrics_port_file)
                    if self.metrics_port is None:
                        raise ClusterError(f"{self.name} started without writing its metrics port file "
                                           f"{self.metrics_port_file}:\n{self.log_tail()}")
                return
            if not self.alive():
                raise ClusterError(f"{self.name} exited with status {self.proc.returncode} before listening "
                                   f"(log {self.log_path}):\n{self.log_tail()}")
            time.sleep(0.05)
        raise ClusterError(f"{self.name} did not report a port in time (log {self.log_path}):\n{self.log_tail()}")


class LocalCluster:
    """The cluster: cache replica(s) (optional), N scatter workers, one combine worker, the router, and with http the
    OpenAI-compatible HTTP front.

    extra_args maps a role ("cache", "scatter", "combine", "router", "http") to extra command-line flags (never
    --listen, --port-file, --parent-pid, --metrics-*: the launcher sets those; UsageError). device ("cpu", "cuda",
    "cuda:N") is passed to the scatter and combine workers as --device; None leaves their default (cuda:0 when the
    build has CUDA and a GPU is visible, else cpu). A comma-separated list ("cuda:0,cuda:1,cuda:2") spreads them
    over several GPUs: the combine worker takes the first, scatter worker i the ((1 + i) mod n)-th, so that with a
    GPU per scatter worker entries go GPU to GPU over NCCL (a scatter worker on the combine worker's GPU, the n-th,
    falls back to gRPC by itself).

    Ports: router_port, combine_port, http_port (0: a free one), cache_ports and scatter_ports (one per replica /
    worker; None: free ones). prefer_router_port: a port the router takes when it is free (else a free one; the
    command-line launcher passes 50050). metrics: None starts each service with --metrics-listen 127.0.0.1:0 when
    its binary has that flag; False never; True requires it.

    work_dir: port files and logs/. None: a temporary directory, removed by stop() unless something failed
    (a service did not start or died unexpectedly, or mark_failed() was called); kept_work_dir then names it.
    """

    def __init__(self, bin_dir: str | Path, model: str | Path, tokenizer: str | Path, scatter_workers: int = 2,
                 cache_replicas: int = 1, work_dir: str | Path | None = None,
                 extra_args: dict[str, list[str]] | None = None, ready_timeout: float = 120.0,
                 grace_seconds: float = 10.0, log_level: str = "info", device: str | None = None, *,
                 router_port: int = 0, prefer_router_port: int | None = None, combine_port: int = 0,
                 cache_ports: list[int] | None = None, scatter_ports: list[int] | None = None,
                 http: bool = False, http_port: int = 0, metrics: bool | None = None, tls: bool = False):
        self.bin_dir = Path(bin_dir)
        self.model = str(model)
        self.tokenizer = str(tokenizer)
        self.scatter_workers = scatter_workers
        self.cache_replicas = cache_replicas
        self.extra = extra_args or {}
        self.ready_timeout = ready_timeout
        self.grace_seconds = grace_seconds
        self.log_level = log_level
        self.device = device
        self.http = http
        self.metrics = metrics
        self.tls = tls  # TLS everywhere (mTLS between services) and a bearer token on the router and the HTTP front
        self.services: dict[str, Service] = {}
        self.expected_down: set[str] = set()
        self.failed = False
        self.failure = ""  # what failed, in words (for the message naming the kept logs)
        self.kept_work_dir: Path | None = None
        self._help: dict[str, str] = {}
        self._check_extra_args()
        self.ports = self._check_ports(router_port, combine_port, http_port, cache_ports, scatter_ports)
        self.prefer_router_port = prefer_router_port if router_port == 0 else None
        self._own_work_dir = work_dir is None
        if work_dir is None:
            work_dir = tempfile.mkdtemp(prefix="hypic-cluster-")
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)

    # ---- checks ----
    def _check_extra_args(self) -> None:
        for role, args in self.extra.items():
            if role not in ROLES:
                raise UsageError(f"extra_args: unknown role {role!r} (one of {', '.join(ROLES)})")
            for a in args:
                flag = a.split("=", 1)[0]
                if flag in RESERVED_FLAGS:
                    fix = (f"fix its port with {PORT_OPTIONS[role]} PORT" if flag == "--listen" else
                           "the metrics endpoints are on 127.0.0.1:0; their addresses are in {metrics_...}"
                           if flag.startswith("--metrics") else "it is the launcher's")
                    raise UsageError(f"--{role}-arg={a}: the launcher sets {flag} of every service itself "
                                     f"(giving it twice makes the service exit); {fix}")

    def _check_ports(self, router_port, combine_port, http_port, cache_ports, scatter_ports) -> dict:
        def one(what: str, p: int) -> int:
            if not isinstance(p, int) or not 0 <= p <= 65535:
                raise UsageError(f"{what}: {p!r} is not a port number in [0, 65535]")
            return p

        def many(what: str, ports: list[int] | None, n: int, noun: str) -> list[int]:
            if ports is None:
                return [0] * n
            if len(ports) != n:
                raise UsageError(f"{what}: {len(ports)} port(s) given for {n} {noun} (one each, comma-separated)")
            return [one(what, p) for p in ports]

        ports = {"router": one(PORT_OPTIONS["router"], router_port),
                 "combine": one(PORT_OPTIONS["combine"], combine_port),
                 "http": one(PORT_OPTIONS["http"], http_port),
                 "cache": many(PORT_OPTIONS["cache"], cache_ports, self.cache_replicas, "cache replica(s)"),
                 "scatter": many(PORT_OPTIONS["scatter"], scatter_ports, self.scatter_workers, "scatter worker(s)")}
        if http_port and not self.http:
            raise UsageError("--http-port needs --http (the HTTP front is started only with --http)")
        fixed = [p for v in ports.values() for p in (v if isinstance(v, list) else [v]) if p]
        dup = sorted({p for p in fixed if fixed.count(p) > 1})
        if dup:
            raise UsageError(f"port(s) {', '.join(map(str, dup))} given to more than one service")
        return ports

    # ---- helpers ----
    def binary(self, name: str) -> str:
        path = self.bin_dir / name
        if not path.exists():
            if name == BINARIES["http"]:
                raise UsageError(f"--http: {path} not found: the OpenAI-compatible HTTP front is not built "
                                 f"(cmake --build build --target hypic-openai), or pass --bin-dir")
            raise UsageError(f"{path} not found: pass --bin-dir, or build with scripts/build.sh")
        return str(path)

    def _help_of(self, binary: str) -> str:
        if binary not in self._help:
            try:
                r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=20)
                self._help[binary] = r.stdout + r.stderr
            except (OSError, subprocess.TimeoutExpired):
                self._help[binary] = ""
        return self._help[binary]

    def supports(self, role: str, flag: str) -> bool:
        """Does the role's binary take `flag` (as its --help lists it)?"""
        return re.search(rf"(^|[\s,]){re.escape(flag)}([\s=]|$)", self._help_of(self.binary(BINARIES[role])),
                         re.M) is not None

    def _metrics_for(self, role: str) -> bool:
        if self.metrics is False:
            return False
        has = self.supports(role, "--metrics-listen")
        if self.metrics is True and not has:
            raise UsageError(f"--metrics: {BINARIES[role]} has no --metrics-listen (rebuild it)")
        return has

    @property
    def tls_dir(self) -> Path:
        """With tls: the certificates (scripts/make_certs.sh: ca.crt; server.crt/.key, the services' identity
        hypic-service, which they serve and call with; client.crt/.key, the user identity hypic-user, which the
        command and clients get: it reaches the router only) and the bearer token (token), made at start."""
        return self.work_dir / "tls"

    @property
    def cache_key_path(self) -> Path:
        """The cluster key the scatter and combine workers sign and verify segment entries with (--cache-key-file;
        proto/rpc/entry_mac.h), made at start."""
        return self.work_dir / "cache.key"

    def _make_cache_key(self) -> None:
        fd = os.open(self.cache_key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")

    def service_tls_flags(self) -> list[str]:
        """The calling flags of a service (its own certificate, identity hypic-service): what an operator's tool
        needs to call the internal services (cache puts, workers) directly. [] without tls."""
        if not self.tls:
            return []
        d = self.tls_dir
        return ["--tls-ca", str(d / "ca.crt"), "--tls-client-cert", str(d / "server.crt"),
                "--tls-client-key", str(d / "server.key")]

    def _make_tls(self) -> None:
        make_certs = Path(__file__).resolve().parent.parent / "scripts" / "make_certs.sh"
        r = subprocess.run([str(make_certs), str(self.tls_dir)], capture_output=True, text=True)
        if r.returncode != 0:
            raise ClusterError(f"--tls: scripts/make_certs.sh failed: {r.stderr.strip()}")
        token = self.tls_dir / "token"
        token.write_text(os.urandom(24).hex() + "\n")
        token.chmod(0o600)

    def client_tls_flags(self) -> list[str]:
        """The flags a hypic-client (or any caller) needs for this cluster: [] without tls."""
        if not self.tls:
            return []
        d = self.tls_dir
        return ["--tls-ca", str(d / "ca.crt"), "--tls-client-cert", str(d / "client.crt"),
                "--tls-client-key", str(d / "client.key")]

    def _tls_flags(self, role: str) -> list[str]:
        if not self.tls:
            return []
        d = self.tls_dir
        serve = ["--tls-cert", str(d / "server.crt"), "--tls-key", str(d / "server.key")]
        token = str(d / "token")
        if role == "http":  # public HTTPS (no client certificates), mTLS to the router (a user), tokens both ways
            return serve + self.client_tls_flags() + ["--auth-token-file", token, "--router-token-file", token]
        flags = serve + ["--tls-client-ca", str(d / "ca.crt")] + self.service_tls_flags()
        if role == "router":
            flags += ["--auth-token-file", token]
        return flags

    def device_of(self, name: str) -> str | None:
        """The --device of service `name` ("combine", "scatter-3"): see the class comment."""
        if self.device is None:
            return None
        devices = [d.strip() for d in self.device.split(",") if d.strip()]
        if not devices:
            raise UsageError(f"device {self.device!r}: no device named")
        if name == "combine" or len(devices) == 1:
            return devices[0]
        i = int(name.split("-")[1])
        return devices[(1 + i) % len(devices)]

    def _common(self, role: str, name: str) -> list[str]:
        extra = self.extra.get(role, [])
        given = {a.split("=")[0] for a in extra if a.startswith("--")}
        flags = self._tls_flags(role)
        if role in ("scatter", "combine") and "--cache-key-file" not in given and self.supports(role, "--cache-key-file"):
            flags += ["--cache-key-file", str(self.cache_key_path)]
        if "--log-level" not in given and (role != "http" or self.supports(role, "--log-level")):
            flags += ["--log-level", self.log_level]
        if self.device is not None and role in ("scatter", "combine") and "--device" not in given:
            flags += ["--device", self.device_of(name)]
        # Short drain so that teardown is quick (the services' default is 10 s), unless set explicitly.
        if "--drain-seconds" not in given and (role != "http" or self.supports(role, "--drain-seconds")):
            flags += ["--drain-seconds", "3"]
        return flags + extra

    def _service(self, name: str, role: str, args: list[str], health: str | None, port: int) -> Service:
        svc = Service(name, role, [self.binary(BINARIES[role])] + args + self._common(role, name), self.work_dir, health,
                      port, self._metrics_for(role))
        self.services[name] = svc
        return svc

    def _start_all(self, services: list[Service]) -> None:
        """Starts services and waits until they report their ports. Fixed ports are checked first (a clear error
        instead of a service that cannot bind) under a host-wide lock held until they are bound."""
        fixed = [s for s in services if s.fixed_port]
        with _port_lock() if fixed else contextlib.nullcontext():
            for s in fixed:
                if not port_free(s.fixed_port):
                    raise ClusterError(f"{s.name}: port {s.fixed_port} on {HOST} is in use (another cluster or "
                                       f"service?); choose another with {PORT_OPTIONS[s.role]}, or 0 for a free one")
            for s in services:
                s.start()
            deadline = time.monotonic() + self.ready_timeout
            for s in services:
                s.wait_port(deadline)

    def _wait_ready(self, services: list[Service]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        for svc in services:
            svc.wait_port(deadline)
        for svc in services:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClusterError(f"{svc.name} at {svc.address} never became SERVING (log {svc.log_path}):\n"
                                       f"{svc.log_tail()}")
                if svc.health_service is None:
                    try:
                        socket.create_connection((HOST, svc.port), timeout=min(remaining, 2.0)).close()
                        break
                    except OSError:
                        time.sleep(0.1)
                else:
                    r = subprocess.run([self.binary("hypic-client"), "health", "--target", svc.address, "--service",
                                        svc.health_service, "--wait-seconds", str(min(remaining, 2.0))]
                                       + self.client_tls_flags(),
                                       capture_output=True, text=True)
                    if r.returncode == 0:
                        break
                if not svc.alive():
                    raise ClusterError(f"{svc.name} exited with status {svc.proc.returncode} (log {svc.log_path}):"
                                       f"\n{svc.log_tail()}")

    def _start_router(self, router: Service) -> None:
        prefer = self.prefer_router_port
        if prefer:
            with _port_lock():
                if port_free(prefer):
                    router.fixed_port = prefer
                    router.start()
                    try:
                        router.wait_port(time.monotonic() + self.ready_timeout)
                        return
                    except ClusterError:
                        if router.alive() or "cannot listen on" not in router.log_tail():
                            raise
                        # It could not take the port after all (e.g. taken in between): a free one instead.
                        router.signal_group(signal.SIGKILL)
                router.fixed_port = 0
        self._start_all([router])

    # ---- lifecycle ----
    def start(self) -> "LocalCluster":
        try:
            for role in ("cache", "scatter", "combine", "router"):
                self.binary(BINARIES[role])
            self.binary("hypic-client")
            if self.http:
                self.binary(BINARIES["http"])
            # Every fixed port is checked before anything starts (each start checks its own again, under the lock).
            roles = {"router": PORT_OPTIONS["router"], "combine": PORT_OPTIONS["combine"], "http": PORT_OPTIONS["http"],
                     "cache": PORT_OPTIONS["cache"], "scatter": PORT_OPTIONS["scatter"]}
            for role, option in roles.items():
                ports = self.ports[role] if isinstance(self.ports[role], list) else [self.ports[role]]
                for p in ports:
                    if p and not port_free(p):
                        raise UsageError(f"{role}: port {p} on {HOST} is in use (another cluster or service?); "
                                           f"choose another with {option}, or 0 for a free one")
            if self.tls:
                self._make_tls()
            self._make_cache_key()
            caches = [self._service(f"cache-{i}", "cache", [], "hypic.v1.SegmentCache", self.ports["cache"][i])
                      for i in range(self.cache_replicas)]
            self._start_all(caches)
            self._wait_ready(caches)
            cache_flags = [f for c in caches for f in ("--cache", c.address)]
            combine = self._service("combine", "combine", ["--model", self.model, "--tokenizer", self.tokenizer]
                                    + cache_flags, "hypic.v1.CombineWorker", self.ports["combine"])
            # The combine worker's port first: the scatter workers deliver only to it (--combine, their allow-list).
            self._start_all([combine])
            allow = (["--combine", combine.address] if self.supports("scatter", "--combine")
                     and "--combine" not in self.extra.get("scatter", []) else [])
            workers = [self._service(f"scatter-{i}", "scatter", ["--model", self.model] + cache_flags + allow,
                                     "hypic.v1.ScatterWorker", self.ports["scatter"][i])
                       for i in range(self.scatter_workers)]
            self._start_all(workers)
            self._wait_ready(workers + [combine])
            router = self._service("router", "router",
                                   ["--model", self.model, "--tokenizer", self.tokenizer, "--combine", combine.address]
                                   + [f for w in workers for f in ("--scatter", w.address)] + cache_flags,
                                   "hypic.v1.Router", self.ports["router"])
            self._start_router(router)
            self._wait_ready([router])
            if self.http:
                http = self._service("http", "http", ["--router", router.address, "--tokenizer", self.tokenizer],
                                     None, self.ports["http"])
                self._start_all([http])
                self._wait_ready([http])
            self._write_cluster_json()
        except BaseException as e:
            if not isinstance(e, (KeyboardInterrupt, UsageError)):  # a usage error started nothing worth keeping
                self.mark_failed("the cluster did not start")
            self.stop()
            raise
        return self

    def _write_cluster_json(self) -> None:
        doc = {"addresses": self.addresses(),
               "services": {n: {"address": s.address, "metrics": s.metrics_address, "pid": s.proc.pid,
                                "log": str(s.log_path)} for n, s in self.services.items()}}
        (self.work_dir / "cluster.json").write_text(json.dumps(doc, indent=2) + "\n")

    @property
    def router_address(self) -> str:
        return self.services["router"].address

    @property
    def cache_addresses(self) -> list[str]:
        return [self.services[f"cache-{i}"].address for i in range(self.cache_replicas)]

    @property
    def scatter_addresses(self) -> list[str]:
        return [self.services[f"scatter-{i}"].address for i in range(self.scatter_workers)]

    @property
    def combine_address(self) -> str:
        return self.services["combine"].address

    @property
    def http_address(self) -> str | None:
        return self.services["http"].address if "http" in self.services else None

    def metrics_address(self, name: str) -> str | None:
        """The metrics endpoint of a service (None without metrics)."""
        return self.services[name].metrics_address

    def address(self, name: str) -> str:
        return self.services[name].address

    def addresses(self) -> dict[str, str]:
        """Placeholder name -> address, for the services started: router, cache (the first replica), cache0...,
        caches (all, comma-separated), scatter (the first), scatter0..., scatters, combine, http, work_dir, and the
        metrics endpoints: metrics (the router's), metrics_router, metrics_cache, metrics_cache0...,
        metrics_scatter0..., metrics_combine, metrics_http. The environment names are HYPIC_ + the name in capitals."""
        out: dict[str, str] = {}
        metrics: dict[str, str] = {}

        def put(key: str, svc: Service) -> None:
            out[key] = svc.address
            if svc.metrics_address:
                metrics[f"metrics_{key}"] = svc.metrics_address

        for role, many in (("cache", self.cache_replicas), ("scatter", self.scatter_workers)):
            names = [f"{role}-{i}" for i in range(many) if f"{role}-{i}" in self.services]
            for i, n in enumerate(names):
                put(f"{role}{i}", self.services[n])
            if names:
                put(role, self.services[names[0]])
                out[f"{role}s"] = ",".join(self.services[n].address for n in names)
        for name in ("combine", "router", "http"):
            if name in self.services:
                put(name, self.services[name])
        if "metrics_router" in metrics:
            metrics["metrics"] = metrics["metrics_router"]
        out.update(metrics)
        out["work_dir"] = str(self.work_dir)
        return out

    def environment(self) -> dict[str, str]:
        """HYPIC_ROUTER, HYPIC_CACHE, ... (see addresses()); with tls also HYPIC_TLS_CA, HYPIC_TLS_CLIENT_CERT,
        HYPIC_TLS_CLIENT_KEY and HYPIC_TOKEN_FILE, which hypic-client reads as its --tls-* and --token-file."""
        env = {f"HYPIC_{k.upper()}": v for k, v in self.addresses().items()}
        if self.tls:
            d = self.tls_dir
            env.update(HYPIC_TLS_CA=str(d / "ca.crt"), HYPIC_TLS_CLIENT_CERT=str(d / "client.crt"),
                       HYPIC_TLS_CLIENT_KEY=str(d / "client.key"), HYPIC_TOKEN_FILE=str(d / "token"))
        return env

    def placeholder_names(self) -> list[str]:
        """The placeholders (see addresses()) this cluster will have once started: known before start(), so that a
        command can be checked first (check_command)."""
        names: list[str] = []
        services = [("router", "router")]
        for role, n in (("cache", self.cache_replicas), ("scatter", self.scatter_workers)):
            services += [(f"{role}{i}", role) for i in range(n)]
            if n:
                services.append((role, role))
                names.append(f"{role}s")
        services.append(("combine", "combine"))
        if self.http:
            services.append(("http", "http"))
        for key, role in services:
            names.append(key)
            if self._metrics_for(role):
                names.append(f"metrics_{key}")
                if key == "router":
                    names.append("metrics")
        return names + ["work_dir"]

    def check_command(self, argv: list[str]) -> None:
        """Raises UsageError if the command uses a placeholder that names nothing this cluster starts."""
        self._placeholders(argv, {k: "" for k in self.placeholder_names()})

    def _placeholders(self, argv: list[str], values: dict[str, str]) -> list[str]:
        def repl(m: re.Match) -> str:
            key = m.group(1)
            if key in values:
                return values[key]
            why = ("start the HTTP front with --http" if "http" in key else
                   "the services have no --metrics-listen (or metrics are off)" if key.startswith("metrics") else
                   "no such service in this cluster")
            raise UsageError(f"the command uses {{{key}}}, which names nothing started here ({why}); available: "
                             + " ".join(f"{{{k}}}" for k in values))

        return [PLACEHOLDER_RE.sub(repl, a) for a in argv]

    def substitute(self, argv: list[str]) -> list[str]:
        """Replaces the placeholders ({router}, {cache0}, ...) in a command. Raises UsageError for one of them that
        names nothing started here (e.g. {http} without --http, {cache1} with one replica); other text in braces is
        left alone."""
        return self._placeholders(argv, self.addresses())

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
        the combine worker; requests are computed without the cache), so the launcher reports it and goes on. The
        HTTP front dying ends the cluster too (its clients have nothing else to talk to)."""
        return [n for n in self.dead_services() if n in ("router", "combine", "http")]

    def describe_exit(self, name: str) -> str:
        rc = self.services[name].proc.returncode if self.services[name].proc else None
        if rc is None:
            return f"{name} is running"
        return f"{name} exited with status {rc}" if rc >= 0 else f"{name} was killed by signal {-rc}"

    def mark_failed(self, what: str = "") -> None:
        """Something went wrong (e.g. the command run against the cluster failed): stop() keeps the logs."""
        self.failed = True
        self.failure = self.failure or what

    def stop(self) -> None:
        """SIGTERM to every process group (router first), SIGKILL to what is left after the grace period. A temporary
        work dir is then removed, unless something failed: then it is kept (kept_work_dir)."""
        if self.dead_services():
            self.mark_failed("; ".join(self.describe_exit(n) for n in self.dead_services()))
        order = sorted(self.services.values(), key=lambda s: {"http": 0, "router": 1, "combine": 2}.get(s.name, 3))
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
        if self._own_work_dir and self.work_dir.exists():
            if self.failed:
                self.kept_work_dir = self.work_dir
            else:
                shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        if exc and exc[0] is not None and not issubclass(exc[0], KeyboardInterrupt):
            self.mark_failed(f"{exc[0].__name__} while the cluster was running")
        self.stop()


def _port(text: str) -> int:
    try:
        p = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"{p} is not a port number in [0, 65535]")
    return p


def _ports(text: str) -> list[int]:
    return [_port(t.strip()) for t in text.split(",") if t.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_bin = Path(__file__).resolve().parent.parent / "build" / "bin"
    p.add_argument("--bin-dir", default=str(default_bin),
                   help=f"where the hypic binaries are (default {default_bin}, i.e. build/bin of this checkout)")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json")
    p.add_argument("--scatter-workers", type=int, default=2)
    p.add_argument("--cache-replicas", type=int, default=1, help="segment cache replicas (0: no cache)")
    p.add_argument("--work-dir", help="port files, cluster.json and logs/ (default: a temporary directory, removed at "
                                      "exit unless something failed)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--device", help="where the scatter and combine workers compute: cpu | cuda | cuda:N, or a list "
                                    "cuda:0,cuda:1,... (the combine worker on the first, scatter worker i on the "
                                    "((1 + i) mod n)-th; entries then go GPU to GPU over NCCL) (default: the workers' own "
                                    "default, cuda:0 when a GPU is visible, else cpu)")
    p.add_argument("--router-port", type=_port, default=None,
                   help=f"the router's port on {HOST} (default {DEFAULT_ROUTER_PORT}, hypic-client's default, when it "
                        f"is free, else a free one; 0: always a free one)")
    p.add_argument("--cache-port", "--cache-ports", dest="cache_port", type=_ports, default=None,
                   metavar="PORT[,PORT...]", help="the cache replicas' ports, one per replica (default: free ones)")
    p.add_argument("--scatter-ports", "--scatter-port", dest="scatter_ports", type=_ports, default=None,
                   metavar="PORT[,PORT...]",
                   help="the scatter workers' ports, one per worker (default: free ones)")
    p.add_argument("--combine-port", type=_port, default=0, help="the combine worker's port (default 0: a free one)")
    p.add_argument("--http", action="store_true",
                   help="also start the OpenAI-compatible HTTP front (hypic-openai) in front of the router: {http}")
    p.add_argument("--http-port", type=_port, default=0, help="the HTTP front's port (default 0: a free one)")
    p.add_argument("--tls", action="store_true",
                   help="TLS on every port (certificates made by scripts/make_certs.sh in WORK_DIR/tls), client "
                        "certificates required on every gRPC port (the services present server.crt, identity "
                        "hypic-service; you and the command get client.crt, identity hypic-user, which reaches the "
                        "router only: the cache and the workers refuse it), and a "
                        "bearer token (WORK_DIR/tls/token) on the router and the HTTP front (HTTPS, no client "
                        "certificate); the ready lines print the client flags; the command gets HYPIC_TLS_CA, HYPIC_TLS_CLIENT_CERT, HYPIC_TLS_CLIENT_KEY and "
                        "HYPIC_TOKEN_FILE, which hypic-client reads")
    p.add_argument("--no-metrics", action="store_true",
                   help="do not give the services a metrics endpoint (default: one on 127.0.0.1:0 each, when the "
                        "binaries have --metrics-listen)")
    for role in ROLES:
        p.add_argument(f"--{role}-arg", action="append", default=[], metavar="FLAG",
                       help=f"extra flag for the {role} service (repeat; use --{role}-arg=--flag=value; not "
                            f"--listen, --port-file, --parent-pid: the launcher sets them)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run against the cluster (placeholders "
                                                              "above)")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    stop_signal = []

    def on_signal(signum, _frame):
        stop_signal.append(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    cluster = None
    try:
        cluster = LocalCluster(args.bin_dir, args.model, args.tokenizer, scatter_workers=args.scatter_workers,
                               cache_replicas=args.cache_replicas, work_dir=args.work_dir,
                               extra_args={r: getattr(args, f"{r}_arg") for r in ROLES},
                               log_level=args.log_level, device=args.device,
                               router_port=args.router_port or 0,
                               prefer_router_port=DEFAULT_ROUTER_PORT if args.router_port is None else None,
                               combine_port=args.combine_port, cache_ports=args.cache_port,
                               scatter_ports=args.scatter_ports, http=args.http, http_port=args.http_port,
                               metrics=False if args.no_metrics else None, tls=args.tls)
        for role in ROLES:  # a missing binary is a usage error, found before anything starts
            if role != "http" or args.http:
                cluster.binary(BINARIES[role])
        cluster.check_command(command)  # and so is a placeholder that names nothing ({http} without --http...)
    except UsageError as e:
        print(f"local_cluster: error: {e}", file=sys.stderr)
        if cluster is not None and cluster._own_work_dir:
            shutil.rmtree(cluster.work_dir, ignore_errors=True)
        return 2

    def report_dead(reported: set[str]) -> None:
        for n in cluster.dead_services():
            if n not in reported:
                reported.add(n)
                svc = cluster.services[n]
                keeps = "" if n in cluster.fatal_dead_services() else "; the cluster keeps serving without it"
                print(f"local_cluster: {cluster.describe_exit(n)}{keeps}; its log ({svc.log_path}) ends with:\n"
                      f"{svc.log_tail(15)}", file=sys.stderr)

    try:
        try:
            cluster.start()
            if command:
                argv = cluster.substitute(command)  # before anything is printed: a bad placeholder is a usage error
        except UsageError as e:
            print(f"local_cluster: error: {e}", file=sys.stderr)
            cluster.failed = False  # nothing went wrong in the cluster itself
            return 2
        # The first line is parsed by tools (bench/cluster/cluster_process.cpp): the router's address ends it.
        print(f"hypic cluster ready: router {cluster.router_address}", file=sys.stderr)
        router_svc = cluster.services["router"]
        if cluster.prefer_router_port and router_svc.port != cluster.prefer_router_port:
            print(f"  (port {cluster.prefer_router_port}, hypic-client's default --router, is in use: the router took "
                  f"a free one; pass --router {router_svc.address} to clients, or fix it with --router-port)",
                  file=sys.stderr)
        for name, svc in cluster.services.items():
            metrics = f"  metrics {svc.metrics_address}" if svc.metrics_address else ""
            print(f"  {name:10s} {svc.address}{metrics}  log {svc.log_path}", file=sys.stderr)
        if cluster.tls:
            d = cluster.tls_dir
            print(f"  TLS on every port, client certificates required (the HTTP front: HTTPS, no client certificate)"
                  f"; a bearer token on the router and the HTTP front. Clients need:\n"
                  f"    hypic-client ... --tls-ca {d / 'ca.crt'} --tls-client-cert {d / 'client.crt'} "
                  f"--tls-client-key {d / 'client.key'} --token-file {d / 'token'}\n"
                  f"    (or the environment HYPIC_TLS_CA, HYPIC_TLS_CLIENT_CERT, HYPIC_TLS_CLIENT_KEY, "
                  f"HYPIC_TOKEN_FILE, which a command after -- gets); client.crt is a user: it reaches the router only.\n"
                  f"    An operator calling the cache or a worker directly presents the services' certificate: "
                  f"--tls-client-cert {d / 'server.crt'} --tls-client-key {d / 'server.key'}\n"
                  f"    curl --cacert {d / 'ca.crt'} -H \"Authorization: Bearer $(cat {d / 'token'})\" https://...",
                  file=sys.stderr)
        if cluster._own_work_dir:
            print(f"  logs in {cluster.work_dir / 'logs'}: a temporary directory, removed at exit unless something "
                  f"fails (then kept and named); --work-dir DIR keeps them", file=sys.stderr)
        if command:
            env = dict(os.environ, **cluster.environment())
            try:
                # Its own process group, so that whatever it leaves running in the background ends with it
                # (end_command_group); on a terminal that group is made the foreground one (it may read the terminal).
                # It is killed if the launcher dies (SIGKILL included), as the services are.
                child = subprocess.Popen(argv, env=env, process_group=0, preexec_fn=_die_with_parent)
            except OSError as e:  # not found, not executable, no interpreter line (Exec format error)
                print(f"local_cluster: cannot run the command {argv[0]!r}: {e.strerror or e}", file=sys.stderr)
                cluster.mark_failed(f"the command could not be started ({e.strerror or e})")
                return 127
            terminal = foreground_group(child.pid)
            reported: set[str] = set()
            try:
                while child.poll() is None:
                    if stop_signal:
                        child.terminate()
                        child.wait()
                        return 130
                    report_dead(reported)
                    if cluster.fatal_dead_services():
                        child.terminate()
                        child.wait()
                        raise ClusterError("the cluster cannot serve any more: " +
                                           "; ".join(cluster.describe_exit(n) for n in cluster.fatal_dead_services()))
                    time.sleep(0.1)
            finally:
                restore_foreground(terminal)
                end_command_group(child.pid)
            report_dead(reported)
            if child.returncode != 0:
                cluster.mark_failed(f"the command exited with status {child.returncode}")
            # A command killed by a signal reports -signal; exit like a shell would (128 + signal).
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        print("Ctrl-C to stop", file=sys.stderr)
        reported_dead: set[str] = set()
        while not stop_signal:
            report_dead(reported_dead)
            if cluster.fatal_dead_services():
                return 1
            time.sleep(0.2)
        return 0
    except ClusterError as e:
        cluster.mark_failed("the cluster failed")
        print(f"local_cluster: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        if cluster.kept_work_dir is not None:
            print(f"local_cluster: {cluster.failure or 'something failed'}: the logs are kept in {cluster.kept_work_dir / 'logs'} "
                  f"(remove {cluster.kept_work_dir} when done)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
