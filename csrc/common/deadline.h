// Deadlines: every blocking call of the core takes one (an absolute point on
// the steady clock) and returns kTimeout when it passes.
#pragma once

#include <chrono>

namespace peerstate {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after_ms(long ms) { return Clock::now() + std::chrono::milliseconds(ms); }

}  // namespace peerstate
