// Internal helpers of the weights loaders (engine/checkpoint/weights.cpp and each family's
// engine/families/<family>/weights.cpp): a checkpoint reader that checks every tensor's shape, names the tensor in
// every error and remembers which tensors were used, and the sink the checkpoint layouts are written into. Not a
// public API.
#pragma once
#include <cstdint>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/checkpoint/config.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/weights.h"

namespace hypic::engine::weights_detail {

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

inline int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

/// Reads checkpoint tensors by name, checking shapes, and remembers which names were used.
class Reader {
 public:
  explicit Reader(const std::filesystem::path& dir) : ck_(Checkpoint::open(dir)), dir_(dir) {}

  bool has(const std::string& name) const { return ck_.contains(name); }

  /// The tensor `name`, which must have shape `want`; stored with shape `keep` (default: want).
  Tensor take(const std::string& name, const std::vector<int64_t>& want, std::vector<int64_t> keep = {}) {
    Tensor t;
    t.shape = keep.empty() ? want : std::move(keep);
    t.data.resize(size_t(product(want)));
    take_into(name, want, t.data.data());
    return t;
  }

  /// Like take(), but accepts any of `shapes` (same element count) and stores it as `keep`.
  Tensor take_any(const std::string& name, const std::vector<std::vector<int64_t>>& shapes, std::vector<int64_t> keep) {
    const TensorInfo& info = lookup(name, shapes.front());
    for (const auto& s : shapes)
      if (info.shape == s) return take(name, s, std::move(keep));
    std::string options;
    for (const auto& s : shapes) options += (options.empty() ? "" : " or ") + shape_text(s);
    throw mismatch(info, options);
  }

  /// Converts tensor `name` (shape `want`) to fp32 at dst.
  void take_into(const std::string& name, const std::vector<int64_t>& want, float* dst) {
    const TensorInfo& info = lookup(name, want);
    if (info.shape != want) throw mismatch(info, shape_text(want));
    ck_.file_of(name).read_f32_into(info, dst);
    used_.insert(name);
  }

  void ignore(const std::string& name) { used_.insert(name); }

  /// Throws if the checkpoint holds tensors nobody read, other than mtp.* / model.visual.* / RoPE buffers.
  void check_all_used() const {
    std::vector<std::string> extra;
    for (const auto& n : ck_.names()) {
      if (used_.count(n) || n.starts_with("mtp.") || n.starts_with("model.visual.") ||
          n.ends_with("rotary_emb.inv_freq"))
        continue;
      extra.push_back(n);
    }
    if (extra.empty()) return;
    std::string list;
    for (size_t i = 0; i < extra.size() && i < 8; ++i) list += (i ? ", " : "") + extra[i];
    if (extra.size() > 8) list += ", ... (" + std::to_string(extra.size()) + " in all)";
    throw std::runtime_error("checkpoint " + dir_.string() + " has tensors the config does not use: " + list +
                             " (config and checkpoint disagree)");
  }

 private:
  const TensorInfo& lookup(const std::string& name, const std::vector<int64_t>& want) const {
    const TensorInfo* info = ck_.find(name);
    if (!info)
      throw std::runtime_error("checkpoint " + dir_.string() + ": missing tensor '" + name + "' (expected shape " +
                               shape_text(want) + ")");
    return *info;
  }
  std::runtime_error mismatch(const TensorInfo& info, const std::string& want) const {
    return std::runtime_error("checkpoint " + dir_.string() + ": tensor '" + info.name + "' has shape " +
                              info.shape_str() + " (" + std::string(dtype_name(info.dtype)) + "), expected " + want);
  }

  Checkpoint ck_;
  std::filesystem::path dir_;
  std::set<std::string> used_;
};

/// Collects the tensor specs of a checkpoint layout (hf_checkpoint_layout: each family's checkpoint_layout).
struct LayoutSink {
  int64_t hidden = 0;  ///< H, the input width of the MLP projections
  std::vector<CheckpointTensorSpec> specs;
  /// Appends one tensor `name` of `shape` (row-major, as stored) with its initialisation role.
  void operator()(std::string name, std::vector<int64_t> shape, TensorRole role = TensorRole::Matrix) {
    specs.push_back({std::move(name), std::move(shape), role});
  }
  /// A SwiGLU MLP of width I under prefix p: gate_proj, up_proj [I, H] and down_proj [H, I] (".weight").
  void mlp(const std::string& p, int64_t I) {
    (*this)(p + "gate_proj.weight", {I, hidden});
    (*this)(p + "up_proj.weight", {I, hidden});
    (*this)(p + "down_proj.weight", {hidden, I});
  }
};

}  // namespace hypic::engine::weights_detail
