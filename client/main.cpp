// hypic-client: command-line client of a hypic cluster.
//
//   hypic-client generate --router HOST:PORT --segment-file a.txt --segment-file b.txt --query "..." [--json]
//   hypic-client health --target HOST:PORT [--service hypic.v1.Router] [--wait-seconds 30]
//   hypic-client services --target HOST:PORT      (server reflection: the services it exposes)
//   hypic-client info --router HOST:PORT
//   hypic-client cache-stats|cache-get|cache-put|cache-delete --cache HOST:PORT ...
//
// Exit status: 0 success; 1 bad usage or local error (unreadable file...); 2 the RPC failed (the
// gRPC code and message go to stderr, and with --json also to stdout as {"error": {...}}). When nothing answered at
// the address, a hint follows on stderr (is the router running? how to start one); an address that serves another
// hypic service is named as such (cache-* against a router: "... is a hypic router, not a segment cache; the cache
// replicas are: ...").
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <google/protobuf/util/json_util.h>
#include <nlohmann/json.hpp>

#include "client/input.h"
#include "engine/io_error.h"
#include "hypic/v1/combine.grpc.pb.h"
#include "hypic/v1/router.grpc.pb.h"
#include "hypic/v1/scatter.grpc.pb.h"
#include "proto/rpc/flags.h"
#include "proto/rpc/reflection_client.h"
#include "proto/rpc/server.h"
#include "proto/rpc/status.h"
#include "segment_cache/client.h"

namespace v1 = hypic::v1;
using hypic::client::read_file;
using nlohmann::json;

namespace {

void write_file(const std::string& path, std::string_view bytes) {
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  out.flush();
  if (!out) {
    throw std::runtime_error(fmt::format("cannot write {}: {}", path, hypic::engine::io_error_reason(path, errno)));
  }
}

json proto_json(const google::protobuf::Message& m) {
  std::string s;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &s, o);
  return json::parse(s);
}

/// The bytes of an input file named by `flag`, capped (client/input.h read_file); errors name the flag.
std::string read_input(const std::string& flag, const std::string& path) {
  try {
    return read_file(path);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(fmt::format("{}: {}", flag, e.what()));
  }
}

int rpc_failed(const grpc::Status& st, bool as_json, const std::string& hint = "") {
  std::cerr << "error: " << hypic::rpc::describe(st) << "\n";
  if (!hint.empty()) std::cerr << hint << "\n";
  if (as_json) {
    std::cout << json{{"error", {{"code", std::string(hypic::rpc::code_name(st.error_code()))},
                                 {"message", st.error_message()}}}}
                     .dump()
              << std::endl;
  }
  return 2;
}

// ---- diagnosing a call to the wrong address ----

/// The hypic service a server at `target` is, from its server reflection ("a hypic router", "a segment cache", ...);
/// empty when it cannot be told (unreachable, no hypic service).
std::string what_serves(const std::string& target) {
  try {
    for (const auto& name : hypic::rpc::list_services(hypic::rpc::make_channel(target), std::chrono::seconds(3))) {
      if (name == "hypic.v1.Router") return "a hypic router";
      if (name == "hypic.v1.SegmentCache") return "a hypic segment cache";
      if (name == "hypic.v1.ScatterWorker") return "a hypic scatter worker";
      if (name == "hypic.v1.CombineWorker") return "a hypic combine worker";
    }
  } catch (const std::exception&) {
  }
  return "";
}

/// Did the call fail because nothing answered at the address (not because a service answered UNAVAILABLE, such as a
/// router that is shutting down)?
bool unreachable(const grpc::Status& st, const std::shared_ptr<grpc::Channel>& channel = nullptr) {
  // With the call's channel: it never got a connection (a router that answered, even UNAVAILABLE because a combine
  // worker is down, leaves it READY). A deadline that ran out while connecting counts too (a dropped SYN).
  if (channel) {
    return (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
            st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) &&
           channel->GetState(false) != GRPC_CHANNEL_READY;
  }
  if (st.error_code() != grpc::StatusCode::UNAVAILABLE) return false;
  const std::string& m = st.error_message();
  for (const char* s : {"failed to connect", "Connection refused", "DNS resolution failed", "No address added",
                        "Name or service not known", "Socket closed", "Connection reset"}) {
    if (m.find(s) != std::string::npos) return true;
  }
  return false;
}

