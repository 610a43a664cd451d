// Environment switches of kernel paths that are tested against their references but not the default ("candidates":
// not yet measured, or measured no faster on a GPU: off by default), and of those a GPU session measured faster and
// made the default ("measured defaults": on, the switch kept to run the old path side by side). Host only.
#pragma once
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

namespace hypic::kernels::cuda {

/// Every candidate switch (README "Kernel path switches" describes each): off by default. A path leaves this list
/// for kMeasuredDefaultSwitches when a GPU session measures it faster side by side; one measured slower or level stays.
inline constexpr const char* kCandidateSwitches[] = {
    "HYPIC_MOE_TAIL64",     "HYPIC_FUSE_NEXT_NORM",  "HYPIC_MOE_DECODE_DEEP", "HYPIC_ATTN_COMBINE_GROUPS",
    "HYPIC_FUSE_POST_NORM", "HYPIC_GDN_DECODE_NORM", "HYPIC_DECODE_LM_HEAD",  "HYPIC_MOE_PERSISTENT_LONG",
    "HYPIC_MOE_CLUSTER_PAIRS", "HYPIC_ATTN_SPLIT_WG_PLAN", "HYPIC_ATTN_DECODE_L2_AHEAD", "HYPIC_ATTN_DECODE_D_SPLIT",
    "HYPIC_MLA_SEQ_CHUNKS", "HYPIC_ROUTE_SGATE_EARLY", "HYPIC_MOE_SWAP_AB", "HYPIC_MOE_SWAP_5D",
    "HYPIC_ATTN_SPLIT_PAIR", "HYPIC_CHAIN_T_BULK", "HYPIC_ATTN_SKIP_RESCALE", "HYPIC_GDN_CONV_FUSED"};
/// Former candidates that a GPU session measured faster (H200, 2026-12-05: bench/results/candidates_ab_h200.md, the
/// first six; bench/results/candidates_ab2_h200.md, the rest but the last three: bench/results/seam_fold_h100.md,
/// bench/results/chain_lr_prefetch.md, bench/results/moe_warp_specialized.md on an H100, the two after them
/// bench/results/moe_ws_small.md on an H100, the three decode ones after them bench/results/decode_candidates_h100.md,
/// an H100 on 2026-12-06 at shorter contexts, the H200 not lent, and the last two, the decode attention's plan, its
/// third table, an H100 the same day; the last five, bench/results/decode_candidates_h100.md fourth to eighth
/// tables, an H100 on 2026-12-06; the two after them, bench/results/gdn_scan_tma_h100.md, and the last three,
/// bench/results/decode_early_ab_h100.md, an H100 on 2026-12-06; the one after them,
/// bench/results/gdn_scan_tma_all_h100.md, an H100 the same day; the last one, bench/results/chain_smem_desc_h100.md,
/// an H100 on 2026-12-07) and made the default: on unless their variable is "0" / "off" (the old path, kept for
/// side-by-side runs); HYPIC_CANDIDATES does not touch them.
inline constexpr const char* kMeasuredDefaultSwitches[] = {
    "HYPIC_MOE_EPILOGUE_VEC",   "HYPIC_ROPE_TABLE",        "HYPIC_NORM_GATED_VEC", "HYPIC_CONV_NARROW",
    "HYPIC_ATTN_SPLIT_EXACT",   "HYPIC_DEVICE_SAMPLING",   "HYPIC_ATTN_CUDNN_BUCKETS", "HYPIC_ATTN_CUDNN_PREFIX",
    "HYPIC_GDN_SCAN_WGMMA",     "HYPIC_GDN_WY_WGMMA",      "HYPIC_ROUTE_ONE_TOKEN",    "HYPIC_SPLICE_SEAM_FOLD",
    "HYPIC_CHAIN_LR_PREFETCH",  "HYPIC_MOE_WARP_SPECIALIZED", "HYPIC_MOE_WS_GATE_UP_LONG",
    "HYPIC_MOE_WS_SMALL",       "HYPIC_ROUTE_SPREAD",      "HYPIC_MOE_DECODE_TILE_INFO",
    "HYPIC_STREAM_X_AHEAD",     "HYPIC_ATTN_DECODE_WAVES", "HYPIC_ATTN_DECODE_SEQ_CHUNKS",
    "HYPIC_DECODE_PDL_MIXERS",  "HYPIC_ARGMAX_CLUSTER",    "HYPIC_MOE_DOWN_EARLY",
    "HYPIC_GDN_STATE_EARLY",    "HYPIC_CONV_STATE_EARLY",  "HYPIC_GDN_SCAN_NO_L2_PREFETCH",
    "HYPIC_GDN_SCAN_TMA",       "HYPIC_ATTN_DECODE_KV_EARLY", "HYPIC_MOE_SHARED_EARLY",  "HYPIC_COMBINE_EARLY",
    "HYPIC_GDN_SCAN_TMA_ALL",   "HYPIC_CHAIN_SMEM_DESC"};
/// Whether `name` is one of kMeasuredDefaultSwitches (on by default).
inline bool is_measured_default_switch(const char* name) {
  for (const char* c : kMeasuredDefaultSwitches)
    if (!std::strcmp(name, c)) return true;
  return false;
}
/// Whether `name` is a candidate switch of kCandidateSwitches or HYPIC_CANDIDATES (all of them).
inline bool is_candidate_switch(const char* name) {
  if (!std::strcmp(name, "HYPIC_CANDIDATES")) return true;
  for (const char* c : kCandidateSwitches)
    if (!std::strcmp(name, c)) return true;
  return false;
}

/// Whether the path of switch `name` (an environment variable: one of kCandidateSwitches or kMeasuredDefaultSwitches)
/// is on: the variable set to "1" / "on" turns it on and "0" / "off" off; unset (or any other value), a measured
/// default is on, and a candidate is on when HYPIC_CANDIDATES=1 (every candidate), else off. Reads the environment at
/// each call (CandidateSwitch keeps the answer). scripts/test_gpu.sh --candidates reruns the GPU tests with
/// HYPIC_CANDIDATES=1.
inline bool candidate_enabled(const char* name) {
  auto parse = [](const char* v) -> int {
    if (!v) return -1;
    if (!std::strcmp(v, "1") || !std::strcmp(v, "on")) return 1;
    if (!std::strcmp(v, "0") || !std::strcmp(v, "off")) return 0;
    return -1;
  };
  const int own = parse(std::getenv(name));
  if (own >= 0) return own == 1;
  if (is_measured_default_switch(name)) return true;
  return parse(std::getenv("HYPIC_CANDIDATES")) == 1;
}

/// The generation of the environment as the switches saw it: candidates_reread() moves it on.
inline std::atomic<int>& candidate_generation() {
  static std::atomic<int> g{0};
  return g;
}

/// Makes every CandidateSwitch read its variable again at its next use: for tests that setenv() a switch to run both
/// paths in one process (single-threaded; the serving processes never change their environment).
inline void candidates_reread() { candidate_generation().fetch_add(1, std::memory_order_relaxed); }

/// One candidate switch, read once per generation (an atomic load per use otherwise), e.g. at a launch site:
///   static CandidateSwitch faster("HYPIC_SOME_PATH");  if (faster.on()) ...
class CandidateSwitch {
 public:
  explicit constexpr CandidateSwitch(const char* name) : name_(name) {}
  bool on() {
    const int g = candidate_generation().load(std::memory_order_relaxed);
    if (gen_.load(std::memory_order_acquire) != g) {
      on_.store(candidate_enabled(name_), std::memory_order_relaxed);
      gen_.store(g, std::memory_order_release);
    }
    return on_.load(std::memory_order_relaxed);
  }

 private:
  const char* name_;
  std::atomic<int> gen_{-1};
  std::atomic<bool> on_{false};
};

/// A candidate switch's environment variable held for one scope (tests, the benchmark's side-by-side runs): set()
/// turns it on or off for every CandidateSwitch; the variable's value from before comes back at the end of the scope
/// (also when an exception leaves it). Single-threaded use: setenv is not thread-safe.
class CandidateScope {
 public:
  explicit CandidateScope(std::string name) : name_(std::move(name)) {
    if (const char* v = std::getenv(name_.c_str())) old_ = v;
  }
  void set(bool on) {
    setenv(name_.c_str(), on ? "1" : "0", 1);
    candidates_reread();
  }
  ~CandidateScope() {
    if (old_)
      setenv(name_.c_str(), old_->c_str(), 1);
    else
      unsetenv(name_.c_str());
    candidates_reread();
  }
  CandidateScope(const CandidateScope&) = delete;
  CandidateScope& operator=(const CandidateScope&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace hypic::kernels::cuda
