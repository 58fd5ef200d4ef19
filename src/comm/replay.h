// mkernel — the CPU replayer of communication programs (host code, no CUDA; used by the tests).
//
// Every rank's program runs at once on host buffers under a seeded random interleaving of its
// communication slots (several communication CTAs taking ops in list order), its compute slots
// (the kernel's side, described by the operator through ReplayCompute) and its proxy (puts
// delivered later, reading their source at delivery), for several consecutive calls (epochs
// 1, 2, ...). A rank starts its next call as soon as its own call ends, so ranks run ahead of
// each other, and each call draws how fast each rank's communication, compute and proxy move.
// A schedule where nothing can move fails as a deadlock, naming the blocked op or unit and its
// wait on every rank. Every memory access is checked (bounds, caller buffers only by their own
// rank, host mirrors only by their own rank's device code or the proxy, other nodes only through
// the proxy).
//
// check_static() checks the flag accounting before any replay: every wait is on a flag of the
// waiting rank that the program raises exactly `mul` times per call (or sets to exactly mul * e
// once), on the raiser's node, proxy regions are raised only by the proxy, and no op waits for a
// flag that only a later op of its own list raises (a deadlock with one communication CTA).
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "src/comm/program.h"

namespace mk {
namespace comm {

class Replay;

// The compute side of an operator in a replay: per rank and call, `units` work units taken in
// order by the compute slots; each unit runs in `phases` steps, each after its waits.
class ReplayCompute {
 public:
  virtual ~ReplayCompute() = default;
  virtual size_t units(int rank) const = 0;
  virtual int phases(int rank, size_t unit) const = 0;
  // The waits before a phase: *n of them at the returned address (valid while the replay runs).
  virtual const Wait* waits(int rank, size_t unit, int phase, size_t* n) const = 0;
  // Runs a phase (reads and writes through Replay::mem, raises through Replay::raise); false
  // after Replay::fail.
  virtual bool run(Replay& r, int rank, size_t unit, int phase) = 0;
  // Fills the caller's inputs of rank's call `epoch` and poisons its outputs.
  virtual void start_call(Replay& r, int rank, int epoch) = 0;
  // Checks rank's outputs of call `epoch` (all its ops and units are done); false after fail.
  virtual bool finish_call(Replay& r, int rank, int epoch) = 0;
  virtual std::string unit_name(int rank, size_t unit) const = 0;
};

// Raises and waits of the compute side, for check_static: `times` raises per call.
struct ComputeRaise {
  int rank;
  Signal signal;
  uint64_t times;
  std::string who;
};
struct ComputeWait {
  int rank;
  Wait wait;
  std::string who;
};

// "" when the accounting holds, else the first problem found.
std::string check_static(const ProgramDecl& p, const std::vector<const RankProgram*>& ranks,
                         const std::vector<ComputeRaise>& raises, const std::vector<ComputeWait>& waits);

struct ReplayOptions {
  uint64_t seed = 1;
  int comm_slots = 1;
  int compute_slots = 1;
  int calls = 3;
  // Each call draws its rank's speed and the weights of its communication, compute and proxy
  // work from 4^0 .. 4^(speed_levels - 1): more levels, more lopsided interleavings (one rank
  // or one kind of work far behind the rest), which rare races need.
  int speed_levels = 3;
  // 0: off; n: an op taken by a communication slot is, one time in n, held until nothing else
  // can move (then one held op, at random, is let go): one CTA descheduled while the rest of
  // the job runs as far as the program lets it.
  int hold_one_in = 0;
  // > 0: the kernel's CTAs take either kind of work (comm_slots and compute_slots are ignored):
  // this many slots, each taking the next op (in list order) when its waits are met and else the
  // next unit; a slot whose unit waits runs the next op meanwhile when that op is ready (a CTA
  // never spins on a unit while an op is ready). A schedule that deadlocks here would hang a
  // kernel whose CTAs are not all resident (MPS, a smaller partition) if its roles were fixed.
  int shared_slots = 0;
};

class Replay {
 public:
  Replay(const ProgramDecl& p, std::vector<const RankProgram*> ranks, ReplayCompute* compute, const ReplayOptions& o);
  // Runs every call of every rank; false with error() on the first failure.
  bool run();
  const std::string& error() const { return err_; }

  // For ReplayCompute: memory [offset, offset + bytes) of a buffer as rank `me`'s device code
  // may reach it (null after fail()); the flag a FlagRef names; raising a signal in rank me's
  // current call; the current call of a rank; the failure context.
  uint8_t* mem(int me, const BufRef& b, uint64_t bytes) { return access(me, b, bytes, false); }
  uint64_t& flag(const FlagRef& f) { return ranks_[f.rank].flags[p_.flag_index(f)]; }
  void raise(int me, const Signal& s);
  int epoch(int rank) const { return ranks_[rank].epoch; }
  bool fail(const std::string& m);
  void set_context(const std::string& c) { ctx_ = c; }
  std::mt19937_64& rng() { return rng_; }
  const ProgramDecl& program() const { return p_; }

 private:
  struct RankState {
    std::vector<std::vector<uint8_t>> mem;  // [bufs]
    std::vector<uint64_t> flags;
    int epoch = 0;
    unsigned speed = 1, w_comm = 1, w_unit = 1, w_net = 1;
    bool active = false;
    size_t next_op = 0, ops_done = 0, next_unit = 0, units_done = 0;
    std::vector<int> comm;                    // op held by each comm slot; -1: free
    std::vector<char> held;                   // per comm slot: its op is held (hold_one_in)
    std::vector<std::pair<long, int>> units;  // (unit, phase) held by each compute slot; unit -1: free
    std::deque<std::pair<int, uint64_t>> in_flight;  // issued puts (op index, bytes), delivered in order
  };
  enum class UnitKind { kComm, kCompute, kDeliver, kSharedOp };
  struct Unit {
    UnitKind kind;
    int rank, slot;
  };

  uint8_t* access(int me, const BufRef& b, uint64_t bytes, bool net);
  bool holds(int me, const Wait& w) { return flag(w.flag) >= w.mul * uint64_t(ranks_[me].epoch); }
  const Wait* unmet(int me, const Wait* w, size_t n);
  const Wait* unmet(int me, const std::vector<Wait>& w) { return unmet(me, w.data(), w.size()); }
  std::string wait_str(int me, const Wait& w);
  void start_call(int me);
  bool exec_op(int me, int slot);
  bool deliver(int me);
  std::string deadlock_report();

  const ProgramDecl& p_;
  std::vector<const RankProgram*> progs_;
  ReplayCompute* compute_;
  ReplayOptions opt_;
  std::mt19937_64 rng_;
  const int W_;
  std::vector<RankState> ranks_;
  std::string err_, ctx_;
};

}  // namespace comm
}  // namespace mk
