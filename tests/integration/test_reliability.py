#!/usr/bin/env python3
"""Reliability integration tests (issue 15): shared in-flight builds (concurrent requests, repeats within a
request, the shared build's worker killed), hit leases released when requests end, and a build that outlives its
request's deadline. Real services on loopback (deploy/local_cluster.py), driven with hypic-client.

Run one class per CTest test:  python3 tests/integration/test_reliability.py SharedBuildTest
Environment: HYPIC_BIN_DIR (the built binaries), HYPIC_TOKENIZER (else scripts/fetch_tokenizer.sh).
"""
from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_test_support import BIN_DIR, ClusterTestCase, words  # noqa: E402

COUNTERS = ("entries_built", "builds_joined", "builds_dropped", "orphan_builds_stored")


def sources(report: dict) -> list[str]:
    return [s["source"] for s in report["segments"]]


class ReliabilityTestCase(ClusterTestCase):
    """Helpers: the scatter workers' shared-build counters (WorkerInfo, as the router's last probe saw them: the
    router probes every --health-interval-ms, 100 ms in these classes)."""

    def scatter_counters(self, worker: str | None = None) -> dict[str, int]:
        r = self.client("info", "--router", self.cluster.router_address)
        self.assertEqual(r.returncode, 0, r.stderr)
        address = self.cluster.address(worker) if worker else None
        total = dict.fromkeys(COUNTERS, 0)
        for w in json.loads(r.stdout)["scatter_workers"]:
            if address is None or w["address"] == address:
                for k in COUNTERS:
                    total[k] += int(w[k])
        return total

    def settled_counters(self, until, worker: str | None = None, timeout: float = 20.0) -> dict[str, int]:
        """The counters once `until(counters)` holds, read again after a few more probes (so that nothing is still
        on its way: an exact assertion on them is then safe)."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.scatter_counters(worker)
            if until(c):
                time.sleep(0.5)
                return self.scatter_counters(worker)
            if time.monotonic() > deadline:
                return c
            time.sleep(0.05)

    def wait_log_count(self, name: str, text: str, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            seen = self.cluster.services[name].log_path.read_text(errors="replace").count(text)
            if seen >= count:
                return
            time.sleep(0.02)
        self.fail(f"{name} logged {text!r} {seen} times, expected {count}")


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTERS}


class SharedBuildTest(ReliabilityTestCase):
    """Concurrent requests that miss the same segment share one build; repeats within a request are built (and
    fetched) once. Every build takes 2 s more (--inject-delay-ms), so the concurrent requests surely overlap it."""
    extra_args = {"scatter": ["--inject-delay-ms", "2000"], "router": ["--health-interval-ms", "100"]}

    def test_concurrent_requests_share_one_build(self):
        seg = words(300, 150)
        query = "What do they share?"
        expected = self.reference([seg], query)
        before = self.scatter_counters()
        n = 4
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(lambda k: self.generate([seg], query, request_id=f"share-{k}"), range(n)))
        reports = [self.ok(r) for r in results]
        for k, r in enumerate(results):
            with self.subTest(request=k):
                self.assertEqual(r["token_ids"], expected)
        # One request had it built, every other one joined that build (on the same worker).
        rows = [rep["segments"][0] for rep in reports]
        self.assertEqual(sorted(s["source"] for s in rows),
                         ["SEGMENT_SOURCE_SCATTER"] + ["SEGMENT_SOURCE_SHARED_BUILD"] * (n - 1))
        self.assertEqual(len({s["built_by"] for s in rows}), 1)
        # Exactly one build happened.
        after = self.settled_counters(lambda c: delta(c, before)["entries_built"] >= 1 and
                                      delta(c, before)["builds_joined"] >= n - 1)
        self.assertEqual(delta(after, before), {"entries_built": 1, "builds_joined": n - 1, "builds_dropped": 0,
                                                "orphan_builds_stored": 0})
        for s in rows:
            self.assertFalse(s["cache_hit"])
            self.assertEqual(s["reused"], s["source"] == "SEGMENT_SOURCE_SHARED_BUILD")
            self.assertEqual(s["attempts"], 1)
            if s["source"] == "SEGMENT_SOURCE_SHARED_BUILD":
                self.assertRegex(s["note"], r"shared build: started on .* for request share-\d")
        # The scatter worker logged the joins.
        scatter_logs = "".join(self.cluster.services[f"scatter-{i}"].log_path.read_text() for i in range(2))
        self.assertEqual(scatter_logs.count("(1 joined builds in flight)"), n - 1)

    def test_repeats_within_a_request(self):
        a, b = words(310, 120), words(311, 90)
        segs = [a, b, a, a]
        query = "Why say it three times?"
        expected = self.reference(segs, query)
        before = self.scatter_counters()
        cold = self.generate(segs, query)
        rep = self.ok(cold)
        self.assertEqual(cold["token_ids"], expected)
        self.assertEqual(sources(rep), ["SEGMENT_SOURCE_SCATTER", "SEGMENT_SOURCE_SCATTER", "SEGMENT_SOURCE_REPEAT",
                                        "SEGMENT_SOURCE_REPEAT"])
        self.assertEqual([s.get("repeat_of") for s in rep["segments"]], [None, None, 0, 0])
        self.assertEqual([s["reused"] for s in rep["segments"]], [False, False, True, True])
        self.assertEqual([s["digest_hex"] for s in rep["segments"]][2:], [rep["segments"][0]["digest_hex"]] * 2)
        self.assertEqual([s["attempts"] for s in rep["segments"]], [1, 1, 0, 0])
        self.assertEqual(rep["segments"][2]["built_by"], rep["segments"][0]["built_by"])
        self.assertEqual(rep["segments"][2]["compute_ms"], 0)
        after = self.settled_counters(lambda c: delta(c, before)["entries_built"] >= 2)
        self.assertEqual(delta(after, before)["entries_built"], 2)  # a and b, once each
        self.assertEqual(delta(after, before)["builds_joined"], 0)

        # Warm: the same prompt is all hits, the repeats still use their first copy's entry; nothing is built.
        self.wait_cached(rep)
        warm = self.generate(segs, query)
        wrep = self.ok(warm)
        self.assertEqual(warm["token_ids"], expected)
        self.assertEqual([s["cache_hit"] for s in wrep["segments"]], [True] * 4)
        self.assertEqual([s["reused"] for s in wrep["segments"]], [True] * 4)
        self.assertEqual(sources(wrep)[2:], ["SEGMENT_SOURCE_REPEAT"] * 2)
        self.assertIn(sources(wrep)[0], ("SEGMENT_SOURCE_COMBINE_MEMORY", "SEGMENT_SOURCE_CACHE"))
        time.sleep(0.5)
        self.assertEqual(delta(self.scatter_counters(), before)["entries_built"], 2)


class SharedBuildFailureTest(ReliabilityTestCase):
    """The worker of a shared build is killed while every request waits for it: one of them starts the one rebuild
    on the other worker, the others join it, and all complete with the same tokens."""
    extra_args = {"scatter": ["--inject-delay-ms", "2000"], "router": ["--health-interval-ms", "100"]}

    def test_builder_killed_waiters_complete(self):
        seg = words(320, 150)
        query = "Who survives?"
        expected = self.reference([seg], query)
        n = 3
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            futures = [pool.submit(self.generate, [seg], query, request_id=f"orphan-{k}") for k in range(n)]
            # Both workers are idle: LPT gives the first request's segment to scatter-0, the others join it there.
            self.wait_log_count("scatter-0", "prefill of 1 segments", n)
            self.cluster.kill("scatter-0")
            results = [f.result() for f in futures]
        survivor = self.cluster.address("scatter-1")
        rows = []
        for k, r in enumerate(results):
            with self.subTest(request=k):
                rep = self.ok(r)
                self.assertEqual(r["token_ids"], expected)
                self.assertEqual(rep["scatter_failures"], 1)
                rows.append(rep["segments"][0])
        self.assertEqual([s["built_by"] for s in rows], [survivor] * n)
        self.assertEqual([s["attempts"] for s in rows], [2] * n)
        self.assertEqual(sorted(s["source"] for s in rows),
                         ["SEGMENT_SOURCE_SCATTER"] + ["SEGMENT_SOURCE_SHARED_BUILD"] * (n - 1))
        # One rebuild: the survivor built the entry once, and the other n - 1 requests joined it.
        c = self.settled_counters(lambda c: c["builds_joined"] >= n - 1, worker="scatter-1")
        self.assertEqual((c["entries_built"], c["builds_joined"]), (1, n - 1))


class LeaseTest(ReliabilityTestCase):
    """Lookup hits are leased only until the request has its entries: with a small cache and a skewed workload over
    many documents, every put is accepted and a newly popular document becomes a hit at once. (Before leases were
    released, each hit pinned its entry for --lease-ms, 30 s: a cache full of hot entries refused every new one.)
    Segments are 64 token ids, so every entry has the same size; the cache holds four and a half of them."""
    ENTRY_BYTES = 29312  # a 64-token entry of the tiny model, w = 8 (asserted below)
    extra_args = {"cache": ["--memory-bytes", str(ENTRY_BYTES * 9 // 2)]}

    @staticmethod
    def doc(k: int) -> list[dict]:
        return [{"tokens": [(1000 + 7919 * j + 104729 * k) % 150000 for j in range(64)]}]

    def request(self, k: int) -> dict:
        """Document k alone, then waits until its cache put (if it missed) has been answered."""
        before = self.cache_stats()
        rep = self.ok(self.generate(self.doc(k), "Which document is this?", max_tokens=2))
        seg = rep["segments"][0]
        self.assertEqual(int(seg["entry_bytes"]), self.ENTRY_BYTES)
        if not seg["cache_hit"]:
            deadline = time.monotonic() + 20
            while int(self.cache_stats()["puts"]) == int(before["puts"]):
                self.assertLess(time.monotonic(), deadline, f"the put of document {k} never reached the cache")
                time.sleep(0.02)
        return seg

    def test_puts_keep_being_accepted(self):
        # Four documents fill the cache; reading them again leases each of them while its request runs.
        for k in range(4):
            self.assertFalse(self.request(k)["cache_hit"])
        for k in range(4):
            self.assertTrue(self.request(k)["cache_hit"])
        # A fifth document: its put evicts the least recently used one, and it is a hit from then on.
        self.assertFalse(self.request(4)["cache_hit"])
        self.assertTrue(self.request(4)["cache_hit"])
        stats = self.cache_stats()
        self.assertEqual(int(stats["leased_entries"]), 0)  # released when their requests ended
        self.assertEqual(int(stats["max_leased_bytes"]), self.ENTRY_BYTES * 9 // 2 // 2)
        # A Zipf workload over 12 documents, then a newly popular one.
        rng = random.Random(15)
        weights = [1 / (r + 1) for r in range(12)]
        for _ in range(30):
            self.request(rng.choices(range(12), weights)[0])
        hits = [self.request(99)["cache_hit"] for _ in range(4)]
        self.assertEqual(hits, [False, True, True, True])
        stats = self.cache_stats()
        self.assertEqual(int(stats["rejected_puts"]), 0, stats)
        self.assertGreater(int(stats["evictions"]), 0)
        self.assertEqual(int(stats["leased_entries"]), 0)
        self.assertEqual(int(stats["leased_bytes"]), 0)
        self.assertGreater(int(stats["leases_released"]), 0)


class AbandonedBuildTest(ReliabilityTestCase):
    """A request whose deadline passes while its segment is being built: the running build finishes and is stored,
    so the same segment next time is a hit; its other segment, still queued behind it, is dropped (nobody waits for
    it). One scatter worker; every build runs 1.5 s more (--inject-delay-ms) and builds one segment at a time
    (--max-batch-tokens 16)."""
    scatter_workers = 1
    extra_args = {"scatter": ["--inject-delay-ms", "1500", "--max-batch-tokens", "16"],
                  "router": ["--health-interval-ms", "100"]}

    def test_running_build_is_stored_queued_build_dropped(self):
        long_seg, short_seg = words(400, 150), words(401, 20)  # built in this order (LPT: longest first)
        query = "Is it too late?"
        before = self.scatter_counters()
        entries = int(self.cache_stats()["entries"])
        r = self.generate([long_seg, short_seg], query, request_id="late-build", deadline_s=0.3)
        self.assertEqual(r["rc"], 2)
        self.assertEqual(r["error"]["code"], "DEADLINE_EXCEEDED")
        # The long segment's build was running when the deadline passed: it finished and went to the cache.
        self.wait_cache_entries(entries + 1)
        after = self.settled_counters(lambda c: delta(c, before)["builds_dropped"] >= 1)
        self.assertEqual(delta(after, before), {"entries_built": 1, "builds_joined": 0, "builds_dropped": 1,
                                                "orphan_builds_stored": 1})
        self.assertEqual(int(self.cache_stats()["entries"]), entries + 1)
        log = self.cluster.services["scatter-0"].log_path.read_text()
        self.assertIn("finished after every request waiting for it had gone: queued for the segment cache", log)
        self.assertIn("dropped: no request waits for it any more", log)
        # The same segment again is a hit, with nothing built; the short one, dropped, is a miss.
        warm = self.ok(self.generate([long_seg], query))
        self.assertTrue(warm["segments"][0]["cache_hit"])
        self.assertEqual(sources(warm), ["SEGMENT_SOURCE_CACHE"])
        cold = self.ok(self.generate([short_seg], query))
        self.assertFalse(cold["segments"][0]["cache_hit"])
        self.assertEqual(sources(cold), ["SEGMENT_SOURCE_SCATTER"])

    def test_request_right_after_a_deadline_joins_the_running_build(self):
        """The same segment asked again while the build its first request gave up on still runs: the new request
        joins that build (nothing is computed twice) and gets the same tokens as a request that waits."""
        seg = words(402, 150)
        query = "Try again?"
        expected = self.reference([seg], query)
        before = self.scatter_counters()
        r = self.generate([seg], query, request_id="gave-up", deadline_s=0.3)
        self.assertEqual(r["error"]["code"], "DEADLINE_EXCEEDED")
        again = self.generate([seg], query, request_id="retry")  # at once: the 1.5 s build is still running
        rep = self.ok(again)
        self.assertEqual(again["token_ids"], expected)
        self.assertEqual(sources(rep), ["SEGMENT_SOURCE_SHARED_BUILD"])
        self.assertIn("for request gave-up", rep["segments"][0]["note"])
        after = self.settled_counters(lambda c: delta(c, before)["entries_built"] >= 1)
        self.assertEqual(delta(after, before), {"entries_built": 1, "builds_joined": 1, "builds_dropped": 0,
                                                "orphan_builds_stored": 0})
        # Its put (off the request's path) has landed before the test ends: the class's other test counts the cache's
        # entries (its request fails, so it has no report whose digests it could wait for).
        self.wait_cached(rep)


class CombineRestartTest(ReliabilityTestCase):
    """The combine worker SIGKILLed between two requests, with the router's probes 60 s apart so that it has not
    noticed: the next request's call fails with UNAVAILABLE before it has started (nothing launched, nothing
    streamed), and the router plans that request once more, waiting (--combine-wait-ms) for a healthy combine worker:
    the same one, restarted. Before, that request failed with UNAVAILABLE."""
    extra_args = {"router": ["--health-interval-ms", "60000", "--combine-wait-ms", "30000"]}

    def test_a_request_to_a_combine_worker_dead_since_the_last_probe_is_planned_again(self):
        segs, q = [words(510, 40)], "After the crash?"
        expected = self.reference(segs, q)
        first = self.generate(segs, q, request_id="before-crash")
        self.ok(first)
        self.assertEqual(first["token_ids"], expected)
        self.cluster.kill("combine")
        self.cluster.wait_exit("combine")
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(self.generate, segs, q, request_id="after-crash", deadline_s=90)
            self.wait_log_count("router", "planning the request again", 1)
            self.cluster.restart("combine")
            result = future.result(timeout=120)
        self.ok(result)
        self.assertEqual(result["token_ids"], expected)
        router_log = self.cluster.services["router"].log_path.read_text()
        self.assertIn("[req after-crash] combine worker", router_log)
        self.assertNotIn("[req before-crash] combine worker", router_log)  # (the first request needed no retry)
        address = self.cluster.metrics_address("router")
        self.assertIsNotNone(address, "the launcher starts the router with --metrics-listen")
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        self.assertIn("hypic:combine_retries_total 1", text.splitlines())


class CombineRestartTwoWorkersTest(ReliabilityTestCase):
    """Two combine workers behind a second router whose probes are 60 s apart, both SIGKILLed between two requests:
    the next request is refused by each in turn before it starts (one attempt per worker, each taking that worker out
    of the rotation), then waits (--combine-wait-ms) and runs on the one restarted. Before, it failed after the
    second refusal although a worker came back within the wait."""
    scatter_workers = 0

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.router_b = cls.start_second_router(["--health-interval-ms", "60000", "--combine-wait-ms", "30000"],
                                               cache=False)

    def test_a_request_refused_by_every_stale_combine_worker_waits_for_one_back(self):
        segs, q = [words(520, 40), words(521, 30)], "Both down?"
        expected = self.reference(segs, q)
        first = self.generate(segs, q, router=self.router_b, request_id="two-before")
        self.ok(first)
        self.assertEqual(first["token_ids"], expected)
        for name in ("combine", "combine-b"):
            self.cluster.kill(name)
            self.cluster.wait_exit(name)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(self.generate, segs, q, router=self.router_b, request_id="two-after", deadline_s=90)
            self.wait_log_count("router-b", "planning the request again", 2)  # refused by both, now waiting
            self.cluster.restart("combine-b")
            result = future.result(timeout=120)
        self.ok(result)
        self.assertEqual(result["token_ids"], expected)
        self.assertEqual(result["report"]["combine_worker"], self.cluster.address("combine-b"))
        self.cluster.restart("combine")


class CombineFailureTest(ReliabilityTestCase):
    """The combine worker SIGKILLed while requests are in flight on it, before their first token (their scatter builds
    take 2 s more): the router plans each of them again once, waiting (--combine-wait-ms, 10 s) for a combine worker
    to come back; restarted within the wait, it gives every one of them the reference tokens (before, they failed
    with UNAVAILABLE). Not restarted, they end with UNAVAILABLE naming the dead worker once the wait is over (no hang,
    no silent truncation), and the next requests succeed once it is back."""
    extra_args = {"scatter": ["--inject-delay-ms", "2000"], "router": ["--health-interval-ms", "100"],
                  "combine": ["--drain-seconds", "0.5"]}

    def kill_with_requests_in_flight(self, prompts, prefix: str, pool, sig: int = signal.SIGKILL):
        futures = [pool.submit(self.generate, segs, q, request_id=f"{prefix}-{k}", deadline_s=60)
                   for k, (segs, q) in enumerate(prompts)]
        self.wait_log_count("combine", f"[req {prefix}-", len(prompts))  # every request reached the combine worker
        t_kill = time.monotonic()
        self.cluster.kill("combine", sig)
        self.cluster.wait_exit("combine")
        # Each is planned again once (nothing had reached its client), then waits for a combine worker.
        for k in range(len(prompts)):
            self.wait_log_count("router", f"[req {prefix}-{k}] combine worker", 1)
        self.assertEqual(self.log_count("router", "after it started, before the first token; planning the request "
                                        f"again once") - self.restarts_before, len(prompts))
        return futures, t_kill

    def log_count(self, name: str, text: str) -> int:
        return self.cluster.services[name].log_path.read_text().count(text)

    def setUp(self) -> None:
        self.restarts_before = self.log_count("router", "after it started, before the first token")

    def assert_run_again_on_the_worker_back(self, prompts, prefix: str, sig: int) -> None:
        """Requests in flight when the combine worker ends (signal `sig`), restarted at once: each gives its
        reference tokens."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures, _ = self.kill_with_requests_in_flight(prompts, prefix, pool, sig)
            self.cluster.restart("combine")
            results = [f.result(timeout=90) for f in futures]
        for k, ((segs, q), r) in enumerate(zip(prompts, results)):
            with self.subTest(request=k):
                self.ok(r)
                self.assertEqual(r["token_ids"], self.reference(segs, q))

    def test_requests_in_flight_before_their_first_token_run_again_on_the_worker_back(self):
        self.assert_run_again_on_the_worker_back([([words(400 + k, 60)], f"Question {k}?") for k in range(3)],
                                                 "again", signal.SIGKILL)
        text = urllib.request.urlopen(f"http://{self.cluster.metrics_address('router')}/metrics", timeout=10)
        counts = [line for line in text.read().decode().splitlines()
                  if line.startswith("hypic:combine_retries_total ")]
        self.assertEqual(len(counts), 1)
        self.assertGreaterEqual(float(counts[0].split()[1]), 3)
        info = json.loads(self.client("info", "--router", self.cluster.router_address).stdout)
        self.assertEqual(int(info.get("active_requests", 0)), 0)

    def test_requests_cut_by_a_drain_run_again_on_the_worker_back(self):
        # SIGTERM: the combine worker drains for --drain-seconds (0.5 s here), then ends the calls still in flight
        # (their builds take 2 s) and exits: nothing reached their clients, so they are planned again like those of a
        # worker that died (before, they failed with UNAVAILABLE), and run on it restarted (a rolling update).
        self.assert_run_again_on_the_worker_back([([words(420 + k, 60)], f"Drained {k}?") for k in range(2)],
                                                 "drained", signal.SIGTERM)

    def test_requests_in_flight_fail_cleanly_when_no_worker_comes_back(self):
        prompts = [([words(410 + k, 60)], f"Question {k}?") for k in range(2)]
        combine = self.cluster.address("combine")
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            futures, t_kill = self.kill_with_requests_in_flight(prompts, "doomed", pool)
            results = [f.result(timeout=60) for f in futures]
        ended_s = time.monotonic() - t_kill
        for k, r in enumerate(results):
            with self.subTest(request=k):
                self.assertNotEqual(r["rc"], 0)
                self.assertIn("UNAVAILABLE", r["stderr"])
                self.assertIn("no combine worker is available", r["stderr"])
                self.assertIn(f"combine worker {combine}", r["stderr"])  # the failure before the wait, named
        self.assertLess(ended_s, 30)  # ended by --combine-wait-ms (10 s), not by their 60 s deadline
        self.cluster.restart("combine")
        for k, (segs, q) in enumerate(prompts):
            with self.subTest(retry=k):
                r = self.generate(segs, q, request_id=f"after-{k}")
                self.ok(r)
                self.assertEqual(r["token_ids"], self.reference(segs, q))
        info = json.loads(self.client("info", "--router", self.cluster.router_address).stdout)
        self.assertEqual(int(info.get("active_requests", 0)), 0)

    def test_a_request_id_in_flight_is_refused_for_a_second_request(self):
        # A client-given request_id names one request in flight: a second request with it while the first waits for
        # its cold segment (2 s build) is refused at once with ALREADY_EXISTS naming the field; the first one is
        # unharmed, and once it has ended the id can be used again.
        segs, q = [words(480, 40)], "Twice?"
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(self.generate, segs, q, request_id="twice", deadline_s=60)
            deadline = time.monotonic() + 10
            while self.active_requests() != 1:
                self.assertLess(time.monotonic(), deadline, "the first request never reached the router")
                time.sleep(0.02)
            t0 = time.monotonic()
            second = self.generate([words(481, 40)], q, request_id="twice")
            refused_s = time.monotonic() - t0
            result = first.result(timeout=60)
        self.assertNotEqual(second["rc"], 0)
        self.assertIn("ALREADY_EXISTS", second["stderr"])
        self.assertIn("request_id: twice is already in use", second["stderr"])
        self.assertLess(refused_s, 1.5)  # refused before any work, not after the first one's build
        expected = self.reference(segs, q)
        self.ok(result)
        self.assertEqual(result["token_ids"], expected)
        again = self.generate(segs, q, request_id="twice")
        self.ok(again)
        self.assertEqual(again["token_ids"], expected)

    def test_a_request_id_is_free_again_once_its_client_is_gone(self):
        # A client killed while its cold segment builds: the router cancels the request and frees its id; a new
        # request with that id, sent at once, runs (the router may still be ending the old one for a few ms: its
        # "already in use" is retried here; the combine worker's table must not refuse it once the router has let it
        # through, which it did while the cancelled call was still being cleaned up).
        work = Path(self.work.name)
        path = work / "reuse.json"
        path.write_text(json.dumps({"segments": [words(490, 40)], "query": "Reuse?"}))
        for trial in range(3):
            rid = f"reuse-{trial}"
            proc = subprocess.Popen([str(BIN_DIR / "hypic-client"), "generate", "--router", self.cluster.router_address,
                                     "--segments-json", str(path), "--max-tokens", "4", "--timeout-seconds", "60",
                                     "--request-id", rid], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                self.wait_log_count("combine", f"[req {rid}] combine:", 1)  # the combine worker has the call
                time.sleep(0.3)
            finally:
                proc.kill()
                proc.wait()
            segs, q = [words(491 + trial, 30)], "Again?"
            deadline = time.monotonic() + 10
            while True:
                r = self.generate(segs, q, request_id=rid)
                if r["rc"] == 0 or "already in use by a request in flight" not in r["stderr"]:
                    break
                self.assertLess(time.monotonic(), deadline, "the router never freed the id")
                time.sleep(0.02)
            self.assertNotIn("already active on this combine worker", r["stderr"])
            self.ok(r)
            self.assertEqual(r["token_ids"], self.reference(segs, q))

    def active_requests(self) -> int:
        r = self.client("info", "--router", self.cluster.router_address)
        self.assertEqual(r.returncode, 0, r.stderr)
        return int(json.loads(r.stdout).get("active_requests", 0))

    def test_clients_gone_while_no_combine_worker_is_up_free_their_slots_at_once(self):
        # Two clients killed (no deadline passed, nothing streamed) while the router holds their requests, waiting up
        # to --combine-wait-ms (10 s by default) for a combine worker: the router sees the cancellation and ends them
        # at once, so their admission slots are free again well before that wait would have ended.
        self.cluster.kill("combine")
        self.cluster.wait_exit("combine")
        self.wait_log_count("router", "is out of rotation", 1)
        work = Path(self.work.name)
        procs = []
        try:
            for k in range(2):
                path = work / f"gone-{k}.json"
                path.write_text(json.dumps({"segments": [words(470 + k, 40)], "query": f"Gone {k}?"}))
                procs.append(subprocess.Popen(
                    [str(BIN_DIR / "hypic-client"), "generate", "--router", self.cluster.router_address,
                     "--segments-json", str(path), "--max-tokens", "4", "--timeout-seconds", "60",
                     "--request-id", f"gone-{k}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 10
            while self.active_requests() != 2:
                self.assertLess(time.monotonic(), deadline, "the two requests never reached the router")
                time.sleep(0.05)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        t0 = time.monotonic()
        while self.active_requests() != 0:
            self.assertLess(time.monotonic() - t0, 3.0, "the gone clients' requests still hold their slots")
            time.sleep(0.05)
        self.cluster.restart("combine")
        segs, q = [words(470, 40)], "Gone 0?"
        r = self.generate(segs, q, request_id="back")
        self.ok(r)
        self.assertEqual(r["token_ids"], self.reference(segs, q))


class ServiceExitTest(unittest.TestCase):
    """A service told to stop with nothing in flight exits at once: after streaming entries of a few MB, gRPC's
    shutdown at process exit used to wait up to 10 s for an executor thread in epoll_wait (the segment cache took
    9.8 s after logging "stopped"); run_server now keeps the library open for the process's life."""

    def test_segment_cache_exits_promptly_after_streaming_entries(self):
        with tempfile.TemporaryDirectory() as tmp:
            port_file = Path(tmp) / "port"
            cache = subprocess.Popen([str(BIN_DIR / "hypic-segment-cache"), "--listen", "127.0.0.1:0", "--port-file",
                                      str(port_file), "--memory-bytes", "256MiB", "--log-level", "warn"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 30
                while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                port = port_file.read_text().strip()
                r = subprocess.run([str(BIN_DIR / "hypic-bench-cache-fetch"), "--cache", f"127.0.0.1:{port}",
                                    "--entry-mb", "10", "--entries", "4", "--parallel", "2", "--connections", "1,2",
                                    "--reps", "1"], capture_output=True, text=True, timeout=120)
                self.assertEqual(r.returncode, 0, r.stderr)
                # Streamed, then mapped from the cache's memfds (it holds entries of 1 MiB and up in them).
                self.assertEqual([(row["transport"], row["connections"]) for row in json.loads(r.stdout)["rows"]],
                                 [("grpc", 1), ("grpc", 2), ("shared_memory", 1), ("shared_memory", 2)])
                t0 = time.monotonic()
                cache.terminate()
                self.assertEqual(cache.wait(timeout=30), 0)
                self.assertLess(time.monotonic() - t0, 3.0)
            finally:
                if cache.poll() is None:
                    cache.kill()
                    cache.wait()


if __name__ == "__main__":
    unittest.main(verbosity=2)
