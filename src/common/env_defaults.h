// mkernel — settings of the libraries mkernel drives that must be in place before they start.
//
// libfabric reads its providers' parameters once, when the process first asks it for anything
// (fi_getinfo; MPI_Init may do so). apply_env_defaults() puts mkernel's values into the
// environment, each only when the variable is unset (a user's value wins), and is called before
// the library's first fi_getinfo and before it initializes MPI itself. Idempotent, thread-safe.
//
//   FI_OFI_RXD_MAX_UNACKED=8    udp;ofi_rxd: unacknowledged datagrams per peer. The default
//                               (128) from 3 or more senders overflows a receiver's UDP socket
//                               buffer (208 KiB by default) whenever it is descheduled, and
//                               rxd's recovery then fails ("an incoming write failed:
//                               Truncation error", or a peer refusing puts for good); before
//                               libfabric 2.4 the udp provider's completion queue (2048
//                               entries) overflowed as well. 8 datagrams (about 2 KiB of buffer
//                               each) from each of up to 13 peers fit the default buffer; the
//                               backend refuses the provider where the job's peers would not
//                               (docs/backend-contract.md).
#pragma once

namespace mk {

void apply_env_defaults();

// The udp;ofi_rxd window in effect for this process (the variable as libfabric will read it).
int rxd_max_unacked();

}  // namespace mk
