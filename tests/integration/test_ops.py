#!/usr/bin/env python3
"""Operations integration tests (issue 13): Prometheus metrics of every service checked against the reports of the
requests that moved them, the segment cache's event stream, and TLS (mutual between services) with bearer tokens
on the router. Real services on loopback (deploy/local_cluster.py), driven with hypic-client.

Run one class per CTest test:  python3 tests/integration/test_ops.py MetricsTest
Environment: HYPIC_BIN_DIR (the built binaries), HYPIC_TOKENIZER (else scripts/fetch_tokenizer.sh).
"""
from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import unittest
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_test_support import BIN_DIR, ClusterTestCase, words  # noqa: E402

SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value of every sample; checks every line is a comment or a well-formed sample and that each
    family has its TYPE before its samples."""
    out: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = SAMPLE_RE.match(line)
        if not m:
            raise AssertionError(f"not a Prometheus sample line: {line!r}")
        name = m.group(1)
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in typed and family not in typed:
            raise AssertionError(f"sample before its # TYPE line: {line!r}")
        out[name + (m.group(2) or "")] = float(m.group(3))
    return out


def total(samples: dict[str, float], name: str) -> float:
    """Sum of a metric over its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


class MetricsTest(ClusterTestCase):
    """Every service's /metrics moves as the requests' reports say: tokens, lookups and hits, builds, bytes moved."""

    def scrape(self, name: str, context: ssl.SSLContext | None = None) -> dict[str, float]:
        address = self.cluster.metrics_address(name)
        self.assertIsNotNone(address, f"{name} has no metrics endpoint")
        scheme = "https" if context else "http"
        with urllib.request.urlopen(f"{scheme}://{address}/metrics", timeout=10, context=context) as r:
            self.assertEqual(r.headers["Content-Type"], "text/plain; version=0.0.4; charset=utf-8")
            return parse_metrics(r.read().decode())

    def all_scrapes(self) -> dict[str, dict[str, float]]:
        return {n: self.scrape(n) for n in self.cluster.services}

    def test_counters_are_scraped_before_they_first_count(self):
        # Every service's counters are registered at start: a failure counter reads 0 (an alert on it needs the
        # series) and the bytes counters exist, whatever the requests so far did.
        scrapes = self.all_scrapes()
        want = {
            "router": ["hypic:combine_retries_total", "hypic:scatter_failures_total", "hypic:request_success_total"],
            "combine": ["hypic:cache_entries_refused_total", "hypic:delivery_mac_failures_total",
                        "hypic:entry_mac_failures_total", "hypic:cache_hits_rebuilt_total",
                        "hypic:combine_builds_joined_total"],
            "scatter-0": ["hypic:entry_mac_failures_total", 'hypic:entry_bytes_sent_total{transport="grpc"}',
                          'hypic:entry_bytes_sent_total{transport="nccl"}', "hypic:prefill_tokens_total",
                          "hypic:segment_build_seconds_count"],
            "cache-0": ['hypic:cache_entry_bytes_total{direction="in"}',
                        'hypic:cache_entry_bytes_total{direction="out"}'],
        }
        zero = {"hypic:combine_retries_total", "hypic:scatter_failures_total", "hypic:cache_entries_refused_total",
                "hypic:delivery_mac_failures_total", "hypic:entry_mac_failures_total"}
        for service, names in want.items():
            for name in names:
                with self.subTest(service=service, metric=name):
                    self.assertIn(name, scrapes[service])
                    if name in zero:
                        self.assertEqual(scrapes[service][name], 0.0)

    def test_counters_follow_the_reports(self):
        segs = [words(900 + i, 80 + 40 * i) for i in range(3)]
        before = self.all_scrapes()
        reports = []
        for k in range(2):  # cold, then warm (from the combine worker's memory or the cache)
            r = self.generate(segs, "What is said?", max_tokens=6)
            reports.append(self.ok(r))
            self.assertEqual(len(r["token_ids"]), 6)
        # The third request waits until the puts landed, so that its lookup hits the cache. (Counted from `before`:
        # the class's other tests store entries too.)
        stored_before = total(before["cache-0"], "hypic:cache_stored_total")
        deadline = time.monotonic() + 20
        while (total(self.scrape("cache-0"), "hypic:cache_stored_total") - stored_before < 3
               and time.monotonic() < deadline):
            time.sleep(0.1)
        reports.append(self.ok(self.generate(segs, "What is said?", max_tokens=6)))
        # Some counters are raised on other threads just after the work they count (a scatter worker's sent bytes
        # after its delivery call returns): scrape until the two ends of every transfer agree (at most 15 s).
        # Wait for the bytes the reports say were built, not for the two ends to agree: they also agree while the
        # last transfer is counted at neither end yet.
        scatters = [n for n in self.cluster.services if n.startswith("scatter-")]
        expected = sum(int(s["entry_bytes"]) for r in reports for s in r["segments"]
                       if s["source"] == "SEGMENT_SOURCE_SCATTER")
        deadline = time.monotonic() + 15
        while True:
            after = self.all_scrapes()

            def moved(name: str, metric: str) -> float:
                return total(after[name], metric) - total(before[name], metric)

            sent = sum(moved(n, "hypic:entry_bytes_sent_total") for n in scatters)
            if (sent == expected and moved("combine", 'hypic:entry_bytes_received_total{from="scatter"}') == expected
                    and moved("router", "hypic:request_success_total") == 3) or time.monotonic() > deadline:
                break
            time.sleep(0.2)

        # Router: one success and one TTFT observation per request; tokens as the reports count them.
        self.assertEqual(moved("router", "hypic:request_success_total"), 3)
        self.assertEqual(moved("router", "hypic:time_to_first_token_seconds_count"), 3)
        self.assertEqual(moved("router", "hypic:e2e_request_latency_seconds_count"), 3)
        self.assertEqual(moved("router", "hypic:prompt_tokens_total"), sum(r["prompt_tokens"] for r in reports))
        self.assertEqual(moved("router", "hypic:generation_tokens_total"),
                         sum(r["completion_tokens"] for r in reports))
        self.assertEqual(moved("router", "hypic:inter_token_latency_seconds_count"),
                         sum(r["completion_tokens"] - 1 for r in reports))
        self.assertEqual(moved("router", "hypic:segment_cache_queries_total"), 9)
        hits = sum(s["cache_hit"] for r in reports for s in r["segments"])
        self.assertGreaterEqual(hits, 3)  # the third request hit every segment
        self.assertEqual(moved("router", "hypic:segment_cache_hits_total"), hits)
        reused = sum(s["num_tokens"] for r in reports for s in r["segments"] if s["reused"])
        self.assertEqual(moved("router", "hypic:prompt_tokens_cached_total"), reused)
        self.assertEqual(total(after["router"], "hypic:num_requests_running"), 0)
        self.assertEqual(total(after["router"], "hypic:num_requests_waiting"), 0)
        planned = {k: v for k, v in after["router"].items() if k.startswith("hypic:segments_planned_total")}
        self.assertEqual(sum(planned.values()) - total(before["router"], "hypic:segments_planned_total"), 9)
        # TTFT buckets are cumulative and end with the count.
        buckets = sorted(((float(re.search(r'le="([^"]+)"', k).group(1)), v) for k, v in after["router"].items()
                          if k.startswith("hypic:time_to_first_token_seconds_bucket")), key=lambda b: b[0])
        self.assertEqual([v for _, v in buckets], sorted(v for _, v in buckets))
        self.assertEqual(buckets[-1], (float("inf"), after["router"]["hypic:time_to_first_token_seconds_count"]))

        # Scatter workers built what the reports say they built, and every byte they sent arrived.
        built = sum(1 for r in reports for s in r["segments"] if s["source"] == "SEGMENT_SOURCE_SCATTER")
        self.assertEqual(built, 3)
        self.assertEqual(sum(moved(n, "hypic:segments_built_total") for n in scatters), built)
        self.assertEqual(sum(moved(n, "hypic:prefill_tokens_total") for n in scatters),
                         sum(s["num_tokens"] for r in reports for s in r["segments"]
                             if s["source"] == "SEGMENT_SOURCE_SCATTER"))
        self.assertEqual(sent, sum(int(s["entry_bytes"]) for r in reports for s in r["segments"]
                                   if s["source"] == "SEGMENT_SOURCE_SCATTER"))
        self.assertEqual(moved("combine", 'hypic:entry_bytes_received_total{from="scatter"}'), sent)
        # On CPU workers every delivery goes over gRPC (no device entries to send over NCCL), and says so: the report
        # names the transport and the bytes moved (the serialized entry); entries not delivered name none.
        self.assertEqual(sum(moved(n, 'hypic:entry_bytes_sent_total{transport="grpc"}') for n in scatters), sent)
        for r in reports:
            for s in r["segments"]:
                if s["source"] == "SEGMENT_SOURCE_SCATTER":
                    self.assertEqual(s.get("transport"), "grpc", s)
                    self.assertEqual(int(s["transfer_bytes"]), int(s["entry_bytes"]), s)
                    self.assertGreater(float(s["transfer_ms"]), 0.0, s)
                else:
                    self.assertEqual(s.get("transport", ""), "", s)
        for n in scatters:
            self.assertEqual(total(after[n], "hypic:scatter_queued_tokens"), 0)
        # The cache stored the three entries and its byte gauge holds them.
        self.assertEqual(moved("cache-0", "hypic:cache_stored_total"), 3)
        self.assertEqual(after["cache-0"]['hypic:cache_bytes{tier="memory"}'], sent)
        self.assertEqual(moved("cache-0", 'hypic:cache_entry_bytes_total{direction="in"}'), sent)
        for n, samples in after.items():
            self.assertTrue(any(k.startswith('hypic:service_info{role="') for k in samples), n)

    def test_a_refused_request_counts_as_a_failure_by_code(self):
        before = self.scrape("router")
        r = self.generate(["a"], "", max_tokens=2)  # an empty query is INVALID_ARGUMENT
        self.assertNotEqual(r["rc"], 0)
        after = self.scrape("router")
        key = 'hypic:request_failures_total{code="INVALID_ARGUMENT"}'
        self.assertEqual(after.get(key, 0) - before.get(key, 0), 1)

    def watch_cache_events(self, cache: str) -> subprocess.Popen:
        """Starts `hypic-client cache-events --count 1` and returns once the cache has subscribed it (its log says so),
        so that no event it should see can come before it listens."""
        log = self.cluster.services["cache-0"].log_path

        def subscribed() -> int:  # "event subscriber PEER joined (N existing entries listed)"
            return len(re.findall(r"\] event subscriber \S+ joined \(", log.read_text(errors="replace")))
        joined = subscribed()
        watcher = subprocess.Popen([str(BIN_DIR / "hypic-client"), "cache-events", "--cache", cache, "--count", "1"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while subscribed() == joined:
            if watcher.poll() is not None:
                self.fail(f"cache-events exited with {watcher.returncode} before subscribing: {watcher.stderr.read()}")
            if time.monotonic() > deadline:
                watcher.kill()
                watcher.communicate()
                self.fail("cache-events did not subscribe within 30 s")
            time.sleep(0.02)
        return watcher

    def test_cache_events_list_and_follow_the_entries(self):
        cache = self.cluster.address("cache-0")
        seg = words(950, 60)
        watcher = self.watch_cache_events(cache)
        report = self.ok(self.generate([seg], "Which?", max_tokens=2))
        out, err = watcher.communicate(timeout=30)
        self.assertEqual(watcher.returncode, 0, err)
        event = json.loads(out.splitlines()[0])
        self.assertEqual(event["kind"], "STORED")
        self.assertEqual(event["digest_hex"], report["segments"][0]["digest_hex"])
        self.assertEqual(int(event["size_bytes"]), int(report["segments"][0]["entry_bytes"]))
        self.assertEqual(event["tier"], "CACHE_TIER_MEMORY")
        self.assertGreater(int(event["sequence"]), 0)
        # A new subscriber with include_existing lists it (sequence 0); a Delete is then reported as cleared.
        stats = json.loads(self.client("cache-stats", "--cache", cache).stdout)
        r = self.client("cache-events", "--cache", cache, "--include-existing", "--count", str(int(stats["entries"])))
        listed = [json.loads(l) for l in r.stdout.splitlines()]
        self.assertIn(report["segments"][0]["digest_hex"], [e["digest_hex"] for e in listed])
        self.assertTrue(all(e["kind"] == "STORED" and int(e["sequence"]) == 0 for e in listed))
        watcher = self.watch_cache_events(cache)
        self.assertEqual(self.client("cache-delete", "--cache", cache, "--digest",
                                     report["segments"][0]["digest_hex"]).returncode, 0)
        out, err = watcher.communicate(timeout=30)
        event = json.loads(out.splitlines()[0])
        self.assertEqual((event["kind"], event["reason"], event["digest_hex"]),
                         ("CLEARED", "deleted", report["segments"][0]["digest_hex"]))

    def client(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN_DIR / "hypic-client"), *args], capture_output=True, text=True, timeout=60)


