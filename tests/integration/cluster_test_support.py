"""Shared support of the cluster integration tests: paths, the tiny model, request helpers and the
engine-only reference. Python 3.11 standard library only."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(SOURCE_DIR / "deploy"))
from local_cluster import LocalCluster  # noqa: E402

BIN_DIR = Path(os.environ.get("HYPIC_BIN_DIR", SOURCE_DIR / "build" / "bin"))
# One engine thread per process: the services and the reference then sum in the same order.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_WORDS = ("the of and to in is was for on that with as by at from his her it an are were which this be or have "
          "had not but they one all their been has when who will more no if out so said what up its about into "
          "than them can only other new some could time these two may then do first any my now such like our over "
          "man me even most made after also did many before must through back years where much your way well down "
          "should because each just those people how too little state good very make world still own see men work "
          "long get here between both life being under never day same another know while last might us great old "
          "year off come since against go came right used take three river city garden winter letter music").split()


def words(seed: int, n: int) -> str:
    """Deterministic English-like text of about n words."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out += sentence
    return " ".join(out)


def tokenizer_path() -> str:
    if "HYPIC_TOKENIZER" in os.environ:
        return os.environ["HYPIC_TOKENIZER"]
    r = subprocess.run([str(SOURCE_DIR / "scripts" / "fetch_tokenizer.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/fetch_tokenizer.sh failed: {r.stderr}")
    return r.stdout.strip()


class Env:
    """The tiny model (made once per process with hypic-model init) and the tokenizer. Weights are drawn
    with std 0.2 rather than HF's 0.02, so that greedy outputs depend on the prompt (at 0.02 this tiny
    model repeats one token whatever it is given, which would make token comparisons vacuous)."""
    _tmp: tempfile.TemporaryDirectory | None = None
    model: str = ""
    tokenizer: str = ""

    @classmethod
    def ensure(cls) -> None:
        if cls.model:
            return
        cls._tmp = tempfile.TemporaryDirectory(prefix="hypic-it-model-")
        cls.model = str(Path(cls._tmp.name) / "tiny")
        subprocess.run([str(BIN_DIR / "hypic-model"), "init", "--config",
                        str(SOURCE_DIR / "tests" / "integration" / "tiny_model.json"), "--seed", "1", "--out",
                        cls.model, "--std", "0.2"], check=True, capture_output=True)
        cls.tokenizer = tokenizer_path()


def processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker` (e.g. a cluster's work dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((l for l in (entry / "status").read_text().splitlines() if l.startswith("State:")), "")
        except OSError:
            continue
        if marker in cmdline and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


class ClusterTestCase(unittest.TestCase):
    """Starts one cluster for the class (scatter_workers, extra_args) and checks at the end that no
    process of it is left."""
    scatter_workers = 2
    cache_replicas = 1
    extra_args: dict[str, list[str]] = {}
    tls = False  # LocalCluster(tls=True): TLS, mTLS between services, a bearer token on the router
    device = "cpu"  # the workers' --device (a list spreads them over GPUs: deploy/local_cluster.py); the reference is CPU
    model_dir = ""  # the checkpoint the cluster serves; empty: the tiny model (Env.model)
    tokenizer_file = ""  # its tokenizer.json; empty: Env.tokenizer (the Qwen3 one)
    cluster: LocalCluster

    @classmethod
    def cluster_extra_args(cls) -> dict[str, list[str]]:
        """extra_args, with the combine worker's --cache-fetch-policy pinned to always unless the class sets it: the
        default (auto) may prefill a segment the cache holds where this machine's fetches look slower than its builds,
        which on the tiny test model can flip with load; CacheFetchPolicyTest covers auto."""
        args = {role: list(flags) for role, flags in cls.extra_args.items()}
        combine = args.setdefault("combine", [])
        if not any(a == "--cache-fetch-policy" or a.startswith("--cache-fetch-policy=") for a in combine):
            combine += ["--cache-fetch-policy", "always"]
        return args

    @classmethod
    def setUpClass(cls) -> None:
        Env.ensure()
        cls.work = tempfile.TemporaryDirectory(prefix=f"hypic-it-{cls.__name__}-")
        cls.cluster = LocalCluster(BIN_DIR, cls.model_dir or Env.model, cls.tokenizer_file or Env.tokenizer,
                                   scatter_workers=cls.scatter_workers, cache_replicas=cls.cache_replicas,
                                   work_dir=cls.work.name, extra_args=cls.cluster_extra_args(), device=cls.device,
                                   tls=cls.tls)
        cls.cluster.start()

    @classmethod
    def start_second_router(cls, router_args: list[str], cache: bool = True) -> str:
        """Starts a second combine worker ("combine-b", on the cluster's cache replicas unless cache is False) and a
        second router ("router-b") in front of both combine workers, with router_args added; returns that router's
        address."""
        c = cls.cluster
        model, tok = cls.model_dir or Env.model, cls.tokenizer_file or Env.tokenizer
        cache_flags = [f for a in c.cache_addresses for f in ("--cache", a)] if cache else []
        second = c._service("combine-b", "combine", ["--model", model, "--tokenizer", tok] + cache_flags,
                            "hypic.v1.CombineWorker", 0)
        c._start_all([second])
        c._wait_ready([second])
        router = c._service("router-b", "router", ["--model", model, "--tokenizer", tok, "--combine", c.combine_address,
                                                   "--combine", second.address] + cache_flags + router_args,
                            "hypic.v1.Router", 0)
        c._start_all([router])
        c._wait_ready([router])
        return router.address

    @classmethod
    def tearDownClass(cls) -> None:
        cls.cluster.stop()
        left = processes_mentioning(cls.work.name)
        cls.work.cleanup()
        if left:
            raise AssertionError(f"processes left behind by the cluster: {left}")

    def tearDown(self) -> None:
        dead = self.cluster.dead_services()
        if dead:
            logs = "\n".join(f"--- {n}\n{self.cluster.services[n].log_tail()}" for n in dead)
            self.fail(f"services died during the test: {dead}\n{logs}")

    # ---- requests ----
    def generate(self, segments: list, query, *extra: str, max_tokens: int = 12,
                 router: str | None = None, request_id: str = "", timeout: float = 120,
                 deadline_s: float = 100) -> dict:
        """Runs hypic-client generate --json (greedy, no EOS stop); returns the parsed JSON plus "rc"."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"segments": segments, "query": query}, f)
            path = f.name
        try:
            argv = [str(BIN_DIR / "hypic-client"), "generate", "--router", router or self.cluster.router_address,
                    "--segments-json", path, "--max-tokens", str(max_tokens), "--ignore-eos", "--json",
                    "--timeout-seconds", str(deadline_s)]
            if request_id:
                argv += ["--request-id", request_id]
            r = subprocess.run(argv + list(extra), capture_output=True, text=True, timeout=timeout)
        finally:
            os.unlink(path)
        out = json.loads(r.stdout) if r.stdout.strip() else {}
        out["rc"] = r.returncode
        out["stderr"] = r.stderr
        return out

    def ok(self, result: dict) -> dict:
        self.assertEqual(result["rc"], 0, f"request failed: {result.get('stderr')}")
        return result["report"]

    def reference(self, segments: list, query, max_tokens: int = 12, mode: str = "hypic",
                  seam_width: int = 8) -> list[int]:
        """Token ids the engine alone generates (hypic-engine-reference, greedy)."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"segments": segments, "query": query, "mode": mode, "seam_width": seam_width,
                       "max_tokens": max_tokens}, f)
            path = f.name
        try:
            r = subprocess.run([str(BIN_DIR / "hypic-engine-reference"), "--model", self.model_dir or Env.model,
                                "--tokenizer", self.tokenizer_file or Env.tokenizer, "--request", path],
                               capture_output=True, text=True, check=True)
        finally:
            os.unlink(path)
        return json.loads(r.stdout)["token_ids"]

    def client(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN_DIR / "hypic-client"), *args], capture_output=True, text=True, timeout=60)

    def combine_metric(self, name: str, default: float | None = 0.0) -> float | None:
        """The first sample of `name` on the combine worker's /metrics (`default` when it has none)."""
        import urllib.request
        text = urllib.request.urlopen(f"http://{self.cluster.metrics_address('combine')}/metrics", timeout=10).read()
        for line in text.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return default

    def cache_stats(self, replica: str = "cache-0") -> dict:
        r = self.client("cache-stats", "--cache", self.cluster.address(replica))
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def wait_cache_entries(self, n: int, timeout: float = 20.0) -> None:
        """Cache puts are asynchronous: waits until the replicas hold at least n entries in all."""
        import time
        deadline = time.monotonic() + timeout
        total = 0
        while time.monotonic() < deadline:
            total = sum(int(self.cache_stats(f"cache-{i}")["entries"]) for i in range(self.cache_replicas))
            if total >= n:
                return
            time.sleep(0.05)
        self.fail(f"the cache holds {total} entries after {timeout} s, expected {n}")

    def wait_cached(self, *reports: dict, timeout: float = 20.0) -> None:
        """Cache puts are asynchronous: waits until every segment entry of the given generate reports can be read
        (cache-get by digest) from one of the replicas. Unlike a count of entries, an entry that an earlier test of
        the class left in the cache cannot stand in for one whose put is still in flight."""
        import time
        deadline = time.monotonic() + timeout
        digests = sorted({s["digest_hex"] for r in reports for s in r["segments"]})
        with tempfile.TemporaryDirectory() as d:
            for digest in digests:
                while not any(self.client("cache-get", "--cache", self.cluster.address(f"cache-{i}"), "--digest",
                                          digest, "--out", str(Path(d) / "entry")).returncode == 0
                              for i in range(self.cache_replicas)):
                    if time.monotonic() > deadline:
                        self.fail(f"entry {digest} is not in the cache after {timeout} s (of {len(digests)} awaited)")
                    time.sleep(0.05)
