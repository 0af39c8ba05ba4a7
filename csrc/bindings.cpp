// pygraph_dist._C: the torch-free core and the c10d wrapper, for Python.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "bucket_plan.h"
#include "capture_fingerprint.h"
#include "capture_policy.h"
#include "graph_safe_backend.h"
#include "hand_out.h"
#include "iteration_stats.h"
#include "input_guard.h"
#include "param_watch.h"
#include "python_free.h"
#include "replay_watchdog.h"
#include "terminate_report.h"

#include <pthread.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#ifdef PGD_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#endif

namespace py = pybind11;
using namespace pgd;

namespace {

py::dict record_to_dict(const core::CollectiveRecord& r) {
  py::dict d;
  d["kind"] = core::collective_kind_name(r.kind);
  d["dtype"] = r.dtype_name;
  d["numel"] = r.numel;
  d["reduce_op"] = r.reduce_op;
  d["root"] = r.root;
  d["kind_code"] = static_cast<int>(r.kind);
  d["dtype_code"] = r.dtype;
  return d;
}

// The inverse of record_to_dict: ranks exchange their fingerprints as these
// dicts (all_gather_object) and compare them with first_difference.
core::CaptureFingerprint fingerprint_from_records(const py::list& records) {
  core::CaptureFingerprint f;
  for (const auto& item : records) {
    const auto d = item.cast<py::dict>();
    core::CollectiveRecord r;
    r.kind = static_cast<core::CollectiveKind>(d["kind_code"].cast<int>());
    r.dtype = d["dtype_code"].cast<int>();
    r.dtype_name = d["dtype"].cast<std::string>();
    r.numel = d["numel"].cast<int64_t>();
    r.reduce_op = d["reduce_op"].cast<int>();
    r.root = d["root"].cast<int64_t>();
    f.record(r);
  }
  return f;
}

#ifdef PGD_WITH_CUDA
// Launch `graphs` in order on the current stream without the GIL (torch binds
// CUDAGraph.replay the same way); with a watchdog, time the launches (a launch
// blocked by a full queue behind a dead peer is a timeout too) and, with
// `arm`, record an event after them.
void launch_watched(const std::vector<std::shared_ptr<at::cuda::CUDAGraph>>& graphs,
                    const py::object& watchdog, const std::string& label, const std::string& collectives,
                    bool arm) {
  std::shared_ptr<ReplayWatchdog> wd =
      watchdog.is_none() ? nullptr : watchdog.cast<std::shared_ptr<ReplayWatchdog>>();
  py::gil_scoped_release no_gil;
  if (wd) {
    wd->launch_started(label, collectives);
  }
  try {
    for (const auto& g : graphs) {
      g->replay();
    }
  } catch (...) {
    if (wd) {
      wd->launch_finished();
    }
    throw;
  }
  if (wd) {
    wd->launch_finished();
    if (arm) {
      wd->arm(label, collectives);
    }
  }
}
#endif

void bind_core(py::module_& m) {
  py::class_<core::ParamSpec>(m, "ParamSpec")
      .def(py::init([](int64_t numel, int64_t element_size, int dtype, int device,
                       bool requires_grad, bool isolated) {
             return core::ParamSpec{numel, element_size, dtype, device, requires_grad, isolated};
           }),
           py::arg("numel"), py::arg("element_size"), py::arg("dtype"),
           py::arg("device"), py::arg("requires_grad") = true, py::arg("isolated") = false)
      .def_readonly("numel", &core::ParamSpec::numel)
      .def_readonly("element_size", &core::ParamSpec::element_size);

  py::class_<core::Bucket>(m, "Bucket")
      .def_readonly("params", &core::Bucket::params)
      .def_readonly("offsets", &core::Bucket::offsets)
      .def_readonly("numel", &core::Bucket::numel)
      .def_readonly("bytes", &core::Bucket::bytes)
      .def_readonly("dtype", &core::Bucket::dtype)
      .def_readonly("device", &core::Bucket::device)
      .def_readonly("isolated", &core::Bucket::isolated);

  py::class_<core::BucketPlan>(m, "BucketPlan")
      .def_readonly("buckets", &core::BucketPlan::buckets)
      .def_readonly("bucket_of_param", &core::BucketPlan::bucket_of_param)
      .def_readonly("offset_of_param", &core::BucketPlan::offset_of_param)
      .def("describe", &core::BucketPlan::describe);

  m.def("plan_buckets", &core::plan_buckets, py::arg("params"),
        py::arg("bucket_cap_bytes"), py::arg("first_bucket_cap_bytes"),
        py::arg("align_elements") = core::kBucketAlignElements,
        "Assign parameters to gradient buckets (reverse order, per dtype/device), each "
        "offset a multiple of align_elements.");
  m.attr("BUCKET_ALIGN_ELEMENTS") = core::kBucketAlignElements;

  py::class_<core::CaptureFingerprint>(m, "CaptureFingerprint")
      .def(py::init<>())
      .def_property_readonly("digest", &core::CaptureFingerprint::digest)
      .def("__len__", &core::CaptureFingerprint::size)
      .def("describe", &core::CaptureFingerprint::describe, py::arg("max_records") = 8)
      .def("records", [](const core::CaptureFingerprint& f) {
        py::list out;
        for (const auto& r : f.records()) {
          out.append(record_to_dict(r));
        }
        return out;
      })
      .def_static("from_records", &fingerprint_from_records, py::arg("records"))
      .def_static("first_difference", &core::CaptureFingerprint::first_difference);

  py::class_<core::Summary>(m, "Summary")
      .def_readonly("count", &core::Summary::count)
      .def_readonly("mean", &core::Summary::mean)
      .def_readonly("stdev", &core::Summary::stdev)
      .def_readonly("cv", &core::Summary::cv)
      .def_readonly("min", &core::Summary::min)
      .def_readonly("max", &core::Summary::max)
      .def_readonly("p50", &core::Summary::p50)
      .def_readonly("p95", &core::Summary::p95)
      .def_readonly("p99", &core::Summary::p99)
      .def("describe", &core::Summary::describe, py::arg("unit") = "ms")
      .def("as_dict", [](const core::Summary& s) {
        py::dict d;
        d["count"] = s.count;
        d["mean"] = s.mean;
        d["stdev"] = s.stdev;
        d["cv"] = s.cv;
        d["min"] = s.min;
        d["max"] = s.max;
        d["p50"] = s.p50;
        d["p95"] = s.p95;
        d["p99"] = s.p99;
        return d;
      });

  py::class_<core::CrossRankSummary>(m, "CrossRankSummary")
      .def_readonly("ranks", &core::CrossRankSummary::ranks)
      .def_readonly("iterations", &core::CrossRankSummary::iterations)
      .def_readonly("iteration_max", &core::CrossRankSummary::iteration_max)
      .def_readonly("iteration_skew", &core::CrossRankSummary::iteration_skew)
      .def_readonly("max_over_ranks", &core::CrossRankSummary::max_over_ranks)
      .def_readonly("skew", &core::CrossRankSummary::skew)
      .def_readonly("straggler_wait_mean", &core::CrossRankSummary::straggler_wait_mean);

  m.def("percentile", &core::percentile, py::arg("samples"), py::arg("q"));
  m.def("summarize", &core::summarize, py::arg("samples"));
  m.def("summarize_across_ranks", &core::summarize_across_ranks, py::arg("per_rank"));

  py::enum_<core::Phase>(m, "Phase")
      .value("PROBE", core::Phase::kProbe)
      .value("WARMUP", core::Phase::kWarmup)
      .value("CAPTURE", core::Phase::kCapture)
      .value("REPLAY", core::Phase::kReplay)
      .value("EAGER", core::Phase::kEager);
  m.def("phase_name", &core::phase_name);

  py::class_<core::PolicyConfig>(m, "PolicyConfig")
      .def(py::init([](int probe, int warmup, int attempts, int recaptures) {
             core::PolicyConfig c;
             c.probe_iters = probe;
             c.warmup_iters = warmup;
             c.max_capture_attempts = attempts;
             c.max_recaptures = recaptures;
             return c;
           }),
           py::arg("probe_iters") = 1, py::arg("warmup_iters") = 3,
           py::arg("max_capture_attempts") = 2, py::arg("max_recaptures") = 8)
      .def_readonly("probe_iters", &core::PolicyConfig::probe_iters)
      .def_readonly("warmup_iters", &core::PolicyConfig::warmup_iters)
      .def_readonly("max_capture_attempts", &core::PolicyConfig::max_capture_attempts)
      .def_readonly("max_recaptures", &core::PolicyConfig::max_recaptures);

  py::class_<core::CapturePolicy>(m, "CapturePolicy")
      .def(py::init<const core::PolicyConfig&>(), py::arg("config"))
      .def("begin_iteration", &core::CapturePolicy::begin_iteration)
      .def_property_readonly("phase", &core::CapturePolicy::phase)
      .def_property_readonly("reason", &core::CapturePolicy::reason)
      .def_property_readonly("capture_attempts", &core::CapturePolicy::capture_attempts)
      .def_property_readonly("recaptures", &core::CapturePolicy::recaptures)
      .def_property_readonly("iterations", &core::CapturePolicy::iterations)
      .def_property_readonly("replays", &core::CapturePolicy::replays)
      .def_property_readonly("eager_iterations", &core::CapturePolicy::eager_iterations)
      .def("capture_succeeded", &core::CapturePolicy::capture_succeeded)
      .def("capture_failed", &core::CapturePolicy::capture_failed,
           py::arg("reason"), py::arg("retryable"))
      .def("conformance_failed", &core::CapturePolicy::conformance_failed)
      .def("invalidate", &core::CapturePolicy::invalidate)
      .def("reject", &core::CapturePolicy::reject)
      .def("disable", &core::CapturePolicy::disable)
      .def("cap_warmup", &core::CapturePolicy::cap_warmup, py::arg("max_left"));
}

void bind_backend(py::module_& m) {
  // The base class c10d::Backend is registered by torch.distributed; it must
  // be imported first so that pybind11 can find it.
  py::module_::import("torch.distributed");
  // The wrapper's Python object may hold the last reference to the inner
  // backend, whose destructor (ProcessGroupGloo's) joins worker threads that
  // can need the GIL to drop the Python tensors of a finished Work: so the
  // C++ destructor runs with the GIL released, as torch does for its own
  // backends. Otherwise a rank exits by deadlock (seen with torch 2.14, where
  // the ProcessGroup destructor drops the wrapper's Python object with the
  // GIL held).
  py::class_<GraphSafeBackend, c10d::Backend, c10::intrusive_ptr<GraphSafeBackend>>(
      m, "GraphSafeBackend",
      "A c10d Backend that forwards to `inner` and makes its collectives safe "
      "to capture into CUDA graphs (see csrc/graph_safe_backend.h).",
      py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& inner,
                       const std::string& device_type) {
             TORCH_CHECK(inner, "GraphSafeBackend needs a backend to wrap, got None");
             return c10::make_intrusive<GraphSafeBackend>(inner, device_type);
           }),
           py::arg("inner"), py::arg("device_type"))
      .def_property_readonly("inner", &GraphSafeBackend::inner)
      .def_property_readonly("device_type", &GraphSafeBackend::device_type)
      .def("start_recording", &GraphSafeBackend::start_recording)
      .def("stop_recording", &GraphSafeBackend::stop_recording)
      .def_property_readonly("recording", &GraphSafeBackend::recording)
      .def_property_readonly("collectives_issued", &GraphSafeBackend::collectives_issued)
      .def_property_readonly("collectives_captured", &GraphSafeBackend::collectives_captured);

  // pygraph_dist's own collectives over a process group whose backend is not
  // ours (csrc/python_free.h); python/pygraph_dist/launch/collectives.py builds the
  // options as torch.distributed does and calls these. The GIL is released as
  // torch's ProcessGroup bindings release it; the argument casters, which hold
  // the caller's tensors, are destroyed with it held.
  using gil_release = py::call_guard<py::gil_scoped_release>;
  m.def("python_free_allreduce", &python_free_allreduce, py::arg("group"), py::arg("tensors"),
        py::arg("opts"), gil_release(),
        "group.allreduce(tensors, opts), its Work holding no Python object.");
  m.def("python_free_broadcast", &python_free_broadcast, py::arg("group"), py::arg("tensors"),
        py::arg("opts"), gil_release(),
        "group.broadcast(tensors, opts), its Work holding no Python object.");
  m.def("python_free_allgather", &python_free_allgather, py::arg("group"), py::arg("outputs"),
        py::arg("inputs"), py::arg("opts"), gil_release(),
        "group.allgather(outputs, inputs, opts), its Work holding no Python object.");
}

