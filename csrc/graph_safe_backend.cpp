#include "graph_safe_backend.h"

#include <cstdlib>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "python_free.h"

#ifdef PGD_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace pgd {

using c10d::Work;
using core::CollectiveKind;
using core::CollectiveRecord;

bool current_stream_is_capturing() {
#ifdef PGD_WITH_CUDA
  if (c10::cuda::device_count() == 0) {
    return false;
  }
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
      c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

namespace {

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && (std::string(v) == "1" || std::string(v) == "true");
}

CollectiveRecord make_record(
    CollectiveKind kind,
    const std::vector<at::Tensor>& tensors,
    int reduce_op = -1,
    int64_t root = -1) {
  CollectiveRecord rec;
  rec.kind = kind;
  rec.reduce_op = reduce_op;
  rec.root = root;
  for (const auto& t : tensors) {
    rec.numel += t.numel();
  }
  if (!tensors.empty()) {
    rec.dtype = static_cast<int>(tensors.front().scalar_type());
    rec.dtype_name = c10::toString(tensors.front().scalar_type());
  }
  return rec;
}

CollectiveRecord make_record(
    CollectiveKind kind, const at::Tensor& t, int reduce_op = -1, int64_t root = -1) {
  return make_record(kind, std::vector<at::Tensor>{t}, reduce_op, root);
}

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& l : lists) {
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

int op_code(const c10d::ReduceOp& op) {
  return static_cast<int>(op.op_);
}

// Every refusal of a call that cannot be captured: a c10::Error whose message
// starts with kNotCapturableTag, which the engine turns into an eager fallback.
[[noreturn]] void refuse(const std::string& what) {
  TORCH_CHECK(false, kNotCapturableTag, " ", what);
}

// The Work of a collective issued while the stream was capturing. Its CUDA
// work exists only inside the graph, so host-side queries about it have no
// meaning; they are refused with an explanation instead of failing inside
// the CUDA runtime (or, worse, answering about the capture-time events).
class CapturedWork : public Work {
 public:
  CapturedWork(c10::intrusive_ptr<Work> inner, std::string op, bool blocking_wait)
      : inner_(std::move(inner)), op_(std::move(op)), blocking_wait_(blocking_wait) {}

  bool isCompleted() override {
    refuse("is_completed() on " + op_ +
           ", which was captured into a CUDA graph: it completes once per replay, "
           "so there is nothing to poll. Remove the poll from the training step.");
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }

  void synchronize() override {
    check_wait("synchronize()", ::kNoTimeout);
    inner_->synchronize();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    check_wait("wait()", timeout);
    return inner_->wait(timeout);
  }
  void blockCurrentStream() override {
    refuse("block_current_stream() on " + op_ +
           " during CUDA graph capture: it spins on a host-written flag that a "
           "replay cannot set.");
  }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return inner_->getFuture();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override {
    return inner_->getFutureResult();
  }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }
#if PGD_TORCH_AT_LEAST(2, 14)
  std::chrono::milliseconds getTimeout() const override { return inner_->getTimeout(); }
#endif

 private:
  void check_wait(const char* what, std::chrono::milliseconds timeout) const {
    if (!current_stream_is_capturing()) {
      refuse(std::string(what) + " outside the capture on " + op_ +
             ", which was captured into a CUDA graph: its result exists only "
             "after a replay. Wait on it inside the captured region.");
    }
    if (timeout != ::kNoTimeout) {
      refuse(std::string(what) + " with a timeout on " + op_ +
             " during CUDA graph capture: a timed wait polls events from the "
             "host, which a replay cannot repeat. Call wait() without a timeout.");
    }
    if (blocking_wait_) {
      refuse(std::string(what) + " on " + op_ +
             " during CUDA graph capture with TORCH_NCCL_BLOCKING_WAIT=1: "
             "blocking waits poll from the host. Unset TORCH_NCCL_BLOCKING_WAIT.");
    }
  }
  c10::intrusive_ptr<Work> inner_;
  std::string op_;
  bool blocking_wait_;
};

}  // namespace

