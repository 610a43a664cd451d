#!/usr/bin/env python3
"""The load test and the chaos run of issue 15, on a local CPU cluster (deploy/local_cluster.py), with the
traffic of hypic-bench-load (bench/load/main.cpp).

    bench/load/run_load.py --bin-dir build/bin --model DIR --tokenizer FILE --scenario load  [--streams 1000]
    bench/load/run_load.py --bin-dir build/bin --model DIR --tokenizer FILE --scenario chaos [--seconds 120]
        [--out-json F]

load:  two phases, each on a fresh cluster (2 scatter workers, 1 cache replica). "held": the router admits
       --streams requests at once (--max-concurrent-requests = streams) and --streams streams send one short
       request each: all are held together, all must finish. "over": the router admits --limit (64) and the same
       streams send two requests each: admission refuses what is above the limit with RESOURCE_EXHAUSTED, and every
       accepted request must finish. Reported: requests, refused, finished, failed, peak in flight, TTFT and
       end-to-end p50 / p99, and each service's peak resident memory (VmRSS sampled every 0.2 s).
chaos: sustained traffic (--chaos-streams streams for --seconds) on 3 scatter workers and 2 cache replicas while
       scatter workers and cache replicas are killed with SIGKILL at random and started again (same address), and
       the combine worker is restarted while idle (traffic paused until nothing is in flight, SIGKILL, start,
       resume). Counted: faults injected, requests lost (accepted but not finished: must be 0, since no request is
       in flight on the combine worker when it is killed) and corrupted outputs (a prompt decoding other tokens
       than before: must be 0).
Exit status: 0 when every check held, 1 otherwise (the JSON says which), 2 bad usage.
Python 3.11 standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy"))
from local_cluster import LocalCluster  # noqa: E402


class RssSampler(threading.Thread):
    """Peak VmRSS (bytes) per service name, sampled every `period` seconds (a restarted service keeps its peak)."""

    def __init__(self, cluster: LocalCluster, period: float = 0.2):
        super().__init__(daemon=True)
        self.cluster, self.period = cluster, period
        self.peak: dict[str, int] = {}
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            for name in list(self.cluster.services):
                pid = self.cluster.pid(name)
                if pid is None:
                    continue
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            kb = int(line.split()[1])
                            self.peak[name] = max(self.peak.get(name, 0), kb * 1024)
                except (OSError, ValueError):
                    pass
            self.stop_flag.wait(self.period)


def load_args(args, streams: int, extra: list[str]) -> list[str]:
    return [str(Path(args.bin_dir) / "hypic-bench-load"), "--tokenizer", args.tokenizer, "--streams", str(streams),
            "--segments", "2", "--segment-tokens", "16:48", "--query-tokens", "8", "--max-tokens",
            str(args.max_tokens), "--pool", str(args.pool), "--seed", str(args.seed)] + extra


def run_phase(args, name: str, router_limit: int, requests_per_stream: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"hypic-load-{name}-") as tmp:
        cluster = LocalCluster(args.bin_dir, args.model, args.tokenizer, scatter_workers=2, cache_replicas=1,
                               work_dir=tmp, extra_args={"router": [f"--max-concurrent-requests={router_limit}"]},
                               log_level="warn")
        with cluster:
            rss = RssSampler(cluster)
            rss.start()
            t0 = time.monotonic()
            r = subprocess.run(load_args(args, args.streams, ["--router", cluster.router_address, "--requests",
                                                              str(args.streams * requests_per_stream)]),
                               capture_output=True, text=True)
            rss.stop_flag.set()
            rss.join()
            if r.returncode not in (0, 1):
                raise SystemExit(f"hypic-bench-load failed ({r.returncode}): {r.stderr[-2000:]}")
            res = json.loads(r.stdout)
            dead = cluster.dead_services()
        res.update(phase=name, router_max_concurrent_requests=router_limit, seconds=round(time.monotonic() - t0, 1),
                   peak_rss_bytes=rss.peak, services_died=dead)
        checks = {"every accepted request finished": res["failed_after_acceptance"] == 0,
                  "no output mismatch": res["output_mismatches"] == 0,
                  "no service died": not dead}
        if name == "held":
            checks["all requests held at once"] = res["peak_in_flight"] == args.streams
            checks["none refused"] = res["refused_resource_exhausted"] == 0
        else:
            checks["admission refused some (RESOURCE_EXHAUSTED)"] = res["refused_resource_exhausted"] > 0
        res["checks"] = checks
        print(f"[{name}] " + r.stderr.strip().splitlines()[-1], file=sys.stderr)
        return res


def write_status_wait(status_file: Path, pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = json.loads(status_file.read_text())
            if pred(st):
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return False


def run_chaos(args) -> dict:
    rng = random.Random(args.seed)
    events: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hypic-chaos-") as tmp:
        tmp = Path(tmp)
        cluster = LocalCluster(args.bin_dir, args.model, args.tokenizer, scatter_workers=3, cache_replicas=2,
                               work_dir=tmp / "cluster", log_level="warn",
                               extra_args={"router": ["--health-interval-ms=200"]})
        with cluster:
            rss = RssSampler(cluster)
            rss.start()
            pause, status = tmp / "pause", tmp / "status.json"
            t0 = time.monotonic()
            load = subprocess.Popen(load_args(args, args.chaos_streams, [
                "--router", cluster.router_address, "--duration-s", str(args.seconds), "--pause-file", str(pause),
                "--status-file", str(status), "--timeout-s", "120"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
            next_combine = t0 + args.seconds / 3
            while load.poll() is None and time.monotonic() - t0 < args.seconds - 5:
                time.sleep(rng.uniform(1.0, 3.0))
                now = time.monotonic() - t0
                if time.monotonic() >= next_combine:
                    next_combine += args.seconds / 3
                    pause.touch()
                    idle = write_status_wait(status, lambda s: s["in_flight"] == 0, 120)
                    cluster.kill("combine")
                    cluster.restart("combine")
                    pause.unlink()
                    events.append({"t_s": round(now, 2), "fault": "combine worker restarted while idle",
                                   "idle": idle})
                    continue
                victim = rng.choice([n for n in cluster.services if n.startswith(("scatter-", "cache-"))])
                cluster.kill(victim)
                down = rng.uniform(0.3, 2.0)
                time.sleep(down)
                cluster.restart(victim)
                events.append({"t_s": round(now, 2), "fault": f"SIGKILL {victim}", "down_s": round(down, 2)})
            out, err = load.communicate(timeout=600)
            rss.stop_flag.set()
            rss.join()
            res = json.loads(out)
            dead = cluster.dead_services()
    res.update(phase="chaos", seconds=args.seconds, faults=events, faults_injected=len(events),
               peak_rss_bytes=rss.peak, services_died=dead)
    res["requests_lost"] = res["failed_after_acceptance"]
    res["entries_corrupted"] = res["output_mismatches"]
    res["checks"] = {"no request lost": res["requests_lost"] == 0, "no corrupted output": res["entries_corrupted"] == 0,
                     "faults injected": len(events) > 0, "no unexpected service death": not dead}
    print("[chaos] " + err.strip().splitlines()[-1] + f"; {len(events)} faults", file=sys.stderr)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--scenario", choices=["load", "chaos", "all"], default="all")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=64, help="router admission limit of the 'over' phase")
    ap.add_argument("--chaos-streams", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--pool", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-json")
    args = ap.parse_args()
    results = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "host_cpus": os.cpu_count(),
               "phases": []}
    if args.scenario in ("load", "all"):
        results["phases"].append(run_phase(args, "held", args.streams, 1))
        results["phases"].append(run_phase(args, "over", args.limit, 2))
    if args.scenario in ("chaos", "all"):
        results["phases"].append(run_chaos(args))
    ok = all(all(p["checks"].values()) for p in results["phases"])
    results["ok"] = ok
    text = json.dumps(results, indent=1)
    if args.out_json:
        Path(args.out_json).write_text(text + "\n")
    print(text)
    for p in results["phases"]:
        bad = [k for k, v in p["checks"].items() if not v]
        print(f"{p['phase']}: " + ("all checks hold" if not bad else "FAILED: " + "; ".join(bad)), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