template <typename T>
c10::intrusive_ptr<T> optional_intrusive(const py::object& obj) {
  return obj.is_none() ? c10::intrusive_ptr<T>() : obj.cast<c10::intrusive_ptr<T>>();
}

void bind_watchdog(py::module_& m) {
  m.attr("WATCHDOG_EXIT_CODE") = kWatchdogExitCode;
  // The exit teardown's last resorts (python/pygraph_dist/launch/lifetime.py):
  // a deadline for the whole exit, and an abort that is bounded, because
  // ncclCommAbort can block for good while a graph waits on the communicator
  // for a peer that exited.
  py::class_<ExitDeadline, std::shared_ptr<ExitDeadline>>(
      m, "ExitDeadline",
      "A native thread that ends the process (message, Python stacks, _exit(exit_code)) "
      "after seconds, unless cancel() came first; for the teardown at interpreter exit.")
      .def(py::init<double, std::string, int>(), py::arg("seconds"), py::arg("message"),
           py::arg("exit_code"))
      .def("cancel", &ExitDeadline::cancel);
  m.def("watch_interrupts", &watch_interrupts, py::arg("read_fd"),
        "Read signal numbers from read_fd (signal.set_wakeup_fd's pipe) on a native thread, once per "
        "process: SIGINT or SIGTERM marks the process interrupted for the replay watchdogs.");
  m.def("interrupted_at", &interrupted_at,
        "Monotonic seconds of the latest SIGINT/SIGTERM watch_interrupts saw; 0.0 when none.");
  m.def(
      "abort_group_within",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, double wait_s) {
        auto error = std::make_shared<std::string>();
        const bool returned = call_within(
            [pg, error] {
              try {
                pg->abort();
              } catch (const std::exception& e) {
                *error = e.what();
              }
            },
            wait_s);
        return std::make_pair(returned, returned ? *error : std::string());
      },
      py::arg("group"), py::arg("wait_s"), py::call_guard<py::gil_scoped_release>(),
      "group.abort() on a native thread, waiting at most wait_s: (returned in time, its error or '').");
  using gil_release = py::call_guard<py::gil_scoped_release>;
  py::class_<ReplayWatchdog, std::shared_ptr<ReplayWatchdog>>(
      m, "ReplayWatchdog",
      "Native replay watchdog: its own threads, never the GIL (csrc/replay_watchdog.h). "
      "On a timeout it prints what it waited for, the other ranks' heartbeats and the "
      "Python stacks, then ends the process with exit_code.")
      .def(py::init([](double timeout_s, int exit_code, double poll_s, std::string context,
                       const py::object& store, int rank, int world_size, double heartbeat_s,
                       std::string heartbeat_prefix, bool dump_python,
                       const py::object& abort_backend, double abort_wait_s,
                       const py::object& interrupt_group, double interrupt_grace_s) {
             ReplayWatchdogOptions o;
             o.timeout_s = timeout_s;
             o.exit_code = exit_code;
             o.poll_s = poll_s;
             o.context = std::move(context);
             o.store = optional_intrusive<c10d::Store>(store);
             o.rank = rank;
             o.world_size = world_size;
             o.heartbeat_s = heartbeat_s;
             o.heartbeat_prefix = std::move(heartbeat_prefix);
             o.dump_python = dump_python;
             o.abort_backend = optional_intrusive<c10d::Backend>(abort_backend);
             o.abort_wait_s = abort_wait_s;
             o.interrupt_group = optional_intrusive<c10d::ProcessGroup>(interrupt_group);
             o.interrupt_grace_s = interrupt_grace_s;
             return std::make_shared<ReplayWatchdog>(std::move(o));
           }),
           py::arg("timeout_s"), py::arg("exit_code") = kWatchdogExitCode,
           py::arg("poll_s") = 0.0, py::arg("context") = "", py::arg("store") = py::none(),
           py::arg("rank") = 0, py::arg("world_size") = 1, py::arg("heartbeat_s") = 0.0,
           py::arg("heartbeat_prefix") = "pgd/alive/", py::arg("dump_python") = true,
           py::arg("abort_backend") = py::none(), py::arg("abort_wait_s") = 0.0,
           py::arg("interrupt_group") = py::none(), py::arg("interrupt_grace_s") = 2.0)
      // Every call that can touch CUDA or wait releases the GIL: recording an
      // event blocks once the launch queue is full.
      .def("launch_started", &ReplayWatchdog::launch_started, py::arg("label"),
           py::arg("collectives") = "", gil_release())
      .def("launch_finished", &ReplayWatchdog::launch_finished, gil_release())
      .def("arm", &ReplayWatchdog::arm, py::arg("label"), py::arg("collectives") = "", gil_release(),
           "Record an event on the current CUDA stream and time out if it does not complete.")
      .def("arm_host", &ReplayWatchdog::arm_host, py::arg("label"), py::arg("collectives") = "",
           gil_release(), "A pending replay completed by complete_host() (tests without CUDA).")
      .def("complete_host", &ReplayWatchdog::complete_host, gil_release())
      .def("clear", &ReplayWatchdog::clear, gil_release())
      .def("close", &ReplayWatchdog::close, gil_release())
      .def_property_readonly("closed", &ReplayWatchdog::closed)
      .def_property_readonly("armed", &ReplayWatchdog::armed)
      .def_property_readonly("completed", &ReplayWatchdog::completed)
      .def_property_readonly("pending", &ReplayWatchdog::pending)
      .def_property_readonly("interrupt_aborted", &ReplayWatchdog::interrupt_aborted)
      .def_property_readonly("timeout_s", &ReplayWatchdog::timeout_s)
      .def_property_readonly("poll_s", &ReplayWatchdog::poll_s)
      .def_property_readonly("heartbeat_s", &ReplayWatchdog::heartbeat_s)
      .def_static("python_stacks_available", &ReplayWatchdog::python_stacks_available);

