// safetensors reader/writer: dtype conversions against hand-computed IEEE bit patterns, exhaustive
// round trips over all 16-bit patterns, writer -> reader round trip, sharded checkpoints, and the errors
// for corrupt / truncated files.
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "engine/checkpoint/safetensors.h"

using namespace hypic::engine;
namespace fs = std::filesystem;

namespace {

/// A fresh empty folder under the build tree for one test case.
fs::path scratch(const std::string& name) {
  const fs::path p = fs::path(HYPIC_BINARY_DIR) / "test_scratch" / "safetensors" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

/// A safetensors file from a literal header and data buffer (to build malformed files).
void write_raw(const fs::path& p, const std::string& header, const std::string& data, uint64_t declared_len) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(&declared_len), 8);
  f << header << data;
}
void write_raw(const fs::path& p, const std::string& header, const std::string& data) {
  write_raw(p, header, data, header.size());
}

float bits_f(uint32_t u) { return std::bit_cast<float>(u); }

}  // namespace

TEST_CASE("bf16 <-> fp32 bit patterns", "[safetensors]") {
  CHECK(bf16_to_f32(0x3F80) == 1.0f);
  CHECK(bf16_to_f32(0xC000) == -2.0f);
  CHECK(bf16_to_f32(0x4049) == 3.140625f);  // 0x40490000
  CHECK(std::isinf(bf16_to_f32(0x7F80)));
  CHECK(bf16_to_f32(0x0001) == std::ldexp(1.0f, -133));  // smallest subnormal
  CHECK(std::isnan(bf16_to_f32(0x7FC0)));

  CHECK(f32_to_bf16(1.0f) == 0x3F80);
  CHECK(f32_to_bf16(bits_f(0x3F808000)) == 0x3F80);                 // exact tie -> even (0x3F80)
  CHECK(f32_to_bf16(bits_f(0x3F818000)) == 0x3F82);                 // exact tie -> even (0x3F82)
  CHECK(f32_to_bf16(bits_f(0x3F808001)) == 0x3F81);                 // just above the tie -> up
  CHECK(f32_to_bf16(bits_f(0x3F807FFF)) == 0x3F80);                 // just below -> down
  CHECK(f32_to_bf16(bits_f(0xBF818000)) == 0xBF82);                 // sign kept
  CHECK(f32_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // rounds to +Inf
  CHECK(f32_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  const uint16_t nan = f32_to_bf16(bits_f(0x7F800001));  // signalling NaN whose payload is all below bit 16
  CHECK((nan & 0x7F80) == 0x7F80);
  CHECK((nan & 0x007F) != 0);  // still a NaN, not Inf

  // Every non-NaN bf16 value survives bf16 -> fp32 -> bf16.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    if (f32_to_bf16(f) != h) FAIL("bf16 round trip failed for 0x" << std::hex << h);
  }
}

TEST_CASE("f16 <-> fp32 bit patterns", "[safetensors]") {
  CHECK(f16_to_f32(0x3C00) == 1.0f);
  CHECK(f16_to_f32(0xC000) == -2.0f);
  CHECK(f16_to_f32(0x7BFF) == 65504.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f16_to_f32(0x0400) == std::ldexp(1.0f, -14));
  CHECK(f16_to_f32(0x03FF) == std::ldexp(1023.0f, -24));
  CHECK(f16_to_f32(0x3555) == 0.333251953125f);
  CHECK(std::isinf(f16_to_f32(0x7C00)));
  CHECK(f16_to_f32(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(f16_to_f32(0x7E00)));
  CHECK(std::signbit(f16_to_f32(0x8000)));
  CHECK(f16_to_f32(0x8000) == 0.0f);

  CHECK(f32_to_f16(1.0f) == 0x3C00);
  CHECK(f32_to_f16(65504.0f) == 0x7BFF);
  CHECK(f32_to_f16(65519.0f) == 0x7BFF);  // below the halfway point to 65536
  CHECK(f32_to_f16(65520.0f) == 0x7C00);  // halfway, odd mantissa -> rounds to Inf
  CHECK(f32_to_f16(1e10f) == 0x7C00);
  CHECK(f32_to_f16(-1e10f) == 0xFC00);
  CHECK(f32_to_f16(0.1f) == 0x2E66);
  CHECK(f32_to_f16(1.0f / 3.0f) == 0x3555);
  CHECK(f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);     // smallest subnormal
  CHECK(f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);     // half of it: tie -> even (0)
  CHECK(f32_to_f16(std::ldexp(3.0f, -26)) == 0x0001);     // 0.75 ulp -> 1
  CHECK(f32_to_f16(std::ldexp(3.0f, -25)) == 0x0002);     // 1.5 ulp: tie -> even (2)
  CHECK(f32_to_f16(std::ldexp(5.0f, -25)) == 0x0002);     // 2.5 ulp: tie -> even (2)
  CHECK(f32_to_f16(std::ldexp(2047.0f, -25)) == 0x0400);  // 1023.5 ulp rounds up into the first normal
  CHECK(f32_to_f16(std::ldexp(1.0f, -26)) == 0x0000);
  CHECK(f32_to_f16(-0.0f) == 0x8000);
  CHECK(f32_to_f16(bits_f(0x3F801000)) == 0x3C00);  // 1 + 2^-11 (half an ulp): tie -> even (1.0)
  CHECK(f32_to_f16(bits_f(0x3F803000)) == 0x3C02);  // 1 + 1.5 ulp: tie -> even (0x3C02)
  CHECK((f32_to_f16(std::numeric_limits<float>::quiet_NaN()) & 0x7E00) == 0x7E00);

  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    if (f32_to_f16(f) != h) FAIL("f16 round trip failed for 0x" << std::hex << h);
  }
}

TEST_CASE("writer -> reader round trip for every dtype", "[safetensors]") {
  const fs::path dir = scratch("roundtrip");
  const std::vector<float> vals = {1.0f, -2.5f, 3.140625f, 1e-3f, 65504.0f, -0.0f};
  const std::vector<int64_t> ids = {0, 1, -7, 151935, int64_t(1) << 40, 2};
  SafetensorsWriter w;
  w.add_f32("f32", {2, 3}, vals, DType::F32);
  w.add_f32("bf16", {6}, vals, DType::BF16);
  w.add_f32("f16", {3, 2}, vals, DType::F16);
  w.add_int("i64", {6}, ids, DType::I64);
  w.add_int("i32", {2, 2}, std::vector<int64_t>{5, -6, 7, 2147483647}, DType::I32);
  w.add_f32("empty", {0, 4}, {}, DType::F32);
  w.set_metadata("format", "pt");
  w.write(dir / "model.safetensors");

  const SafetensorsFile f = SafetensorsFile::open(dir / "model.safetensors");
  CHECK(f.header_json().size() % 8 == 0);  // data buffer 8-byte aligned
  CHECK(f.metadata().at("format") == "pt");
  REQUIRE(f.tensors().size() == 6);
  CHECK(f.at("f32").shape == std::vector<int64_t>{2, 3});
  CHECK(f.at("f32").dtype == DType::F32);
  CHECK(f.read_f32(f.at("f32")) == vals);
  // bf16 of these values: 3.140625 and 1.0, -2.5 are exact in bf16; 1e-3 and 65504 are rounded.
  const auto b = f.read_f32(f.at("bf16"));
  CHECK(b[0] == 1.0f);
  CHECK(b[1] == -2.5f);
  CHECK(b[2] == 3.140625f);
  CHECK(b[3] == bits_f(0x3A830000));  // 1e-3 = 0x3A83126F -> 0x3A83
  CHECK(b[4] == 65536.0f);            // 65504 = 0x477FE000 -> rounds up to 0x4780
  CHECK(std::signbit(b[5]));
  const auto h = f.read_f32(f.at("f16"));
  CHECK(h[0] == 1.0f);
  CHECK(h[3] == f16_to_f32(0x1419));  // 1e-3 in f16 is 0x1419 (0.0010004)
  CHECK(h[4] == 65504.0f);
  CHECK(f.read_i64(f.at("i64")) == ids);
  CHECK(f.read_i64(f.at("i32")) == std::vector<int64_t>{5, -6, 7, 2147483647});
  CHECK(f.at("empty").numel() == 0);
  CHECK(f.read_f32(f.at("empty")).empty());
  CHECK_THROWS_WITH(f.read_f32(f.at("i64")), Catch::Contains("does not convert to fp32"));
  CHECK_THROWS_WITH(f.read_i64(f.at("f32")), Catch::Contains("not an integer type"));
  CHECK_THROWS_WITH(f.at("nope"), Catch::Contains("has no tensor 'nope'"));

  // Writer input errors.
  SafetensorsWriter bad;
  CHECK_THROWS_AS(bad.add_f32("x", {2, 2}, vals, DType::F32), std::invalid_argument);  // 6 values for 4
  bad.add_f32("y", {1}, std::vector<float>{1.0f});
  CHECK_THROWS_AS(bad.add_f32("y", {1}, std::vector<float>{1.0f}), std::invalid_argument);  // duplicate
  CHECK_THROWS_AS(bad.add_int("z", {1}, std::vector<int64_t>{int64_t(1) << 40}, DType::I32), std::invalid_argument);
}

TEST_CASE("sharded checkpoint through model.safetensors.index.json", "[safetensors]") {
  const fs::path dir = scratch("sharded");
  SafetensorsWriter a, b;
  a.add_f32("x", {2}, std::vector<float>{1, 2});
  b.add_f32("y", {1}, std::vector<float>{3});
  a.write(dir / "s1.safetensors");
  b.write(dir / "s2.safetensors");
  auto index = [&](const std::string& body) { std::ofstream(dir / "model.safetensors.index.json") << body; };

  index(R"({"metadata": {}, "weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}})");
  CHECK(has_safetensors(dir));
  const Checkpoint ck = Checkpoint::open(dir);
  CHECK(ck.names() == std::vector<std::string>{"x", "y"});
  CHECK(ck.file_of("y").read_f32(*ck.find("y")) == std::vector<float>{3});
  CHECK(ck.files().size() == 2);
  CHECK_FALSE(ck.contains("z"));

  index(R"({"weight_map": {"x": "s1.safetensors", "y": "s1.safetensors"}})");
  CHECK_THROWS_WITH(Checkpoint::open(dir), Catch::Contains("tensor 'y' is mapped to s1.safetensors"));
  index(R"({"weight_map": {"y": "s2.safetensors"}})");  // s2 alone: x (in s1, not listed) is simply absent
  CHECK(Checkpoint::open(dir).names() == std::vector<std::string>{"y"});
  SafetensorsWriter c;
  c.add_f32("y", {1}, std::vector<float>{3});
  c.add_f32("z", {1}, std::vector<float>{4});
  c.write(dir / "s2.safetensors");
  CHECK_THROWS_WITH(Checkpoint::open(dir),
                    Catch::Contains("shard s2.safetensors holds tensor 'z' that the weight_map does not list"));
  index(R"({"weight_map": {"x": "s1.safetensors", "y": "missing.safetensors"}})");
  CHECK_THROWS_WITH(Checkpoint::open(dir), Catch::Contains("missing.safetensors: cannot open"));
  index(R"({"weight_map": {"x": "../s1.safetensors"}})");
  CHECK_THROWS_WITH(Checkpoint::open(dir), Catch::Contains("plain file name"));
  index("[1,2");
  CHECK_THROWS_WITH(Checkpoint::open(dir), Catch::Contains("not valid JSON"));

  const fs::path empty = scratch("empty");
  CHECK_FALSE(has_safetensors(empty));
  CHECK_THROWS_WITH(Checkpoint::open(empty), Catch::Contains("no model.safetensors"));
}

