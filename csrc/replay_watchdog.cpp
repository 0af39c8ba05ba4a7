#include "replay_watchdog.h"

#include <dlfcn.h>
#include <pthread.h>
#include <csignal>
#include <cerrno>
#include <unistd.h>

#include <Python.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

#include <c10/util/Exception.h>

#include "pending_replays.h"

#ifdef PGD_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace pgd {

namespace {

double mono_now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

double wall_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::chrono::duration<double> seconds(double s) { return std::chrono::duration<double>(s); }

// _Py_DumpTracebackThreads(fd, interp, current_tstate): exported by CPython
// 3.11 and 3.12 (Include/internal/pycore_traceback.h, PyAPI_FUNC) but not part
// of the public headers, so it is looked up at run time: a Python without it
// gets the report without stacks instead of an extension that fails to load.
// faulthandler.dump_traceback_later's thread calls it the same way, from a C
// thread that does not hold the GIL.
using DumpThreadsFn = const char* (*)(int, PyInterpreterState*, PyThreadState*);

DumpThreadsFn python_stack_dumper() {
  static DumpThreadsFn fn = [] {
    for (const char* name : {"PyUnstable_DumpTracebackThreads", "_Py_DumpTracebackThreads"}) {
      if (void* sym = dlsym(RTLD_DEFAULT, name)) {
        return reinterpret_cast<DumpThreadsFn>(sym);
      }
    }
    return static_cast<DumpThreadsFn>(nullptr);
  }();
  return fn;
}

void write_all(const std::string& text) {
  // stdio's stderr is unbuffered; fflush anyway in case a program changed that.
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

// Every Python thread's stack to stderr, from a native thread without the GIL
// (interp: the interpreter of the thread that armed it), with a line before
// it; each line of ours starts with prefix.
void write_python_stacks(PyInterpreterState* interp, const std::string& prefix) {
  DumpThreadsFn dump = python_stack_dumper();
  if (dump == nullptr) {
    write_all(prefix + "Python stacks unavailable: this Python does not export _Py_DumpTracebackThreads\n");
  } else if (interp == nullptr || !Py_IsInitialized()) {
    write_all(prefix + "Python stacks unavailable: the interpreter is finalizing\n");
  } else {
    write_all(prefix + "Python stacks of this process, most recent call first:\n");
    if (const char* err = dump(STDERR_FILENO, interp, nullptr)) {
      write_all(prefix + "stack dump failed: " + err + "\n");
    }
  }
}

// The end of a process nothing else can end: message, then (stacks) every
// Python thread's stack, then _exit -- not exit: atexit handlers and static
// destructors would run while the main thread is stuck in a CUDA or NCCL call.
[[noreturn]] void end_process(const std::string& message, bool stacks, PyInterpreterState* interp,
                              const std::string& prefix, int exit_code) {
  write_all(message);
  if (stacks) {
    write_python_stacks(interp, prefix);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(exit_code);
}

}  // namespace

// One armed replay as the threads see it: core::PendingReplays holds its
// label and times, this holds what completes it.
struct Slot {
  uint64_t seq = 0;
  void* event = nullptr;  // cudaEvent_t, or nullptr for a host replay (arm_host)
  int device = -1;
  bool host_done = false;
};

struct ReplayWatchdog::State {
  explicit State(ReplayWatchdogOptions o)
      : opts(std::move(o)), pending(opts.timeout_s) {}
  ~State();

  ReplayWatchdogOptions opts;
  double poll_s = 0.0;
  double heartbeat_s = 0.0;
  PyInterpreterState* interp = nullptr;

  std::mutex mu;  // guards everything below; never held across a CUDA or store call
  std::condition_variable wake;
  core::PendingReplays pending;
  std::deque<Slot> slots;  // parallel to pending's queue
  std::vector<std::pair<int, void*>> free_events;  // (device, cudaEvent_t) for reuse
  bool stop = false;
  int threads_running = 0;
  std::condition_variable thread_exited;
  std::string poll_error;  // the last error cudaEventQuery returned, if any
  std::optional<core::RankLiveness> liveness;
  double store_call_since = 0.0;  // mono time a store call began; 0 when none is in flight
  std::atomic<bool> firing{false};
  bool interrupt_handled = false;
  std::atomic<bool> interrupt_aborted{false};

  uint64_t arm_slot(Slot slot, const std::string& label, const std::string& collectives);
  void poll_loop();
  void judge_loop();
  void heartbeat_loop();
  [[noreturn]] void fire(const core::ReplayVerdict& verdict, const std::vector<int>& departed = {});
  void abort_for_interrupt(const core::ReplayVerdict& verdict, double interrupted_s);
  double departure_grace_s() const;
  std::string describe_liveness();
};

ReplayWatchdog::State::~State() {
#ifdef PGD_WITH_CUDA
  // Only reached once every thread has exited (they hold this state).
  // Errors are ignored: at process exit the runtime may already be unloading.
  auto destroy = [](void* ev) {
    if (ev != nullptr) {
      (void)cudaEventDestroy(static_cast<cudaEvent_t>(ev));
    }
  };
  for (auto& [device, ev] : free_events) {
    destroy(ev);
  }
  for (auto& slot : slots) {
    destroy(slot.event);
  }
  (void)cudaGetLastError();
#endif
}

uint64_t ReplayWatchdog::State::arm_slot(Slot slot, const std::string& label,
                                         const std::string& collectives) {
  std::lock_guard<std::mutex> lock(mu);
  slot.seq = pending.arm(label, collectives, mono_now());
  slots.push_back(slot);
  return slot.seq;
}

void ReplayWatchdog::State::poll_loop() {
#ifdef PGD_WITH_CUDA
  int current_device = -1;
#endif
  std::unique_lock<std::mutex> lock(mu);
  while (!stop) {
    if (slots.empty()) {
      wake.wait_for(lock, seconds(poll_s));
      continue;
    }
    Slot head = slots.front();
    bool done = head.host_done;
#ifdef PGD_WITH_CUDA
    if (head.event != nullptr) {
      lock.unlock();  // cudaEventQuery may block behind a launch stuck in the driver
      if (head.device != current_device) {
        (void)cudaSetDevice(head.device);
        current_device = head.device;
      }
      const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(head.event));
      done = err == cudaSuccess;
      if (err != cudaSuccess && err != cudaErrorNotReady) {
        (void)cudaGetLastError();
        lock.lock();
        poll_error = std::string("cudaEventQuery: ") + cudaGetErrorString(err);
        lock.unlock();
      }
      lock.lock();
    }
#endif
    if (done && !slots.empty() && slots.front().seq == head.seq) {
      if (head.event != nullptr) {
        free_events.emplace_back(head.device, head.event);
      }
      slots.pop_front();
      pending.complete_oldest(head.seq, mono_now());
      continue;  // the next one may be complete too
    }
    wake.wait_for(lock, seconds(poll_s));
  }
}

void ReplayWatchdog::State::judge_loop() {
  std::unique_lock<std::mutex> lock(mu);
  while (!stop) {
    wake.wait_for(lock, seconds(poll_s));
    if (stop) {
      break;
    }
    const double now = mono_now();
    const core::ReplayVerdict verdict = pending.check(now);
    if (verdict.timed_out()) {
      lock.unlock();
      fire(verdict);
    }
    const double interrupted = interrupted_at();
    if (opts.interrupt_group && !interrupt_handled && interrupted > 0.0) {
      const core::ReplayVerdict stuck = pending.check_interrupted(now, interrupted, opts.interrupt_grace_s);
      if (stuck.timed_out()) {
        interrupt_handled = true;
        lock.unlock();
        abort_for_interrupt(stuck, now - interrupted);
        lock.lock();
      }
    }
  }
}

void ReplayWatchdog::State::abort_for_interrupt(const core::ReplayVerdict& verdict, double interrupted_s) {
  const double wait_s = opts.abort_wait_s > 0.0 ? opts.abort_wait_s : 2.0;
  char head[256];
  std::snprintf(head, sizeof(head),
                "[pygraph_dist watchdog] %s: interrupted %.1f s ago while graph replay #%llu ",
                opts.context.c_str(), interrupted_s, static_cast<unsigned long long>(verdict.replay.seq));
  write_all(std::string(head) + verdict.replay.label +
            " waits for its collectives, with no progress since: the ranks interrupted before they "
            "launched them will not launch them now, and Python cannot raise the interrupt inside "
            "this CUDA call. Aborting the communicator so that this process can end; this rank's "
            "last step is incomplete (its parameters and optimizer state are not the other ranks': "
            "do not save them).\n");
  // Done when the abort returns, or when the stuck replay completes (its
  // kernels saw the abort flag) while the abort waits for the graphs to go.
  int asked = 0;
  const auto replay_returned = [&] {
    std::lock_guard<std::mutex> g(mu);
    const auto head = pending.oldest();
    if (!head || head->seq != verdict.replay.seq) {
      return true;
    }
    if (++asked % 5 == 0) {
      wake.notify_all();  // the poller asks CUDA again now, not in a poll period
    }
    return false;
  };
  const bool freed = call_within([group = opts.interrupt_group] { group->abort(); }, wait_s, replay_returned);
  if (freed) {
    interrupt_aborted.store(true);
    write_all("[pygraph_dist watchdog] communicator aborted\n");
    return;
  }
  // As lifetime._end_now at exit: nothing else can end this process. Status
  // 1, an uncaught error's (and torch DDP's ranks' on Ctrl-C on 2xH200), not
  // the timeout's 70: the user asked it to stop, and it stops.
  firing.store(true);
  char tail[256];
  std::snprintf(tail, sizeof(tail),
                "[pygraph_dist watchdog] the abort did not return within %.0f s; ending the process "
                "now with exit status %d\n",
                wait_s, opts.interrupt_exit_code);
  end_process(tail, opts.dump_python, interp, "[pygraph_dist watchdog] ", opts.interrupt_exit_code);
}

void ReplayWatchdog::State::heartbeat_loop() {
  // A connection of our own: TCPStore serialises calls on one client, and a
  // store call blocked here (the store's host stopped) must not block the
  // main thread's. Made here rather than in the constructor because
  // connecting can itself block.
  c10::intrusive_ptr<c10d::Store> store = opts.store;
  try {
    store = opts.store->clone();
  } catch (const std::exception&) {
    store = opts.store;  // a store that cannot be cloned is shared
  }
  const std::string self_key = opts.heartbeat_prefix + std::to_string(opts.rank);
  const auto store_call = [&](auto&& fn) -> bool {
    {
      std::lock_guard<std::mutex> g(mu);
      store_call_since = mono_now();
    }
    std::string error;
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
      const size_t nl = error.find('\n');
      if (nl != std::string::npos) {
        error.resize(nl);
      }
    }
    std::lock_guard<std::mutex> g(mu);
    store_call_since = 0.0;
    if (error.empty()) {
      liveness->store_reachable();
    } else {
      liveness->store_unreachable(error, wall_now());
    }
    return error.empty();
  };
  const auto beat = [&](bool closed) {
    core::Heartbeat hb;
    {
      std::lock_guard<std::mutex> g(mu);
      hb.armed = pending.armed();
      hb.completed = pending.completed();
    }
    hb.wall_s = wall_now();
    hb.closed = closed;
    const std::string text = core::encode_heartbeat(hb);
    return store_call([&] { store->set(self_key, std::vector<uint8_t>(text.begin(), text.end())); });
  };

