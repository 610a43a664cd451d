// Model weights in ONE internal fp32 layout, whatever layout the checkpoint used:
//  - transformers 5.17 save_pretrained (fused experts `mlp.experts.gate_up_proj` [E,2I,H] and
//    `mlp.experts.down_proj` [E,H,I]; `model.` prefix),
//  - released checkpoints (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`; Qwen3.5's
//    `model.language_model.` prefix; Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba`),
//  - Kimi-Linear, MiniMax and Ring-linear in both their save_pretrained and released names
//    (engine/families/<family>/weights.h: `block_sparse_moe.` or `mlp.`, experts `w1/w2/w3` or `gate/up/down_proj`
//    or fused, Kimi's three `{q,k,v}_conv1d` or one packed `conv1d`, `forget_gate.`-prefixed or flat gate tensors,
//    Ring's `model.word_embeddings` and fused `query_key_value`).
// Each family's names are read by engine/families/<family>/weights.cpp; load_weights dispatches to them by family.
// `mtp.*` and `model.visual.*` tensors are ignored. All matrices are row-major [out][in] like
// torch.nn.Linear.weight, so y = W x is a GEMM with W's rows as outputs.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/safetensors.h"

namespace hypic::engine {

/// Owning dense fp32 tensor, row-major, with its shape.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  int64_t numel() const;  ///< product of shape (1 for a scalar, 0 if empty shape list is {0})
  bool empty() const { return data.empty(); }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
  /// Shape as text, e.g. "[8192, 2048]".
  std::string shape_str() const;
};

/// One Gated DeltaNet layer (`linear_attn.*`). nk/nv heads, dk/dv dims, H hidden, K conv kernel.
struct LinearAttnWeights {
  Tensor in_proj_qkv;  ///< [conv_dim, H], rows [Q all nk heads (nk*dk) | K all heads (nk*dk) | V all nv heads (nv*dv)]
  Tensor in_proj_z;    ///< [nv*dv, H], rows grouped by value head
  Tensor in_proj_b;    ///< [nv, H]  beta = sigmoid(b)
  Tensor in_proj_a;    ///< [nv, H]  g = -exp(A_log) * softplus(a + dt_bias)
  Tensor conv1d;       ///< [conv_dim, K]  (checkpoint [conv_dim, 1, K]); w[c][K-1] multiplies the current token
  Tensor A_log;        ///< [nv]
  Tensor dt_bias;      ///< [nv]
  Tensor norm;         ///< [dv]  gated RMSNorm weight, applied as w (NOT 1 + w)
  Tensor out_proj;     ///< [H, nv*dv]
};

/// One gated full-attention layer (`self_attn.*`). nh query heads, nkv KV heads, hd head dim.
struct AttentionWeights {
  Tensor q_proj;  ///< [2*nh*hd, H] when attn_output_gate (per head: hd query rows, then hd gate rows, as HF),
                  ///< else [nh*hd, H]
  Tensor k_proj;  ///< [nkv*hd, H]
  Tensor v_proj;  ///< [nkv*hd, H]
  Tensor o_proj;  ///< [H, nh*hd]
  Tensor q_norm;  ///< [hd] zero-centred (applied as 1 + w)
  Tensor k_norm;  ///< [hd] zero-centred (applied as 1 + w)
};

/// One KDA layer (Kimi-Linear `self_attn.*` of a linear layer, KimiLinearDeltaAttention): nh heads of d channels
/// (key dim = value dim = d), H hidden, K conv kernel.
struct KdaWeights {
  Tensor q_proj, k_proj, v_proj;  ///< [nh*d, H] each
  Tensor conv1d;    ///< [3*nh*d, K], channels [q | k | v] (checkpoint q_conv1d / k_conv1d / v_conv1d [nh*d, 1, K],
                    ///< or one packed conv1d [3*nh*d, 1, K]); w[c][K-1] multiplies the current token
  Tensor f_a_proj;  ///< [d, H]      forget gate, low rank: g = -exp(A_log) * softplus(f_b(f_a x) + dt_bias)
  Tensor f_b_proj;  ///< [nh*d, d]
  Tensor A_log;     ///< [nh]        (checkpoint [1, 1, nh, 1])
  Tensor dt_bias;   ///< [nh*d]
  Tensor b_proj;    ///< [nh, H]     beta = sigmoid(b_proj x)
  Tensor g_a_proj;  ///< [d, H]      output gate, low rank: sigmoid(g_b(g_a x))
  Tensor g_b_proj;  ///< [nh*d, d]
  Tensor o_norm;    ///< [d]         RMSNorm weight (applied as w) of each head's output
  Tensor o_proj;    ///< [H, nh*d]
};

