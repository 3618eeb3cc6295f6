// Names for the core's threads, as `top -H`, `ps -L`, /proc/PID/task/TID/comm and
// debuggers show them: an operator sees which of a worker's threads burns its CPU,
// and bench/step_breakdown.py sums the step's CPU by them. Every name starts with
// "ps-" (at most 15 bytes are kept). A failure is ignored: the name is a convenience.
#pragma once

#include <pthread.h>

namespace peerstate {

inline void name_this_thread(const char* name) { (void)pthread_setname_np(pthread_self(), name); }

}  // namespace peerstate
