// intranode_check.cu: the check kernel (dek_ic_check): the checks of intranode_check.cuh on their
// own grid, for the ops whose checks are not folded into another kernel (combine, internode).
#include <cstdint>

#include "intranode_check.cuh"

namespace deep_ep {
namespace ic {

__global__ void __launch_bounds__(kCheckThreads) check_inputs(const __grid_constant__ Ctx c, const __grid_constant__ dek_ic_check_args_t a) {
  run_checks(c, a);
}
}  // namespace ic
}  // namespace deep_ep

using namespace deep_ep;
using namespace deep_ep::ic;

extern "C" int dek_ic_check(const dek_ic_ctx_t* ctx, const dek_ic_check_args_t* args, void* stream) {
  if (!ctx_domain_ok(ctx) || args == nullptr || args->num_blocks < 1 || !check_args_ok(ctx, *args)) return cudaErrorInvalidValue;
  check_inputs<<<args->num_blocks, kCheckThreads, 0, as_stream(stream)>>>(*ctx, *args);
  return cudaGetLastError();
}
