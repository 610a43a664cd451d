#include "proto/rpc/security.h"

#include "proto/rpc/status.h"

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <openssl/crypto.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

namespace hypic::rpc {
namespace {

TlsMaterial g_tls;  // set once by configure_tls, before servers and channels exist
std::vector<std::string> g_service_ids{kDefaultServiceIdentity};  // set once by configure_service_identities

std::string read_file(const std::string& flag, const std::string& path) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::invalid_argument(
        fmt::format("{}: cannot read {}: {}", flag, path, errno ? std::strerror(errno) : "cannot open"));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string read_pem(const std::string& flag, const std::string& path) {
  if (path.empty()) return {};
  std::string s = read_file(flag, path);
  if (s.find("-----BEGIN ") == std::string::npos) {
    throw std::invalid_argument(fmt::format("{}: {} is not a PEM file (no -----BEGIN line)", flag, path));
  }
  return s;
}

std::string trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(" \t\r\n");
  return std::string(s.substr(b, e - b + 1));
}

std::vector<std::string> read_tokens(const std::string& flag, const std::string& path) {
  std::string text = read_file(flag, path);
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);  // a UTF-8 byte-order mark is not part of the token
  std::istringstream in(text);
  std::vector<std::string> out;
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    std::string t = trim(line);
    if (t.empty() || t[0] == '#') continue;
    // Tokens travel in an HTTP/2 header: visible ASCII only (gRPC aborts on anything else).
    for (unsigned char c : t) {
      if (c < 0x21 || c > 0x7E) {
        throw std::invalid_argument(fmt::format("{}: {} line {}: a token may hold only visible ASCII characters "
                                                "(byte 0x{:02x} found)",
                                                flag, path, line_no, c));
      }
    }
    out.push_back(std::move(t));
  }
  if (out.empty()) throw std::invalid_argument(fmt::format("{}: {} holds no token", flag, path));
  return out;
}

std::unique_ptr<X509, decltype(&X509_free)> read_certificate(const std::string& pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(pem.data(), int(pem.size())), &BIO_free);
  return {bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr, &X509_free};
}

// The certificate (first of the chain) and the private key must parse and belong together; an expired certificate
// is refused too (clients would refuse it at every handshake).
void check_key_pair(const char* cert_flag, const std::string& cert_pem, const char* key_flag,
                    const std::string& key_pem) {
  if (cert_pem.empty()) return;
  auto cert = read_certificate(cert_pem);
  if (!cert) throw std::invalid_argument(fmt::format("{}: no certificate could be read from it", cert_flag));
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(key_pem.data(), int(key_pem.size())), &BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr) : nullptr, &EVP_PKEY_free);
  if (!key) throw std::invalid_argument(fmt::format("{}: no private key could be read from it (encrypted?)", key_flag));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    throw std::invalid_argument(fmt::format("{} and {}: the key does not belong to the certificate", cert_flag,
                                            key_flag));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    throw std::invalid_argument(fmt::format("{}: the certificate has expired", cert_flag));
  }
}

