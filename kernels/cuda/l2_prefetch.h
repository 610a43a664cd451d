// L2 prefetch of weights for the small-batch decode step (HYPIC_DECODE_L2_PREFETCH). At batch 1 a decode step is a
// chain of about 480 kernels, and between the weight-streaming GEMMs (decode_linear, the MoE decode GEMMs) run
// latency-bound ones (conv1d, the recurrence, norms, routing, combines) during which the DRAM idles. A prefetch
// launched on a side stream at the start of such a window pulls the next GEMMs' weights into the L2 (50 MB on H100 /
// H200), so that those GEMMs read them from the L2 instead of waiting on DRAM. The bytes each kernel reads are the
// same either way: the results are bit-identical with and without prefetching.
//
// Only for memory no kernel writes while the prefetch may be in flight (weights): nothing waits for a prefetch, and a
// prefetch gives no ordering. All pointers are DEVICE pointers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

namespace hypic::kernels::cuda {

/// One range of device memory to bring into the L2: `bytes` bytes at `p` (p 16-byte aligned; a tail of less than
/// 16 bytes is left out). An empty range (p null or bytes 0) is skipped.
struct L2Range {
  const void* p = nullptr;
  size_t bytes = 0;
};

/// Largest decode batch (tokens) whose steps prefetch (HYPIC_DECODE_L2_PREFETCH): the recurrent states a GDN layer
/// reads and writes (2 MB per request at Qwen3.5-35B-A3B's shape) and the attention's KV stream evict the prefetched
/// lines at larger batches, whose weight GEMMs already stream near the DRAM's rate.
inline constexpr int kDecodeL2PrefetchMaxTokens = 4;

/// Most ranges of one l2_prefetch call.
inline constexpr int kL2PrefetchMaxRanges = 8;

/// Asks the L2 for ranges[0 .. n) (a host array) with bulk prefetches (`cp.async.bulk.prefetch.L2` on sm_90,
/// `prefetch.global.L2` per 128-byte line before it) from one small kernel on `stream`, which returns without waiting
/// for the bytes. Throws std::invalid_argument for n outside [0, kL2PrefetchMaxRanges] or a misaligned non-empty
/// range, std::runtime_error when the launch fails.
void l2_prefetch(const L2Range* ranges, int n, cudaStream_t stream);

/// The same for the experts a decode step's routing picked: for each of the `picks` entries e of topk_e (DEVICE,
/// int [picks], written by an earlier kernel of `stream`: read after it completes), the `expert_bytes` bytes at
/// base + e * expert_bytes (an expert-major weight [E][rows][cols] bf16: expert_bytes = rows * cols * 2). Entries
/// outside [0, num_experts) are skipped. Throws std::invalid_argument for picks < 0 or a misaligned base or size,
/// std::runtime_error when the launch fails.
void l2_prefetch_experts(int picks, const int* topk_e, int num_experts, const void* base, size_t expert_bytes,
                         cudaStream_t stream);

/// Bytes one prefetch window may ask for on the current device: half its L2 (cudaDevAttrL2CacheSize, read once per
/// device), so that the lines prefetched stay until their reader comes. Throws std::runtime_error on a CUDA error.
size_t l2_prefetch_budget();

/// Keeps the ranges' prefix that fits `budget` bytes (the last one kept cut short); returns how many remain.
int l2_prefetch_fit(L2Range* ranges, int n, size_t budget);

/// Forks `side` off `stream`: records `fork` on stream and makes side wait for it, so that what is enqueued on side
/// next starts after everything enqueued on stream so far (also inside a stream capture: the side work becomes a
/// branch of the graph, which the caller joins back before the capture ends). Throws std::runtime_error.
void fork_stream(cudaStream_t stream, cudaEvent_t fork, cudaStream_t side);

}  // namespace hypic::kernels::cuda