/// Does a TCP connection to host:port succeed within 2 s (something listens there, whatever it speaks)?
bool tcp_open(const std::string& target) {
  const auto colon = target.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = target.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), target.substr(colon + 1).c_str(), &hints, &res) != 0) return false;
  bool open = false;
  for (addrinfo* a = res; a && !open; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      open = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof(err);
      open = poll(&p, 1, 2000) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return open;
}

/// Is a TLS mismatch the likely cause of a failed call to `target`? Only when something listens there (TCP) but a gRPC
/// connection with this process's TLS settings cannot be made within 2 s: a server that connects fine (a deadline
/// that was just too short, a busy server) is not blamed on TLS.
bool likely_tls_mismatch(const std::string& target) {
  if (!tcp_open(target)) return false;
  const auto channel = hypic::rpc::make_channel(target);
  return !channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

/// The hint for a gRPC connection that failed although something listens at `target`: most likely the TLS settings
/// differ from the server's.
std::string tls_hint(const std::string& target) {
  return fmt::format(
      "hint: {} accepts connections but the gRPC connection failed: the TLS settings probably do not match the "
      "server's. A cluster started with TLS (deploy/local_cluster.py --tls: the files are in WORK_DIR/tls) wants "
      "--tls-ca ca.crt --tls-client-cert client.crt --tls-client-key client.key (and --token-file token for the "
      "router); a plaintext server wants none of them.",
      target);
}

/// The hint printed under an error of a call to the router at `router`: nothing answered there, or it is not a router.
std::string router_hint(const grpc::Status& st, const std::string& router,
                        const std::shared_ptr<grpc::Channel>& channel) {
  if (unreachable(st, channel)) {
    if (likely_tls_mismatch(router)) return tls_hint(router);
    if (tcp_open(router)) {
      if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        return fmt::format("hint: the deadline (--timeout-seconds) passed before the call to {} got through; the "
                           "router is reachable: give it more time",
                           router);
      }
      return "";
    }
    return fmt::format(
        "hint: no router answered at {} (--router; default 127.0.0.1:50050, the router's own default --listen): the "
        "router may not be running.\n"
        "      Start a local cluster (router on 127.0.0.1:50050 when that port is free; serves until Ctrl-C):\n"
        "        deploy/local_cluster.py --model DIR --tokenizer FILE\n"
        "      or run the whole demo: scripts/demo.sh; or pass --router HOST:PORT of a running router.",
        router);
  }
  if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    const std::string what = what_serves(router);
    if (!what.empty() && what != "a hypic router") {
      return fmt::format("hint: {} is {}, not a hypic router: pass --router HOST:PORT of the router (the launcher "
                         "prints it: \"hypic cluster ready: router ...\")",
                         router, what);
    }
  }
  return "";
}

std::string not_a_cache(const std::string& target);

/// Prints a failed cache-* call with what explains it: the address serves something else (UNIMPLEMENTED: say what,
/// and where the cache is), nothing answers there, or the TLS settings differ. Returns the exit status (2).
int cache_failed(const grpc::Status& st, const std::string& cache_addr) {
  if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    if (const std::string why = not_a_cache(cache_addr); !why.empty()) {
      std::cerr << "error: " << why << "\n";
      return 2;
    }
  }
  std::string hint;
  if (unreachable(st)) {
    hint = likely_tls_mismatch(cache_addr) ? tls_hint(cache_addr)
           : tcp_open(cache_addr)          ? std::string()
               : fmt::format("hint: no segment cache answered at {} (--cache): is it running? `hypic-client info "
                             "--router HOST:PORT` lists a cluster's cache replicas",
                             cache_addr);
  }
  return rpc_failed(st, false, hint);
}

