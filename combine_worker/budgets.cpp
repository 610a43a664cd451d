#include "combine_worker/budgets.h"

#include <algorithm>

#include <fmt/format.h>

namespace hypic::combine {

TierBudgets default_tier_budgets(const BudgetInputs& in) {
  constexpr uint64_t GiB = uint64_t{1} << 30;
  TierBudgets b;
  if (in.device_entries) {
    const uint64_t reserve = 4 * GiB + in.device_free / 10 + in.prefix_cache_bytes +
                             uint64_t(std::max(in.fetch_parallelism, 0)) * in.entry_bytes;
    b.device_tier = in.device_free > reserve ? in.device_free - reserve : 0;
    b.host_tier = in.host_memory / 4;
  } else {
    b.device_tier = std::max(GiB, in.host_memory / 8);
    b.host_tier = 0;
  }
  b.put_queue = std::max(GiB, 16 * in.wire_entry_bytes);
  b.host_copy_queue = std::max(GiB, 16 * in.entry_bytes);
  return b;
}

std::string describe_budget(uint64_t bytes, uint64_t entry_bytes) {
  return fmt::format("{:.1f} GiB (about {} entries of {} tokens, {:.0f} MB each)", double(bytes) / double(1ull << 30),
                     entry_bytes ? bytes / entry_bytes : 0, kTypicalSegmentTokens, double(entry_bytes) / 1e6);
}

}  // namespace hypic::combine
