// mkernel — the roles of the ring attention backward's persistent grid (host and device code:
// the kernel, the CPU tests).
//
// The backward needs both roles running at once: its communication CTAs' dK/dV sums wait for
// this rank's compute CTAs, and its compute CTAs wait for K/V that the communication CTAs bring.
// Ranks that share a GPU under MPS do not always get their whole grid resident: on an H100 with
// six ranks, at most 104-110 of their 120 CTAs ran at once, and the CTAs a rank was left without
// were its last ones by index (bench/results/h100-2026-12-07-roles). With the communication CTAs
// first and the compute CTAs last, such a rank could have no compute CTA at all and its waits
// gave up. So the roles are interleaved by index: communication CTA j of C is CTA
// floor(j * G / C) of the grid's G, the others compute, and every first part of the grid holds
// both roles in proportion (a first part of L CTAs holds at least floor(L * C / G) communication
// and floor(L * (G - C) / G) compute CTAs).
#pragma once

#if defined(__CUDACC__)
#define MK_ROLE_HD __host__ __device__ __forceinline__
#else
#define MK_ROLE_HD inline
#endif

namespace mk {
namespace attention {

struct RingRole {
  bool comm;         // a communication CTA
  int compute_slot;  // a compute CTA's index among the compute CTAs (0 .. G - C - 1)
};

// CTA `cta` of a grid of `grid` CTAs, `comm` of them communicating (0 <= comm <= grid).
MK_ROLE_HD RingRole ring_role(int cta, int comm, int grid) {
  // Communication CTAs before this one: the j with floor(j * grid / comm) < cta, i.e.
  // ceil(cta * comm / grid); this one communicates iff the next such j lands on it.
  const int before = (cta * comm + grid - 1) / grid;
  return RingRole{before * grid < (cta + 1) * comm, cta - before};
}

}  // namespace attention
}  // namespace mk
