// CPU fp32 forward pass of every family: the decoder loop, Qwen3-Next / Qwen3.5's gated attention, the plain GQA
// attention of MiniMax / Ring and the MoE blocks; each family's linear mixer (Qwen's Gated DeltaNet, Kimi's KDA,
// MiniMax's and Ring's lightning attention) and Kimi's MLA are in engine/families/<family>/layers.h. Layer math: docs/research/hybrid_models.md 1.4-1.7, 2-4 and the HF transformers 5.17
// classes named at each block. Projections over a span run as GEMMs (OpenBLAS).
#include "engine/cpu/model.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>

#include <spdlog/spdlog.h>

#include "engine/families/family_layers.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/blas_env.h"
#include "kernels/cpu/gated_delta.h"
#include "kernels/cpu/ops.h"

namespace hypic::engine {

namespace cpu = hypic::kernels::cpu;

namespace {

using families::expect_shape;

}  // namespace

/// Work buffers of one forward call, reused across layers.
struct Model::Scratch {
  std::vector<float> a, b, c, d, e, f, g, h;
};

size_t ModelState::byte_size() const {
  size_t n = 0;
  for (const auto& l : linear) n += (l.ssm.size() + l.conv.size()) * sizeof(float);
  for (const auto& a : attention) n += (a.k.size() + a.v.size()) * sizeof(float);
  return n;
}

Model Model::load(const std::filesystem::path& dir) {
  static std::once_flag checked_blas;
  std::call_once(checked_blas, [] {
    const std::string better = cpu::recommended_blas_core();
    if (better.empty()) return;
    spdlog::warn("OpenBLAS runs its {} kernels on a CPU that supports {}: set OPENBLAS_CORETYPE={} before the "
                 "program starts (several times faster GEMMs; see kernels/cpu/blas_env.h)",
                 cpu::blas_core_name(), better, better);
  });
  ModelConfig cfg = load_config(dir);
  ModelWeights w = load_weights(cfg, dir);
  return Model(std::move(cfg), std::move(w));
}

Model::Model(ModelConfig config, ModelWeights weights) : config_(std::move(config)), weights_(std::move(weights)) {
  const ModelConfig& c = config_;
  c.validate();
  const int64_t H = c.hidden_size, V = c.vocab_size;
  expect_shape(weights_.embed, {V, H}, "embed");
  expect_shape(weights_.final_norm, {H}, "final_norm");
  if (weights_.tied != c.tie_word_embeddings) {
    throw std::invalid_argument(std::string("Model: weights tied=") + (weights_.tied ? "true" : "false") +
                                " but config tie_word_embeddings=" + (c.tie_word_embeddings ? "true" : "false"));
  }
  if (!weights_.tied) expect_shape(weights_.lm_head, {V, H}, "lm_head");
  if (static_cast<int>(weights_.layers.size()) != c.num_hidden_layers) {
    throw std::invalid_argument("Model: " + std::to_string(weights_.layers.size()) + " layers of weights, config has " +
                                std::to_string(c.num_hidden_layers));
  }
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const LayerWeights& lw = weights_.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    if (lw.type != c.layer_types[i] || lw.is_moe != c.is_moe_layer(i)) {
      throw std::invalid_argument("Model: " + p + " weights do not match the config's layer type / MoE flag");
    }
    expect_shape(lw.input_layernorm, {H}, p + "input_layernorm");
    expect_shape(lw.post_attention_layernorm, {H}, p + "post_attention_layernorm");
    families::check_layer_shapes(c, lw, p);  // the mixer, by family
    if (lw.is_moe) {
      const MoeWeights& m = lw.moe;
      const int64_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
      expect_shape(m.router, {E, H}, p + "mlp.gate");
      expect_shape(m.experts_gate_up, {E, 2 * I, H}, p + "mlp.experts.gate_up_proj");
      expect_shape(m.experts_down, {E, H, I}, p + "mlp.experts.down_proj");
      if (Is > 0) {
        expect_shape(m.shared_expert.gate_proj, {Is, H}, p + "mlp.shared_expert.gate_proj");
        expect_shape(m.shared_expert.up_proj, {Is, H}, p + "mlp.shared_expert.up_proj");
        expect_shape(m.shared_expert.down_proj, {H, Is}, p + "mlp.shared_expert.down_proj");
        if (c.shared_expert_gated) expect_shape(m.shared_expert_gate, {1, H}, p + "mlp.shared_expert_gate");
      }
    } else {
      const int64_t I = c.intermediate_size;
      expect_shape(lw.mlp.gate_proj, {I, H}, p + "mlp.gate_proj");
      expect_shape(lw.mlp.up_proj, {I, H}, p + "mlp.up_proj");
      expect_shape(lw.mlp.down_proj, {H, I}, p + "mlp.down_proj");
    }
  }
  const bool rope = (c.num_attention_layers() > 0 && c.attention_has_rope()) ||
                    (c.num_linear_layers() > 0 && c.linear_rope);
  if (rope) inv_freq_ = cpu::rope_inv_freq(c.rope_theta, c.rotary_dim());
  // Qwen3.5-MoE's router (Qwen3VLMoeTextTopKRouter) always renormalises; Qwen3-Next only if norm_topk_prob.
  renormalize_topk_ = c.norm_topk_prob || c.model_type.rfind("qwen3_5_moe", 0) == 0;
}

