// A C++ MoE communication server step without Python: loads libdeep_ep.so, sets up a buffer
// across processes, runs a normal-mode (HT) dispatch/combine and a low-latency (LL) decode step
// through the libtorch dispatcher, checks both against a reference computed locally, and prints
// timings. On GPUs the LL decode step is captured in a CUDA graph and replayed.
//
// Launch either way:
//   cpp_server --ranks 2                     spawns 2 copies of itself (RANK, WORLD_SIZE set)
//   torchrun-style: RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/MASTER_PORT or DEEP_EP_ID_FILE)
//                   set by the launcher, one process per rank: cpp_server
// Rank 0 creates the unique id (get_unique_id) and publishes it in a file (DEEP_EP_ID_FILE, else
// /tmp/deep_ep_id_<MASTER_ADDR>_<MASTER_PORT>); the others poll it. Library: --lib PATH or
// $DEEP_EP_LIBRARY. Device: cuda:LOCAL_RANK when GPUs are visible, else the CPU backend.
#include <deep_ep.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <thread>

#ifdef DEEP_EP_EXAMPLE_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

struct Args {
  int spawn_ranks = 0, tokens = 64, hidden = 512, topk = 2, experts_per_rank = 4, iters = 5;
  std::string lib;
};

std::string env_or(const char* name, const std::string& dflt) {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}

// Spawns `n` copies of this program with RANK/WORLD_SIZE/LOCAL_RANK/DEEP_EP_ID_FILE set and
// waits for all of them; returns the number of ranks that failed.
int spawn(int n, char** argv) {
  char dir[] = "/tmp/deep_ep_cpp_XXXXXX";
  if (!mkdtemp(dir)) return n;
  const std::string id_file = std::string(dir) + "/unique_id";
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("DEEP_EP_ID_FILE", id_file.c_str(), 1);
      execv("/proc/self/exe", argv);
      std::perror("execv");
      _exit(127);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t p : pids) {
    int status = 0;
    waitpid(p, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::remove(id_file.c_str());
  rmdir(dir);
  return failed;
}

// Rank 0 writes the id (atomically: temp file + rename); the others wait up to 60 s for it.
at::Tensor share_unique_id(int rank, const std::string& path, const std::string& backend, const at::Device& dev) {
  if (rank == 0) {
    at::Tensor id = deep_ep::get_unique_id(backend, dev);
    std::ofstream(path + ".tmp", std::ios::binary).write(static_cast<const char*>(id.data_ptr()), id.numel());
    if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0) throw std::runtime_error("cannot publish " + path);
    return id;
  }
  for (int i = 0; i < 6000; ++i) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      at::Tensor id = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
      std::memcpy(id.data_ptr(), bytes.data(), bytes.size());
      return id;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  throw std::runtime_error("rank " + std::to_string(rank) + ": no unique id in " + path + " after 60 s (is rank 0 running?)");
}

// Inputs of rank `src` (every rank can rebuild every other rank's inputs): small integers, exact
// in bf16, so sums of a few of them are exact too.
at::Tensor make_x(int src, int n, int h) {
  auto t = at::arange(n, at::kLong).unsqueeze(1), c = at::arange(h, at::kLong).unsqueeze(0);
  return ((t * 7 + c + src * 31) % 17 - 8).to(at::kBFloat16);
}

// K distinct experts per token; every fifth token drops its last choice (-1).
at::Tensor make_topk(int src, int n, int k, int e) {
  auto t = at::arange(n, at::kLong).unsqueeze(1), j = at::arange(k, at::kLong).unsqueeze(0);
  auto idx = ((t * 7 + src * 3) % e + j * (e / k)) % e;
  auto drop = ((at::arange(n, at::kLong) + src) % 5 == 0).unsqueeze(1) & (j == k - 1);
  return idx.masked_fill(drop, -1);
}

double time_us(const std::function<void()>& fn, int iters, const std::function<void()>& sync) {
  sync();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  sync();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
}

void require(bool ok, int rank, const std::string& what) {
  if (!ok) throw std::runtime_error("rank " + std::to_string(rank) + ": " + what + " differs from the reference");
}

bool not_implemented(const std::exception& e) { return std::string(e.what()).find("not implemented") != std::string::npos; }

