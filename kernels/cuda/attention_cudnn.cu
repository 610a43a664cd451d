// cuDNN's fused SDPA forward for attention_prefill's long groups, loaded at run time (attention_cudnn.h).
#include "kernels/cuda/attention_cudnn.h"

#include <cuda_bf16.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_check.h"

#if HYPIC_CUDNN_HEADERS
#include <cudnn_graph.h>
#endif

namespace hypic::kernels::cuda::detail {

#if HYPIC_CUDNN_HEADERS
namespace {

// The cuDNN entry points used here, resolved from libcudnn.so.9 (which loads its sub-libraries itself).
struct CudnnApi {
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
  std::string why_not;  // empty: loaded
};

template <typename F>
bool resolve(void* lib, const char* name, F& f, std::string& why) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f && why.empty()) why = std::string("libcudnn.so.9 lacks ") + name;
  return f != nullptr;
}

// HYPIC_ATTN_CUDNN, checked: "" (unset), "0", "1" or "all"; anything else throws std::invalid_argument.
std::string cudnn_sdpa_mode_env() {
  const char* e = std::getenv("HYPIC_ATTN_CUDNN");
  const std::string v = e ? e : "";
  if (v.empty() || v == "0" || v == "1" || v == "all") return v;
  throw std::invalid_argument("HYPIC_ATTN_CUDNN must be 0, 1 or all, got '" + v + "'");
}

const CudnnApi& api() {
  // Leaked on purpose: workspaces with static lifetime may destroy their plans after this would have been destroyed.
  static const CudnnApi& a = *new CudnnApi([] {
    CudnnApi r;
    const std::string env = cudnn_sdpa_mode_env();
    if (env == "0") {
      r.why_not = "HYPIC_ATTN_CUDNN=0";
      return r;
    }
    void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      r.why_not = std::string("libcudnn.so.9 not loadable: ") + (e ? e : "?");
      return r;
    }
    std::string& w = r.why_not;
    resolve(lib, "cudnnGetVersion", r.GetVersion, w);
    resolve(lib, "cudnnGetErrorString", r.GetErrorString, w);
    resolve(lib, "cudnnGetLastErrorString", r.GetLastErrorString, w);
    resolve(lib, "cudnnCreate", r.Create, w);
    resolve(lib, "cudnnDestroy", r.Destroy, w);
    resolve(lib, "cudnnSetStream", r.SetStream, w);
    resolve(lib, "cudnnBackendCreateDescriptor", r.CreateDescriptor, w);
    resolve(lib, "cudnnBackendDestroyDescriptor", r.DestroyDescriptor, w);
    resolve(lib, "cudnnBackendSetAttribute", r.SetAttribute, w);
    resolve(lib, "cudnnBackendGetAttribute", r.GetAttribute, w);
    resolve(lib, "cudnnBackendFinalize", r.Finalize, w);
    resolve(lib, "cudnnBackendExecute", r.Execute, w);
    if (w.empty() && r.GetVersion() < 90000)
      w = "libcudnn.so.9 reports version " + std::to_string(r.GetVersion()) + " (9.0 or later needed)";
    return r;
  }());
  return a;
}

[[noreturn]] void fail(const char* what, cudnnStatus_t st) {
  char msg[512] = {0};
  api().GetLastErrorString(msg, sizeof msg);
  throw std::runtime_error(std::string("cuDNN SDPA: ") + what + ": " + api().GetErrorString(st) +
                           (msg[0] ? std::string(" (") + msg + ")" : std::string()));
}

void ok(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) fail(what, st);
}

// One backend descriptor, destroyed with its owner.
struct Desc {
  cudnnBackendDescriptor_t d = nullptr;
  explicit Desc(cudnnBackendDescriptorType_t t) { ok(api().CreateDescriptor(t, &d), "create descriptor"); }
  ~Desc() {
    if (d) api().DestroyDescriptor(d);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  template <typename T>
  Desc& set(cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t, const T* v, int64_t n = 1) {
    ok(api().SetAttribute(d, a, t, n, v), "set attribute");
    return *this;
  }
  Desc& set_desc(cudnnBackendAttributeName_t a, const Desc& o) {
    return set(a, CUDNN_TYPE_BACKEND_DESCRIPTOR, &o.d);
  }
  void finalize(const char* what) { ok(api().Finalize(d), what); }
};

}  // namespace