  std::unique_lock<std::mutex> lock(mu);
  while (!stop) {
    // Read the other ranks only once something is overdue by a third of the
    // timeout: steady state costs one set per period, not world_size reads.
    // Or once the oldest replay has waited departure_grace_s: then a rank
    // that left training (closed its watchdog) ends the wait early.
    const double now = mono_now();
    const double grace = departure_grace_s();
    const bool suspicious = pending.check(now, opts.timeout_s / 3.0).timed_out();
    const bool waiting = grace < opts.timeout_s && pending.check(now, grace).timed_out();
    lock.unlock();
    if (beat(false) && (suspicious || waiting)) {
      for (int r = 0; r < opts.world_size; ++r) {
        if (r == opts.rank) {
          continue;
        }
        const std::string key = opts.heartbeat_prefix + std::to_string(r);
        std::optional<core::Heartbeat> hb;
        const bool ok = store_call([&] {
          if (store->check({key})) {
            const std::vector<uint8_t> v = store->get(key);
            hb = core::decode_heartbeat(std::string(v.begin(), v.end()));
          }
        });
        if (!ok) {
          break;
        }
        std::lock_guard<std::mutex> g(mu);
        liveness->observe(r, hb, wall_now());
      }
      if (waiting) {
        std::unique_lock<std::mutex> g(mu);
        const std::vector<int> left = liveness->departed();
        const core::ReplayVerdict verdict = pending.check(mono_now(), grace);
        g.unlock();
        if (!left.empty() && verdict.timed_out()) {
          fire(verdict, left);
        }
      }
    }
    lock.lock();
    if (stop) {
      break;
    }
    wake.wait_for(lock, seconds(heartbeat_s));
  }
  lock.unlock();
  beat(true);  // tell the others this rank left on purpose
}

