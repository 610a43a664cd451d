// Device discovery and entry sizes (engine/backend.h); the model-free part is in backend_ids.cpp, the factory that
// dispatches to the CPU and CUDA backends in backend_factory.cpp.
#include "engine/backend.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/cpu/cpu_backend.h"
#include "engine/sampling.h"

#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hypic::engine {

SpliceShape splice_shape(const SplicePlan& plan) { return shape_of_request(plan); }

bool cuda_available() {
#if defined(HYPIC_WITH_CUDA) && HYPIC_WITH_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

std::optional<DeviceBlock> Backend::device_block(const ResidentEntry&) const { return std::nullopt; }

void Backend::check_step_rows(size_t batch, std::span<const uint8_t> modes, std::span<const SampleDraw> draws) {
  if (modes.size() != batch)
    throw std::invalid_argument("decode_step: " + std::to_string(batch) + " sequences but " +
                                std::to_string(modes.size()) + " row modes");
  bool sampling = false;
  for (size_t b = 0; b < batch; ++b) {
    if (modes[b] > kStepSample)
      throw std::invalid_argument("decode_step: row " + std::to_string(b) + " has mode " + std::to_string(modes[b]) +
                                  " (0 greedy, 1 logits, 2 sample)");
    sampling |= modes[b] == kStepSample;
  }
  if (!sampling) return;
  if (draws.size() != batch)
    throw std::invalid_argument("decode_step: " + std::to_string(batch) + " sequences but " +
                                std::to_string(draws.size()) + " draws for the sampling rows");
  for (size_t b = 0; b < batch; ++b) {
    if (modes[b] != kStepSample) continue;
    const SampleDraw& d = draws[b];
    const std::string row = "decode_step: row " + std::to_string(b) + ": ";
    if (!std::isfinite(d.temperature) || d.temperature <= 0.0f)
      throw std::invalid_argument(row + "temperature must be a finite number > 0, got " + std::to_string(d.temperature));
    if (d.top_k < 0) throw std::invalid_argument(row + "top_k must be >= 0, got " + std::to_string(d.top_k));
    if (!(d.top_p > 0.0f && d.top_p <= 1.0f))
      throw std::invalid_argument(row + "top_p must be in (0, 1], got " + std::to_string(d.top_p));
    if (!(d.u >= 0.0 && d.u < 1.0)) throw std::invalid_argument(row + "u must be in [0, 1), got " + std::to_string(d.u));
  }
}

void Backend::decode_step(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                          std::span<const uint8_t> modes, DecodeStepOutput& out, std::span<const SampleDraw> draws) {
  check_step_rows(sequences.size(), modes, draws);
  std::vector<float> all;
  decode(sequences, tokens, all);
  const size_t B = sequences.size(), V = B ? all.size() / B : 0;
  out.argmax.assign(B, -1);
  out.logits.clear();
  for (size_t b = 0; b < B; ++b) {
    const std::span<const float> row(all.data() + b * V, V);
    if (modes[b] == kStepLogits) {
      out.logits.insert(out.logits.end(), row.begin(), row.end());
      continue;
    }
    if (modes[b] == kStepSample) {
      out.argmax[b] = sample_row(row, draws[b]);
      continue;
    }
    const auto nan = std::find_if(row.begin(), row.end(), [](float v) { return std::isnan(v); });
    out.argmax[b] = nan != row.end() ? nan_logits_code(int32_t(nan - row.begin())) : argmax(row);
  }
}

int32_t Backend::sample_row(std::span<const float> logits, const SampleDraw& d) {
  const auto nan = std::find_if(logits.begin(), logits.end(), [](float v) { return std::isnan(v); });
  if (nan != logits.end()) return nan_logits_code(int32_t(nan - logits.begin()));
  float mx = -INFINITY;
  for (const float v : logits) mx = std::max(mx, v);
  if (!std::isfinite(mx)) return kNoFiniteLogitCode;  // (Sampler::pick would throw "no finite logit")
  SamplingConfig cfg;
  cfg.temperature = d.temperature, cfg.top_k = d.top_k, cfg.top_p = d.top_p;
  return Sampler::pick(logits, cfg, d.u);
}

std::pair<std::shared_ptr<const ResidentEntry>, DeviceBlock> Backend::allocate_entry(const SegmentEntry&) const {
  throw std::logic_error("allocate_entry: the " + std::string(numerics()) +
                         " backend keeps entries in host memory (no device entries to receive into)");
}

namespace {
[[noreturn]] void no_host_blocks(const Backend& b, const char* what) {
  throw std::logic_error(std::string(what) + ": the " + std::string(b.numerics()) +
                         " backend keeps entries in host memory (no host blocks)");
}
}  // namespace

std::shared_ptr<const HostBlock> Backend::copy_to_host(const ResidentEntry&) const { no_host_blocks(*this, "copy_to_host"); }
std::shared_ptr<const ResidentEntry> Backend::import_block(const HostBlock&) const { no_host_blocks(*this, "import_block"); }
std::shared_ptr<const SegmentEntry> Backend::entry_of_block(const HostBlock&) const {
  no_host_blocks(*this, "entry_of_block");
}
std::shared_ptr<const HostBlock> Backend::block_of_entry(const SegmentEntry&) const {
  no_host_blocks(*this, "block_of_entry");
}

std::optional<WireBlock> Backend::wire_block(const SegmentEntry&, const WireShape&) const { return std::nullopt; }

std::string Backend::wire_of_block(const HostBlock& block) const { return serialize_entry(*entry_of_block(block)); }

void Backend::write_wire_of_block(const HostBlock& block, const std::function<void(uint64_t)>& begin,
                                  const std::function<void(std::string_view)>& out) const {
  const std::string bytes = wire_of_block(block);
  begin(bytes.size());
  out(bytes);
}

EntryReceiver::EntryReceiver(const Backend& backend, EntryReaderChecks checks)
    : reader_([&] {
        if (backend.device_entries()) {
          checks.destination = [this, &backend](const SegmentEntry& header, const WireShape& shape) {
            block_ = backend.wire_block(header, shape);
            return block_ ? block_->regions : std::vector<std::span<char>>{};
          };
        }
        return std::move(checks);
      }()) {}

EntryReceiver::Received EntryReceiver::finish() {
  Received r;
  r.entry = std::make_shared<const SegmentEntry>(reader_.finish());
  if (reader_.laid_out()) r.block = std::move(block_->block);
  return r;
}

std::string Backend::wire_of(const ResidentEntry& entry) const {
  return device_entries() ? wire_of_block(*copy_to_host(entry)) : serialize_entry(*entry.host());
}

size_t Backend::entry_bytes(int64_t tokens) const { return wire_entry_bytes(config(), tokens); }

size_t wire_entry_bytes(const ModelConfig& config, int64_t tokens) {
  // The fp32 wire form's tensors (engine/segment.h) of an entry with a seam (w > 0): per linear layer T_int, S_seam and
  // S_int, transitions counted dense (an upper bound for the families whose entries keep T_C compact, and for w = 0
  // entries, which have no S_seam), the conv tail, and K/V, both counted fp32 (an upper bound too: a CUDA backend's
  // entries carry them as bf16): K [n][kv_heads][head_dim], V [n][kv_heads][v_dim()] (MLA: the latent, no V).
  const EntryGeometry g = EntryGeometry::of(config);
  const size_t lin = size_t(g.linear_heads) * (size_t(g.d_k) * g.d_k + 2 * size_t(g.d_k) * g.d_v) +
                     size_t(g.conv_rows) * g.conv_dim;
  const size_t attn = size_t(std::max<int64_t>(tokens, 0)) * g.kv_heads * (size_t(g.head_dim) + size_t(g.v_dim()));
  return (size_t(g.num_linear) * lin + size_t(g.num_attention) * attn) * sizeof(float);
}

DeviceSpec default_device() { return cuda_available() ? DeviceSpec{BackendKind::Cuda, 0} : DeviceSpec{}; }


}  // namespace hypic::engine