// The descriptors of one plan (kept alive together: the plan refers to its graph's tensors and operations).
struct CudnnSdpa::Plan {
  std::vector<std::unique_ptr<Desc>> keep;
  Desc* plan = nullptr;
  int64_t workspace = 0;
  bool supported = false;
  std::string why_not;  // when not supported: the stage and cuDNN's message
};

struct CudnnSdpa::Impl {
  cudnnHandle_t handle = nullptr;
  int device = -1;
  std::map<CudnnSdpaShape, std::unique_ptr<Plan>> plans;
  std::list<CudnnSdpaShape> lru;  // front: most recent
  std::string broken;  // a cuDNN failure outside one shape's plan (the handle, the library): cuDNN off, why

  // Tensor ids of the variant pack.
  enum : int64_t { kQ = 1, kK, kV, kO, kScale, kNegInf, kSkv, kSq, kVirtual = 100 };

  std::unique_ptr<Plan> build(const CudnnSdpaShape& s) {
    auto p = std::make_unique<Plan>();
    auto mk = [&](cudnnBackendDescriptorType_t t) -> Desc& {
      p->keep.push_back(std::make_unique<Desc>(t));
      return *p->keep.back();
    };
    int64_t next_virtual = kVirtual;
    const int64_t align = 16;
    auto tensor = [&](cudnnDataType_t dt, std::vector<int64_t> dims, std::vector<int64_t> strides, int64_t uid,
                      bool is_virtual, bool by_value = false) -> Desc& {
      Desc& t = mk(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
      t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &dt)
          .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), int64_t(dims.size()))
          .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), int64_t(strides.size()))
          .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid)
          .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &align)
          .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual);
      if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
      t.finalize("tensor descriptor");
      return t;
    };
    const int64_t b = s.b, h = s.num_heads, hk = s.num_kv_heads, sq = s.s_q, skv = s.s_kv, d = s.head_dim;
    // Q / O: [b][s_q][h][d] rows; K^T / V over [b][hk][s_kv][d] (as gather_kv writes them).
    const std::vector<int64_t> q_strides{sq * h * d, d, h * d, 1};
    Desc& Q = tensor(CUDNN_DATA_BFLOAT16, {b, h, sq, d}, q_strides, kQ, false);
    Desc& KT = tensor(CUDNN_DATA_BFLOAT16, {b, hk, d, skv}, {hk * skv * d, skv * d, 1, d}, kK, false);
    Desc& V = tensor(CUDNN_DATA_BFLOAT16, {b, hk, skv, d}, {hk * skv * d, skv * d, d, 1}, kV, false);
    Desc& O = tensor(CUDNN_DATA_BFLOAT16, {b, h, sq, d}, q_strides, kO, false);
    const std::vector<int64_t> one{1, 1, 1, 1};
    Desc& scale = tensor(CUDNN_DATA_FLOAT, one, one, kScale, false, true);
    Desc& neg_inf = tensor(CUDNN_DATA_FLOAT, one, one, kNegInf, false, true);
    const std::vector<int64_t> sd{b, h, sq, skv}, ss{h * sq * skv, sq * skv, skv, 1};
    const std::vector<int64_t> rd{b, h, sq, 1}, rs{h * sq, sq, 1, 1};
    auto virt = [&](cudnnDataType_t dt, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides) -> Desc& {
      return tensor(dt, dims, strides, next_virtual++, true);
    };
    std::vector<Desc*> ops;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT, i32 = CUDNN_DATA_INT32, boolean = CUDNN_DATA_BOOLEAN;
    auto pointwise = [&](cudnnPointwiseMode_t mode, cudnnDataType_t prec, Desc& x, Desc* bb, Desc* tt, Desc& y,
                         int64_t axis = -1) {
      Desc& pw = mk(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
      pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode)
          .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &prec);
      if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
      pw.finalize("pointwise descriptor");
      Desc& op = mk(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
      op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw).set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
      if (bb) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *bb);
      if (tt) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *tt);
      op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y).finalize("pointwise operation");
      ops.push_back(&op);
    };
    auto reduction = [&](cudnnReduceTensorOp_t mode, Desc& x, Desc& y) {
      Desc& rd_ = mk(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
      rd_.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode)
          .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32)
          .finalize("reduction descriptor");
      Desc& op = mk(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
      op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd_)
          .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
          .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
          .finalize("reduction operation");
      ops.push_back(&op);
    };
    auto matmul = [&](Desc& a, Desc& bb, Desc& c) {
      Desc& mm = mk(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
      mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32).finalize("matmul descriptor");
      Desc& op = mk(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
      op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
          .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, bb)
          .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
          .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm)
          .finalize("matmul operation");
      ops.push_back(&op);
    };
    // S = Q K^T, * scale.
    Desc& S = virt(f32, sd, ss);
    matmul(Q, KT, S);
    Desc& S1 = virt(f32, sd, ss);
    pointwise(CUDNN_POINTWISE_MUL, f32, S, &scale, nullptr, S1);
    // Causal by the bottom-right diagonal: keep row + s_kv - s_q >= col.
    Desc& row = virt(i32, sd, ss);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, f32, S1, nullptr, nullptr, row, 2);
    Desc& col = virt(i32, sd, ss);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, f32, S1, nullptr, nullptr, col, 3);
    Desc* shifted = &row;
    if (skv != sq || s.runtime_offset) {  // (the lengths are by-value tensors: run() passes them)
      Desc& skv_t = tensor(CUDNN_DATA_INT32, one, one, kSkv, false, true);
      Desc& sq_t = tensor(CUDNN_DATA_INT32, one, one, kSq, false, true);
      Desc& r1 = virt(i32, sd, ss);
      pointwise(CUDNN_POINTWISE_ADD, i32, row, &skv_t, nullptr, r1);
      Desc& r2 = virt(i32, sd, ss);
      pointwise(CUDNN_POINTWISE_SUB, i32, r1, &sq_t, nullptr, r2);
      shifted = &r2;
    }
    Desc& keep = virt(boolean, sd, ss);
    pointwise(CUDNN_POINTWISE_CMP_GE, boolean, *shifted, &col, nullptr, keep);
    Desc& S2 = virt(f32, sd, ss);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, f32, S1, &neg_inf, &keep, S2);
    // Softmax over the keys: max, exp(S - max), sum, divide (P in bf16 for the second product).
    Desc& mx = virt(f32, rd, rs);
    reduction(CUDNN_REDUCE_TENSOR_MAX, S2, mx);
    Desc& sub = virt(f32, sd, ss);
    pointwise(CUDNN_POINTWISE_SUB, f32, S2, &mx, nullptr, sub);
    Desc& ex = virt(f32, sd, ss);
    pointwise(CUDNN_POINTWISE_EXP, f32, sub, nullptr, nullptr, ex);
    Desc& sum = virt(f32, rd, rs);
    reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
    // The softmax statistics max + log(sum) into a virtual tensor: unused here, but the engines' pattern for the
    // fused SDPA includes them (without, the graph is not recognised).
    Desc& lg = virt(f32, rd, rs);
    pointwise(CUDNN_POINTWISE_LOG, f32, sum, nullptr, nullptr, lg);
    Desc& stats = virt(f32, rd, rs);
    pointwise(CUDNN_POINTWISE_ADD, f32, mx, &lg, nullptr, stats);
    Desc& P = virt(CUDNN_DATA_BFLOAT16, sd, ss);
    pointwise(CUDNN_POINTWISE_DIV, f32, ex, &sum, nullptr, P);
    matmul(P, V, O);

    Desc& graph = mk(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    std::vector<cudnnBackendDescriptor_t> raw;
    for (Desc* o : ops) raw.push_back(o->d);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, raw.data(), int64_t(raw.size()))
        .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle);
    auto reject = [&](const char* stage, cudnnStatus_t st) {
      char msg[512] = {0};
      api().GetLastErrorString(msg, sizeof msg);
      p->why_not = std::string(stage) + ": " + api().GetErrorString(st) + (msg[0] ? std::string(" (") + msg + ")" : "");
    };
    cudnnStatus_t st = api().Finalize(graph.d);
    if (st >= 3000 && st < 4000) {  // CUDNN_STATUS_NOT_SUPPORTED_*
      reject("operation graph", st);
      return p;
    }
    ok(st, "operation graph");

    Desc& heur = mk(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
    st = api().Finalize(heur.d);
    if (st >= 3000 && st < 4000) {
      reject("engine heuristics", st);
      return p;
    }
    ok(st, "engine heuristics");
    int64_t count = 0;
    ok(api().GetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
       "heuristics result count");
    if (count <= 0) {
      p->why_not = "engine heuristics: no engine config";
      return p;
    }
    std::vector<Desc*> cfgs;
    std::vector<cudnnBackendDescriptor_t> cfg_raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.push_back(&mk(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      cfg_raw.push_back(cfgs.back()->d);
    }
    int64_t got = 0;
    ok(api().GetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                          cfg_raw.data()),
       "heuristics results");
    for (int64_t i = 0; i < got; ++i) {
      auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle)
          .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[i]);
      st = api().Finalize(plan->d);
      if (st != CUDNN_STATUS_SUCCESS) {  // this engine cannot run it: the next one
        if (p->why_not.empty()) reject("execution plan", st);
        continue;
      }
      int64_t n = 0;
      ok(api().GetAttribute(plan->d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                            &p->workspace),
         "plan workspace size");
      p->keep.push_back(std::move(plan));
      p->plan = p->keep.back().get();
      p->supported = true;
      break;
    }
    return p;
  }
};