std::string ReplayWatchdog::State::describe_liveness() {
  std::lock_guard<std::mutex> lock(mu);
  std::string out;
  if (!poll_error.empty()) {
    out += "the event poller saw " + poll_error + "\n";
  }
  if (!liveness) {
    return out;
  }
  if (store_call_since > 0.0) {
    char buf[160];
    std::snprintf(buf, sizeof(buf),
                  "a store call has not returned for %.1f s (the store's host may be the rank "
                  "that stopped)\n",
                  mono_now() - store_call_since);
    out += buf;
  }
  return out + liveness->describe(wall_now());
}

double ReplayWatchdog::State::departure_grace_s() const {
  // Long enough that a slow step is not mistaken for a wait on a rank that
  // left; the departure itself takes RankLiveness::kDepartedReads heartbeats.
  return std::max(5.0, 2.0 * heartbeat_s);
}

void ReplayWatchdog::State::fire(const core::ReplayVerdict& verdict, const std::vector<int>& departed) {
  firing.store(true);
  const std::string liveness_text = describe_liveness();
  write_all(core::describe_timeout(verdict, opts.timeout_s, opts.context, liveness_text, opts.exit_code, departed));

  if (opts.dump_python) {
    write_python_stacks(interp, "[pygraph_dist watchdog] ");
  }

  if (opts.abort_backend && opts.abort_wait_s > 0.0) {
    char buf[160];
    std::snprintf(buf, sizeof(buf),
                  "[pygraph_dist watchdog] aborting the communicator (%s), waiting at most %.1f s\n",
                  opts.abort_backend->getBackendName().c_str(), opts.abort_wait_s);
    write_all(buf);
    const bool aborted = call_within([backend = opts.abort_backend] { backend->abort(); }, opts.abort_wait_s);
    write_all(aborted ? "[pygraph_dist watchdog] communicator aborted\n"
                           : "[pygraph_dist watchdog] the abort did not return in time\n");
  }
  std::fflush(stdout);
  std::fflush(stderr);
  // _exit, not exit: atexit handlers and static destructors would run while
  // the main thread is stuck inside a CUDA or NCCL call.
  _exit(opts.exit_code);
}

