// ReplayWatchdog: a timeout for collectives inside CUDA graphs that works
// when Python cannot run.
//
// ProcessGroupNCCL does not watch captured collectives ("Note [cuda graph
// capture and workEnqueue]" in ProcessGroupNCCL.cpp): when a peer dies or
// stops replaying, this rank's replayed all-reduce waits forever. A watchdog
// written in Python cannot be relied on to notice: torch's Event.record() and
// Event.query() call the CUDA runtime while holding the GIL
// (torch/csrc/cuda/Event.cpp has no gil_scoped_release around either), and
// once the GPU stops, the launch queue fills and a stream call blocks. A
// record() that blocks in the main thread holds the GIL for good, and the
// watchdog thread never runs again.
//
// So everything here runs on native threads that never take the GIL:
//   * the poller asks cudaEventQuery about the oldest pending replay;
//   * the judge decides from host timestamps only (core::PendingReplays), so
//     it fires even if the poller itself blocks inside the driver;
//   * the heartbeat thread (optional) writes this rank's liveness to the
//     c10d store and, once a replay is overdue, reads the other ranks'.
// On a timeout the judge prints what it waited for, which ranks were last seen
// alive, every Python thread's stack (_Py_DumpTracebackThreads, the function
// faulthandler's own timer thread uses, also without the GIL), optionally
// aborts the communicator, and ends the process with _exit(exit_code):
// running atexit handlers or destructors while the main thread is stuck in a
// CUDA call could hang or crash instead of exiting.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace pgd {

// The exit code of a process ended by the watchdog: EX_SOFTWARE (sysexits.h).
inline constexpr int kWatchdogExitCode = 70;

struct ReplayWatchdogOptions {
  double timeout_s = 0.0;           // > 0
  int exit_code = kWatchdogExitCode;
  double poll_s = 0.0;              // 0: min(1, max(0.05, timeout_s / 20))
  std::string context;              // first words of the report, e.g. "rank 0 of 2"
  // Heartbeats through the store (optional: no store, no heartbeats).
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int world_size = 1;
  double heartbeat_s = 0.0;         // 0: min(5, max(0.5, timeout_s / 4))
  std::string heartbeat_prefix = "pgd/alive/";
  bool dump_python = true;          // dump Python stacks before exiting
  // Optional: abort this backend (the communicator) before exiting, waiting
  // at most abort_wait_s for it. Off by default: process exit already releases
  // the GPU, and ncclCommAbort can itself block (the reason for
  // TORCH_NCCL_ASYNC_ERROR_HANDLING=3, "skip cleanup").
  c10::intrusive_ptr<c10d::Backend> abort_backend;
  double abort_wait_s = 0.0;
  // Optional: when the process was interrupted (watch_interrupts) while a
  // replay waits that makes no progress (core::PendingReplays::
  // check_interrupted, with interrupt_grace_s), abort this group -- its
  // kernels return, the main thread's CUDA call returns, and Python raises
  // the KeyboardInterrupt -- instead of waiting out the timeout. The abort
  // counts as done when the stuck replay completes: ncclCommAbort sets the
  // flag its kernels poll, then waits until every graph that captured the
  // communicator is destroyed (commDestroySync: localPersistentRefs), which
  // the exit teardown does next -- on 2xH200 (NCCL 2.28.9) it never returned
  // while the graphs lived. If neither happens within 2 s (or abort_wait_s),
  // the process ends with _exit(interrupt_exit_code) (1: an uncaught error's,
  // as the exit teardown's own last resort ends it).
  c10::intrusive_ptr<c10d::ProcessGroup> interrupt_group;
  double interrupt_grace_s = 2.0;
  int interrupt_exit_code = 1;
};

// Interrupts, as Python's signal handler reports them: read_fd is the read end
// of the pipe whose write end is signal.set_wakeup_fd's (runtime/patches.py).
// A native thread (started once) reads the signal numbers; SIGINT and SIGTERM
// mark the process interrupted (interrupted_at(): monotonic seconds of the
// latest, 0 when none). Python cannot raise KeyboardInterrupt while its main
// thread waits in a CUDA call for a replayed collective: this is how the
// watchdog learns of it.
void watch_interrupts(int read_fd);
double interrupted_at();

// Runs fn (an abort: ncclCommAbort can block, e.g. while a CUDA graph that
// references the communicator waits for a peer that is gone) on a detached
// native thread and waits at most wait_s for it, without the GIL. True when it
// returned in time; otherwise the thread is left behind and the caller decides
// (the watchdog and the exit teardown both end the process). `enough`, when
// given, is asked every 20 ms: true ends the wait early, as a success (the
// abort freed what the caller waited for, though it has not returned).
bool call_within(std::function<void()> fn, double wait_s, const std::function<bool()>& enough = {});

// The last resort of an exiting process: a detached native thread that, unless
// cancel() came first, writes message and every Python thread's stack to
// stderr after seconds and ends the process with _exit(exit_code). Armed
// around the graphs' teardown at interpreter exit
// (python/pygraph_dist/launch/lifetime.py), where a CUDA or NCCL call that
// waits for a peer that is gone would otherwise hang the exit; cancelled when
// the teardown returns, so that the script's own exit handlers that run after
// it (an upload, a logger's flush) take the time they need.
class ExitDeadline {
 public:
  ExitDeadline(double seconds, std::string message, int exit_code);
  void cancel();

 private:
  std::shared_ptr<std::atomic<bool>> cancelled_;
};

class ReplayWatchdog {
 public:
  explicit ReplayWatchdog(ReplayWatchdogOptions options);
  ~ReplayWatchdog();  // close()
  ReplayWatchdog(const ReplayWatchdog&) = delete;
  ReplayWatchdog& operator=(const ReplayWatchdog&) = delete;

  // The host side of a replay: a launch that does not return within the
  // timeout fires too (the launch queue is full and the GPU is not draining it).
  void launch_started(const std::string& label, const std::string& collectives);
  void launch_finished();

  // Records a CUDA event on the current stream of the current device and
  // waits for it; returns its sequence number (0, and nothing armed, while
  // that stream is capturing). Only in builds with the CUDA code paths
  // (otherwise throws).
  uint64_t arm(const std::string& label, const std::string& collectives);
  // A pending replay without CUDA, completed by complete_host(): lets the
  // CPU tests exercise the threads, the report and the exit.
  uint64_t arm_host(const std::string& label, const std::string& collectives);
  void complete_host();

  // Forget what is pending (the engine synchronised and released its graphs).
  void clear();
  // Stop the threads: joins them, waiting at most a few seconds for one
  // blocked in the driver or the store (it is then detached: it holds only
  // shared state, never this object). Idempotent; the destructor calls it.
  void close();

  bool closed() const;
  uint64_t armed() const;
  uint64_t completed() const;
  size_t pending() const;
  // The watchdog aborted interrupt_group after an interrupt: the graphs'
  // communicator is gone, and this process must not replay again.
  bool interrupt_aborted() const;
  double timeout_s() const;
  double poll_s() const;
  double heartbeat_s() const;

  // Whether this Python exports the stack dumper (CPython 3.11-3.13 do).
  static bool python_stacks_available();

  struct State;  // shared with the threads

 private:
  std::shared_ptr<State> state_;
  std::vector<std::thread> threads_;
  bool closed_ = false;
};

}  // namespace pgd
