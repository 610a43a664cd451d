// The CUDA backend (contracts in cuda_backend.h and engine/backend.h): construction, pools and memory, the
// layer steps shared by every pass, decode steps, and entry transfer between device, host and wire. The splice
// and entry-build passes are in cuda_splice.cpp; the types and the class in cuda_backend_impl.h.
#include "engine/cuda/cuda_backend.h"

#include "engine/cuda/cuda_backend_impl.h"

namespace hypic::engine::cuda::impl {


// ---- entry / sequence methods ----------------------------------------------------------------------------------

CudaEntry::CudaEntry(CudaBackend& b, SegmentEntry header, cudaStream_t stream)
    : header_(std::move(header)), owner_(&b), lay_(b.geometry(), n(), header_.seam_tokens() > 0) {
  const size_t total = lay_.total;
  device_ = b.device().index;
  mem_ = DeviceMemory(total, "segment entry (" + std::to_string(n()) + " tokens)", stream,
                      /*stream_ordered=*/stream != nullptr);
  base_ = mem_.bytes_ptr();
  b.live_entry_bytes += mem_.size();
}

CudaEntry::CudaEntry(CudaBackend& b, SegmentEntry header, StagedView)
    : header_(std::move(header)), owner_(&b), lay_(b.geometry(), n(), header_.seam_tokens() > 0),
      device_(b.device().index) {}

std::shared_ptr<const SegmentEntry> CudaEntry::host() const {
  std::lock_guard lock(mu_);
  if (!host_) host_ = owner_->entry_of_block(*owner_->copy_to_host(*this));
  return host_;
}

CudaSequence::~CudaSequence() { b_->release(slot_, pages_); }

CudaEntry::~CudaEntry() {
  if (!mem_.size()) return;  // a staged view
  owner_->live_entry_bytes -= mem_.size();
  owner_->defer_free(std::move(mem_));
}

size_t CudaSequence::bytes() const { return b_->sequence_state_bytes() + pages_.size() * b_->page_bytes(); }

ModelState CudaSequence::to_host() const { return b_->download_state(*this); }

// ---- construction ----------------------------------------------------------------------------------------------

CudaBackend::CudaBackend(const DeviceSpec& dev, ModelConfig cfg, const ModelWeights* weights,
                         const BackendOptions& opt, const std::filesystem::path& checkpoint)
    : cfg_(std::move(cfg)), dev_(dev), opt_(opt), prefix_(opt.prefix_cache_bytes) {
  cfg_.validate();
  check_supported();
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (dev_.index < 0 || dev_.index >= count)
    throw std::invalid_argument("device " + dev_.name() + " does not exist (" + std::to_string(count) +
                                " CUDA device(s) visible)");
  set_device();
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  full_stream_ = stream_;
  check_cuda(cudaStreamCreateWithFlags(&xfer_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaStreamCreateWithFlags(&d2h_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaStreamCreateWithFlags(&h2d_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaStreamCreateWithFlags(&stage_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  {  // decode steps: the highest priority, so that their blocks go first as a prefill pass's blocks retire
    int least = 0, greatest = 0;
    check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    check_cuda(cudaStreamCreateWithPriority(&dec_stream_, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
    dec_full_stream_ = dec_stream_;
  }
  if (opt_.decode_sms < -1)
    throw std::invalid_argument("decode_sms must be >= 0 (or -1: auto), got " + std::to_string(opt_.decode_sms));
  if (!opt_.concurrent_decode && opt_.decode_sms > 0)
    spdlog::warn("cuda backend on {}: decode_sms {} ignored: decode steps do not run beside prefill "
                 "(--concurrent-decode=false)",
                 dev_.name(), opt_.decode_sms);
  if (opt_.concurrent_decode && opt_.decode_sms != 0) {
    int want = opt_.decode_sms;
    if (want < 0) {  // auto: about an eighth of the device in multiples of 8 SMs; none on small devices
      int device_sms = 0;
      check_cuda(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, dev_.index), "SM count");
      want = device_sms >= 32 ? std::max(8, (device_sms / 8 + 4) / 8 * 8) : 0;
    }
    if (want > 0) {
      try {
        sms_ = SmPartition::create(dev_.index, want);
        check_cuda(cudaEventCreateWithFlags(&lane_ev_, cudaEventDisableTiming), "cudaEventCreate(lane)");
        spdlog::info("cuda backend on {}: SM partition while decode steps run beside prefill: {}", dev_.name(),
                     sms_->describe());
      } catch (const std::exception& e) {
        cudaGetLastError();  // a failed driver entry-point query leaves the runtime's last error set
        if (opt_.decode_sms > 0) throw;  // asked for explicitly
        sms_.reset();
        spdlog::warn("cuda backend on {}: no SM partition for decode beside prefill ({}); decode steps share every "
                     "SM with prefill passes (--decode-sms 0 silences this)",
                     dev_.name(), e.what());
      }
    }
  }
  pinned_ = std::make_shared<PinnedPool>(dev_.index);
  if (!weights && checkpoint.empty()) cfg_.weights_digest = random_weights_digest(opt_.random_weights_seed);
  fingerprint_ = model_fingerprint(cfg_, numerics());
  geom_ = EntryGeometry::of(cfg_);
  n_lin_ = cfg_.num_linear_layers();
  n_attn_ = cfg_.num_attention_layers();
  nk_ = cfg_.linear_num_key_heads, nv_ = cfg_.linear_num_value_heads, K_ = cfg_.linear_conv_kernel_dim;
  C_ = int(cfg_.conv_dim()), qd_ = int(cfg_.linear_q_dim()), vd_ = int(cfg_.linear_v_dim());
  nh_ = cfg_.num_attention_heads, nkv_ = cfg_.num_key_value_heads, hd_ = cfg_.head_dim, H_ = int(cfg_.hidden_size);
  zc_ = cfg_.zero_centred_norms();
  post_norm_ = cfg_.family == ModelFamily::MiniMax;
  lin_ = cfg_.family == ModelFamily::Qwen         ? Lin::Gdn
         : cfg_.family == ModelFamily::KimiLinear ? Lin::Kda
                                                  : Lin::Lightning;
  attn_ = cfg_.family == ModelFamily::Qwen ? Attn::Gated : cfg_.family == ModelFamily::KimiLinear ? Attn::Mla : Attn::Plain;
  if (n_lin_ && lin_ == Lin::Kda) kda_cfg_ = KdaLayerConfig::of(cfg_);
  if (n_lin_ && lin_ == Lin::Lightning) light_cfg_ = LightningLayerConfig::of(cfg_);
  if (n_attn_ && attn_ == Attn::Mla) mla_cfg_ = MlaLayerConfig::of(cfg_);
  state_heads_ = nv_;
  state_head_floats_ = cfg_.linear_key_head_dim * cfg_.linear_value_head_dim;
  state_layer_bytes_ = size_t(state_heads_) * state_head_floats_ * sizeof(float);
  trans_layer_bytes_ = lin_ == Lin::Lightning ? size_t(nv_) * sizeof(float)
                                              : size_t(nv_) * cfg_.linear_key_head_dim * cfg_.linear_key_head_dim * 4;
  conv_layer_bytes_ = size_t(cfg_.conv_rows()) * C_ * 2;
  kv_row_ = attn_ == Attn::Mla ? size_t(mla_cfg_.dims.rank + mla_cfg_.dims.rope) * 2 : size_t(nkv_) * hd_ * 2;
  v_row_ = attn_ == Attn::Mla ? 0 : kv_row_;
  eps_ = float(cfg_.rms_norm_eps);
  attn_scale_ = attn_ == Attn::Mla ? mla_cfg_.scale : float(1.0 / std::sqrt(double(hd_)));
  gdn_scale_ = float(1.0 / std::sqrt(double(cfg_.linear_key_head_dim)));
  renorm_topk_ = cfg_.norm_topk_prob || cfg_.model_type.rfind("qwen3_5_moe", 0) == 0;
  if (!checkpoint.empty()) {
    w_ = DeviceWeights::load(cfg_, checkpoint);  // streamed: one layer on the host at a time
  } else if (weights) {
    w_ = DeviceWeights::upload(cfg_, *weights);
  } else {
    if (opt_.random_weights_seed == 0)
      throw std::invalid_argument("cuda backend: no weights given and random_weights_seed is 0");
    spdlog::warn("cuda backend: BENCHMARK-ONLY random weights (seed {}) made on {} from the config alone: the model's "
                 "text is meaningless",
                 opt_.random_weights_seed, dev_.name());
    w_ = DeviceWeights::random(cfg_, opt_.random_weights_seed);
  }
  if (n_attn_ && attn_ == Attn::Mla) {  // W_UK^T per MLA layer for the absorbed queries
    const kc::MlaDims& d = mla_cfg_.dims;
    const size_t per = size_t(d.heads) * d.rank * std::max(d.nope, 1);
    mla_uk_t_ = DeviceMemory(size_t(n_attn_) * per * 2, "MLA W_UK^T");
    for (int i = 0, a = 0; i < cfg_.num_hidden_layers; ++i) {
      if (cfg_.layer_types[i] != LayerType::FullAttention) continue;
      DevMla& m = w_.layers[i].mla;
      kc::bf16* dst = mla_uk_t_.as<kc::bf16>() + size_t(a++) * per;
      kc::mla_transpose_uk(d, m.kv_b_proj, dst, stream_);
      m.w_uk_t = dst;
    }
    check_cuda(cudaStreamSynchronize(stream_), "MLA W_UK^T");
  }
  allocate_pools();
  spdlog::info("cuda backend on {}: weights {}, {} state slots ({} each), {} KV pages of {} tokens ({}), activations "
               "for {} tokens ({})",
               dev_.name(), mib(w_.bytes()), opt_.max_sequences, mib(sequence_state_bytes()), num_pages_, kPage,
               mib(size_t(num_pages_) * page_bytes()), Tmax_, mib(act_.size()));
  if (n_attn_) {  // (also surfaces a bad HYPIC_ATTN_CUDNN at start: std::invalid_argument)
    if (kc::attention_cudnn_available())
      spdlog::info("cuda backend: long prefill attention groups on cuDNN's fused SDPA (HYPIC_ATTN_CUDNN=0: our kernels)");
    else
      spdlog::info("cuda backend: prefill attention on our kernels only ({})", kc::attention_cudnn_status());
  }
}

CudaBackend::~CudaBackend() {
  if (stream_) {
    cudaSetDevice(dev_.index);
    cudaStreamSynchronize(stream_);
    if (dec_full_stream_) cudaStreamSynchronize(dec_full_stream_);
    if (sms_) {
      cudaStreamSynchronize(sms_->prefill_stream());
      cudaStreamSynchronize(sms_->decode_stream());
    }
    prefix_.clear();
    graphs_.clear();
    drain_frees();
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (lane_ev_) cudaEventDestroy(lane_ev_);
  for (cudaStream_t st : {d2h_stream_, h2d_stream_, stage_stream_, dec_full_stream_}) {
    if (!st) continue;
    cudaStreamSynchronize(st);
    cudaStreamDestroy(st);
  }
  if (xfer_stream_) {
    cudaStreamSynchronize(xfer_stream_);
    cudaStreamDestroy(xfer_stream_);
  }
}

void CudaBackend::check_supported() const {
  const ModelConfig& c = cfg_;
  auto bad = [&](const std::string& what) {
    throw std::invalid_argument("cuda backend: " + what + " is not supported (model_type " + c.model_type + ")");
  };
  // Each family's layer configs refuse, naming the value, what their kernels do not take (KDA head size 128, lightning
  // head size 64 / 128, MLA with the q LoRA or heads over 256).
  try {
    if (c.num_linear_layers() > 0 && c.family == ModelFamily::KimiLinear) (void)KdaLayerConfig::of(c);
    if (c.num_linear_layers() > 0 && (c.family == ModelFamily::MiniMax || c.family == ModelFamily::RingLinear))
      (void)LightningLayerConfig::of(c);
    if (c.num_attention_layers() > 0 && c.family == ModelFamily::KimiLinear) (void)MlaLayerConfig::of(c);
  } catch (const std::invalid_argument& e) {
    bad(e.what());
  }
  if (c.family == ModelFamily::Qwen && c.num_linear_layers() > 0 &&
      (c.linear_key_head_dim != D || c.linear_value_head_dim != D))
    bad("linear_key_head_dim " + std::to_string(c.linear_key_head_dim) + " / linear_value_head_dim " +
        std::to_string(c.linear_value_head_dim) + " (the GPU gated-delta kernels need 128 / 128)");
  if (c.family != ModelFamily::KimiLinear && c.num_attention_layers() > 0 && c.head_dim != 64 && c.head_dim != 128 &&
      c.head_dim != 256)
    bad("attention head_dim " + std::to_string(c.head_dim) + " (64, 128 or 256)");
  if (c.family != ModelFamily::Qwen && c.attn_output_gate) bad("an attention output gate outside the Qwen families");
  if (c.hidden_size % 64 != 0) bad("hidden_size " + std::to_string(c.hidden_size) + " (a multiple of 64)");
  if (c.is_moe() && c.moe_intermediate_size % 32 != 0)
    bad("moe_intermediate_size " + std::to_string(c.moe_intermediate_size) + " (a multiple of 32)");
  if (c.is_moe() && c.shared_expert_intermediate_size % 32 != 0)
    bad("shared_expert_intermediate_size " + std::to_string(c.shared_expert_intermediate_size) + " (a multiple of 32)");
  bool dense_layers = false;
  for (int i = 0; i < c.num_hidden_layers; ++i) dense_layers = dense_layers || !c.is_moe_layer(i);
  if (dense_layers && c.intermediate_size % 8 != 0)
    bad("intermediate_size " + std::to_string(c.intermediate_size) + " (a multiple of 8) of the dense MLP layers");
  if (c.family == ModelFamily::MiniMax &&
      (c.full_attn_alpha == 0 || c.linear_attn_alpha == 0 || c.mlp_alpha == 0))
    bad("a post-norm residual alpha of 0");
  if (c.num_linear_layers() > 0 && (c.family == ModelFamily::MiniMax || c.family == ModelFamily::RingLinear) &&
      (c.group_norm_size < 1 || (int64_t(c.num_attention_heads) * c.head_dim) % c.group_norm_size != 0 ||
       (int64_t(c.num_attention_heads) * c.head_dim / c.group_norm_size) % 2 != 0))
    bad("group_norm_size " + std::to_string(c.group_norm_size) + " (it must split the " +
        std::to_string(int64_t(c.num_attention_heads) * c.head_dim) + " output channels into even groups)");
  if (c.conv_dim() % 8 != 0) bad("conv_dim " + std::to_string(c.conv_dim()) + " (a multiple of 8)");
  if (c.num_attention_layers() > 0 && c.rotary_dim() % 2 != 0) bad("odd rotary_dim");
  if (c.vocab_size > (int64_t(1) << 31) - 1) bad("vocab_size above 2^31");
  if (c.family == ModelFamily::MiniMax && c.mlp_beta != 1.0)
    for (int i = 0; i < c.num_hidden_layers; ++i)
      if (!c.is_moe_layer(i)) bad("a dense MLP layer with mlp_beta != 1 (MiniMax's scales are applied by the MoE)");
}

void CudaBackend::allocate_pools() {
  if (opt_.max_sequences < 1) throw std::invalid_argument("max_sequences must be >= 1");
  if (opt_.max_batch_tokens < 64) throw std::invalid_argument("max_batch_tokens must be >= 64");
  const int S = opt_.max_sequences;
  for (int l = 0; l < n_lin_; ++l) {
    ssm_pool_.emplace_back(size_t(S) * state_layer_bytes_, "linear state slots");
    conv_pool_.emplace_back(size_t(S) * conv_layer_bytes_, "conv state slots");  // empty without a short conv
  }
  for (int s = S - 1; s >= 0; --s) free_slots_.push_back(s);
  // Activations.
  Tmax_ = std::max(opt_.max_batch_tokens, opt_.max_segment_tokens);
  carve_activations(act_, size_t(Tmax_), "activations (--max-batch-tokens " + std::to_string(Tmax_) + ")", pre_);
  pre_.stream = stream_, pre_.gemm = &gemm_, pre_.moe_ws = &moe_ws_;
  carve_activations(dec_act_, size_t(opt_.max_sequences), "decode activations (--max-sequences)", dec_);
  dec_.stream = dec_stream_, dec_.gemm = &dec_gemm_, dec_.moe_ws = &dec_moe_ws_, dec_.decode = true;
  dec_norm_counter_ = DeviceMemory(sizeof(unsigned), "decode norm counter");
  check_cuda(cudaMemset(dec_norm_counter_.as(), 0, sizeof(unsigned)), "decode norm counter");
  dec_.norm_counter = dec_norm_counter_.as<unsigned>();
  if (n_lin_ && lin_ == Lin::Gdn) {  // gdn_decode_gated's per-(request, value head) counters
    dec_gdn_counters_ = DeviceMemory(size_t(opt_.max_sequences) * nv_ * sizeof(unsigned), "decode GDN norm counters");
    check_cuda(cudaMemset(dec_gdn_counters_.as(), 0, dec_gdn_counters_.size()), "decode GDN norm counters");
  }
  dec_logits_ = DeviceMemory(size_t(opt_.max_sequences) * cfg_.vocab_size * 4, "decode logits (--max-sequences)");
  dec_argmax_ = DeviceMemory(size_t(opt_.max_sequences) * 4, "decode greedy tokens (--max-sequences)");
  dec_sample_ = DeviceMemory(sample_draws_offset() + size_t(opt_.max_sequences) * sizeof(kc::SampleRowDraw),
                             "decode sampling rows (--max-sequences)");
  if ((n_attn_ || cfg_.linear_rope) && cfg_.rotary_dim() > 0) {
    const std::vector<float> inv = kernels::cpu::rope_inv_freq(cfg_.rope_theta, cfg_.rotary_dim());
    inv_freq_ = DeviceMemory(inv.size() * 4, "rope inverse frequencies");
    check_cuda(cudaMemcpy(inv_freq_.as(), inv.data(), inv.size() * 4, cudaMemcpyHostToDevice), "inv_freq upload");
  }
  // Workspaces sized once for the largest pass so that later passes allocate nothing.
  for (const DevLayer& L : w_.layers)
    if (L.is_moe) {
      moe_ws_.reserve(int(Tmax_), moe_view(L));
      dec_moe_ws_.reserve(opt_.max_sequences, moe_view(L));
      break;
    }
  bool dense_layers = false;
  for (const DevLayer& L : w_.layers) dense_layers = dense_layers || !L.is_moe;
  if (cfg_.intermediate_size > 0 && dense_layers) {  // (all-MoE models: MiniMax, Qwen3-Next-style) need none
    moe_ws_.reserve_mlp(int(Tmax_), H_, int(cfg_.intermediate_size));
    dec_moe_ws_.reserve_mlp(opt_.max_sequences, H_, int(cfg_.intermediate_size));
  }
  // The KDA / lightning prefill workspace for the largest pass (one sequence of Tmax tokens, or an entry build's
  // 2 x max_sequences pieces), so that passes allocate nothing (a larger shape still grows it).
  if (n_lin_ && lin_ != Lin::Gdn) {
    size_t need = 0;
    for (int seqs : {1, 2 * opt_.max_sequences}) {
      if (lin_ == Lin::Kda) {
        kc::KdaPrefillArgs a;
        a.num_seqs = seqs, a.total_tokens = int(Tmax_), a.num_heads = kda_cfg_.heads;
        need = std::max(need, kc::kda_prefill_workspace_bytes(a));
      } else {
        kc::LightningPrefillArgs a;
        a.num_seqs = seqs, a.max_seqlen = int(Tmax_ / seqs), a.num_heads = light_cfg_.heads;
        a.head_dim = light_cfg_.head_dim;
        need = std::max(need, kc::lightning_prefill_workspace_bytes(a));
      }
    }
    ensure_capacity(lin_ws_, need, "KDA / lightning prefill workspace");
  }
  // MLA's expansion scratch for a pass over Tmax_ context rows (longer expanded passes grow it when there is room).
  if (n_attn_ && attn_ == Attn::Mla && !grow_mla_scratch(int(std::min<size_t>(Tmax_ + kPage, 1 << 30))))
    throw ResourceExhausted("MLA expansion scratch for " + std::to_string(Tmax_) + " tokens (--max-batch-tokens): " +
                            std::to_string(MlaExpandScratch::bytes(mla_cfg_.dims, (Tmax_ + kPage + 4095) / 4096 * 4096)) +
                            " bytes of device memory");
  // KV pool: what the budget allows, else 40% of what is free now.
  if (n_attn_) {
    size_t budget = opt_.kv_pool_bytes;
    if (!budget) {
      size_t free = 0, total = 0;
      check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
      budget = free / 10 * 4;
    }
    num_pages_ = int(std::min<size_t>(budget / page_bytes(), size_t(1) << 30));
    if (num_pages_ < 1)
      throw ResourceExhausted("KV pool budget (--kv-pool-bytes) of " + std::to_string(budget) +
                              " bytes holds no page of " + std::to_string(page_bytes()) + " bytes");
    for (int a = 0; a < n_attn_; ++a) {
      k_pool_.emplace_back(size_t(num_pages_) * kPage * kv_row_, "KV pool (K)");
      if (v_row_)
        v_pool_.emplace_back(size_t(num_pages_) * kPage * v_row_, "KV pool (V)");
      else
        v_pool_.emplace_back();  // MLA: the latent rows are K and V
    }
    for (int p = num_pages_ - 1; p >= 0; --p) free_pages_.push_back(p);
  }
}

void CudaBackend::carve_activations(DeviceMemory& mem, size_t T, const std::string& what, Lane& lane) {
  Layout lay;
  const size_t o_ids = lay.add(T * 4), o_x = lay.add(T * H_ * 4), o_hn = lay.add(T * H_ * 2);
  size_t o_qkv = 0, o_q = 0, o_k = 0, o_v = 0, o_z = 0, o_a = 0, o_b = 0, o_o = 0;
  if (n_lin_ && lin_ == Lin::Gdn) {
    o_qkv = lay.add(T * C_ * 2), o_q = lay.add(T * qd_ * 2), o_k = lay.add(T * qd_ * 2);
    o_v = lay.add(T * vd_ * 2), o_z = lay.add(T * vd_ * 2), o_a = lay.add(T * nv_ * 2), o_b = lay.add(T * nv_ * 2);
    o_o = lay.add(T * vd_ * 2);
  }
  // The other families' mixer scratch (engine/cuda/*_mixer.h), bf16 [T][width] unless said.
  std::vector<size_t> o_fam;
  const size_t HD = size_t(nv_) * cfg_.linear_value_head_dim;
  if (n_lin_ && lin_ == Lin::Kda)  // pre, q, k, v, graw, o, gate, low; g, beta fp32
    for (size_t w : {3 * HD * 2, HD * 2, HD * 2, HD * 2, HD * 2, HD * 2, HD * 2, size_t(kda_cfg_.low_width()) * 2, HD * 4,
                     size_t(nv_) * 4})
      o_fam.push_back(lay.add(T * w));
  if (n_lin_ && lin_ == Lin::Lightning)  // qkv, q, k, v, o, gate
    for (size_t w : {3 * HD, HD, HD, HD, HD, HD}) o_fam.push_back(lay.add(T * w * 2));
  size_t o_qg = 0, o_kv = 0, o_aq = 0, o_ao = 0;
  std::vector<size_t> o_mla;
  if (n_attn_ && attn_ != Attn::Mla) {
    o_qg = lay.add(T * (cfg_.attn_output_gate ? 2 : 1) * nh_ * hd_ * 2), o_kv = lay.add(T * 2 * nkv_ * hd_ * 2);
    o_aq = lay.add(T * nh_ * hd_ * 2), o_ao = lay.add(T * nh_ * hd_ * 2);
  }
  if (n_attn_ && attn_ == Attn::Mla) {  // q, ckv, qx, ox, packed
    const kc::MlaDims& d = mla_cfg_.dims;
    for (size_t w : {size_t(nh_) * (d.nope + d.rope), size_t(d.rank + d.rope), MlaScratch::qx_width(d),
                     MlaScratch::ox_width(d), size_t(nh_) * d.v})
      o_mla.push_back(lay.add(T * w * 2));
  }
  mem = DeviceMemory(lay.total(), what);
  auto bp = [&](size_t off) { return reinterpret_cast<kc::bf16*>(mem.bytes_ptr(off)); };
  auto fp = [&](size_t off) { return reinterpret_cast<float*>(mem.bytes_ptr(off)); };
  lane.ids = reinterpret_cast<int32_t*>(mem.bytes_ptr(o_ids));
  lane.x = fp(o_x);
  lane.hn = bp(o_hn);
  if (n_lin_ && lin_ == Lin::Gdn)
    lane.qkv = bp(o_qkv), lane.q = bp(o_q), lane.k = bp(o_k), lane.v = bp(o_v),
    lane.z = bp(o_z), lane.ga = bp(o_a), lane.gb = bp(o_b), lane.o = bp(o_o);
  if (n_lin_ && lin_ == Lin::Kda) {
    KdaScratch& k = lane.kda;
    k.pre = bp(o_fam[0]), k.q = bp(o_fam[1]), k.k = bp(o_fam[2]), k.v = bp(o_fam[3]), k.graw = bp(o_fam[4]);
    k.o = bp(o_fam[5]), k.gate = bp(o_fam[6]), k.low = bp(o_fam[7]), k.g = fp(o_fam[8]), k.beta = fp(o_fam[9]);
  }
  if (n_lin_ && lin_ == Lin::Lightning) {
    LightningScratch& l = lane.light;
    l.qkv = bp(o_fam[0]), l.q = bp(o_fam[1]), l.k = bp(o_fam[2]), l.v = bp(o_fam[3]), l.o = bp(o_fam[4]);
    l.gate = bp(o_fam[5]);
  }
  if (n_attn_ && attn_ != Attn::Mla) lane.qg = bp(o_qg), lane.kv = bp(o_kv), lane.aq = bp(o_aq), lane.ao = bp(o_ao);
  if (n_attn_ && attn_ == Attn::Mla) {
    MlaScratch& m = lane.mla;
    m.q = bp(o_mla[0]), m.ckv = bp(o_mla[1]), m.qx = bp(o_mla[2]), m.ox = bp(o_mla[3]), m.packed = bp(o_mla[4]);
  }
}

std::unique_ptr<CudaSequence> CudaBackend::new_sequence() {
  std::unique_lock lock(pool_mu_);
  if (free_slots_.empty())
    throw ResourceExhausted("all " + std::to_string(opt_.max_sequences) +
                            " sequence slots of the cuda backend are in use (--max-sequences)");
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  lock.unlock();
  auto s = std::make_unique<CudaSequence>(*this, slot);
  for (int l = 0; l < n_lin_; ++l) {
    check_cuda(cudaMemsetAsync(ssm(l, slot), 0, state_layer_bytes_, stream_), "zero state slot");
    if (conv_layer_bytes_) check_cuda(cudaMemsetAsync(convs(l, slot), 0, conv_layer_bytes_, stream_), "zero conv slot");
  }
  return s;
}

void CudaBackend::ensure_pages(CudaSequence& s, int64_t tokens) {
  if (!n_attn_) return;
  const size_t need = size_t((tokens + kPage - 1) / kPage);
  if (need <= s.pages_.size()) return;
  std::lock_guard lock(pool_mu_);
  const size_t more = need - s.pages_.size();
  if (more > free_pages_.size())
    throw ResourceExhausted("KV pool exhausted (--kv-pool-bytes): " + std::to_string(tokens) + " tokens need " +
                            std::to_string(need) + " pages of " + std::to_string(kPage) + " tokens, " +
                            std::to_string(free_pages_.size() + s.pages_.size()) + " available to this request of " +
                            std::to_string(num_pages_));
  for (size_t i = 0; i < more; ++i) {
    s.pages_.push_back(free_pages_.back());
    free_pages_.pop_back();
  }
}

void CudaBackend::release(int slot, const std::vector<int>& pages) {
  std::lock_guard lock(pool_mu_);
  free_slots_.push_back(slot);
  free_pages_.insert(free_pages_.end(), pages.begin(), pages.end());
}

BackendMemory CudaBackend::memory() const {
  BackendMemory m;
  m.weights = w_.bytes() + mla_uk_t_.size();
  m.kv_budget = size_t(num_pages_) * page_bytes();
  {
    std::lock_guard lock(pool_mu_);
    m.kv_used = size_t(num_pages_ - int(free_pages_.size())) * page_bytes();
  }
  m.workspace = act_.size() + dec_act_.size() + moe_ws_.bytes() + dec_moe_ws_.bytes() + ws_a_.bytes() + ws_c_.bytes() + ws_seam_.bytes() + ws_pieces_.bytes() +
                attn_ws_.bytes() + attn_dec_ws_.bytes() + run_scratch_.size() + tables_dev_.size() + logits_dev_.size() +
                lin_ws_.size() + mla_ws_.bytes() + mla_dec_ws_.bytes() + mla_x_mem_.size();
  m.entries_used = live_entry_bytes.load() + prefix_.bytes();
  {
    std::lock_guard lock(free_mu_);
    m.freed_pending = pending_free_bytes_;
  }
  size_t free = 0, total = 0;
  if (cudaSetDevice(dev_.index) == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess) {
    m.device_free = free;
    m.device_total = total;
  }
  cudaMemPool_t pool = nullptr;
  uint64_t reserved = 0, used = 0;
  if (cudaDeviceGetDefaultMemPool(&pool, dev_.index) == cudaSuccess &&
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess &&
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used) == cudaSuccess && reserved > used) {
    m.pool_free = size_t(reserved - used);
  }
  cudaGetLastError();  // (a failed query above leaves nothing to report)
  m.pinned_host = pinned_->bytes_held();
  return m;
}

void CudaBackend::check_ids(std::span<const int32_t> ids, const std::string& where) const {
  for (size_t t = 0; t < ids.size(); ++t)
    if (ids[t] < 0 || ids[t] >= cfg_.vocab_size)
      throw std::invalid_argument("token id " + std::to_string(ids[t]) + " at index " + std::to_string(t) + " of " +
                                  where + " is outside [0, " + std::to_string(cfg_.vocab_size) + ")");
}

// ---- layer pieces ----------------------------------------------------------------------------------------------

namespace {
// HYPIC_DECODE_LINEAR=0 in the environment (read once) keeps decode's projections on cuBLASLt (comparisons).
bool decode_linear_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HYPIC_DECODE_LINEAR");
    return !(v && v[0] == '0');
  }();
  return on;
}
}  // namespace

bool CudaBackend::project(const Lane& ln, int T, int K, const kc::bf16* x,
                          std::initializer_list<kc::DecodeLinearOutput> outs, kc::DecodeLinearEpilogue epilogue,
                          float alpha, const kc::bf16* then_norm) {
  const int n = int(outs.size());
  if (ln.decode && alpha == 1.f && T <= kc::kDecodeLinearProjectionTokens && decode_linear_enabled() &&
      kc::decode_linear_supported(T, K, x, K, outs.begin(), n)) {
    // The norm of the rows just added into (the residual) rides on the launch (decode_linear.h DecodeLinearNorm):
    // one output, not MiniMax's post-norm residuals (their norm rescales x).
    const bool fuse = then_norm && ln.norm_counter && n == 1 && epilogue == kc::DecodeLinearEpilogue::AddF32 &&
                      !post_norm_ && outs.begin()->N % 4 == 0 && outs.begin()->ldy % 4 == 0;
    const kc::DecodeLinearNorm norm{then_norm, eps_, zc_, ln.hn, ln.norm_counter};
    kc::decode_linear(T, K, x, K, outs.begin(), n, epilogue, ln.stream, fuse ? &norm : nullptr);
    return fuse;
  }
  const bool bf16_out = epilogue == kc::DecodeLinearEpilogue::StoreBf16;
  const float beta = epilogue == kc::DecodeLinearEpilogue::AddF32 ? 1.f : 0.f;
  for (const kc::DecodeLinearOutput& d : outs)
    ln.gemm->linear(T, d.N, K, x, K, d.W, d.y, bf16_out ? CUDA_R_16BF : CUDA_R_32F, d.ldy, beta, ln.stream, alpha);
  return false;
}

void CudaBackend::mixer_norm(const Lane& ln, const DevLayer& L, int T) {
  const float alpha = !post_norm_ ? 0.f
                      : L.type == LayerType::Linear ? float(cfg_.linear_attn_alpha)
                                                    : float(cfg_.full_attn_alpha);
  kc::rms_norm_residual(T, H_, ln.x, H_, nullptr, L.input_layernorm, eps_, ln.hn, ln.stream, zc_, alpha,
                        post_norm_ ? ln.x : nullptr);
}

void CudaBackend::linear_family_project(const Lane& ln, const DevLayer& L, int T, int num_seqs, const int* cu_dev,
                                        kc::bf16* conv_state, const int* positions) {
  if (lin_ == Lin::Kda)
    kda_mixer_project(*ln.gemm, L.kda, kda_cfg_, T, ln.hn, num_seqs, cu_dev, conv_state, ln.kda, ln.stream);
  else
    lightning_mixer_project(*ln.gemm, L.lightning, light_cfg_, T, ln.hn, positions, inv_freq_.as<float>(), ln.light,
                            ln.stream);
}

void CudaBackend::linear_scan(const Lane& ln, const DevLayer& L, int num_seqs, const int* cu_dev, const int* cu_host, const float* init,
                              float* fin, float* trans, bool out, const kc::bf16* q, const kc::bf16* k,
                              const kc::bf16* v, const float* g, const float* beta) {
  if (num_seqs == 0) return;
  if (lin_ == Lin::Kda) {
    kc::KdaPrefillArgs a;
    a.num_seqs = num_seqs, a.cu_seqlens = cu_dev, a.total_tokens = cu_host[num_seqs] - cu_host[0];
    a.num_heads = kda_cfg_.heads;
    a.q = q ? q : ln.kda.q, a.k = k ? k : ln.kda.k, a.v = v ? v : ln.kda.v;
    a.g = g ? g : ln.kda.g, a.beta = beta ? beta : ln.kda.beta;
    a.l2norm_qk = true, a.scale = kda_cfg_.scale;
    a.initial_state = init, a.final_state = fin, a.transition = trans, a.out = out ? ln.kda.o : nullptr;
    a.workspace_bytes = kc::kda_prefill_workspace_bytes(a);
    ensure_capacity(lin_ws_, a.workspace_bytes, "KDA prefill workspace");
    a.workspace = lin_ws_.as();
    kc::kda_prefill(a, ln.stream);
  } else {
    kc::LightningPrefillArgs a;
    a.num_seqs = num_seqs, a.cu_seqlens = cu_dev;
    for (int i = 0; i < num_seqs; ++i) a.max_seqlen = std::max(a.max_seqlen, cu_host[i + 1] - cu_host[i]);
    a.num_heads = light_cfg_.heads, a.head_dim = light_cfg_.head_dim;
    a.q = q ? q : ln.light.q, a.k = k ? k : ln.light.k, a.v = v ? v : ln.light.v;
    a.slope = L.lightning.slope;
    a.initial_state = init, a.final_state = fin, a.transition = trans, a.out = out ? ln.light.o : nullptr;
    a.workspace_bytes = kc::lightning_prefill_workspace_bytes(a);
    ensure_capacity(lin_ws_, a.workspace_bytes, "lightning prefill workspace");
    a.workspace = lin_ws_.as();
    kc::lightning_prefill(a, ln.stream);
  }
}

void CudaBackend::linear_family_finish(const Lane& ln, const DevLayer& L, int T) {
  if (lin_ == Lin::Kda)
    kda_mixer_finish(*ln.gemm, L.kda, kda_cfg_, T, ln.kda, ln.x, ln.stream);
  else
    lightning_mixer_finish(*ln.gemm, L.lightning, light_cfg_, T, ln.hn, ln.light, ln.x, ln.stream);
}

void CudaBackend::chain(int num_chains, int steps_per_chain, const kc::AffineStep* steps, const float* const* init,
                        float* const* fin, cudaStream_t stream) const {
  if (lin_ == Lin::Lightning)
    kc::affine_chain_scalar(num_chains, state_heads_, state_head_floats_, steps_per_chain, steps, init, fin, stream);
  else
    kc::affine_chain(num_chains, state_heads_, steps_per_chain, steps, init, fin, stream);
}

void CudaBackend::import_kv(int a, const KvImport& kv, const KvImportTables& t, const Tables& tb) {
  if (!kv.rows()) return;
  const int* run_start = tb.dev<int>(t.run_start);
  const kc::bf16* const* k_src = tb.dev<const kc::bf16*>(t.k[a]);
  if (attn_ == Attn::Mla)
    kc::mla_latent_import(kv.rows(), kv.runs(), mla_cfg_.dims, run_start, k_src, tb.dev<int>(t.dst),
                          k_pool_[a].as<kc::bf16>(), stream_);
  else
    kc::kv_import(kv.rows(), kv.runs(), nkv_, hd_, cfg_.rotary_dim(), run_start, k_src, tb.dev<const kc::bf16*>(t.v[a]),
                  tb.dev<int>(t.deltas), inv_freq_.as<float>(), tb.dev<int>(t.dst), k_pool_[a].as<kc::bf16>(),
                  v_pool_[a].as<kc::bf16>(), stream_);
}

void CudaBackend::attention_layer(const Lane& ln, const DevLayer& L, int a, int T, const int* positions,
                                  const int* kv_rows, const kc::AttnGroups& groups, bool decode,
                                  const MlaExpandPass* mla_expand) {
  if (attn_ != Attn::Mla) return attention_mixer(ln, L.attention, a, T, positions, kv_rows, groups, decode);
  mla_mixer(*ln.gemm, L.mla, mla_cfg_, T, ln.hn, kv_rows, groups, k_pool_[a].as<kc::bf16>(), mla_expand, &mla_xs_,
            &attn_ws_, decode ? &mla_dec_ws_ : &mla_ws_, ln.mla, ln.x, ln.stream);
}

CudaBackend::MlaExpandTables CudaBackend::plan_mla_expand(Tables& tb, int G, const int* q_start, const int* slot0,
                                                          const int* bt, int max_pages) {
  MlaExpandTables x;
  if (attn_ != Attn::Mla || !n_attn_ || G == 0) return x;
  MlaExpandPlan p = MlaExpandPlan::of(G, q_start, slot0, bt, max_pages);
  if (mla_pass_form(mla_cfg_.dims, G, q_start, slot0, p.rows) != MlaForm::Expanded || !grow_mla_scratch(p.rows))
    return x;
  x.on = true, x.rows = p.rows, x.max_pages = p.max_pages;
  x.t_src = tb.add(p.src_rows), x.t_bt = tb.add(p.block_table);
  return x;
}

MlaExpandPass CudaBackend::mla_expand_pass(const MlaExpandTables& x, const Tables& tb,
                                           const kc::AttnGroups& groups) const {
  MlaExpandPass p;
  p.rows = x.rows;
  p.src_rows = tb.dev<int>(x.t_src);
  p.groups = groups;
  p.groups.block_table = tb.dev<int>(x.t_bt);
  p.groups.max_pages = x.max_pages;
  p.groups.max_kv = x.rows;
  return p;
}

bool CudaBackend::grow_mla_scratch(int rows) {
  if (mla_xs_.rows >= rows) return true;
  const int want = (rows + 4095) / 4096 * 4096;
  const kc::MlaDims& d = mla_cfg_.dims;
  const size_t bytes = MlaExpandScratch::bytes(d, size_t(want));
  if (mla_x_failed_rows_ && want >= mla_x_failed_rows_) {  // failed before: only when the device has room now
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess || free + mla_x_mem_.size() < bytes + (size_t(256) << 20))
      return false;
  }
  check_cuda(cudaStreamSynchronize(stream_), "MLA expansion scratch");  // earlier passes may still read the old one
  const int old_rows = mla_xs_.rows;
  mla_x_mem_ = DeviceMemory();  // the old one first: growth needs only the new size free
  mla_xs_ = MlaExpandScratch{};
  try {
    mla_x_mem_ = DeviceMemory(bytes, "MLA expansion scratch");
  } catch (const std::exception& e) {
    spdlog::warn("cuda backend: no room for the MLA expansion scratch of {} rows ({}); such passes run absorbed{}",
                 want, e.what(), std::getenv("HYPIC_MLA_FORM") ? " (HYPIC_MLA_FORM is overridden)" : "");
    mla_x_failed_rows_ = mla_x_failed_rows_ ? std::min(mla_x_failed_rows_, want) : want;
    if (old_rows) {  // back to the old size where possible
      try {
        mla_x_mem_ = DeviceMemory(MlaExpandScratch::bytes(d, size_t(old_rows)), "MLA expansion scratch");
        mla_xs_ = MlaExpandScratch::carve(mla_x_mem_.as<char>(), d, size_t(old_rows), stream_);
      } catch (const std::exception&) {
        mla_x_mem_ = DeviceMemory();
      }
    }
    return false;
  }
  if (mla_x_failed_rows_ && want >= mla_x_failed_rows_) mla_x_failed_rows_ = 0;
  mla_xs_ = MlaExpandScratch::carve(mla_x_mem_.as<char>(), d, size_t(want), stream_);
  return true;
}

void CudaBackend::linear_gemms(const Lane& ln, const DevLinear& L, int T) {
  project(ln, T, H_, ln.hn,
          {{L.in_proj_qkv, C_, ln.qkv, C_}, {L.in_proj_z, vd_, ln.z, vd_}, {L.in_proj_b, nv_, ln.gb, nv_},
           {L.in_proj_a, nv_, ln.ga, nv_}},
          kc::DecodeLinearEpilogue::StoreBf16);
}

// Gated RMSNorm of the delta-rule output times silu(z), then out_proj added into the residual stream.
bool CudaBackend::linear_finish(const Lane& ln, const DevLinear& L, int T, const kc::bf16* then_norm,
                                bool gated_normed) {
  if (!gated_normed) kc::rms_norm_gated(T * nv_, D, ln.o, ln.z, L.norm, eps_, ln.o, ln.stream);
  return project(ln, T, vd_, ln.o, {{L.out_proj, H_, ln.x, H_}}, kc::DecodeLinearEpilogue::AddF32, 1.f, then_norm);
}


// Gated attention layer a over T tokens (HF Qwen3NextAttention): projections, q/k norms and RoPE with K and V written
// to the pool rows kv_rows (DEVICE [T]) at positions (DEVICE [T]), attention over the groups (prefill, or one query
// per group in decode), the output gate, o_proj added into the residual stream.
void CudaBackend::attention_mixer(const Lane& ln, const DevAttention& A, int a, int T, const int* positions, const int* kv_rows,
                                  const kc::AttnGroups& groups, bool decode) {
  attention_gemms(ln, A, T);
  kc::bf16* kp = k_pool_[a].as<kc::bf16>();
  kc::bf16* vp = v_pool_[a].as<kc::bf16>();
  const kc::QkNorm qk = attn_ == Attn::Gated ? kc::QkNorm::ZeroCentred
                        : A.q_norm              ? kc::QkNorm::Plain
                                                : kc::QkNorm::None;
  kc::attention_prepare(T, nh_, nkv_, hd_, cfg_.rotary_dim(), cfg_.attn_output_gate, ln.qg, ln.kv, ln.kv + nkv_ * hd_,
                        2 * nkv_ * hd_, A.q_norm, A.k_norm, eps_, positions, inv_freq_.as<float>(), kv_rows, ln.aq, kp, vp,
                        ln.stream, qk);
  const bool gate = cfg_.attn_output_gate;
  const kc::bf16* g = gate ? ln.qg + hd_ : nullptr;
  const long g_token = gate ? long(2) * nh_ * hd_ : 0;
  const int g_head = gate ? 2 * hd_ : 0;
  if (decode)
    kc::attention_decode(groups, nh_, nkv_, hd_, ln.aq, kp, vp, attn_scale_, g, g_token, g_head, ln.ao, attn_dec_ws_,
                         ln.stream, /*kv_read_early=*/true);  // (attention_prepare, just before, writes the new rows)
  else
    kc::attention_prefill(groups, nh_, nkv_, hd_, ln.aq, kp, vp, attn_scale_, g, g_token, g_head, ln.ao, attn_ws_, ln.stream);
  project(ln, T, nh_ * hd_, ln.ao, {{A.o_proj, H_, ln.x, H_}}, kc::DecodeLinearEpilogue::AddF32,
          float(cfg_.full_attn_beta));
}

void CudaBackend::attention_gemms(const Lane& ln, const DevAttention& A, int T) {
  const int qrows = (cfg_.attn_output_gate ? 2 : 1) * nh_ * hd_;
  const int kvrows = 2 * nkv_ * hd_;
  project(ln, T, H_, ln.hn, {{A.q_proj, qrows, ln.qg, qrows}, {A.kv_proj, kvrows, ln.kv, kvrows}},
          kc::DecodeLinearEpilogue::StoreBf16);
}

bool CudaBackend::ffn(const Lane& ln, const DevLayer& L, int T, bool decode, const kc::bf16* next_norm,
                      bool normed) {
  if (!normed)
    kc::rms_norm_residual(T, H_, ln.x, H_, nullptr, L.post_attention_layernorm, eps_, ln.hn, ln.stream, zc_,
                          post_norm_ ? float(cfg_.mlp_alpha) : 0.f, post_norm_ ? ln.x : nullptr);
  if (L.is_moe) {
    const kc::GroupedGemm impl = kc::grouped_gemm_for_tokens(T, decode);
    // The next norm rides on the MoE combine (post-norm residuals rescale x in their norm: kept separate).
    const bool fuse = next_norm && !post_norm_;
    const kc::MoeNextNorm next{next_norm, eps_, zc_, ln.hn};
    kc::moe_forward(T, ln.hn, moe_view(L), ln.x, *ln.moe_ws, *ln.gemm, impl, ln.stream, fuse ? &next : nullptr);
    return fuse;
  }
  kc::mlp_forward(T, ln.hn, H_, int(cfg_.intermediate_size), L.ffn.gate_up, L.ffn.down, ln.x, *ln.moe_ws, *ln.gemm,
                  ln.stream);
  return false;
}

const kc::bf16* CudaBackend::next_input_norm(int i) const {
  return i + 1 < cfg_.num_hidden_layers ? w_.layers[size_t(i) + 1].input_layernorm : nullptr;
}

kc::MoeWeightsView CudaBackend::moe_view(const DevLayer& L) const {
  kc::MoeWeightsView v;
  v.E = cfg_.num_experts, v.H = H_, v.I = int(cfg_.moe_intermediate_size), v.topk = cfg_.num_experts_per_tok;
  v.renormalize = renorm_topk_;
  v.router = L.ffn.router, v.experts_gate_up = L.ffn.experts_gate_up, v.experts_down = L.ffn.experts_down;
  v.Is = int(cfg_.shared_expert_intermediate_size);
  v.shared_gate_up = L.ffn.shared_gate_up, v.shared_down = L.ffn.shared_down, v.shared_gate = L.ffn.shared_gate;
  if (cfg_.router_score == RouterScore::Sigmoid) {
    v.scoring = kc::MoeScoring::Sigmoid;
    v.expert_bias = L.ffn.router_bias;
    v.n_group = cfg_.n_group, v.topk_group = cfg_.topk_group;
    v.routed_scaling = float(cfg_.routed_scaling_factor);
  }
  v.output_scale = post_norm_ ? float(cfg_.mlp_beta) : 1.f;
  return v;
}

void CudaBackend::lm_head(int rows, const int* rows_index, std::vector<float>& logits) {
  const size_t V = size_t(cfg_.vocab_size);
  ensure_capacity(logits_dev_, size_t(rows) * V * 4, "logits");
  kc::rms_norm_residual(rows, H_, pre_.x, H_, rows_index, w_.final_norm, eps_, pre_.hn, stream_, zc_);
  gemm_.linear(rows, int(V), H_, pre_.hn, H_, w_.lm_head, logits_dev_.as(), CUDA_R_32F, long(V), 0.f, stream_);
  logits.resize(size_t(rows) * V);
  check_cuda(cudaMemcpyAsync(logits.data(), logits_dev_.as(), logits.size() * 4, cudaMemcpyDeviceToHost, stream_),
             "logits download");
}

// ---- decode ----------------------------------------------------------------------------------------------------

void CudaBackend::decode(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                         std::vector<float>& logits) {
  logits.clear();
  decode_device(sequences, tokens, [&](int B) {
    logits.resize(size_t(B) * size_t(cfg_.vocab_size));
    check_cuda(cudaMemcpyAsync(logits.data(), dec_logits_.as(), logits.size() * 4, cudaMemcpyDeviceToHost, dec_stream_),
               "logits download");
  });
}

void CudaBackend::decode_step(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                              std::span<const uint8_t> modes, DecodeStepOutput& out, std::span<const SampleDraw> draws) {
  check_step_rows(sequences.size(), modes, draws);
  out.argmax.clear();
  out.logits.clear();
  const size_t V = size_t(cfg_.vocab_size);
  // Sampling rows picked on the device (kernels/cuda/sample.h; HYPIC_DEVICE_SAMPLING, on by default: =0 copies their
  // logits to the host): top_k in 1 .. min(kSampleMaxTopK, V - 1); the others (no top-k: the whole vocabulary
  // sorted) on the host.
  static kc::CandidateSwitch device_sampling("HYPIC_DEVICE_SAMPLING");
  const bool dev_sampling = device_sampling.on();
  auto on_device = [&](size_t b) {
    if (!dev_sampling || modes[b] != kStepSample) return false;  // (draws exist only with sampling rows)
    const SampleDraw& d = draws[b];
    return d.top_k >= 1 && d.top_k <= kc::kSampleMaxTopK && size_t(d.top_k) < V;  // (temperature > 0: checked)
  };
  std::vector<int32_t> dev_rows;
  std::vector<kc::SampleRowDraw> dev_draws;
  std::vector<int32_t> dev_tokens;
  for (size_t b = 0; b < modes.size(); ++b)
    if (on_device(b)) {
      dev_rows.push_back(int32_t(b));
      dev_draws.push_back({draws[b].temperature, draws[b].top_k, draws[b].top_p, draws[b].u});
    }
  std::vector<float> sampled;  // [rows in kStepSample mode][V]: picked on the host after the step
  decode_device(sequences, tokens, [&](int B) {
    out.argmax.assign(size_t(B), -1);
    size_t n_logits = 0, n_sample = 0;
    for (int b = 0; b < B; ++b) n_logits += modes[b] == kStepLogits, n_sample += modes[b] == kStepSample && !on_device(b);
    if (n_logits + n_sample + dev_rows.size() < size_t(B)) {  // greedy rows: their argmax on the device, 4 bytes each
      kc::argmax_rows(B, int(V), dec_logits_.as<float>(), long(V), dec_argmax_.as<int32_t>(), dec_stream_);
      check_cuda(cudaMemcpyAsync(out.argmax.data(), dec_argmax_.as(), size_t(B) * 4, cudaMemcpyDeviceToHost,
                                 dec_stream_),
                 "greedy tokens download");
    }
    if (!dev_rows.empty()) {  // (after the greedy tokens' copy, in stream order: these overwrite their rows below)
      const size_t n = dev_rows.size();
      int32_t* d_rows = dec_sample_.as<int32_t>();
      int32_t* d_tokens = d_rows + opt_.max_sequences;
      auto* d_draws = reinterpret_cast<kc::SampleRowDraw*>(dec_sample_.as<char>() + sample_draws_offset());
      check_cuda(cudaMemcpyAsync(d_rows, dev_rows.data(), n * 4, cudaMemcpyHostToDevice, dec_stream_), "sample rows");
      check_cuda(cudaMemcpyAsync(d_draws, dev_draws.data(), n * sizeof(kc::SampleRowDraw), cudaMemcpyHostToDevice,
                                 dec_stream_),
                 "sample draws");
      kc::sample_rows(int(n), int(V), dec_logits_.as<float>(), long(V), d_rows, d_draws, d_tokens, dec_stream_);
      dev_tokens.resize(n);
      check_cuda(cudaMemcpyAsync(dev_tokens.data(), d_tokens, n * 4, cudaMemcpyDeviceToHost, dec_stream_),
                 "sampled tokens download");
    }
    out.logits.resize(n_logits * V);
    sampled.resize(n_sample * V);
    size_t row_l = 0, row_s = 0;
    for (int b = 0; b < B;) {  // runs of consecutive rows of one copied mode, one copy each
      const uint8_t m = modes[b];
      if (m == kStepGreedy || on_device(size_t(b))) {
        ++b;
        continue;
      }
      int e = b;
      while (e < B && modes[e] == m && !on_device(size_t(e))) ++e;
      float* dst = m == kStepLogits ? out.logits.data() + row_l * V : sampled.data() + row_s * V;
      check_cuda(cudaMemcpyAsync(dst, dec_logits_.as<float>() + size_t(b) * V, size_t(e - b) * V * 4,
                                 cudaMemcpyDeviceToHost, dec_stream_),
                 "logits download");
      (m == kStepLogits ? row_l : row_s) += size_t(e - b);
      b = e;
    }
  });
  // After the step's synchronisation: greedy rows' tokens (argmax_rows' -1 - j for a NaN at j -> nan_logits_code(j)),
  // sampling rows picked on the device (the same codes; INT32_MIN == kNoFiniteLogitCode) or on the host, -1 for the
  // logits rows.
  static_assert(kNoFiniteLogitCode == INT32_MIN, "sample_rows' code for a row without a finite logit");
  for (size_t i = 0; i < dev_rows.size(); ++i) {
    const int32_t t = dev_tokens[i];
    out.argmax[size_t(dev_rows[i])] = t >= 0 || t == kNoFiniteLogitCode ? t : nan_logits_code(-1 - t);
  }
  size_t row_s = 0;
  for (size_t b = 0; b < out.argmax.size(); ++b) {
    if (modes[b] == kStepLogits) {
      out.argmax[b] = -1;
    } else if (on_device(b)) {
      continue;
    } else if (modes[b] == kStepSample) {
      const std::span<const float> row(sampled.data() + row_s++ * V, V);
      out.argmax[b] = sample_row(row, draws[b]);
    } else if (out.argmax[b] < 0) {
      out.argmax[b] = nan_logits_code(-1 - out.argmax[b]);
    }
  }
}

void CudaBackend::decode_device(std::span<Sequence* const> sequences, std::span<const int32_t> tokens,
                                const std::function<void(int B)>& download) {
  set_device();  // no drain_frees: freeing synchronizes the device, and this may run beside a prefill pass
  // Always the whole device at the highest priority: while a prefill call runs confined to the prefill partition
  // (PartitionScope), the SMs it leaves out take this step's blocks at once and freed prefill SMs take more. (A
  // step on the 16-SM decode partition itself cannot replay a graph captured on the whole device, and capturing
  // one there waits for a pause in prefill: measured 4.3x slower steps than this, 2026-12-03.)
  decoding_.fetch_add(1);
  struct StepEnd {
    CudaBackend& b;
    int exceptions = std::uncaught_exceptions();
    ~StepEnd() {
      // A step that failed part-way may have kernels in flight on its stream: the next step may take the other one.
      if (std::uncaught_exceptions() > exceptions) cudaStreamSynchronize(b.dec_stream_);
      b.decoding_.fetch_sub(1);
    }
  } step_end{*this};
  if (sequences.size() != tokens.size())
    throw std::invalid_argument("decode: " + std::to_string(sequences.size()) + " sequences but " +
                                std::to_string(tokens.size()) + " tokens");
  const int B = int(sequences.size());
  if (B == 0) return;
  if (B > opt_.max_sequences)
    throw std::invalid_argument("decode: batch of " + std::to_string(B) + " above max_sequences (" +
                                std::to_string(opt_.max_sequences) + ")");
  check_ids(tokens, "the decode batch");
  std::vector<CudaSequence*> seqs(B);
  for (int b = 0; b < B; ++b) {
    seqs[b] = dynamic_cast<CudaSequence*>(sequences[b]);
    if (!seqs[b] || seqs[b]->b_ != this) throw std::invalid_argument("decode: sequence " + std::to_string(b) + " is not this backend's");
    for (int c = 0; c < b; ++c)
      if (seqs[c] == seqs[b]) throw std::invalid_argument("decode: sequence " + std::to_string(b) + " appears twice");
  }
  for (auto* s : seqs) ensure_pages(*s, s->n_ + 1);
  // The step's tables in a fixed layout for (B, cap): cap = the block-table width, a power of two >= every
  // sequence's page count, so that a CUDA graph captured for (B, cap) serves every later step of that shape.
  int max_pages = 1;
  for (int b = 0; b < B; ++b) max_pages = std::max<int>(max_pages, int(seqs[b]->pages_.size()));
  int cap = 1;
  while (cap < max_pages) cap *= 2;
  DecodeTables t(B, cap);
  std::vector<int32_t> host(t.ints, 0);
  for (int b = 0; b < B; ++b) {
    const CudaSequence& s = *seqs[b];
    host[t.ids + b] = tokens[b];
    host[t.pos + b] = int32_t(s.n_);
    host[t.rows + b] = n_attn_ ? page_row(s, s.n_) : 0;
    host[t.slots + b] = s.slot_;
    host[t.qs + b] = b;
    host[t.lr + b] = b;
    std::copy(s.pages_.begin(), s.pages_.end(), host.begin() + t.bt + size_t(b) * cap);
  }
  host[t.qs + B] = B;
  if (dec_tables_.size() < host.size() * 4) {  // the graphs hold pointers into it: they go with it
    graphs_.clear();
    dec_tables_ = DeviceMemory(std::max<size_t>(host.size() * 4 * 2, 1 << 16), "decode tables");
  }
  check_cuda(cudaMemcpyAsync(dec_tables_.as(), host.data(), host.size() * 4, cudaMemcpyHostToDevice, dec_stream_),
             "decode tables");
  if (n_attn_) {  // sized before any step of this width runs, eager or captured; growing drops the graphs
    const size_t before = attn_dec_ws_.bytes();
    const size_t before_mla = mla_dec_ws_.bytes();
    if (attn_ == Attn::Mla)
      mla_dec_ws_.reserve(opt_.max_sequences, 1, nh_, mla_cfg_.dims.rank, cap * kPage);
    else
      attn_dec_ws_.reserve(opt_.max_sequences, nh_, hd_, cap * kPage);
    if (attn_dec_ws_.bytes() != before || mla_dec_ws_.bytes() != before_mla) graphs_.clear();
  }
  // A candidate switch flipped in this process (kernels/cuda/switches.h: tests, bench --ab) changes which kernels a
  // step launches: the graphs captured before are dropped, and each shape runs eagerly once again first.
  if (const int gen = kc::candidate_generation().load(std::memory_order_relaxed); gen != graphs_generation_) {
    graphs_.clear();
    warmed_.clear();
    graphs_generation_ = gen;
  }
  const auto key = std::make_pair(B, cap);
  auto it = graphs_.find(key);
  std::unique_lock<std::recursive_mutex> capturing(capture_mu_, std::defer_lock);
  if (it == graphs_.end() && opt_.decode_graphs && warmed_.count(key) && capturing.try_lock()) {
    // Second step of this shape: every GEMM plan and workspace exists, so the step can be captured (while no
    // engine-loop call runs: capture_mu_).
    cudaGraph_t graph = nullptr;
    check_cuda(cudaStreamBeginCapture(dec_stream_, cudaStreamCaptureModeThreadLocal), "decode capture");
    try {
      decode_body(B, cap, t);
    } catch (...) {
      cudaStreamEndCapture(dec_stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    check_cuda(cudaStreamEndCapture(dec_stream_, &graph), "decode capture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    check_cuda(err, "decode graph instantiate");
    it = graphs_.emplace(key, GraphExec(exec)).first;
    capturing.unlock();
  }
  if (it != graphs_.end()) {
    check_cuda(cudaGraphLaunch(it->second.get(), dec_stream_), "decode graph launch");
  } else {
    decode_body(B, cap, t);
    warmed_.insert(key);
  }
  download(B);
  check_cuda(cudaStreamSynchronize(dec_stream_), "decode step");
  for (auto* s : seqs) s->n_ += 1;
}

CudaBackend::PartitionScope::PartitionScope(CudaBackend& backend) : b(backend) {
  if (!b.sms_ || b.partition_depth_++ > 0 || !b.decode_beside_likely()) return;
  const cudaStream_t part = b.sms_->prefill_stream();
  try {
    check_cuda(cudaEventRecord(b.lane_ev_, b.full_stream_), "lane event");
    check_cuda(cudaStreamWaitEvent(part, b.lane_ev_, 0), "lane event wait");
  } catch (...) {
    --b.partition_depth_;
    throw;
  }
  b.stream_ = b.pre_.stream = part;
  for (kc::GdnWorkspace* ws : {&b.ws_a_, &b.ws_c_, &b.ws_seam_, &b.ws_pieces_})
    ws->set_side_stream(b.sms_->prefill_side_stream());
  b.partitioned_.store(true);
  switched = true;
}

CudaBackend::PartitionScope::~PartitionScope() {
  if (!b.sms_) return;
  --b.partition_depth_;
  if (!switched) return;
  b.partitioned_.store(false);
  // Joined back: the whole-device stream's later work (and frees) follow this call's.
  if (cudaEventRecord(b.lane_ev_, b.stream_) != cudaSuccess ||
      cudaStreamWaitEvent(b.full_stream_, b.lane_ev_, 0) != cudaSuccess) {
    cudaGetLastError();  // not left for the next launch check to report
    cudaStreamSynchronize(b.stream_);
  }
  b.stream_ = b.pre_.stream = b.full_stream_;
  for (kc::GdnWorkspace* ws : {&b.ws_a_, &b.ws_c_, &b.ws_seam_, &b.ws_pieces_}) ws->set_side_stream(nullptr);
}

// One decode step of B sequences from the fixed tables (no host work, no allocation: capturable).
void CudaBackend::decode_body(int B, int cap, const DecodeTables& t) {
  const Lane& ln = dec_;
  const int* tab = dec_tables_.as<int>();
  const kc::AttnGroups groups = attn_groups(B, tab + t.qs, tab + t.pos, tab + t.bt, cap, B, 1, cap * kPage);
  const int* slots = tab + t.slots;
  kc::embed_gather(B, H_, tab + t.ids, w_.embed, ln.x, ln.stream);
  bool normed = false;  // ln.hn already holds this layer's input norm (the previous MoE combine wrote it)
  for (int i = 0; i < cfg_.num_hidden_layers; ++i) {
    const DevLayer& L = w_.layers[i];
    if (!normed) mixer_norm(ln, L, B);
    bool post_normed = false;  // ln.hn holds the post-attention norm (the mixer's out_proj launch did it)
    if (L.type == LayerType::Linear && lin_ == Lin::Kda) {
      const int l = cfg_.linear_index(i);
      kda_mixer_decode(*ln.gemm, L.kda, kda_cfg_, B, ln.hn, ssm(l, 0), convs(l, 0), slots, ln.kda, ln.x, ln.stream);
    } else if (L.type == LayerType::Linear && lin_ == Lin::Lightning) {
      const int l = cfg_.linear_index(i);
      lightning_mixer_decode(*ln.gemm, L.lightning, light_cfg_, B, ln.hn, tab + t.pos, inv_freq_.as<float>(), ssm(l, 0),
                             slots, ln.light, ln.x, ln.stream);
    } else if (L.type == LayerType::Linear) {
      const int l = cfg_.linear_index(i);
      linear_gemms(dec_, L.linear, B);
      // (Both read their state before waiting for the kernel before them: its writer is the previous step's call,
      // and the in_proj GEMM and the conv wait before they let their successor start; gated_delta.h.)
      kc::conv1d_silu_decode(B, C_, K_, ln.qkv, L.linear.conv1d, convs(l, 0), kc::ConvQkvOut{ln.q, ln.k, ln.v, qd_},
                             ln.stream, slots, /*state_read_early=*/true);
      // The gated output norm rides on the recurrence launch (gated_delta.h GdnDecodeNorm).
      const kc::GdnDecodeNorm gnorm{ln.z, L.linear.norm, eps_, dec_gdn_counters_.as<unsigned>()};
      kc::gdn_decode_gated(B, nk_, nv_, ln.q, ln.k, ln.v, ln.ga, ln.gb, L.linear.A_log, L.linear.dt_bias, true, gdn_scale_,
                           ssm(l, 0), ln.o, ln.stream, slots, &gnorm, /*state_read_early=*/true);
      post_normed = linear_finish(dec_, L.linear, B, L.post_attention_layernorm, /*gated_normed=*/true);
    } else {
      attention_layer(dec_, L, cfg_.attention_index(i), B, tab + t.pos, tab + t.rows, groups, true);
    }
    const bool last = i + 1 == cfg_.num_hidden_layers;
    normed = ffn(dec_, L, B, /*decode=*/true, last ? w_.final_norm : next_input_norm(i), post_normed);
  }
  const int V = int(cfg_.vocab_size);
  if (!normed) kc::rms_norm_residual(B, H_, ln.x, H_, nullptr, w_.final_norm, eps_, ln.hn, ln.stream, zc_);
  // The LM head on decode_linear's weight stream (HYPIC_DECODE_LM_HEAD, a candidate: cuBLASLt read its 1 GB at
  // 4.1 TB/s at batch 1, 247 us of a 3.7 ms step); another fp32 summation order than cuBLASLt's.
  static kc::CandidateSwitch lm_head_stream("HYPIC_DECODE_LM_HEAD");
  const kc::DecodeLinearOutput head{w_.lm_head, V, dec_logits_.as(), long(V)};
  if (lm_head_stream.on() && B <= kc::kDecodeLinearProjectionTokens && decode_linear_enabled() &&
      kc::decode_linear_supported(B, H_, ln.hn, H_, &head, 1))
    kc::decode_linear(B, H_, ln.hn, H_, &head, 1, kc::DecodeLinearEpilogue::StoreF32, ln.stream);
  else
    ln.gemm->linear(B, V, H_, ln.hn, H_, w_.lm_head, dec_logits_.as(), CUDA_R_32F, V, 0.f, ln.stream);
}

// ---- entry builds ----------------------------------------------------------------------------------------------

// ---- import / download -----------------------------------------------------------------------------------------

// An entry's header without its tensors: what a CudaEntry keeps on the host.
SegmentEntry header_of(const SegmentEntry& e) {
  SegmentEntry h;
  h.format_version = e.format_version;
  h.model_fingerprint = e.model_fingerprint;
  h.numerics = e.numerics;
  h.seam_width = e.seam_width;
  h.token_ids = e.token_ids;
  h.geometry = e.geometry;
  return h;
}

std::optional<DeviceBlock> CudaBackend::device_block(const ResidentEntry& entry) const {
  const auto* e = dynamic_cast<const CudaEntry*>(&entry);
  if (!e || e->device() != dev_.index || e->no_transitions) return std::nullopt;
  return e->block();
}

std::pair<std::shared_ptr<const ResidentEntry>, DeviceBlock> CudaBackend::allocate_entry(const SegmentEntry& header) const {
  // Any thread: nothing here touches the engine's stream or mutable state (the allocation is on xfer_stream_).
  header.check_compatible(fingerprint_, geom_, -1, numerics());
  if (header.num_tokens() < 1) throw EntryError("allocate_entry: an entry has at least one token");
  check_cuda(cudaSetDevice(dev_.index), "cudaSetDevice");
  // The entry hands its memory back through the (mutex-guarded) deferred frees: const_cast is safe there. Its block
  // is freed stream-ordered on xfer_stream_ too; every engine call ends with its stream synchronized, so no engine
  // work still reads an entry whose last reference went.
  auto e = new_entry_any_thread(header, xfer_stream_);
  check_cuda(cudaStreamSynchronize(xfer_stream_), "entry allocation");  // ready before another stream writes it
  const DeviceBlock block = e->block();
  return {std::move(e), block};
}

std::shared_ptr<CudaEntry> CudaBackend::new_entry_any_thread(const SegmentEntry& header, cudaStream_t stream) const {
  auto& self = const_cast<CudaBackend&>(*this);  // the deferred frees are guarded by free_mu_ and capture_mu_
  try {
    return std::make_shared<CudaEntry>(self, header_of(header), stream);
  } catch (const ResourceExhausted&) {
    {
      std::lock_guard lock(free_mu_);
      if (pending_free_bytes_ == 0) throw;
    }
  }
  {
    std::lock_guard<std::recursive_mutex> no_capture(self.capture_mu_);  // after the loop's running call
    self.drain_frees();
    for (cudaStream_t s : {full_stream_, xfer_stream_, h2d_stream_, sms_ ? sms_->prefill_stream() : nullptr})
      if (s) cudaStreamSynchronize(s);  // (errors surface at the allocation below)
  }
  return std::make_shared<CudaEntry>(self, header_of(header), stream);
}

std::shared_ptr<const ResidentEntry> CudaBackend::import_entry(std::shared_ptr<const SegmentEntry> host) {
  set_device();
  std::lock_guard<std::recursive_mutex> no_capture(capture_mu_);  // see capture_mu_
  drain_frees();
  if (!host) throw std::invalid_argument("import_entry: null entry");
  // Converted into a pinned block, then one host-to-device copy at PCIe bandwidth (not the engine's stream).
  return import_block(*block_of_entry(*host));
}

// ---- host blocks -----------------------------------------------------------------------------------------------

void CudaBackend::wait_stream(cudaStream_t stream, const char* what) const {
  cudaEvent_t ev = nullptr;
  check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), what);
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err == cudaSuccess) err = cudaEventSynchronize(ev);
  cudaEventDestroy(ev);
  check_cuda(err, what);
}

std::shared_ptr<const HostBlock> CudaBackend::copy_to_host(const ResidentEntry& entry) const {
  const auto* e = dynamic_cast<const CudaEntry*>(&entry);
  if (!e || e->device() != dev_.index) throw EntryError("copy_to_host: the entry is not one of " + dev_.name() + "'s");
  if (e->no_transitions) throw EntryError("copy_to_host: the entry was built with benchmark_skip_transitions (no T_C)");
  check_cuda(cudaSetDevice(dev_.index), "cudaSetDevice");
  const DeviceBlock dev = e->block();
  auto block = std::make_shared<CudaHostBlock>(header_of(e->header()), dev.bytes, pinned_);
  size_t off = 0;
  for (const auto& p : block->pieces()) {
    check_cuda(cudaMemcpyAsync(p.data, static_cast<const char*>(dev.data) + off, p.used, cudaMemcpyDeviceToHost,
                               d2h_stream_),
               "entry copy to host");
    off += p.used;
  }
  wait_stream(d2h_stream_, "entry copy to host");
  return block;
}

std::shared_ptr<const ResidentEntry> CudaBackend::import_block(const HostBlock& hb) const {
  const auto* block = dynamic_cast<const CudaHostBlock*>(&hb);
  if (!block) throw EntryError("import_block: not a host block of the CUDA backend");
  const SegmentEntry& h = block->header();
  h.check_compatible(fingerprint_, geom_, -1, numerics());
  if (h.num_tokens() < 1) throw EntryError("import_block: an entry has at least one token");
  const size_t want = EntryLayout(geom_, h.num_tokens(), h.seam_tokens() > 0).total;
  if (block->bytes() != want)
    throw EntryError("import_block: a block of " + std::to_string(block->bytes()) + " bytes for " +
                     std::to_string(h.num_tokens()) + " tokens (expected " + std::to_string(want) + ")");
  check_cuda(cudaSetDevice(dev_.index), "cudaSetDevice");
  // Allocated and filled in order on h2d_stream_ (stream-ordered: no device-wide synchronization), then waited for,
  // so that the engine's stream only ever sees a complete entry. Freed stream-ordered on h2d_stream_ too.
  auto e = new_entry_any_thread(h, h2d_stream_);
  const DeviceBlock dev = e->block();
  size_t off = 0;
  for (const auto& p : block->pieces()) {
    check_cuda(cudaMemcpyAsync(static_cast<char*>(dev.data) + off, p.data, p.used, cudaMemcpyHostToDevice, h2d_stream_),
               "entry copy to device");
    off += p.used;
  }
  wait_stream(h2d_stream_, "entry copy to device");
  return e;
}

std::shared_ptr<const SegmentEntry> CudaBackend::entry_of_block(const HostBlock& hb) const {
  const auto* block = dynamic_cast<const CudaHostBlock*>(&hb);
  if (!block) throw EntryError("entry_of_block: not a host block of the CUDA backend");
  const SegmentEntry& h = block->header();
  const EntryGeometry& g = h.geometry;
  const EntryLayout lay(g, h.num_tokens(), h.seam_tokens() > 0);
  if (block->bytes() != lay.total) throw EntryError("entry_of_block: the block's size does not match its header");
  auto e = std::make_shared<SegmentEntry>(h);
  auto get_f32 = [&](size_t off, size_t bytes) {
    std::vector<float> v(bytes / sizeof(float));
    block->read(off, v.data(), bytes);
    return v;
  };
  std::vector<uint16_t> raw;
  auto get_bf16 = [&](size_t off, size_t count) {
    raw.resize(count);
    block->read(off, raw.data(), count * 2);
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = bf16_to_f32(raw[i]);
    return v;
  };
  const TransitionKind kind = scalar_transitions(g) ? TransitionKind::Scalar : TransitionKind::Dense;
  e->linear.resize(size_t(g.num_linear));
  for (int l = 0; l < g.num_linear; ++l) {
    LinearLayerEntry& L = e->linear[size_t(l)];
    if (lay.states == 2) L.seam_state = get_f32(lay.S_seam(l), lay.state);
    L.interior_transition = TransitionOperator::wrap(kind, g.linear_heads, g.d_k, get_f32(lay.T_int(l), lay.trans));
    L.interior_state = get_f32(lay.S_int(l), lay.state);
    L.conv_tail = get_bf16(lay.conv_at(l), size_t(g.conv_rows) * g.conv_dim);
  }
  e->attention.resize(size_t(g.num_attention));
  for (int a = 0; a < g.num_attention; ++a) {
    e->attention[size_t(a)].k = get_bf16(lay.K(a), size_t(h.num_tokens()) * lay.k_row / 2);
    e->attention[size_t(a)].v = get_bf16(lay.V(a), size_t(h.num_tokens()) * lay.v_row / 2);
  }
  e->check_consistent();
  return e;
}

// The block's regions in wire order (engine/segment.h): per linear layer S_seam (with a seam), T_int (dense, or
// scalar for lightning), S_int, fp32 in both layouts, and the conv tail, then per attention layer K and V, bf16 in both
// (the wire's K/V type 2: every value of a CUDA entry is a bf16 value, as serialize_entry finds): f(offset, bytes)
// for each, in that order.
template <class F>
void for_each_wire_region(const EntryGeometry& g, int64_t n, const EntryLayout& lay, F&& f) {
  const size_t kn = size_t(n) * lay.k_row, vn = size_t(n) * lay.v_row;
  for (int l = 0; l < g.num_linear; ++l) {
    if (lay.states == 2) f(lay.S_seam(l), lay.state);
    f(lay.T_int(l), lay.trans);
    f(lay.S_int(l), lay.state);
    f(lay.conv_at(l), lay.conv);
  }
  for (int a = 0; a < g.num_attention; ++a) {
    f(lay.K(a), kn);
    f(lay.V(a), vn);
  }
}

// Whether the wire carries K, V and the conv tails as bf16: serialize_entry's choice for a CUDA entry (every value a
// bf16 value), which holds whenever there is at least one of them.
bool wire_kv_bf16(const EntryGeometry& g, int64_t n, const EntryLayout& lay) {
  return (g.num_linear > 0 && lay.conv > 0) || (g.num_attention > 0 && size_t(n) * lay.k_row > 0);
}

// The wire parts of a block: views into its pinned pieces.
WireParts wire_parts_of(const HostBlock& hb) {
  const auto* block = dynamic_cast<const CudaHostBlock*>(&hb);
  if (!block) throw EntryError("wire_of_block: not a host block of the CUDA backend");
  const SegmentEntry& h = block->header();
  const EntryGeometry& g = h.geometry;
  const EntryLayout lay(g, h.num_tokens(), h.seam_tokens() > 0);
  if (block->bytes() != lay.total) throw EntryError("wire_of_block: the block's size does not match its header");
  WireParts parts;
  parts.interior_kinds.assign(size_t(g.num_linear), scalar_transitions(g) ? TransitionKind::Scalar : TransitionKind::Dense);
  parts.kv_bf16 = wire_kv_bf16(g, h.num_tokens(), lay);
  for_each_wire_region(g, h.num_tokens(), lay, [&](size_t off, size_t n) {
    block->span(off, n, [&](const char* p, size_t, size_t len) { parts.bytes.emplace_back(p, len); });
  });
  return parts;
}

// Copied once into the wire buffer.
std::string CudaBackend::wire_of_block(const HostBlock& block) const {
  return serialize_entry_parts(block.header(), wire_parts_of(block));
}

void CudaBackend::write_wire_of_block(const HostBlock& block, const std::function<void(uint64_t)>& begin,
                                      const std::function<void(std::string_view)>& out) const {
  write_entry_parts(block.header(), wire_parts_of(block), begin, out);
}

std::optional<WireBlock> CudaBackend::wire_block(const SegmentEntry& header, const WireShape& shape) const {
  header.check_compatible(fingerprint_, geom_, -1, numerics());
  if (header.num_tokens() < 1) throw EntryError("wire_block: an entry has at least one token");
  const EntryLayout lay(geom_, header.num_tokens(), header.seam_tokens() > 0);
  const TransitionKind kind = scalar_transitions(geom_) ? TransitionKind::Scalar : TransitionKind::Dense;
  // Anything but this layout's kinds and dtypes (an entry another writer made: fp32 K/V, a diagonal T) is converted
  // through a SegmentEntry instead.
  if (shape.kv_bf16 != wire_kv_bf16(geom_, header.num_tokens(), lay) ||
      shape.interior_kinds.size() != size_t(geom_.num_linear) ||
      std::any_of(shape.interior_kinds.begin(), shape.interior_kinds.end(), [&](TransitionKind k) { return k != kind; }))
    return std::nullopt;
  auto block = std::make_shared<CudaHostBlock>(header_of(header), lay.total, pinned_);
  WireBlock out;
  uint64_t sum = 0;
  for_each_wire_region(geom_, header.num_tokens(), lay, [&](size_t off, size_t n) {
    sum += n;
    block->span(off, n, [&](char* p, size_t, size_t len) { out.regions.emplace_back(p, len); });
  });
  if (sum != shape.tensor_bytes) return std::nullopt;  // (the kinds and dtypes above make them equal)
  out.block = std::move(block);
  return out;
}

std::shared_ptr<const HostBlock> CudaBackend::block_of_entry(const SegmentEntry& host) const {
  host.check_consistent();
  host.check_compatible(fingerprint_, geom_, -1, numerics());
  if (host.num_tokens() < 1) throw EntryError("block_of_entry: an entry has at least one token");
  const EntryLayout lay(geom_, host.num_tokens(), host.seam_tokens() > 0);
  auto block = std::make_shared<CudaHostBlock>(header_of(host), lay.total, pinned_);
  std::vector<uint16_t> buf;
  auto put_bf16 = [&](size_t off, const std::vector<float>& src) {
    buf.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) buf[i] = f32_to_bf16(src[i]);
    block->write(off, buf.data(), buf.size() * 2);
  };
  for (int l = 0; l < n_lin_; ++l) {
    const LinearLayerEntry& L = host.linear[size_t(l)];
    // Dense families: T in the dense layout whatever its stored kind; lightning: its scalars (one per head).
    const std::vector<float> Ti = scalar_transitions(geom_) ? L.interior_transition.data : L.interior_transition.to_dense();
    if (Ti.size() * sizeof(float) != lay.trans)
      throw EntryError("block_of_entry: linear layer " + std::to_string(l) + "'s transition has " +
                       std::to_string(Ti.size()) + " values, expected " + std::to_string(lay.trans / sizeof(float)));
    if (lay.states == 2) block->write(lay.S_seam(l), L.seam_state.data(), lay.state);
    block->write(lay.T_int(l), Ti.data(), lay.trans);
    block->write(lay.S_int(l), L.interior_state.data(), lay.state);
    put_bf16(lay.conv_at(l), L.conv_tail);
  }
  for (int a = 0; a < n_attn_; ++a) {
    put_bf16(lay.K(a), host.attention[size_t(a)].k);
    put_bf16(lay.V(a), host.attention[size_t(a)].v);
  }
  return block;
}

ModelState CudaBackend::download_state(const CudaSequence& s) const {
  ModelState st;
  st.num_tokens = s.n_;
  st.linear.resize(n_lin_);
  std::vector<uint16_t> raw;
  auto bf = [&](const void* src, size_t count, std::vector<float>& dst) {
    raw.resize(count);
    if (count) check_cuda(cudaMemcpy(raw.data(), src, count * 2, cudaMemcpyDeviceToHost), "state download");
    dst.resize(count);
    for (size_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(raw[i]);
  };
  check_cuda(cudaStreamSynchronize(full_stream_), "state download");
  for (int l = 0; l < n_lin_; ++l) {
    st.linear[l].ssm.resize(state_layer_bytes_ / 4);
    check_cuda(cudaMemcpy(st.linear[l].ssm.data(), ssm(l, s.slot_), state_layer_bytes_, cudaMemcpyDeviceToHost),
               "state download");
    if (conv_layer_bytes_) bf(convs(l, s.slot_), conv_layer_bytes_ / 2, st.linear[l].conv);
  }
  st.attention.resize(n_attn_);
  // Pool rows are the model's K [kv_heads][head_dim] and V [kv_heads][v_dim] rows (MLA: the latent, no V).
  const int heads = geom_.kv_heads, kd = geom_.head_dim, vdim = geom_.v_dim();
  for (int a = 0; a < n_attn_; ++a) {
    AttentionLayerState& A = st.attention[a];
    A.n_tokens = s.n_;
    A.k.resize(size_t(s.n_) * heads * kd);
    A.v.resize(size_t(s.n_) * heads * vdim);
    std::vector<float> tmp;
    for (int64_t t = 0; t < s.n_; t += kPage) {
      const int64_t cnt = std::min<int64_t>(kPage, s.n_ - t);
      for (int kvi = 0; kvi < 2; ++kvi) {
        const int w = kvi ? vdim : kd;
        if (!w) continue;
        bf((kvi ? v_pool_[a] : k_pool_[a]).bytes_ptr(size_t(page_row(s, t)) * row_bytes(kvi)), size_t(cnt) * heads * w,
           tmp);
        std::copy(tmp.begin(), tmp.end(), (kvi ? A.v : A.k).begin() + size_t(t) * heads * w);
      }
    }
  }
  return st;
}

}  // namespace hypic::engine::cuda::impl

namespace hypic::engine::cuda {

using impl::CudaBackend;


std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const ModelConfig& config, const ModelWeights* weights,
                                      const BackendOptions& options) {
  if (device.kind != BackendKind::Cuda) throw std::invalid_argument("cuda::make_backend: device " + device.name() + " is not a CUDA device");
  return std::make_unique<CudaBackend>(device, config, weights, options);
}

std::unique_ptr<Backend> make_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                      const BackendOptions& options) {
  ModelConfig cfg = load_config(model_dir);
  if (options.random_weights_seed) return make_backend(device, cfg, nullptr, options);
  if (device.kind != BackendKind::Cuda) throw std::invalid_argument("cuda::make_backend: device " + device.name() + " is not a CUDA device");
  return std::make_unique<CudaBackend>(device, cfg, nullptr, options, model_dir);
}

}  // namespace hypic::engine::cuda

namespace hypic::engine {

std::unique_ptr<Backend> make_cuda_backend(const DeviceSpec& device, const std::filesystem::path& model_dir,
                                           const BackendOptions& options) {
  return cuda::make_backend(device, model_dir, options);
}

}  // namespace hypic::engine
