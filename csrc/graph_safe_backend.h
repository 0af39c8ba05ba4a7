// GraphSafeBackend: a c10d::Backend that owns the real one (NCCL on CUDA,
// Gloo on CPU) and makes collectives safe to capture into CUDA graphs.
//
// Modelled on c10d's ProcessGroupWrapper (torch/csrc/distributed/c10d/
// ProcessGroupWrapper.hpp): every collective is forwarded to the wrapped
// backend. What it adds:
//   * a fingerprint of the collectives issued while recording is on (the
//     engine turns it on for the capture iteration), so that all ranks can
//     check they captured the same sequence before the first replay;
//   * during stream capture, calls that cannot be captured (barrier, a wait
//     with a timeout, blocking-wait mode, is_completed) throw an error tagged
//     kNotCapturableTag that the engine turns into an eager fallback, instead
//     of invalidating the capture with an opaque CUDA error;
//   * Work returned during capture is wrapped so that later misuse of it
//     (waiting on it outside the capture) is refused with a clear message.
//   * Outside capture it adds nothing but a counter: the Work returned is the
//     wrapped backend's own.
//
// Overrides are the c10d::Backend virtuals present in every torch release we
// build against (2.11 to 2.14); the ones added later are forwarded under
// PGD_TORCH_AT_LEAST guards. `override` on each turns a vtable change into a
// compile error rather than a silently unforwarded call (pytorch#173538 is the
// same hazard for ProcessGroupWrapper).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "capture_fingerprint.h"

#ifndef PGD_TORCH_MAJOR
#error "PGD_TORCH_MAJOR/PGD_TORCH_MINOR must be defined by the build"
#endif
#define PGD_TORCH_AT_LEAST(major, minor) \
  (PGD_TORCH_MAJOR > (major) ||          \
   (PGD_TORCH_MAJOR == (major) && PGD_TORCH_MINOR >= (minor)))

namespace pgd {

// Every error this backend raises for a call that cannot be captured starts
// with this tag; the Python engine matches on it.
inline constexpr const char* kNotCapturableTag = "[pygraph_dist:not-capturable]";

// True when the current CUDA stream of this thread is capturing. Always false
// in builds without the CUDA code paths.
bool current_stream_is_capturing();

class GraphSafeBackend : public c10d::Backend {
 public:
  // `device_type` is "cuda" or "cpu": only a CUDA backend can be captured.
  GraphSafeBackend(c10::intrusive_ptr<c10d::Backend> inner, std::string device_type);

  const c10::intrusive_ptr<c10d::Backend>& inner() const { return inner_; }
  const std::string& device_type() const { return device_type_; }

  // Recording: the engine starts it before capture and takes the fingerprint
  // after. Collectives may come from autograd's device thread, hence the lock.
  void start_recording();
  core::CaptureFingerprint stop_recording();
  bool recording() const;
  // Collectives forwarded since construction, and those issued while the
  // current stream was capturing.
  uint64_t collectives_issued() const;
  uint64_t collectives_captured() const;

  // ---- c10d::Backend -----------------------------------------------------
  const std::string getBackendName() const override;
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsSplitting() const override;
  bool supportsCoalescing() const override;
  bool supportsTimeEstimation() const override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input,
      std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void registerOnCompletionHook(
      std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override;
  void waitForPendingWorks() override;
  void enableCollectivesTiming() override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;
  void setGroupUid(const std::string& pg_uid) override;
  void eagerConnectSingleDevice(at::Device device) override;
  c10d::ErrorType getError() override;
  std::shared_ptr<c10::Allocator> getMemAllocator() override;
  at::Tensor allocateTensor(long size, at::TensorOptions options) override;
  bool supportsTensorAlloc(c10::DeviceIndex device_index) override;
  void abort() override;
  void shutdown() override;
  bool supportsShrinking() const override;
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranks_to_exclude,
      int shrink_flags,
      const c10::intrusive_ptr<Options>& opts_override) override;
  c10::intrusive_ptr<c10d::Backend> merge(
      const c10::intrusive_ptr<c10d::Store>& store,
      const c10::intrusive_ptr<Options>& opts,
      const int& rank,
      const int& size) override;
#if PGD_TORCH_AT_LEAST(2, 13)
  void suspend() override;
  void resume() override;
  std::unordered_map<std::string, uint64_t> getMemoryStats() override;
#endif
#if PGD_TORCH_AT_LEAST(2, 14)
  std::optional<at::Device> getBoundDeviceId() const override;
  void setBoundDeviceId(std::optional<at::Device> device) override;
  void addEphemeralTimeout(const std::chrono::milliseconds& timeout) override;
  void registerAbortHook(int64_t hook_id, c10d::AbortHook hook) override;
  void unregisterAbortHook(int64_t hook_id) override;
#endif

 private:
  // Bookkeeping shared by every collective: refuse what cannot be captured,
  // record into the fingerprint, and wrap the Work of a captured call.
  bool enter(const core::CollectiveRecord& rec);
  c10::intrusive_ptr<c10d::Work> leave(
      c10::intrusive_ptr<c10d::Work> work, bool was_capturing, const char* op);
  // This backend serves CUDA tensors and this thread's current stream is
  // capturing: the one test behind every refusal and every captured record.
  bool capturing() const;
  // Children made by split/shrink/merge are wrapped too.
  c10::intrusive_ptr<c10d::Backend> wrap_child(c10::intrusive_ptr<c10d::Backend> child) const;

  c10::intrusive_ptr<c10d::Backend> inner_;
  const std::string device_type_;
  const bool blocking_wait_;  // TORCH_NCCL_BLOCKING_WAIT=1: waits poll the host

  mutable std::mutex mu_;
  bool recording_ = false;
  core::CaptureFingerprint fingerprint_;
  uint64_t issued_ = 0;
  uint64_t captured_ = 0;
};

}  // namespace pgd