TransitionKind linear_transition_kind(const ModelConfig& cfg) {
  return cfg.family == ModelFamily::MiniMax || cfg.family == ModelFamily::RingLinear ? TransitionKind::Scalar
                                                                                     : TransitionKind::Dense;
}

ModelState Model::initial_state() const {
  const ModelConfig& c = config_;
  ModelState s;
  s.linear.resize(c.num_linear_layers());
  for (auto& l : s.linear) {
    l.ssm.assign(static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim,
                 0.0f);
    l.conv.assign(static_cast<size_t>(c.conv_rows()) * c.conv_dim(), 0.0f);
  }
  s.attention.resize(c.num_attention_layers());
  return s;
}

void Model::validate_state(const ModelState& s) const {
  const ModelConfig& c = config_;
  if (static_cast<int>(s.linear.size()) != c.num_linear_layers() ||
      static_cast<int>(s.attention.size()) != c.num_attention_layers()) {
    throw std::invalid_argument("ModelState: " + std::to_string(s.linear.size()) + " linear / " +
                                std::to_string(s.attention.size()) + " attention layer states, model has " +
                                std::to_string(c.num_linear_layers()) + " / " +
                                std::to_string(c.num_attention_layers()));
  }
  const size_t ssm = static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
  const size_t conv = static_cast<size_t>(c.conv_rows()) * c.conv_dim();
  for (size_t i = 0; i < s.linear.size(); ++i) {
    if (s.linear[i].ssm.size() != ssm || s.linear[i].conv.size() != conv) {
      throw std::invalid_argument("ModelState: linear layer state " + std::to_string(i) + " has ssm " +
                                  std::to_string(s.linear[i].ssm.size()) + " / conv " +
                                  std::to_string(s.linear[i].conv.size()) + " values, expected " +
                                  std::to_string(ssm) + " / " + std::to_string(conv));
    }
  }
  // Cache rows: K [H_kv][head_dim] and V [H_kv][v dim], or MLA's latent [1][R + rope] and no V.
  const size_t row = static_cast<size_t>(c.kv_cache_heads()) * c.kv_cache_k_dim();
  const size_t vrow = static_cast<size_t>(c.kv_cache_heads()) * c.kv_cache_v_dim();
  for (size_t i = 0; i < s.attention.size(); ++i) {
    const auto& a = s.attention[i];
    if (a.n_tokens < 0 || a.k.size() != static_cast<size_t>(a.n_tokens) * row ||
        a.v.size() != static_cast<size_t>(a.n_tokens) * vrow) {
      throw std::invalid_argument("ModelState: attention layer state " + std::to_string(i) + " has n_tokens " +
                                  std::to_string(a.n_tokens) + " but K/V hold " + std::to_string(a.k.size()) +
                                  " / " + std::to_string(a.v.size()) + " values (" + std::to_string(row) + " / " +
                                  std::to_string(vrow) + " per token)");
    }
  }
}

