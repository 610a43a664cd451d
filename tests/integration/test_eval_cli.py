"""hypic-eval on one prompt with its default modes (full, prefix, naive, transition, hypic), as the README runs it.

Transition mode folds the T_C of entries made without a seam window, naive and hypic the entries made at --seam-width:
the command builds both from one prefill per segment. What must hold, on the kimi_linear_grouped fixture (layers
L L F L: the first linear layer comes before any attention, so its state does not depend on the attention's
inputs): the composition law S(C1 C2 | 0) = T_C2 S(C1 | 0) + S(C2 | 0) makes transition's and hypic's state of that
layer equal full's to fp32 rounding (DESIGN.md 3.1), while naive addition (T_C taken as the identity) is off by
order 1; prefix (a warm prefix cache) recomputes nothing but the query and matches full as well.

Python 3.11 standard library only; run as `python3 tests/integration/test_eval_cli.py EvalCliTest`.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_test_support import BIN_DIR, SOURCE_DIR  # noqa: E402


class EvalCliTest(unittest.TestCase):
    def run_eval(self, *extra: str) -> dict:
        with tempfile.TemporaryDirectory(prefix="hypic-eval-") as tmp:
            files = []
            for i, n in enumerate([300, 200, 250, 150]):  # the README's segments
                r = random.Random(1000 + i)
                f = Path(tmp) / f"seg{i}.txt"
                f.write_text(" ".join(str(r.randrange(256)) for _ in range(n)) + "\n")
                files += ["--token-file", str(f)]
            p = subprocess.run([str(BIN_DIR / "hypic-eval"), "--model",
                                str(SOURCE_DIR / "tests" / "fixtures" / "kimi_linear_grouped"), *files,
                                "--query-ids", "5,17,99,3,200", "--json", *extra],
                               capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        return json.loads(p.stdout[p.stdout.index("{"):])  # (a BLAS warning may precede the JSON)

    def test_default_modes_run_and_compose_exactly(self):
        out = self.run_eval()
        modes = out["modes"]
        self.assertEqual(set(modes), {"full", "prefix", "naive", "transition", "hypic"})
        self.assertEqual(out["prompt_tokens"], 905)
        self.assertEqual(modes["full"]["computed_tokens"], 905)
        # linear layer 0 precedes every attention layer: exact composition (fp32 rounding) for transition and hypic
        for m in ("prefix", "transition", "hypic"):
            self.assertLess(modes[m]["state_rel_err"][0], 1e-4, (m, modes[m]["state_rel_err"]))
        self.assertGreater(modes["naive"]["state_rel_err"][0], 0.1, modes["naive"]["state_rel_err"])
        # transition computes only the query; hypic also each boundary's seam window (3 boundaries x 8 tokens)
        self.assertEqual(modes["transition"]["computed_tokens"], 5)
        self.assertEqual(modes["hypic"]["computed_tokens"], 5 + 3 * 8)

    def test_transition_alone_and_with_seam_width_zero(self):
        for extra in (["--modes", "transition"], ["--seam-width", "0"]):
            out = self.run_eval(*extra)
            self.assertIn("transition", out["modes"], extra)
            self.assertLess(out["modes"]["transition"]["state_rel_err"][0], 1e-4, extra)


if __name__ == "__main__":
    unittest.main()