TEST_CASE("corrupt and truncated files give errors naming the file and the problem", "[safetensors]") {
  const fs::path dir = scratch("corrupt");
  const fs::path p = dir / "bad.safetensors";
  const std::string good_hdr = R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  const std::string data16(16, '\0');

  write_raw(p, good_hdr, data16);
  REQUIRE_NOTHROW(SafetensorsFile::open(p));

  std::ofstream(p, std::ios::binary) << "abc";
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains(p.string()) && Catch::Contains("truncated: 3 bytes"));

  write_raw(p, good_hdr, data16, 1'000'000);
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("header size prefix says 1000000 bytes"));

  write_raw(p, good_hdr, data16.substr(0, 10));  // data cut short
  CHECK_THROWS_WITH(
      SafetensorsFile::open(p),
      Catch::Contains(p.string()) && Catch::Contains("truncated: data buffer is 10 bytes but the tensors need 16"));

  write_raw(p, good_hdr, data16 + "xx");
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("trailing garbage"));

  write_raw(p, "{\"t\":", data16);
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("not valid JSON"));

  write_raw(p, R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", data16.substr(0, 12));
  CHECK_THROWS_WITH(SafetensorsFile::open(p),
                    Catch::Contains("tensor 't'") && Catch::Contains("span 12 bytes but shape [2, 2] of F32 needs 16"));

  write_raw(p, R"({"t":{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}})", "xx");
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("unknown safetensors dtype 'Q4'"));

  write_raw(
      p,
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      std::string(12, '\0'));
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("overlaps"));

  write_raw(p, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0'));
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("hole"));

  write_raw(p, R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("negative dimension"));

  write_raw(p, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", std::string(4, '\0'));
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("end 4 < begin 8"));

  write_raw(p, R"({"a":{"dtype":"F32","shape":[1]}})", "");
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("'data_offsets' must be two non-negative integers"));

  write_raw(p, R"([1,2])", "");
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("not a JSON object"));

  CHECK_THROWS_WITH(SafetensorsFile::open(dir / "absent.safetensors"), Catch::Contains("cannot open"));
}

