#include "src/proxy/staging_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "mkernel/common/check.h"
#include "mkernel/common/cuda_check.h"
#include "mkernel/common/log.h"
#include "mkernel/common/tunables.h"
#include "mkernel/runtime/bootstrap.h"
#include "src/runtime/cuda_driver.h"

namespace mk {
namespace {

// Transport cookies: the top two bits say whose completion it is.
constexpr uint64_t kTagMask = 3ull << 62;
constexpr uint64_t kCookieDirect = 1ull << 62;  // a direct put (low bits: its slot in direct_cookie_)
constexpr uint64_t kCookieChunk = 2ull << 62;   // a staged chunk (low bits: its outbox slot)
constexpr uint64_t kCookieCredit = 3ull << 62;  // a credit return (nothing to report)

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

// Pinned (when a GPU exists, so copies to and from the GPU are asynchronous DMA) or plain.
Status host_alloc(bool gpu, size_t bytes, uint8_t** out) {
  if (gpu) {
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(out), bytes, cudaHostAllocPortable));
  } else {
    *out = static_cast<uint8_t*>(aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
    MK_REQUIRE(*out, Code::kOutOfMemory, "staging: cannot allocate %zu B", bytes);
  }
  memset(*out, 0, bytes);
  return OkStatus();
}
void host_free(bool gpu, uint8_t* p) {
  if (!p) return;
  if (gpu) cudaFreeHost(p);
  else free(p);
}

}  // namespace

Status StagingBackend::create(Bootstrap* bs, net::Backend* transport, const std::string& mode,
                              const StagingConfig& sc, std::unique_ptr<StagingBackend>* out) {
  MK_REQUIRE(bs && transport, Code::kInvalidArgument, "staging needs a bootstrap and a transport");
  MK_REQUIRE(transport->api_version() == net::kBackendApiVersion, Code::kMismatch,
             "backend %s speaks API version %u, staging %u", transport->name(), transport->api_version(),
             net::kBackendApiVersion);
  std::unique_ptr<StagingBackend> b(new StagingBackend());
  b->bs_ = bs;
  b->tr_ = transport;
  b->rank_ = bs->rank();
  b->world_ = bs->size();
  b->mode_ = mode.empty() ? tunables::net_staging() : mode;
  MK_REQUIRE(b->mode_ == "auto" || b->mode_ == "always" || b->mode_ == "never", Code::kInvalidArgument,
             "net_staging must be auto, always or never, got '%s'", b->mode_.c_str());
  MK_REQUIRE(sc.chunk_bytes >= 64 && sc.inbox_slots >= 1 && sc.inbox_slots <= 0xffff && sc.outbox_slots >= 1,
             Code::kInvalidArgument, "staging config: chunk >= 64 B, 1..65535 inbox slots, >= 1 outbox slot");
  b->sc_ = sc;
  b->name_ = std::string(transport->name()) + "+staging";
  b->gpu_ = have_gpu();
  b->copier_ = sc.copier ? sc.copier : &b->own_copier_;
  b->out_.resize(sc.outbox_slots);
  for (uint32_t k = sc.outbox_slots; k > 0; --k) b->free_outbox_.push_back(k - 1);
  b->sent_to_.assign(b->world_, 0);
  b->credit_from_.assign(b->world_, 0);
  b->freed_.assign(b->world_, std::vector<uint8_t>(sc.inbox_slots, 0));
  b->next_credit_.assign(b->world_, 0);
  b->credit_owed_.assign(b->world_, 0);
  b->tr_done_.reserve(256);
  b->tr_arrivals_.reserve(256);
  *out = std::move(b);
  return OkStatus();
}

StagingBackend::~StagingBackend() { (void)finalize(); }

net::BackendCaps StagingBackend::caps() const {
  net::BackendCaps c = tr_->caps();
  if (mode_ != "never") c.cuda_windows = true;  // staged when the transport cannot take it
  return c;
}

uint64_t StagingBackend::inbox_offset(int sender, uint32_t k) const {
  return (uint64_t(sender) * sc_.inbox_slots + k) * slot_bytes();
}

net::WindowId StagingBackend::transport_id(net::WindowId id) const {
  return id < wins_.size() && wins_[id].live ? wins_[id].transport : net::kNoWindow;
}

uint64_t StagingBackend::window_size(net::WindowId id, int rank) const {
  if (id >= wins_.size() || !wins_[id].live || rank < 0 || rank >= world_) return 0;
  return wins_[id].sizes[rank];
}

void StagingBackend::fail(const Status& s) {
  if (error_.ok()) error_ = s;
}

