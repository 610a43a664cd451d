#include "engine/transition.h"

#include <cblas.h>

#include <cstring>
#include <stdexcept>

namespace hypic::engine {
namespace {

void check_state(std::span<const float> state, int heads, int d_k, int d_v, const char* what) {
  const size_t want = static_cast<size_t>(heads) * d_k * d_v;
  if (d_v <= 0 || state.size() != want) {
    throw std::invalid_argument(std::string(what) + ": state has " + std::to_string(state.size()) +
                                " floats, expected heads*d_k*d_v = " + std::to_string(heads) + "*" +
                                std::to_string(d_k) + "*" + std::to_string(d_v));
  }
}

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
T get(std::string_view bytes, size_t* off, const char* field) {
  if (bytes.size() < *off + sizeof(T)) {
    throw std::runtime_error(std::string("transition operator truncated while reading ") + field + " at byte " +
                             std::to_string(*off) + " of " + std::to_string(bytes.size()));
  }
  T v;
  std::memcpy(&v, bytes.data() + *off, sizeof(T));
  *off += sizeof(T);
  return v;
}

}  // namespace

const char* transition_kind_name(TransitionKind kind) {
  switch (kind) {
    case TransitionKind::Scalar: return "scalar";
    case TransitionKind::Diagonal: return "diagonal";
    case TransitionKind::Dense: return "dense";
  }
  return "unknown";
}

size_t TransitionOperator::per_head() const {
  switch (kind) {
    case TransitionKind::Scalar: return 1;
    case TransitionKind::Diagonal: return static_cast<size_t>(d_k);
    case TransitionKind::Dense: return static_cast<size_t>(d_k) * d_k;
  }
  throw std::invalid_argument("unknown transition kind");
}

TransitionOperator TransitionOperator::identity(TransitionKind kind, int heads, int d_k) {
  if (heads <= 0 || d_k <= 0) throw std::invalid_argument("transition identity: heads and d_k must be positive");
  TransitionOperator t{kind, heads, d_k, {}};
  t.data.assign(static_cast<size_t>(heads) * t.per_head(), kind == TransitionKind::Dense ? 0.0f : 1.0f);
  if (kind == TransitionKind::Dense) {
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d_k; ++i) t.data[(static_cast<size_t>(h) * d_k + i) * d_k + i] = 1.0f;
  }
  return t;
}

TransitionOperator TransitionOperator::dense(int heads, int d_k, std::vector<float> data) {
  if (heads <= 0 || d_k <= 0 || data.size() != static_cast<size_t>(heads) * d_k * d_k) {
    throw std::invalid_argument("dense transition: got " + std::to_string(data.size()) + " floats for heads=" +
                                std::to_string(heads) + " d_k=" + std::to_string(d_k));
  }
  return TransitionOperator{TransitionKind::Dense, heads, d_k, std::move(data)};
}

TransitionOperator TransitionOperator::wrap(TransitionKind kind, int heads, int d_k, std::vector<float> data) {
  if (kind == TransitionKind::Dense) return dense(heads, d_k, std::move(data));
  TransitionOperator t{kind, heads, d_k, {}};
  if (heads <= 0 || d_k <= 0 || data.size() != static_cast<size_t>(heads) * t.per_head()) {
    throw std::invalid_argument(std::string(transition_kind_name(kind)) + " transition: got " +
                                std::to_string(data.size()) + " floats for heads=" + std::to_string(heads) +
                                " d_k=" + std::to_string(d_k));
  }
  t.data = std::move(data);
  return t;
}

std::vector<float> TransitionOperator::to_dense() const {
  if (kind == TransitionKind::Dense) return data;
  std::vector<float> out(static_cast<size_t>(heads) * d_k * d_k, 0.0f);
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < d_k; ++i)
      out[(static_cast<size_t>(h) * d_k + i) * d_k + i] =
          kind == TransitionKind::Scalar ? data[h] : data[static_cast<size_t>(h) * d_k + i];
  return out;
}

