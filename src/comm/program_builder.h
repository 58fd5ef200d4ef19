// mkernel — the shared helpers with which every operator writes its communication program
// (program.h): flags, waits and signals; buffer declarations; the entry token put; network puts,
// staged or not, with their local completions counted per flag. Pure host code, no CUDA.
//
// An operator's builder keeps a ProgramBuilder over its ProgramDecl and writes its own ops with
// it; what is the operator's own (which chunk goes where, in which order) stays in the operator.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include "src/comm/program.h"

namespace mk {
namespace comm {

inline BufRef buf_at(BufId b, int rank, uint64_t offset) { return BufRef{b, rank, offset}; }
inline FlagRef flag_at(RegionId r, int rank, uint32_t index) { return FlagRef{r, rank, index}; }
// flag >= mul * e, raised by `peer` (reported on timeout).
inline Wait wait_on(RegionId r, int rank, uint32_t index, uint64_t mul, int peer) {
  return Wait{flag_at(r, rank, index), mul, peer};
}
// flag = e.
inline Signal set_epoch(RegionId r, int rank, uint32_t index) { return Signal{flag_at(r, rank, index), 1, false}; }
// flag += value.
inline Signal add_to(RegionId r, int rank, uint32_t index, uint64_t value = 1) {
  return Signal{flag_at(r, rank, index), value, true};
}

class ProgramBuilder {
 public:
  explicit ProgramBuilder(ProgramDecl& p) : p_(p) {}
  ProgramDecl& decl() { return p_; }

  // Declares the next buffer (ids follow the order of the calls).
  BufId buf(const char* name, uint64_t bytes, Space space, bool network = false, int user_slot = -1,
            BufId mirror_of = kNoBuf, bool rank_token = false);

  // A signal-only op.
  static Op signal_op(std::vector<Signal> signals, std::string what);

  // A network put of `bytes` from src (this rank's) to dst (on `to`), raising remote_flag there on
  // arrival and local_flag here on local completion (counted: completions(); kNoRegion: none). In
  // a staged program the put moves the host mirrors of src's and dst's buffers, and the device
  // first copies src into its mirror (Op::stage_src).
  Op put(int to, BufRef src, BufRef dst, uint64_t bytes, FlagRef remote_flag, FlagRef local_flag, std::string what);

  // The entry handshake across nodes: this rank's 8-byte token (a rank_token buffer: its words are
  // filled at setup) at offset 8 * me, to the same place on `to`. In a staged program the put moves
  // the token's host mirror, which holds the same words (no staging copy). local_flag may be none.
  Op token_put(int me, int to, BufId token, FlagRef remote_flag, FlagRef local_flag, std::string what);

  // The entry handshake of rank me, appended to `ops` (a program's first ops): region `entry`'s
  // flag me set to the call's epoch on every other rank of me's node (their buffers may now be
  // written: me entered the call), and me's token put to its twin on every other node, raising
  // that twin's `entry_net` flag me (token_put: no local completion).
  void entry_ops(int me, RegionId entry, RegionId entry_net, BufId token, std::vector<Op>* ops);

  // The op that ends a call once the proxy has read every source of this rank's puts: a wait for
  // their local completions counted on `src_free` (rank me's), appended to `ops` — none when no put
  // of the program counts there.
  void proxy_done_op(const FlagRef& src_free, int me, std::string what, std::vector<Op>* ops) const;

  // Local completions counted on local flags by put() and token_put(): per flag index within
  // `region` of `rank` (ascending), and on one flag.
  std::vector<std::pair<uint32_t, uint64_t>> completions(RegionId region, int rank) const;
  uint64_t completions_at(const FlagRef& f) const;

 private:
  // A put as it is, its local completion counted (put and token_put).
  Op net_op(int to, BufRef src, BufRef dst, uint64_t bytes, FlagRef remote_flag, FlagRef local_flag, std::string what);

  ProgramDecl& p_;
  std::map<std::tuple<RegionId, int, uint32_t>, uint64_t> completions_;
};

}  // namespace comm
}  // namespace mk