// ---- ReplayWatchdog ------------------------------------------------------

ReplayWatchdog::ReplayWatchdog(ReplayWatchdogOptions options) {
  TORCH_CHECK(options.timeout_s > 0.0, "ReplayWatchdog: timeout_s must be > 0, got ", options.timeout_s);
  TORCH_CHECK(options.exit_code >= 0 && options.exit_code <= 255,
              "ReplayWatchdog: exit_code must be in 0..255, got ", options.exit_code);
  TORCH_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size,
              "ReplayWatchdog: need 0 <= rank < world_size, got rank ", options.rank,
              " of ", options.world_size);
  if (options.context.empty()) {
    options.context = "rank " + std::to_string(options.rank) + " of " + std::to_string(options.world_size);
  }
  state_ = std::make_shared<State>(std::move(options));
  State& s = *state_;
  s.poll_s = s.opts.poll_s > 0.0 ? s.opts.poll_s
                                 : std::min(1.0, std::max(0.05, s.opts.timeout_s / 20.0));
  s.heartbeat_s = s.opts.heartbeat_s > 0.0 ? s.opts.heartbeat_s
                                           : std::min(5.0, std::max(0.5, s.opts.timeout_s / 4.0));
  // Called from Python (the bindings hold the GIL for the constructor).
  if (Py_IsInitialized() && PyGILState_Check()) {
    s.interp = PyInterpreterState_Get();
  }
  auto start = [this](void (State::*loop)(), const char* name) {
    std::shared_ptr<State> st = state_;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      ++st->threads_running;
    }
    threads_.emplace_back([st, loop, name] {
      pthread_setname_np(pthread_self(), name);  // shows in stacks, top, gdb
      ((*st).*loop)();
      std::lock_guard<std::mutex> lock(st->mu);
      --st->threads_running;
      st->thread_exited.notify_all();
    });
  };
  start(&State::poll_loop, "pgd_wd_poll");
  start(&State::judge_loop, "pgd_wd_judge");
  if (s.opts.store) {
    // A heartbeat older than two periods plus a second is stale: an alive
    // rank writes every period, and this rank reads every period.
    s.liveness.emplace(s.opts.world_size, s.opts.rank, 2.0 * s.heartbeat_s + 1.0);
    start(&State::heartbeat_loop, "pgd_wd_beat");
  }
}