Status StagingBackend::ensure_staging() {
  if (staging_ready_) return OkStatus();
  MK_REQUIRE(world_ <= kMaxStagedRanks, Code::kNotSupported, "staging supports up to %d ranks", kMaxStagedRanks);
  const uint64_t slot = slot_bytes();
  Status s = [&]() -> Status {
    MK_CHECK(host_alloc(gpu_, world_ * sc_.inbox_slots * slot, &inbox_));
    MK_CHECK(host_alloc(gpu_, sc_.outbox_slots * slot, &outbox_));
    MK_CHECK(host_alloc(gpu_, 64, &credit_));
    return OkStatus();
  }();
  MK_CHECK(agree(*bs_, s, "staging buffers"));
  MK_CHECK(tr_->register_window(inbox_, world_ * sc_.inbox_slots * slot, net::MemKind::kHost, &inbox_id_));
  MK_CHECK(tr_->register_window(outbox_, sc_.outbox_slots * slot, net::MemKind::kHost, &outbox_id_));
  MK_CHECK(tr_->register_window(credit_, 64, net::MemKind::kHost, &credit_id_));
  staging_ready_ = true;
  MK_INFO(kSubsysProxy, "staging: %u x %u B inbox slots per rank, %u outbox slots", sc_.inbox_slots,
          sc_.chunk_bytes, sc_.outbox_slots);
  return OkStatus();
}

Status StagingBackend::register_window(void* base, size_t bytes, net::MemKind kind, net::WindowId* id) {
  *id = net::kNoWindow;
  MK_REQUIRE(!finalized_, Code::kInvalidArgument, "%s: register_window after finalize", name());
  const bool cuda = kind == net::MemKind::kCuda;
  const bool hmem = tr_->caps().cuda_windows;
  struct Info {
    uint64_t bytes;
    uint32_t staged;
    uint32_t refused;  // GPU memory the transport cannot take, and net_staging=never
  } mine{bytes, 0, 0};
  mine.staged = mode_ == "always" || (mode_ == "auto" && cuda && !hmem);
  mine.refused = mode_ == "never" && cuda && !hmem;
  std::vector<Info> all(world_);
  MK_CHECK(bs_->allgather(&mine, all.data(), sizeof(mine)));
  Window w;
  w.base = base;
  w.bytes = bytes;
  w.kind = kind;
  for (int r = 0; r < world_; ++r) {
    MK_REQUIRE(!all[r].refused, Code::kNotSupported,
               "window %zu: rank %d: %s cannot register GPU memory and net_staging=never", wins_.size(), r,
               tr_->name());
    MK_REQUIRE(all[r].staged == all[0].staged, Code::kMismatch,
               "window %zu: ranks disagree on staging (rank 0: %u, rank %d: %u)", wins_.size(), all[0].staged, r,
               all[r].staged);
    w.sizes.push_back(all[r].bytes);
  }
  w.staged = all[0].staged != 0;
  if (w.staged) {
    MK_CHECK(ensure_staging());
    // GPU copies need a stream and events of the memory's device: made now, not in flight.
    // Every rank agrees (the kinds may differ per rank), so all take the same steps.
    Status p = [&]() -> Status {
      if (!cuda || copier_ != &own_copier_) return OkStatus();
      cudaPointerAttributes a{};
      MK_CUDA_CHECK(cudaPointerGetAttributes(&a, base));
      MK_REQUIRE(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged, Code::kInvalidArgument,
                 "a GPU window at %p is not GPU memory", base);
      // At most one copy per outbox slot and one per inbox slot in flight.
      return own_copier_.prepare(a.device, sc_.outbox_slots + uint32_t(world_) * sc_.inbox_slots);
    }();
    MK_CHECK(agree(*bs_, p, "staging copies of a GPU window"));
  } else {
    MK_CHECK(tr_->register_window(base, bytes, kind, &w.transport));
    direct_gpu_ |= cuda;
  }
  *id = static_cast<net::WindowId>(wins_.size());
  wins_.push_back(std::move(w));
  MK_INFO(kSubsysProxy, "window %u: %llu B of %s memory, %s", *id, static_cast<unsigned long long>(bytes),
          cuda ? "GPU" : "host", wins_.back().staged ? "staged through host buffers" : "registered with the transport");
  return OkStatus();
}

Status StagingBackend::deregister_window(net::WindowId id) {
  MK_REQUIRE(id < wins_.size(), Code::kInvalidArgument, "%s: deregister_window(%u): unknown window", name(), id);
  if (abandoned_.load()) return given_up();
  Window& w = wins_[id];
  if (!w.live) return OkStatus();
  w.live = false;
  // A staged window is only this rank's table entry: nothing registered with the transport.
  if (!w.staged) return tr_->deregister_window(w.transport);
  return OkStatus();
}

