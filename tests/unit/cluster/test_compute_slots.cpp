// ComputeSlots (combine worker): bounded concurrency, FIFO order, cancellation while waiting.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "combine_worker/service.h"

using hypic::combine::ComputeSlots;
using namespace std::chrono_literals;

TEST_CASE("compute slots never run more holders than slots", "[compute-slots]") {
  ComputeSlots slots(2);
  std::atomic<int> inside{0}, peak{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&] {
      for (int k = 0; k < 20; ++k) {
        REQUIRE(slots.acquire({}));
        const int now = ++inside;
        int p = peak.load();
        while (now > p && !peak.compare_exchange_weak(p, now)) {}
        std::this_thread::sleep_for(200us);
        --inside;
        slots.release();
      }
    });
  for (auto& t : threads) t.join();
  CHECK(peak.load() == 2);
  CHECK(inside.load() == 0);
}

TEST_CASE("compute slots are handed out in arrival order", "[compute-slots]") {
  ComputeSlots slots(1);
  REQUIRE(slots.acquire({}));  // hold the only slot while the waiters line up
  std::vector<int> order;
  std::mutex mu;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&, i] {
      REQUIRE(slots.acquire({}));
      {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(i);
      }
      slots.release();
    });
    std::this_thread::sleep_for(30ms);  // waiter i takes its ticket before waiter i+1
  }
  slots.release();
  for (auto& t : waiters) t.join();
  CHECK(order == std::vector<int>{0, 1, 2, 3});
}

TEST_CASE("a cancelled waiter gives up its place without blocking the ones behind it", "[compute-slots]") {
  ComputeSlots slots(1);
  REQUIRE(slots.acquire({}));
  std::atomic<bool> cancel{false};
  std::atomic<int> got{-1};
  std::thread first([&] { got = slots.acquire([&] { return cancel.load(); }) ? 1 : 0; });
  std::this_thread::sleep_for(30ms);
  std::atomic<bool> second_ok{false};
  std::thread second([&] {
    second_ok = slots.acquire({});
    if (second_ok) slots.release();
  });
  std::this_thread::sleep_for(30ms);
  cancel = true;
  first.join();
  CHECK(got.load() == 0);
  slots.release();  // the held slot goes to the second waiter, whose turn came after the cancelled ticket
  second.join();
  CHECK(second_ok.load());
}