/// One multi-head latent attention layer (Kimi-Linear `self_attn.*` of a full-attention layer, KimiLinearAttention):
/// nh heads, qk = qk_nope + qk_rope, R = kv_lora_rank, Q = q_lora_rank.
struct MlaWeights {
  Tensor q_proj;          ///< [nh*qk, H] when Q == 0 (else empty)
  Tensor q_a_proj;        ///< [Q, H] when Q > 0
  Tensor q_a_layernorm;   ///< [Q] when Q > 0 (RMSNorm, w)
  Tensor q_b_proj;        ///< [nh*qk, Q] when Q > 0
  Tensor kv_a_proj;       ///< [R + qk_rope, H] (`kv_a_proj_with_mqa`): compressed KV, then the shared k_rot slice
  Tensor kv_a_layernorm;  ///< [R] (RMSNorm, w)
  Tensor kv_b_proj;       ///< [nh*(qk_nope + v_head_dim), R], per head k_nope rows then v rows
  Tensor o_proj;          ///< [H, nh*v_head_dim]
};

/// One lightning-attention layer (MiniMaxLightningAttention `self_attn.*`; Ring's linear `attention.*`): nh heads of
/// d channels (key = value dim), H hidden.
struct LightningWeights {
  Tensor qkv_proj;        ///< [3*nh*d, H], rows [Q all heads | K all heads | V all heads] (MiniMax's per-head
                          ///< q|k|v rows of `qkv_proj` are regrouped at load; Ring's `query_key_value` is flat already)
  Tensor gate;            ///< [nh*d, H] output gate (MiniMax `output_gate`, Ring `g_proj`)
  Tensor norm;            ///< [nh*d] output RMSNorm weight, applied as w (MiniMax `norm`, Ring `g_norm`)
  Tensor out_proj;        ///< [H, nh*d] (MiniMax `out_proj`, Ring `dense`)
  Tensor q_norm, k_norm;  ///< [d] Ring `query_layernorm` / `key_layernorm` (RMSNorm, w); empty without qk-norm
  Tensor slope;           ///< [nh] decay rate s_h > 0 of each head: the per-token decay is e^{-s_h}. From the
                          ///< checkpoint's `slope_rate` buffer when it has one (what HF then uses), else
                          ///< lightning_slope_rates()
};

/// Dense SwiGLU MLP: down(silu(gate x) * up x). I = its intermediate width.
struct MlpWeights {
  Tensor gate_proj;  ///< [I, H]
  Tensor up_proj;    ///< [I, H]
  Tensor down_proj;  ///< [H, I]
};

/// Sparse MoE block: router, top-k routed experts, plus an optional shared expert. Qwen3NextSparseMoeBlock gates
/// the shared expert by sigmoid(shared_expert_gate x); Kimi-Linear (KimiLinearMoE) and Ring add theirs ungated and
/// route with sigmoid scores plus a selection bias; MiniMax (MiniMaxSparseMoeBlock) has no shared expert.
/// E experts of width I, shared width Is.
struct MoeWeights {
  Tensor router;              ///< [E, H]  (checkpoint `mlp.gate.weight`)
  Tensor router_bias;         ///< [E] when ModelConfig::router_bias (`gate.e_score_correction_bias`, Ring
                              ///< `gate.expert_bias`): added to the scores for the choice only; else empty
  Tensor experts_gate_up;     ///< [E, 2I, H]  per expert: I gate rows first, then I up rows
  Tensor experts_down;        ///< [E, H, I]
  MlpWeights shared_expert;   ///< gate/up [Is, H], down [H, Is]; all empty when Is == 0
  Tensor shared_expert_gate;  ///< [1, H]; empty when Is == 0 or the shared expert is ungated
};