PrefillResult Model::prefill(ModelState& state, std::span<const int32_t> ids, int64_t start_position,
                             const PrefillOptions& options) const {
  const SpanSpec span{ids, start_position};
  return forward(state, std::span<const SpanSpec>(&span, 1), nullptr, options, LinearMode::Chunked);
}

PrefillResult Model::prefill_spans(ModelState& state, std::span<const SpanSpec> spans,
                                   const SpanLayerHook& after_mixer, const PrefillOptions& options) const {
  if (options.capture_transitions && spans.size() != 1)
    throw std::invalid_argument("prefill_spans: capture_transitions needs exactly one span");
  return forward(state, spans, after_mixer ? &after_mixer : nullptr, options, LinearMode::Chunked);
}

std::vector<float> Model::decode(ModelState& state, int32_t id, int64_t position) const {
  const int32_t ids[1] = {id};
  const SpanSpec span{ids, position};
  return forward(state, std::span<const SpanSpec>(&span, 1), nullptr, PrefillOptions{}, LinearMode::Recurrent).logits;
}

void Model::rope_rotate(float* k, int64_t n_tokens, int heads, int64_t position_delta) const {
  if (inv_freq_.empty())
    throw std::invalid_argument(std::string("rope_rotate: the model (") + model_family_name(config_.family) +
                                ") has no RoPE");
  if (n_tokens < 0 || heads < 0) {
    throw std::invalid_argument("rope_rotate: negative n_tokens " + std::to_string(n_tokens) + " or heads " +
                                std::to_string(heads));
  }
  cpu::apply_rope_uniform(k, n_tokens, heads, config_.head_dim, inv_freq_, position_delta);
}

void Model::rotate_linear_state(std::span<float> ssm, int64_t position_delta) const {
  const ModelConfig& c = config_;
  if (!linear_states_rotate())
    throw std::invalid_argument(std::string("rotate_linear_state: the linear layers of this model (") +
                                model_family_name(c.family) + ") apply no RoPE");
  const size_t want = size_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
  if (ssm.size() != want)
    throw std::invalid_argument("rotate_linear_state: state has " + std::to_string(ssm.size()) + " values, expected " +
                                std::to_string(want));
  cpu::apply_rope_key_axis(ssm.data(), c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                           inv_freq_, position_delta);
}

