#include "pending_replays.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace pgd::core {

PendingReplays::PendingReplays(double timeout_s) : timeout_s_(timeout_s) {
  if (!(timeout_s > 0.0)) {
    throw std::invalid_argument("PendingReplays: timeout_s must be > 0");
  }
}

void PendingReplays::launch_started(std::string label, std::string collectives, double now) {
  PendingReplay p;
  p.label = std::move(label);
  p.collectives = std::move(collectives);
  p.armed_at = now;
  launch_ = std::move(p);
}

void PendingReplays::launch_finished(double /*now*/) { launch_.reset(); }

uint64_t PendingReplays::arm(std::string label, std::string collectives, double now) {
  PendingReplay p;
  p.seq = ++armed_;
  p.label = std::move(label);
  p.collectives = std::move(collectives);
  p.armed_at = now;
  pending_.push_back(std::move(p));
  return armed_;
}

std::optional<PendingReplay> PendingReplays::oldest() const {
  if (pending_.empty()) {
    return std::nullopt;
  }
  return pending_.front();
}

void PendingReplays::complete_oldest(uint64_t seq, double now) {
  if (pending_.empty() || pending_.front().seq != seq) {
    return;
  }
  longest_wait_s_ = std::max(longest_wait_s_, now - progress_after(pending_.front().armed_at));
  pending_.pop_front();
  ++completed_;
  last_progress_ = now;
  any_progress_ = true;
}

ReplayVerdict PendingReplays::check(double now) const { return check(now, timeout_s_); }

ReplayVerdict PendingReplays::check(double now, double after_s) const {
  ReplayVerdict v;
  v.pending = pending_.size();
  v.armed = armed_;
  v.completed = completed_;
  if (!pending_.empty()) {
    const PendingReplay& head = pending_.front();
    const double since = progress_after(head.armed_at);
    if (now - since > after_s) {
      v.kind = WaitKind::kReplay;
      v.waited_s = now - since;
      v.replay = head;
      return v;
    }
  }
  if (launch_ && now - launch_->armed_at > after_s) {
    v.kind = WaitKind::kLaunch;
    v.waited_s = now - launch_->armed_at;
    v.replay = *launch_;
  }
  return v;
}

ReplayVerdict PendingReplays::check_interrupted(double now, double interrupted_at, double grace_s) const {
  ReplayVerdict v;
  v.pending = pending_.size();
  v.armed = armed_;
  v.completed = completed_;
  if (pending_.empty() || interrupted_at <= 0.0) {
    return v;
  }
  // Launched before the interrupt, and no completion seen for after_s since
  // the later of the interrupt and the last completion. Not "no completion
  // since the interrupt": the poller sees a completion up to one poll period
  // late, so the step before the stuck one often reads as completed after it.
  const PendingReplay& head = pending_.front();
  const double after_s = std::max(grace_s, 3.0 * longest_wait_s_);
  if (head.armed_at <= interrupted_at && now - progress_after(interrupted_at) > after_s) {
    v.kind = WaitKind::kReplay;
    v.waited_s = now - progress_after(head.armed_at);
    v.replay = head;
  }
  return v;
}

void PendingReplays::clear(double now) {
  pending_.clear();
  launch_.reset();
  last_progress_ = now;
  any_progress_ = true;
}

// ---- heartbeats ---------------------------------------------------------

// Wall time travels as integer milliseconds: "%f" and strtod follow
// LC_NUMERIC, and a process that switched it to a comma-decimal locale would
// write or read heartbeats no other rank understands.
std::string encode_heartbeat(const Heartbeat& hb) {
  char buf[96];
  const uint64_t ms = std::isfinite(hb.wall_s) && hb.wall_s > 0.0
                          ? static_cast<uint64_t>(std::llround(hb.wall_s * 1000.0))
                          : 0;
  std::snprintf(buf, sizeof(buf), "%" PRIu64 " %" PRIu64 " %" PRIu64 "%s", ms,
                hb.armed, hb.completed, hb.closed ? " closed" : "");
  return buf;
}

