"""Hostile cases (issue 26, items 3-6) against real processes on loopback, each asserting the right outcome:

- PoisonTest: a relabelled cache entry (another document's bytes and MAC under this document's digest and token ids,
  checksums recomputed) is refused by the combine worker's MAC check, counted, dropped, and the answer is unchanged;
  an internal caller's limits are not trusted (a combine worker refuses decode tokens past its own cap; a scatter
  worker refuses a combine_address it was not configured with); untrusted text is escaped in logs and errors.
- UserCertificateTest: under mutual TLS a user certificate reaches the router but cannot Put, Delete or call a worker;
  the services' certificate can.
- PutBudgetTest: a Put past the cache's budget is refused from its header, before its bytes are buffered.
- FrozenWorkerTest: a frozen scatter worker is found within about 2.5 s (channel keepalive) and its work replanned.
- ClientFlagTest: every bad hypic-client flag value is refused with a message naming the flag (no cluster).
- LauncherGroupTest: the launcher ends what the command left running in the background.
- CancelTest: a cancelled long prompt stops at the end of its current pass: the next small request barely waits.
Python 3.11 standard library only."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_test_support import BIN_DIR, SOURCE_DIR, ClusterTestCase, Env, words  # noqa: E402

CLIENT = str(BIN_DIR / "hypic-client")


def run(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([CLIENT, *args], capture_output=True, text=True, timeout=timeout, env=env)


class PoisonTest(ClusterTestCase):
    """The launcher gives the workers a cluster key (--cache-key-file). The combine worker keeps no tier of its own
    (--memory-tier-bytes 0), so every warm segment is read from the cache and checked there; its decode cap is below
    the router's."""
    scatter_workers = 1
    extra_args = {"combine": ["--memory-tier-bytes", "0", "--max-new-tokens", "16"]}

    def test_relabelled_entry_is_refused_and_the_answer_unchanged(self):
        doc_a, doc_b, query = words(2601, 60), words(2602, 60), "What is said?"
        first_b = self.generate([doc_b], query)
        rep_b = self.ok(first_b)
        rep_a = self.ok(self.generate([doc_a], query))
        self.wait_cached(rep_b, rep_a)
        cache = self.cluster.address("cache-0")
        digest_a = self.ok(self.generate([doc_a], query))["segments"][0]["digest_hex"]
        digest_b = rep_b["segments"][0]["digest_hex"]
        with tempfile.TemporaryDirectory() as d:
            entry_a, entry_b = Path(d) / "a", Path(d) / "b"
            got_a = run("cache-get", "--cache", cache, "--digest", digest_a, "--out", str(entry_a))
            got_b = run("cache-get", "--cache", cache, "--digest", digest_b, "--out", str(entry_b))
            self.assertEqual(got_a.returncode, 0, got_a.stderr)
            self.assertEqual(got_b.returncode, 0, got_b.stderr)
            a, b = json.loads(got_a.stdout), json.loads(got_b.stdout)
            # Every entry carries its MAC: AES-256-GMAC by default (29 bytes: version 2, nonce, tag).
            self.assertEqual(len(a["mac_hex"]), 58)
            self.assertEqual(a["mac_hex"][:2], "02")
            # The attack: A's bytes and A's MAC relabelled as B (B's digest and token ids; the checksum is recomputed
            # by the put).
            put = run("cache-put", "--cache", cache, "--digest", digest_b, "--token-ids",
                      ",".join(map(str, b["token_ids"])), "--in", str(entry_a), "--mac-hex", a["mac_hex"])
            self.assertEqual(put.returncode, 0, put.stderr)
            self.assertTrue(json.loads(put.stdout)["replaced"])
            refused = self.combine_metric("hypic:cache_entries_refused_total")
            second_b = self.generate([doc_b], query)
            rep = self.ok(second_b)
            seg = rep["segments"][0]
            self.assertNotEqual(seg["source"], "SEGMENT_SOURCE_CACHE")  # not spliced from the forged entry
            # A's header names A's token ids: refused as soon as the header arrives, before any tensor is sized.
            self.assertIn("token ids differ", seg.get("note", ""))
            self.assertEqual(second_b["token_ids"], first_b["token_ids"])
            self.assertEqual(second_b["token_ids"], self.reference([doc_b], query))
            self.assertEqual(self.combine_metric("hypic:cache_entries_refused_total"), refused + 1)
            # The forged entry was dropped (before the answer) and the recomputed one is put back (after it, off the
            # request's path): wait for it, so that the entry read and forged below is not replaced by a late put.
            self.wait_cached(rep)
            # B's entry in the cache now is the recomputed one, not A's.
            again = run("cache-get", "--cache", cache, "--digest", digest_b, "--out", str(entry_b))
            self.assertEqual(again.returncode, 0, again.stderr)
            self.assertNotEqual(entry_b.read_bytes(), entry_a.read_bytes())
            # B's own bytes under B's label but with A's MAC: everything else checks out, the MAC does not.
            got_b = run("cache-get", "--cache", cache, "--digest", digest_b, "--out", str(entry_b))
            self.assertEqual(got_b.returncode, 0, got_b.stderr)
            failures = self.combine_metric("hypic:entry_mac_failures_total")
            put = run("cache-put", "--cache", cache, "--digest", digest_b, "--token-ids",
                      ",".join(map(str, b["token_ids"])), "--in", str(entry_b), "--mac-hex", a["mac_hex"])
            self.assertEqual(put.returncode, 0, put.stderr)
            third_b = self.generate([doc_b], query)
            rep = self.ok(third_b)
            self.assertIn("MAC does not verify", rep["segments"][0].get("note", ""))
            self.assertEqual(third_b["token_ids"], first_b["token_ids"])
            self.assertEqual(self.combine_metric("hypic:entry_mac_failures_total"), failures + 1)
            self.wait_cached(rep)  # the recomputed entry, put back (as above)
            # Without a MAC it is refused too (a plain cache-put of B's own bytes under its own label).
            got_b = run("cache-get", "--cache", cache, "--digest", digest_b, "--out", str(entry_b))
            self.assertEqual(got_b.returncode, 0, got_b.stderr)
            put = run("cache-put", "--cache", cache, "--digest", digest_b, "--token-ids",
                      ",".join(map(str, b["token_ids"])), "--in", str(entry_b))
            self.assertEqual(put.returncode, 0, put.stderr)
            fourth_b = self.generate([doc_b], query)
            self.assertIn("carries no MAC", self.ok(fourth_b)["segments"][0].get("note", ""))
            self.assertEqual(fourth_b["token_ids"], first_b["token_ids"])

    @staticmethod
    def xxh3(data: bytes) -> int:
        """XXH3-64 (the entry format's checksums), through the libxxhash the services link."""
        import ctypes
        lib = ctypes.CDLL("libxxhash.so.0")
        lib.XXH3_64bits.restype = ctypes.c_uint64
        lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        return lib.XXH3_64bits(data, len(data))

    def cached_entry(self, doc: list, query: str) -> tuple:
        """Generates on `doc` (its entry goes to the cache) and reads the entry back: (first answer, cache address,
        digest hex, cache-get's JSON (token ids, MAC), the entry's bytes)."""
        first = self.generate([doc], query)
        rep = self.ok(first)
        self.wait_cached(rep)
        cache = self.cluster.address("cache-0")
        digest = rep["segments"][0]["digest_hex"]
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "e"
            got = run("cache-get", "--cache", cache, "--digest", digest, "--out", str(path))
            self.assertEqual(got.returncode, 0, got.stderr)
            return first, cache, digest, json.loads(got.stdout), path.read_bytes()

    def put_forged(self, cache: str, digest: str, info: dict, data: bytes) -> None:
        """Puts `data` under the entry's own digest, token ids and MAC."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "forged"
            path.write_bytes(data)
            put = run("cache-put", "--cache", cache, "--digest", digest, "--token-ids",
                      ",".join(map(str, info["token_ids"])), "--in", str(path), "--mac-hex", info["mac_hex"])
            self.assertEqual(put.returncode, 0, put.stderr)

    def test_header_claiming_gigabytes_is_refused_before_anything_is_sized(self):
        """An entry's header is not authenticated until its whole stream (checksum, MAC) has been read, so nothing it
        announces may size memory first: a real entry whose header claims ~250 GB of K/V (header checksum recomputed)
        is refused against the stream's size, counted, dropped, and the segment recomputed; the combine worker neither
        dies (std::bad_alloc) nor grows."""
        doc, query = words(2605, 60), "What is said?"
        first, cache, digest, info, data = self.cached_entry(doc, query)
        combine = self.cluster.services["combine"].proc.pid

        def peak_kib() -> int:
            for line in Path(f"/proc/{combine}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
            return 0
        raw = bytearray(data)
        (hlen,) = struct.unpack_from("<I", raw, 8)
        h = 12  # the header: version, fingerprint, numerics, w, n, ids, then the 9 geometry values
        (fp_len,) = struct.unpack_from("<I", raw, h + 4)
        (num_len,) = struct.unpack_from("<I", raw, h + 8 + fp_len)
        (n,) = struct.unpack_from("<I", raw, h + 8 + fp_len + 4 + num_len + 4)
        geometry = h + 8 + fp_len + 4 + num_len + 8 + 4 * n
        struct.pack_into("<II", raw, geometry + 5 * 4, 1280, 131072)  # kv_heads, head_dim: ~250 GB of K/V
        struct.pack_into("<Q", raw, 12 + hlen, self.xxh3(bytes(raw[12:12 + hlen])))
        self.put_forged(cache, digest, info, bytes(raw))
        refused, peak = self.combine_metric("hypic:cache_entries_refused_total"), peak_kib()
        again = self.generate([doc], query)
        seg = self.ok(again)["segments"][0]
        self.assertNotEqual(seg["source"], "SEGMENT_SOURCE_CACHE")
        self.assertIn("truncated: its header announces", seg.get("note", ""))
        self.assertEqual(again["token_ids"], first["token_ids"])
        self.assertEqual(self.combine_metric("hypic:cache_entries_refused_total"), refused + 1)
        self.assertTrue(self.cluster.services["combine"].alive())
        self.assertLess(peak_kib() - peak, 256 * 1024)  # no gigabytes sized by the header (peak RSS, KiB)

    def test_header_with_a_huge_fingerprint_is_refused_at_its_length(self):
        """A real entry whose header carries a 4 MB fingerprint (its size and checksums consistent): refused at the
        header's length, before it is buffered, and nothing of it is quoted at length in the segment's note."""
        doc, query = words(2606, 60), "What is said?"
        first, cache, digest, info, raw = self.cached_entry(doc, query)
        (hlen,) = struct.unpack_from("<I", raw, 8)
        (fp_len,) = struct.unpack_from("<I", raw, 16)
        fp = b"f" * (4 << 20)
        header = raw[12:16] + struct.pack("<I", len(fp)) + fp + raw[20 + fp_len:12 + hlen]
        body = b"HYPICSEG" + struct.pack("<I", len(header)) + header
        body += struct.pack("<Q", self.xxh3(header)) + raw[12 + hlen + 8:-8]
        body += struct.pack("<Q", self.xxh3(body))
        self.put_forged(cache, digest, info, body)
        again = self.generate([doc], query)
        seg = self.ok(again)["segments"][0]
        self.assertNotEqual(seg["source"], "SEGMENT_SOURCE_CACHE")
        self.assertIn("this model's entry of these tokens takes", seg.get("note", ""))
        self.assertLess(len(seg.get("note", "")), 2000)
        self.assertEqual(again["token_ids"], first["token_ids"])

    def test_combine_worker_caps_decode_tokens_itself(self):
        r = self.generate([words(2603, 30)], "Go on.", max_tokens=40)  # the router allows 4096, the worker 16
        self.assertNotEqual(r["rc"], 0)
        self.assertIn("INVALID_ARGUMENT", r["stderr"])
        self.assertIn("sampling.max_tokens: 40 exceeds this combine worker's limit of 16 (--max-new-tokens)",
                      r["stderr"])
        self.ok(self.generate([words(2603, 30)], "Go on.", max_tokens=16))

    def test_newline_in_request_id_never_reaches_a_log_unescaped(self):
        r = self.generate([words(2604, 20)], "Who?", request_id="abc\nFORGED [router] [info] all good")
        self.assertNotEqual(r["rc"], 0)
        self.assertIn("INVALID_ARGUMENT: request_id", r["stderr"])
        deadline = time.monotonic() + 10
        log = ""
        while time.monotonic() < deadline:
            log = self.cluster.services["router"].log_path.read_text()
            if "FORGED" in log:
                break
            time.sleep(0.1)
        self.assertIn('"abc\\nFORGED [router] [info] all good"', log)
        for line in log.splitlines():
            self.assertFalse(line.startswith("FORGED"), line)

    def test_8kb_mode_is_invalid_argument(self):
        mode = "x" * 8192 + "\n"
        r = self.generate([words(2605, 20)], "Who?", "--mode", mode)
        self.assertNotEqual(r["rc"], 0)
        self.assertIn("INVALID_ARGUMENT: cache.mode: unknown splice mode", r["stderr"])
        self.assertNotIn("RESOURCE_EXHAUSTED", r["stderr"])
        self.assertLess(len(r["stderr"]), 2000)  # cut to a few hundred bytes, not echoed whole
        log = self.cluster.services["router"].log_path.read_text()
        self.assertNotIn("x" * 300, log)

    def test_a_short_deadline_is_not_blamed_on_tls(self):
        r = self.generate([words(2607, 30)], "Who?", deadline_s=0.001)
        self.assertNotEqual(r["rc"], 0)
        self.assertIn("DEADLINE_EXCEEDED", r["stderr"])
        self.assertNotIn("TLS", r["stderr"])

    def test_scatter_worker_refuses_an_unconfigured_combine_address(self):
        # The launcher started the scatter worker with --combine <the combine worker>: a caller naming another
        # combine_address is refused (the unit test drives Prefill directly: test_shared_builds.cpp); here the
        # configured one works and the start-up line names it.
        log = self.cluster.services["scatter-0"].log_path.read_text()
        self.assertIn(f"delivers only to the combine workers {self.cluster.combine_address}", log)
        self.ok(self.generate([words(2606, 30)], "Who?"))


class CancelTest(ClusterTestCase):
    """Cancellation reaches the engine (item 2): the trained checkpoint (a CPU prefill of about 2k tokens/s on 2
    cores), no scatter workers (the combine worker prefills), splices cut into passes of 512 tokens
    (--max-pass-tokens), so a request cancelled by its deadline stops within one pass."""
    model_dir = str(SOURCE_DIR / "models" / "trained" / "qwen35-dense")
    tokenizer_file = str(SOURCE_DIR / "models" / "trained" / "qwen35-dense" / "tokenizer.json")
    extra_args = {"combine": ["--max-pass-tokens", "512"]}

    def small(self) -> float:
        """A small request's time to first token as the router measured it (from its arrival), in seconds: what a
        prefill still running would delay, without the client process's start-up, which on a loaded machine varies by
        more than the half second asserted below."""
        rep = self.ok(self.generate([words(2611, 20)], "Who?", "--mode", "full", max_tokens=2))
        return rep["ttft"]["total_ms"] / 1000

    def test_a_cancelled_long_prompt_delays_the_next_request_by_at_most_half_a_second(self):
        self.small()  # warm
        alone = min(self.small() for _ in range(3))
        result: list = []
        long_request = threading.Thread(target=lambda: result.append(
            self.generate([words(2612, 9000)], "Summarise.", "--mode", "full", max_tokens=2, deadline_s=1.0)))
        long_request.start()
        time.sleep(1.3)  # past its deadline, its prefill of ~20k tokens (about 10 s whole) under way
        after = self.small()
        long_request.join()
        self.assertNotEqual(result[0]["rc"], 0)
        self.assertIn("DEADLINE_EXCEEDED", result[0]["stderr"])
        self.assertLess(after - alone, 0.5, f"the small request's TTFT was {after:.2f} s after the "
                                            f"cancellation, {alone:.2f} s alone")


class CancelScatterTest(ClusterTestCase):
    """A cold document on a scatter worker (the trained checkpoint, 1 scatter worker) whose every requester is gone
    and whose entry would not be stored (--no-cache-write) stops being built within a layer of one of its 512-token
    passes (SharedBuilds' stop flag, Backend::build_entries' cancellation), so a small cold request that comes next is
    not held behind it: 14.4 s before. (One that would be stored runs on and is stored: AbandonedBuildTest.)"""
    model_dir = CancelTest.model_dir
    tokenizer_file = CancelTest.tokenizer_file
    scatter_workers = 1

    def small(self, seed: int) -> float:
        """A small cold request (through the scatter worker): its time to first token as the router measured it, in
        seconds (CancelTest.small)."""
        rep = self.ok(self.generate([words(seed, 20)], "Who?", "--no-cache-write", max_tokens=2))
        return rep["ttft"]["total_ms"] / 1000

    def test_a_cancelled_cold_document_stops_being_built(self):
        self.small(2630)
        alone = min(self.small(2631 + i) for i in range(3))
        result: list = []
        long_request = threading.Thread(target=lambda: result.append(
            self.generate([words(2613, 9000)], "Summarise.", "--no-cache-write", max_tokens=2, deadline_s=1.0)))
        long_request.start()
        time.sleep(1.3)  # past its deadline, its build of ~20k tokens (about 10 s whole) under way
        after = self.small(2640)
        long_request.join()
        self.assertNotEqual(result[0]["rc"], 0)
        self.assertIn("DEADLINE_EXCEEDED", result[0]["stderr"])
        self.assertLess(after - alone, 0.5, f"the small request's TTFT was {after:.2f} s after the "
                                            f"cancellation, {alone:.2f} s alone")
        log = self.cluster.services["scatter-0"].log_path.read_text()
        self.assertNotIn("finished after every request waiting for it had gone", log)


class FrozenWorkerTest(ClusterTestCase):
    """A scatter worker frozen (SIGSTOP) while a request waits on it: the router's channel keepalive (a ping a second,
    1.5 s to answer) finds it within about 2.5 s and its segments are planned again (before: ~15 s)."""
    scatter_workers = 2

    def test_frozen_worker_is_detected_within_3_s(self):
        segs = [words(2621 + i, 120) for i in range(4)]  # spread over both workers (LPT)
        query = "Which one?"
        want = self.reference(segs, query, max_tokens=4)
        frozen = self.cluster.services["scatter-0"]
        frozen.signal_group(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = self.generate(segs, query, max_tokens=4)
            took = time.monotonic() - t0
        finally:
            frozen.signal_group(signal.SIGCONT)
        self.ok(r)
        self.assertEqual(r["token_ids"], want)
        # 2.5 s to find the frozen worker, plus the request's own work on the tiny model (well under 2 s here).
        self.assertLess(took, 6.0, r["stderr"])
        # It was given segments, and they were planned again when its connection was found dead.
        log = self.cluster.services["router"].log_path.read_text()
        self.assertIn(f"scatter worker {frozen.address} failed (UNAVAILABLE", log)
        self.assertTrue(all(s.get("built_by") != frozen.address for s in r["report"]["segments"]))


class UserCertificateTest(ClusterTestCase):
    """Mutual TLS with distinct identities (LocalCluster(tls=True), scripts/make_certs.sh): the user certificate
    (client.crt, CN hypic-user) reaches the router only; the services' (server.crt, CN hypic-service) everything."""
    tls = True
    scatter_workers = 1

    def env(self, who: str) -> dict:
        env = dict(os.environ, **self.cluster.environment())
        if who == "service":
            d = self.cluster.tls_dir
            env.update(HYPIC_TLS_CLIENT_CERT=str(d / "server.crt"), HYPIC_TLS_CLIENT_KEY=str(d / "server.key"))
        return env

    def test_user_certificate_cannot_put_delete_or_call_a_worker(self):
        user, service = self.env("user"), self.env("service")
        seg, query = words(2611, 40), "Who?"
        r = run("generate", "--router", self.cluster.router_address, "--segment", seg, "--query", query,
                "--max-tokens", "2", "--timeout-seconds", "60", "--json", env=user)
        self.assertEqual(r.returncode, 0, r.stderr)  # users call the router
        cache = self.cluster.address("cache-0")
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"forged bytes")
            f.flush()
            for who, want in ((user, "SegmentCache.Put is for hypic services only"),
                              (service, None)):
                put = run("cache-put", "--cache", cache, "--digest", "00" * 16, "--token-ids", "1,2", "--in", f.name,
                          env=who)
                if want:
                    self.assertNotEqual(put.returncode, 0)
                    self.assertIn("PERMISSION_DENIED", put.stderr)
                    self.assertIn(want, put.stderr)
                    self.assertIn("hypic-user", put.stderr)
                else:
                    self.assertEqual(put.returncode, 0, put.stderr)
        d = run("cache-delete", "--cache", cache, "--digest", "00" * 16, env=user)
        self.assertIn("PERMISSION_DENIED", d.stderr)
        self.assertIn("SegmentCache.Delete is for hypic services only", d.stderr)
        d = run("cache-get", "--cache", cache, "--digest", "00" * 16, "--out", os.devnull, env=user)
        self.assertIn("PERMISSION_DENIED", d.stderr)
        self.assertIn("SegmentCache.Get is for hypic services only", d.stderr)
        for role, target in (("scatter", self.cluster.address("scatter-0")), ("combine", self.cluster.combine_address)):
            w = run("worker-info", "--target", target, "--role", role, env=user)
            self.assertNotEqual(w.returncode, 0)
            self.assertIn("PERMISSION_DENIED", w.stderr)
            w = run("worker-info", "--target", target, "--role", role, env=service)
            self.assertEqual(w.returncode, 0, w.stderr)
            self.assertEqual(json.loads(w.stdout)["role"], role)
        d = run("cache-delete", "--cache", cache, "--digest", "00" * 16, env=service)
        self.assertEqual(d.returncode, 0, d.stderr)