ReplayWatchdog::~ReplayWatchdog() { close(); }

void ReplayWatchdog::launch_started(const std::string& label, const std::string& collectives) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->pending.launch_started(label, collectives, mono_now());
}

void ReplayWatchdog::launch_finished() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->pending.launch_finished(mono_now());
}

uint64_t ReplayWatchdog::arm(const std::string& label, const std::string& collectives) {
#ifdef PGD_WITH_CUDA
  TORCH_CHECK(!closed_, "ReplayWatchdog.arm() after close()");
  State& s = *state_;
  const int device = c10::cuda::current_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return 0;  // an event recorded now would become a node of the graph being captured
  }
  Slot slot;
  slot.device = device;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto it = s.free_events.begin(); it != s.free_events.end(); ++it) {
      if (it->first == device) {
        slot.event = it->second;
        s.free_events.erase(it);
        break;
      }
    }
    // Recording blocks once the launch queue is full: the judge sees it as a launch.
    s.pending.launch_started(label, collectives, mono_now());
  }
  if (slot.event == nullptr) {
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    slot.event = ev;
  }
  const cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(slot.event), stream);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.pending.launch_finished(mono_now());
    if (err != cudaSuccess) {
      s.free_events.emplace_back(device, slot.event);
    }
  }
  C10_CUDA_CHECK(err);
  return s.arm_slot(slot, label, collectives);
#else
  TORCH_CHECK(false, "ReplayWatchdog.arm(): pygraph_dist._C was built without its CUDA code "
                     "paths; use arm_host()");
#endif
}

uint64_t ReplayWatchdog::arm_host(const std::string& label, const std::string& collectives) {
  TORCH_CHECK(!closed_, "ReplayWatchdog.arm_host() after close()");
  return state_->arm_slot(Slot{}, label, collectives);
}

void ReplayWatchdog::complete_host() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (Slot& slot : state_->slots) {
    if (slot.event == nullptr && !slot.host_done) {
      slot.host_done = true;
      break;
    }
  }
  state_->wake.notify_all();
}

