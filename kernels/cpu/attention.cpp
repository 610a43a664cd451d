#include "kernels/cpu/attention.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"

namespace hypic::kernels::cpu {

void attention_causal(const AttentionShape& s, const float* q, const float* k, const float* v, float scale,
                      float* out, float* key_mass, int64_t key_mass_queries) {
  if (s.num_queries < 0 || s.num_keys < s.num_queries || s.num_heads <= 0 || s.num_kv_heads <= 0 ||
      s.head_dim <= 0 || s.num_heads % s.num_kv_heads != 0 || s.num_keys > INT_MAX) {
    throw std::invalid_argument("attention_causal: bad shape T=" + std::to_string(s.num_queries) +
                                " keys=" + std::to_string(s.num_keys) + " heads=" + std::to_string(s.num_heads) +
                                " kv_heads=" + std::to_string(s.num_kv_heads) +
                                " head_dim=" + std::to_string(s.head_dim));
  }
  const int64_t T = s.num_queries;
  if (T == 0) return;
  const int64_t past = s.num_keys - T;
  const int hd = s.head_dim;
  const int vd = s.v_head_dim > 0 ? s.v_head_dim : hd;
  const int group = s.num_heads / s.num_kv_heads;
  const int ldq = s.num_heads * hd;
  const int ldk = s.num_kv_heads * hd;
  const int ldv = s.num_kv_heads * vd;
  const int ldo = s.num_heads * vd;
  constexpr int64_t kBlock = 128;
  std::vector<float> scores(static_cast<size_t>(std::min(T, kBlock)) * s.num_keys);

  for (int h = 0; h < s.num_heads; ++h) {
    const int kvh = h / group;
    const float* kh = k + static_cast<size_t>(kvh) * hd;
    const float* vh = v + static_cast<size_t>(kvh) * vd;
    for (int64_t b0 = 0; b0 < T; b0 += kBlock) {
      const int rows = static_cast<int>(std::min(kBlock, T - b0));
      const int keys = static_cast<int>(past + b0 + rows);  // keys visible to the block's last query
      const float* qb = q + static_cast<size_t>(b0) * ldq + static_cast<size_t>(h) * hd;
      float* ob = out + static_cast<size_t>(b0) * ldo + static_cast<size_t>(h) * vd;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, hd, scale, qb, ldq, kh, ldk, 0.0f,
                  scores.data(), keys);
      for (int i = 0; i < rows; ++i) {
        float* row = scores.data() + static_cast<size_t>(i) * keys;
        const int visible = static_cast<int>(past + b0 + i + 1);
        softmax_rows(1, visible, row, keys);
        std::fill(row + visible, row + keys, 0.0f);
        if (key_mass && b0 + i >= T - key_mass_queries)
          for (int j = 0; j < visible; ++j) key_mass[j] += row[j];
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, vd, keys, 1.0f, scores.data(), keys, vh, ldv,
                  0.0f, ob, ldo);
    }
  }
}

}  // namespace hypic::kernels::cpu