Status StagingBackend::put(int peer, net::WindowId src, uint64_t src_off, net::WindowId dst, uint64_t dst_off,
                           uint64_t bytes, uint32_t imm, uint64_t cookie, bool* posted) {
  *posted = false;
  MK_REQUIRE(!finalized_, Code::kInvalidArgument, "%s: put after finalize", name());
  if (!error_.ok()) return error_;
  MK_REQUIRE(peer >= 0 && peer < world_, Code::kInvalidArgument, "rank %d: a put to unknown rank %d", rank_, peer);
  MK_REQUIRE(!(imm & kImmStaged), Code::kInvalidArgument,
             "rank %d: a put to rank %d with imm 0x%08x: bit 31 belongs to staging", rank_, peer, imm);
  MK_REQUIRE(src < wins_.size() && wins_[src].live && dst < wins_.size() && wins_[dst].live,
             Code::kInvalidArgument, "rank %d: a put to rank %d names window %u -> %u, not both registered",
             rank_, peer, src, dst);
  const Window& s = wins_[src];
  const Window& d = wins_[dst];
  if (!s.staged && !d.staged) {
    uint32_t slot;
    if (free_direct_.empty()) {
      slot = static_cast<uint32_t>(direct_cookie_.size());
      direct_cookie_.push_back(0);
    } else {
      slot = free_direct_.back();
      free_direct_.pop_back();
    }
    direct_cookie_[slot] = cookie;
    Status st = tr_->put(peer, s.transport, src_off, d.transport, dst_off, bytes, imm, kCookieDirect | slot, posted);
    if (!st.ok() || !*posted) free_direct_.push_back(slot);
    return st;
  }
  uint32_t id;
  if (free_puts_.empty()) {
    id = static_cast<uint32_t>(puts_.size());
    puts_.emplace_back();
  } else {
    id = free_puts_.back();
    free_puts_.pop_back();
  }
  StagedPut& p = puts_[id];
  p = StagedPut{};
  p.cookie = cookie;
  p.peer = peer;
  p.src = src;
  p.dst = dst;
  p.src_off = src_off;
  p.dst_off = dst_off;
  p.bytes = bytes;
  p.imm = imm;
  p.seq = next_seq_++;
  p.chunks = bytes == 0 ? 1 : static_cast<uint32_t>((bytes + sc_.chunk_bytes - 1) / sc_.chunk_bytes);
  queued_.push_back(id);
  *posted = true;
  return OkStatus();
}

Status StagingBackend::start_copy(void* dst, const void* src, uint64_t bytes, bool device, int* ticket) {
  *ticket = -1;
  if (bytes == 0) return OkStatus();  // an empty chunk: nothing to copy
  return copier_->start(dst, src, bytes, device, ticket);
}

bool StagingBackend::copy_done(int ticket, const char* what, int peer) {
  if (ticket < 0) return true;
  bool done = false;
  Status s = copier_->poll(ticket, &done);
  if (!s.ok()) {
    // Never done: its chunk is not sent (or its put never arrives), and nothing after it.
    fail(make_status(s.code(), "rank %d: staging copy %s rank %d failed: %s", rank_, what, peer,
                     s.message().c_str()));
    return false;
  }
  return done;
}

Status StagingBackend::flush_gpu_writes() {
  const CudaDriver* d = nullptr;
  MK_CHECK(cuda_driver(&d));
  MK_CU_CHECK(d->cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                            CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER));
  return OkStatus();
}

