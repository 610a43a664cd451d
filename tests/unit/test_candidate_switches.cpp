// The candidate and measured-default switches of kernels/cuda/switches.h (host code, no GPU needed): the environment
// rules, the per-generation caching of CandidateSwitch, and that every listed switch is wired to a CandidateSwitch in
// the CUDA kernels or backend and described in the README's table.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "kernels/cuda/switches.h"

namespace kc = hypic::kernels::cuda;

namespace {

std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}


}  // namespace

TEST_CASE("candidate_enabled: own variable first, then HYPIC_CANDIDATES, else off", "[switches]") {
  kc::CandidateScope all("HYPIC_CANDIDATES"), own("HYPIC_TEST_CANDIDATE_X");
  struct Row {
    const char* own;  // nullptr: unset
    const char* all;
    bool want;
  };
  // "yes" is no recognised value: HYPIC_CANDIDATES decides.
  const Row rows[] = {{nullptr, nullptr, false}, {nullptr, "1", true}, {"0", "1", false}, {"off", "1", false},
                      {"yes", "1", true},        {"yes", "0", false},  {"on", "0", true},  {"1", nullptr, true},
                      {nullptr, "on", true},     {nullptr, "2", false}};
  for (const Row& r : rows) {
    INFO("own " << (r.own ? r.own : "unset") << ", HYPIC_CANDIDATES " << (r.all ? r.all : "unset"));
    r.own ? setenv("HYPIC_TEST_CANDIDATE_X", r.own, 1) : unsetenv("HYPIC_TEST_CANDIDATE_X");
    r.all ? setenv("HYPIC_CANDIDATES", r.all, 1) : unsetenv("HYPIC_CANDIDATES");
    CHECK(kc::candidate_enabled("HYPIC_TEST_CANDIDATE_X") == r.want);
  }
}

TEST_CASE("CandidateSwitch keeps its answer until candidates_reread", "[switches]") {
  kc::CandidateScope all("HYPIC_CANDIDATES"), own("HYPIC_TEST_CANDIDATE_Y");
  unsetenv("HYPIC_CANDIDATES");
  setenv("HYPIC_TEST_CANDIDATE_Y", "1", 1);
  kc::candidates_reread();
  static kc::CandidateSwitch sw("HYPIC_TEST_CANDIDATE_Y");
  CHECK(sw.on());
  setenv("HYPIC_TEST_CANDIDATE_Y", "0", 1);
  CHECK(sw.on());  // not re-read yet
  const int gen = kc::candidate_generation().load();
  kc::candidates_reread();
  CHECK(kc::candidate_generation().load() == gen + 1);
  CHECK_FALSE(sw.on());
  unsetenv("HYPIC_TEST_CANDIDATE_Y");
  setenv("HYPIC_CANDIDATES", "1", 1);
  kc::candidates_reread();
  CHECK(sw.on());
}

TEST_CASE("every candidate switch is wired in kernels/cuda or engine/cuda and described in the README", "[switches]") {
  const std::filesystem::path root(HYPIC_SOURCE_DIR);
  std::string sources;  // the CUDA kernels and the CUDA backend (decode_step's device sampling)
  for (const char* dir : {"kernels/cuda", "engine/cuda"})
    for (const auto& e : std::filesystem::directory_iterator(root / dir))
      if (e.path().extension() == ".cu" || e.path().extension() == ".cuh" || e.path().extension() == ".h" ||
          e.path().extension() == ".cpp")
        sources += slurp(e.path());
  const std::string readme = slurp(root / "README.md");
  REQUIRE(!sources.empty());
  REQUIRE(!readme.empty());
  auto wired_and_described = [&](const char* name) {
    // A CandidateSwitch reads it: `CandidateSwitch <var>("NAME")`.
    const std::string wired = std::string("(\"") + name + "\")";
    bool found = false;
    for (size_t at = sources.find(wired); at != std::string::npos && !found; at = sources.find(wired, at + 1))
      found = sources.rfind("CandidateSwitch", at) != std::string::npos &&
              at - sources.rfind("CandidateSwitch", at) < 40;
    CHECK(found);
    CHECK(readme.find(std::string("| `") + name + "` |") != std::string::npos);
  };
  for (const char* name : kc::kCandidateSwitches) {
    INFO(name);
    CHECK(kc::is_candidate_switch(name));
    CHECK_FALSE(kc::is_measured_default_switch(name));
    wired_and_described(name);
  }
  for (const char* name : kc::kMeasuredDefaultSwitches) {
    INFO(name);
    CHECK_FALSE(kc::is_candidate_switch(name));
    CHECK(kc::is_measured_default_switch(name));
    wired_and_described(name);
  }
  CHECK(kc::is_candidate_switch("HYPIC_CANDIDATES"));
  CHECK_FALSE(kc::is_candidate_switch("HYPIC_ATTN_CUDNN"));
  CHECK_FALSE(kc::is_candidate_switch(""));
}

TEST_CASE("a measured default is on unless its own variable turns it off, whatever HYPIC_CANDIDATES says", "[switches]") {
  REQUIRE(std::size(kc::kMeasuredDefaultSwitches) > 0);
  const char* name = kc::kMeasuredDefaultSwitches[0];
  kc::CandidateScope all("HYPIC_CANDIDATES"), own(name);
  struct Row {
    const char* own;  // nullptr: unset
    const char* all;
    bool want;
  };
  const Row rows[] = {{nullptr, nullptr, true}, {nullptr, "0", true}, {nullptr, "1", true}, {"0", nullptr, false},
                      {"off", "1", false},      {"1", "0", true},     {"yes", "0", true}};
  for (const Row& r : rows) {
    INFO(name << ": own " << (r.own ? r.own : "unset") << ", HYPIC_CANDIDATES " << (r.all ? r.all : "unset"));
    r.own ? setenv(name, r.own, 1) : unsetenv(name);
    r.all ? setenv("HYPIC_CANDIDATES", r.all, 1) : unsetenv("HYPIC_CANDIDATES");
    CHECK(kc::candidate_enabled(name) == r.want);
  }
}

TEST_CASE("CandidateScope sets a switch for its scope and restores the variable after it", "[switches]") {
  kc::CandidateScope outer("HYPIC_TEST_CANDIDATE_Z");
  setenv("HYPIC_TEST_CANDIDATE_Z", "off", 1);
  static kc::CandidateSwitch sw("HYPIC_TEST_CANDIDATE_Z");
  kc::candidates_reread();
  CHECK_FALSE(sw.on());
  {
    kc::CandidateScope s("HYPIC_TEST_CANDIDATE_Z");
    s.set(true);
    CHECK(sw.on());
    s.set(false);
    CHECK_FALSE(sw.on());
    s.set(true);
  }
  REQUIRE(std::getenv("HYPIC_TEST_CANDIDATE_Z") != nullptr);
  CHECK(std::string(std::getenv("HYPIC_TEST_CANDIDATE_Z")) == "off");
  CHECK_FALSE(sw.on());  // (the scope's end re-read it)
  unsetenv("HYPIC_TEST_CANDIDATE_Z");
  {
    kc::CandidateScope s("HYPIC_TEST_CANDIDATE_Z");
    s.set(true);
  }
  CHECK(std::getenv("HYPIC_TEST_CANDIDATE_Z") == nullptr);
}
