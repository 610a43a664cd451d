#!/usr/bin/env python3
"""The Kimi-Linear, MiniMax and Ring-linear families through a real cluster on the GPU (issue 29): the test of
tests/integration/test_families_cluster.py (cold: every segment built by the scatter workers; warm: every entry from
the segment cache, through its bytes; reordered segments hit too; hypic and transition modes; full mode) with every
worker on cuda:0 (the CUDA backend, bf16), on random checkpoints of tests/gpu/configs/<family>_gpu.json (real head
sizes: KDA 128, MLA 128 + 64 / 128, lightning 128). A miss and a hit give bit-identical tokens; the bf16 tokens are not
compared with the CPU engine's (tests/gpu/test_gpu_families_backend.cpp holds the numerics to stated bounds).

    HYPIC_BIN_DIR=build-gpu/bin python3 tests/gpu/test_gpu_families_cluster.py [KimiLinearGpuClusterTest ...]
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2]
os.environ.setdefault("HYPIC_BIN_DIR", str(SOURCE_DIR / "build-gpu" / "bin"))
sys.path.insert(0, str(SOURCE_DIR / "tests" / "integration"))
from cluster_test_support import BIN_DIR  # noqa: E402
from test_families_cluster import FamilyCluster  # noqa: E402

# Every worker of the cluster on one GPU: small KV pools and passes, so that four CUDA backends share it.
WORKER_ARGS = ["--kv-pool-bytes", str(1 << 30), "--max-batch-tokens", "2048"]


class GpuFamilyCluster(FamilyCluster):
    device = "cuda:0"
    exact_reference = False
    # No memory tier and no pinned host tier on the combine worker: warm entries come from the segment cache service,
    # through their bytes.
    extra_args = {"combine": ["--memory-tier-bytes", "0", "--host-tier-bytes", "0"] + WORKER_ARGS,
                  "scatter": WORKER_ARGS}
    config = ""
    _tmp: tempfile.TemporaryDirectory | None = None

    @classmethod
    def model_path(cls) -> str:
        cls._tmp = tempfile.TemporaryDirectory(prefix=f"hypic-gpu-fam-{cls.config}-")
        out = str(Path(cls._tmp.name) / "m")
        subprocess.run([str(BIN_DIR / "hypic-model"), "init", "--config",
                        str(SOURCE_DIR / "tests" / "gpu" / "configs" / f"{cls.config}.json"), "--seed", "5",
                        "--std", "0.05", "--out", out], check=True, capture_output=True)
        return out

    @classmethod
    def tearDownClass(cls) -> None:
        super().tearDownClass()
        if cls._tmp:
            cls._tmp.cleanup()


class KimiLinearGpuClusterTest(GpuFamilyCluster):
    fixture = "kimi_linear_gpu"
    config = "kimi_linear_gpu"


class MiniMaxGpuClusterTest(GpuFamilyCluster):
    fixture = "minimax_gpu"
    config = "minimax_gpu"


class RingLinearGpuClusterTest(GpuFamilyCluster):
    fixture = "ring_linear_gpu"
    config = "ring_linear_gpu"


if __name__ == "__main__":
    unittest.main()