class PutBudgetTest(unittest.TestCase):
    """A segment cache alone (--memory-bytes 1MiB): a Put announcing more is refused from its header."""

    def test_put_past_the_budget_is_refused_before_buffering(self):
        with tempfile.TemporaryDirectory() as d:
            port_file = Path(d) / "port"
            proc = subprocess.Popen([str(BIN_DIR / "hypic-segment-cache"), "--listen", "127.0.0.1:0", "--port-file",
                                     str(port_file), "--memory-bytes", "1MiB", "--parent-pid", str(os.getpid())],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 30
                while not port_file.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                addr = f"127.0.0.1:{port_file.read_text().strip()}"
                big = Path(d) / "big"
                big.write_bytes(os.urandom(1 << 20) * 8)  # 8 MiB
                t0 = time.monotonic()
                put = run("cache-put", "--cache", addr, "--digest", "11" * 16, "--token-ids", "1", "--in", str(big))
                self.assertNotEqual(put.returncode, 0)
                self.assertIn("RESOURCE_EXHAUSTED", put.stderr)
                self.assertIn("refused before reading it", put.stderr)
                self.assertLess(time.monotonic() - t0, 20)
                stats = json.loads(run("cache-stats", "--cache", addr).stdout)
                self.assertEqual(int(stats.get("rejected_puts", 0)), 1)
                self.assertEqual(int(stats.get("entries", 0)), 0)
                small = Path(d) / "small"
                small.write_bytes(b"x" * 1000)
                ok = run("cache-put", "--cache", addr, "--digest", "22" * 16, "--token-ids", "1", "--in", str(small))
                self.assertEqual(ok.returncode, 0, ok.stderr)
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)