void ReplayWatchdog::clear() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (Slot& slot : state_->slots) {
    if (slot.event != nullptr) {
      state_->free_events.emplace_back(slot.device, slot.event);
    }
  }
  state_->slots.clear();
  state_->pending.clear(mono_now());
}

void ReplayWatchdog::close() {
  if (closed_) {
    return;
  }
  closed_ = true;
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  s.stop = true;
  s.wake.notify_all();
  // Bounded: a thread blocked in cudaEventQuery or a store call must not hang
  // teardown. The heartbeat thread's last write ("closed") is part of this wait.
  const double bound = 3.0;
  s.thread_exited.wait_for(lock, seconds(bound), [&] { return s.threads_running == 0; });
  const bool all_exited = s.threads_running == 0;
  lock.unlock();
  for (std::thread& t : threads_) {
    // A thread that has not exited only touches the shared state it owns a
    // reference to; detaching keeps ~thread from calling std::terminate.
    if (all_exited) {
      t.join();
    } else {
      t.detach();
    }
  }
  threads_.clear();
}

bool ReplayWatchdog::closed() const { return closed_; }

uint64_t ReplayWatchdog::armed() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pending.armed();
}

uint64_t ReplayWatchdog::completed() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pending.completed();
}

size_t ReplayWatchdog::pending() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pending.pending();
}

bool ReplayWatchdog::interrupt_aborted() const { return state_->interrupt_aborted.load(); }
double ReplayWatchdog::timeout_s() const { return state_->opts.timeout_s; }
double ReplayWatchdog::poll_s() const { return state_->poll_s; }
double ReplayWatchdog::heartbeat_s() const { return state_->heartbeat_s; }

bool ReplayWatchdog::python_stacks_available() { return python_stack_dumper() != nullptr; }

namespace {
std::atomic<double> g_interrupted_at{0.0};
std::atomic<bool> g_watching_interrupts{false};
}  // namespace

void watch_interrupts(int read_fd) {
  if (g_watching_interrupts.exchange(true)) {
    return;  // one reader for the process; the pipe is kept for its lifetime
  }
  std::thread([read_fd] {
    pthread_setname_np(pthread_self(), "pgd_signals");
    unsigned char buf[64];
    for (;;) {
      const ssize_t n = read(read_fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        g_watching_interrupts.store(false);
        return;
      }
      for (ssize_t i = 0; i < n; ++i) {
        if (buf[i] == SIGINT || buf[i] == SIGTERM) {
          // The latest: a script that handled an earlier Ctrl-C and trained
          // on is watched again for this one (replays armed before it).
          g_interrupted_at.store(mono_now());
        }
      }
    }
  }).detach();
}

double interrupted_at() { return g_interrupted_at.load(); }

bool call_within(std::function<void()> fn, double wait_s, const std::function<bool()>& enough) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([fn = std::move(fn), done] {
    try {
      fn();
    } catch (...) {
    }
    done->store(true);
  }).detach();
  const double deadline = mono_now() + wait_s;
  while (!done->load() && mono_now() < deadline) {
    if (enough && enough()) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done->load() || (enough && enough());
}

ExitDeadline::ExitDeadline(double seconds, std::string message, int exit_code)
    : cancelled_(std::make_shared<std::atomic<bool>>(false)) {
  PyInterpreterState* interp =
      (Py_IsInitialized() && PyGILState_Check()) ? PyInterpreterState_Get() : nullptr;
  std::thread([seconds, message = std::move(message), exit_code, interp, cancelled = cancelled_] {
    pthread_setname_np(pthread_self(), "pgd-exit-limit");
    const double deadline = mono_now() + seconds;
    while (mono_now() < deadline) {
      if (cancelled->load()) {
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (cancelled->load()) {
      return;
    }
    end_process(message, true, interp, "[pygraph_dist] ", exit_code);
  }).detach();
}

void ExitDeadline::cancel() { cancelled_->store(true); }

}  // namespace pgd
