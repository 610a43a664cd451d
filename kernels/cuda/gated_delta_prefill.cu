// Chunked gated delta rule prefill with the segment transition T_C (see gated_delta.h).
//
// Chunk C = 64, head size 128; the WY launch, then one or two scan launches:
//  1. gdn_wy_kernel, per (chunk, value head), all chunks in parallel: l2-normalise q and k (fp32,
//     rounded to bf16 once), G = in-chunk cumsum of g, A_ij = b_i e^{G_i - G_j} k_i.k_j (j < i),
//     X = (I + A)^{-1} blockwise in fp32 (16 x 16 diagonal blocks by forward substitution, then
//     block rows I = 1..3 as X_IJ = -X_II sum_K A_IK X_KJ), then on tensor cores
//       W = X diag(b e^G) K,  U = X diag(b) V  (stored transposed, U^T),
//       P_ij = e^{G_i - G_j} q_i.k_j for j <= i (the causal intra-chunk part of the outputs),
//     and the per-token factors kf_t = |k_t|^-1 e^{G_C - G_t}, qf_t = scale |q_t|^-1 e^{G_t}.
//  2. gdn_scan_kernel, the sequential chunk scan with the outputs fused in (no per-chunk states go
//     through device memory). Each recurrence warp owns 16 columns of [S | T] (S: the state, T: the
//     transition, started from I) and keeps the transposed block h^T (16 x 128, fp32) in its
//     tensor-core accumulators for the whole sequence, so the recurrence needs no exchange between
//     warps. Per chunk, with raw bf16 q, k from the inputs:
//       v_new^T = U^T - h^T W^T                      (T columns: U = 0)
//       h^T     = gamma h^T + v_new^T diag(kf) K,     gamma = e^{G_C}
//       o^T     = (h^T Q^T) diag(qf) + v_new^T P^T   (S columns only, by an output warp one chunk
//                                                     behind, from bf16 fragments of h^T, v_new^T)
//     which is S_C = T_chunk S_0 + K~^T U with T_chunk = gamma I - K~^T W (hybrid_models.md 5.4),
//     so T columns accumulate T_C = T_n ... T_1 in the same pass. The warps of a block share the
//     chunk's tiles, staged in shared memory through cp.async (layouts: see section 2 below).
//  3. Sequence-parallel scan (host side, gdn_prefill): a sequence is a chain of 2 blocks per value
//     head, so a few long sequences leave most SMs idle. Such a sequence is cut at chunk boundaries
//     into P parts; scan launch 1 runs part 0 from the initial state (with outputs) and parts
//     1 .. P-2 from zero with their T; compose_fold gives every part's true initial state
//     I_{p+1} = T_p I_p + S(p|0) (DESIGN.md 3.1); scan launch 2 reruns parts 1 .. P-1 from I_p for
//     their outputs (without outputs all parts run in launch 1 and the chain gives the final
//     state). About 2n/P chunk steps instead of n: P = 3 for 32 value heads on 132 SMs.
// The two kernels are templates in gdn_wy.cuh and gdn_scan.cuh (with the workspace layout they share): their products
// on mma.sync here, on warpgroup MMAs in gdn_wgmma.cu (sm_90a) under the switches (default on) HYPIC_GDN_WY_WGMMA and
// HYPIC_GDN_SCAN_WGMMA.
// The host side that needs none of the kernels' internals (gates kernel, workspace streams, argument checks, the
// split) is in gated_delta_host.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gated_delta.h"
#include "kernels/cuda/gated_delta_internal.h"
#include "kernels/cuda/gates.cuh"
#include "kernels/cuda/gdn_scan.cuh"
#include "kernels/cuda/gdn_wy.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/switches.h"

namespace hypic::kernels::cuda {
namespace {

using namespace detail;
using namespace detail::gdn;

// Once per device (the shared-memory opt-in is a per-device function attribute): returns the
// current device's SM count.
int configure() {
  const int dev = current_device();
  static DeviceOnce once;
  return once.run(dev, [](int d) {
    check_cuda(cudaFuncSetAttribute(gdn_wy_kernel<false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kWySmem),
               "cudaFuncSetAttribute(gdn_wy_kernel)");
    check_cuda(cudaFuncSetAttribute(gdn_wy_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kWySmem),
               "cudaFuncSetAttribute(gdn_wy_kernel<conv>)");
    check_cuda(cudaFuncSetAttribute(gdn_scan_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kScanSmem),
               "cudaFuncSetAttribute(gdn_scan_kernel)");
    int sms = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d), "cudaDeviceGetAttribute(SMs)");
    return sms;
  });
}

}  // namespace

