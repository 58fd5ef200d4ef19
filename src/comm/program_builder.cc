// Shared helpers of the operators' program builders (see src/comm/program_builder.h).
#include "src/comm/program_builder.h"

#include <utility>

namespace mk {
namespace comm {

BufId ProgramBuilder::buf(const char* name, uint64_t bytes, Space space, bool network, int user_slot,
                          BufId mirror_of, bool rank_token) {
  BufDecl d;
  d.name = name;
  d.bytes = bytes;
  d.space = space;
  d.network = network;
  d.user_slot = user_slot;
  d.mirror_of = mirror_of;
  d.rank_token = rank_token;
  return p_.add_buf(d);
}

Op ProgramBuilder::signal_op(std::vector<Signal> signals, std::string what) {
  Op op;
  op.kind = OpKind::kSignal;
  op.signals = std::move(signals);
  op.what = std::move(what);
  return op;
}

Op ProgramBuilder::net_op(int to, BufRef src, BufRef dst, uint64_t bytes, FlagRef remote_flag, FlagRef local_flag,
                          std::string what) {
  Op op;
  op.kind = OpKind::kNetPut;
  op.srcs = {src};
  op.dsts = {dst};
  op.bytes = bytes;
  op.peer = to;
  op.remote_flag = remote_flag;
  op.local_flag = local_flag;
  if (local_flag.region != kNoRegion) ++completions_[{local_flag.region, local_flag.rank, local_flag.index}];
  op.what = std::move(what);
  return op;
}

Op ProgramBuilder::put(int to, BufRef src, BufRef dst, uint64_t bytes, FlagRef remote_flag, FlagRef local_flag,
                       std::string what) {
  Op op = net_op(to, src, dst, bytes, remote_flag, local_flag, std::move(what));
  if (p_.net_staged) {
    op.stage_src = src;
    op.srcs[0].buf = p_.mirror(src.buf);
    op.dsts[0].buf = p_.mirror(dst.buf);
  }
  return op;
}

Op ProgramBuilder::token_put(int me, int to, BufId token, FlagRef remote_flag, FlagRef local_flag, std::string what) {
  const BufId tok = p_.net_staged ? p_.mirror(token) : token;
  return net_op(to, BufRef{tok, me, 8ull * uint64_t(me)}, BufRef{tok, to, 8ull * uint64_t(me)}, 8, remote_flag,
                local_flag, std::move(what));
}

void ProgramBuilder::entry_ops(int me, RegionId entry, RegionId entry_net, BufId token, std::vector<Op>* ops) {
  Op op;
  op.kind = OpKind::kSignal;
  for (int q : p_.layout.node_peers(me)) op.signals.push_back(set_epoch(entry, q, uint32_t(me)));
  op.what = "entry signal to the node's peers";
  ops->push_back(op);
  for (int q : p_.layout.twins(me))
    ops->push_back(token_put(me, q, token, flag_at(entry_net, q, uint32_t(me)), FlagRef{},
                             "entry signal to rank " + std::to_string(q) + " (network)"));
}

void ProgramBuilder::proxy_done_op(const FlagRef& src_free, int me, std::string what, std::vector<Op>* ops) const {
  const uint64_t puts = completions_at(src_free);
  if (!puts) return;
  Op op;
  op.kind = OpKind::kSignal;
  op.waits = {Wait{src_free, puts, me}};
  op.what = std::move(what);
  ops->push_back(op);
}

std::vector<std::pair<uint32_t, uint64_t>> ProgramBuilder::completions(RegionId region, int rank) const {
  std::vector<std::pair<uint32_t, uint64_t>> out;
  for (const auto& [key, count] : completions_)
    if (std::get<0>(key) == region && std::get<1>(key) == rank) out.push_back({std::get<2>(key), count});
  return out;
}

uint64_t ProgramBuilder::completions_at(const FlagRef& f) const {
  auto it = completions_.find({f.region, f.rank, f.index});
  return it == completions_.end() ? 0 : it->second;
}

}  // namespace comm
}  // namespace mk
