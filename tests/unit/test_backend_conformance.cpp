// The backend conformance suite (tests/conformance/backend_conformance.h) on the CPU backend, for every family's
// fixture (tests/fixtures: Qwen3.5 MoE, Qwen3-Next, Kimi-Linear, MiniMax, Ring-linear). The CUDA backend runs the
// same suite in tests/gpu/test_gpu_conformance.cpp.
#include <catch2/catch.hpp>

#include <iterator>
#include <string>

#include "engine/backend.h"
#include "tests/conformance/backend_conformance.h"

TEST_CASE("backend conformance: the CPU backend on every family", "[conformance]") {
  namespace eng = hypic::engine;
  const char* names[] = {"qwen3_5_moe", "qwen3_next_moe", "kimi_linear_grouped", "minimax_h3", "ring_linear_grouped"};
  for (uint32_t i = 0; i < std::size(names); ++i) {
    const char* name = names[i];
    const uint32_t seed = i + 1;  // (outside the SECTION: Catch2 reruns the case once per section)
    SECTION(name) {
      auto b = eng::make_backend(eng::DeviceSpec{eng::BackendKind::Cpu, 0},
                                 std::string(HYPIC_SOURCE_DIR) + "/tests/fixtures/" + name);
      hypic::testing::ConformanceOptions o;
      o.tol = 1e-4;  // fp32: only the chunked scans' boundaries move between the passes compared
      o.seed = seed;
      hypic::testing::check_backend_conformance(*b, o);
    }
  }
}