GraphSafeBackend::GraphSafeBackend(
    c10::intrusive_ptr<c10d::Backend> inner, std::string device_type)
    : Backend(inner->getRank(), inner->getSize()),
      inner_(std::move(inner)),
      device_type_(std::move(device_type)),
      blocking_wait_(env_flag("TORCH_NCCL_BLOCKING_WAIT")) {
  TORCH_CHECK(
      device_type_ == "cuda" || device_type_ == "cpu",
      "GraphSafeBackend: device_type must be 'cuda' or 'cpu', got '", device_type_, "'");
}

void GraphSafeBackend::start_recording() {
  std::lock_guard<std::mutex> lock(mu_);
  fingerprint_.clear();
  recording_ = true;
}

core::CaptureFingerprint GraphSafeBackend::stop_recording() {
  std::lock_guard<std::mutex> lock(mu_);
  recording_ = false;
  core::CaptureFingerprint out = std::move(fingerprint_);
  fingerprint_.clear();
  return out;
}

bool GraphSafeBackend::recording() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recording_;
}

uint64_t GraphSafeBackend::collectives_issued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return issued_;
}

uint64_t GraphSafeBackend::collectives_captured() const {
  std::lock_guard<std::mutex> lock(mu_);
  return captured_;
}

bool GraphSafeBackend::enter(const CollectiveRecord& rec) {
  const bool is_capturing = capturing();
  std::lock_guard<std::mutex> lock(mu_);
  ++issued_;
  if (is_capturing) {
    ++captured_;
  }
  if (recording_) {
    fingerprint_.record(rec);
  }
  return is_capturing;
}

c10::intrusive_ptr<Work> GraphSafeBackend::leave(
    c10::intrusive_ptr<Work> work, bool was_capturing, const char* op) {
  if (!was_capturing || !work) {
    return work;
  }
  return c10::make_intrusive<CapturedWork>(std::move(work), op, blocking_wait_);
}

bool GraphSafeBackend::capturing() const {
  return device_type_ == "cuda" && current_stream_is_capturing();
}

const std::string GraphSafeBackend::getBackendName() const {
  return "pgd_" + inner_->getBackendName();
}

c10::intrusive_ptr<c10d::Backend::Options> GraphSafeBackend::getBackendOptions() {
  return inner_->getBackendOptions();
}

bool GraphSafeBackend::supportsSplitting() const { return inner_->supportsSplitting(); }
bool GraphSafeBackend::supportsCoalescing() const { return inner_->supportsCoalescing(); }
bool GraphSafeBackend::supportsTimeEstimation() const {
  return inner_->supportsTimeEstimation();
}
void GraphSafeBackend::setTimeout(std::chrono::milliseconds timeout) {
  inner_->setTimeout(timeout);
}
void GraphSafeBackend::startCoalescing() { inner_->startCoalescing(); }

c10::intrusive_ptr<Work> GraphSafeBackend::endCoalescing() {
  PythonTlsObjectsHidden hidden;
  return leave(inner_->endCoalescing(), capturing(), "a coalesced collective");
}

// Every collective below has the same shape: record, forward (without
// Python objects in the Work's captured thread-local state, and on CPU with
// its tensors as Python-free aliases: TENSORS lists them, e.g. (outputs)(inputs)),
// wrap.
#define PGD_FORWARD(OPNAME, RECORD, CALL, TENSORS)          \
  const bool was_capturing = enter(RECORD);                  \
  PythonTlsObjectsHidden hidden;                             \
  PythonFreeArgs python_free;                                \
  python_free TENSORS;                                       \
  return leave(inner_->CALL, was_capturing, OPNAME)