/// The message for a cache-* command whose --cache address is not a segment cache (its answer was UNIMPLEMENTED):
/// what it is instead and, for a router, the cache replicas it uses. Empty when it cannot be told.
std::string not_a_cache(const std::string& target) {
  const std::string what = what_serves(target);
  if (what.empty() || what == "a hypic segment cache") return "";
  std::string msg = fmt::format("{} is {}, not a segment cache", target, what);
  if (what != "a hypic router") return msg + "; pass --cache HOST:PORT of a segment cache replica";
  auto stub = v1::Router::NewStub(hypic::rpc::make_channel(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ServerInfo info;
  if (!stub->GetServerInfo(&ctx, v1::GetServerInfoRequest{}, &info).ok()) {
    return msg + "; `hypic-client info --router " + target + "` lists its cache replicas";
  }
  if (info.cache_replicas().empty()) return msg + "; the router uses no cache replica (it was started without --cache)";
  return fmt::format("{}; the cache replicas are: {} (e.g. hypic-client cache-stats --cache {})", msg,
                     fmt::join(info.cache_replicas(), ", "), info.cache_replicas(0));
}

/// Where the segments' entries came from, in words: "4 reused from the combine worker's own memory tier (not fetched
/// from the segment cache)", "2 fetched from the segment cache, 2 built for this request by a scatter worker", ...
std::string source_summary(const v1::GenerateReport& r) {
  const bool prefix = r.mode() == "prefix";
  std::vector<std::string> parts;
  for (int src : {v1::SEGMENT_SOURCE_COMBINE_MEMORY, v1::SEGMENT_SOURCE_COMBINE_HOST, v1::SEGMENT_SOURCE_CACHE,
                  v1::SEGMENT_SOURCE_SHARED_BUILD,
                  v1::SEGMENT_SOURCE_REPEAT, v1::SEGMENT_SOURCE_SCATTER, v1::SEGMENT_SOURCE_COMBINE_COMPUTED,
                  v1::SEGMENT_SOURCE_IN_CONTEXT, v1::SEGMENT_SOURCE_UNSPECIFIED}) {
    int n = 0;
    for (const auto& s : r.segments()) n += s.source() == src && !s.refreshed();  // (those are counted below)
    if (n == 0) continue;
    const char* what = "of unknown source";
    switch (src) {
      case v1::SEGMENT_SOURCE_COMBINE_MEMORY:
        what = prefix ? "restored from the combine worker's prefix checkpoint (combine-memory)"
                      : "reused from the combine worker's own memory tier (combine-memory; not fetched from the "
                        "segment cache)";
        break;
      case v1::SEGMENT_SOURCE_COMBINE_HOST:
        what = "copied to the device from the combine worker's host tier (combine-host; not fetched from the segment "
               "cache)";
        break;
      case v1::SEGMENT_SOURCE_CACHE: what = "fetched from the segment cache (cache)"; break;
      case v1::SEGMENT_SOURCE_SHARED_BUILD: what = "joined a build another request had started (shared-build)"; break;
      case v1::SEGMENT_SOURCE_REPEAT: what = "reused from an earlier copy in this prompt (repeat)"; break;
      case v1::SEGMENT_SOURCE_SCATTER: what = "built for this request by a scatter worker (scatter)"; break;
      case v1::SEGMENT_SOURCE_COMBINE_COMPUTED:
        what = "prefilled for this request by the combine worker (combine-computed)";
        break;
      case v1::SEGMENT_SOURCE_IN_CONTEXT: what = "computed in context, no entry (in-context)"; break;
      default: break;
    }
    parts.push_back(fmt::format("{} {}", n, what));
  }
  int refreshed = 0;
  for (const auto& s : r.segments()) refreshed += s.refreshed();
  if (refreshed > 0)
    parts.push_back(fmt::format("{} refreshed (computed in context by the refresh; their entries unused)", refreshed));
  return parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, ", "));
}