PrefillResult Model::forward(ModelState& state, std::span<const SpanSpec> spans, const SpanLayerHook* after_mixer,
                             const PrefillOptions& options, LinearMode mode) const {
  const ModelConfig& c = config_;
  if (spans.empty()) throw std::invalid_argument("prefill: no spans");
  // Row offsets of each span in the concatenated activations.
  std::vector<int64_t> offset(spans.size() + 1, 0);
  for (size_t si = 0; si < spans.size(); ++si) {
    const SpanSpec& sp = spans[si];
    const std::string where = spans.size() > 1 ? " (span " + std::to_string(si) + ")" : std::string();
    if (sp.ids.empty()) throw std::invalid_argument("prefill: empty token span" + where);
    if (sp.start_position < 0) {
      throw std::invalid_argument("prefill: start_position " + std::to_string(sp.start_position) + " is negative" +
                                  where);
    }
    for (size_t t = 0; t < sp.ids.size(); ++t) {
      if (sp.ids[t] < 0 || sp.ids[t] >= c.vocab_size) {
        throw std::invalid_argument("prefill: token id " + std::to_string(sp.ids[t]) + " at span index " +
                                    std::to_string(t) + where + " is outside [0, " + std::to_string(c.vocab_size) +
                                    ")");
      }
    }
    offset[si + 1] = offset[si] + static_cast<int64_t>(sp.ids.size());
  }
  const int64_t T = offset.back();
  validate_state(state);
  if (options.attention_mass) {
    options.attention_mass->assign(static_cast<size_t>(state.attention.empty() ? 0 : state.attention[0].n_tokens + T),
                                   0.0f);
  }

  const int64_t H = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> x(static_cast<size_t>(T) * H), hn(x.size()), mix(x.size());
  for (size_t si = 0; si < spans.size(); ++si)
    for (size_t t = 0; t < spans[si].ids.size(); ++t) {
      const float* row = weights_.embed.ptr() + static_cast<size_t>(spans[si].ids[t]) * H;
      std::copy(row, row + H, x.data() + static_cast<size_t>(offset[si] + static_cast<int64_t>(t)) * H);
    }
  PrefillResult result;
  if (options.capture_transitions) result.transitions.resize(state.linear.size());
  result.transition_kind = linear_transition_kind(c);
  Scratch scratch;
  // RMSNorm flavour: Qwen's zero-centred (1 + w), every other family's w (KimiLinearRMSNorm, MiniMaxRMSNorm, ...).
  const bool zc = c.zero_centred_norms();
  auto norm = [&](int64_t rows, const float* in, const Tensor& w, float* out_rows) {
    if (zc)
      cpu::rms_norm_zero_centred(rows, H, in, w.ptr(), eps, out_rows);
    else
      cpu::rms_norm(rows, H, in, w.ptr(), eps, out_rows);
  };
  // Residual: x += f(norm(x)); MiniMaxDecoderLayer is post-norm: x = alpha * norm(x) + beta * f(norm(x)).
  const bool post_norm = c.family == ModelFamily::MiniMax;
  auto residual = [&](double alpha, double beta) {
    if (!post_norm) {
      for (size_t j = 0; j < x.size(); ++j) x[j] += mix[j];
      return;
    }
    const float a = static_cast<float>(alpha), b = static_cast<float>(beta);
    for (size_t j = 0; j < x.size(); ++j) x[j] = hn[j] * a + mix[j] * b;
  };

  // Decoder layer (Qwen3NextDecoderLayer / Qwen3_5DecoderLayer / KimiLinearDecoderLayer; MiniMaxDecoderLayer with
  // its alpha/beta residuals): x += mixer(norm(x)); x += ffn(norm(x)).
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    if (options.cancelled && options.cancelled())
      throw PrefillCancelled("prefill cancelled before layer " + std::to_string(i));
    const LayerWeights& lw = weights_.layers[i];
    norm(T, x.data(), lw.input_layernorm, hn.data());
    for (size_t si = 0; si < spans.size(); ++si) {  // token mixers: span by span, on the running state
      const size_t r0 = static_cast<size_t>(offset[si]) * H;
      const int64_t Ts = offset[si + 1] - offset[si];
      if (lw.type == LayerType::Linear) {
        const int li = c.linear_index(i);
        std::vector<float>* tr = options.capture_transitions ? &result.transitions[li] : nullptr;
        const bool recurrent = mode == LinearMode::Recurrent;
        LinearLayerState& lst = state.linear[li];
        const float* xs = hn.data() + r0;
        float* ys = mix.data() + r0;
        switch (c.family) {  // each family's linear mixer (engine/families/<family>/layers.h)
          case ModelFamily::Qwen:
            families::qwen::gated_deltanet_layer(
                c, lw.linear, lst, xs, Ts, recurrent, tr,
                {scratch.a, scratch.b, scratch.c, scratch.d, scratch.e, scratch.f, scratch.g}, ys);
            break;
          case ModelFamily::KimiLinear: families::kimi_linear::kda_layer(c, lw.kda, lst, xs, Ts, recurrent, tr, ys); break;
          case ModelFamily::MiniMax:
            families::minimax::lightning_layer(c, lw.lightning, lst, xs, Ts, recurrent, tr, ys);
            break;
          case ModelFamily::RingLinear:
            families::ring_linear::lightning_layer(c, lw.lightning, lst, xs, Ts, spans[si].start_position, inv_freq_,
                                                   recurrent, tr, ys);
            break;
        }
      } else {
        AttentionLayerState& ast = state.attention[c.attention_index(i)];
        float* key_mass = nullptr;
        if (options.attention_mass && si + 1 == spans.size()) {  // the last span's last token, over the whole cache
          options.attention_mass->resize(static_cast<size_t>(ast.n_tokens + Ts), 0.0f);
          key_mass = options.attention_mass->data();
        }
        if (c.family == ModelFamily::KimiLinear)
          families::kimi_linear::mla_layer(c, lw.mla, ast, hn.data() + r0, Ts, mix.data() + r0, key_mass);
        else
          attention_layer(lw, ast, hn.data() + r0, Ts, spans[si].start_position, scratch, mix.data() + r0, key_mass);
      }
      if (after_mixer) (*after_mixer)(si, i, state);
    }
    if (lw.type == LayerType::Linear)
      residual(c.linear_attn_alpha, c.linear_attn_beta);
    else
      residual(c.full_attn_alpha, c.full_attn_beta);
    norm(T, x.data(), lw.post_attention_layernorm, hn.data());
    if (lw.is_moe) {
      moe_block(lw.moe, hn.data(), T, scratch, mix.data());
    } else {
      mlp_block(lw.mlp, c.intermediate_size, hn.data(), T, scratch, mix.data());
    }
    residual(c.mlp_alpha, c.mlp_beta);
  }
  state.num_tokens += T;

  // Final norm and LM head, only on the last span's rows whose logits are wanted.
  if (options.skip_logits) return result;
  const int64_t first = options.all_logits ? offset[spans.size() - 1] : T - 1;
  const int64_t rows = T - first;
  norm(rows, x.data() + static_cast<size_t>(first) * H, weights_.final_norm, hn.data());
  result.logits.resize(static_cast<size_t>(rows) * c.vocab_size);
  cpu::linear(rows, H, c.vocab_size, hn.data(), weights_.output_embedding().ptr(), result.logits.data());
  return result;
}

