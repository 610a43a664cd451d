"""The number flags of the command-line tools (hypic-model, hypic-eval and the CPU benchmarks), read through each
tool's own registration code: whole decimal numbers ("010" is 10 where CLI11 2.1 read octal 8, "0x10" is refused where
it read hex 16, "-1" is refused where it wrapped an unsigned option) and finite decimal reals (no "nan" or "inf"), each
in its range (proto/rpc/flags.h). A refused value ends the parse with CLI11's validation exit code (105) and a message
naming the flag, the value and the range, before the tool loads or writes anything.

Python 3.11 standard library only; run as `python3 tests/integration/test_cli_flags.py CliNumberFlagsTest`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_test_support import BIN_DIR, SOURCE_DIR  # noqa: E402

FIXTURE = SOURCE_DIR / "tests" / "fixtures" / "kimi_linear_grouped"
VALIDATION_EXIT = 105  # CLI::ExitCodes::ValidationError

# (binary, arguments before the flag, flag, range as the message writes it). Only the flag under test is given where
# the tool's other flags are required: the refusal comes before CLI11 checks for required flags.
INT_FLAGS = [
    ("hypic-model", ["info", "--model", str(FIXTURE)], "--segment-tokens", "[1, 2147483647]"),
    ("hypic-model", ["init"], "--seed", "[0, 18446744073709551615]"),
    ("hypic-model", ["generate"], "--max-new-tokens", "[0, 2147483647]"),
    ("hypic-model", ["generate"], "--eos", "[-1, 2147483647]"),
    ("hypic-eval", [], "--seam-width", "[0, 2147483647]"),
    ("hypic-eval", [], "--max-new-tokens", "[0, 2147483647]"),
    ("hypic-eval", [], "--seam-widths", "[0, 2147483647]"),
    ("hypic-eval", [], "--refresh", "[1, 2147483647]"),
    ("hypic-eval", [], "--refresh-tail", "[1, 2147483647]"),
    ("hypic-eval", [], "--refresh-seam-width", "[0, 2147483647]"),
    ("hypic-eval", [], "--limit", "[0, 18446744073709551615]"),
    ("hypic-bench-prefill", [], "--repeats", "[1, 2147483647]"),
    ("hypic-bench-prefill", [], "--threads", "[0, 2147483647]"),
    ("hypic-bench-prefill", [], "--seed", "[0, 4294967295]"),
    ("hypic-bench-tokenizer", [], "--chunk-bytes", "[1, 1073741824]"),
    ("hypic-bench-tokenizer", [], "--passes", "[2, 100]"),
    ("hypic-bench-load", [], "--streams", "[1, 2147483647]"),
    ("hypic-bench-load", [], "--channels", "[1, 2147483647]"),
    ("hypic-bench-load", [], "--requests", "[0, 9223372036854775807]"),
    ("hypic-bench-load", [], "--pool", "[1, 2147483647]"),
    ("hypic-bench-load", [], "--segments", "[1, 2147483647]"),
    ("hypic-bench-load", [], "--query-tokens", "[1, 2147483647]"),
    ("hypic-bench-load", [], "--max-tokens", "[1, 2147483647]"),
    ("hypic-bench-load", [], "--seed", "[0, 18446744073709551615]"),
    ("hypic-bench-cluster", [], "--scatter-workers", "[0, 1024]"),
    ("hypic-bench-cluster", [], "--seed", "[0, 18446744073709551615]"),
    ("hypic-bench-cluster", [], "--query-tokens", "[1, 1048576]"),
    ("hypic-bench-cluster", [], "--max-tokens", "[1, 4096]"),
    ("hypic-bench-cluster", [], "--prompts", "[1, 100000]"),
    ("hypic-bench-cluster", [], "--segments", "[1, 4096]"),
    ("hypic-bench-cluster", [], "--scaling-requests", "[1, 100000]"),
    ("hypic-bench-cluster", [], "--scaling-segments", "[1, 4096]"),
    ("hypic-bench-cluster", [], "--schedule-requests", "[1, 100000]"),
    ("hypic-bench-cluster", [], "--long-tokens", "[1, 1048576]"),
    ("hypic-bench-cluster", [], "--short-tokens", "[1, 1048576]"),
    ("hypic-bench-cluster", [], "--serving-prompts", "[1, 100000]"),
    ("hypic-bench-cluster", [], "--serving-segments", "[1, 4096]"),
    ("hypic-bench-cluster", [], "--load-requests", "[1, 100000]"),
    ("hypic-bench-cluster", [], "--load-segments", "[1, 4096]"),
    ("hypic-bench-cluster", [], "--load-pool", "[1, 100000]"),
]
REAL_FLAGS = [
    ("hypic-model", ["init"], "--std", "[0, 10]"),
    ("hypic-bench-load", [], "--duration-s", "[0, 604800]"),
    ("hypic-bench-load", [], "--timeout-s", "[0.001, 604800]"),
    ("hypic-bench-load", [], "--refused-backoff-ms", "[0, 3600000]"),
    ("hypic-bench-cluster", [], "--ready-timeout-s", "[0.001, 604800]"),
    ("hypic-bench-cluster", [], "--request-timeout-s", "[0.001, 604800]"),
    ("hypic-bench-cluster", [], "--hit-ratio", "[0, 1]"),
    ("hypic-bench-cluster", [], "--load-hit-ratio", "[0, 1]"),
    ("hypic-bench-cluster", [], "--slo-ms", "[0.001, 86400000]"),
]
BAD_INTS = ["0x10", "nan", "1e3", "12.5", "5k", "99999999999999999999"]
BAD_REALS = ["nan", "inf", "-inf", "0x1p3", "1,5", "-1"]


def run(binary: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN_DIR / binary), *args], capture_output=True, text=True, timeout=120)


class CliNumberFlagsTest(unittest.TestCase):
    def check_refused(self, binary: str, before: list[str], flag: str, value: str, what: str) -> None:
        with self.subTest(binary=binary, flag=flag, value=value):
            if not (BIN_DIR / binary).exists():
                self.skipTest(f"{binary} is not built")
            p = run(binary, *before, f"{flag}={value}")
            self.assertEqual(p.returncode, VALIDATION_EXIT, p.stderr[-1000:])
            self.assertIn(f"{flag}: {value} is not {what}", p.stderr)

    def test_integer_flags_refuse_anything_but_whole_decimal_numbers_in_range(self) -> None:
        for binary, before, flag, rng in INT_FLAGS:
            lo = int(rng[1:rng.index(",")])
            for value in BAD_INTS + ([str(lo - 1)] if lo >= 0 else ["-2"]):
                self.check_refused(binary, before, flag, value, f"a whole decimal number in {rng}")

    def test_real_flags_refuse_non_finite_and_non_decimal_values(self) -> None:
        for binary, before, flag, rng in REAL_FLAGS:
            for value in BAD_REALS:
                self.check_refused(binary, before, flag, value, f"a finite number in {rng}")

    def test_combine_worker_rate_priors_refuse_non_decimal_and_out_of_range_values(self) -> None:
        for flag in ["--fetch-rate-prior-mb-per-s", "--build-rate-prior-tokens-per-s", "--staged-rate-prior-gb-per-s"]:
            for value, why in [("0x10", "not a decimal number"), (" 1", "not a decimal number"),
                               ("nan", "not a decimal number"), ("inf", "not a decimal number"),
                               ("1e-7", "must be 0 or in [1e-6, 1e12]"), ("-1", "must be 0 or in [1e-6, 1e12]"),
                               ("1e13", "must be 0 or in [1e-6, 1e12]")]:
                with self.subTest(flag=flag, value=value):
                    if not (BIN_DIR / "hypic-combine-worker").exists():
                        self.skipTest("hypic-combine-worker is not built")
                    p = run("hypic-combine-worker", f"{flag}={value}")
                    self.assertEqual(p.returncode, VALIDATION_EXIT, p.stderr[-1000:])
                    self.assertIn(flag, p.stderr)
                    self.assertIn(why, p.stderr)

    def test_model_reads_leading_zeros_in_base_10(self) -> None:
        p = run("hypic-model", "info", "--model", str(FIXTURE), "--segment-tokens", "010", "--json")
        self.assertEqual(p.returncode, 0, p.stderr[-1000:])
        self.assertEqual(json.loads(p.stdout)["segment_tokens"], 10)  # CLI11 read 8
        with tempfile.TemporaryDirectory(prefix="hypic-cli-flags-") as tmp:
            out = Path(tmp) / "ck"
            p = run("hypic-model", "init", "--config", str(FIXTURE / "config.json"), "--seed", "010", "--std", "0.05",
                    "--out", str(out))
            self.assertEqual(p.returncode, 0, p.stderr[-1000:])
            p = run("hypic-model", "info", "--model", str(out), "--json")
            self.assertEqual(json.loads(p.stdout)["random_weights_seed"], "10")
            p = run("hypic-model", "generate", "--model", str(out), "--ids", "1,2,3", "--max-new-tokens", "03")
            self.assertEqual(p.returncode, 0, p.stderr[-1000:])
            self.assertEqual(len(json.loads(p.stdout)), 3)

    def test_eval_reads_leading_zeros_in_base_10(self) -> None:
        with tempfile.TemporaryDirectory(prefix="hypic-cli-flags-") as tmp:
            seg = Path(tmp) / "seg.txt"
            seg.write_text("1 2 3 4 5 6 7 8 9 10 11 12\n")
            p = run("hypic-eval", "--model", str(FIXTURE), "--token-file", str(seg), "--token-file", str(seg),
                    "--query-ids", "5,6", "--modes", "hypic", "--seam-width", "010", "--max-new-tokens", "02",
                    "--json")
        self.assertEqual(p.returncode, 0, p.stderr[-1000:])
        self.assertEqual(json.loads(p.stdout[p.stdout.index("{"):])["seam_width"], 10)  # CLI11 read 8


if __name__ == "__main__":
    unittest.main()