/// One decoder layer. Exactly one mixer is filled, by `type` and the family: linear (Qwen Gated DeltaNet), kda
/// (Kimi), lightning (MiniMax, Ring) for linear layers; attention (Qwen gated, MiniMax / Ring plain GQA) or mla
/// (Kimi) for full-attention layers. Exactly one of {moe, mlp} (by `is_moe`).
/// AttentionWeights for MiniMax / Ring: q_proj [nh*hd, H], k/v_proj [nkv*hd, H], o_proj [H, nh*hd]; q_norm / k_norm
/// [hd] applied as w for Ring with use_qk_norm, empty otherwise.
struct LayerWeights {
  LayerType type = LayerType::Linear;
  bool is_moe = false;
  Tensor input_layernorm;           ///< [H] Qwen: zero-centred (1 + w); other families: w
  Tensor post_attention_layernorm;  ///< [H] Qwen: zero-centred (1 + w); other families: w
  LinearAttnWeights linear;
  KdaWeights kda;
  LightningWeights lightning;
  AttentionWeights attention;
  MlaWeights mla;
  MoeWeights moe;
  MlpWeights mlp;
};

/// All weights of a model, fp32, in the internal layout above.
struct ModelWeights {
  Tensor embed;       ///< [V, H]  (`model.embed_tokens.weight`; Ring `model.word_embeddings.weight`)
  Tensor final_norm;  ///< [H] zero-centred (1 + w) for Qwen, w otherwise  (`model.norm.weight`)
  Tensor lm_head;     ///< [V, H]; EMPTY when tie_word_embeddings (use output_embedding())
  bool tied = false;  ///< lm_head is embed
  std::vector<LayerWeights> layers;

  /// The LM-head matrix [V, H]: lm_head, or embed when tied.
  const Tensor& output_embedding() const { return tied ? embed : lm_head; }
  /// Number of scalar parameters held (embed counted once when tied).
  int64_t parameter_count() const;
};

/// Loads and normalises every tensor of the checkpoint in `dir` (model.safetensors or a sharded
/// model.safetensors.index.json), converting bf16/f16/f32 to fp32. Detects the layout by the tensor
/// names present. Throws std::runtime_error naming the tensor and the expected and found shapes when
/// a tensor is missing or mis-shaped, and naming the file for unreadable / corrupt safetensors.
/// Unused tensors other than `mtp.*` / `model.visual.*` are an error too (they signal a config that
/// does not match the checkpoint).
ModelWeights load_weights(const ModelConfig& cfg, const std::filesystem::path& dir);

/// One top-level group of ModelWeights as load_weights_streaming hands it over.
struct WeightsPart {
  enum class Kind {
    Embed,      ///< `tensor` = ModelWeights::embed [V, H]
    FinalNorm,  ///< `tensor` = ModelWeights::final_norm [H]
    LmHead,     ///< `tensor` = ModelWeights::lm_head [V, H]; never sent when tie_word_embeddings
    Layer,      ///< `weights` = ModelWeights::layers[layer] (type / is_moe set, exactly as load_weights fills it)
  };
  Kind kind = Kind::Embed;
  int layer = -1;         ///< Layer: the decoder layer's index; -1 otherwise
  Tensor tensor;          ///< Embed / FinalNorm / LmHead; empty for Layer
  LayerWeights weights;   ///< Layer; default (all empty) otherwise
};

/// Receives each part; it may keep it (move from it) or drop it. An exception thrown by the sink stops the load and
/// propagates unchanged.
using WeightsSink = std::function<void(WeightsPart&&)>;

/// The loader behind load_weights, handing the weights over part by part instead of collecting them: Embed,
/// FinalNorm, LmHead (unless tied), then Layer 0, 1, ..., num_hidden_layers - 1, in this order, each part converted
/// and normalised exactly as load_weights would store it (the same code: load_weights is this plus a collecting
/// sink). Only the part being built is held (a layer's tensors in fp32; Qwen3-Next's grouped in_proj_qkvz /
/// in_proj_ba also briefly as read, before regrouping), plus the memory mappings of the safetensors files.
/// Errors are load_weights's, raised at the same point of the load: a missing / mis-shaped tensor throws before the
/// part holding it is sent (earlier parts have been sent); the check for unused tensors runs after the last layer
/// was sent, so a sink can have consumed every part of a checkpoint that then fails with "has tensors the config
/// does not use".
void load_weights_streaming(const ModelConfig& cfg, const std::filesystem::path& dir, const WeightsSink& sink);