namespace {

// Parsing and formatting here avoid iostreams, as capture_fingerprint.cpp
// explains: in the GPU machine's process (torch 2.11+cu130, g++ 13) the
// istream number extraction compiled into this library called through the
// wrong locale facet and crashed (SIGSEGV in decode_heartbeat).
const char* skip_spaces(const char* s) {
  while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') {
    ++s;
  }
  return s;
}

bool parse_u64(const char*& s, uint64_t& v) {
  s = skip_spaces(s);
  if (*s < '0' || *s > '9') {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(s, &end, 10);
  if (errno != 0 || end == s) {
    return false;
  }
  v = static_cast<uint64_t>(x);
  s = end;
  return true;
}

}  // namespace

std::optional<Heartbeat> decode_heartbeat(const std::string& text) {
  Heartbeat hb;
  const char* s = text.c_str();
  uint64_t wall_ms = 0;
  if (!parse_u64(s, wall_ms) || !parse_u64(s, hb.armed) || !parse_u64(s, hb.completed)) {
    return std::nullopt;
  }
  hb.wall_s = static_cast<double>(wall_ms) / 1000.0;
  s = skip_spaces(s);
  if (*s != '\0') {
    if (std::strncmp(s, "closed", 6) != 0 || *skip_spaces(s + 6) != '\0') {
      return std::nullopt;
    }
    hb.closed = true;
  }
  return hb;
}

RankLiveness::RankLiveness(int world_size, int self_rank, double stale_after_s)
    : world_size_(world_size), self_(self_rank), stale_after_s_(stale_after_s),
      seen_(static_cast<size_t>(std::max(world_size, 0))) {
  if (world_size <= 0 || self_rank < 0 || self_rank >= world_size) {
    throw std::invalid_argument("RankLiveness: need 0 <= self_rank < world_size");
  }
}

void RankLiveness::observe(int rank, const std::optional<Heartbeat>& hb, double /*read_at*/) {
  if (rank < 0 || rank >= world_size_) {
    return;
  }
  any_read_ = true;
  if (hb) {
    Seen& s = seen_[static_cast<size_t>(rank)];
    // A late read must not replace a newer heartbeat with an older one.
    if (!s.last || hb->wall_s >= s.last->wall_s) {
      s.last = hb;
    }
    s.closed_reads = s.last->closed ? s.closed_reads + 1 : 0;
  }
}

std::vector<int> RankLiveness::departed() const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r) {
    if (r != self_ && seen_[static_cast<size_t>(r)].closed_reads >= kDepartedReads) {
      out.push_back(r);
    }
  }
  return out;
}

void RankLiveness::store_unreachable(const std::string& why, double wall_now) {
  if (store_error_.empty()) {
    store_error_since_ = wall_now;
  }
  store_error_ = why;
}

void RankLiveness::store_reachable() { store_error_.clear(); }

std::vector<int> RankLiveness::stale(double wall_now) const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r) {
    if (r == self_) {
      continue;
    }
    const Seen& s = seen_[static_cast<size_t>(r)];
    if (!s.last || s.last->closed || wall_now - s.last->wall_s > stale_after_s_) {
      out.push_back(r);
    }
  }
  return out;
}