TEST_CASE("weights_identity tracks the bytes, not the file's name or time", "[safetensors]") {
  const fs::path a = scratch("ident_a"), b = scratch("ident_b");
  std::vector<float> v(5000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i) * 0.25f;
  SafetensorsWriter w;
  w.add_f32("w", {5000}, v);
  w.write(a / "model.safetensors");
  w.write(b / "model.safetensors");
  CHECK(weights_identity(a) == weights_identity(b));
  CHECK(weights_identity(a).size() == 32);
  v[0] = 7.0f;  // a value inside the first sampled block
  SafetensorsWriter w2;
  w2.add_f32("w", {5000}, v);
  w2.write(b / "model.safetensors");
  CHECK(weights_identity(a) != weights_identity(b));
}

// Found by fuzzing (tests/fuzz/fuzz_safetensors.cpp).
TEST_CASE("fuzz regressions: sizes that wrap and numbers that do not fit", "[safetensors][fuzz]") {
  const fs::path p = scratch("fuzz") / "bad.safetensors";
  // 2^61 F64 elements are 2^64 bytes, which wrapped to 0 and matched data_offsets [0, 0]: the file opened with a
  // tensor of 2^61 elements in an empty buffer (read_f32 would read far out of bounds).
  write_raw(p, R"({"t":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})", "");
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("tensor 't'") && Catch::Contains("overflows"));
  write_raw(p, R"({"t":{"dtype":"I32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", "");
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("overflows"));
  // A number too large for a double in the header: nlohmann's out_of_range used to escape open().
  write_raw(p, R"({"t":{"dtype":"F32","shape":[1E99999],"data_offsets":[0,4]}})", std::string(4, '\0'));
  CHECK_THROWS_WITH(SafetensorsFile::open(p), Catch::Contains("not valid JSON"));
}