GdnWorkspace::GdnWorkspace() = default;

GdnWorkspace::~GdnWorkspace() {
  if (side_) cudaStreamDestroy(side_);
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
  if (mem_) cudaFree(mem_);
  if (split_mem_) cudaFree(split_mem_);
  if (job_mem_) cudaFree(job_mem_);
}

void GdnWorkspace::reserve(size_t chunk_heads) {
  if (chunk_heads <= chunk_heads_cap_ && mem_) return;
  chunk_heads_cap_ = std::max(chunk_heads, chunk_heads_cap_);
  factors_key_.clear();  // (the factors go with the buffer)
  if (mem_) {
    check_cuda(cudaFree(mem_), "cudaFree(GdnWorkspace)");
    mem_ = nullptr;
    bytes_ = 0;
  }
  const size_t bytes = chunk_heads_cap_ * kPerChunkHeadBytes;
  check_cuda(cudaMalloc(&mem_, bytes), "cudaMalloc(GdnWorkspace, " + std::to_string(bytes) + " bytes)");
  bytes_ = bytes;
}

// The scan plan of one call shape (see GdnWorkspace): chunk table and scan jobs (on the device in
// ws.job_mem_), the launch layouts and the split sequences' state slots.
struct GdnPlan {
  std::vector<int> key;  // cu_seqlens, head counts, requested outputs, seq_parts
  bool t_in_launch1 = false;  // some job of launch 1 carries T columns
  int nchunks = 0, njobs1 = 0, njobs2 = 0, n_split = 0;
  size_t chunk_table_bytes = 0;
  struct Split {
    int seq, P;
    int F, Tp, I;  // first slots of F[p] (final state of part p from its start), Tp[p] (its T), I[p]
  };
  std::vector<Split> splits;
};

