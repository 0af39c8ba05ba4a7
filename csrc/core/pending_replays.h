// What a replay watchdog waits for, and when it has waited too long.
//
// Collectives captured into a CUDA graph have no timeout of their own:
// ProcessGroupNCCL does not hand them to its watchdog ("Note [cuda graph
// capture and workEnqueue]" in ProcessGroupNCCL.cpp). The native watchdog
// (csrc/replay_watchdog.h) records a CUDA event after replays, a poller thread
// reports the events that completed, and a judge thread asks check(). This
// file is that bookkeeping without threads, CUDA or clocks: every time is a
// number of seconds on one monotonic clock, passed in, so the rules are
// unit-tested (tests/cpp/test_pending_replays.cpp).
//
// The rules:
//   * The GPU must make progress. The oldest pending replay times out when
//     `timeout_s` has passed since the later of its arming and the last
//     completion seen. Counting from the last completion, not from arming,
//     keeps a deep launch queue (the host far ahead of a slow but working
//     GPU) from reading as a hang.
//   * A launch (cudaGraphLaunch, or recording the event) that has not
//     returned within `timeout_s` times out too: launches block once the
//     device's launch queue is full, i.e. when the GPU has stopped consuming
//     it, and a blocked host arms nothing new.
//   * Events complete in stream order, so the poller only ever asks about the
//     oldest pending replay (complete_oldest).
//   * A rank that left training (its heartbeat says "closed",
//     RankLiveness::departed) will never launch the collectives a pending
//     replay waits for: once that replay has waited a grace period (the
//     watchdog's departure_grace_s), the watchdog fires without waiting out
//     the timeout -- a peer that exited on Ctrl-C or an error one step
//     before this rank left it waiting for the whole process group timeout.
//   * A process interrupted (SIGINT, or SIGTERM the script handles) while a
//     replay waits that has not progressed since: Ctrl-C reaches the ranks a
//     step apart, so the rank still inside a replay waits for collectives the
//     interrupted peer will never launch, inside a CUDA call Python cannot
//     interrupt. check_interrupted says when it has waited long enough to
//     give up: the interrupt grace, and three times the longest wait a replay
//     of this process has needed so far (a slow step is not given up on).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

namespace pgd::core {

struct PendingReplay {
  uint64_t seq = 0;         // 1, 2, ... in arming order (0: a launch, not yet armed)
  std::string label;        // what was replayed, as the engine names it (signature, iteration)
  std::string collectives;  // the graph's collectives, as captured
  double armed_at = 0.0;    // when the event was recorded (or the launch began)
};

enum class WaitKind : uint8_t {
  kNone,         // nothing has waited too long
  kReplay,       // a replay's event has not completed
  kLaunch,       // a launch call has not returned
};

struct ReplayVerdict {
  WaitKind kind = WaitKind::kNone;
  double waited_s = 0.0;    // since the GPU's last progress (kReplay) or the launch began (kLaunch)
  PendingReplay replay;     // what was waited for
  size_t pending = 0;       // replays armed and not yet seen complete
  uint64_t armed = 0;       // replays armed so far
  uint64_t completed = 0;   // replays seen complete so far
  bool timed_out() const { return kind != WaitKind::kNone; }
};

class PendingReplays {
 public:
  // `timeout_s` > 0.
  explicit PendingReplays(double timeout_s);

  double timeout_s() const { return timeout_s_; }

  // The host is about to launch / has launched a replay. At most one launch
  // is in flight (launches come from the one thread that replays).
  void launch_started(std::string label, std::string collectives, double now);
  void launch_finished(double now);

  // An event was recorded after a replay; returns its sequence number.
  uint64_t arm(std::string label, std::string collectives, double now);

  // The oldest pending replay (the one the poller should query), if any.
  std::optional<PendingReplay> oldest() const;
  // The poller saw the oldest pending replay's event complete. `seq` guards
  // against a clear() between the query and this call: a stale seq is ignored.
  void complete_oldest(uint64_t seq, double now);