#ifdef PGD_WITH_CUDA
  // torch binds CUDAGraph.replay with the GIL released already
  // (torch/csrc/cuda/Graph.cpp, wrap_pybind_function_no_gil); this adds the
  // watchdog's launch bracket and event around the launches, in one call.
  m.def(
      "replay_graphs",
      [](const py::sequence& graphs, const py::object& watchdog, const std::string& label,
         const std::string& collectives, bool arm) {
        std::vector<std::shared_ptr<at::cuda::CUDAGraph>> gs;
        gs.reserve(graphs.size());
        for (const py::handle g : graphs) {
          gs.push_back(g.cast<std::shared_ptr<at::cuda::CUDAGraph>>());
        }
        launch_watched(gs, watchdog, label, collectives, arm);
      },
      py::arg("graphs"), py::arg("watchdog") = py::none(), py::arg("label") = "",
      py::arg("collectives") = "", py::arg("arm") = true,
      "Replay torch.cuda.CUDAGraph objects in order on the current stream without the GIL; "
      "with a watchdog, time the launches and (arm=True) record an event after them.");
#endif

#ifdef PGD_WITH_CUDA
  // Tier 1's steady replay in one call (issue 26): what Engine._replay_owned
  // would otherwise spread over four calls and their Python frames. Compares
  // the parameters' state with the capture's (graph_cache.drift's check);
  // copies the call's tensors matched by `guard` into the static inputs; makes
  // every trainable .grad its bucket view; launches the graph as replay_graphs
  // does (watched, without the GIL); hands out a fresh loss (hand_out.h).
  // Returns None with nothing done when the parameters' state differs: the
  // caller takes the long path, which says what changed.
  m.def(
      "replay_owned",
      [](InputGuard& guard, const ParamWatch& watch, const py::bytes& state, const py::object& graph,
         const py::object& watchdog, const std::string& label, const std::string& collectives,
         bool arm, const at::Tensor& loss) -> py::object {
        if (watch.state() != static_cast<std::string_view>(state)) {
          return py::none();
        }
        const std::vector<std::shared_ptr<at::cuda::CUDAGraph>> gs{
            graph.cast<std::shared_ptr<at::cuda::CUDAGraph>>()};
        guard.copy_pending();
        watch.expose_grads();
        launch_watched(gs, watchdog, label, collectives, arm);
        return py::cast(hand_out_loss(loss));
      },
      py::arg("guard"), py::arg("watch"), py::arg("state"), py::arg("graph"),
      py::arg("watchdog"), py::arg("label"), py::arg("collectives"), py::arg("arm"),
      py::arg("loss"),
      "Tier 1's steady replay: state check, input copies, .grad views, launch, loss hand-out.");
