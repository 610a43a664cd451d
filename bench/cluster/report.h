// The cluster benchmark's report: the human table (Markdown) of its JSON, and the host facts the JSON records.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace hypic::bench::cluster {

/// The Markdown report of a hypic-bench-cluster JSON result (its "modes", "scaling", "schedule", "serving", "load"
/// sections, whichever ran, then the notes). Times in the JSON are milliseconds.
std::string markdown(const nlohmann::json& j);

/// The host's CPU model name (from /proc/cpuinfo), "unknown CPU" when unreadable.
std::string cpu_model();

/// The 1-minute load average of the host (other work competing for its cores), -1 if unknown.
double load_average();

/// The current time, UTC, ISO 8601 to the second ("2026-12-03T21:05:00Z").
std::string utc_now();

}  // namespace hypic::bench::cluster
