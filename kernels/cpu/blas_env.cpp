#include "kernels/cpu/blas_env.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <initializer_list>

namespace hypic::kernels::cpu {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool one_of(const std::string& name, std::initializer_list<const char*> names) {
  const std::string l = lower(name);
  for (const char* n : names)
    if (l == n) return true;
  return false;
}

}  // namespace

std::string blas_core_name() {
  const char* name = openblas_get_corename();
  return name ? std::string(name) : std::string();
}

std::string recommended_blas_core() {
  const std::string core = blas_core_name();
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && !one_of(core, {"skylakex", "cooperlake", "sapphirerapids"})) return "SkylakeX";
  if (!avx512 && avx2 && !one_of(core, {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"})) {
    return "Haswell";
  }
#endif
  return {};
}

void reexec_with_recommended_blas_core(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string core = recommended_blas_core();
  if (core.empty() || argv == nullptr || argv[0] == nullptr) return;
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return;
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // exec failed: carry on with the original kernels
}

}  // namespace hypic::kernels::cpu