std::string RankLiveness::describe(double wall_now, size_t max_ranks) const {
  std::string out;
  char buf[256];
  if (!store_error_.empty()) {
    std::snprintf(buf, sizeof(buf), "the store has not answered for %.1f s (", wall_now - store_error_since_);
    out += buf + store_error_ + "); heartbeats as last read:\n";
  }
  if (!any_read_) {
    out += "no heartbeat has been read from the store yet\n";
    return out;
  }
  const std::vector<int> stale_ranks = stale(wall_now);
  std::vector<int> order = stale_ranks;
  for (int r = 0; r < world_size_; ++r) {
    if (r != self_ && std::find(stale_ranks.begin(), stale_ranks.end(), r) == stale_ranks.end()) {
      order.push_back(r);
    }
  }
  size_t shown = 0;
  for (int r : order) {
    if (shown == max_ranks) {
      break;
    }
    const Seen& s = seen_[static_cast<size_t>(r)];
    const bool is_stale = std::find(stale_ranks.begin(), stale_ranks.end(), r) != stale_ranks.end();
    if (!s.last) {
      std::snprintf(buf, sizeof(buf), "rank %d: no heartbeat seen (NOT ALIVE or never started its watchdog)", r);
    } else if (s.last->closed) {
      std::snprintf(buf, sizeof(buf),
                    "rank %d: closed its watchdog %.1f s ago (it left training: teardown, shutdown or "
                    "exit) after arming %" PRIu64 " replays, %" PRIu64 " completed",
                    r, wall_now - s.last->wall_s, s.last->armed, s.last->completed);
    } else {
      std::snprintf(buf, sizeof(buf),
                    "rank %d: last heartbeat %.1f s ago (%s), had armed %" PRIu64 " replays, %" PRIu64 " completed",
                    r, wall_now - s.last->wall_s, is_stale ? "NOT ALIVE" : "alive", s.last->armed,
                    s.last->completed);
    }
    out += buf;
    out += "\n";
    ++shown;
  }
  if (order.size() > shown) {
    out += "... and " + std::to_string(order.size() - shown) + " more ranks, alive\n";
  }
  if (stale_ranks.empty()) {
    out += "every rank's watchdog is alive: a rank is running but not replaying "
           "(it may have left the training loop, or be stuck outside the graph)\n";
  }
  return out;
}

// ---- the report ---------------------------------------------------------

namespace {

void lines(std::string& out, const std::string& prefix, const std::string& text) {
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string::npos) {
      nl = text.size();
    }
    out += prefix;
    out.append(text, start, nl - start);
    out += "\n";
    start = nl + 1;
  }
}

}  // namespace

std::string describe_timeout(const ReplayVerdict& v,
                             double timeout_s,
                             const std::string& context,
                             const std::string& liveness,
                             int exit_code,
                             const std::vector<int>& departed) {
  const std::string p = "[pygraph_dist watchdog] ";
  std::string out;
  char buf[512];
  const std::string what = v.replay.label.empty() ? std::string("(unlabelled)") : v.replay.label;
  if (!departed.empty()) {
    std::string ranks;
    for (int r : departed) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    }
    std::snprintf(buf, sizeof(buf),
                  "%s: graph replay #%" PRIu64 " %s has waited %.1f s, and rank(s) %s left training "
                  "(closed their watchdog): the collectives it waits for will never come, so this rank "
                  "does not wait out the replay timeout (%.0f s).",
                  context.c_str(), v.replay.seq, what.c_str(), v.waited_s, ranks.c_str(), timeout_s);
  } else if (v.kind == WaitKind::kLaunch) {
    std::snprintf(buf, sizeof(buf),
                  "%s: launching graph replay %s has not returned after %.1f s (replay timeout %.0f s): "
                  "the GPU has stopped draining its launch queue.",
                  context.c_str(), what.c_str(), v.waited_s, timeout_s);
  } else {
    std::snprintf(buf, sizeof(buf),
                  "%s: graph replay #%" PRIu64 " %s has not completed; the GPU made no progress for "
                  "%.1f s (replay timeout %.0f s).",
                  context.c_str(), v.replay.seq, what.c_str(), v.waited_s, timeout_s);
  }
  out += p + buf + "\n";
  std::snprintf(buf, sizeof(buf), "replays armed %" PRIu64 ", completed %" PRIu64 ", pending %zu.",
                v.armed, v.completed, v.pending);
  out += p + "  " + buf + "\n";
  if (!v.replay.collectives.empty()) {
    out += p + "  collectives in the graph: " + v.replay.collectives + "\n";
  }
  if (!liveness.empty()) {
    out += p + "  other ranks, by their watchdog heartbeats in the store:\n";
    lines(out, p + "    ", liveness);
  }
  std::snprintf(buf, sizeof(buf),
                "  Collectives inside CUDA graphs are not covered by NCCL's own timeout; a rank has "
                "probably crashed, stopped or left the training loop. Ending this process with exit "
                "code %d so that the launcher stops the job instead of hanging.",
                exit_code);
  out += p + buf + "\n";
  return out;
}

}  // namespace pgd::core
