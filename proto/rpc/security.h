// Transport security and bearer tokens, shared by every hypic service, the HTTP front and the client.
//
// TLS (gRPC's own, BoringSSL/OpenSSL underneath; certificates in PEM files):
// - serving: --tls-cert + --tls-key turn TLS on for the service's gRPC port and its HTTP endpoints (metrics, the
//   OpenAI front); --tls-client-ca additionally requires every client to present a certificate signed by that CA
//   (mutual TLS between services).
// - calling: --tls-ca turns TLS on for every channel the process opens (make_channel, proto/rpc/server.h) and
//   verifies the servers against that CA; --tls-client-cert + --tls-client-key present a certificate to them
//   (needed where the server sets --tls-client-ca); --tls-server-name checks the servers' certificates against that
//   name instead of the host in the address (e.g. services reached by IP with certificates issued for a DNS name).
// Both are process-wide: configure_tls() once in main(), before the first channel or server.
//
// Bearer tokens (the public APIs: Router, the HTTP front): --auth-token-file names a file of accepted tokens, one
// per line (blank lines and lines starting with '#' ignored; surrounding whitespace trimmed), so a token can be
// rotated by listing old and new. A call must carry `authorization: Bearer <token>` (gRPC metadata or HTTP
// header); otherwise gRPC UNAUTHENTICATED / HTTP 401. Tokens are compared in constant time. Health checks stay
// open (probes carry no token).
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

namespace hypic::rpc {

/// The TLS flags of a process (file paths; empty = not set).
struct TlsFlags {
  std::string cert;         ///< --tls-cert: PEM certificate chain this process serves with
  std::string key;          ///< --tls-key: PEM private key of that certificate
  std::string client_ca;    ///< --tls-client-ca: PEM CA that client certificates must chain to (mTLS); needs cert
  std::string ca;           ///< --tls-ca: PEM CA the servers this process calls must chain to; turns outgoing TLS on
  std::string client_cert;  ///< --tls-client-cert: PEM certificate presented to servers (mTLS)
  std::string client_key;   ///< --tls-client-key: its PEM private key
  std::string server_name;  ///< --tls-server-name: expected name in the servers' certificates (default: the host)

  bool serving() const { return !cert.empty(); }
  bool calling() const { return !ca.empty(); }
};

/// Registers the --tls-* flags above on `app`.
void add_tls_flags(CLI::App& app, TlsFlags& flags);
/// Registers only the calling side's flags (--tls-ca, --tls-client-cert, --tls-client-key, --tls-server-name), for
/// clients that serve nothing.
void add_client_tls_flags(CLI::App& app, TlsFlags& flags);

/// PEM contents of a TLS configuration, read from the files (what the credentials are built from).
struct TlsMaterial {
  std::string cert, key, client_ca, ca, client_cert, client_key, server_name;
  std::string cert_path, key_path, client_ca_path;  ///< the serving files' paths (the HTTP servers load them)
  bool serving() const { return !cert.empty(); }
  bool calling() const { return !ca.empty(); }
};

/// Reads and checks the files of `flags`. Throws std::invalid_argument naming the flag when a file cannot be read
/// (with the reason) or is not PEM, when only one of --tls-cert/--tls-key (or of --tls-client-cert/--tls-client-key)
/// is given, when --tls-client-ca is given without --tls-cert, or when a client certificate is given without --tls-ca.
TlsMaterial load_tls(const TlsFlags& flags);

/// Makes `material` the process-wide TLS configuration used by server_credentials(), channel_credentials() and
/// make_channel(). Call once from main() before any server or channel is made (not thread-safe against them).
void configure_tls(TlsMaterial material);
/// load_tls + configure_tls.
void configure_tls(const TlsFlags& flags);
/// The process-wide configuration (empty until configure_tls).
const TlsMaterial& tls_material();

/// Credentials for the process's gRPC server: TLS (requiring verified client certificates when client_ca is set)
/// or insecure.
std::shared_ptr<grpc::ServerCredentials> server_credentials();
/// Credentials for outgoing channels: TLS against the configured CA (with the client certificate when set) or
/// insecure.
std::shared_ptr<grpc::ChannelCredentials> channel_credentials();

/// Caller identities (mutual TLS). Users and services hold certificates of distinct identities from the same CA
/// (scripts/make_certs.sh: CN hypic-service for the services, CN hypic-user for users). The internal services
/// (segment cache, scatter and combine workers) accept their RPCs only from a service identity: a certificate whose
/// subject CN or one of whose subjectAltNames (DNS, URI) equals one of the names configured here (default:
/// "hypic-service"; --tls-service-identity, repeatable). Users may only call the router's public RPCs (and health
/// checks). Without --tls-client-ca nobody presents a certificate, so there is no identity to check and every caller
/// is accepted (log_caller_policy says so at start-up).
inline constexpr const char* kDefaultServiceIdentity = "hypic-service";

/// Registers --tls-service-identity NAME (repeatable) on `app`, into `names` (which keeps its default when the flag is
/// not given).
void add_service_identity_flag(CLI::App& app, std::vector<std::string>& names);
/// Makes `names` the process-wide service identities (empty: the default). Call once from main(), like
/// configure_tls.
void configure_service_identities(std::vector<std::string> names);
/// Logs, once at start-up, who may call this internal service: the identities, or a warning that every caller is
/// accepted (no client certificates required).
void log_caller_policy(const std::string& role);
/// The identities of the call's peer certificate: its subject CN and subjectAltNames (empty without mutual TLS).
std::vector<std::string> peer_identities(const grpc::ServerContext& context);
/// OK when the caller may call an internal RPC: mutual TLS is off (no identities to check), or its certificate names
/// a service identity. Otherwise PERMISSION_DENIED naming `rpc` and the certificate's identity (escaped, cut).
grpc::Status require_service_caller(const grpc::ServerContext& context, std::string_view rpc);

/// A set of accepted bearer tokens (see the file comment). Empty set: authentication off, every call accepted.
class BearerTokens {
 public:
  BearerTokens() = default;
  /// Reads `path` (one token per line). Throws std::invalid_argument naming `flag` and the file when it cannot be
  /// read (with the reason) or holds no token.
  static BearerTokens load(const std::string& path, const std::string& flag = "--auth-token-file");
  /// From a list of tokens (tests); empty strings are ignored.
  static BearerTokens of(std::vector<std::string> tokens);

  bool enabled() const { return !tokens_.empty(); }
  /// True when `authorization` (the header's value, e.g. "Bearer abc") names an accepted token, or when
  /// authentication is off. The scheme is matched case-insensitively, the token exactly (constant time).
  bool accepts(std::string_view authorization) const;
  /// Checks the call's `authorization` metadata: OK, or UNAUTHENTICATED saying whether the token was missing or not
  /// accepted (the token itself is never echoed).
  grpc::Status check(const grpc::ServerContext& context) const;

 private:
  std::vector<std::string> tokens_;
};

/// The first token of a token file (for clients; same format as BearerTokens::load, same errors).
std::string read_token_file(const std::string& path, const std::string& flag = "--token-file");

/// Adds `authorization: Bearer <token>` to an outgoing call's metadata (nothing when token is empty).
void add_bearer(grpc::ClientContext& context, const std::string& token);

}  // namespace hypic::rpc
