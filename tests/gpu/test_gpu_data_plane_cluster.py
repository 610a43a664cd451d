#!/usr/bin/env python3
"""The NCCL data plane through a real cluster, on a host of at least 2 GPUs (issue 16). Run by scripts/test_gpu.sh
(it skips, saying so, with fewer GPUs); needs the CUDA build's binaries in HYPIC_BIN_DIR (default build-gpu/bin).

Cluster: the combine worker on cuda:0, scatter-0 on cuda:1 (its entries go GPU to GPU over NCCL), scatter-1 on
cuda:0 (the combine worker's GPU: refused for NCCL, it falls back to gRPC by itself); no segment cache and no memory
tier, so every request is all cold. Checks:
  - the report names each delivered segment's transport, nccl and grpc both occur, and the gRPC ones say why;
  - the tokens equal those of the same prompts on a cluster whose entries all go over gRPC (--entry-transport grpc):
    entries over NCCL are bit-identical;
  - scatter-0 killed mid-transfer (its NCCL send held back by --inject-transfer-stall-ms, testing only) leaves the
    request complete with the same tokens (the combine worker aborts the communicator, the router reassigns the
    segment), and the next request completes too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2]
os.environ.setdefault("HYPIC_BIN_DIR", str(SOURCE_DIR / "build-gpu" / "bin"))
os.environ["NCCL_NVLS_ENABLE"] = "0"
sys.path.insert(0, str(SOURCE_DIR / "tests" / "integration"))
from cluster_test_support import BIN_DIR, ClusterTestCase, LocalCluster, words  # noqa: E402


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class GpuModel:
    """A random checkpoint of tests/gpu/configs/qwen3_next_gpu.json (CUDA-supported shapes, vocab 2048) and the
    trained models' 2048-token tokenizer."""
    _tmp: tempfile.TemporaryDirectory | None = None
    model = ""
    tokenizer = str(SOURCE_DIR / "models" / "trained" / "qwen35-dense" / "tokenizer.json")

    @classmethod
    def ensure(cls) -> str:
        if not cls.model:
            cls._tmp = tempfile.TemporaryDirectory(prefix="hypic-gpu-dp-")
            cls.model = str(Path(cls._tmp.name) / "m")
            subprocess.run([str(BIN_DIR / "hypic-model"), "init", "--config",
                            str(SOURCE_DIR / "tests" / "gpu" / "configs" / "qwen3_next_gpu.json"), "--seed", "5",
                            "--out", cls.model, "--std", "0.05"], check=True, capture_output=True)
        return cls.model


def wait_for_link(test: ClusterTestCase, timeout: float = 60) -> None:
    """Sends warm-up requests until scatter-0 reports its NCCL communicator up (links open in the background: the
    first entries go over gRPC meanwhile)."""
    log = Path(test.cluster.services["scatter-0"].log_path)
    deadline = time.monotonic() + timeout
    k = 0
    while " up (cuda:" not in log.read_text():
        test.assertLess(time.monotonic(), deadline, "scatter-0's NCCL communicator never came up")
        test.ok(test.generate([words(9000 + k, 40)], "Warm-up?", max_tokens=1))
        k += 1
        time.sleep(0.2)


def prompts() -> list[tuple[list[str], str]]:
    return [([words(100 * k + i, 60 + 25 * i) for i in range(4)], f"Question {k}: what is said?") for k in range(3)]


@unittest.skipIf(gpu_count() < 2, f"needs 2 GPUs, {gpu_count()} visible")
class NcclClusterTest(ClusterTestCase):
    scatter_workers = 2
    cache_replicas = 0
    device = "cuda:0,cuda:1"
    extra_args = {"combine": ["--memory-tier-bytes", "0"]}
    tokenizer_file = GpuModel.tokenizer

    @classmethod
    def setUpClass(cls) -> None:
        cls.model_dir = GpuModel.ensure()
        super().setUpClass()

    def test_entries_over_nccl_give_the_tokens_of_grpc(self):
        wait_for_link(self)
        ours = []
        transports = set()
        for segs, q in prompts():
            r = self.generate(segs, q, max_tokens=8)
            report = self.ok(r)
            ours.append(r["token_ids"])
            for s in report["segments"]:
                t = s.get("transport", "")
                self.assertIn(t, ("nccl", "grpc"), s)
                transports.add(t)
                if t == "grpc":  # scatter-1 shares the combine worker's GPU: refused (or still being asked)
                    note = s.get("note", "")
                    self.assertTrue("same GPU" in note or "being opened" in note, s)
                self.assertGreater(int(s["transfer_bytes"]), 0, s)
        self.assertEqual(transports, {"nccl", "grpc"})
        # The same prompts where every entry goes over gRPC.
        with tempfile.TemporaryDirectory(prefix="hypic-gpu-dp-grpc-") as work:
            other = LocalCluster(BIN_DIR, self.model_dir, self.tokenizer_file, scatter_workers=2, cache_replicas=0,
                                 work_dir=work, device=self.device,
                                 extra_args={"combine": ["--memory-tier-bytes", "0"],
                                             "scatter": ["--entry-transport", "grpc"]})
            other.start()
            try:
                for (segs, q), tokens in zip(prompts(), ours):
                    r = self.generate(segs, q, max_tokens=8, router=other.router_address)
                    report = self.ok(r)
                    self.assertEqual({s.get("transport") for s in report["segments"]}, {"grpc"})
                    self.assertEqual(r["token_ids"], tokens)
            finally:
                other.stop()


@unittest.skipIf(gpu_count() < 2, f"needs 2 GPUs, {gpu_count()} visible")
class NcclScatterKilledTest(ClusterTestCase):
    scatter_workers = 2
    cache_replicas = 0
    device = "cuda:0,cuda:1"
    extra_args = {"combine": ["--memory-tier-bytes", "0"], "scatter": ["--inject-transfer-stall-ms", "4000"]}
    tokenizer_file = GpuModel.tokenizer

    @classmethod
    def setUpClass(cls) -> None:
        cls.model_dir = GpuModel.ensure()
        super().setUpClass()

    def test_scatter_worker_killed_mid_transfer(self):
        wait_for_link(self)
        segs, q = prompts()[0]
        before = self.generate(segs, q, max_tokens=8, request_id="dp-before")
        self.ok(before)
        log = self.cluster.services["scatter-0"].log_path
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(self.generate(segs, q, max_tokens=8,
                                                                          request_id="dp-killed")))
        t.start()
        deadline = time.monotonic() + 60
        while "[req dp-killed]" not in "".join(l for l in Path(log).read_text().splitlines(True)
                                              if "stalling the NCCL transfer" in l):
            self.assertLess(time.monotonic(), deadline, "scatter-0 never started an NCCL transfer")
            time.sleep(0.05)
        self.cluster.kill("scatter-0")  # mid-transfer: header sent, block not
        t.join(timeout=120)
        self.assertFalse(t.is_alive(), "the request hung")
        report = self.ok(result)
        self.assertEqual(result["token_ids"], before["token_ids"])
        self.assertTrue(any(int(s.get("attempts", 1)) > 1 for s in report["segments"]), report["segments"])
        combine_log = Path(self.cluster.services["combine"].log_path).read_text()
        self.assertIn("receive failed", combine_log)
        # The cluster goes on with the worker left.
        after = self.generate(segs, q, max_tokens=8, request_id="dp-after")
        self.ok(after)
        self.assertEqual(after["token_ids"], before["token_ids"])


if __name__ == "__main__":
    unittest.main()
