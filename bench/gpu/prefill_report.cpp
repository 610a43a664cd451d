// The GPU prefill benchmark's report (contract in prefill_report.h).
#include "bench/gpu/prefill_report.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>

namespace hypic::bench::gpu {

using json = nlohmann::json;

std::string fmt(const char* f, double v) {
  if (!std::isfinite(v)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

double jnum(const json& j, const char* key) {
  auto it = j.find(key);
  return (it != j.end() && it->is_number()) ? it->get<double>() : NAN;
}

std::string markdown(const json& J) {
  std::ostringstream m;
  const json& dev = J["device"];
  const json& ceil = J["ceilings"];
  const double peak = jnum(ceil, "bf16_gemm_TFLOPs");
  m << "# Whole-model prefill, splice and decode on " << dev.value("name", "?")
    << " (" << (J["model"].value("model_type", "qwen3_5_moe").rfind("qwen", 0) == 0 ? std::string("Qwen3.5-35B-A3B")
                                                                                   : J["model"].value("model_type", "?"))
    << " dimensions, benchmark-only random weights)\n\n";
  m << "Model: " << J["model"].value("config", "?") << " (" << J["model"].value("layer_pattern", "") << "; "
    << fmt("%.2f", jnum(J["model"], "parameters_total") / 1e9) << "B parameters, "
    << fmt("%.2f", jnum(J["model"], "parameters_active_per_token") / 1e9)
    << "B active per token incl. embedding and LM head), bf16 weights made on the device from seed "
    << J["model"].value("random_weights_seed", 0) << ". Measured ceilings in the same run: bf16 GEMM "
    << fmt("%.0f", peak) << " TFLOP/s (cuBLASLt, n = " << ceil.value("bf16_gemm_n", 0) << "), device copy "
    << fmt("%.0f", jnum(ceil, "copy_GBps")) << " GB/s. Each number is a median of " << J["method"].value("reps", 0)
    << " timed runs after " << J["method"].value("warmup", 0) << " warm-up runs; backend calls are timed by wall clock "
    << "around the call (which ends with its stream sync and the logits copy) plus a device sync.\n\n";

  m << "## Full prefill\n\n| tokens | ours ms | tokens/s | counted TFLOP/s | % of bf16 GEMM | HF transformers ms | HF / ours |\n"
       "|---|---|---|---|---|---|---|\n";
  for (const json& r : J["rows"]) {
    m << "| " << r.value("tokens", 0) << " | " << fmt("%.1f", jnum(r, "ours_ms")) << " | "
      << fmt("%.0f", jnum(r, "tokens_per_s")) << " | " << fmt("%.1f", jnum(r, "TFLOPs")) << " | "
      << fmt("%.1f%%", jnum(r, "pct_of_bf16_gemm")) << " | " << fmt("%.1f", jnum(r, "hf_ms"));
    if (std::isfinite(jnum(r, "hf_ms_measured")))
      m << " (" << fmt("%.1f", jnum(r, "hf_ms_measured")) << " for " << r.value("hf_layers_timed", 0) << " layers)";
    m << " | " << fmt("%.2fx", jnum(r, "hf_over_ours")) << " |\n";
  }
  if (J.contains("hf") && J["hf"].is_object()) {
    const json& h = J["hf"];
    m << "\nHugging Face: transformers " << h.value("transformers", "?") << ", torch " << h.value("torch", "?")
      << ", bf16, " << h.value("layers_timed", 0) << " of " << h.value("layers_full", 0)
      << " layers instantiated (same 3:1 pattern) and timed, scaled: " << h.value("scaling", "") << ". Ran: ";
    if (h.contains("implementations")) {
      const json& im = h["implementations"];
      bool first = true;
      for (const char* k : {"gdn", "fla_kernels_seen", "conv1d", "attention", "attention_kernels", "experts",
                            "experts_fallback_reason"}) {
        if (!im.contains(k)) continue;
        std::string v = im[k].is_string() ? im[k].get<std::string>() : im[k].dump();
        if (v.size() > 160) v = v.substr(0, 160) + "...";
        m << (first ? "" : "; ") << k << ": " << v;
        first = false;
      }
    }
    m << ".\n";
  } else {
    m << "\nNo Hugging Face run was given (--hf-json): the HF columns are empty.\n";
  }

  if (J.contains("parts") && J["parts"].is_array() && !J["parts"].empty()) {
    m << "\n## Full prefill by part (kernels timed standalone at the same shapes, GPU ms summed over the layers; "
         "rest = end-to-end minus their sum)\n\n"
         "| tokens | end-to-end | dense GEMMs | MoE | attention | GDN | rest |\n|---|---|---|---|---|---|---|\n";
    for (const json& p : J["parts"]) {
      const double e2e = jnum(p, "end_to_end_ms");
      auto cell = [&](const json& x) {
        const double ms = jnum(x, "ms");
        return fmt("%.1f", ms) + " (" + fmt("%.0f%%", 100 * ms / e2e) + ", " + fmt("%.0f", jnum(x, "TFLOPs")) +
               " TFLOP/s)";
      };
      m << "| " << p.value("tokens", 0) << " | " << fmt("%.1f", e2e) << " | " << cell(p["dense_gemm"]) << " | "
        << cell(p["moe"]) << " | " << cell(p["attention"]) << " | " << cell(p["gdn"]) << " | "
        << fmt("%.1f", jnum(p, "rest_ms")) << " (" << fmt("%.0f%%", 100 * jnum(p, "rest_ms") / e2e) << ") |\n";
    }
  }
  if (J.contains("parts_vs_best") && J["parts_vs_best"].is_array() && !J["parts_vs_best"].empty()) {
    m << "\n## Parts next to the best library kernels (same shapes, same GPU call; ours / best < 1: ours faster)\n\n"
         "| tokens | part | ours ms | best library ms | ours / best | library |\n|---|---|---|---|---|---|\n";
    for (const json& e : J["parts_vs_best"]) {
      const bool have = e.contains("best_ms") && e["best_ms"].is_number();
      m << "| " << e.value("tokens", 0) << " | " << e.value("part", "") << " | " << fmt("%.1f", jnum(e, "ours_ms"))
        << " | " << (have ? fmt("%.1f", jnum(e, "best_ms")) : std::string("n/a")) << " | "
        << (have ? fmt("%.2fx", jnum(e, "ours_over_best")) : std::string("n/a")) << " | "
        << (have ? e.value("best_what", "") : e.value("best_error", "")) << " |\n";
    }
    // (tools/best_kernels_bench.py has timed its parts over their layers back to back since 2026-12-05, and records
    // single_call_ms_per_layer since; older results timed one call and multiplied.)
    bool back_to_back = false;
    if (J.contains("best") && J["best"].is_object())
      for (const json& r : J["best"].value("rows", json::array()))
        for (const char* part : {"attention", "moe", "gdn"})
          if (r.contains(part) && r[part].is_object() && r[part].contains("single_call_ms_per_layer"))
            back_to_back = true;
    if (back_to_back)
      m << "\nBoth sides run the part once per layer of its kind, the layers back to back between two CUDA events "
           "(one call timed alone differs from the same call among its layers: the GPU's clocks, the host's launch "
           "gaps).";
    else
      m << "\nThe library's times: one call timed alone, times the layers.";
    std::string sdpa_only;
    for (const json& e : J["parts_vs_best"])
      if (e.contains("best_sdpa_only_ms") && e["best_sdpa_only_ms"].is_number())
        sdpa_only += (sdpa_only.empty() ? "" : ", ") + std::to_string(e.value("tokens", 0)) + " tokens " +
                     fmt("%.1f", jnum(e, "best_sdpa_only_ms")) + " ms";
    if (!sdpa_only.empty())
      m << " The library's attention includes the output gate, as ours does; its SDPA alone: " << sdpa_only << ".";
    m << "\n";
  }
  if (J.contains("build") && J["build"].is_object() && !J["build"].empty()) {
    const json& b = J["build"];
    m << "\n## Entry build (" << b.value("segments", 0) << " segments x " << b.value("segment_tokens", 0)
      << " tokens, one build_entries call, w = " << b.value("seam_width", 0) << ")\n\n"
      << "| with T_C ms | without T_C ms | T_C overhead |\n|---|---|---|\n| "
      << fmt("%.1f", jnum(b, "with_tc_ms")) << " | " << fmt("%.1f", jnum(b, "without_tc_ms")) << " | "
      << fmt("%+.1f%%", jnum(b, "tc_overhead_pct")) << " |\n";
    if (b.contains("without_tc_error")) m << "\nWithout T_C: " << b["without_tc_error"].get<std::string>() << "\n";
    if (b.contains("error")) m << "\nError: " << b["error"].get<std::string>() << "\n";
  }
  if (J.contains("splice") && J["splice"].is_object() && !J["splice"].empty()) {
    const json& sp = J["splice"];
    m << "\n## Warm splice (" << sp.value("segments", 0) << " cached segments x " << sp.value("segment_tokens", 0)
      << " tokens + a " << sp.value("query_tokens", 0) << "-token query, " << sp.value("mode", "") << ", w = "
      << sp.value("seam_width", 0) << ")\n\n| hypic TTFT ms | full prefill of the same prompt ms | full / hypic |\n"
      << "|---|---|---|\n| " << fmt("%.1f", jnum(sp, "hypic_ttft_ms")) << " | " << fmt("%.1f", jnum(sp, "full_ms"))
      << " | " << fmt("%.1fx", jnum(sp, "full_over_hypic")) << " |\n\nThe hypic splice ran "
      << fmt("%.0f", jnum(sp, "hypic_computed_tokens")) << " of " << fmt("%.0f", jnum(sp, "prompt_tokens"))
      << " tokens through the model (the seams and the query); the rest came from the resident entries.\n";
    if (sp.contains("refresh") && sp["refresh"].is_array() && !sp["refresh"].empty()) {
      m << "\nWith the query-aware refresh (SplicePlan::refresh_segments = k: a probe splice measures the query's "
           "attention per segment, then the k segments it attends to most are recomputed whole in context and the "
           "prompt is spliced again; tokens computed count both passes) and its tail (refresh_tail = t: the last t "
           "segments recomputed whole, no probe):\n\n"
        << "| k | t | TTFT ms | tokens computed | full / refresh | refresh / hypic |\n|---|---|---|---|---|---|\n";
      for (const json& r : sp["refresh"])
        m << "| " << r.value("refresh_segments", 0) << " | " << r.value("refresh_tail", 0) << " | "
          << fmt("%.1f", jnum(r, "ttft_ms")) << " | "
          << fmt("%.0f", jnum(r, "computed_tokens")) << " | " << fmt("%.1fx", jnum(r, "full_over_refresh")) << " | "
          << fmt("%.2fx", jnum(r, "refresh_over_hypic")) << " |\n";
    }
    if (sp.contains("error")) m << "\nError: " << sp["error"].get<std::string>() << "\n";
  }
  if (J.contains("decode") && J["decode"].is_object() && !J["decode"].empty()) {
    const json& dc = J["decode"];
    m << "\n## Decode (Backend::decode of a batch, contexts of " << dc.value("context_tokens", 0)
      << " tokens, each a hypic splice of the cached segments + a distinct query)\n\n"
         "| batch | ms per step (inter-token latency) | greedy, argmax on the device (Backend::decode_step) ms | "
         "sampled (top-k 20, top-p 0.8), picked on the host / on the device ms | "
         "tokens/s | est. bytes read per step | est. GB/s |\n"
         "|---|---|---|---|---|---|---|\n";
    auto opt_ms = [](const json& r, const char* k) {
      return r.contains(k) ? fmt("%.2f", jnum(r, k)) : std::string("-");
    };
    for (const json& r : dc.value("batches", json::array()))
      m << "| " << r.value("batch", 0) << " | " << fmt("%.2f", jnum(r, "ms")) << " | " << opt_ms(r, "greedy_ms")
        << " | " << opt_ms(r, "sampled_host_ms") << " / " << opt_ms(r, "sampled_device_ms") << " | "
        << fmt("%.0f", jnum(r, "tokens_per_s")) << " | " << fmt("%.1f GB", jnum(r, "est_bytes") / 1e9) << " | "
        << fmt("%.0f", jnum(r, "est_GBps")) << " |\n";
    m << "\nEstimated bytes per step: every dense weight and the LM head, the experts the batch touches (uniform "
         "routing: E (1 - (1 - k/E)^B) per layer), the KV of every context, the linear states read and written.\n";
    if (dc.contains("error")) m << "\nError: " << dc["error"].get<std::string>() << "\n";
  }
  if (J.contains("decode_beside") && J["decode_beside"].is_object() && J["decode_beside"].contains("loads")) {
    const json& db = J["decode_beside"];
    m << "\n## Decode beside prefill (Backend::concurrent_decode: " << db.value("steps", 0) << " steps of batch "
      << db.value("batch", 0) << ", contexts of " << db.value("context_tokens", int64_t(0))
      << " tokens, on a second thread while this one runs the load back to back; decode SM partition: "
      << (db.value("decode_sms", 0) > 0    ? std::to_string(db.value("decode_sms", 0)) + " SMs"
          : db.value("decode_sms", 0) < 0 ? std::string("auto")
                                           : std::string("none"))
      << ")\n\n"
         "| load | step median ms | vs alone | p90 | p99 | max | load's work ms | vs alone |\n|---|---|---|---|---|---|---|---|\n";
    for (const json& r : db["loads"]) {
      if (r.contains("error")) {
        m << "| " << r.value("load", "") << " | failed: " << r["error"].get<std::string>() << " |||||||\n";
        continue;
      }
      m << "| " << r.value("load", "") << " | " << fmt("%.2f", jnum(r, "step_ms_median")) << " | "
        << fmt("%.2fx", jnum(r, "step_over_alone")) << " | " << fmt("%.2f", jnum(r, "step_ms_p90")) << " | "
        << fmt("%.2f", jnum(r, "step_ms_p99")) << " | " << fmt("%.2f", jnum(r, "step_ms_max")) << " | "
        << fmt("%.1f", jnum(r, "work_ms_median")) << " | " << fmt("%.2fx", jnum(r, "work_over_alone")) << " |\n";
    }
    if (db.contains("error")) m << "\nError: " << db["error"].get<std::string>() << "\n";
  }
  if (J.contains("ab") && J["ab"].is_array() && !J["ab"].empty()) {
    m << "\n## Candidate switches off and on, side by side (`--ab`: prefills and splices run by run alternating, "
         "medians; decode in blocks of steps off, on, on, off, the mean of each mode's block medians)\n\n"
         "| switch | measurement | off ms | on ms | on / off |\n|---|---|---|---|---|\n";
    for (const json& r : J["ab"]) {
      if (r.contains("error")) {
        m << "| " << r.value("switch", "") << " | failed: " << r["error"].get<std::string>() << " | | | |\n";
        continue;
      }
      m << "| " << r.value("switch", "") << " | " << r.value("what", "") << " | " << fmt("%.2f", jnum(r, "off_ms"))
        << " | " << fmt("%.2f", jnum(r, "on_ms")) << " | " << fmt("%.3f", jnum(r, "on_over_off")) << " |\n";
    }
  }
  if (J.contains("targets")) {
    m << "\n## Targets (issue 11, set for Qwen3.5-35B-A3B)\n\n";
    for (const json& t : J["targets"])
      m << "- " << t.value("target", "") << ": " << t.value("measured", "") << " -> "
        << (t["met"].is_boolean() ? (t["met"].get<bool>() ? "met" : "MISSED") : "not measured") << "\n";
  }
  m << "\n## Run\n\n- Command: `" << J.value("command", "") << "`\n- Time: " << J.value("utc", "")
    << "\n- Commit: " << J.value("git_commit", "")
    << (J.contains("build_commit") ? "; binary built from " + J.value("build_commit", "") : std::string())
    << "\n- Device: " << dev.value("name", "?") << ", "
    << dev.value("sms", 0) << " SMs, " << fmt("%.0f", jnum(dev, "memory_bytes") / double(1 << 30))
    << " GiB, driver " << dev.value("driver", 0) << ", runtime " << dev.value("runtime", 0)
    << "\n";
  if (J.contains("memory") && J["memory"].is_object() && !J["memory"].empty()) {
    const json& mm = J["memory"];
    auto gib = [&](const char* k) { return fmt("%.1f GiB", jnum(mm, k) / double(1u << 30)); };
    m << "- Backend memory with the decode contexts alive: weights " << gib("weights") << ", KV pool " << gib("kv_used")
      << " used of " << gib("kv_budget") << ", workspace " << gib("workspace") << "; device free "
      << gib("device_free") << " of " << gib("device_total") << "\n";
  }
  if (J.contains("hf") && J["hf"].is_object() && J["hf"].contains("command"))
    m << "- HF command: `" << J["hf"].value("command", "") << "`\n";
  return m.str();
}

}  // namespace hypic::bench::gpu