CudnnSdpa::CudnnSdpa() : impl_(std::make_unique<Impl>()) {}

CudnnSdpa::~CudnnSdpa() {
  if (!impl_) return;
  impl_->plans.clear();
  if (impl_->handle) api().Destroy(impl_->handle);
}

void CudnnSdpa::trim(cudaStream_t stream) {
  Impl& m = *impl_;
  if (int(m.plans.size()) <= kMaxPlans) return;
  check_cuda(cudaStreamSynchronize(stream), "CudnnSdpa::trim");  // a plan's last launch may still run
  while (int(m.plans.size()) > kMaxPlans && !m.lru.empty()) {  // least recently used first
    m.plans.erase(m.lru.back());
    m.lru.pop_back();
  }
}

size_t CudnnSdpa::plans() const { return impl_->plans.size(); }

bool CudnnSdpa::prepare(const CudnnSdpaShape& s, size_t* workspace_bytes) {
  if (!cudnn_sdpa_available()) return false;
  Impl& m = *impl_;
  if (!m.broken.empty()) return false;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  try {
    if (m.handle && dev != m.device) {  // another device: its plans do not carry over
      int cur = dev;
      check_cuda(cudaSetDevice(m.device), "cudaSetDevice");  // their last launches done first
      const cudaError_t e = cudaDeviceSynchronize();
      check_cuda(cudaSetDevice(cur), "cudaSetDevice");
      check_cuda(e, "CudnnSdpa: synchronise the previous device");
      m.plans.clear();
      m.lru.clear();
      api().Destroy(m.handle);
      m.handle = nullptr;
    }
    if (!m.handle) {
      ok(api().Create(&m.handle), "cudnnCreate");
      m.device = dev;
    }
  } catch (const std::exception& e) {  // the library cannot serve this process: our kernels from now on
    m.broken = e.what();
    std::fprintf(stderr, "hypic attention: cuDNN SDPA disabled (%s); our kernels run every group\n", e.what());
    return false;
  }
  auto it = m.plans.find(s);
  if (it == m.plans.end()) {  // built on first sight (no eviction here: the caller's other runs may hold plans)
    std::unique_ptr<Plan> plan;
    try {
      plan = m.build(s);
    } catch (const std::exception& e) {  // any cuDNN error while building: this shape runs on our kernels
      plan = std::make_unique<Plan>();
      plan->why_not = e.what();
    }
    it = m.plans.emplace(s, std::move(plan)).first;
    m.lru.push_front(s);
    if (!it->second->supported)  // once per shape while it stays cached: our kernel runs these groups
      std::fprintf(stderr,
                   "hypic attention: cuDNN SDPA has no plan for b %d, s_q %d, s_kv %d, heads %d/%d, head_dim %d "
                   "(%s); our kernel runs it\n",
                   s.b, s.s_q, s.s_kv, s.num_heads, s.num_kv_heads, s.head_dim, it->second->why_not.c_str());
  } else {
    for (auto l = m.lru.begin(); l != m.lru.end(); ++l)
      if (!(*l < s) && !(s < *l)) {
        m.lru.splice(m.lru.begin(), m.lru, l);
        break;
      }
  }
  if (!it->second->supported) return false;
  *workspace_bytes = size_t(it->second->workspace);
  return true;
}

