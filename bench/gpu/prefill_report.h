// The GPU prefill benchmark's report (hypic-bench-prefill-gpu): the Markdown tables of its JSON result, and the two
// small formatting helpers the benchmark shares with them.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace hypic::bench::gpu {

/// The Markdown report of a hypic-bench-prefill-gpu JSON result: device and ceilings, then whichever sections ran
/// (full prefill next to HF, parts and parts_vs_best, splice, decode, decode beside prefill), then the commands.
/// Times in the JSON are milliseconds, rates TFLOP/s or GB/s as their keys say.
std::string markdown(const nlohmann::json& J);

/// printf-style formatting of one number ("%.1f"), "n/a" when it is not finite.
std::string fmt(const char* f, double v);

/// j[key] as a number, NAN when absent or not a number.
double jnum(const nlohmann::json& j, const char* key);

}  // namespace hypic::bench::gpu
