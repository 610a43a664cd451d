#!/usr/bin/env python3
"""The main job's smoke run and what it tells the user: scripts/demo.sh --smoke --skip-setup --skip-build against
this build's binaries (the demo model, the real Qwen3 tokenizer, a local cluster, a cold then a warm request, no
process left), and its output: one line per preparation step, the warm run saying where its entries came from (the
combine worker's memory tier, not "the cache"), the comparison counting them; bad --doc files named with the reason.

  python3 tests/demo/test_demo.py BIN_DIR        (ctest: demo.smoke)
Python 3.11 standard library only.
"""
from __future__ import annotations

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
        r = demo("--smoke")
        self.assertEqual(r.returncode, 0, f"demo.sh --smoke failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        out = r.stdout
        # Preparation: one line per step; skipped steps print nothing, present ones say so.
        prep = out.split("== preparing", 1)[1].split("== hypic demo", 1)[0]
        self.assertRegex(prep, r"\ntokenizer  (cached|fetched): \S+tokenizer\.json\n")
        self.assertRegex(prep, r"\nmodel      (cached|made): \S+demo-seed1\n")
        self.assertNotIn("packages", prep)  # --skip-setup
        self.assertNotIn("build ", prep)    # --skip-build
        # Run 2 does not claim its entries came "from the cache": the table and the summary say where.
        run2 = out.split("== run 2 of 2", 1)[1].split("== comparison", 1)[0]
        self.assertNotIn("reused from the cache", run2)
        self.assertIn("entries: 2 reused from the combine worker's own memory tier (combine-memory; not fetched from "
                      "the segment cache)", run2)
        rows = [l.split() for l in run2.splitlines() if l.split()[:1] in (["0"], ["1"])]
        self.assertEqual([row[3] for row in rows], ["combine-memory"] * 2, run2)
        self.assertRegex(run2, r"TTFT [0-9.]+ ms = router .* \+ splice [0-9.]+ \+ first decode")
        self.assertIn("run 2's entries: 2 from the combine worker's own memory tier (combine-memory), 0 fetched from "
                      "the segment cache (cache)", out)
        self.assertIn("the cluster is shut down; no process is left.", out)

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
