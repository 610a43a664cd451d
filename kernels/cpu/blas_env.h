// Which kernel set OpenBLAS runs on this CPU, and how to fix a bad pick.
//
// OpenBLAS built with DYNAMIC_ARCH (the Debian package) chooses its kernels once, when the library loads, from
// the CPU model number. Releases that predate a CPU do not know its model and fall back to a generic core:
// OpenBLAS 0.3.21 (Debian 12) runs Sapphire / Emerald Rapids Xeons with the "Prescott" SSE3 kernels, which
// made our prefill GEMMs several times slower than its AVX-512 "SkylakeX" kernels on the same machine.
// The environment variable OPENBLAS_CORETYPE overrides the pick, but only if it is set before the library
// loads, hence the re-exec helper below for programs' main().
#pragma once
#include <string>

namespace hypic::kernels::cpu {

/// The kernel set OpenBLAS picked (openblas_get_corename()), e.g. "SkylakeX", "Haswell", "Prescott".
std::string blas_core_name();

/// The OPENBLAS_CORETYPE this CPU should use when OpenBLAS picked a weaker kernel set than the CPU supports:
/// "SkylakeX" when the CPU has AVX-512 F/BW/DQ/VL, "Haswell" with AVX2 + FMA; empty when the current pick
/// already uses that instruction set (or the CPU supports nothing better).
std::string recommended_blas_core();

/// For a program's main(): when OPENBLAS_CORETYPE is unset and recommended_blas_core() is not empty, sets
/// OPENBLAS_CORETYPE to it and re-executes the program (/proc/self/exe) with the same argv, so OpenBLAS
/// picks the better kernels at load. Returns (without re-exec) when nothing is to be done, when
/// OPENBLAS_CORETYPE was already set (the user's choice wins), or if the exec fails.
void reexec_with_recommended_blas_core(char** argv);

}  // namespace hypic::kernels::cpu
