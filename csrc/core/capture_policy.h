// The fallback decision state machine: for one graph key (one input signature
// of one wrapped model), what the next iteration does.
//
//   Probe ──> Warmup ──> Capture ──ok──> Replay ──invalidate──> Warmup
//     │          ^          │                │
//     │          └─retry────┤ failed         └─reject──> Eager
//     │                     └─give up──────────────────> Eager
//     └─ loop does not conform ────────────────────────> Eager
//
// Probe iterations run the user's loop exactly as written (forward in the
// model call, backward and step where the user calls them) while the engine
// checks that the loop is one a graph can represent. Warmup iterations run the
// whole iteration eagerly inside the model call on the capture stream; the
// Capture iteration records it; Replay iterations launch the graph. Eager is
// terminal and carries the reason.
//
// Every input to this machine that changes which collectives run (capture
// result, conformance, selection) must already be agreed by all ranks: the
// machine itself is local and deterministic, so identical inputs on every rank
// keep every rank in the same phase.
#pragma once

#include <cstdint>
#include <string>

namespace pgd::core {

enum class Phase : uint8_t { kProbe, kWarmup, kCapture, kReplay, kEager };

const char* phase_name(Phase phase);

struct PolicyConfig {
  int probe_iters = 1;          // iterations run in the user's own semantics
  int warmup_iters = 3;         // eager iterations on the capture stream
  int max_capture_attempts = 2; // captures tried before giving up
  int max_recaptures = 8;       // invalidations tolerated before giving up
};

class CapturePolicy {
 public:
  explicit CapturePolicy(const PolicyConfig& config);

  // Called once at the start of every iteration of this key; returns what the
  // iteration must do and advances the probe/warmup counters.
  Phase begin_iteration();

  Phase phase() const { return phase_; }
  const std::string& reason() const { return reason_; }
  int capture_attempts() const { return capture_attempts_; }
  int recaptures() const { return recaptures_; }
  int64_t iterations() const { return iterations_; }
  int64_t replays() const { return replays_; }
  int64_t eager_iterations() const { return iterations_ - replays_; }

  // All ranks captured the same collectives: replay from the next iteration.
  void capture_succeeded();
  // Capture failed on some rank. A retryable failure goes back to warmup
  // until max_capture_attempts is reached; otherwise the key runs eagerly.
  void capture_failed(const std::string& reason, bool retryable);
  // The probe found something a replay would lose or repeat.
  void conformance_failed(const std::string& reason);
  // Something baked into the graph changed (e.g. an optimizer hyperparameter):
  // capture again after a fresh warmup, unless that happened too often.
  void invalidate(const std::string& reason);
  // Selective deployment decided the graph does not pay for itself.
  void reject(const std::string& reason);
  // Graphs cannot be used at all (no CUDA, disabled by the user, ...).
  void disable(const std::string& reason);
  // Leave at most `max_left` warm-up iterations (0: capture next). Once one
  // input signature has been captured, the lazy initialisation that warm-up
  // exists for is done, and a rarely seen signature (the short last batch of
  // an epoch) should not wait for the full warm-up. No-op outside warm-up.
  void cap_warmup(int max_left);

 private:
  void to_eager(const std::string& reason);
  void to_warmup();

  PolicyConfig config_;
  Phase phase_;
  std::string reason_;
  int probe_left_;
  int warmup_left_;
  int capture_attempts_ = 0;
  int recaptures_ = 0;
  int64_t iterations_ = 0;
  int64_t replays_ = 0;
};

}  // namespace pgd::core