class ClientFlagTest(unittest.TestCase):
    """Each bad value is refused by hypic-client itself (exit 1, before any call) with the flag named."""

    def refused(self, flag: str, *args: str) -> None:
        r = run(*args, timeout=30)
        self.assertEqual(r.returncode, 1, f"{args}: {r.stderr}")
        self.assertIn(f"error: {flag}:", r.stderr, args)

    def test_bad_values_are_refused_naming_the_flag(self):
        gen = ("generate", "--router", "127.0.0.1:1", "--segment", "a", "--query", "b")
        for value in ("nan", "-1", "-inf", "inf", "1e308", "abc", ""):
            self.refused("--timeout-seconds", *gen, "--timeout-seconds", value)
        for value in ("18446744073709551616", "-1", "1.5", "1e3"):
            self.refused("--seed", *gen, "--seed", value)
        for value in ("127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", "127.0.0.1:-5", "::1:80"):
            self.refused("--router", "generate", "--router", value, "--segment", "a", "--query", "b")
        self.refused("--target", "health", "--target", "localhost:65536")
        self.refused("--wait-seconds", "health", "--target", "localhost:1", "--wait-seconds", "nan")
        self.refused("--cache", "cache-stats", "--cache", "127.0.0.1:70000")
        self.refused("--count", "cache-events", "--cache", "127.0.0.1:1", "--count", "1180591620717411303424")
        self.refused("--count", "cache-events", "--cache", "127.0.0.1:1", "--count", "-1")
        for flag, value in (("--temperature", "nan"), ("--temperature", "1e400"), ("--top-p", "inf")):
            self.refused(flag, *gen, flag, value)
        t0 = time.monotonic()
        self.refused("--segment-file", "generate", "--router", "127.0.0.1:1", "--segment-file", "/dev/zero",
                     "--query", "b")
        self.refused("--query-file", "generate", "--router", "127.0.0.1:1", "--segment", "a", "--query-file",
                     "/dev/zero")
        self.assertLess(time.monotonic() - t0, 20)  # capped (64 MiB), not read to the end

    def test_tls_is_not_blamed_for_a_short_deadline(self):
        import socket
        with socket.socket() as s:  # something listens and speaks nothing: a TLS mismatch looks like this
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            r = run("generate", "--router", f"127.0.0.1:{port}", "--segment", "a", "--query", "b",
                    "--timeout-seconds", "0.5")
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("TLS settings probably do not match", r.stderr)


class LauncherGroupTest(unittest.TestCase):
    """The command's background children end with it (the launcher ends the command's process group)."""

    def test_background_children_of_the_command_are_ended(self):
        Env.ensure()
        with tempfile.TemporaryDirectory() as work:
            pid_file = Path(work) / "bg.pid"
            script = f"sleep 300 & echo $! > {pid_file}; exit 0"
            p = subprocess.run([sys.executable, str(SOURCE_DIR / "deploy" / "local_cluster.py"), "--bin-dir",
                                str(BIN_DIR), "--model", Env.model, "--tokenizer", Env.tokenizer, "--scatter-workers",
                                "1", "--device", "cpu", "--work-dir", str(Path(work) / "c"), "--", "sh", "-c",
                                script], capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stderr)
            pid = int(pid_file.read_text())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                try:  # reaped by init, or a zombie of ours? neither: it is the launcher's grandchild
                    state = Path(f"/proc/{pid}/status").read_text()
                    if "State:\tZ" in state:
                        break
                except OSError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
                self.fail("the command's background child outlived the launcher")


if __name__ == "__main__":
    unittest.main(verbosity=2)