namespace {

std::vector<int> plan_key(const GdnPrefillArgs& a) {
  std::vector<int> key(a.cu_seqlens_host, a.cu_seqlens_host + a.num_seqs + 1);
  key.insert(key.end(), {a.num_seqs, a.num_k_heads, a.num_v_heads, a.out != nullptr, a.transition != nullptr,
                         a.seq_parts, a.num_checkpoints, a.final_state_last_only});
  key.insert(key.end(), a.checkpoint_tokens_host, a.checkpoint_tokens_host + a.num_checkpoints);
  return key;
}

// Builds the plan for `a`: the chunk table and scan jobs as one host table (copied to the device by
// the caller) and the bytes of split-state arena they need.
void build_plan(const GdnPrefillArgs& a, GdnPlan& plan, std::vector<unsigned char>& table,
                size_t& split_bytes) {
  std::vector<ChunkInfo> chunks;
  std::vector<int> seq_start(a.num_seqs + 1);
  int next_cp = 0;  // checkpoints are increasing: the chunking restarts after each
  for (int s = 0; s < a.num_seqs; ++s) {
    const int t0 = a.cu_seqlens_host[s], t1 = a.cu_seqlens_host[s + 1];
    seq_start[s] = static_cast<int>(chunks.size());
    for (int t = t0; t < t1;) {
      int end = std::min(t + C, t1), cp = 0;
      if (next_cp < a.num_checkpoints && a.checkpoint_tokens_host[next_cp] <= end) {
        end = a.checkpoint_tokens_host[next_cp];
        cp = ++next_cp;
      }
      chunks.push_back({s, t, end - t, cp});
      t = end;
    }
  }
  seq_start[a.num_seqs] = static_cast<int>(chunks.size());
  plan.nchunks = static_cast<int>(chunks.size());
  const bool with_t = a.transition != nullptr, with_out = a.out != nullptr;
  const std::vector<int> parts = gdn_scan_parts(a);
  int max_parts = 1;
  plan.n_split = 0;
  plan.splits.clear();
  for (int s = 0; s < a.num_seqs; ++s)
    if (parts[s] > 1) {
      max_parts = std::max(max_parts, parts[s]);
      ++plan.n_split;
    }
  for (int s = 0, k = 0; s < a.num_seqs; ++s) {
    if (parts[s] == 1) continue;
    const int b0 = 3 * max_parts * k++;
    plan.splits.push_back({s, parts[s], b0, b0 + max_parts, b0 + 2 * max_parts});
  }
  split_bytes = size_t(3) * max_parts * plan.n_split * size_t(a.num_v_heads) * D * D * sizeof(float);
  auto part_range = [&](int s, int P, int p, int& c0, int& n) {
    const int nc_s = seq_start[s + 1] - seq_start[s];
    const int lo = int(long(nc_s) * p / P), hi = int(long(nc_s) * (p + 1) / P);
    c0 = seq_start[s] + lo;
    n = hi - lo;
  };
  std::vector<ScanJob> jobs1, jobs2;
  // Where sequence s's final state goes (GdnPrefillArgs::final_state_last_only: the last one's only).
  auto final_ref = [&](int s) {
    if (!a.final_state_last_only) return kRefUser;
    return s == a.num_seqs - 1 ? kRefUserLast : kRefNone;
  };
  // Launch 1: parts of split sequences first (they carry the critical path), then whole sequences.
  for (const GdnPlan::Split& sp : plan.splits) {
    const int last1 = with_out ? sp.P - 2 : sp.P - 1;  // without outputs every part runs here
    for (int pp = 0; pp <= last1; ++pp) {
      ScanJob j{};
      part_range(sp.seq, sp.P, pp, j.c_begin, j.nc);
      j.seq = sp.seq;
      j.out = pp == 0 && with_out;
      j.init = pp == 0 ? kRefUser : kRefNone;
      j.init_t = kRefNone;
      j.final_state = sp.F + pp;
      j.transition = (pp > 0 || with_t) ? sp.Tp + pp : kRefNone;
      j.checkpoints = pp == 0;  // later parts start from zero here (and again from their true states in launch 2)
      plan.t_in_launch1 |= j.transition != kRefNone;
      jobs1.push_back(j);
    }
  }
  for (int s = 0; s < a.num_seqs; ++s) {
    if (parts[s] > 1) continue;
    jobs1.push_back({seq_start[s], seq_start[s + 1] - seq_start[s], with_out, s, kRefUser, kRefNone, final_ref(s),
                     kRefUser, 1});
  }
  // Launch 2 (with outputs): parts 1 .. P-1 from their composed initial states I[1] = F[0], I[p].
  if (with_out)
    for (const GdnPlan::Split& sp : plan.splits)
      for (int pp = 1; pp < sp.P; ++pp) {
        ScanJob j{};
        part_range(sp.seq, sp.P, pp, j.c_begin, j.nc);
        j.seq = sp.seq;
        j.out = 1;
        j.init = pp == 1 ? sp.F : sp.I + pp;
        j.final_state = pp == sp.P - 1 ? final_ref(sp.seq) : kRefNone;
        // T_C = T[P-1] (T[P-2] ... T[0]): the last part's T columns start from the prefix in I[0].
        const bool last_t = pp == sp.P - 1 && with_t;
        j.init_t = last_t ? (sp.P == 2 ? sp.Tp : sp.I) : kRefNone;
        j.transition = last_t ? kRefUser : kRefNone;
        j.checkpoints = 1;
        jobs2.push_back(j);
      }
  plan.njobs1 = static_cast<int>(jobs1.size());
  plan.njobs2 = static_cast<int>(jobs2.size());
  plan.chunk_table_bytes = (chunks.size() * sizeof(ChunkInfo) + 15) / 16 * 16;
  table.assign(plan.chunk_table_bytes + (jobs1.size() + jobs2.size()) * sizeof(ScanJob), 0);
  if (!chunks.empty()) std::memcpy(table.data(), chunks.data(), chunks.size() * sizeof(ChunkInfo));
  std::memcpy(table.data() + plan.chunk_table_bytes, jobs1.data(), jobs1.size() * sizeof(ScanJob));
  if (!jobs2.empty())
    std::memcpy(table.data() + plan.chunk_table_bytes + jobs1.size() * sizeof(ScanJob), jobs2.data(),
                jobs2.size() * sizeof(ScanJob));
  plan.key = plan_key(a);
}

}  // namespace

namespace {

// Whether a wgmma kernel of gdn_wgmma.cu whose switch is `on` runs: this build has the sm_90a code and the
// current device has compute capability 9.0.
bool wgmma_kernel_runs(bool on) {
#if HYPIC_GDN_WGMMA_BUILT
  return on && current_device_is_sm90();
#else
  (void)on;  // (no sm_90a code in this build)
  return false;
#endif
}

}  // namespace

