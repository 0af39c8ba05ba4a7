// Calling a c10d collective so that its Work holds no Python object.
//
// A ProcessGroupGloo Work is often released by a Gloo worker thread. If it
// holds a Python object (in the thread-local state it captured, or through
// one of its tensors), that release takes the GIL; during interpreter
// finalization CPython ends such a thread with pthread_exit, the unwinding
// meets noexcept destructors and the process aborts with "terminate called
// without an active exception" after Python finished (issue 13 item 4,
// issue 25). Two users of what is here:
//   * GraphSafeBackend (graph_safe_backend.cpp) forwards every collective to
//     the backend it wraps this way;
//   * python_free_* below issue pygraph_dist's own collectives this way over a
//     process group whose backend is not ours: the user's own
//     init_process_group("gloo") or "nccl", Lightning's CPU strategy.
#pragma once

#include <utility>
#include <vector>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace pgd {

// Hides, while a collective is issued, the Python objects torch keeps in C++
// thread-local storage, which ProcessGroupGloo's AsyncWork captures with the
// caller's at::ThreadLocalState:
//   * at::impl::ThreadLocalPythonObjects: torch's backward stashes
//     contextvars.copy_context() there for its whole duration
//     (torch/autograd/graph.py, _engine_run_backward), and our reducer issues
//     the bucket all-reduces from gradient hooks during backward;
//   * the TorchFunctionMode stack (at::impl::PythonTorchFunctionTLS):
//     pygraph_dist's LoopMonitor is on it during backward. torch's own
//     dist.all_reduce pops it before reaching the process group (it dispatches
//     __torch_function__ first); a collective issued from C++ would not.
// Neither is read by a collective: c10d dispatches below Python. The native
// stack of the abort this prevents: pt_gloo_runloop, ~AsyncAllreduceWork,
// ~ThreadLocalState, ~SafePyObject, gil_scoped_acquire, pthread_exit.
// Saving and restoring copies shared_ptrs only: no Python refcount changes,
// no GIL.
class PythonTlsObjectsHidden {
 public:
  PythonTlsObjectsHidden()
      : saved_objects_(at::impl::ThreadLocalPythonObjects::get_state()),
        saved_modes_(at::impl::PythonTorchFunctionTLS::get_state()) {
    at::impl::ThreadLocalPythonObjects::set_state(at::impl::ThreadLocalPythonObjects());
    const auto disabled = at::impl::PythonTorchFunctionTLS::get_disabled_state();
    at::impl::PythonTorchFunctionTLS::set_state(at::impl::PythonTorchFunctionTLS());
    at::impl::PythonTorchFunctionTLS::set_disabled_state(disabled);
  }
  ~PythonTlsObjectsHidden() {
    at::impl::PythonTorchFunctionTLS::set_state(saved_modes_);
    at::impl::ThreadLocalPythonObjects::set_state(std::move(saved_objects_));
  }
  PythonTlsObjectsHidden(const PythonTlsObjectsHidden&) = delete;
  PythonTlsObjectsHidden& operator=(const PythonTlsObjectsHidden&) = delete;

 private:
  at::impl::ThreadLocalPythonObjects saved_objects_;
  at::impl::PythonTorchFunctionTLS saved_modes_;
};

// Hands the backend aliases of the caller's CPU tensors that have no Python
// object, for the duration of the call, and puts the caller's tensors back
// afterwards. In current torch (2.13's c10/util/intrusive_ptr.h) a TensorImpl
// with a Python object increfs it when a second C++ reference appears and
// decrefs it -- taking the GIL -- when that reference goes. A Gloo Work holds
// its tensors until a Gloo worker thread drops it (CI, 2026-11-23:
// pt_gloo_runloop, TensorImpl::decref_pyobject, PyEval_RestoreThread,
// pthread_exit). An alias is a new TensorImpl over the same storage, with the
// same version counter: the collective reads and writes the caller's memory
// and bumps the caller's version where torch's does (all_gather's outputs),
// and the worker thread drops a tensor no Python object knows. (The storage
// is shared; pygraph_dist never creates Python objects for its buckets'
// storages.) CUDA tensors are left alone: NCCL's Works are released by its
// watchdog, which the process group joins when it is destroyed.
class PythonFreeArgs {
 public:
  PythonFreeArgs() = default;
  ~PythonFreeArgs() {
    for (auto& [slot, original] : saved_) {
      *slot = std::move(original);
    }
  }
  PythonFreeArgs(const PythonFreeArgs&) = delete;
  PythonFreeArgs& operator=(const PythonFreeArgs&) = delete;

  PythonFreeArgs& operator()() { return *this; }
  PythonFreeArgs& operator()(at::Tensor& t) {
    if (aliasable(t)) {
      auto impl = c10::make_intrusive<c10::TensorImpl>(
          c10::Storage(t.storage()), t.key_set(), t.dtype());
      impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
      // Under torch.inference_mode() the alias of a normal tensor is an
      // inference tensor, which has no version counter to share (and the
      // reverse: TensorImpl's constructor follows the mode, not the key set).
      if (impl->is_inference() == t.is_inference()) {
        impl->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
      }
      saved_.emplace_back(&t, t);
      t = at::Tensor(std::move(impl));
    }
    return *this;
  }
  PythonFreeArgs& operator()(std::vector<at::Tensor>& ts) {
    for (auto& t : ts) {
      (*this)(t);
    }
    return *this;
  }
  PythonFreeArgs& operator()(std::vector<std::vector<at::Tensor>>& lists) {
    for (auto& l : lists) {
      (*this)(l);
    }
    return *this;
  }

 private:
  // Plain dense CPU tensors only: CUDA, sparse ones, tensor subclasses (Python
  // dispatch key) and lazily conjugated/negated views go to the backend as they are.
  static bool aliasable(const at::Tensor& t) {
    return t.defined() && t.layout() == c10::kStrided && t.has_storage() &&
        !t.key_set().has(c10::DispatchKey::Python) && !t.is_conj() && !t.is_neg() &&
        t.device().is_cpu();
  }

  std::vector<std::pair<at::Tensor*, at::Tensor>> saved_;
};

// pygraph_dist's own collectives over any process group: `pg`'s own
// allreduce / broadcast / allgather (the c10d dispatcher op, then the
// backend, exactly as torch.distributed's Python functions reach it), issued
// with the Python objects above hidden and, for CPU tensors, Python-free
// aliases. The caller builds `opts` as torch.distributed does
// (python/pygraph_dist/launch/collectives.py) and waits on the Work when it asked
// for a synchronous call. Call without the GIL (the bindings release it).
c10::intrusive_ptr<c10d::Work> python_free_allreduce(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts);
c10::intrusive_ptr<c10d::Work> python_free_broadcast(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts);
c10::intrusive_ptr<c10d::Work> python_free_allgather(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts);

}  // namespace pgd
