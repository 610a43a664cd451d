// Model weights in ONE internal fp32 layout, whatever layout the checkpoint used:
//  - transformers 5.17 save_pretrained (fused experts `mlp.experts.gate_up_proj` [E,2I,H] and
//    `mlp.experts.down_proj` [E,H,I]; `model.` prefix),
//  - released checkpoints (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`; Qwen3.5's
//    `model.language_model.` prefix; Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba`).
// `mtp.*` and `model.visual.*` tensors are ignored. All matrices are row-major [out][in] like
// torch.nn.Linear.weight, so y = W x is a GEMM with W's rows as outputs.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/safetensors.h"

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

/// Dense SwiGLU MLP: down(silu(gate x) * up x). I = its intermediate width.
struct MlpWeights {
  Tensor gate_proj;  ///< [I, H]
  Tensor up_proj;    ///< [I, H]
  Tensor down_proj;  ///< [H, I]
};

/// Sparse MoE block (Qwen3NextSparseMoeBlock): softmax router, top-k routed experts, plus a shared
/// expert gated by sigmoid(shared_expert_gate x). E experts of width I, shared width Is.
struct MoeWeights {
  Tensor router;              ///< [E, H]  (checkpoint `mlp.gate.weight`)
  Tensor experts_gate_up;     ///< [E, 2I, H]  per expert: I gate rows first, then I up rows
  Tensor experts_down;        ///< [E, H, I]
  MlpWeights shared_expert;   ///< gate/up [Is, H], down [H, Is]; all empty when Is == 0
  Tensor shared_expert_gate;  ///< [1, H]; empty when Is == 0
};

/// One decoder layer. Exactly one of {linear, attention} is filled (by `type`), and exactly one of
/// {moe, mlp} (by `is_moe`).
struct LayerWeights {
  LayerType type = LayerType::Linear;
  bool is_moe = false;
  Tensor input_layernorm;           ///< [H] zero-centred (1 + w)
  Tensor post_attention_layernorm;  ///< [H] zero-centred (1 + w)
  LinearAttnWeights linear;
  AttentionWeights attention;
  MoeWeights moe;
  MlpWeights mlp;
};

/// All weights of a model, fp32, in the internal layout above.
struct ModelWeights {
  Tensor embed;       ///< [V, H]  (`model.embed_tokens.weight`)
  Tensor final_norm;  ///< [H] zero-centred (1 + w)  (`model.norm.weight`)
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
  GatedNorm,        ///< gated RMSNorm weight applied as w: 1 + N(0, 0.05)
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

/// The tensors transformers 5.17 `save_pretrained` writes for this config, in order: prefix `model.`
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

/// Number of parameters the config implies (total, and active per token: embeddings, attention,
/// norms, router, shared expert, top-k routed experts, LM head; embed counted once when tied).
struct ParameterCounts {
  int64_t total = 0;
  int64_t active_per_token = 0;
};
ParameterCounts count_parameters(const ModelConfig& cfg);

}  // namespace hypic::engine
