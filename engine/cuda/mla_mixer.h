// Kimi-Linear's full-attention layer (multi-head latent attention, HF KimiLinearAttention in transformers 5.17: no
// rotary embedding) on the GPU over a latent KV cache (kernels/cuda/mla.h): the projections through cuBLASLt, the
// token's latent row [normed c_kv | k_rot] into the layer's pool, then attention in one of two forms:
//  - absorbed (every decode step; prefill passes where mla_pass_form says so, e.g. seam windows and short queries over
//    long contexts): q_lat = [q_nope W_UK | q_rope] per head, mla_attention_latent over the pool, o = o_lat W_UV^T
//    per head (batched GEMMs);
//  - expanded (long spans, prefill): the context rows of each sequence gathered into scratch (MlaExpandPlan),
//    kv_b_proj applied, K / V expanded at a padded head size, the attention kernels of kernels/cuda/attention.h.
// Then o_proj into the residual. The CPU form is engine/families/kimi_linear mla_layer (the test oracle). All pointers
// are DEVICE pointers unless said; every call is asynchronous on `stream`.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "engine/checkpoint/config.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/mla.h"

#include <vector>

namespace hypic::engine::cuda {

/// One MLA layer's weights on the device, bf16 row-major (engine/checkpoint/weights.h MlaWeights, q LoRA excepted).
struct DevMla {
  const __nv_bfloat16* q_proj = nullptr;          ///< [nh (nope + rope)][hidden]
  const __nv_bfloat16* kv_a_proj = nullptr;       ///< [R + rope][hidden] (kv_a_proj_with_mqa)
  const __nv_bfloat16* kv_a_layernorm = nullptr;  ///< [R] (applied as w)
  const __nv_bfloat16* kv_b_proj = nullptr;       ///< [nh (nope + v)][R], per head k_nope rows then v rows
  const __nv_bfloat16* o_proj = nullptr;          ///< [hidden][nh v]
  const __nv_bfloat16* w_uk_t = nullptr;          ///< [nh][R][nope]: W_UK^T per head (kernels mla_transpose_uk of kv_b)
};

/// Which form a prefill pass's MLA attention takes (decode steps are always absorbed).
enum class MlaForm { Absorbed, Expanded };

/// The cheaper form for a pass of G groups (host q_start [G + 1], slot0 [G]) whose expansion would cover
/// `expand_rows` context rows, by a time model of the forms on one H200: absorbed, W (query, visible slot) pairs x nh x
/// (2R + rope) x 2 FLOPs at kMlaAbsorbedFlops; expanded, per context row the per-head kv_b GEMM (2R nh (nope + v)
/// FLOPs at kMlaGemmFlops) and its K / V rows written (nh (nope + rope + v) bf16 at kMlaWriteBytes), then attention at
/// the padded head size P (4P FLOPs per pair and head at kMlaAttnFlops). The rates are effective ones, fitted on
/// 2026-12-04 to Kimi-Linear-48B with each form forced: a 16 x 2k splice with a query of 64 / 512 / 2048 tokens
/// (absorbed 69.0 / 146.6 / 396.2 ms, expanded 71.5 / 98.0 / 131.2) and 1k / 4k / 16k prefills (absorbed 45.5 /
/// 153.5 / 1420.8 ms, expanded 40.8 / 86.8 / 339.4): fresh prefills and long queries expand, seam windows and short
/// queries over long contexts stay absorbed (as does any pass whose context outgrows the scratch).
/// HYPIC_MLA_FORM=absorbed / expanded in the environment (read once) forces one form (comparisons).
MlaForm mla_pass_form(const kernels::cuda::MlaDims& d, int G, const int* q_start, const int* slot0, int expand_rows);
inline constexpr double kMlaAbsorbedFlops = 80e12, kMlaGemmFlops = 120e12, kMlaAttnFlops = 400e12,
                        kMlaWriteBytes = 1e12;

/// What the model config says about its MLA layers.
struct MlaLayerConfig {
  int hidden = 0;
  kernels::cuda::MlaDims dims;
  float latent_eps = 1e-6f;  ///< KimiLinearRMSNorm(kv_lora_rank)'s default eps
  float scale = 1.0f;        ///< (nope + rope)^-1/2
  float out_scale = 1.0f;    ///< o_proj's output is added times this (1 for Kimi-Linear)
  /// From a Kimi-Linear config. Throws std::invalid_argument naming what the GPU path does not take: q_lora_rank > 0
  /// (the q LoRA), nope + rope or v over 256, or a family without MLA.
  static MlaLayerConfig of(const ModelConfig& c);
};

/// Scratch of one call of T tokens, bf16: q [T][nh (nope + rope)], ckv [T][R + rope], qx [T][nh][max(R + rope, P)]
/// (q_lat, or q_pad when expanded), ox [T][nh][max(R, P)] (o_lat, or the expanded attention output), packed
/// [T][nh v] (P = dims.padded()).
struct MlaScratch {
  __nv_bfloat16 *q = nullptr, *ckv = nullptr, *qx = nullptr, *ox = nullptr, *packed = nullptr;
  /// Elements per token of qx and ox.
  static size_t qx_width(const kernels::cuda::MlaDims& d);
  static size_t ox_width(const kernels::cuda::MlaDims& d);
};

/// How a pass with long groups expands its context (host side, built with the pass's tables): each distinct
/// sequence (groups with the same block-table row) gets scratch pages holding its slots 0 .. its longest group's KV
/// end; src_rows[i] is the pool row of scratch row i (-1 past a sequence's end: zeros); block_table [groups][max_pages]
/// gives each group its sequence's scratch pages.
struct MlaExpandPlan {
  int rows = 0;  ///< scratch rows, a multiple of kernels::cuda::kKvPageTokens
  std::vector<int> src_rows;
  std::vector<int> block_table;
  int max_pages = 0;
  /// From the pass's host groups: q_start [G + 1], slot0 [G], block_table [G][max_pages] (pool pages).
  static MlaExpandPlan of(int G, const int* q_start, const int* slot0, const int* block_table, int max_pages);
};

/// Scratch of an expanded pass over n context rows, bf16: lat [n][R + rope] (the gathered latent rows), k and v
/// [n][nh][P] (the expanded K and V; their padding columns, K's past nope + rope and V's past v, are zeros written
/// once by carve and never overwritten).
struct MlaExpandScratch {
  __nv_bfloat16 *lat = nullptr, *k = nullptr, *v = nullptr;
  int rows = 0;  ///< capacity
  /// Bytes for n rows.
  static size_t bytes(const kernels::cuda::MlaDims& d, size_t n);
  /// Points a scratch of n rows into `mem` (DEVICE, bytes(d, n) bytes) and zero-fills it (asynchronous on `stream`).
  static MlaExpandScratch carve(void* mem, const kernels::cuda::MlaDims& d, size_t n, cudaStream_t stream);
};

/// An expanded pass's device view: the plan's src_rows (DEVICE [rows]) and the groups re-pointed at the scratch pages.
struct MlaExpandPass {
  int rows = 0;
  const int* src_rows = nullptr;
  kernels::cuda::AttnGroups groups;
};

/// The layer over T tokens: xn [T][hidden] bf16 (normed input); token t's latent row goes to pool row kv_rows[t] of
/// `pool` ([rows][R + rope] bf16, pages of kKvPageTokens rows); `groups` says which queries attend which slots
/// (prefill: varlen groups; decode: one query per group). With `expand` (a pass whose groups are not all short) the
/// context is expanded into `xs` (xs->rows >= expand->rows) and attention_prefill runs over expand->groups with `aws`;
/// without, the absorbed form runs over `groups` with `lws`. y [T][hidden] fp32 += the output. Throws what the
/// kernels and GemmRunner throw, std::invalid_argument when the expansion scratch is too small.
void mla_mixer(kernels::cuda::GemmRunner& gemm, const DevMla& w, const MlaLayerConfig& c, int T,
               const __nv_bfloat16* xn, const int* kv_rows, const kernels::cuda::AttnGroups& groups,
               __nv_bfloat16* pool, const MlaExpandPass* expand, const MlaExpandScratch* xs,
               kernels::cuda::AttnDecodeWorkspace* aws, kernels::cuda::MlaAttnWorkspace* lws, const MlaScratch& s,
               float* y, cudaStream_t stream);

/// The absorbed queries of T tokens: q_lat [T][nh][R + rope] = [q_nope W_UK | q_rope] per head, from q [T][nh][nope +
/// rope] (the refresh probe of a splice uses it for the last token).
void mla_absorb_query(kernels::cuda::GemmRunner& gemm, const DevMla& w, const MlaLayerConfig& c, int T,
                      const __nv_bfloat16* q, __nv_bfloat16* q_lat, cudaStream_t stream);

}  // namespace hypic::engine::cuda