void CudnnSdpa::run(const CudnnSdpaShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                    float scale, __nv_bfloat16* out, void* workspace, int q_len, int kv_len, cudaStream_t stream) {
  Impl& m = *impl_;
  auto it = m.plans.find(s);
  if (it == m.plans.end() || !it->second->supported)
    throw std::logic_error("CudnnSdpa::run: no plan for b " + std::to_string(s.b) + ", s_q " + std::to_string(s.s_q) +
                           ", s_kv " + std::to_string(s.s_kv) + " (prepare it first)");
  const bool lengths_ok = s.runtime_offset ? q_len >= 1 && q_len <= s.s_q && kv_len >= q_len && kv_len <= s.s_kv &&
                                               kv_len - q_len <= s.s_kv - s.s_q
                                           : q_len == s.s_q && kv_len == s.s_kv;
  if (!lengths_ok)
    throw std::logic_error("CudnnSdpa::run: lengths q " + std::to_string(q_len) + ", kv " + std::to_string(kv_len) +
                           " do not fit the plan's s_q " + std::to_string(s.s_q) + ", s_kv " + std::to_string(s.s_kv) +
                           (s.runtime_offset ? " (padded)" : ""));
  ok(api().SetStream(m.handle, stream), "cudnnSetStream");
  float neg_inf = -INFINITY;
  int32_t skv = kv_len, sq = q_len;
  std::vector<int64_t> uids{Impl::kQ, Impl::kK, Impl::kV, Impl::kO, Impl::kScale, Impl::kNegInf};
  std::vector<void*> ptrs{const_cast<__nv_bfloat16*>(q), const_cast<__nv_bfloat16*>(k), const_cast<__nv_bfloat16*>(v),
                          out, &scale, &neg_inf};
  if (s.s_kv != s.s_q || s.runtime_offset) {
    uids.push_back(Impl::kSkv), ptrs.push_back(&skv);
    uids.push_back(Impl::kSq), ptrs.push_back(&sq);
  }
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), int64_t(uids.size()))
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(), int64_t(ptrs.size()))
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace)
      .finalize("variant pack");
  ok(api().Execute(m.handle, it->second->plan->d, pack.d), "execute");
}