bool equal_constant_time(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

void add_tls_flags(CLI::App& app, TlsFlags& f) {
  app.add_option("--tls-cert", f.cert, "PEM certificate chain: serve gRPC and HTTP over TLS (with --tls-key)");
  app.add_option("--tls-key", f.key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", f.client_ca,
                 "PEM CA: require client certificates signed by it (mutual TLS; needs --tls-cert)");
  add_client_tls_flags(app, f);
}

void add_client_tls_flags(CLI::App& app, TlsFlags& f) {
  app.add_option("--tls-ca", f.ca, "PEM CA: call other services over TLS, verifying them against it");
  app.add_option("--tls-client-cert", f.client_cert, "PEM certificate presented to the services called (mTLS)");
  app.add_option("--tls-client-key", f.client_key, "PEM private key of --tls-client-cert");
  app.add_option("--tls-server-name", f.server_name,
                 "name expected in the called services' certificates (default: the host of each address)");
}

TlsMaterial load_tls(const TlsFlags& f) {
  if (f.cert.empty() != f.key.empty()) {
    throw std::invalid_argument("--tls-cert and --tls-key: give both or neither");
  }
  if (f.client_cert.empty() != f.client_key.empty()) {
    throw std::invalid_argument("--tls-client-cert and --tls-client-key: give both or neither");
  }
  if (!f.client_ca.empty() && f.cert.empty()) {
    throw std::invalid_argument("--tls-client-ca: client certificates can only be required over TLS (--tls-cert)");
  }
  if (!f.client_cert.empty() && f.ca.empty()) {
    throw std::invalid_argument("--tls-client-cert: needs --tls-ca (outgoing TLS) to be presented");
  }
  if (!f.server_name.empty() && f.ca.empty()) {
    throw std::invalid_argument("--tls-server-name: needs --tls-ca (outgoing TLS)");
  }
  TlsMaterial m;
  m.cert = read_pem("--tls-cert", f.cert);
  m.key = read_pem("--tls-key", f.key);
  m.client_ca = read_pem("--tls-client-ca", f.client_ca);
  m.ca = read_pem("--tls-ca", f.ca);
  m.client_cert = read_pem("--tls-client-cert", f.client_cert);
  m.client_key = read_pem("--tls-client-key", f.client_key);
  check_key_pair("--tls-cert", m.cert, "--tls-key", m.key);
  check_key_pair("--tls-client-cert", m.client_cert, "--tls-client-key", m.client_key);
  for (const auto& [flag, pem] : {std::pair{"--tls-client-ca", &m.client_ca}, std::pair{"--tls-ca", &m.ca}}) {
    if (!pem->empty() && !read_certificate(*pem)) {
      throw std::invalid_argument(fmt::format("{}: no certificate could be read from it", flag));
    }
  }
  m.server_name = f.server_name;
  m.cert_path = f.cert;
  m.key_path = f.key;
  m.client_ca_path = f.client_ca;
  return m;
}

void configure_tls(TlsMaterial material) { g_tls = std::move(material); }
void configure_tls(const TlsFlags& flags) { configure_tls(load_tls(flags)); }
const TlsMaterial& tls_material() { return g_tls; }

std::shared_ptr<grpc::ServerCredentials> server_credentials() {
  if (!g_tls.serving()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions opts(g_tls.client_ca.empty()
                                             ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                             : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  opts.pem_root_certs = g_tls.client_ca;
  opts.pem_key_cert_pairs.push_back({g_tls.key, g_tls.cert});
  return grpc::SslServerCredentials(opts);
}

std::shared_ptr<grpc::ChannelCredentials> channel_credentials() {
  if (!g_tls.calling()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions opts;
  opts.pem_root_certs = g_tls.ca;
  opts.pem_private_key = g_tls.client_key;
  opts.pem_cert_chain = g_tls.client_cert;
  return grpc::SslCredentials(opts);
}

void add_service_identity_flag(CLI::App& app, std::vector<std::string>& names) {
  app.add_option("--tls-service-identity", names,
                 "with --tls-client-ca: a certificate identity (subject CN or subjectAltName) allowed to call this "
                 "internal service (repeatable; default hypic-service); other certificates (users) are refused")
      ->capture_default_str();
}

void configure_service_identities(std::vector<std::string> names) {
  std::erase_if(names, [](const std::string& n) { return n.empty(); });
  g_service_ids = names.empty() ? std::vector<std::string>{kDefaultServiceIdentity} : std::move(names);
}

void log_caller_policy(const std::string& role) {
  if (!g_tls.client_ca.empty()) {
    spdlog::info("{}: internal RPCs accepted only from certificates of a service identity ({}); users are refused",
                 role, fmt::join(g_service_ids, ", "));
  } else {
    spdlog::warn("{}: no --tls-client-ca: callers present no certificate, so any caller that reaches this port may "
                 "call its internal RPCs (keep it on a private network; deploy/README.md \"Trust model\")",
                 role);
  }
}

std::vector<std::string> peer_identities(const grpc::ServerContext& context) {
  std::vector<std::string> out;
  const auto auth = context.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return out;
  for (const char* prop : {"x509_common_name", "x509_subject_alternative_name"}) {
    for (const auto& v : auth->FindPropertyValues(prop)) out.emplace_back(v.data(), v.size());
  }
  return out;
}

grpc::Status require_service_caller(const grpc::ServerContext& context, std::string_view rpc) {
  if (g_tls.client_ca.empty()) return grpc::Status::OK;
  const auto ids = peer_identities(context);
  for (const auto& id : ids) {
    for (const auto& allowed : g_service_ids) {
      if (id == allowed) return grpc::Status::OK;
    }
  }
  std::string who = ids.empty() ? std::string("no certificate identity") : untrusted(ids.front(), 100);
  return {grpc::StatusCode::PERMISSION_DENIED,
          fmt::format("{} is for hypic services only: the caller's certificate ({}) is not a service identity "
                      "(--tls-service-identity); users call the router",
                      rpc, who)};
}

BearerTokens BearerTokens::load(const std::string& path, const std::string& flag) {
  return of(read_tokens(flag, path));
}

BearerTokens BearerTokens::of(std::vector<std::string> tokens) {
  BearerTokens b;
  for (auto& t : tokens) {
    if (!t.empty()) b.tokens_.push_back(std::move(t));
  }
  return b;
}

bool BearerTokens::accepts(std::string_view authorization) const {
  if (!enabled()) return true;
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(authorization[i])) != kScheme[i]) return false;
  }
  const std::string token = trim(authorization.substr(kScheme.size()));
  bool ok = false;
  for (const auto& t : tokens_) ok |= equal_constant_time(token, t);  // no early exit: time does not tell which
  return ok;
}

grpc::Status BearerTokens::check(const grpc::ServerContext& context) const {
  if (!enabled()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  const auto it = md.find("authorization");
  if (it == md.end()) {
    return {grpc::StatusCode::UNAUTHENTICATED,
            "missing bearer token: send the metadata 'authorization: Bearer <token>' (hypic-client --token-file)"};
  }
  if (!accepts(std::string_view(it->second.data(), it->second.size()))) {
    return {grpc::StatusCode::UNAUTHENTICATED, "bearer token not accepted"};
  }
  return grpc::Status::OK;
}

std::string read_token_file(const std::string& path, const std::string& flag) {
  return read_tokens(flag, path).front();
}

void add_bearer(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
}

}  // namespace hypic::rpc
