#!/usr/bin/env python3
"""The main job's smoke run and what it tells the user: scripts/demo.sh --smoke --skip-setup --skip-build against
this build's binaries (the demo model, the real Qwen3 tokenizer, a local cluster, a cold then a warm request, no
process left), and its output: one line per preparation step, the warm run saying where its entries came from (the
combine worker's memory tier, not "the cache"), the comparison counting them; bad --doc files named with the reason.

  python3 tests/demo/test_demo.py BIN_DIR        (ctest: demo.smoke)
Python 3.11 standard library only.
"""
from __future__ import annotations

import json
import subprocess
import sys
import unittest
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2]
DEMO = SOURCE_DIR / "scripts" / "demo.sh"
BIN_DIR = Path(sys.argv.pop(1)) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else SOURCE_DIR / "build" / "bin"


def demo(*args: str, timeout: float = 170) -> subprocess.CompletedProcess:
    return subprocess.run([str(DEMO), "--skip-setup", "--skip-build", "--bin-dir", str(BIN_DIR), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=SOURCE_DIR)


class DemoTest(unittest.TestCase):
    def test_smoke_run_and_its_output(self):
        # the default: the trained checkpoint models/trained/qwen35-dense and a held-out prompt of its task
        r = demo("--smoke")
        self.assertEqual(r.returncode, 0, f"demo.sh --smoke failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        out = r.stdout
        # Preparation: one line per step; skipped steps print nothing, present ones say so.
        prep = out.split("== preparing", 1)[1].split("== hypic demo", 1)[0]
        self.assertRegex(prep, r"\ntokenizer  the checkpoint's own: \S+models/trained/qwen35-dense/tokenizer\.json\n")
        self.assertNotIn("model ", prep)    # nothing to make
        self.assertNotIn("packages", prep)  # --skip-setup
        self.assertNotIn("build ", prep)    # --skip-build
        self.assertIn("TRAINED on the multi-document task", out)
        self.assertIn("task       held-out prompt t-00003 (two_hop): the answer needs document(s) 0 and 3", out)
        # the answer is checked against the held-out set's, computed here independently of the script
        row = next(json.loads(l) for l in (SOURCE_DIR / "bench/datasets/heldout_test.jsonl").open()
                   if json.loads(l)["id"] == "t-00003")
        self.assertIn(f'answer     right: "{row["answer"].strip()}" is the held-out answer of t-00003', out)
        run1 = out.split("== run 1 of 2", 1)[1].split("== run 2 of 2", 1)[0]
        self.assertIn(row["answer"].strip(), run1)
        # Run 2 does not claim its entries came "from the cache": the table and the summary say where.
        run2 = out.split("== run 2 of 2", 1)[1].split("== comparison", 1)[0]
        self.assertNotIn("reused from the cache", run2)
        self.assertIn("entries: 4 reused from the combine worker's own memory tier (combine-memory; not fetched from "
                      "the segment cache)", run2)
        rows = [l.split() for l in run2.splitlines() if l.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
        self.assertEqual([row[3] for row in rows], ["combine-memory"] * 4, run2)
        self.assertRegex(run2, r"TTFT [0-9.]+ ms = router .* \+ splice [0-9.]+ \+ first decode")
        self.assertIn("run 2's entries: 4 from the combine worker's own memory tier (combine-memory), 0 fetched from "
                      "the segment cache (cache)", out)
        self.assertIn("the cluster is shut down; no process is left.", out)

    def test_random_model_says_so(self):
        r = demo("--smoke", "--random-model")
        self.assertEqual(r.returncode, 0, f"demo.sh --smoke --random-model failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        prep = r.stdout.split("== preparing", 1)[1].split("== hypic demo", 1)[0]
        self.assertRegex(prep, r"\ntokenizer  (cached|fetched): \S+tokenizer\.json\n")
        self.assertRegex(prep, r"\nmodel      (cached|made): \S+demo-seed1\n")
        self.assertIn("RANDOM WEIGHTS", r.stdout)
        self.assertIn("(random weights: the text itself means nothing.", r.stdout)
        self.assertNotIn("answer     right", r.stdout)

    def test_task_prompt_errors(self):
        r = demo("--task-prompt", "t-99999", timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("--task-prompt t-99999: no such prompt", r.stderr)
        r = demo("--random-model", "--task-prompt", "t-00001", timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--task-prompt needs a trained task checkpoint", r.stderr)
        r = demo("--random-model", "--model", "models/trained/next-moe", timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)

    def test_bad_documents_name_the_reason(self):
        for doc, reason in (("/nonexistent/doc.txt", "--doc /nonexistent/doc.txt: no such file"),
                            ("/", "--doc /: is a directory")):
            with self.subTest(doc=doc):
                r = demo("--doc", doc, timeout=30)
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn(reason, r.stderr)

    def test_setup_check_installs_nothing(self):
        r = subprocess.run([str(SOURCE_DIR / "scripts" / "setup.sh"), "--check"], capture_output=True, text=True,
                           timeout=60)
        self.assertIn(r.returncode, (0, 1), r.stderr)
        self.assertEqual(r.stdout, "")  # quiet: only the missing packages, on stderr
        if r.returncode == 1:
            self.assertIn("[setup] missing:", r.stderr)
        r = subprocess.run([str(SOURCE_DIR / "scripts" / "setup.sh"), "--bogus"], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("usage: scripts/setup.sh [--check]", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