/// What a checkpoint tensor is, which decides how `init` draws it (write_random_checkpoint).
enum class TensorRole {
  Matrix,           ///< projection / embedding: N(0, std)
  ZeroCentredNorm,  ///< RMSNorm weight applied as 1 + w: N(0, 0.05)
  GatedNorm,        ///< RMSNorm weight applied as w (the gated norms; every norm of the non-Qwen families): 1 + N(0, 0.05)
  ALog,             ///< log(U(1, 16)) (decay rates A in [1, 16])
  DtBias,           ///< ones (HF init)
  Conv,             ///< depthwise conv taps: U(-1/sqrt(K), 1/sqrt(K)) (PyTorch's default for Conv1d)
};

/// One tensor of a checkpoint: name, shape, role.
struct CheckpointTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorRole role = TensorRole::Matrix;
};

/// The tensors transformers 5.17 `save_pretrained` writes for this config (for Kimi-Linear, MiniMax and Ring: the
/// released checkpoints' names, see engine/families/<family>/weights.h), in order: prefix `model.`
/// (`model.language_model.` for the nested types qwen3_5 / qwen3_5_moe), MoE experts per expert
/// (`mlp.experts.{e}.{gate,up,down}_proj.weight`), Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba`,
/// Qwen3.5's flat `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`, conv1d [conv_dim, 1, K],
/// `lm_head.weight` unless tied. load_weights accepts exactly this layout (among others).
std::vector<CheckpointTensorSpec> hf_checkpoint_layout(const ModelConfig& cfg);

/// Writes a deterministic random checkpoint to `dir` (created if needed): config.json
/// (config_to_json) and model.safetensors in the hf_checkpoint_layout, values stored as `dtype`
/// (F32 or BF16; F16 also accepted). Matrices are N(0, std) (HF's initializer_range is 0.02); other roles
/// as TensorRole says. Value j of a tensor depends only on (seed, tensor name, j): the same arguments give
/// the same bytes on any thread count. Memory: one tensor at a time. Throws std::invalid_argument for a
/// bad dtype or std, std::runtime_error for I/O errors.
void write_random_checkpoint(const ModelConfig& cfg, uint64_t seed, const std::filesystem::path& dir,
                             DType dtype = DType::BF16, double std = 0.02);

/// The seed of a checkpoint that write_random_checkpoint made (`hypic-model init`): the "hypic_init_seed"
/// entry of the safetensors __metadata__ of any of its files, or nullopt for every other checkpoint (trained
/// weights). Such weights are random: text generated from them, and agreement figures measured on them, mean
/// nothing about a trained model. Reads only the headers. Throws what Checkpoint::open throws (unreadable or
/// invalid files, no safetensors in `dir`).
std::optional<std::string> random_init_seed(const std::filesystem::path& dir);

/// Per-head decay rates s_h (per-token decay e^{-s_h}) of lightning layer `layer` (0-based over all layers), fp32:
///  - MiniMax (MiniMaxLightningAttention.get_slope_rate): s_h = (2^(-8/nh))^(h+1) * (1 - layer/(L - 1 + 1e-5) + 1e-5);
///  - Ring (BailingMoeV2 linear attention, docs/research/hybrid_models.md 3.3): ALiBi slopes of nh heads (the
///    power-of-two construction for other nh) times (1 - (layer - 1)/(L - 1) + 1e-5).
/// Throws std::invalid_argument for a family without lightning layers or a bad layer.
std::vector<float> lightning_slope_rates(const ModelConfig& cfg, int layer);

/// Number of parameters the config implies (total, and active per token: embeddings, attention,
/// norms, router, shared expert, top-k routed experts, LM head; embed counted once when tied).
struct ParameterCounts {
  int64_t total = 0;
  int64_t active_per_token = 0;
};
ParameterCounts count_parameters(const ModelConfig& cfg);

/// Counted FLOPs of one causal forward pass of `tokens` new tokens from an empty context, no LM head: 2 per active
/// body parameter per token (count_parameters less the embedding and LM head) plus causal attention, 2 nh (d_qk +
/// d_v) per (query, key) pair over tokens^2 / 2 pairs in each full-attention layer (as bench/gpu/prefill_bench.cpp
/// counts them). The scans' own FLOPs, norms and elementwise work are not counted. A cost estimate for comparing
/// plans of the same model (the combine worker's staged-cold policy), not a measurement. 0 for tokens <= 0.
double forward_flops(const ModelConfig& cfg, int64_t tokens);

}  // namespace hypic::engine