namespace {
std::atomic<uint64_t> g_scan_wgmma_launches{0}, g_wy_wgmma_launches{0}, g_scan_tma_launches{0},
    g_scan_tma_all_launches{0}, g_wy_conv_launches{0};  // (gdn_wgmma_launches)
}  // namespace

GdnWgmmaLaunches gdn_wgmma_launches() {
  return GdnWgmmaLaunches{g_scan_wgmma_launches.load(), g_wy_wgmma_launches.load(), g_scan_tma_launches.load(),
                          g_scan_tma_all_launches.load(), g_wy_conv_launches.load()};
}

bool gdn_conv_fused_active(int kernel) {
  // HYPIC_GDN_CONV_FUSED (a candidate): the conv in the WY kernel (GdnPrefillArgs::conv) where the callers choose it.
  static CandidateSwitch fused("HYPIC_GDN_CONV_FUSED");
  return gdn_conv_fused_supported(kernel) && fused.on();
}

bool gdn_wgmma_built() {
#if HYPIC_GDN_WGMMA_BUILT
  return true;
#else
  return false;
#endif
}

bool gdn_scan_wgmma_active() {
  // HYPIC_GDN_SCAN_WGMMA (default on): the scan's products on warpgroup MMAs (gdn_wgmma.cu).
  static CandidateSwitch scan_wgmma_switch("HYPIC_GDN_SCAN_WGMMA");
  return wgmma_kernel_runs(scan_wgmma_switch.on());
}

bool gdn_wy_wgmma_active() {
  // HYPIC_GDN_WY_WGMMA (default on): the WY kernel's products on warpgroup MMAs (gdn_wgmma.cu).
  static CandidateSwitch wy_wgmma_switch("HYPIC_GDN_WY_WGMMA");
  return wgmma_kernel_runs(wy_wgmma_switch.on());
}

namespace {

// What the factors in a workspace were computed from (GdnWorkspace::factors_key_); pk: plan_key(a).
std::vector<uintptr_t> factors_key(const GdnPrefillArgs& a, const std::vector<int>& pk) {
  std::vector<uintptr_t> key(pk.begin(), pk.end());
  for (const void* p : {static_cast<const void*>(a.q), static_cast<const void*>(a.k), static_cast<const void*>(a.v),
                        static_cast<const void*>(a.g), static_cast<const void*>(a.beta),
                        static_cast<const void*>(a.gate_a), static_cast<const void*>(a.gate_b),
                        static_cast<const void*>(a.A_log), static_cast<const void*>(a.dt_bias)})
    key.push_back(reinterpret_cast<uintptr_t>(p));
  for (const void* p : {static_cast<const void*>(a.conv.x), static_cast<const void*>(a.conv.weight),
                        static_cast<const void*>(a.conv.state), static_cast<const void*>(a.conv.conv_start)})
    key.push_back(reinterpret_cast<uintptr_t>(p));
  if (a.conv.x) key.insert(key.end(), {uintptr_t(a.conv.kernel), uintptr_t(detail::conv_narrow_on())});  // (its SiLU)
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &a.scale, 4);
  key.push_back(scale_bits);
  key.push_back(a.l2norm_qk);
  return key;
}

}  // namespace

namespace detail {

// What gdn_prefill and gdn_prefill_factors share: the argument checks (messages naming `fn`), the plan (chunk table
// and scan jobs, built when the call shape changes), the workspace's factor arrays and the WY launch. Fills the
// factors' view, the device scan jobs, the split-state arena, the chunk count and the device's SM count.
struct GdnFactors {
  WsView v{};
  const ScanJob* jobs_dev = nullptr;
  float* split = nullptr;
  int nchunks = 0;
  int num_sms = 0;
  size_t slots = 0;  // the workspace's (chunk, value head) capacity
};
struct GdnFactorsAccess {
  static GdnFactors prepare(const GdnPrefillArgs& a, GdnWorkspace& ws, cudaStream_t stream, const char* fn);
  /// The factors' view of a workspace whose factors are of `a` (false, `out` untouched, when they are not).
  static bool view(const GdnPrefillArgs& a, const GdnWorkspace& ws, GdnFactors& out);

