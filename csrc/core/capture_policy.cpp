#include "capture_policy.h"

#include <stdexcept>

namespace pgd::core {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kProbe: return "probe";
    case Phase::kWarmup: return "warmup";
    case Phase::kCapture: return "capture";
    case Phase::kReplay: return "replay";
    case Phase::kEager: return "eager";
  }
  return "unknown";
}

CapturePolicy::CapturePolicy(const PolicyConfig& config)
    : config_(config),
      phase_(Phase::kProbe),
      probe_left_(config.probe_iters),
      warmup_left_(config.warmup_iters) {
  if (config.probe_iters < 0 || config.warmup_iters < 0) {
    throw std::invalid_argument("probe_iters and warmup_iters must be >= 0");
  }
  if (config.max_capture_attempts < 1) {
    throw std::invalid_argument("max_capture_attempts must be >= 1");
  }
  if (config.max_recaptures < 0) {
    throw std::invalid_argument("max_recaptures must be >= 0");
  }
  if (probe_left_ == 0) {
    phase_ = warmup_left_ == 0 ? Phase::kCapture : Phase::kWarmup;
  }
}

Phase CapturePolicy::begin_iteration() {
  ++iterations_;
  switch (phase_) {
    case Phase::kProbe: {
      // This iteration is a probe; the next one moves on if probes are done.
      if (--probe_left_ <= 0) {
        phase_ = warmup_left_ > 0 ? Phase::kWarmup : Phase::kCapture;
      }
      return Phase::kProbe;
    }
    case Phase::kWarmup: {
      if (--warmup_left_ <= 0) {
        phase_ = Phase::kCapture;
      }
      return Phase::kWarmup;
    }
    case Phase::kCapture:
      // Stays in kCapture until capture_succeeded / capture_failed.
      return Phase::kCapture;
    case Phase::kReplay:
      ++replays_;
      return Phase::kReplay;
    case Phase::kEager:
      return Phase::kEager;
  }
  return phase_;
}

void CapturePolicy::capture_succeeded() {
  if (phase_ != Phase::kCapture) {
    throw std::logic_error(
        std::string("capture_succeeded in phase ") + phase_name(phase_));
  }
  phase_ = Phase::kReplay;
  reason_.clear();
}

void CapturePolicy::capture_failed(const std::string& reason, bool retryable) {
  if (phase_ != Phase::kCapture) {
    throw std::logic_error(
        std::string("capture_failed in phase ") + phase_name(phase_));
  }
  ++capture_attempts_;
  if (retryable && capture_attempts_ < config_.max_capture_attempts) {
    reason_ = reason;
    to_warmup();
  } else {
    to_eager(
        capture_attempts_ > 1 ? reason + " (after " +
                std::to_string(capture_attempts_) + " capture attempts)"
                              : reason);
  }
}

void CapturePolicy::conformance_failed(const std::string& reason) {
  to_eager(reason);
}

void CapturePolicy::invalidate(const std::string& reason) {
  if (phase_ == Phase::kEager) {
    return;
  }
  if (phase_ != Phase::kReplay) {
    // Nothing captured yet: the next capture sees the new state anyway.
    return;
  }
  ++recaptures_;
  if (recaptures_ > config_.max_recaptures) {
    to_eager(
        reason + "; the graph was invalidated " + std::to_string(recaptures_) +
        " times, more than max_recaptures=" +
        std::to_string(config_.max_recaptures));
    return;
  }
  reason_ = reason;
  capture_attempts_ = 0;
  to_warmup();
}

void CapturePolicy::reject(const std::string& reason) {
  to_eager(reason);
}

void CapturePolicy::disable(const std::string& reason) {
  to_eager(reason);
}

void CapturePolicy::cap_warmup(int max_left) {
  if (phase_ != Phase::kWarmup || max_left < 0 || warmup_left_ <= max_left) {
    return;
  }
  warmup_left_ = max_left;
  if (warmup_left_ == 0) {
    phase_ = Phase::kCapture;
  }
}

void CapturePolicy::to_eager(const std::string& reason) {
  phase_ = Phase::kEager;
  reason_ = reason;
}

void CapturePolicy::to_warmup() {
  warmup_left_ = config_.warmup_iters;
  phase_ = warmup_left_ > 0 ? Phase::kWarmup : Phase::kCapture;
}

}  // namespace pgd::core