  // Whether something has waited longer than the timeout, and what.
  ReplayVerdict check(double now) const;
  // The same against another bound (the departure grace, a third of the timeout).
  ReplayVerdict check(double now, double after_s) const;
  // After an interrupt at `interrupted_at`: timed out when the oldest pending
  // replay was armed before it and no replay has completed for
  // max(grace_s, 3 x longest_wait_s()) since the later of the interrupt and
  // the last completion seen. A replay armed after the interrupt (the script
  // handled it and trains on) never counts.
  ReplayVerdict check_interrupted(double now, double interrupted_at, double grace_s) const;
  // The longest a replay has waited for its completion (from the later of its
  // arming and the previous completion), over the replays completed so far.
  double longest_wait_s() const { return longest_wait_s_; }

  // Forget everything pending (the engine released its graphs, or closed).
  void clear(double now);

  size_t pending() const { return pending_.size(); }
  uint64_t armed() const { return armed_; }
  uint64_t completed() const { return completed_; }
  bool launching() const { return launch_.has_value(); }

 private:
  // The later of t and the last completion seen: when a wait that began at t
  // last saw the GPU make progress.
  double progress_after(double t) const { return any_progress_ ? std::max(t, last_progress_) : t; }

  double timeout_s_;
  std::deque<PendingReplay> pending_;
  std::optional<PendingReplay> launch_;
  double last_progress_ = 0.0;  // last completion seen (or clear); deadlines count from here
  bool any_progress_ = false;
  double longest_wait_s_ = 0.0;
  uint64_t armed_ = 0;
  uint64_t completed_ = 0;
};

// ---- heartbeats ---------------------------------------------------------
// Each rank's watchdog writes "<wall ms> <armed> <completed>[ closed]" under
// its key every few seconds, and once more with "closed" when it is closed
// (the engine tore down: the rank left training on purpose); on a timeout the survivor says which ranks were last
// seen alive and how far each got. Wall-clock time (not monotonic) because
// ranks on different hosts compare it; skew of a second does not matter
// against staleness thresholds of several heartbeat periods.
struct Heartbeat {
  double wall_s = 0.0;
  uint64_t armed = 0;
  uint64_t completed = 0;
  bool closed = false;  // the rank closed its watchdog: it is not replaying any more
};

std::string encode_heartbeat(const Heartbeat& hb);
std::optional<Heartbeat> decode_heartbeat(const std::string& text);

class RankLiveness {
 public:
  // `stale_after_s`: a heartbeat older than this marks its rank as not alive.
  RankLiveness(int world_size, int self_rank, double stale_after_s);

  // What a read of the store found for `rank` at wall time `read_at`: a
  // heartbeat, or nothing (key absent or unparsable).
  void observe(int rank, const std::optional<Heartbeat>& hb, double read_at);
  // A read of the store failed or did not answer; `why` says how.
  void store_unreachable(const std::string& why, double wall_now);
  void store_reachable();

  // Ranks (other than self) not replaying: last heartbeat older than
  // stale_after_s, never seen, or closed.
  std::vector<int> stale(double wall_now) const;
  // One line per other rank (at most `max_ranks`, stale ones first), e.g.
  // "rank 1: last heartbeat 14.2 s ago (NOT ALIVE), had armed 199 replays, 199 completed".
  std::string describe(double wall_now, size_t max_ranks = 16) const;
  bool any_read() const { return any_read_; }
  // Ranks that left: their heartbeat said "closed" on the last
  // kDepartedReads reads in a row. One read is not enough: engines of one
  // rank share its key, and a model torn down while another trains on
  // writes "closed" until the other's next heartbeat overwrites it.
  static constexpr int kDepartedReads = 3;
  std::vector<int> departed() const;

 private:
  struct Seen {
    std::optional<Heartbeat> last;
    int closed_reads = 0;  // consecutive reads that found it closed
  };
  int world_size_;
  int self_;
  double stale_after_s_;
  std::vector<Seen> seen_;
  bool any_read_ = false;
  std::string store_error_;
  double store_error_since_ = 0.0;
};

// The report printed when the watchdog fires: what it waited for, for how
// long, the graph's collectives, the other ranks' liveness (if known), and
// what happens next. `context` names the process ("rank 0 of 2").
// `departed` (RankLiveness::departed()): the ranks that left while the replay
// waited, when that, not the timeout, is why the watchdog fires.
std::string describe_timeout(const ReplayVerdict& verdict,
                             double timeout_s,
                             const std::string& context,
                             const std::string& liveness,
                             int exit_code,
                             const std::vector<int>& departed = {});

}  // namespace pgd::core