 private:
  static void fill_view(const GdnWorkspace& ws, GdnFactors& out);
};

void GdnFactorsAccess::fill_view(const GdnWorkspace& ws, GdnFactors& out) {
  WsView& v = out.v;
  auto* base = static_cast<unsigned char*>(ws.mem_);
  const size_t cap = ws.chunk_heads_cap_;
  v.W = reinterpret_cast<bf16*>(base);
  v.UT = v.W + cap * kWElems;
  v.P = v.UT + cap * kWElems;
  v.scal = reinterpret_cast<float*>(v.P + cap * kPElems);
  auto* table_dev = static_cast<unsigned char*>(ws.job_mem_);
  v.chunks = reinterpret_cast<const ChunkInfo*>(table_dev);
  out.jobs_dev = reinterpret_cast<const ScanJob*>(table_dev + ws.plan_->chunk_table_bytes);
  out.split = static_cast<float*>(ws.split_mem_);
  out.nchunks = ws.plan_->nchunks;
  out.slots = cap;
}

bool GdnFactorsAccess::view(const GdnPrefillArgs& a, const GdnWorkspace& ws, GdnFactors& out) {
  if (!ws.plan_ || ws.factors_key_.empty() || ws.factors_key_ != factors_key(a, plan_key(a))) return false;
  fill_view(ws, out);
  return true;
}

GdnFactors GdnFactorsAccess::prepare(const GdnPrefillArgs& a, GdnWorkspace& ws, cudaStream_t stream,
                                     const char* fn) {
  GdnFactors out;
  WsView& v = out.v;
  const std::string f = fn;
  detail::validate_gdn_args(a, fn);
  const int total_tokens = a.cu_seqlens_host[a.num_seqs];
  const bool fused_gates = a.gate_a || a.gate_b || a.A_log || a.dt_bias;
  if (fused_gates && (a.g || a.beta))
    throw std::invalid_argument(f + ": give either g and beta or the fused gate inputs, not both");
  const bool conv = a.conv.x != nullptr;
  if (conv) {
    if (!gdn_conv_fused_supported(a.conv.kernel))
      throw std::invalid_argument(f + ": the fused conv takes 4 taps (conv.kernel), got " +
                                  std::to_string(a.conv.kernel) + ": run conv1d_silu_prefill before instead");
    if (!a.conv.weight || !a.conv.conv_start)
      throw std::invalid_argument(f + ": the fused conv needs conv.weight and conv.conv_start");
    for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a.conv.x, "conv.x"},
                                    {a.conv.weight, "conv.weight"}, {a.conv.state, "conv.state"}})
      if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
        throw std::invalid_argument(f + ": " + name + " must be 16-byte aligned");
  }
  if (total_tokens > 0) {
    // (with the conv fused, k (and q) are where the conv's rows go, and v is not used)
    for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a.k, "k"}, {conv ? a.k : a.v, "v"}})
      if (!ptr) throw std::invalid_argument(f + ": " + name + " is null");
    if (fused_gates) {
      for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a.gate_a, "gate_a"}, {a.gate_b, "gate_b"},
                                      {a.A_log, "A_log"}, {a.dt_bias, "dt_bias"}})
        if (!ptr) throw std::invalid_argument(f + ": " + name + " is null (fused gates)");
    } else {
      for (const auto& [ptr, name] : {std::pair<const void*, const char*>{a.g, "g"}, {a.beta, "beta"}})
        if (!ptr) throw std::invalid_argument(f + ": " + name + " is null");
    }
  }
  if (a.out && total_tokens > 0 && !a.q) throw std::invalid_argument(f + ": q is null but out is requested");
  // 16-byte vector accesses: q, k, v rows (uint4, cp.async), out rows, states (float4 in compose_fold).
  for (const auto& [ptr, name] :
       {std::pair<const void*, const char*>{a.q, "q"}, {a.k, "k"}, {a.v, "v"}, {a.out, "out"},
        {a.initial_state, "initial_state"}, {a.final_state, "final_state"}, {a.transition, "transition"}})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      throw std::invalid_argument(f + ": " + name + " must be 16-byte aligned");

  out.num_sms = configure();
  // The plan: reused while cu_seqlens, head counts and requested outputs stay the same.
  const std::vector<int> pk = plan_key(a);  // (once per call: the plan's key and the factors')
  if (!ws.plan_ || ws.plan_->key != pk) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
    if (capturing != cudaStreamCaptureStatusNone)
      throw std::invalid_argument(
          f + ": a new call shape (cu_seqlens, heads, requested outputs, seq_parts) during CUDA graph "
          "capture: make one uncaptured call of this shape on this workspace first");
    auto plan = std::make_unique<GdnPlan>();
    std::vector<unsigned char> table;
    size_t split_bytes = 0;
    build_plan(a, *plan, table, split_bytes);
    ws.plan_.reset();  // a failed allocation or copy below must not leave a plan over freed buffers
    ws.factors_key_.clear();
    ws.reserve_split(split_bytes, table.size());
    check_cuda(cudaMemcpyAsync(ws.job_mem_, table.data(), table.size(), cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync(chunk table and scan jobs)");
    ws.plan_ = std::move(plan);
    ++ws.plans_built_;
  }
  const int nchunks = ws.plan_->nchunks;
  ws.reserve(size_t(nchunks) * a.num_v_heads);
  fill_view(ws, out);
  if (a.reuse_factors) {
    if (ws.factors_key_.empty() || ws.factors_key_ != factors_key(a, pk))
      throw std::invalid_argument(f + ": reuse_factors is set, but the workspace holds no factors of these arguments "
                                      "(call gdn_prefill_factors with the same arguments first)");
    return out;
  }
  ws.factors_key_.clear();  // (set again once the WY launch is issued)
  if (nchunks > 0) {
    const unsigned blocks = unsigned(nchunks) * unsigned(a.num_v_heads);
    const GateInputs gates{a.gate_a, a.gate_b, a.A_log, a.dt_bias};
    bf16* const q_out = a.out ? const_cast<bf16*>(a.q) : nullptr;  // (the conv's outputs: GdnPrefillArgs::conv)
    const ConvView cv{a.conv.x,
                      a.conv.weight,
                      a.conv.state,
                      a.conv.conv_start,
                      conv ? q_out : nullptr,
                      conv ? const_cast<bf16*>(a.k) : nullptr,
                      (2 * a.num_k_heads + a.num_v_heads) * D,
                      conv && conv_narrow_on()};
#if HYPIC_GDN_WGMMA_BUILT
    if (gdn_wy_wgmma_active()) {
      launch_wy_wgmma(blocks, q_out, a.k, a.v, a.g, a.beta, gates, a.num_k_heads, a.num_v_heads, a.l2norm_qk,
                      a.scale, v, cv, stream);
      g_wy_wgmma_launches.fetch_add(1);
    } else
#endif
    {
      auto kernel = conv ? gdn_wy_kernel<false, true> : gdn_wy_kernel<false, false>;
      kernel<<<blocks, kWyThreads, kWySmem, stream>>>(q_out, a.k, a.v, a.g, a.beta, gates, a.num_k_heads,
                                                      a.num_v_heads, a.l2norm_qk, a.scale, v, cv);
      check_cuda(cudaGetLastError(), "gdn_wy_kernel launch");
    }
    if (conv) g_wy_conv_launches.fetch_add(1);
  }
  ws.factors_key_ = factors_key(a, pk);
  return out;
}

}  // namespace detail