// Gated full attention (Qwen3NextAttention / Qwen3_5Attention, eager): q_proj split per head into
// query | gate, zero-centred q/k norms, partial NeoX RoPE, causal GQA over cache + span, * sigmoid(gate), o_proj.
// Without the gate and the norms it is MiniMaxAttention (full-head RoPE); with plain (w) q/k norms and partial
// RoPE, Ring's softmax attention.
void Model::attention_layer(const LayerWeights& lw, AttentionLayerState& st, const float* x, int64_t T,
                            int64_t start_position, Scratch& s, float* out, float* key_mass) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = lw.attention;
  const int64_t H = c.hidden_size;
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int64_t qrow = int64_t(nh) * hd, kvrow = int64_t(nkv) * hd;
  const int64_t qproj = (c.attn_output_gate ? 2 : 1) * qrow;
  const float eps = static_cast<float>(c.rms_norm_eps);

  std::vector<float>& qg = s.a;    // [T][nh][2*hd] (query | gate per head) or [T][nh][hd]
  std::vector<float>& q = s.b;     // [T][nh][hd]
  std::vector<float>& gate = s.c;  // [T][nh][hd]
  std::vector<float>& kv = s.d;    // [T][nkv][hd] k then [T][nkv][hd] v
  std::vector<float>& attn = s.e;  // [T][nh][hd]
  qg.resize(static_cast<size_t>(T) * qproj);
  q.resize(static_cast<size_t>(T) * qrow);
  gate.resize(q.size());
  kv.resize(static_cast<size_t>(T) * kvrow * 2);
  attn.resize(q.size());
  float* k = kv.data();
  float* v = kv.data() + static_cast<size_t>(T) * kvrow;

  cpu::linear(T, H, qproj, x, w.q_proj.ptr(), qg.data());
  cpu::linear(T, H, kvrow, x, w.k_proj.ptr(), k);
  cpu::linear(T, H, kvrow, x, w.v_proj.ptr(), v);
  if (c.attn_output_gate) {
    for (int64_t r = 0; r < T * nh; ++r) {
      const float* src = qg.data() + static_cast<size_t>(r) * 2 * hd;
      std::copy(src, src + hd, q.data() + static_cast<size_t>(r) * hd);
      std::copy(src + hd, src + 2 * hd, gate.data() + static_cast<size_t>(r) * hd);
    }
  } else {
    std::copy(qg.begin(), qg.end(), q.begin());
  }
  if (c.use_qk_norm && c.zero_centred_norms()) {
    cpu::rms_norm_zero_centred(T * nh, hd, q.data(), w.q_norm.ptr(), eps, q.data());
    cpu::rms_norm_zero_centred(T * nkv, hd, k, w.k_norm.ptr(), eps, k);
  } else if (c.use_qk_norm) {  // Ring: query_layernorm / key_layernorm, applied as w
    cpu::rms_norm(T * nh, hd, q.data(), w.q_norm.ptr(), eps, q.data());
    cpu::rms_norm(T * nkv, hd, k, w.k_norm.ptr(), eps, k);
  }
  cpu::apply_rope(q.data(), T, nh, hd, inv_freq_, start_position);
  cpu::apply_rope(k, T, nkv, hd, inv_freq_, start_position);

  st.k.insert(st.k.end(), k, k + static_cast<size_t>(T) * kvrow);
  st.v.insert(st.v.end(), v, v + static_cast<size_t>(T) * kvrow);
  st.n_tokens += T;

  const cpu::AttentionShape shape{T, st.n_tokens, nh, nkv, hd};
  cpu::attention_causal(shape, q.data(), st.k.data(), st.v.data(),
                        static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))), attn.data(), key_mass, 1);
  if (c.attn_output_gate) {
    for (size_t i = 0; i < attn.size(); ++i) attn[i] *= cpu::sigmoid(gate[i]);
  }
  cpu::linear(T, qrow, H, attn.data(), w.o_proj.ptr(), out);
}

