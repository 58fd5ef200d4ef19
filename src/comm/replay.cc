// The CPU replayer of communication programs (see src/comm/replay.h).
#include "src/comm/replay.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

namespace mk {
namespace comm {

std::string check_static(const ProgramDecl& p, const std::vector<const RankProgram*>& ranks,
                         const std::vector<ComputeRaise>& craises, const std::vector<ComputeWait>& cwaits) {
  const int W = p.layout.world;
  const auto& node = p.layout.node_of;
  if (int(ranks.size()) != W) return "the program has " + std::to_string(ranks.size()) + " ranks, world " + std::to_string(W);
  auto invalid = [&](const FlagRef& f) {
    return f.region >= p.regions.size() || f.rank < 0 || f.rank >= W || f.index >= p.regions[f.region].size;
  };
  struct Raises {
    uint64_t adds = 0, sets = 0, set_value = 0;
  };
  std::map<std::pair<int, uint32_t>, Raises> raised;  // (rank, pad index) -> raises per call
  auto key = [&](const FlagRef& f) { return std::make_pair(f.rank, p.flag_index(f)); };
  std::string err;
  auto device = [&](int me, const Signal& s, uint64_t times, const std::string& who) {
    if (invalid(s.flag)) err = who + ": invalid signal flag " + flag_str(p, s.flag);
    else if (p.proxy_region(s.flag.region)) err = who + ": device signal on proxy flag " + flag_str(p, s.flag);
    else if (node[s.flag.rank] != node[me]) err = who + ": device signal to another node " + flag_str(p, s.flag);
    if (!err.empty()) return;
    Raises& r = raised[key(s.flag)];
    if (s.add) r.adds += s.value * times;
    else r.sets += times, r.set_value = s.value;
  };
  auto proxy = [&](const FlagRef& f, const std::string& who) {
    if (invalid(f)) err = who + ": invalid put flag " + flag_str(p, f);
    else if (!p.proxy_region(f.region)) err = who + ": the proxy raises device flag " + flag_str(p, f);
    else raised[key(f)].adds += 1;
  };
  for (int me = 0; me < W && err.empty(); ++me) {
    const RankProgram& rp = *ranks[me];
    const std::string rk = "rank " + std::to_string(me);
    for (size_t i = 0; i < rp.ops.size() && err.empty(); ++i) {
      const Op& op = rp.ops[i];
      const std::string who = rk + " op " + std::to_string(i) + " (" + op.what + ")";
      for (const auto& s : op.signals) device(me, s, 1, who);
      if (op.kind == OpKind::kNetPut) {
        if (!op.signals.empty()) err = who + ": a put with device signals";
        if (op.remote_flag.rank != op.peer) err = who + ": remote flag not on the destination rank";
        if (op.local_flag.region != kNoRegion && op.local_flag.rank != me) err = who + ": local flag elsewhere";
        if (!err.empty()) break;
        proxy(op.remote_flag, who);
        if (op.local_flag.region != kNoRegion) proxy(op.local_flag, who);
      }
    }
  }
  for (const auto& r : craises) {
    if (!err.empty()) break;
    device(r.rank, r.signal, r.times, "rank " + std::to_string(r.rank) + " " + r.who);
  }
  if (!err.empty()) return err;
  auto check_wait = [&](int me, const Wait& w, const std::string& who) {
    if (invalid(w.flag)) return err = who + ": invalid wait flag " + flag_str(p, w.flag), false;
    if (w.flag.rank != me) return err = who + ": waits on another rank's flag " + flag_str(p, w.flag), false;
    auto it = raised.find(key(w.flag));
    const std::string f = flag_str(p, w.flag) + " >= " + std::to_string(w.mul) + "*e";
    if (it == raised.end()) return err = who + ": waits on " + f + " which nothing raises (deadlock)", false;
    const Raises& r = it->second;
    if (r.adds && r.sets) return err = who + ": " + f + " is both set and added", false;
    if (r.sets) {
      if (r.sets != 1) return err = who + ": " + f + " is set " + std::to_string(r.sets) + " times per call", false;
      // A flag set to v * e must be waited as >= v * e: a smaller mul would pass in a later call
      // before that call's signal (v * e >= mul * e' for e' > e), a larger one never.
      if (w.mul != r.set_value)
        return err = who + ": " + f + " but the program sets it to " + std::to_string(r.set_value) + "*e", false;
    } else if (r.adds != w.mul) {
      return err = who + ": waits " + f + " but the program adds " + std::to_string(r.adds) + " per call", false;
    }
    return true;
  };
  for (int me = 0; me < W; ++me) {
    const RankProgram& rp = *ranks[me];
    // Flags this rank's own ops raise (device signals, and its puts' local completions), by the
    // last op index that raises each: with one comm CTA the ops run strictly in list order, and a
    // wait's count needs every raise of the call, so an op waiting for a raise by itself or a
    // later op of its own list deadlocks.
    std::map<std::pair<int, uint32_t>, size_t> last_raise;
    for (size_t i = 0; i < rp.ops.size(); ++i) {
      const Op& op = rp.ops[i];
      for (const auto& s : op.signals) last_raise[key(s.flag)] = i;
      if (op.kind == OpKind::kNetPut && op.local_flag.region != kNoRegion) last_raise[key(op.local_flag)] = i;
    }
    for (size_t i = 0; i < rp.ops.size(); ++i)
      for (const auto& w : rp.ops[i].waits) {
        const std::string who = "rank " + std::to_string(me) + " op " + std::to_string(i) + " (" + rp.ops[i].what + ")";
        if (!check_wait(me, w, who)) return err;
        auto it = last_raise.find(key(w.flag));
        if (it != last_raise.end() && it->second >= i)
          return who + ": waits on " + flag_str(p, w.flag) + " which op " + std::to_string(it->second) + " (" +
                 rp.ops[it->second].what + ") of its own list raises (deadlock with one comm CTA)";
      }
  }
  for (const auto& w : cwaits)
    if (!check_wait(w.rank, w.wait, "rank " + std::to_string(w.rank) + " " + w.who)) return err;
  return "";
}

Replay::Replay(const ProgramDecl& p, std::vector<const RankProgram*> ranks, ReplayCompute* compute,
               const ReplayOptions& o)
    : p_(p), progs_(std::move(ranks)), compute_(compute), opt_(o), rng_(o.seed), W_(p.layout.world) {
  ranks_.resize(W_);
  for (int r = 0; r < W_; ++r) {
    RankState& s = ranks_[r];
    s.mem.resize(p.bufs.size());
    for (size_t b = 0; b < p.bufs.size(); ++b) {
      s.mem[b].assign(p.bufs[b].bytes, 0);
      if (p.bufs[b].rank_token)
        for (size_t i = 0; i + 8 <= s.mem[b].size(); i += 8) {
          const uint64_t v = uint64_t(r);
          memcpy(&s.mem[b][i], &v, 8);
        }
    }
    s.flags.assign(p.pad_flags, 0);
    const bool shared = o.shared_slots > 0;
    s.comm.assign(shared ? o.shared_slots : std::max(1, o.comm_slots), -1);
    s.held.assign(s.comm.size(), 0);
    s.units.assign(shared ? o.shared_slots : std::max(1, o.compute_slots), {-1, 0});
  }
}

bool Replay::fail(const std::string& m) {
  if (err_.empty()) err_ = ctx_ + ": " + m;
  return false;
}

uint8_t* Replay::access(int me, const BufRef& b, uint64_t bytes, bool net) {
  if (b.buf >= p_.bufs.size() || b.rank < 0 || b.rank >= W_) return fail("bad buffer " + ref_str(p_, b)), nullptr;
  const BufDecl& d = p_.bufs[b.buf];
  if (d.space == Space::kUser && (b.rank != me || net))
    return fail("touches the caller's buffer " + ref_str(p_, b)), nullptr;
  if (d.space == Space::kHost && !net && b.rank != me)
    return fail("device code touches another rank's host mirror " + ref_str(p_, b)), nullptr;
  if (net && !d.network) return fail("the proxy touches " + ref_str(p_, b) + ", not a network window"), nullptr;
  if (net && p_.net_staged && d.space != Space::kHost)
    return fail("the proxy touches device buffer " + ref_str(p_, b) + " in a staged program"), nullptr;
  if (!net && p_.layout.node_of[b.rank] != p_.layout.node_of[me])
    return fail("touches " + ref_str(p_, b) + " on another node without the proxy"), nullptr;
  auto& v = ranks_[b.rank].mem[b.buf];
  if (b.offset + bytes > v.size())
    return fail(ref_str(p_, b) + " + " + std::to_string(bytes) + " bytes is past its " + std::to_string(v.size())),
           nullptr;
  return v.data() + b.offset;
}

void Replay::raise(int me, const Signal& s) {
  uint64_t& f = flag(s.flag);
  f = s.add ? f + s.value : s.value * uint64_t(ranks_[me].epoch);
}

const Wait* Replay::unmet(int me, const Wait* w, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!holds(me, w[i])) return &w[i];
  return nullptr;
}

std::string Replay::wait_str(int me, const Wait& w) {
  return flag_str(p_, w.flag) + " = " + std::to_string(flag(w.flag)) + ", needs >= " +
         std::to_string(w.mul * uint64_t(ranks_[me].epoch)) +
         (w.peer < 0 ? " (raised by several ranks)" : " (raised by rank " + std::to_string(w.peer) + ")");
}

void Replay::start_call(int me) {
  RankState& s = ranks_[me];
  ++s.epoch;
  s.active = true;
  const uint64_t levels = uint64_t(std::min(std::max(opt_.speed_levels, 1), 8));
  s.speed = 1u << (2 * (rng_() % levels));  // 1, 4, 16, ...
  s.w_comm = 1u << (2 * (rng_() % levels));
  s.w_unit = 1u << (2 * (rng_() % levels));
  s.w_net = 1u << (2 * (rng_() % levels));
  s.next_op = s.ops_done = s.next_unit = s.units_done = 0;
  compute_->start_call(*this, me, s.epoch);
}

bool Replay::exec_op(int me, int slot) {
  RankState& s = ranks_[me];
  const int idx = s.comm[slot];
  const Op& op = progs_[me]->ops[idx];
  ctx_ = "rank " + std::to_string(me) + " call " + std::to_string(s.epoch) + " op " + std::to_string(idx) + " " +
         op_kind_name(op.kind) + " (" + op.what + ")";
  uint64_t bytes = op.bytes;
  if (op.count_at.buf != kNoBuf) {
    if (op.kind != OpKind::kCopy && op.kind != OpKind::kZero && op.kind != OpKind::kNetPut)
      return fail("a run-time count on this kind of op");
    if (op.count_at.rank != me) return fail("a run-time count in another rank's memory");
    const uint8_t* c = access(me, op.count_at, 8, false);
    if (!c) return false;
    uint64_t n;
    memcpy(&n, c, 8);
    bytes = std::min(bytes, n) & ~uint64_t(15);  // as the device does
  }
  switch (op.kind) {
    case OpKind::kCopy: {
      if (op.srcs.size() != 1 || op.dsts.empty()) return fail("a copy needs one source and a destination");
      const uint8_t* src = access(me, op.srcs[0], bytes, false);
      if (!src) return false;
      for (const auto& d : op.dsts) {
        uint8_t* dst = access(me, d, bytes, false);
        if (!dst) return false;
        memmove(dst, src, bytes);
      }
      break;
    }
    case OpKind::kReduce: {
      if (op.srcs.empty() || op.dsts.empty() || op.srcs.size() > 32 || (op.zero_src_mask >> op.srcs.size()) != 0)
        return fail("malformed reduce");
      // The device starts from the first source (acc = src0; acc += src1 ...): so does this.
      const uint64_t sb = op.src_bf16 ? 2 : 4;
      std::vector<float> sum(op.elems, 0.f), v(op.elems);
      std::vector<uint8_t*> src;
      for (const auto& r : op.srcs) {
        src.push_back(access(me, r, op.elems * sb, false));
        if (!src.back()) return false;
        if (op.src_bf16) {
          for (uint64_t i = 0; i < op.elems; ++i) {
            uint16_t h;
            memcpy(&h, src.back() + 2 * i, 2);
            const uint32_t u = uint32_t(h) << 16;
            memcpy(&v[i], &u, 4);
          }
        } else {
          memcpy(v.data(), src.back(), op.elems * 4);
        }
        if (src.size() == 1) sum = v;
        else for (uint64_t i = 0; i < op.elems; ++i) sum[i] += v[i];
      }
      for (const auto& d : op.dsts) {
        uint8_t* dst = access(me, d, op.elems * (op.dst_f32 ? 4 : 2), false);
        if (!dst) return false;
        if (op.dst_f32) {
          memcpy(dst, sum.data(), op.elems * 4);
        } else {
          for (uint64_t i = 0; i < op.elems; ++i) {
            // bf16, round to nearest even (the device's __floats2bfloat162_rn)
            uint32_t u;
            memcpy(&u, &sum[i], 4);
            const uint16_t h = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            memcpy(dst + 2 * i, &h, 2);
          }
        }
      }
      for (size_t i = 0; i < src.size(); ++i)
        if (op.zero_src_mask >> i & 1) memset(src[i], 0, op.elems * sb);
      break;
    }
    case OpKind::kNetPut:  // handed to the proxy: the bytes are read when it delivers
      if (op.srcs.size() != 1 || op.dsts.size() != 1 || op.srcs[0].rank != me || op.dsts[0].rank != op.peer ||
          !op.signals.empty())
        return fail("malformed put");
      if (op.stage_src.buf != kNoBuf) {  // staged: the device fills the host mirror first
        if (!p_.net_staged || op.stage_src.rank != me || p_.is_host(op.stage_src.buf) ||
            p_.mirror(op.stage_src.buf) != op.srcs[0].buf || op.stage_src.offset != op.srcs[0].offset)
          return fail("malformed staged put");
        const uint8_t* from = access(me, op.stage_src, bytes, false);
        uint8_t* to = access(me, op.srcs[0], bytes, false);
        if (!from || !to) return false;
        memmove(to, from, bytes);
      }
      if (!access(me, op.srcs[0], op.bytes, true) || !access(me, op.dsts[0], op.bytes, true)) return false;
      s.in_flight.push_back({idx, bytes});
      break;
    case OpKind::kSignal:
      if (!op.srcs.empty() || !op.dsts.empty()) return fail("a signal op with buffers");
      break;
    case OpKind::kZero:
      for (const auto& d : op.dsts) {
        uint8_t* dst = access(me, d, bytes, false);
        if (!dst) return false;
        memset(dst, 0, bytes);
      }
      break;
  }
  for (const auto& sig : op.signals) raise(me, sig);
  s.comm[slot] = -1;
  ++s.ops_done;
  return true;
}

// The proxy of rank me completes its oldest put: copies the source as it is now, raises the
// destination's flag and then its own local-completion flag.
bool Replay::deliver(int me) {
  RankState& s = ranks_[me];
  const Op& op = progs_[me]->ops[s.in_flight.front().first];
  const uint64_t bytes = s.in_flight.front().second;  // fixed when the put was issued (run-time counts)
  s.in_flight.pop_front();
  ctx_ = "rank " + std::to_string(me) + " proxy delivering (" + op.what + ")";
  const uint8_t* src = access(me, op.srcs[0], bytes, true);
  uint8_t* dst = access(me, op.dsts[0], bytes, true);
  if (!src || !dst) return false;
  memmove(dst, src, bytes);
  flag(op.remote_flag) += 1;
  if (op.local_flag.region != kNoRegion) flag(op.local_flag) += 1;
  return true;
}

std::string Replay::deadlock_report() {
  std::ostringstream os;
  os << "deadlock: no op, unit or put can move\n";
  for (int r = 0; r < W_; ++r) {
    RankState& s = ranks_[r];
    const RankProgram& rp = *progs_[r];
    os << " rank " << r << (s.active ? "" : " (finished)") << ": call " << s.epoch << ", ops " << s.ops_done << "/"
       << rp.ops.size() << ", units " << s.units_done << "/" << compute_->units(r) << ", puts in flight "
       << s.in_flight.size() << "\n";
    for (int idx : s.comm) {
      if (idx < 0) continue;
      const Op& op = rp.ops[idx];
      const Wait* w = unmet(r, op.waits);
      os << "   op " << idx << " " << op_kind_name(op.kind) << " (" << op.what << ") waits "
         << (w ? wait_str(r, *w) : "nothing?") << "\n";
    }
    if (opt_.shared_slots > 0 && s.next_op < rp.ops.size()) {
      const Op& op = rp.ops[s.next_op];
      const Wait* w = unmet(r, op.waits);
      os << "   next op " << s.next_op << " " << op_kind_name(op.kind) << " (" << op.what << ") waits "
         << (w ? wait_str(r, *w) : "nothing?") << "\n";
    }
    for (const auto& u : s.units) {
      if (u.first < 0) continue;
      size_t n = 0;
      const Wait* ws = compute_->waits(r, size_t(u.first), u.second, &n);
      const Wait* w = unmet(r, ws, n);
      os << "   " << compute_->unit_name(r, size_t(u.first)) << " phase " << u.second << " waits "
         << (w ? wait_str(r, *w) : "nothing?") << "\n";
    }
  }
  return os.str();
}

bool Replay::run() {
  for (int r = 0; r < W_; ++r) start_call(r);
  std::vector<Unit> units;
  for (;;) {
    units.clear();
    bool busy = false;
    for (int r = 0; r < W_; ++r) {
      RankState& s = ranks_[r];
      const RankProgram& rp = *progs_[r];
      if (!s.in_flight.empty()) units.push_back({UnitKind::kDeliver, r, 0});
      if (!s.active) continue;
      busy = true;
      for (size_t i = 0; i < s.comm.size() && opt_.shared_slots <= 0; ++i) {
        if (s.comm[i] < 0 && s.next_op < rp.ops.size()) {  // take the next op
          s.comm[i] = int(s.next_op++);
          s.held[i] = opt_.hold_one_in > 0 && rng_() % uint64_t(opt_.hold_one_in) == 0;
        }
        if (s.comm[i] >= 0 && !s.held[i] && !unmet(r, rp.ops[s.comm[i]].waits))
          units.push_back({UnitKind::kComm, r, int(i)});
      }
      const size_t nu = compute_->units(r);
      if (opt_.shared_slots > 0) {
        // Shared slots: the next op (in list order) when its waits are met, else the next unit;
        // a slot whose unit waits runs the next op meanwhile when it is ready.
        const bool op_ready = s.next_op < rp.ops.size() && !unmet(r, rp.ops[s.next_op].waits);
        for (size_t i = 0; i < s.units.size(); ++i) {
          auto& u = s.units[i];
          if (u.first < 0) {
            if (op_ready) {
              units.push_back({UnitKind::kSharedOp, r, int(i)});
              continue;
            }
            if (s.next_unit >= nu) continue;
            u = {long(s.next_unit++), 0};
          }
          size_t n = 0;
          const Wait* ws = compute_->waits(r, size_t(u.first), u.second, &n);
          if (!unmet(r, ws, n)) units.push_back({UnitKind::kCompute, r, int(i)});
          else if (op_ready) units.push_back({UnitKind::kSharedOp, r, int(i)});
        }
        continue;
      }
      for (size_t i = 0; i < s.units.size(); ++i) {
        auto& u = s.units[i];
        if (u.first < 0 && s.next_unit < nu) u = {long(s.next_unit++), 0};
        if (u.first < 0) continue;
        size_t n = 0;
        const Wait* ws = compute_->waits(r, size_t(u.first), u.second, &n);
        if (!unmet(r, ws, n)) units.push_back({UnitKind::kCompute, r, int(i)});
      }
    }
    if (units.empty()) {
      std::vector<std::pair<int, size_t>> held;  // nothing else moves: let one held op go
      for (int r = 0; r < W_; ++r)
        for (size_t i = 0; i < ranks_[r].held.size(); ++i)
          if (ranks_[r].held[i]) held.push_back({r, i});
      if (!held.empty()) {
        const auto h = held[rng_() % held.size()];
        ranks_[h.first].held[h.second] = 0;
        continue;
      }
      return busy ? (ctx_ = "replay", fail(deadlock_report())) : true;
    }
    uint64_t total = 0;  // a random unit, weighted by its rank's speed and its kind's weight
    auto weight = [&](const Unit& x) -> uint64_t {
      const RankState& r = ranks_[x.rank];
      return uint64_t(r.speed) * (x.kind == UnitKind::kComm || x.kind == UnitKind::kSharedOp ? r.w_comm
                                  : x.kind == UnitKind::kCompute                                 ? r.w_unit
                                                                                                 : r.w_net);
    };
    for (const Unit& x : units) total += weight(x);
    uint64_t pick = rng_() % total;
    size_t i = 0;
    while (pick >= weight(units[i])) pick -= weight(units[i++]);
    const Unit u = units[i];
    RankState& s = ranks_[u.rank];
    bool ok = true;
    switch (u.kind) {
      case UnitKind::kDeliver: ok = deliver(u.rank); break;
      case UnitKind::kComm: ok = exec_op(u.rank, u.slot); break;
      case UnitKind::kSharedOp:
        s.comm[u.slot] = int(s.next_op++);
        ok = exec_op(u.rank, u.slot);
        break;
      case UnitKind::kCompute: {
        auto& cu = s.units[u.slot];
        ctx_ = "rank " + std::to_string(u.rank) + " call " + std::to_string(s.epoch) + " " +
               compute_->unit_name(u.rank, size_t(cu.first)) + " phase " + std::to_string(cu.second);
        ok = compute_->run(*this, u.rank, size_t(cu.first), cu.second);
        if (ok && ++cu.second == compute_->phases(u.rank, size_t(cu.first))) {
          cu = {-1, 0};
          ++s.units_done;
        }
        break;
      }
    }
    if (!ok) return false;
    if (u.kind != UnitKind::kDeliver && s.active && s.ops_done == progs_[u.rank]->ops.size() &&
        s.units_done == compute_->units(u.rank)) {
      ctx_ = "rank " + std::to_string(u.rank) + " call " + std::to_string(s.epoch) + " output";
      if (!compute_->finish_call(*this, u.rank, s.epoch)) return false;
      if (s.epoch < opt_.calls) start_call(u.rank);
      else s.active = false;
    }
  }
}

}  // namespace comm
}  // namespace mk