void gdn_prefill(const GdnPrefillArgs& a, GdnWorkspace& ws, cudaStream_t stream) {
  const detail::GdnFactors fac = detail::GdnFactorsAccess::prepare(a, ws, stream, "gdn_prefill");
  const WsView& v = fac.v;
  const ScanJob* jobs_dev = fac.jobs_dev;
  float* split = fac.split;
  const int num_sms = fac.num_sms;
  const GdnPlan& plan = *ws.plan_;
  const bool with_t = a.transition != nullptr, with_out = a.out != nullptr;

  ScanParams sp{};
  sp.Hk = a.num_k_heads;
  sp.Hv = a.num_v_heads;
  sp.q = a.q;
  sp.k = a.k;
  sp.out = a.out;
  sp.user_init = a.initial_state;
  sp.user_final = a.final_state;
  sp.user_transition = a.transition;
  sp.split = split;
  sp.checkpoints = a.checkpoint_states;
  sp.ws = v;
  sp.s_blocks = 2;
  const bool scan_wgmma = gdn_scan_wgmma_active();
  static CandidateSwitch no_l2_prefetch("HYPIC_GDN_SCAN_NO_L2_PREFETCH");  // (the wgmma scan only)
  static CandidateSwitch scan_tma("HYPIC_GDN_SCAN_TMA");                      // (the wgmma scan only)
  static CandidateSwitch scan_tma_all("HYPIC_GDN_SCAN_TMA_ALL");              // (with HYPIC_GDN_SCAN_TMA)
  (void)scan_wgmma;  // (unused in a build without sm_90a code)
  auto launch = [&](const ScanJob* jobs, int njobs, bool need_t, bool mixed_forced) {
    if (njobs == 0) return;
    // Layout: with few (job, head) pairs S and T columns go to separate blocks, so T blocks run on
    // otherwise idle SMs; with many, each block carries 64 columns of both S and T (mixed), sharing
    // the staged tiles.
    sp.with_out = with_out;
    sp.jobs = jobs;
    const long pairs = long(njobs) * a.num_v_heads;
    const int t_blocks = need_t ? (with_out ? 1 : 2) : 0;  // T blocks have as many warps as S blocks
    int layout = mixed_forced ? 2 : a.scan_layout;
    if (layout == 0) layout = pairs * (sp.s_blocks + t_blocks) <= num_sms ? 1 : 2;
    sp.mixed = layout == 2 && need_t;
    const int warps = 4 * (1 + (with_out ? 1 : 0) + (sp.mixed ? 1 : 0));
    const int blocks_per_head = sp.mixed ? 2 : sp.s_blocks + t_blocks;
    const dim3 grid(blocks_per_head, a.num_v_heads, njobs);
#if HYPIC_GDN_WGMMA_BUILT
    if (scan_wgmma) {
      ScanStaging staging;
      staging.l2_prefetch = !no_l2_prefetch.on();
      staging.tma = scan_tma.on();
      staging.tma_all = staging.tma && scan_tma_all.on();
      staging.total_tokens = a.cu_seqlens_host[a.num_seqs];
      staging.ws_slots = fac.slots;
      if (launch_scan_wgmma(grid, warps * 32, sp, a.scan_profile, staging, stream)) {
        g_scan_tma_launches.fetch_add(1);
        if (staging.tma_all) g_scan_tma_all_launches.fetch_add(1);
      }
      g_scan_wgmma_launches.fetch_add(1);
      return;
    }
#endif
    if (a.scan_profile) {
      static DeviceOnce once_prof;  // (the profiled instantiation's shared-memory opt-in, at its first launch)
      once_prof.run(current_device(), [](int) {
        check_cuda(cudaFuncSetAttribute(gdn_scan_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kScanSmem),
                   "cudaFuncSetAttribute(gdn_scan_kernel<profile>)");
        return 0;
      });
      gdn_scan_kernel<false, true><<<grid, warps * 32, kScanSmem, stream>>>(sp, a.scan_profile);
    } else {
      gdn_scan_kernel<false><<<grid, warps * 32, kScanSmem, stream>>>(sp);
    }
    check_cuda(cudaGetLastError(), "gdn_scan_kernel launch");
  };
  // Launch 1 needs T warps for the middle parts of split sequences (mixed blocks keep those at
  // two blocks per job and head).
  launch(jobs_dev, plan.njobs1, with_t || plan.t_in_launch1, plan.t_in_launch1);

  // Initial states of the parts: I[1] = F[0]; I[p+1] = T[p] I[p] + F[p] (composition law,
  // DESIGN.md 3.1). Without outputs the chain runs to the end: final = T[P-1] I[P-1] + F[P-1].
  // With outputs and T_C, I[0] receives the prefix transition T[P-2] ... T[0] that the last part's
  // T columns start from.
  const int Hv = a.num_v_heads;
  const size_t state_bytes = size_t(Hv) * D * D * sizeof(float);
  auto slot = [&](int i) { return state_ref(i, 0, nullptr, split, Hv); };
  // The transition folds (T prefix, or T_C without outputs) run on a side stream beside the state
  // folds: fork after launch 1, join before launch 2 (or the end). Capturable in a CUDA graph.
  const bool t_chain = with_t && !plan.splits.empty();
  cudaStream_t ts = stream;
  if (t_chain) {
    ws.ensure_side_stream();
    ts = ws.side_override_ ? ws.side_override_ : ws.side_;
    check_cuda(cudaEventRecord(ws.fork_, stream), "cudaEventRecord(fork)");
    check_cuda(cudaStreamWaitEvent(ts, ws.fork_, 0), "cudaStreamWaitEvent(fork)");
  }
  for (const GdnPlan::Split& q : plan.splits) {
    const float* prev = slot(q.F);  // I[1] = F[0]
    for (int pp = 2; pp < q.P; ++pp) {
      float* dst = slot(q.I + pp);
      check_cuda(cudaMemcpyAsync(dst, prev, state_bytes, cudaMemcpyDeviceToDevice, stream), "copy of a part state");
      compose_fold(Hv, 1, dst, slot(q.Tp + pp - 1), slot(q.F + pp - 1), stream);
      prev = dst;
    }
    if (with_out && with_t && q.P > 2) {
      check_cuda(cudaMemcpyAsync(slot(q.I), slot(q.Tp), state_bytes, cudaMemcpyDeviceToDevice, ts), "copy of T[0]");
      compose_fold(Hv, q.P - 2, slot(q.I), slot(q.Tp + 1), nullptr, ts);
    }
    if (!with_out) {
      const int fin_ref = !a.final_state_last_only ? kRefUser : q.seq == a.num_seqs - 1 ? kRefUserLast : kRefNone;
      float* fin = state_ref(fin_ref, q.seq, a.final_state, split, Hv);
      if (fin) {
        check_cuda(cudaMemcpyAsync(fin, prev, state_bytes, cudaMemcpyDeviceToDevice, stream),
                   "copy of the final state");
        compose_fold(Hv, 1, fin, slot(q.Tp + q.P - 1), slot(q.F + q.P - 1), stream);
      }
      float* tc = state_ref(kRefUser, q.seq, a.transition, split, Hv);
      if (tc) {  // T_C = T[P-1] ... T[1] T[0]
        check_cuda(cudaMemcpyAsync(tc, slot(q.Tp), state_bytes, cudaMemcpyDeviceToDevice, ts), "copy of T[0]");
        compose_fold(Hv, q.P - 1, tc, slot(q.Tp + 1), nullptr, ts);
      }
    }
  }
  if (t_chain) {
    check_cuda(cudaEventRecord(ws.join_, ts), "cudaEventRecord(join)");
    check_cuda(cudaStreamWaitEvent(stream, ws.join_, 0), "cudaStreamWaitEvent(join)");
  }
  launch(jobs_dev + plan.njobs1, plan.njobs2, with_t, with_t);
}