// SwiGLU MLP (Qwen3NextMLP / Qwen3_5MLP): down(silu(gate x) * up x).
void Model::mlp_block(const MlpWeights& w, int64_t width, const float* x, int64_t T, Scratch& s, float* out) const {
  const int64_t H = config_.hidden_size;
  std::vector<float>& gu = s.h;  // [T][width] gate then [T][width] up
  gu.resize(static_cast<size_t>(T) * width * 2);
  float* gate = gu.data();
  float* up = gu.data() + static_cast<size_t>(T) * width;
  cpu::linear(T, H, width, x, w.gate_proj.ptr(), gate);
  cpu::linear(T, H, width, x, w.up_proj.ptr(), up);
  for (size_t i = 0; i < static_cast<size_t>(T) * width; ++i) gate[i] = cpu::silu(gate[i]) * up[i];
  cpu::linear(T, width, H, gate, w.down_proj.ptr(), out);
}

// Sparse MoE (Qwen3NextSparseMoeBlock with eager experts; MiniMaxSparseMoeBlock is the same without a shared expert;
// KimiLinearMoE / Ring route with families::shared::route_sigmoid and add their shared experts ungated): softmax router over
// all experts (fp32), top-k,
// optional renormalisation; tokens grouped per expert and run as GEMMs; routed outputs accumulated in
// ascending expert order (as HF's index_add_ loop), then the sigmoid-gated shared expert added.
void Model::moe_block(const MoeWeights& w, const float* x, int64_t T, Scratch& s, float* out) const {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  const int E = c.num_experts, topk = c.num_experts_per_tok;

  // Per expert: the tokens routed to it and their weights, in token order.
  std::vector<std::vector<std::pair<int64_t, float>>> routed(E);
  std::vector<float> probs;
  std::vector<int> order(E);
  if (c.router_score == RouterScore::Sigmoid) {
    families::shared::route_sigmoid(c, w, x, T, routed);  // Kimi-Linear, Ring: sigmoid, bias, groups, scaling
  } else {
    probs.resize(static_cast<size_t>(T) * E);
    cpu::linear(T, H, E, x, w.router.ptr(), probs.data());
    cpu::softmax_rows(T, E, probs.data(), E);
  }
  for (int64_t t = 0; t < T && c.router_score == RouterScore::Softmax; ++t) {
    const float* p = probs.data() + static_cast<size_t>(t) * E;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + topk, order.end(),
                      [p](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float sum = 0.0f;
    for (int j = 0; j < topk; ++j) sum += p[order[j]];
    for (int j = 0; j < topk; ++j) {
      const float wt = renormalize_topk_ ? p[order[j]] / sum : p[order[j]];
      routed[order[j]].emplace_back(t, wt);
    }
  }

  std::fill(out, out + static_cast<size_t>(T) * H, 0.0f);
  std::vector<float>& xe = s.a;   // [n_e][H] gathered inputs
  std::vector<float>& gu = s.b;   // [n_e][2I]
  std::vector<float>& act = s.c;  // [n_e][I]
  std::vector<float>& ye = s.d;   // [n_e][H]
  for (int e = 0; e < E; ++e) {
    const auto& list = routed[e];
    if (list.empty()) continue;
    const int64_t n = static_cast<int64_t>(list.size());
    xe.resize(static_cast<size_t>(n) * H);
    gu.resize(static_cast<size_t>(n) * 2 * I);
    act.resize(static_cast<size_t>(n) * I);
    ye.resize(static_cast<size_t>(n) * H);
    for (int64_t r = 0; r < n; ++r) {
      const float* src = x + static_cast<size_t>(list[r].first) * H;
      std::copy(src, src + H, xe.data() + static_cast<size_t>(r) * H);
    }
    cpu::linear(n, H, 2 * I, xe.data(), w.experts_gate_up.ptr() + static_cast<size_t>(e) * 2 * I * H, gu.data());
    for (int64_t r = 0; r < n; ++r) {
      const float* row = gu.data() + static_cast<size_t>(r) * 2 * I;
      float* a = act.data() + static_cast<size_t>(r) * I;
      for (int64_t j = 0; j < I; ++j) a[j] = cpu::silu(row[j]) * row[I + j];
    }
    cpu::linear(n, I, H, act.data(), w.experts_down.ptr() + static_cast<size_t>(e) * H * I, ye.data());
    for (int64_t r = 0; r < n; ++r) {
      float* dst = out + static_cast<size_t>(list[r].first) * H;
      const float* src = ye.data() + static_cast<size_t>(r) * H;
      const float wt = list[r].second;
      for (int64_t j = 0; j < H; ++j) dst[j] += src[j] * wt;
    }
  }

  if (Is > 0) {
    std::vector<float> shared(static_cast<size_t>(T) * H), sgate(static_cast<size_t>(T));
    mlp_block(w.shared_expert, Is, x, T, s, shared.data());
    if (!c.shared_expert_gated) {  // KimiLinearMoE / Ring: routed + shared_experts(x)
      for (size_t j = 0; j < shared.size(); ++j) out[j] += shared[j];
      return;
    }
    cpu::linear(T, H, 1, x, w.shared_expert_gate.ptr(), sgate.data());
    for (int64_t t = 0; t < T; ++t) {
      const float gt = cpu::sigmoid(sgate[t]);
      float* dst = out + static_cast<size_t>(t) * H;
      const float* src = shared.data() + static_cast<size_t>(t) * H;
      for (int64_t j = 0; j < H; ++j) dst[j] += gt * src[j];
    }
  }
}

}  // namespace hypic::engine
