// libFuzzer target: the safetensors reader (engine/checkpoint/safetensors.h, SafetensorsFile::open).
//
// Feeds: the input bytes as a whole safetensors file (an in-memory memfd opened by path).
// Asserts, beyond "no crash, no leak, no UB":
//  - open() fails only with std::runtime_error (the documented error, naming the file);
//  - an accepted file's tensors tile its data buffer exactly, and each tensor's bytes() lie inside the mapping and
//    hold numel * dtype_size bytes;
//  - every float tensor converts with read_f32 and every integer tensor with read_i64 to numel values;
//  - round trip: the tensors and __metadata__ written back with SafetensorsWriter and reopened give the same names,
//    dtypes, shapes and bytes.
// Seeds (scripts/fuzz.sh): the fixtures' safetensors files cut down to their first tensors.
#include <unistd.h>

#include <cstring>
#include <map>

#include "engine/checkpoint/safetensors.h"
#include "tests/fuzz/fuzz_common.h"

using namespace hypic::engine;

namespace {
std::filesystem::path scratch_file() {
  static const std::filesystem::path p = [] {
    auto d = std::filesystem::temp_directory_path() / ("hypic-fuzz-safetensors-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d / "roundtrip.safetensors";
  }();
  return p;
}

bool is_float(DType d) { return d == DType::F32 || d == DType::F16 || d == DType::BF16 || d == DType::F64; }
bool is_int(DType d) {
  return d == DType::I64 || d == DType::I32 || d == DType::I16 || d == DType::I8 || d == DType::U8 || d == DType::BOOL;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const hypic::fuzz::MemFile mem(std::string_view(reinterpret_cast<const char*>(data), size));
  std::optional<SafetensorsFile> f;
  try {
    f.emplace(SafetensorsFile::open(mem.path()));
  } catch (const std::runtime_error&) {
    return 0;
  }
  FUZZ_CHECK(f->file_size() == size, "file size");
  uint64_t covered = 0;
  for (const TensorInfo& t : f->tensors()) {
    const auto b = f->bytes(t);
    FUZZ_CHECK(t.numel() >= 0, t.name);
    FUZZ_CHECK(b.size() == uint64_t(t.numel()) * dtype_size(t.dtype), t.name + ": byte size vs numel");
    FUZZ_CHECK(b.data() >= f->data().data() && b.data() + b.size() <= f->data().data() + f->data().size(),
               t.name + ": bytes outside the data buffer");
    FUZZ_CHECK(f->find(t.name) == &t, t.name + ": find");
    covered += b.size();
    if (is_float(t.dtype)) FUZZ_CHECK(f->read_f32(t).size() == size_t(t.numel()), t.name + ": read_f32");
    if (is_int(t.dtype)) FUZZ_CHECK(f->read_i64(t).size() == size_t(t.numel()), t.name + ": read_i64");
  }
  FUZZ_CHECK(covered == f->data_size(), "tensors do not cover the data buffer");

  SafetensorsWriter w;
  for (const TensorInfo& t : f->tensors()) {
    const auto b = f->bytes(t);
    w.add(t.name, t.dtype, t.shape, [b](uint8_t* dst) {
      if (!b.empty()) std::memcpy(dst, b.data(), b.size());
    });
  }
  for (const auto& [k, v] : f->metadata()) w.set_metadata(k, v);
  w.write(scratch_file());
  const SafetensorsFile g = SafetensorsFile::open(scratch_file());
  FUZZ_CHECK(g.tensors().size() == f->tensors().size(), "round trip: tensor count");
  FUZZ_CHECK(g.metadata() == f->metadata(), "round trip: metadata");
  for (const TensorInfo& t : f->tensors()) {
    const TensorInfo* u = g.find(t.name);
    FUZZ_CHECK(u && u->dtype == t.dtype && u->shape == t.shape, "round trip: " + t.name);
    const auto a = f->bytes(t), b = g.bytes(*u);
    FUZZ_CHECK(a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0),
               "round trip bytes: " + t.name);
  }
  return 0;
}