bool cudnn_sdpa_available() { return api().why_not.empty(); }

bool cudnn_sdpa_all_long_groups() { return cudnn_sdpa_mode_env() == "all"; }

std::string cudnn_sdpa_unavailable_reason() { return api().why_not; }

#else  // built without cuDNN's headers

struct CudnnSdpa::Plan {};
struct CudnnSdpa::Impl {};
CudnnSdpa::CudnnSdpa() = default;
CudnnSdpa::~CudnnSdpa() = default;
void CudnnSdpa::trim(cudaStream_t) {}
size_t CudnnSdpa::plans() const { return 0; }
bool CudnnSdpa::prepare(const CudnnSdpaShape&, size_t*) { return false; }
void CudnnSdpa::run(const CudnnSdpaShape&, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, float,
                    __nv_bfloat16*, void*, int, int, cudaStream_t) {
  throw std::logic_error("CudnnSdpa::run: built without cuDNN");
}
bool cudnn_sdpa_available() { return false; }
bool cudnn_sdpa_all_long_groups() { return false; }
std::string cudnn_sdpa_unavailable_reason() { return "built without cuDNN's headers"; }

#endif

namespace {

// One block per (sequence, 8 slots): each warp copies one slot's K and V rows ([num_kv_heads][head_dim] bf16) in
// 16-byte pieces, or zeroes them for the padding slots s_kv .. s_kv_pad-1.
__global__ void gather_kv_kernel(int s_kv, int s_kv_pad, int num_kv_heads, int head_vec,
                                 const int* __restrict__ block_table, int max_pages, int group0,
                                 const uint4* __restrict__ k_pool, const uint4* __restrict__ v_pool,
                                 uint4* __restrict__ k_out, uint4* __restrict__ v_out) {
  const int j = blockIdx.y;
  const int slot = blockIdx.x * 8 + threadIdx.y;
  if (slot >= s_kv_pad) return;
  const int row_vec = num_kv_heads * head_vec;
  const bool pad = slot >= s_kv;  // (warp-uniform)
  const long page = pad ? 0 : block_table[static_cast<long>(group0 + j) * max_pages + slot / kKvPageTokens];
  const long src = (page * kKvPageTokens + slot % kKvPageTokens) * row_vec;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < row_vec; i += 32) {
    const int h = i / head_vec, e = i - h * head_vec;
    const long dst = ((static_cast<long>(j) * num_kv_heads + h) * s_kv_pad + slot) * head_vec + e;
    k_out[dst] = pad ? zero : __ldg(k_pool + src + i);
    v_out[dst] = pad ? zero : __ldg(v_pool + src + i);
  }
}

