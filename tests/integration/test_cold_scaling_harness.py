#!/usr/bin/env python3
"""bench/run_cold_scaling.sh end to end on the CPU (--cpu-smoke: the tiny model, two worker counts, gRPC only): the
harness that makes bench/results/cold_scaling_h200.{json,md} on a host of several GPUs must not rot while no such
host is lent. Checks the JSON's shape (a row per worker count and transport with `workers` and `ttft_ms`), that on
CPU workers every delivered segment went over gRPC, and LPT's assignment against round-robin's, which is arithmetic
and not timing: LPT's busiest worker holds the ideal share, round-robin's holds both long segments."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import unittest
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("HYPIC_BIN_DIR", SOURCE_DIR / "build" / "bin"))


class ColdScalingHarnessTest(unittest.TestCase):
    def test_cpu_smoke(self):
        with tempfile.TemporaryDirectory(prefix="hypic-cold-scaling-test-") as d:
            out = Path(d) / "cs"
            r = subprocess.run([str(SOURCE_DIR / "bench" / "run_cold_scaling.sh"), "--cpu-smoke", "--build-dir",
                                str(BIN_DIR.parent), "--requests", "2", "--out", str(out)],
                               cwd=SOURCE_DIR, capture_output=True, text=True, timeout=240)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            j = json.loads(out.with_suffix(".json").read_text())
            md = out.with_suffix(".md").read_text()
        rows = j["rows"]
        self.assertEqual(sorted((r["workers"], r["transport"]) for r in rows),
                         [(1, "auto"), (1, "grpc"), (2, "auto"), (2, "grpc")])
        for row in rows:
            self.assertGreater(row["ttft_ms"], 0)
            self.assertEqual(row["segments_by_transport"], {"grpc": 2 * 4}, row)  # 2 requests x 4 cold segments
            self.assertGreater(row["transfer_bytes_per_segment"], 0)
            if row["workers"] == 1:
                self.assertAlmostEqual(row["speedup"], 1.0)
        var = {v["policy"]: v for v in j["variable"]}
        self.assertEqual(set(var), {"lpt", "round-robin"})
        # 2 workers, segments of 128, 32, 128, 32 tokens: LPT gives each worker 128 + 32; round-robin gives worker 0
        # both long ones (256).
        self.assertEqual(var["lpt"]["max_worker_tokens"], 160)
        self.assertEqual(var["round-robin"]["max_worker_tokens"], 256)
        self.assertIn("| workers | transport | TTFT ms (mean)", md)
        self.assertIn("LPT over round-robin", md)


if __name__ == "__main__":
    unittest.main()