#endif

  // Whether every param group's "params" holds exactly the parameters of
  // `snapshot` (one tuple per group), compared by identity: fast_lane.ClearGrads'
  // check before each zero_grad, ~1 ns a parameter instead of a Python call each.
  m.def(
      "same_group_params",
      [](const py::sequence& groups, const py::sequence& snapshot) {
        const size_t n = py::len(groups);
        if (n != py::len(snapshot)) {
          return false;
        }
        for (size_t i = 0; i < n; ++i) {
          py::object params = groups[i]["params"];
          py::object snap = snapshot[i];
          if (!PyTuple_Check(snap.ptr())) {
            return false;
          }
          py::object fast = py::reinterpret_steal<py::object>(
              PySequence_Fast(params.ptr(), "param group 'params' is not a sequence"));
          if (!fast) {
            PyErr_Clear();
            return false;
          }
          const Py_ssize_t k = PySequence_Fast_GET_SIZE(fast.ptr());
          if (k != PyTuple_GET_SIZE(snap.ptr())) {
            return false;
          }
          PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
          for (Py_ssize_t j = 0; j < k; ++j) {
            if (items[j] != PyTuple_GET_ITEM(snap.ptr(), j)) {
              return false;
            }
          }
        }
        return true;
      },
      py::arg("groups"), py::arg("snapshot"),
      "Whether each group's params are the snapshot's tuple, element by element, by identity.");

  // Test hook: block this thread for `seconds` while holding the GIL, as a
  // CUDA call made with the GIL held blocks when the launch queue is full.
  m.def("_hold_gil_for_test", [](double seconds) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  });
  // Test hook: std::terminate from a named thread, as a joinable thread destroyed would.
  m.def("_terminate_for_test", [](const std::string& thread_name) {
    std::thread([thread_name] {
      pthread_setname_np(pthread_self(), thread_name.substr(0, 15).c_str());
      std::terminate();
    }).join();
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pygraph_dist native core: bucket planning, capture fingerprints, "
            "iteration statistics, the capture policy, and the graph-safe c10d backend.";
  m.attr("__torch_version__") = PGD_TORCH_VERSION;
#ifdef PGD_WITH_CUDA
  m.attr("cuda_enabled") = true;
#else
  m.attr("cuda_enabled") = false;
#endif
  m.attr("not_capturable_tag") = kNotCapturableTag;
  m.def("current_stream_is_capturing", &current_stream_is_capturing,
        "True when this thread's current CUDA stream is capturing.");
  bind_core(m);
  bind_backend(m);
  bind_watchdog(m);
  bind_param_watch(m);
  bind_hand_out(m);
  bind_input_guard(m);
  install_terminate_report();
}