void StagingBackend::stage_out() {
  // Start chunks, oldest put first; a put waiting for room holds back the later ones.
  while (!queued_.empty()) {
    const uint32_t id = queued_.front();
    StagedPut& p = puts_[id];
    const Window& s = wins_[p.src];
    while (p.started < p.chunks && !free_outbox_.empty() && sent_to_[p.peer] - credit_from_[p.peer] < sc_.inbox_slots) {
      const uint32_t j = p.started++;
      const uint32_t k = free_outbox_.back();
      free_outbox_.pop_back();
      const uint32_t k_in = static_cast<uint32_t>(sent_to_[p.peer]++ % sc_.inbox_slots);
      const uint64_t off = uint64_t(j) * sc_.chunk_bytes;
      const uint64_t len = p.bytes == 0 ? 0 : std::min<uint64_t>(sc_.chunk_bytes, p.bytes - off);
      StagedHeader h{};
      h.magic = kStagedMagic;
      h.src_rank = static_cast<uint32_t>(rank_);
      h.dst_window = p.dst;
      h.imm = p.imm;
      h.dst_offset = p.dst_off + off;
      h.bytes = len;
      h.put = p.seq;
      h.chunks = p.chunks;
      uint8_t* slot = outbox_slot(k);
      memcpy(slot, &h, sizeof(h));
      OutChunk& ch = out_[k];
      ch = OutChunk{id, j, k_in, -1};
      to_post_.push_back(k);
      Status st = start_copy(slot + sizeof(StagedHeader), static_cast<uint8_t*>(s.base) + p.src_off + off, len,
                             s.kind == net::MemKind::kCuda, &ch.copy);
      if (!st.ok()) {
        fail(make_status(st.code(), "rank %d: staging copy for rank %d failed: %s", rank_, p.peer,
                         st.message().c_str()));
        return;
      }
    }
    if (p.started < p.chunks) break;
    queued_.pop_front();
  }
  // Post chunks in the order they were started, each once its copy finished: a copy still
  // running or failed holds back every later chunk.
  while (!to_post_.empty()) {
    const uint32_t k = to_post_.front();
    OutChunk& ch = out_[k];
    const StagedPut& p = puts_[ch.put];
    if (!copy_done(ch.copy, "for", p.peer)) return;
    ch.copy = -1;
    const StagedHeader* h = reinterpret_cast<const StagedHeader*>(outbox_slot(k));
    bool posted = false;
    Status st = tr_->put(p.peer, outbox_id_, uint64_t(k) * slot_bytes(), inbox_id_, inbox_offset(rank_, ch.inbox_slot),
                         sizeof(StagedHeader) + h->bytes, kImmStaged | (uint32_t(rank_) << 16) | ch.inbox_slot,
                         kCookieChunk | k, &posted);
    if (!st.ok()) {
      fail(make_status(st.code(), "rank %d: posting staged chunk %u of %u of a put (peer %d): %s", rank_,
                       ch.chunk + 1, p.chunks, p.peer, st.message().c_str()));
      return;
    }
    if (!posted) return;  // the transport is out of resources: progress, then retry in order
    to_post_.pop_front();
  }
}

void StagingBackend::on_local_done(uint64_t cookie, std::vector<net::LocalDone>* done) {
  const uint64_t idx = cookie & ~kTagMask;
  switch (cookie & kTagMask) {
    case kCookieDirect:
      if (idx < direct_cookie_.size()) {
        done->push_back(net::LocalDone{direct_cookie_[idx]});
        free_direct_.push_back(static_cast<uint32_t>(idx));
      }
      break;
    case kCookieChunk: {
      if (idx >= out_.size()) break;
      const uint32_t id = out_[idx].put;
      free_outbox_.push_back(static_cast<uint32_t>(idx));
      StagedPut& p = puts_[id];
      if (++p.done == p.chunks) {
        done->push_back(net::LocalDone{p.cookie});
        free_puts_.push_back(id);
      }
      break;
    }
    default:  // a credit return
      break;
  }
}

Status StagingBackend::on_staged_arrival(uint32_t imm) {
  const int sender = static_cast<int>((imm >> 16) & 0x3fff);
  const uint32_t low = imm & 0xffff;
  MK_REQUIRE(sender < world_ && staging_ready_, Code::kInternal,
             "rank %d: staging traffic (imm 0x%08x) from unknown rank %d", rank_, imm, sender);
  if (imm & kImmCredit) {
    credit_from_[sender] += low;
    return OkStatus();
  }
  MK_REQUIRE(low < sc_.inbox_slots, Code::kInternal, "rank %d: rank %d wrote inbox slot %u of %u", rank_, sender,
             low, sc_.inbox_slots);
  InChunk in;
  in.sender = sender;
  in.slot = low;
  const uint8_t* slot = inbox_ + inbox_offset(sender, low);
  memcpy(&in.h, slot, sizeof(StagedHeader));
  const StagedHeader& h = in.h;
  const Window* dst = h.dst_window < wins_.size() && wins_[h.dst_window].live ? &wins_[h.dst_window] : nullptr;
  // The receiver checks too: a staged chunk never writes outside its window.
  if (h.magic != kStagedMagic || h.src_rank != static_cast<uint32_t>(sender) || !dst || h.bytes > sc_.chunk_bytes ||
      h.dst_offset > dst->bytes || h.bytes > dst->bytes - h.dst_offset)
    return make_status(Code::kInvalidArgument,
                       "rank %d: rank %d sent a bad staged chunk (magic 0x%x, window %u, offset %llu, %llu B)", rank_,
                       sender, h.magic, h.dst_window, static_cast<unsigned long long>(h.dst_offset),
                       static_cast<unsigned long long>(h.bytes));
  Status st = start_copy(static_cast<uint8_t*>(dst->base) + h.dst_offset, slot + sizeof(StagedHeader), h.bytes,
                         dst->kind == net::MemKind::kCuda, &in.copy);
  if (!st.ok())
    return make_status(st.code(), "rank %d: staging copy from rank %d failed: %s", rank_, sender, st.message().c_str());
  in_.push_back(in);
  return OkStatus();
}