void print_report_table(const v1::GenerateReport& r, std::ostream& os) {
  os << fmt::format("\n--- request {} | mode {} w={}{}{} | {} prompt tokens ({} query) | {} generated ({}) | seed {}\n",
                    r.request_id(), r.mode(), r.seam_width(),
                    r.refresh_segments() > 0 ? fmt::format(" refresh={}", r.refresh_segments()) : std::string(),
                    r.refresh_tail() > 0 ? fmt::format(" tail={}", r.refresh_tail()) : std::string(),
                    r.prompt_tokens(), r.query_tokens(), r.completion_tokens(),
                    v1::FinishReason_Name(r.finish_reason()), r.seed());
  os << fmt::format("{:>4} {:>7} {:>5} {:<17} {:<22} {:<7} {:>8} {:>10}  {}\n", "seg", "tokens", "hit", "source",
                    "built by", "on", "ms", "bytes", "note");
  for (const auto& s : r.segments()) {
    os << fmt::format("{:>4} {:>7} {:>5} {:<17} {:<22} {:<7} {:>8.1f} {:>10}  {}\n", s.index(), s.num_tokens(),
                      s.cache_hit() ? "hit" : "miss", hypic::rpc::segment_source_name(s.source()), s.built_by(), s.device(),
                      s.compute_ms(), s.entry_bytes(),
                      s.refreshed() ? (s.note().empty() ? std::string("refreshed: recomputed whole in context")
                                                        : "refreshed: recomputed whole in context; " + s.note())
                                    : s.note());
  }
  os << "entries: " << source_summary(r) << "\n";
  if (r.random_weights_seed() != 0)
    os << fmt::format("BENCHMARK ONLY: the combine worker ran seeded random weights (seed {}): the text is "
                      "meaningless\n",
                      r.random_weights_seed());
  const auto& t = r.ttft();
  // Full and prefix modes splice nothing: their combine-worker phase is an in-context prefill (prefill_ms).
  const bool in_context = r.mode() == "full" || r.mode() == "prefix" || t.prefill_ms() > 0;
  os << fmt::format("TTFT {:.1f} ms = router {:.1f} + lookup {:.1f} + scatter {:.1f} + transfer {:.1f} + {} {:.1f} "
                    "+ first decode {:.1f}\n",
                    t.total_ms(), t.router_ms(), t.lookup_ms(), t.scatter_ms(), t.transfer_ms(),
                    in_context ? "prefill" : "splice", in_context ? t.prefill_ms() : t.splice_ms(),
                    t.first_decode_ms());
  os << fmt::format("decode {:.1f} ms, total {:.1f} ms, combine {} on {} ({}), cache {}, schedule {}, scatter failures "
                    "{}\n",
                    r.decode_ms(), r.total_ms(), r.combine_worker(), r.combine_device(), r.numerics(),
                    r.cache_available() ? "available" : "unavailable",
                    r.schedule_policy(), r.scatter_failures());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hypic client: send prompts to a hypic cluster, check health, inspect the segment cache"};
  app.require_subcommand(1);
  app.fallthrough();  // the options below may also follow the subcommand
  hypic::rpc::TlsFlags tls;
  hypic::rpc::add_client_tls_flags(app, tls);
  // The launcher's --tls exports these for the command it runs (deploy/local_cluster.py).
  app.get_option("--tls-ca")->envname("HYPIC_TLS_CA");
  app.get_option("--tls-client-cert")->envname("HYPIC_TLS_CLIENT_CERT");
  app.get_option("--tls-client-key")->envname("HYPIC_TLS_CLIENT_KEY");
  std::string token_file;
  app.add_option("--token-file", token_file,
                 "file whose first token is sent as 'authorization: Bearer <token>' (routers started with "
                 "--auth-token-file require it)")
      ->envname("HYPIC_TOKEN_FILE");

  // ---- generate ----
  auto* gen = app.add_subcommand("generate", "send segments and a query; stream the answer and print the report");
  std::string router = "127.0.0.1:50050", segments_json, query, query_file, mode, request_id;
  std::vector<std::string> seg_texts, seg_files, stops;
  std::vector<int32_t> stop_ids;
  int max_tokens = 0, top_k = 0, seam_width = 0;
  float temperature = 0.0f, top_p = 1.0f;
  std::string seed_text, timeout_text = "0";
  bool as_json = false, quiet = false, no_cache_write = false, ignore_eos = false, allow_special = false;
  gen->add_option("--router", router,
                  "router host:port (the default is hypic-router's own default --listen, and the port "
                  "deploy/local_cluster.py gives the router when it is free)")
      ->capture_default_str();
  gen->add_option("--segments-json", segments_json,
                  "JSON file: an array of segments (\"text\", {\"text\":..}, {\"tokens\":[ids]}, {\"file\":path}; an "
                  "object may add \"allow_special_tokens\": true) or {\"segments\": [...], \"query\": ...}; token ids "
                  "must be integers in [0, 2^31)");
  gen->add_option("--segment", seg_texts, "segment text (repeat; after --segments-json ones)");
  gen->add_option("--segment-file", seg_files, "file whose bytes are one segment (repeat; after --segment ones)");
  auto* q_opt = gen->add_option("--query", query, "query text");
  gen->add_option("--query-file", query_file, "file holding the query")->excludes(q_opt);
  // Integer values go to the router as they are (it names what it refuses), but only as whole decimal numbers that
  // fit the request's int32 fields (proto/rpc/flags.h).
  namespace hr = hypic::rpc;
  constexpr int kI32Min = std::numeric_limits<int32_t>::min(), kI32Max = std::numeric_limits<int32_t>::max();
  auto* mt_opt = hr::add_strict_int_option(*gen, "--max-tokens", max_tokens, kI32Min, kI32Max,
                                           "tokens to generate (default: the router's)");
  gen->add_option("--temperature", temperature, "0 = greedy")->capture_default_str();
  hr::add_strict_int_option(*gen, "--top-k", top_k, kI32Min, kI32Max, "0 = off")->capture_default_str();
  auto* tp_opt = gen->add_option("--top-p", top_p, "nucleus sampling, (0, 1]");
  auto* seed_opt = gen->add_option("--seed", seed_text, "random seed, an integer in [0, 2^64) (default: chosen by the "
                                                       "router)");
  gen->add_option("--stop", stops, "stop string (repeat)");
  hr::add_strict_int_option(*gen, "--stop-token-id", stop_ids, 0, kI32Max, "stop token id (repeat)");
  gen->add_flag("--ignore-eos", ignore_eos, "do not stop at the end-of-text tokens");
  gen->add_flag("--allow-special-tokens", allow_special,
                "let special-token strings (\"<|im_end|>\"...) in every text segment and the query be special tokens "
                "(default: tokenised as plain text); for text you built yourself, e.g. a chat template");
  gen->add_option("--mode", mode, "hypic | transition | naive | prefix | full");
  auto* sw_opt = hr::add_strict_int_option(*gen, "--seam-width", seam_width, kI32Min, kI32Max,
                                           "seam window w (default: the router's)");
  int refresh_segments = 0;
  auto* refresh_opt = hr::add_strict_int_option(*gen, "--refresh-segments", refresh_segments, kI32Min, kI32Max,
                                                "hypic: recompute whole in context the k segments the query attends "
                                                "to most (default: the router's --refresh-segments)");
  int refresh_tail = 0;
  auto* tail_opt = hr::add_strict_int_option(*gen, "--refresh-tail", refresh_tail, kI32Min, kI32Max,
                                             "hypic: recompute whole in context the last t segments (default: the "
                                             "router's --refresh-tail)");
  gen->add_flag("--no-cache-write", no_cache_write, "do not store this request's segments in the cache");
  gen->add_option("--request-id", request_id, "request id (default: made up by the router)");
  gen->add_option("--timeout-seconds", timeout_text, "deadline of the call: finite seconds > 0 (0: none)")
      ->capture_default_str();
  gen->add_flag("--json", as_json, "print one JSON object {text, token_ids, report} instead of streaming");
  gen->add_flag("--quiet", quiet, "do not stream the text (the report is still printed)");

  // ---- health ----
  auto* health = app.add_subcommand("health", "check (or wait for) a service's gRPC health status");
  std::string target, service;
  std::string wait_text = "0";
  health->add_option("--target", target, "host:port")->required();
  health->add_option("--service", service, "service name (default: the whole server)");
  health->add_option("--wait-seconds", wait_text, "keep checking until SERVING or this long has passed (finite, >= 0)")
      ->capture_default_str();

  // ---- services ----
  auto* services = app.add_subcommand("services", "list the services a server exposes (gRPC server reflection)");
  services->add_option("--target", target, "host:port")->required();

  // ---- info ----
  auto* info = app.add_subcommand("info", "print the router's server info as JSON");
  info->add_option("--router", router, "router host:port")->capture_default_str();

  // ---- cache administration ----
  std::string cache_addr, digest_hex, path, ids_text;
  auto* cstats = app.add_subcommand("cache-stats", "print a cache replica's stats as JSON");
  auto* cget = app.add_subcommand("cache-get", "fetch an entry's bytes (no token check); prints its token ids");
  auto* cput = app.add_subcommand("cache-put", "store bytes as an entry");
  auto* cdel = app.add_subcommand("cache-delete", "remove an entry");
  for (auto* sc : {cstats, cget, cput, cdel}) sc->add_option("--cache", cache_addr, "cache host:port")->required();
  for (auto* sc : {cget, cput, cdel}) sc->add_option("--digest", digest_hex, "32 hex digits")->required();
  cget->add_option("--out", path, "file to write the bytes to")->required();
  cput->add_option("--in", path, "file holding the bytes (at most 64 MiB)")->required()->check(CLI::ExistingFile);
  cput->add_option("--token-ids", ids_text, "comma-separated token ids of the segment")->required();
  std::string mac_hex;
  cput->add_option("--mac-hex", mac_hex, "the entry's MAC as cache-get printed it (an entry moved as is; default: "
                                         "none, which workers with a --cache-key-file refuse)");

  // ---- worker info (operators; under mutual TLS it needs a service certificate) ----
  auto* winfo = app.add_subcommand("worker-info", "print a scatter or combine worker's GetWorkerInfo as JSON");
  std::string worker_role = "auto";
  winfo->add_option("--target", target, "worker host:port")->required();
  winfo->add_option("--role", worker_role, "scatter | combine | auto (the one the worker serves)")
      ->check(CLI::IsMember({"scatter", "combine", "auto"}))
      ->capture_default_str();
  auto* cevents = app.add_subcommand("cache-events", "follow a cache replica's events (stored, evicted, cleared, "
                                                     "moved) as JSON lines (SegmentCache.WatchEvents)");
  bool include_existing = false;
  std::string count_text = "0";
  cevents->add_option("--cache", cache_addr, "cache host:port")->required();
  cevents->add_flag("--include-existing", include_existing, "start with one STORED event per entry held now");
  cevents->add_option("--count", count_text, "stop after this many events (0: follow until interrupted)")
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);

  try {
    // Strict values (named in the error): addresses with a port in [1, 65535], finite durations, integers that fit.
    namespace hc = hypic::client;
    if (*gen || *info) hc::check_address(router, "--router");
    if (*health || *services || *winfo) hc::check_address(target, "--target");
    if (*cstats || *cget || *cput || *cdel || *cevents) hc::check_address(cache_addr, "--cache");
    const double timeout_s = hc::parse_seconds(timeout_text, "--timeout-seconds", true);
    const double wait_s = hc::parse_seconds(wait_text, "--wait-seconds", true);
    const uint64_t seed = seed_text.empty() ? 0 : hc::parse_uint64(seed_text, "--seed");
    const int64_t event_count = hc::parse_integer(count_text, "--count", 0, INT64_MAX);
    for (const auto& [flag, v] : {std::pair{"--temperature", temperature}, std::pair{"--top-p", top_p}}) {
      if (!std::isfinite(v)) throw std::invalid_argument(fmt::format("{}: {} is not a finite number", flag, v));
    }
    hypic::rpc::configure_tls(tls);
    const std::string token = token_file.empty() ? std::string() : hypic::rpc::read_token_file(token_file);
    if (*cevents) {
      auto stub = v1::SegmentCache::NewStub(hypic::rpc::make_channel(cache_addr));
      grpc::ClientContext ctx;
      v1::WatchEventsRequest wreq;
      wreq.set_include_existing(include_existing);
      auto reader = stub->WatchEvents(&ctx, wreq);
      v1::CacheEvent ev;
      int64_t seen = 0;
      while ((event_count == 0 || seen < event_count) && reader->Read(&ev)) {
        json j = proto_json(ev);
        j["digest_hex"] = hypic::rpc::digest_hex(hypic::rpc::parse_digest(ev.digest(), "digest"));
        j.erase("digest");
        std::cout << j.dump() << std::endl;
        ++seen;
      }
      if (event_count > 0 && seen >= event_count) {
        ctx.TryCancel();
        reader->Finish();
        return 0;
      }
      const grpc::Status st = reader->Finish();
      return st.ok() ? 0 : cache_failed(st, cache_addr);
    }
    if (*health) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(wait_s * 1000));
      std::string err;
      for (;;) {
        const int st = hypic::rpc::check_health(target, service, std::chrono::milliseconds(1000), &err);
        if (st == 1) {
          std::cout << "SERVING\n";
          return 0;
        }
        if (st >= 0) err = fmt::format("status {}", st == 2 ? "NOT_SERVING" : st == 3 ? "SERVICE_UNKNOWN" : "UNKNOWN");
        if (std::chrono::steady_clock::now() >= until) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      std::cerr << fmt::format("{} ({}) is not serving: {}\n", target, service.empty() ? "server" : service, err);
      return 1;
    }
    if (*services) {
      try {
        for (const auto& name : hypic::rpc::list_services(hypic::rpc::make_channel(target), std::chrono::seconds(5))) {
          std::cout << name << "\n";
        }
      } catch (const hypic::rpc::RpcError& e) {
        return rpc_failed(e.status(), false);
      }
      return 0;
    }
    if (*winfo) {
      const auto channel = hypic::rpc::make_channel(target);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::WorkerInfo out;
      grpc::Status st;
      if (worker_role != "combine") {
        st = v1::ScatterWorker::NewStub(channel)->GetWorkerInfo(&ctx, v1::WorkerInfoRequest{}, &out);
      }
      // auto: a combine worker answers the scatter worker's method with UNIMPLEMENTED; ask it as a combine worker
      if (worker_role == "combine" || (worker_role == "auto" && st.error_code() == grpc::StatusCode::UNIMPLEMENTED)) {
        grpc::ClientContext ctx2;
        ctx2.set_deadline(ctx.deadline());
        st = v1::CombineWorker::NewStub(channel)->GetWorkerInfo(&ctx2, v1::WorkerInfoRequest{}, &out);
      }
      if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
        return rpc_failed(st, false, fmt::format("{} is not a {}: `hypic-client services --target {}` lists what it "
                                                 "serves", target, worker_role == "auto" ? "scatter or combine worker"
                                                 : worker_role + " worker", target));
      }
      if (!st.ok()) return rpc_failed(st, false);
      std::cout << proto_json(out).dump(2) << std::endl;
      return 0;
    }
    if (*info) {
      const auto channel = hypic::rpc::make_channel(router);
      auto stub = v1::Router::NewStub(channel);
      grpc::ClientContext ctx;
      hypic::rpc::add_bearer(ctx, token);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      v1::ServerInfo out;
      const grpc::Status st = stub->GetServerInfo(&ctx, v1::GetServerInfoRequest{}, &out);
      if (!st.ok()) return rpc_failed(st, false, router_hint(st, router, channel));
      std::cout << proto_json(out).dump(2) << std::endl;
      return 0;
    }
    if (*cstats || *cget || *cput || *cdel) {
      hypic::cache::SegmentCacheClient cache({cache_addr});
      try {
        if (*cstats) {
          std::cout << proto_json(cache.stats(0)).dump(2) << std::endl;
          return 0;
        }
        const auto digest = hypic::rpc::digest_from_hex(digest_hex);
        if (*cget) {
          std::string mac;
          auto got = cache.get_unchecked(digest, &mac);
          if (!got) return rpc_failed(grpc::Status(grpc::StatusCode::NOT_FOUND, "no such entry"), false);
          write_file(path, got->first);
          std::string mac_hex_out;
          for (unsigned char c : mac) mac_hex_out += fmt::format("{:02x}", c);
          std::cout << json{{"bytes", got->first.size()}, {"token_ids", got->second}, {"mac_hex", mac_hex_out}}.dump()
                    << std::endl;
          return 0;
        }
        if (*cput) {
          const auto ids = hypic::client::parse_token_id_list(ids_text, "--token-ids");
          std::optional<std::string> mac;
          if (!mac_hex.empty()) {
            if (mac_hex.size() % 2 != 0 || mac_hex.size() > 128 ||
                mac_hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
              throw std::invalid_argument("--mac-hex: at most 64 bytes as an even number of hex digits");
            }
            mac.emplace();
            for (size_t i = 0; i < mac_hex.size(); i += 2) mac->push_back(char(std::stoi(mac_hex.substr(i, 2), nullptr, 16)));
          }
          const bool replaced = cache.put(hypic::cache::CacheKey{digest, ids}, read_input("--in", path), mac);
          std::cout << json{{"replaced", replaced}}.dump() << std::endl;
          return 0;
        }
        std::cout << json{{"deleted", cache.erase(digest)}}.dump() << std::endl;
        return 0;
      } catch (const hypic::rpc::RpcError& e) {
        return cache_failed(e.status(), cache_addr);
      }
    }

    // ---- generate ----
    v1::GenerateRequest req;
    req.set_request_id(request_id);
    if (!segments_json.empty()) {
      hypic::client::segments_from_json_text(read_input("--segments-json", segments_json),
                                             "--segments-json " + segments_json, &req);
    }
    for (const auto& t : seg_texts) req.add_segments()->set_text(t);
    for (const auto& f : seg_files) req.add_segments()->set_text(read_input("--segment-file", f));
    if (*q_opt) req.mutable_query()->set_text(query);
    if (!query_file.empty()) req.mutable_query()->set_text(read_input("--query-file", query_file));
    if (allow_special) {
      for (auto& seg : *req.mutable_segments())
        if (seg.has_text()) seg.set_allow_special_tokens(true);
      if (req.query().has_text()) req.mutable_query()->set_allow_special_tokens(true);
    }
    auto* s = req.mutable_sampling();
    if (*mt_opt) s->set_max_tokens(max_tokens);
    s->set_temperature(temperature);
    s->set_top_k(top_k);
    if (*tp_opt) s->set_top_p(top_p);
    if (*seed_opt) s->set_seed(seed);
    for (const auto& st : stops) s->add_stop(st);
    for (int32_t id : stop_ids) s->add_stop_token_ids(id);
    s->set_ignore_eos(ignore_eos);
    auto* c = req.mutable_cache();
    c->set_mode(mode);
    if (*sw_opt) c->set_seam_width(seam_width);
    if (*refresh_opt) c->set_refresh_segments(refresh_segments);
    if (*tail_opt) c->set_refresh_tail(refresh_tail);
    if (no_cache_write) c->set_cache_segments(false);

    const auto channel = hypic::rpc::make_channel(router);
    auto stub = v1::Router::NewStub(channel);
    grpc::ClientContext ctx;
    hypic::rpc::add_bearer(ctx, token);
    if (timeout_s > 0) {
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000)));
    }
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse resp;
    std::string text;
    std::vector<int32_t> ids;
    std::optional<v1::GenerateReport> report;
    while (reader->Read(&resp)) {
      if (resp.has_delta()) {
        text += resp.delta().text();
        ids.insert(ids.end(), resp.delta().token_ids().begin(), resp.delta().token_ids().end());
        if (!as_json && !quiet) std::cout << resp.delta().text() << std::flush;
      } else if (resp.has_report()) {
        report = resp.report();
      }
    }
    const grpc::Status st = reader->Finish();
    if (!st.ok()) {
      if (!as_json && !quiet && !text.empty()) std::cout << std::endl;
      return rpc_failed(st, as_json, router_hint(st, router, channel));
    }
    if (as_json) {
      std::cout << json{{"text", text}, {"token_ids", ids}, {"report", report ? proto_json(*report) : json()}}.dump()
                << std::endl;
    } else {
      if (!quiet) std::cout << std::endl;
      if (report) print_report_table(*report, std::cerr);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