void gdn_prefill_factors(const GdnPrefillArgs& a, GdnWorkspace& ws, cudaStream_t stream) {
  GdnPrefillArgs b = a;
  b.reuse_factors = false;
  detail::GdnFactorsAccess::prepare(b, ws, stream, "gdn_prefill_factors");
}

ChainLowRankFactors gdn_low_rank_factors(const GdnPrefillArgs& a, const GdnWorkspace& ws) {
  detail::validate_gdn_args(a, "gdn_low_rank_factors");
  if (a.num_checkpoints)
    throw std::invalid_argument("gdn_low_rank_factors: the arguments have checkpoints (they cut the chunking)");
  detail::GdnFactors fac;
  if (!detail::GdnFactorsAccess::view(a, ws, fac))
    throw std::invalid_argument("gdn_low_rank_factors: the workspace holds no factors of these arguments (call "
                                "gdn_prefill_factors with the same arguments first)");
  ChainLowRankFactors f;
  f.W = fac.v.W, f.UT = fac.v.UT, f.scal = fac.v.scal, f.k = a.k;
  f.w_stride = kWElems, f.scal_stride = kScal, f.ut_ld = C, f.gamma_at = 2 * C + C - 1;
  f.num_k_heads = a.num_k_heads, f.heads = a.num_v_heads;
  return f;
}