class TlsAuthTest(MetricsTest):
    """The same cluster with TLS everywhere, client certificates required between services, and a bearer token on
    the router (LocalCluster(tls=True)): requests with the right credentials give the same tokens as without TLS;
    a missing or wrong token is UNAUTHENTICATED; plaintext and certificate-less callers get nowhere."""
    tls = True

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        # Every hypic-client this class runs reads the cluster's certificates and token from the environment, as
        # the launcher's command does.
        cls.saved_env = dict(os.environ)
        os.environ.update(cls.cluster.environment())
        # These tests act as the operator: cache events and stats are internal RPCs, which need the services'
        # certificate identity (the user certificate the launcher's environment gives is refused there;
        # test_hostile.py UserCertificateTest).
        d = cls.cluster.tls_dir
        os.environ.update(HYPIC_TLS_CLIENT_CERT=str(d / "server.crt"), HYPIC_TLS_CLIENT_KEY=str(d / "server.key"))

    @classmethod
    def tearDownClass(cls) -> None:
        os.environ.clear()
        os.environ.update(cls.saved_env)
        super().tearDownClass()

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def tls_context(self) -> ssl.SSLContext:
        d = self.cluster.tls_dir
        ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
        ctx.load_cert_chain(str(d / "client.crt"), str(d / "client.key"))
        return ctx

    def scrape(self, name: str, context: ssl.SSLContext | None = None) -> dict[str, float]:
        return super().scrape(name, context or self.tls_context())

    def test_tokens_and_certificates_are_checked(self):
        router = self.cluster.router_address
        seg, query = words(970, 50), "Who?"
        good = self.generate([seg], query, max_tokens=4)
        self.ok(good)
        self.assertEqual(good["token_ids"], self.reference([seg], query, max_tokens=4))
        env = self.env()
        base = [str(BIN_DIR / "hypic-client"), "generate", "--router", router, "--segment", seg, "--query", query,
                "--max-tokens", "2", "--timeout-seconds", "20"]
        # No token.
        no_token = {k: v for k, v in env.items() if k != "HYPIC_TOKEN_FILE"}
        r = subprocess.run(base, capture_output=True, text=True, env=no_token, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("UNAUTHENTICATED: missing bearer token", r.stderr)
        # A wrong token.
        wrong = self.cluster.work_dir / "wrong-token"
        wrong.write_text("not-the-token\n")
        r = subprocess.run(base + ["--token-file", str(wrong)], capture_output=True, text=True, env=no_token,
                           timeout=60)
        self.assertIn("UNAUTHENTICATED: bearer token not accepted", r.stderr)
        r = subprocess.run([str(BIN_DIR / "hypic-client"), "info", "--router", router], capture_output=True,
                           text=True, env=no_token, timeout=60)
        self.assertIn("UNAUTHENTICATED", r.stderr)
        # Plaintext, and TLS without a client certificate, do not get through to the internal services.
        plain = {k: v for k, v in env.items() if not k.startswith("HYPIC_TLS_")}
        r = subprocess.run([str(BIN_DIR / "hypic-client"), "health", "--target", router], capture_output=True,
                           text=True, env=plain, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        # A plaintext client is told the TLS settings differ (not that no router is running).
        r = subprocess.run(base, capture_output=True, text=True, env=plain, timeout=60)
        self.assertIn("the TLS settings probably do not match", r.stderr)
        self.assertNotIn("the router may not be running", r.stderr)
        r = subprocess.run([str(BIN_DIR / "hypic-client"), "cache-events", "--cache", router, "--count", "1"],
                           capture_output=True, text=True, env=env, timeout=60)
        self.assertIn("is a hypic router, not a segment cache", r.stderr)
        no_cert = {k: v for k, v in env.items() if not k.startswith("HYPIC_TLS_CLIENT")}
        r = subprocess.run([str(BIN_DIR / "hypic-client"), "cache-stats", "--cache", self.cluster.address("cache-0")],
                           capture_output=True, text=True, env=no_cert, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        # Health checks need no token (probes carry none), only the TLS credentials.
        r = subprocess.run([str(BIN_DIR / "hypic-client"), "health", "--target", router], capture_output=True,
                           text=True, env=no_token, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        # The metrics endpoint refuses a client without a certificate.
        ctx = ssl.create_default_context(cafile=str(self.cluster.tls_dir / "ca.crt"))
        with self.assertRaises(Exception):
            urllib.request.urlopen(f"https://{self.cluster.metrics_address('router')}/metrics", timeout=10,
                                   context=ctx).read()


if __name__ == "__main__":
    unittest.main()
