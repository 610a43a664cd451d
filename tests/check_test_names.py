#!/usr/bin/env python3
"""Fails when a Catch2 TEST_CASE name contains ';': catch_discover_tests registers the name in a CMake list, which
splits it there, so the CTest entry's filter matches no test case, Catch2 runs nothing and exits 0, and CTest reports
a test that never ran as passed."""
import re
import sys
from pathlib import Path

root = Path(__file__).resolve().parent
bad = []
for f in sorted(root.rglob("*.cpp")):
    text = f.read_text(errors="replace")
    for m in re.finditer(r'TEST_CASE\(((?:\s*"(?:[^"\\]|\\.)*"\s*)+),', text):
        name = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
        if ";" in name:
            bad.append(f"{f.relative_to(root.parent)}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
if bad:
    print("TEST_CASE names must not contain ';' (CTest would run nothing for them):", *bad, sep="\n  ")
    sys.exit(1)
print("no TEST_CASE name contains ';'")
