// Host phases of the ops frameworks call on every layer (bench/host_overhead.py --phases): with
// DEEP_EP_HOST_PHASES=<path> in the environment when the library loads, each timed op adds the
// host time of every phase of its body (steady_clock between marks) to a per-process table, which
// is written as JSON to <path>.<pid>.json when the process exits. Unset (the default), a mark is
// one predictable branch. What lies outside the body (Python, the dispatcher, argument boxing) is
// the op's host time minus the phases' sum.
#pragma once
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

namespace deep_ep_ops::phases {

enum Op : int { kLlDispatch, kLlCombine, kLayout, kCachedDispatch, kCombine, kDispatch, kNumOps };
inline constexpr const char* kOpNames[kNumOps] = {"low_latency_dispatch", "low_latency_combine", "get_dispatch_layout", "cached_dispatch",
                                                  "combine", "dispatch"};
inline constexpr int kMaxPhases = 8;

class Table {
 public:
  explicit Table(const char* path) : path_(path) {}
  ~Table() { write(); }
  void add(Op op, int phase, const char* name, uint64_t ns) {
    auto& c = cells_[op][phase];
    c.name.store(name, std::memory_order_relaxed);
    c.ns.fetch_add(ns, std::memory_order_relaxed);
    c.n.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  struct Cell {
    std::atomic<const char*> name{nullptr};
    std::atomic<uint64_t> ns{0}, n{0};
  };
  void write() const {
    const std::string file = path_ + "." + std::to_string(getpid()) + ".json";
    FILE* f = std::fopen(file.c_str(), "w");
    if (f == nullptr) return;
    std::fprintf(f, "{");
    bool first_op = true;
    for (int o = 0; o < kNumOps; ++o) {
      std::fprintf(f, "%s\"%s\": [", first_op ? "" : ", ", kOpNames[o]);
      first_op = false;
      bool first = true;
      for (const auto& c : cells_[o]) {
        const char* name = c.name.load();
        if (name == nullptr) continue;
        std::fprintf(f, "%s[\"%s\", %llu, %llu]", first ? "" : ", ", name, static_cast<unsigned long long>(c.ns.load()),
                     static_cast<unsigned long long>(c.n.load()));
        first = false;
      }
      std::fprintf(f, "]");
    }
    std::fprintf(f, "}\n");
    std::fclose(f);
  }
  std::string path_;
  std::array<std::array<Cell, kMaxPhases>, kNumOps> cells_;
};

// The process's table, or nullptr when DEEP_EP_HOST_PHASES is unset (read once).
// Its destructor (static storage: at exit) writes the file.
inline Table* table() {
  static const std::unique_ptr<Table> t = [] {
    const char* p = std::getenv("DEEP_EP_HOST_PHASES");
    return p != nullptr && *p != '\0' ? std::make_unique<Table>(p) : nullptr;
  }();
  return t.get();
}

// Marks the end of each phase of one op call: `mark(i, "name")` adds the time since the previous
// mark (or construction) to phase i; the destructor adds the rest as phase kMaxPhases - 1 ("return":
// building the outputs' tuple up to the dispatcher).
class Clock {
 public:
  explicit Clock(Op op) : t_(table()), op_(op) {
    if (t_ != nullptr) last_ = now();
  }
  ~Clock() { mark(kMaxPhases - 1, "return"); }
  Clock(const Clock&) = delete;
  Clock& operator=(const Clock&) = delete;
  void mark(int phase, const char* name) {
    if (t_ == nullptr) return;
    const uint64_t t = now();
    t_->add(op_, phase, name, t - last_);
    last_ = t;
  }

 private:
  static uint64_t now() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
  }
  Table* t_;
  Op op_;
  uint64_t last_ = 0;
};

// `c->mark(phase, name)` where a helper shared by a timed op and an untimed one (the split LL
// ops) gets no clock (nullptr).
inline void mark(Clock* c, int phase, const char* name) {
  if (c != nullptr) c->mark(phase, name);
}

}  // namespace deep_ep_ops::phases
