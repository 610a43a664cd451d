#include "combine_worker/budgets.h"

#include <algorithm>

#include <fmt/format.h>

#include "engine/checkpoint/config.h"

namespace hypic::combine {

std::string describe_device_memory(const engine::BackendMemory& m) {
  if (m.device_total == 0) return {};
  const auto gib = [](uint64_t b) { return double(b) / double(uint64_t{1} << 30); };
  const uint64_t known = m.weights + m.kv_budget + m.workspace + m.entries_used + m.freed_pending + m.pool_free +
                         m.device_free;
  const uint64_t rest = m.device_total > known ? m.device_total - known : 0;
  return fmt::format("weights {:.1f} GiB, KV pool {:.1f} GiB ({:.1f} used), workspace {:.1f} GiB, entries {:.1f} GiB "
                     "(alive, with prefix checkpoints; {:.1f} dropped, freed at the next engine call), {:.1f} GiB free "
                     "in the allocator's pool, free {:.1f} of {:.1f} GiB, the rest {:.1f} GiB (sequence state slots, "
                     "CUDA context, libraries' workspaces)",
                     gib(m.weights), gib(m.kv_budget), gib(m.kv_used), gib(m.workspace), gib(m.entries_used),
                     gib(m.freed_pending), gib(m.pool_free), gib(m.device_free), gib(m.device_total), gib(rest));
}

uint64_t request_entry_room(const BudgetInputs& in, uint64_t device_tier) {
  if (!in.device_entries) return 0;
  const uint64_t taken = device_tier + in.prefix_cache_bytes + kRuntimeDeviceReserve;
  return in.device_free > taken ? in.device_free - taken : 0;
}

TierBudgets default_tier_budgets(const BudgetInputs& in) {
  constexpr uint64_t GiB = uint64_t{1} << 30;
  TierBudgets b;
  if (in.device_entries) {
    const uint64_t reserve = 4 * GiB + in.device_free / 10 + in.prefix_cache_bytes +
                             uint64_t(std::max(in.fetch_parallelism, 0)) * in.entry_bytes;
    b.device_tier = in.device_free > reserve ? in.device_free - reserve : 0;
    // Pinned at start-up, so no larger than it needs to be: at most 256 typical entries (at least 1 GiB).
    b.host_tier = std::min(in.host_memory / 4, std::max(GiB, 256 * in.entry_bytes));
  } else {
    b.device_tier = std::max(GiB, in.host_memory / 8);
    b.host_tier = 0;
  }
  b.put_queue = std::max(GiB, 16 * in.wire_entry_bytes);
  b.host_copy_queue = std::max(GiB, 16 * in.entry_bytes);
  return b;
}

std::string describe_budget(uint64_t bytes, uint64_t entry_bytes) {
  if (bytes == 0) return "off (0 bytes)";
  const std::string size = bytes >= (uint64_t{1} << 30) ? fmt::format("{:.1f} GiB", double(bytes) / double(1ull << 30))
                                                         : fmt::format("{:.1f} MiB", double(bytes) / double(1ull << 20));
  return fmt::format("{} (about {} entries of {} tokens, {:.0f} MB each)", size, entry_bytes ? bytes / entry_bytes : 0,
                     kTypicalSegmentTokens, double(entry_bytes) / 1e6);
}

std::string describe_entry_parts(const engine::EntryGeometry& g, int64_t tokens, size_t kv_bytes_per_element) {
  const double state = double(g.num_linear) * g.linear_heads * g.d_k * g.d_v * 4;
  const double conv = double(g.num_linear) * g.conv_rows * g.conv_dim * kv_bytes_per_element;
  // K [H_kv][head_dim] and V [H_kv][v_dim()] per token and attention layer; MLA (kv_latent_rank > 0): the latent row
  // [1][R + rope] and no V.
  const double kv_per_token = double(g.num_attention) * g.kv_heads * (g.head_dim + g.v_dim()) * kv_bytes_per_element;
  const char* kv = g.kv_latent_rank > 0 ? "MLA latent KV" : "KV";
  // Lightning attention (MiniMax, Ring-linear): T_int is one float per head, not a dense operator.
  const bool scalar_t = g.family == int(engine::ModelFamily::MiniMax) || g.family == int(engine::ModelFamily::RingLinear);
  if (scalar_t) {
    const double trans = double(g.num_linear) * g.linear_heads * 4;
    const double total = 2 * state + trans + conv + kv_per_token * double(tokens);
    return fmt::format("{} tokens: {:.1f} MB = 2 x {:.1f} MB of linear states (S_seam, S_int; no S_seam at w = 0) + "
                       "{:.0f} bytes of scalar T_int + {:.1f} MB of {} ({:.0f} bytes per token)",
                       tokens, total / 1e6, state / 1e6, trans, kv_per_token * double(tokens) / 1e6, kv, kv_per_token);
  }
  const double total = 3 * state + conv + kv_per_token * double(tokens);
  return fmt::format("{} tokens: {:.1f} MB = 3 x {:.1f} MB of linear operators and states (S_seam, T_int, S_int; "
                     "no S_seam at w = 0) + {:.1f} MB of conv tails + {:.1f} MB of {} ({:.0f} bytes per token)",
                     tokens, total / 1e6, state / 1e6, conv / 1e6, kv_per_token * double(tokens) / 1e6, kv, kv_per_token);
}

}  // namespace hypic::combine