c10::intrusive_ptr<Work> GraphSafeBackend::broadcast(
    std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  PGD_FORWARD("broadcast",
      make_record(CollectiveKind::kBroadcast, tensors, -1, opts.rootRank),
      broadcast(tensors, opts), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::allreduce(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  PGD_FORWARD("all_reduce",
      make_record(CollectiveKind::kAllReduce, tensors, op_code(opts.reduceOp)),
      allreduce(tensors, opts), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  PGD_FORWARD("sparse all_reduce",
      make_record(CollectiveKind::kAllReduceSparse, tensors, op_code(opts.reduceOp)),
      allreduce_sparse(tensors, opts), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  PGD_FORWARD("all_reduce_coalesced",
      make_record(CollectiveKind::kAllReduceCoalesced, tensors, op_code(opts.reduceOp)),
      allreduce_coalesced(tensors, opts), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::reduce(
    std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  PGD_FORWARD("reduce",
      make_record(CollectiveKind::kReduce, tensors, op_code(opts.reduceOp), opts.rootRank),
      reduce(tensors, opts), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  PGD_FORWARD("all_gather", make_record(CollectiveKind::kAllGather, inputs),
      allgather(outputs, inputs, opts), (outputs)(inputs));
}

c10::intrusive_ptr<Work> GraphSafeBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  PGD_FORWARD("all_gather_into_tensor", make_record(CollectiveKind::kAllGatherBase, input),
      _allgather_base(output, input, opts), (output)(input));
}

c10::intrusive_ptr<Work> GraphSafeBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  PGD_FORWARD("all_gather_coalesced",
      make_record(CollectiveKind::kAllGatherCoalesced, inputs),
      allgather_coalesced(outputs, inputs, opts), (outputs)(inputs));
}

c10::intrusive_ptr<Work> GraphSafeBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  PGD_FORWARD("all_gather_into_tensor_coalesced",
      make_record(CollectiveKind::kAllGatherCoalesced, inputs),
      allgather_into_tensor_coalesced(outputs, inputs, opts), (outputs)(inputs));
}

c10::intrusive_ptr<Work> GraphSafeBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  PGD_FORWARD("gather", make_record(CollectiveKind::kGather, inputs, -1, opts.rootRank),
      gather(outputs, inputs, opts), (outputs)(inputs));
}

c10::intrusive_ptr<Work> GraphSafeBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  PGD_FORWARD("scatter",
      make_record(CollectiveKind::kScatter, outputs, -1, opts.rootRank),
      scatter(outputs, inputs, opts), (outputs)(inputs));
}

c10::intrusive_ptr<Work> GraphSafeBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  PGD_FORWARD("reduce_scatter",
      make_record(CollectiveKind::kReduceScatter, flatten(inputs), op_code(opts.reduceOp)),
      reduce_scatter(outputs, inputs, opts), (outputs)(inputs));
}

c10::intrusive_ptr<Work> GraphSafeBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  PGD_FORWARD("reduce_scatter_tensor",
      make_record(CollectiveKind::kReduceScatterBase, input, op_code(opts.reduceOp)),
      _reduce_scatter_base(output, input, opts), (output)(input));
}

c10::intrusive_ptr<Work> GraphSafeBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  PGD_FORWARD("reduce_scatter_tensor_coalesced",
      make_record(CollectiveKind::kReduceScatterCoalesced, inputs, op_code(opts.reduceOp)),
      reduce_scatter_tensor_coalesced(outputs, inputs, opts), (outputs)(inputs));
}

c10::intrusive_ptr<Work> GraphSafeBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  PGD_FORWARD("all_to_all_single", make_record(CollectiveKind::kAllToAllBase, input),
      alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
      (output)(input));
}

c10::intrusive_ptr<Work> GraphSafeBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  PGD_FORWARD("all_to_all", make_record(CollectiveKind::kAllToAll, inputs),
      alltoall(outputs, inputs, opts), (outputs)(inputs));
}

void GraphSafeBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  if (capturing()) {
    refuse("monitored_barrier() during CUDA graph capture: it synchronizes the "
           "host, which a replay cannot repeat. Move it outside the training step.");
  }
  inner_->monitoredBarrier(opts, wait_all_ranks);
}

void GraphSafeBackend::setSequenceNumberForGroup() { inner_->setSequenceNumberForGroup(); }
uint64_t GraphSafeBackend::getSequenceNumberForGroup() {
  return inner_->getSequenceNumberForGroup();
}

