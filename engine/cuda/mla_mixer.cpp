// Kimi-Linear's MLA layer on the GPU. Contracts: mla_mixer.h.
#include "engine/cuda/mla_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>

#include "kernels/cuda/cuda_check.h"
#include <stdexcept>
#include <string>

namespace hypic::engine::cuda {

namespace kc = hypic::kernels::cuda;

MlaLayerConfig MlaLayerConfig::of(const ModelConfig& c) {
  const std::string f = "MlaLayerConfig: ";
  if (c.family != ModelFamily::KimiLinear)
    throw std::invalid_argument(f + "family " + model_family_name(c.family) + " has no MLA layers");
  if (c.q_lora_rank > 0)
    throw std::invalid_argument(f + "q_lora_rank " + std::to_string(c.q_lora_rank) +
                                " (the q LoRA) is not supported on the GPU yet; q_proj checkpoints are");
  MlaLayerConfig l;
  l.hidden = c.hidden_size;
  l.dims = {c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank};
  if (l.dims.padded() == 0)
    throw std::invalid_argument(f + "qk head dim " + std::to_string(c.qk_nope_head_dim + c.qk_rope_head_dim) +
                                " or v head dim " + std::to_string(c.v_head_dim) + " is over 256");
  if (c.qk_nope_head_dim < 1)
    throw std::invalid_argument(f + "qk_nope_head_dim " + std::to_string(c.qk_nope_head_dim) +
                                " (the absorbed query q_nope W_UK needs at least 1)");
  if (!kc::mla_latent_supported(l.dims))
    throw std::invalid_argument(f + "kv_lora_rank " + std::to_string(c.kv_lora_rank) + " with qk_rope_head_dim " +
                                std::to_string(c.qk_rope_head_dim) +
                                " (the latent attention takes rank 128, 256 or 512 and rank + rope a multiple of 16, "
                                "at most " + std::to_string(kc::kMlaLatentMaxDim) + ")");
  l.scale = static_cast<float>(1.0 / std::sqrt(double(c.qk_nope_head_dim + c.qk_rope_head_dim)));
  l.out_scale = static_cast<float>(c.full_attn_beta);
  return l;
}

size_t MlaScratch::qx_width(const kc::MlaDims& d) {
  return size_t(d.heads) * std::max(d.rank + d.rope, d.padded());
}
size_t MlaScratch::ox_width(const kc::MlaDims& d) { return size_t(d.heads) * std::max(d.rank, d.padded()); }

size_t MlaExpandScratch::bytes(const kc::MlaDims& d, size_t n) {
  const size_t P = size_t(d.padded());
  return n * 2 * (size_t(d.rank + d.rope) + 2 * size_t(d.heads) * P) + 3 * 256;
}

MlaExpandScratch MlaExpandScratch::carve(void* mem, const kc::MlaDims& d, size_t n, cudaStream_t stream) {
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t P = size_t(d.padded()), lat = up(n * (d.rank + d.rope) * 2), kv = up(n * d.heads * P * 2);
  char* b = static_cast<char*>(mem);
  kc::check_cuda(cudaMemsetAsync(b, 0, lat + 2 * kv, stream), "MlaExpandScratch::carve");
  MlaExpandScratch s;
  s.lat = reinterpret_cast<__nv_bfloat16*>(b);
  s.k = reinterpret_cast<__nv_bfloat16*>(b + lat);
  s.v = reinterpret_cast<__nv_bfloat16*>(b + lat + kv);
  s.rows = int(n);
  return s;
}

MlaExpandPlan MlaExpandPlan::of(int G, const int* q_start, const int* slot0, const int* block_table, int max_pages) {
  constexpr int kPage = kc::kKvPageTokens;
  MlaExpandPlan p;
  // Distinct sequences by their block-table rows; each sequence's extent is its longest group's KV end.
  std::map<std::vector<int>, int> seq_of;
  std::vector<int> seq(size_t(G), 0), extent;
  for (int g = 0; g < G; ++g) {
    const int* row = block_table + size_t(g) * max_pages;
    auto [it, fresh] = seq_of.try_emplace(std::vector<int>(row, row + max_pages), int(extent.size()));
    if (fresh) extent.push_back(0);
    seq[size_t(g)] = it->second;
    extent[size_t(it->second)] = std::max(extent[size_t(it->second)], slot0[g] + q_start[g + 1] - q_start[g]);
  }
  std::vector<int> first_page(extent.size());
  std::vector<const int*> row_of(extent.size());
  for (int g = 0; g < G; ++g) row_of[size_t(seq[size_t(g)])] = block_table + size_t(g) * max_pages;
  int pages = 0;
  for (size_t s = 0; s < extent.size(); ++s) {
    first_page[s] = pages;
    const int np = (extent[s] + kPage - 1) / kPage;
    for (int i = 0; i < np * kPage; ++i)
      p.src_rows.push_back(i < extent[s] ? row_of[s][i / kPage] * kPage + i % kPage : -1);
    pages += np;
  }
  p.rows = pages * kPage;
  p.max_pages = 1;
  for (int e : extent) p.max_pages = std::max(p.max_pages, (e + kPage - 1) / kPage);
  p.block_table.assign(size_t(G) * p.max_pages, 0);
  for (int g = 0; g < G; ++g) {
    const int s = seq[size_t(g)], np = (extent[size_t(s)] + kPage - 1) / kPage;
    for (int i = 0; i < np; ++i) p.block_table[size_t(g) * p.max_pages + i] = first_page[size_t(s)] + i;
  }
  return p;
}

MlaForm mla_pass_form(const kc::MlaDims& d, int G, const int* q_start, const int* slot0, int expand_rows) {
  static const int forced = [] {
    const char* e = std::getenv("HYPIC_MLA_FORM");
    const std::string v = e ? e : "";
    return v == "absorbed" ? 1 : v == "expanded" ? 2 : 0;
  }();
  if (forced) return forced == 1 ? MlaForm::Absorbed : MlaForm::Expanded;
  double W = 0;  // (query, visible slot) pairs
  for (int g = 0; g < G; ++g) {
    const double len = q_start[g + 1] - q_start[g];
    W += len * slot0[g] + len * (len + 1) / 2;
  }
  const double nh = d.heads, P = d.padded(), rows = expand_rows;
  const double t_abs = W * nh * (2.0 * d.rank + d.rope) * 2 / kMlaAbsorbedFlops;
  const double t_exp = rows * 2.0 * d.rank * nh * (d.nope + d.v) / kMlaGemmFlops +
                       rows * nh * (d.nope + d.rope + d.v) * 2 / kMlaWriteBytes + W * nh * 4 * P / kMlaAttnFlops;
  return t_exp < t_abs ? MlaForm::Expanded : MlaForm::Absorbed;
}

void mla_absorb_query(kc::GemmRunner& gemm, const DevMla& w, const MlaLayerConfig& c, int T, const __nv_bfloat16* q,
                      __nv_bfloat16* q_lat, cudaStream_t stream) {
  if (T == 0) return;
  const kc::MlaDims& d = c.dims;
  const int qk = d.nope + d.rope, D = d.rank + d.rope, nh = d.heads;
  // q_lat[t][h][0, R) = q_nope[t][h] W_UK_h: per head x [T][nope] (row stride nh qk) times (W_UK_h^T [R][nope])^T.
  gemm.linear_batched(nh, T, d.rank, d.nope, q, long(nh) * qk, qk, w.w_uk_t, long(d.rank) * d.nope, q_lat, CUDA_R_16BF,
                      long(nh) * D, D, 0.0f, stream);
  kc::mla_query_rope(T, d, q, q_lat, stream);
}

void mla_mixer(kc::GemmRunner& gemm, const DevMla& w, const MlaLayerConfig& c, int T, const __nv_bfloat16* xn,
               const int* kv_rows, const kc::AttnGroups& groups, __nv_bfloat16* pool, const MlaExpandPass* expand,
               const MlaExpandScratch* xs, kc::AttnDecodeWorkspace* aws, kc::MlaAttnWorkspace* lws,
               const MlaScratch& s, float* y, cudaStream_t stream) {
  if (T == 0) return;
  const kc::MlaDims& d = c.dims;
  const int qk = d.nope + d.rope, nh = d.heads, D = d.rank + d.rope;
  gemm.linear(T, nh * qk, c.hidden, xn, c.hidden, w.q_proj, s.q, CUDA_R_16BF, nh * qk, 0.0f, stream);
  gemm.linear(T, D, c.hidden, xn, c.hidden, w.kv_a_proj, s.ckv, CUDA_R_16BF, D, 0.0f, stream);
  kc::mla_latent_store(T, d, s.ckv, w.kv_a_layernorm, c.latent_eps, kv_rows, pool, stream);
  if (expand) {
    if (!xs || !aws || xs->rows < expand->rows)
      throw std::invalid_argument("mla_mixer: the expansion needs " + std::to_string(expand->rows) +
                                  " scratch rows and an attention workspace");
    const int n = expand->rows, P = d.padded();
    kc::mla_gather_latent(n, d, expand->src_rows, pool, xs->lat, stream);
    // Per head h, straight into the padded K / V rows: k_nope = c W_UK_h^T (kv_b rows h (nope + v) ..), v = c W_UV_h^T.
    const long kvb_head = long(d.nope + d.v) * d.rank;
    if (d.nope > 0)
      gemm.linear_batched(nh, n, d.nope, d.rank, xs->lat, D, 0, w.kv_b_proj, kvb_head, xs->k, CUDA_R_16BF, long(nh) * P,
                          P, 0.0f, stream);
    gemm.linear_batched(nh, n, d.v, d.rank, xs->lat, D, 0, w.kv_b_proj + size_t(d.nope) * d.rank, kvb_head, xs->v,
                        CUDA_R_16BF, long(nh) * P, P, 0.0f, stream);
    kc::mla_expand_rope(n, d, xs->lat, xs->k, stream);
    kc::mla_pad_query(T, d, s.q, s.qx, stream);
    kc::attention_prefill(expand->groups, nh, nh, P, s.qx, xs->k, xs->v, c.scale, nullptr, 0, 0, s.ox, *aws, stream);
    kc::mla_pack_output(T, d, s.ox, s.packed, stream);
  } else {
    if (!lws) throw std::invalid_argument("mla_mixer: the absorbed form needs a latent attention workspace");
    mla_absorb_query(gemm, w, c, T, s.q, s.qx, stream);
    kc::mla_attention_latent(groups, d, s.qx, pool, c.scale, s.ox, *lws, stream);
    // packed[t][h] = o_lat[t][h] W_UV_h^T: W_UV_h = kv_b rows h (nope + v) + nope .. + v, [v][R].
    gemm.linear_batched(nh, T, d.v, d.rank, s.ox, long(nh) * d.rank, d.rank, w.kv_b_proj + size_t(d.nope) * d.rank,
                        long(d.nope + d.v) * d.rank, s.packed, CUDA_R_16BF, long(nh) * d.v, d.v, 0.0f, stream);
  }
  gemm.linear(T, c.hidden, nh * d.v, s.packed, nh * d.v, w.o_proj, y, CUDA_R_32F, c.hidden, 1.0f, stream, c.out_scale);
}

}  // namespace hypic::engine::cuda
