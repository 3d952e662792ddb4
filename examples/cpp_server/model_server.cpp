// Serves models made in another (Python) process, with no Python here: loads a TorchScript file
// (torch::jit::load) and an AOTInductor package (AOTIModelPackageLoader) written by
// tests/python/_serialized_model.py, creates this process's own deep_ep buffer, binds it to the
// slot the models were made with (slot 0), runs both on the saved inputs and checks the results
// against the saved outputs bit for bit. One rank: CPU backend, or with --device cuda (models made
// with DEEP_EP_MODEL_DEVICE=cuda) a GPU buffer on cuda:0, where the AOTI decode package is also
// captured in a CUDA graph (loaded with run_single_threaded: the package's own run-finished
// event is not capturable) and replayed.
//   model_server --dir DIR --lib target/release/libdeep_ep.so [--device cuda]
#include <deep_ep.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#ifdef DEEP_EP_EXAMPLE_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

bool same(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, const char* what) {
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < got.size(); ++i) ok = got[i].dtype() == want[i].dtype() && at::equal(got[i], want[i]);
  std::printf("%s: %s\n", what, ok ? "bit-exact with the saved outputs" : "DIFFERS from the saved outputs");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a log even if a later step aborts
  std::string dir, lib = "target/release/libdeep_ep.so", device = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--dir")) dir = argv[i + 1];
    if (!std::strcmp(argv[i], "--lib")) lib = argv[i + 1];
    if (!std::strcmp(argv[i], "--device")) device = argv[i + 1];
  }
  if (dir.empty() || (device != "cpu" && device != "cuda")) {
    std::fprintf(stderr, "usage: model_server --dir DIR [--lib libdeep_ep.so] [--device cpu|cuda]\n");
    return 2;
  }
#ifndef DEEP_EP_EXAMPLE_CUDA
  if (device == "cuda") {
    std::fprintf(stderr, "model_server: built without CUDA (CPU-only libtorch or no CUDA runtime headers)\n");
    return 2;
  }
#endif
  deep_ep::load_library(lib);  // registers deep_ep::* before the models are loaded
  const bool gpu = device == "cuda";
  const at::Device dev = gpu ? at::Device("cuda:0") : at::Device("cpu");
  const std::string backend = gpu ? "" : "cpu";  // GPU: DEEP_EP_BACKEND, else nccl
  // The saved inputs and outputs: a scripted module whose forward() returns [num_inputs, *inputs,
  // prefill, decode, num_experts, max_decode_tokens] (examples/export_moe_layer.py SavedIO).
  auto saved = torch::jit::load(dir + "/io_ts.pt").forward({}).toTensorVector();
  const int64_t n_in = saved.at(0).item<int64_t>();
  if (saved.size() != static_cast<size_t>(n_in) + 5) {
    std::fprintf(stderr, "model_server: io_ts.pt holds %zu tensors, expected %lld\n", saved.size(), (long long)n_in + 5);
    return 2;
  }
  std::vector<at::Tensor> args(saved.begin() + 1, saved.begin() + 1 + n_in);
  std::vector<at::Tensor> want = {saved[1 + n_in], saved[2 + n_in]};
  if (args[0].device() != dev) {
    std::fprintf(stderr, "model_server: the models in %s were made on %s, not %s\n", dir.c_str(), args[0].device().str().c_str(), device.c_str());
    return 2;
  }
  const int64_t n = args[0].size(0), hidden = args[0].size(1), experts = saved[3 + n_in].item<int64_t>();
  const int64_t t = saved[4 + n_in].item<int64_t>();

  // This process's buffers: a first one so that handle numbers differ from the maker's, then the
  // one the models use, bound to slot 0.
  const int64_t ll_bytes = deep_ep::op<int64_t(int64_t, int64_t, int64_t, int64_t)>("low_latency_rdma_size_hint").call(t, hidden, 1, experts);
  const int64_t other = deep_ep::create_buffer(deep_ep::get_unique_id(backend, dev), 0, 1, dev, 1 << 20, 0, false, backend);
  const int64_t h = deep_ep::create_buffer(deep_ep::get_unique_id(backend, dev), 0, 1, dev, 1 << 22, ll_bytes, true, backend);
  deep_ep::bind_buffer_slot(h, 0);
  std::printf("buffers %lld and %lld, slot 0 -> %lld; %lld tokens x %lld\n", (long long)other, (long long)h, (long long)h,
              (long long)n, (long long)hidden);

  bool ok = true;
  {
    auto model = torch::jit::load(dir + "/model.pt");
    std::vector<c10::IValue> in(args.begin(), args.end());
    auto out = model.forward(in).toTuple();
    ok &= same({out->elements()[0].toTensor(), out->elements()[1].toTensor()}, want, "TorchScript (torch::jit::load)");
  }
  {
    torch::inductor::AOTIModelPackageLoader loader(dir + "/model_aoti.pt2");
    ok &= same(loader.run(args), want, "AOTInductor package (AOTIModelPackageLoader)");
  }
#ifdef DEEP_EP_EXAMPLE_CUDA
  if (gpu) {
    // The decode step (LL dispatch + combine) as an AOTI package, captured once and replayed: what
    // a decode loop does. Capture on a side stream (not the legacy default stream).
    torch::inductor::AOTIModelPackageLoader decode(dir + "/decode_aoti.pt2", "model", /*run_single_threaded=*/true);
    auto side = c10::cuda::getStreamFromPool(false, dev.index());
    c10::cuda::CUDAStreamGuard sg(side);
    std::vector<at::Tensor> in;
    for (const auto& a : args) in.push_back(a.clone());
    decode.run(in, side.stream());  // warm-up: kernels loaded, allocator pools on this stream
    side.synchronize();
    at::cuda::CUDAGraph graph;
    graph.capture_begin();
    auto out = decode.run(in, side.stream());
    graph.capture_end();
    for (int i = 0; i < 3; ++i) graph.replay();
    side.synchronize();
    ok &= same({out[0]}, {want[1]}, "AOTInductor decode package in a CUDA graph (3 replays)");
  }
#endif
  deep_ep::destroy_buffer(h);
  deep_ep::destroy_buffer(other);
  std::printf("%s\n", ok ? "model_server: all checks passed" : "model_server: FAILED");
  return ok ? 0 : 1;
}