void TransitionOperator::apply(std::span<float> state, int d_v) const {
  check_state(state, heads, d_k, d_v, "transition apply");
  const size_t hs = static_cast<size_t>(d_k) * d_v;
  if (kind == TransitionKind::Scalar) {
    for (int h = 0; h < heads; ++h) {
      float* s = state.data() + h * hs;
      for (size_t i = 0; i < hs; ++i) s[i] *= data[h];
    }
  } else if (kind == TransitionKind::Diagonal) {
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d_k; ++i) {
        const float g = data[static_cast<size_t>(h) * d_k + i];
        float* row = state.data() + h * hs + static_cast<size_t>(i) * d_v;
        for (int j = 0; j < d_v; ++j) row[j] *= g;
      }
  } else {
    std::vector<float> tmp(hs);
    for (int h = 0; h < heads; ++h) {
      float* s = state.data() + h * hs;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d_k, d_v, d_k, 1.0f,
                  data.data() + static_cast<size_t>(h) * d_k * d_k, d_k, s, d_v, 0.0f, tmp.data(), d_v);
      std::memcpy(s, tmp.data(), hs * sizeof(float));
    }
  }
}

TransitionOperator TransitionOperator::then(const TransitionOperator& later) const {
  if (later.heads != heads || later.d_k != d_k) {
    throw std::invalid_argument("transition compose: shapes differ (heads " + std::to_string(heads) + " vs " +
                                std::to_string(later.heads) + ", d_k " + std::to_string(d_k) + " vs " +
                                std::to_string(later.d_k) + ")");
  }
  if (kind == later.kind && kind != TransitionKind::Dense) {
    TransitionOperator out = *this;  // scalar and diagonal operators commute: elementwise product
    for (size_t i = 0; i < out.data.size(); ++i) out.data[i] *= later.data[i];
    return out;
  }
  const std::vector<float> a = later.to_dense();  // applied second: left factor
  const std::vector<float> b = to_dense();
  TransitionOperator out{TransitionKind::Dense, heads, d_k, std::vector<float>(a.size())};
  const size_t hs = static_cast<size_t>(d_k) * d_k;
  for (int h = 0; h < heads; ++h) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d_k, d_k, d_k, 1.0f, a.data() + h * hs, d_k,
                b.data() + h * hs, d_k, 0.0f, out.data.data() + h * hs, d_k);
  }
  return out;
}

void compose_state(std::span<float> state, const TransitionOperator& transition, std::span<const float> seg_state,
                   int d_v) {
  check_state(seg_state, transition.heads, transition.d_k, d_v, "compose_state (segment state)");
  transition.apply(state, d_v);
  for (size_t i = 0; i < state.size(); ++i) state[i] += seg_state[i];
}

void serialize_transition(const TransitionOperator& t, std::string& out) {
  put<uint8_t>(out, static_cast<uint8_t>(t.kind));
  put<uint32_t>(out, static_cast<uint32_t>(t.heads));
  put<uint32_t>(out, static_cast<uint32_t>(t.d_k));
  put<uint64_t>(out, static_cast<uint64_t>(t.data.size()));
  out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
}

TransitionOperator deserialize_transition(std::string_view bytes, size_t* offset) {
  TransitionOperator t;
  const auto kind = get<uint8_t>(bytes, offset, "kind");
  if (kind < 1 || kind > 3) throw std::runtime_error("transition operator: unknown kind " + std::to_string(kind));
  t.kind = static_cast<TransitionKind>(kind);
  t.heads = static_cast<int>(get<uint32_t>(bytes, offset, "heads"));
  t.d_k = static_cast<int>(get<uint32_t>(bytes, offset, "d_k"));
  const auto count = get<uint64_t>(bytes, offset, "count");
  if (t.heads <= 0 || t.d_k <= 0 || t.d_k > 65536 || count != static_cast<uint64_t>(t.heads) * t.per_head()) {
    throw std::runtime_error("transition operator: inconsistent sizes (kind " +
                             std::string(transition_kind_name(t.kind)) + ", heads " + std::to_string(t.heads) +
                             ", d_k " + std::to_string(t.d_k) + ", count " + std::to_string(count) + ")");
  }
  if (bytes.size() - *offset < count * sizeof(float)) {
    throw std::runtime_error("transition operator truncated: need " + std::to_string(count * sizeof(float)) +
                             " data bytes, have " + std::to_string(bytes.size() - *offset));
  }
  t.data.resize(count);
  std::memcpy(t.data.data(), bytes.data() + *offset, count * sizeof(float));
  *offset += count * sizeof(float);
  return t;
}

}  // namespace hypic::engine