int run_rank(const Args& a) {
  const int rank = std::stoi(env_or("RANK", "0")), world = std::stoi(env_or("WORLD_SIZE", "1"));
  const int local = std::stoi(env_or("LOCAL_RANK", std::to_string(rank)));
  deep_ep::load_library(a.lib);
  const bool gpu = at::hasCUDA() && at::getNumGPUs() > 0;
  const at::Device dev = gpu ? at::Device(at::kCUDA, local % at::getNumGPUs()) : at::Device(at::kCPU);
  const std::string backend = gpu ? "" : "cpu";
  const std::string id_file =
      env_or("DEEP_EP_ID_FILE", "/tmp/deep_ep_id_" + env_or("MASTER_ADDR", "local") + "_" + env_or("MASTER_PORT", "0"));
  auto sync = [&] {
#ifdef DEEP_EP_EXAMPLE_CUDA
    if (gpu) c10::cuda::getCurrentCUDAStream(dev.index()).synchronize();
#endif
  };
#ifdef DEEP_EP_EXAMPLE_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (gpu) guard.emplace(dev.index());
#endif

  const int n = a.tokens, h = a.hidden, k = a.topk, e = a.experts_per_rank * world, el = a.experts_per_rank;
  const auto cfg = deep_ep::default_config(world, false), ccfg = deep_ep::default_config(world, true);
  int64_t nvl = std::max(deep_ep::nvl_buffer_size_hint(cfg, h * 2, world), deep_ep::nvl_buffer_size_hint(ccfg, h * 2, world));
  int64_t rdma = (deep_ep::low_latency_rdma_size_hint(n, h, world, e) + 127) / 128 * 128;
  at::Tensor id = share_unique_id(rank, id_file, backend, dev);
  int64_t buf = deep_ep::create_buffer(id, rank, world, dev, nvl, rdma, /*low_latency_mode=*/true, backend);
  if (rank == 0) std::printf("deep_ep %s, %d ranks on %s\n", deep_ep::build_info().c_str(), world, dev.str().c_str());

  // ---- HT (prefill): dispatch, identity experts, combine ----
  at::Tensor x = make_x(rank, n, h).to(dev), topk = make_topk(rank, n, k, e).to(dev);
  at::Tensor weights = at::full({n, k}, 0.5, at::TensorOptions().dtype(at::kFloat).device(dev));
  at::Tensor per_rank, per_rdma, per_expert, in_rank;
  std::tie(per_rank, per_rdma, per_expert, in_rank) = deep_ep::get_dispatch_layout(topk, e, world);
  auto d = deep_ep::dispatch(buf, x, topk, weights, per_rank, in_rank, per_expert, cfg);
  // Reference: the tokens of every source rank that route to this rank, in (source, token) order.
  std::vector<at::Tensor> want_rows, want_src;
  for (int src = 0; src < world; ++src) {
    auto owner = make_topk(src, n, k, e).div(el, "floor");
    auto hit = (owner == rank).any(1);
    auto idx = hit.nonzero().squeeze(1);
    want_rows.push_back(make_x(src, n, h).index_select(0, idx));
    want_src.push_back(idx.to(at::kInt));
  }
  require(at::equal(d.recv_x.cpu(), at::cat(want_rows)), rank, "HT recv_x");
  require(at::equal(d.handle.recv_src_idx.cpu(), at::cat(want_src)), rank, "HT recv_src_idx");
  at::Tensor combined = std::get<0>(deep_ep::combine(buf, d.recv_x, d.handle, ccfg));
  auto copies = in_rank.sum(1, true).to(at::kFloat);
  require(at::equal(combined.cpu(), (x.to(at::kFloat) * copies).to(at::kBFloat16).cpu()), rank, "HT combined_x");
  double ht_us = time_us(
      [&] {
        auto dd = deep_ep::dispatch(buf, x, topk, weights, per_rank, in_rank, per_expert, cfg);
        deep_ep::combine(buf, dd.recv_x, dd.handle, ccfg);
      },
      a.iters, sync);
  if (rank == 0) std::printf("HT dispatch+combine: ok, %.1f us/iter (%d tokens x %d hidden)\n", ht_us, n, h);

  // ---- LL (decode): dispatch, expert e scales by (e+1), weighted combine ----
  at::Tensor scale = (at::arange(el, at::kFloat) + rank * el + 1).to(dev).view({el, 1, 1});
  at::Tensor out = at::empty({n, h}, x.options());
  auto decode = [&] {
    auto ld = deep_ep::low_latency_dispatch(buf, x, topk, n, e);
    auto y = (ld.recv_x.to(at::kFloat) * scale).to(at::kBFloat16);
    deep_ep::low_latency_combine(buf, y, topk, weights, ld, out, n, e);
  };
  auto gain = (topk.to(at::kFloat) + 1).masked_fill(topk < 0, 0);  // Σ_k w_k (e_k + 1)
  auto want = (x.to(at::kFloat) * (gain * weights).sum(1, true)).to(at::kBFloat16).cpu();
  auto check_ll = [&](const char* what) { require(at::allclose(out.cpu().to(at::kFloat), want.to(at::kFloat), 1e-2, 1e-2), rank, what); };
  try {
    decode();
    check_ll("LL combined (eager)");
    {
      // The real batch as a device tensor (what lets one captured graph serve any batch <= n):
      // rows >= m are not routed and their combined rows are zero.
      const int64_t m = n / 2;
      auto nt = at::full({1}, m, at::TensorOptions().dtype(at::kInt).device(dev));
      auto ld = deep_ep::low_latency_dispatch(buf, x, topk, n, e, false, std::nullopt, nt);
      auto y = (ld.recv_x.to(at::kFloat) * scale).to(at::kBFloat16);
      at::Tensor part = at::full({n, h}, 7.0, x.options());
      deep_ep::low_latency_combine(buf, y, topk, weights, ld, part, n, e, nt);
      auto got = part.cpu().to(at::kFloat);
      require(at::allclose(got.slice(0, 0, m), want.slice(0, 0, m).to(at::kFloat), 1e-2, 1e-2) && got.slice(0, m).eq(0).all().item<bool>(),
              rank, "LL combined with num_tokens");
      if (rank == 0) std::printf("LL decode step with num_tokens=%lld of %d: ok\n", static_cast<long long>(m), n);
    }
    {
      // Single-batch overlap: the send waits for the producer's signals, one per row here
      // (block_m 1), all raised since the producer (the scaling above) has run.
      auto ld = deep_ep::low_latency_dispatch(buf, x, topk, n, e);
      auto y = (ld.recv_x.to(at::kFloat) * scale).to(at::kBFloat16);
      auto sig = at::ones({static_cast<int64_t>(el) * world * n}, at::TensorOptions().dtype(at::kInt).device(dev));
      at::Tensor ov = at::empty({n, h}, x.options());
      deep_ep::low_latency_combine(buf, y, topk, weights, ld, ov, n, e, std::nullopt, sig, /*block_m=*/1, /*threshold=*/1);
      require(at::allclose(ov.cpu().to(at::kFloat), want.to(at::kFloat), 1e-2, 1e-2), rank, "LL combined with overlap signals");
      if (rank == 0) std::printf("LL combine with single-batch-overlap signals: ok\n");
    }
    double eager_us = time_us(decode, a.iters, sync);
    if (rank == 0) std::printf("LL decode step (eager): ok, %.1f us/iter\n", eager_us);
#ifdef DEEP_EP_EXAMPLE_CUDA
    if (gpu) {
      // Capture on a side stream (a graph cannot capture the legacy default stream), then replay.
      auto side = c10::cuda::getStreamFromPool(false, dev.index());
      c10::cuda::CUDAStreamGuard sg(side);
      decode();  // warm-up on the capture stream
      side.synchronize();
      at::cuda::CUDAGraph graph;
      graph.capture_begin();
      decode();
      graph.capture_end();
      out.zero_();
      graph.replay();
      side.synchronize();
      check_ll("LL combined (CUDA graph replay)");
      double graph_us = time_us([&] { graph.replay(); }, a.iters, [&] { side.synchronize(); });
      if (rank == 0) std::printf("LL decode step (CUDA graph replay): ok, %.1f us/iter\n", graph_us);
    }
#endif
  } catch (const std::exception& ex) {
    if (!not_implemented(ex)) throw;
    if (rank == 0) std::printf("LL decode step: skipped, not implemented on this backend yet: %s\n", ex.what());
  }
  deep_ep::destroy_buffer(buf);
  if (rank == 0) std::remove(id_file.c_str());
  std::printf("rank %d: all checks passed\n", rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  a.lib = env_or("DEEP_EP_LIBRARY", "libdeep_ep.so");
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (s == "--ranks") a.spawn_ranks = std::stoi(next());
    else if (s == "--lib") a.lib = next();
    else if (s == "--tokens") a.tokens = std::stoi(next());
    else if (s == "--hidden") a.hidden = std::stoi(next());
    else if (s == "--iters") a.iters = std::stoi(next());
    else {
      std::fprintf(stderr, "usage: %s [--ranks N] [--lib libdeep_ep.so] [--tokens N] [--hidden H] [--iters I]\n", argv[0]);
      return 2;
    }
  }
  if (a.spawn_ranks > 0 && !std::getenv("RANK")) {
    int failed = spawn(a.spawn_ranks, argv);
    if (failed) std::fprintf(stderr, "%d of %d ranks failed\n", failed, a.spawn_ranks);
    return failed ? 1 : 0;
  }
  try {
    return run_rank(a);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "rank %s failed: %s\n", env_or("RANK", "0").c_str(), ex.what());
    return 1;
  }
}
