#!/usr/bin/env python3
"""The Kimi-Linear, MiniMax and Ring-linear families through the cluster (issue 14): each class starts a cluster
(deploy/local_cluster.py, --device cpu: the CUDA backend does not run these families) on one of the reference fixture
models of tests/fixtures (vocabulary 256, random weights), sends token-id segments and a token-id query (with
the small test tokenizer tests/fixtures/tokenizer/tiny_subword.json, whose ids fit the vocabulary), and checks that a miss (cold: every segment built by the scatter
workers) and a hit (warm: every entry from the segment cache, through its bytes) give bit-identical tokens, in
hypic and transition mode, equal to what the engine alone generates (hypic-engine-reference), and that reordered
segments hit too.

Run one class per CTest test:  python3 tests/integration/test_families_cluster.py KimiLinearClusterTest
Environment: HYPIC_BIN_DIR (the built binaries), HYPIC_TOKENIZER (else scripts/fetch_tokenizer.sh).
"""
from __future__ import annotations

import random
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_test_support import SOURCE_DIR, ClusterTestCase  # noqa: E402

FIXTURES = SOURCE_DIR / "tests" / "fixtures"


def token_segment(seed: int, n: int, vocab: int = 256) -> dict:
    rng = random.Random(seed)
    return {"tokens": [rng.randrange(vocab) for _ in range(n)]}


class FamilyCluster(ClusterTestCase):
    """A miss and a hit give the same tokens, bit for bit. The combine worker's memory tier is off, so warm entries
    come from the segment cache service (serialised, sent, verified and deserialised)."""
    extra_args = {"combine": ["--memory-tier-bytes", "0"]}
    fixture = ""
    # The cluster's tokens equal the engine alone's (hypic-engine-reference, the CPU backend): true when the cluster
    # runs the CPU backend too; a GPU cluster (bf16) is held to hit == miss and to itself (tests/gpu).
    exact_reference = True

    @classmethod
    def model_path(cls) -> str:
        return str(FIXTURES / cls.fixture)

    @classmethod
    def setUpClass(cls) -> None:
        if not cls.fixture:
            raise unittest.SkipTest("the base class runs no cluster")
        cls.model_dir = cls.model_path()
        # A tokenizer whose 121 ids fit the fixtures' vocabulary of 256 (the router refuses a larger one); the
        # requests are token ids anyway.
        cls.tokenizer_file = str(FIXTURES / "tokenizer" / "tiny_subword.json")
        super().setUpClass()

    def test_hit_equals_miss(self):
        base = sum(map(ord, self.fixture))
        segs = [token_segment(base + 1, 60), token_segment(base + 2, 35), token_segment(base + 3, 6),
                token_segment(base + 4, 20)]
        query = token_segment(base + 5, 5)
        for mode in ("hypic", "transition"):
            with self.subTest(mode=mode):
                # Another seed per mode: the digests cover w, so both modes' entries must be built cold.
                shift = 0 if mode == "hypic" else 100
                msegs = [token_segment(base + 1 + shift + i, len(s["tokens"])) for i, s in enumerate(segs)]
                cold = self.generate(msegs, query, "--mode", mode, max_tokens=10)
                rep = self.ok(cold)
                self.assertEqual([s["cache_hit"] for s in rep["segments"]], [False] * 4)
                self.assertEqual(rep["mode"], mode)
                self.assertEqual(len(cold["token_ids"]), 10)
                self.wait_cache_entries(4 if mode == "hypic" else 8)
                warm = self.generate(msegs, query, "--mode", mode, max_tokens=10)
                wrep = self.ok(warm)
                self.assertEqual([s["cache_hit"] for s in wrep["segments"]], [True] * 4)
                self.assertEqual([s["source"] for s in wrep["segments"]], ["SEGMENT_SOURCE_CACHE"] * 4)
                self.assertEqual(warm["token_ids"], cold["token_ids"])
                if self.exact_reference:
                    self.assertEqual(cold["token_ids"], self.reference(msegs, query, max_tokens=10, mode=mode))
                # Reordered, with another query: hits at other positions (Ring: states re-rotated), and the
                # tokens tell the prompts apart.
                other = self.generate([msegs[2], msegs[0], msegs[3], msegs[1]], token_segment(base + 6, 4), "--mode",
                                      mode, max_tokens=10)
                orep = self.ok(other)
                self.assertEqual([s["cache_hit"] for s in orep["segments"]], [True] * 4)
        # The full mode runs too (no entries), and its tokens do not depend on the cache either.
        full = [self.generate(segs, query, "--mode", "full", max_tokens=6) for _ in range(2)]
        self.assertEqual(self.ok(full[0])["mode"], "full")
        self.assertEqual(full[0]["token_ids"], full[1]["token_ids"])
        if self.exact_reference:
            self.assertEqual(full[0]["token_ids"], self.reference(segs, query, max_tokens=6, mode="full"))


class KimiLinearClusterTest(FamilyCluster):
    fixture = "kimi_linear_grouped"


class MiniMaxClusterTest(FamilyCluster):
    fixture = "minimax_blocks"


class RingLinearClusterTest(FamilyCluster):
    fixture = "ring_linear_grouped"


if __name__ == "__main__":
    unittest.main()
