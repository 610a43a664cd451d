"""Answer quality of the trained checkpoints (issue 12), on the CPU engine and through the cluster.

The checkpoints in models/trained/ were trained on the multi-document task of tools/multidoc_task.py
(models/trained/README.md); bench/datasets/heldout_test.jsonl holds 32 held-out prompts of it (4 documents of
128-192 tokens, answers known). What the method predicts, asserted here on the smallest checkpoint:
  - full recomputation answers almost every prompt (the training reached 0.99 exact match on its own prompts);
  - hypic with an 8-token seam window answers as full does, within one prompt;
  - naive state addition (and the reference's Naive Addition baseline, naive_local, which also leaves every
    segment's K at its local positions) is clearly worse, and it is the order-dependent "last" questions it loses.
    On these small models what loses them is the missing seam window, not the state sum: naive, transition and
    hypic w = 0 answer alike, and the seam recovers each document's first tokens, which the models attend to when
    asked for the last header (bench/results/quality.md).
And through the cluster (router, segment cache, scatter and combine workers) both checkpoints give the dataset's
answers, cold and warm, with the warm request's tokens identical to the cold one's (next-moe on the kinds it has
learnt so far).

Python 3.11 standard library only; run as `python3 tests/integration/test_trained_quality.py CLASS`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_test_support import BIN_DIR, SOURCE_DIR, LocalCluster, processes_mentioning  # noqa: E402

MODELS = SOURCE_DIR / "models" / "trained"
DATASET = SOURCE_DIR / "bench" / "datasets" / "heldout_test.jsonl"
EOS = "<|endoftext|>"


def load_rows(limit: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in DATASET.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


class QualityTest(unittest.TestCase):
    """hypic-eval --dataset on the dense checkpoint (the smallest): full, naive and hypic (w = 8, and w = 8 with the
    query-aware refresh of 2 segments, with its tail of the last 2 segments, and both)."""

    @classmethod
    def setUpClass(cls) -> None:
        model = MODELS / "qwen35-dense"
        with tempfile.TemporaryDirectory(prefix="hypic-quality-") as tmp:
            out = Path(tmp) / "report.json"
            r = subprocess.run([str(BIN_DIR / "hypic-eval"), "--model", str(model), "--tokenizer",
                                str(model / "tokenizer.json"), "--dataset", str(DATASET), "--modes", "naive,hypic",
                                "--seam-widths", "8", "--refresh", "2", "--refresh-tail", "2", "--json-out", str(out)],
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise AssertionError(f"hypic-eval failed ({r.returncode}): {r.stderr[-3000:]}")
            cls.report = json.loads(out.read_text())
        cls.summary = cls.report["summary"]
        cls.n = cls.report["evaluated_prompts"]

    def test_every_prompt_evaluated_with_trained_weights(self):
        self.assertEqual(self.n, len(load_rows()))
        self.assertFalse(self.report["random_weights"])
        self.assertEqual(set(self.summary), {"full", "naive", "naive_local", "hypic_w8", "hypic_w8_r2", "hypic_w8_t2",
                                             "hypic_w8_r2_t2"})

    def test_full_answers_almost_everything(self):
        self.assertGreaterEqual(self.summary["full"]["accuracy"], 0.9, self.summary["full"])
        # one_hop, two_hop and recall are retrieval: the trained model answers all of them here (2026-12-01); the
        # bound leaves room for a prompt whose greedy choice is close enough to flip with another BLAS build
        for kind in ("one_hop", "two_hop", "recall"):
            self.assertGreaterEqual(self.summary["full"]["accuracy_by_kind"][kind], 0.8, kind)

    def test_hypic_within_one_prompt_of_full(self):
        full, hypic = self.summary["full"], self.summary["hypic_w8"]
        self.assertLessEqual(abs(full["accuracy"] - hypic["accuracy"]), 1.0 / self.n + 1e-9, (full, hypic))
        self.assertLess(hypic["mean_computed_tokens"], 0.1 * full["mean_computed_tokens"])

    def test_naive_loses_the_order_dependent_questions(self):
        full = self.summary["full"]
        for mode in ("naive", "naive_local"):
            naive = self.summary[mode]
            self.assertLessEqual(naive["accuracy"], full["accuracy"] - 2.0 / self.n, (mode, full, naive))
            self.assertGreaterEqual(naive["flips_right_to_wrong"], 2, mode)
            self.assertLessEqual(naive["accuracy_by_kind"]["last"], full["accuracy_by_kind"]["last"] - 0.2, mode)
            # on the "last" answers the seam window takes the answer distribution to full's (KL per prompt from
            # the report's rows)
            last = [p["modes"] for p in self.report["prompts"] if p["kind"] == "last"]
            kl = lambda m: sum(r[m]["answer_kl"] for r in last) / len(last)  # noqa: E731
            self.assertGreater(kl(mode), 100 * kl("hypic_w8"), mode)
            # over every prompt the gap is smaller, since hypic also misses some "latest" updates (measured 19x,
            # 2026-12-02; it was 100x on the earlier four-kind set)
            self.assertGreater(naive["mean_kl"], 10 * self.summary["hypic_w8"]["mean_kl"], mode)

    def test_refresh_repairs_the_updates(self):
        """The query-aware refresh recomputes the documents the question reads in context: the "latest" answers that
        hypic w = 8 misses come back (measured 2026-12-02: every prompt as in full, answer KL 53x below hypic_w8's),
        at a fraction of full's tokens."""
        full, hypic, refresh = self.summary["full"], self.summary["hypic_w8"], self.summary["hypic_w8_r2"]
        self.assertEqual(refresh["flips_right_to_wrong"], 0, refresh)
        self.assertGreaterEqual(refresh["accuracy"], hypic["accuracy"])
        self.assertEqual(refresh["accuracy_by_kind"]["latest"], full["accuracy_by_kind"]["latest"])
        self.assertLess(refresh["mean_kl"], 0.1 * hypic["mean_kl"], (refresh, hypic))
        self.assertLess(refresh["mean_computed_tokens"], 0.75 * full["mean_computed_tokens"])
        for p in self.report["prompts"]:  # 4 documents: at most 2 of the 3 later ones refreshed, never the first
            chosen = p["modes"]["hypic_w8_r2"]["recomputed_segments"]
            self.assertTrue(1 <= len(chosen) <= 2 and all(1 <= i <= 3 for i in chosen), (p["id"], chosen))

    def test_refresh_tail(self):
        """The tail of 2 recomputes documents 2 and 3 of 4 whole, with no probe: exactly their tokens on top of the seam
        of document 1 and the query. With the refresh of 2 on top, the only candidate left is document 1, so every
        later document is recomputed: full recomputation, whatever the model (the answers and their distribution are
        full's)."""
        full, tail, both = self.summary["full"], self.summary["hypic_w8_t2"], self.summary["hypic_w8_r2_t2"]
        for p in self.report["prompts"]:
            m = p["modes"]
            docs = p["document_tokens"]
            self.assertEqual(m["hypic_w8_t2"]["recomputed_segments"], [2, 3], p["id"])
            self.assertEqual(m["hypic_w8_t2"]["computed_tokens"], min(8, docs[1]) + docs[2] + docs[3] + p["query_tokens"],
                             p["id"])
            self.assertEqual(m["hypic_w8_r2_t2"]["recomputed_segments"], [1, 2, 3], p["id"])
            self.assertEqual(m["hypic_w8_r2_t2"]["generated_text"], m["full"]["generated_text"], p["id"])
            self.assertLess(m["hypic_w8_r2_t2"]["answer_kl"], 1e-6, p["id"])
        self.assertEqual(both["accuracy"], full["accuracy"])
        # the tail makes the boundary into the last document exact: the "last" questions are answered as full does
        self.assertEqual(tail["accuracy_by_kind"]["last"], full["accuracy_by_kind"]["last"])

    def test_exact_match_is_the_answer_text(self):
        # the report's exact_match is the generated text against the dataset's answer, checked here independently
        answers = {r["id"]: r["answer"].strip() for r in load_rows()}
        for p in self.report["prompts"]:
            m = p["modes"]["full"]
            self.assertEqual(m["exact_match"], m["generated_text"].strip() == answers[p["id"]], p["id"])


class ClusterAnswerTest(unittest.TestCase):
    """Both checkpoints served by a local cluster (2 scatter workers): the first prompts of the held-out set, each
    document one segment, cold then warm."""
    prompts = 4

    def run_model(self, name: str, kinds: tuple[str, ...] = ("one_hop", "two_hop", "recall", "last")) -> None:
        model = MODELS / name
        with tempfile.TemporaryDirectory(prefix=f"hypic-it-trained-{name}-") as work:
            cluster = LocalCluster(BIN_DIR, model, model / "tokenizer.json", scatter_workers=2, work_dir=work,
                                   device="cpu")
            cluster.start()
            try:
                rows = [r for r in load_rows() if r["kind"] in kinds]
                for row in rows[:self.prompts]:
                    with self.subTest(model=name, prompt=row["id"]):
                        cold = self.generate(cluster, row)
                        warm = self.generate(cluster, row)
                        self.assertEqual(cold["text"].split(EOS)[0].strip(), row["answer"].strip(), row["id"])
                        self.assertEqual(warm["token_ids"], cold["token_ids"], row["id"])
                        self.assertEqual([s["source"] for s in cold["report"]["segments"]],
                                         ["SEGMENT_SOURCE_SCATTER"] * len(row["documents"]))
                        self.assertNotIn("SEGMENT_SOURCE_SCATTER", [s["source"] for s in warm["report"]["segments"]])
            finally:
                cluster.stop()
            self.assertEqual(processes_mentioning(work), [])

    @staticmethod
    def generate(cluster: LocalCluster, row: dict) -> dict:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"segments": row["documents"], "query": row["query"]}, f)
            path = f.name
        try:
            r = subprocess.run([str(BIN_DIR / "hypic-client"), "generate", "--router", cluster.router_address,
                                "--segments-json", path, "--max-tokens", "24", "--json", "--timeout-seconds", "100"],
                               capture_output=True, text=True, timeout=120)
        finally:
            os.unlink(path)
        if r.returncode != 0:
            raise AssertionError(f"hypic-client failed ({r.returncode}): {r.stderr[-2000:]}")
        return json.loads(r.stdout)

    def test_dense(self):
        self.run_model("qwen35-dense")

    def test_next_moe(self):
        # next-moe answers one_hop and two_hop questions spliced as well as in full, but not yet the recall ones,
        # and its "last" and "latest" answers still depend on cross-document context that splicing drops
        # (models/trained/README.md, bench/results/quality.md)
        self.run_model("next-moe", ("one_hop", "two_hop"))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