c10::intrusive_ptr<Work> GraphSafeBackend::send(
    std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  PGD_FORWARD("send", make_record(CollectiveKind::kSend, tensors, -1, dst_rank),
      send(tensors, dst_rank, tag), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::recv(
    std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  PGD_FORWARD("recv", make_record(CollectiveKind::kRecv, tensors, -1, src_rank),
      recv(tensors, src_rank, tag), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::recvAnysource(
    std::vector<at::Tensor>& tensors, int tag) {
  if (capturing()) {
    refuse("recv() from any source during CUDA graph capture: the sender is "
           "decided at run time, which a replay cannot repeat.");
  }
  PGD_FORWARD("recv", make_record(CollectiveKind::kRecv, tensors), recvAnysource(tensors, tag), (tensors));
}

c10::intrusive_ptr<Work> GraphSafeBackend::barrier(const c10d::BarrierOptions& opts) {
  if (capturing()) {
    refuse("barrier() during CUDA graph capture: a barrier synchronizes the host "
           "with every rank, which a replay cannot repeat. Move it outside the "
           "training step (before or after the loop).");
  }
  PGD_FORWARD("barrier", make_record(CollectiveKind::kBarrier, std::vector<at::Tensor>{}),
      barrier(opts), ());
}

#undef PGD_FORWARD

void GraphSafeBackend::registerOnCompletionHook(
    std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) {
  inner_->registerOnCompletionHook(std::move(hook));
}
void GraphSafeBackend::waitForPendingWorks() { inner_->waitForPendingWorks(); }
void GraphSafeBackend::enableCollectivesTiming() { inner_->enableCollectivesTiming(); }

c10::intrusive_ptr<c10d::Backend> GraphSafeBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  return wrap_child(inner_->split(store, ranks, opts));
}

c10::intrusive_ptr<c10d::Backend> GraphSafeBackend::wrap_child(
    c10::intrusive_ptr<c10d::Backend> child) const {
  if (!child) {
    return child;  // this rank is not part of the new group
  }
  return c10::make_intrusive<GraphSafeBackend>(std::move(child), device_type_);
}

bool GraphSafeBackend::supportsShrinking() const { return inner_->supportsShrinking(); }

c10::intrusive_ptr<c10d::Backend> GraphSafeBackend::shrink(
    const std::vector<int64_t>& ranks_to_exclude,
    int shrink_flags,
    const c10::intrusive_ptr<Options>& opts_override) {
  return wrap_child(inner_->shrink(ranks_to_exclude, shrink_flags, opts_override));
}

c10::intrusive_ptr<c10d::Backend> GraphSafeBackend::merge(
    const c10::intrusive_ptr<c10d::Store>& store,
    const c10::intrusive_ptr<Options>& opts,
    const int& rank,
    const int& size) {
  return wrap_child(inner_->merge(store, opts, rank, size));
}

#if PGD_TORCH_AT_LEAST(2, 13)
void GraphSafeBackend::suspend() { inner_->suspend(); }
void GraphSafeBackend::resume() { inner_->resume(); }
std::unordered_map<std::string, uint64_t> GraphSafeBackend::getMemoryStats() {
  return inner_->getMemoryStats();
}
#endif

#if PGD_TORCH_AT_LEAST(2, 14)
std::optional<at::Device> GraphSafeBackend::getBoundDeviceId() const {
  return inner_->getBoundDeviceId();
}
void GraphSafeBackend::setBoundDeviceId(std::optional<at::Device> device) {
  Backend::setBoundDeviceId(device);
  inner_->setBoundDeviceId(device);
}
void GraphSafeBackend::addEphemeralTimeout(const std::chrono::milliseconds& timeout) {
  inner_->addEphemeralTimeout(timeout);
}
void GraphSafeBackend::registerAbortHook(int64_t hook_id, c10d::AbortHook hook) {
  inner_->registerAbortHook(hook_id, std::move(hook));
}
void GraphSafeBackend::unregisterAbortHook(int64_t hook_id) {
  inner_->unregisterAbortHook(hook_id);
}
#endif

void GraphSafeBackend::setGroupUid(const std::string& pg_uid) {
  Backend::setGroupUid(pg_uid);
  inner_->setGroupUid(pg_uid);
}
void GraphSafeBackend::eagerConnectSingleDevice(at::Device device) {
  inner_->eagerConnectSingleDevice(device);
}
c10d::ErrorType GraphSafeBackend::getError() { return inner_->getError(); }
std::shared_ptr<c10::Allocator> GraphSafeBackend::getMemAllocator() {
  return inner_->getMemAllocator();
}
at::Tensor GraphSafeBackend::allocateTensor(long size, at::TensorOptions options) {
  return inner_->allocateTensor(size, options);
}
bool GraphSafeBackend::supportsTensorAlloc(c10::DeviceIndex device_index) {
  return inner_->supportsTensorAlloc(device_index);
}
void GraphSafeBackend::abort() { inner_->abort(); }
void GraphSafeBackend::shutdown() { inner_->shutdown(); }

}  // namespace pgd