// One thread per 8 elements (16 bytes) of an output row.
__global__ void output_gate_kernel(long n_vec, int num_heads, int head_dim, const __nv_bfloat16* __restrict__ gate,
                                   long gate_ts, int gate_hs, uint4* __restrict__ out) {
  const int head_vec = head_dim / 8;
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < n_vec; i += long(gridDim.x) * blockDim.x) {
    const long row = i / head_vec;  // t * num_heads + h
    const int e = int(i - row * head_vec);
    const long t = row / num_heads;
    const int h = int(row - t * num_heads);
    uint4 v = out[i];
    __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(&v);
    const __nv_bfloat16* g = gate + t * gate_ts + long(h) * gate_hs + e * 8;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      x[k] = __float2bfloat16(__bfloat162float(x[k]) * sigmoidf_(__bfloat162float(g[k])));
    }
    out[i] = v;
  }
}

int grid_for(long n) { return static_cast<int>(std::min<long>((n + 255) / 256, 132L * 16)); }

}  // namespace

void gather_kv(int num_seqs, int s_kv, int s_kv_pad, int num_kv_heads, int head_dim, const int* block_table,
               int max_pages, int group0, const __nv_bfloat16* k_pool, const __nv_bfloat16* v_pool,
               __nv_bfloat16* k_out, __nv_bfloat16* v_out, cudaStream_t stream) {
  if (s_kv_pad < s_kv)
    throw std::logic_error("gather_kv: s_kv_pad " + std::to_string(s_kv_pad) + " < s_kv " + std::to_string(s_kv));
  if (num_seqs <= 0 || s_kv_pad <= 0) return;
  const dim3 grid(static_cast<unsigned>((s_kv_pad + 7) / 8), static_cast<unsigned>(num_seqs));
  gather_kv_kernel<<<grid, dim3(32, 8), 0, stream>>>(s_kv, s_kv_pad, num_kv_heads, head_dim / 8, block_table,
                                                     max_pages, group0, reinterpret_cast<const uint4*>(k_pool),
                                                     reinterpret_cast<const uint4*>(v_pool),
                                                     reinterpret_cast<uint4*>(k_out), reinterpret_cast<uint4*>(v_out));
  check_cuda(cudaGetLastError(), "gather_kv_kernel launch");
}

void apply_output_gate(int rows, int num_heads, int head_dim, const __nv_bfloat16* gate, long gate_ts, int gate_hs,
                       __nv_bfloat16* out, cudaStream_t stream) {
  const long n_vec = static_cast<long>(rows) * num_heads * (head_dim / 8);
  if (n_vec <= 0) return;
  output_gate_kernel<<<grid_for(n_vec), 256, 0, stream>>>(n_vec, num_heads, head_dim, gate, gate_ts, gate_hs,
                                                          reinterpret_cast<uint4*>(out));
  check_cuda(cudaGetLastError(), "output_gate_kernel launch");
}

}  // namespace hypic::kernels::cuda::detail
