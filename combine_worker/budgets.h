// The combine worker's default byte budgets ("auto"), derived from the model's entry size and the machine, so that
// the defaults serve real entries (a 2048-token Qwen3.5-35B-A3B entry is about 280 MB on the device): the device
// tier takes the device memory left after the weights, the KV pool and the workspace, minus a reserve for what a
// request allocates on the way (prefix checkpoints, imports in flight, entries in use after their eviction); the host
// tier a quarter of host memory (pinned); the queues of host copies and cache puts a few entries each.
#pragma once
#include <cstdint>
#include <string>

#include "engine/backend.h"
#include "engine/segment.h"

namespace hypic::combine {

/// Segment length the budgets are stated in ("about N entries of 2048 tokens").
constexpr int64_t kTypicalSegmentTokens = 2048;

/// What the budgets are derived from.
struct BudgetInputs {
  bool device_entries = false;      ///< the backend keeps entries in device memory (CUDA)
  uint64_t device_free = 0;         ///< device memory free after the backend was made (bytes)
  uint64_t host_memory = 0;         ///< this host's memory (bytes; rpc::host_memory_bytes)
  uint64_t entry_bytes = 0;         ///< a typical entry where it is resident (Backend::entry_bytes(2048))
  uint64_t wire_entry_bytes = 0;    ///< the same entry serialized (cache puts)
  uint64_t prefix_cache_bytes = 0;  ///< --prefix-cache-bytes (device memory on CUDA)
  int fetch_parallelism = 8;        ///< entries imported at once per request (CombineOptions::fetch_parallelism)
};

/// Byte budgets (0 disables a tier).
struct TierBudgets {
  uint64_t device_tier = 0;       ///< --memory-tier-bytes: entries resident on the backend
  uint64_t host_tier = 0;         ///< --host-tier-bytes: pinned host copies (device backends only)
  uint64_t put_queue = 0;         ///< --put-queue-bytes: serialized entries waiting for their cache put
  uint64_t host_copy_queue = 0;   ///< --host-copy-queue-bytes: resident entries waiting for their host copy
};

/// The defaults:
///  - device backends: device tier = device_free - reserve, reserve = 4 GiB + device_free / 10 + prefix_cache_bytes
///    + fetch_parallelism entries (0 if that is negative); host tier = min(host_memory / 4, max(1 GiB, 256 entries))
///    (pinned at start-up: a small model's worker does not pin a quarter of the host);
///  - the CPU backend (entries in host memory): device tier = max(1 GiB, host_memory / 8), no host tier;
///  - put queue = max(1 GiB, 16 wire entries); host-copy queue = max(1 GiB, 16 entries) (a cold 16k-token prompt makes 8
///    entries at once, and a cache put over gRPC is slower than a host copy).
TierBudgets default_tier_budgets(const BudgetInputs& in);

/// What the CUDA runtime and the libraries (cuBLAS, cuDNN, CUDA graphs) take of device memory after start-up, beyond
/// what the backend reported free then: about 1 GiB at Qwen3.5-35B-A3B dimensions on an H100
/// (bench/results/serving_full_h100_fallback.md).
constexpr uint64_t kRuntimeDeviceReserve = uint64_t{1} << 30;

/// Device memory one request's entries can take beside the device tier (bytes; 0 on a backend without device
/// entries): what was free after start-up less the device tier, the prefix checkpoints and kRuntimeDeviceReserve.
/// A request of an entry mode whose entries need more is staged by its splice from pinned host blocks
/// (CombineService::plan_entry_room), or answered by a full prefill where not even its largest entry fits
/// (CombineService::answer_in_full).
uint64_t request_entry_room(const BudgetInputs& in, uint64_t device_tier);

/// Where a device backend's memory is, for logs: "weights 64.6 GiB, KV pool 2.2 GiB (0.3 used), workspace 7.0 GiB,
/// entries 1.9 GiB (alive, with prefix checkpoints; 0.2 dropped, freed at the next engine call), free 0.2 of 79.2 GiB,
/// the rest 3.9 GiB (sequence state slots, CUDA context, libraries' workspaces)". "" for a backend without device
/// memory (device_total 0).
std::string describe_device_memory(const engine::BackendMemory& m);

/// "31.2 GiB (about 115 entries of 2048 tokens)".
std::string describe_budget(uint64_t bytes, uint64_t entry_bytes);

/// An entry's bytes by part (DESIGN.md 3.2), for the start-up log: per linear layer the three fp32 operators and states
/// [H_v][d_k][d_v] of an entry made with w > 0 (S_seam, T_int, S_int; engine/segment.h) and the conv tail, per attention
/// layer K and V of every token; `kv_bytes_per_element` 2 where the KV is bf16 (CUDA), 4 where it is fp32 (CPU, the
/// wire). E.g. "2048 tokens: 232.2 MB = 3 x 62.9 MB of linear operators and states (S_seam, T_int, S_int; no S_seam at
/// w = 0) + 1.5 MB of conv tails + 41.9 MB of KV (20480 bytes per token)". Lightning families (scalar T_int): "2 x ...
/// MB of linear states (S_seam, S_int; ...) + N bytes of scalar T_int + ...". MLA (Kimi-Linear, kv_latent_rank > 0):
/// "... MB of MLA latent KV (N bytes per token)", its one latent row per token and layer.
std::string describe_entry_parts(const engine::EntryGeometry& g, int64_t tokens, size_t kv_bytes_per_element);

}  // namespace hypic::combine
