// mkernel — planted failures for fault-injection tests (tunable `fault`, MK_FAULT).
//
// Off unless the tunable names a fault; then the rank it names fails at the n-th event of a
// site, the way a real failure would, so tests can show that every rank still leaves in time
// and names the culprit (docs/testing.md, "Faults"). The value is a comma list of
//
//   <site>:<action>@<rank>[#<n>]      n >= 1, default 1
//
//   call:kill        the rank's n-th operator call: SIGKILL to itself shortly after the call
//                    is taken (its kernel is in flight, its peers' too)
//   call:stop        likewise SIGSTOP (a hung process: alive, silent)
//   call:badinput    the n-th call is refused on this rank alone as bad input (its peers launch)
//   put:error        the network backend's n-th put fails as a provider error would
//   completion:error the backend's n-th completion reports a provider error
//   register:error   the backend's n-th window registration is refused
//
// An operator call is each entry that launches communication (FusedGemm::run/enqueue,
// RingAttention::run/enqueue, MoeEp::dispatch and ::combine, each of them in MoeLayer::run).
#pragma once

#include <cstdint>
#include <string>

#include "mkernel/common/status.h"

namespace mk {
namespace fault {

enum class Site { kCall, kPut, kCompletion, kRegister };
enum class Action { kNone, kKill, kStop, kBadInput, kError };

// Counts this event of `site` on `rank` and returns the action planted for it (kNone unless
// the tunable plants one here; one atomic load when it plants nothing). Thread-safe. The
// tunable is read at the first call in the process (reload() reads it again).
Action at(Site site, int rank);

// kill and stop, carried out MK_FAULT_DELAY_MS (tunable fault_delay_ms, default 1) later from a
// thread of their own (the caller goes on and launches its work; the peers are in theirs; a long
// delay lets the call finish: a rank that dies or stops between calls). Other actions are the
// caller's to carry out.
void carry_out_later(Action a);

// The message a planted error carries ("... (planted by MK_FAULT=put:error@1#5)").
std::string planted(Site site, int rank);

// The tunable parses (empty is fine); else kInvalidArgument naming the bad entry.
Status validate();
Status parse(const std::string& spec, std::string* why);  // for tests: ok, or the reason

// Reads the tunable again and restarts the counts (tests).
void reload();

}  // namespace fault
}  // namespace mk