AffineStep gdn_low_rank_step(const GdnPrefillArgs& a, int seq) {
  const std::string fn = "gdn_low_rank_step";
  detail::validate_gdn_args(a, fn.c_str());
  if (seq < 0 || seq >= a.num_seqs)
    throw std::invalid_argument(fn + ": sequence " + std::to_string(seq) + " is outside [0, " +
                                std::to_string(a.num_seqs) + ")");
  if (a.num_checkpoints) throw std::invalid_argument(fn + ": the arguments have checkpoints (they cut the chunking)");
  const int len = a.cu_seqlens_host[seq + 1] - a.cu_seqlens_host[seq];
  if (len > C)
    throw std::invalid_argument(fn + ": sequence " + std::to_string(seq) + " has " + std::to_string(len) +
                                " tokens, more than one chunk (" + std::to_string(C) + ")");
  AffineStep st;  // an empty sequence: the identity
  if (len == 0) return st;
  int chunk = 0;  // the plan's chunks: each sequence's in order, ceil(len / C) of them
  for (int i = 0; i < seq; ++i) chunk += (a.cu_seqlens_host[i + 1] - a.cu_seqlens_host[i] + C - 1) / C;
  st.lr_chunk = chunk, st.lr_t0 = a.cu_seqlens_host[seq], st.lr_len = len;
  return st;
}

}  // namespace hypic::kernels::cuda