void StagingBackend::stage_in(std::vector<net::Arrival>* arrivals) {
  for (size_t i = 0; i < in_.size();) {
    InChunk& in = in_[i];
    if (!copy_done(in.copy, "from", in.sender)) {
      if (!error_.ok()) return;
      ++i;
      continue;
    }
    // The chunk is in its window: the put arrives with its last chunk.
    const auto key = std::make_pair(in.sender, in.h.put);
    if (++chunks_in_[key] == in.h.chunks) {
      chunks_in_.erase(key);
      arrivals->push_back(net::Arrival{in.h.imm});
    }
    // Slots return to the sender in slot order (it reuses them round-robin).
    std::vector<uint8_t>& freed = freed_[in.sender];
    freed[in.slot] = 1;
    while (freed[next_credit_[in.sender] % sc_.inbox_slots]) {
      freed[next_credit_[in.sender] % sc_.inbox_slots] = 0;
      ++next_credit_[in.sender];
      ++credit_owed_[in.sender];
    }
    in_[i] = in_.back();
    in_.pop_back();
  }
  for (int s = 0; s < world_; ++s) {
    if (credit_owed_[s] == 0) continue;
    const uint32_t n = std::min<uint32_t>(credit_owed_[s], 0xffff);
    bool posted = false;
    Status st = tr_->put(s, credit_id_, 0, credit_id_, 0, 0, kImmStaged | kImmCredit | (uint32_t(rank_) << 16) | n,
                         kCookieCredit, &posted);
    if (!st.ok()) {
      fail(make_status(st.code(), "rank %d: returning staging credits (peer %d): %s", rank_, s, st.message().c_str()));
      return;
    }
    if (!posted) break;
    credit_owed_[s] -= n;
  }
}

Status StagingBackend::progress(std::vector<net::LocalDone>* done, std::vector<net::Arrival>* arrivals) {
  MK_REQUIRE(!finalized_, Code::kInvalidArgument, "%s: progress after finalize", name());
  if (error_.ok() && staging_ready_) stage_out();
  tr_done_.clear();
  tr_arrivals_.clear();
  Status ts = tr_->progress(&tr_done_, &tr_arrivals_);
  if (!ts.ok()) fail(ts);
  for (const net::LocalDone& d : tr_done_) on_local_done(d.cookie, done);
  // Direct puts into GPU memory (GPUDirect RDMA): the NIC's writes are made visible to the GPU
  // before their arrivals are reported; without a successful flush they are not reported.
  bool flushed = false, flush_failed = false;
  for (const net::Arrival& a : tr_arrivals_) {
    if (a.imm & kImmStaged) {
      if (!error_.ok()) continue;  // failed: no copy starts, no credit returns
      Status s = on_staged_arrival(a.imm);
      if (!s.ok()) fail(s);
      continue;
    }
    if (direct_gpu_ && !flushed) {
      if (flush_failed) continue;
      Status f = flush_gpu_writes();
      if (!f.ok()) {
        fail(make_status(f.code(), "rank %d: flushing GPUDirect RDMA writes: %s", rank_, f.message().c_str()));
        flush_failed = true;
        continue;
      }
      flushed = true;
    }
    arrivals->push_back(a);
  }
  if (error_.ok() && staging_ready_) stage_in(arrivals);
  return error_;
}

Status StagingBackend::finalize() {
  if (abandoned_.load()) return given_up();  // nothing freed: the stuck thread still uses it
  if (finalized_) return OkStatus();
  finalized_ = true;
  Status first;
  auto keep = [&](const Status& s) {
    if (first.ok() && !s.ok()) first = s;
  };
  for (auto it = wins_.rbegin(); it != wins_.rend(); ++it) {
    if (it->live && !it->staged) keep(tr_->deregister_window(it->transport));
    it->live = false;
  }
  if (staging_ready_)
    for (net::WindowId id : {credit_id_, outbox_id_, inbox_id_}) keep(tr_->deregister_window(id));
  host_free(gpu_, inbox_);
  host_free(gpu_, outbox_);
  host_free(gpu_, credit_);
  inbox_ = outbox_ = credit_ = nullptr;
  return first;
}

}  // namespace mk
