// megacispo's CPU kernels put into torch's dispatch, at the CPU key; built by parallel/cpu/kernels.py
// and switched on by megacispo.parallel.cpu.enable() (megacispo::enable_cpu_kernels):
//
// - the fp32 CPU kernels of the model's decode-step ops megacispo::decode_experts and
//   megacispo::rms_norm (cpu_decode.cpp); other dtypes run the ops' own torch implementations;
// - torch's fp32 CPU products (aten::mm, addmm, addmm_, bmm) replaced by faster kernels for the
//   shapes this project multiplies:
//
//   - 1 to 16 rows times a weight (a @ weight.T, weight contiguous [n, k]): cpu_decode.cpp's
//     few_rows_product, which reads each weight row once for all the rows. A decode step's
//     products are bound by reading the weights, which MKL reads at 5-15 GB/s for so few rows.
//   - One row per batch entry (bmm [B, 1, k] x [B, k, n], lightning attention's q_t S_t in a decode
//     step): a broadcast product summed over k. MKL runs these B tiny GEMMs over its threads, which
//     wait for each other (milliseconds a call) when another process holds a core.
//   - Everything else in fp32 with contiguous or transposed operands: oneDNN (torch's own build of
//     it), where it takes fp32, i.e. on CPUs with AVX-512. MKL runs no AVX-512 code on AMD CPUs;
//     oneDNN multiplied about twice as fast on this project's 2-core AMD EPYC VM (docs/guides/cpu.md).
//   - All the rest (other dtypes, other layouts, empty products): torch's own CPU kernels.
//
// The out= form of mm, which torch.compile's graphs call, takes the same kernels.
//
// Model code therefore multiplies with `@`, F.linear and Megatron's linears, unchanged, on every
// device; their autograd formulas call these ops too, so backward passes take the same kernels.
// The sums are the same products in another order: results agree with torch's to fp32 rounding.
//
// ATen does not install the header of at::native::mkldnn_matmul, so it is declared here; the pinned
// torch exports it.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <optional>

namespace at::native {
// result = beta * result + alpha * (mat1 @ mat2), 2-D or batched 3-D.
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result,
                             float beta, float alpha);
}  // namespace at::native

namespace megacispo {
// cpu_decode.cpp: rows [m, k] (m <= kFewRows) x weight [n, k]^T -> [m, n], and the model ops' fp32
// kernels.
at::Tensor few_rows_product(const at::Tensor& rows, const at::Tensor& weight);
void few_rows_product_into(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& out);
extern const int64_t kFewRows;
at::Tensor decode_experts_kernel(const at::Tensor& tokens, const at::Tensor& probs, const at::Tensor& top_experts,
                                 at::TensorList fc1_weights, at::TensorList fc2_weights, double residual_scale,
                                 double update_scale);
at::Tensor rms_norm_kernel(const at::Tensor& rows, const at::Tensor& weight, double eps);
}  // namespace megacispo

namespace {

bool onednn_enabled = false;
std::unique_ptr<torch::Library> product_kernels;
std::unique_ptr<torch::Library> model_op_kernels;

bool fp32(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat;
}

// oneDNN reads a contiguous operand or a transposed view (the last two dimensions swapped) as it is.
bool plain_or_transposed(const at::Tensor& t) {
  return t.is_contiguous() || t.transpose(-1, -2).is_contiguous();
}

bool few_rows_take(const at::Tensor& a, const at::Tensor& b) {
  return fp32(a, b) && a.size(0) >= 1 && a.size(0) <= megacispo::kFewRows && a.size(1) > 0 &&
         b.t().is_contiguous();
}

// Not for empty products: oneDNN has none (k = 0 is a sum of nothing).
bool onednn_takes(const at::Tensor& a, const at::Tensor& b) {
  return onednn_enabled && fp32(a, b) && a.numel() > 0 && b.numel() > 0 && plain_or_transposed(a) &&
         plain_or_transposed(b);
}

at::Tensor onednn_product(const at::Tensor& a, const at::Tensor& b) {
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape.back() = b.size(-1);
  at::Tensor out = at::empty(shape, a.options());
  at::native::mkldnn_matmul(a, b, out, /*beta=*/0.0f, /*alpha=*/1.0f);
  return out;
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (few_rows_take(a, b)) {
    return megacispo::few_rows_product(a.contiguous(), b.t());
  }
  if (onednn_takes(a, b)) {
    return onednn_product(a, b);
  }
  return at::cpu::mm(a, b);
}

// torch.compile's graphs call the out= form (inductor's extern_kernels.mm), with a buffer of the
// product's shape: written in place.
at::Tensor& mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const bool few_rows = few_rows_take(a, b);
  if (!few_rows && !onednn_takes(a, b)) {
    return at::cpu::mm_out(out, a, b);
  }
  out.resize_({a.size(0), b.size(1)});
  if (out.scalar_type() != at::kFloat || !out.is_contiguous()) {
    return out.copy_(mm(a, b));
  }
  if (few_rows) {
    megacispo::few_rows_product_into(a.contiguous(), b.t(), out);
  } else {
    at::native::mkldnn_matmul(a, b, out, /*beta=*/0.0f, /*alpha=*/1.0f);
  }
  return out;
}

at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  if (fp32(a, b) && a.size(1) == 1) {
    return a.transpose(1, 2).mul(b).sum(1, /*keepdim=*/true);
  }
  if (onednn_takes(a, b)) {
    return onednn_product(a, b);
  }
  return at::cpu::bmm(a, b);
}

// In place into a contiguous fp32 output (the fused LM head's hand-written backward accumulates
// its gradient tiles so); oneDNN applies beta and alpha itself.
at::Tensor& addmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  if (onednn_takes(a, b) && self.scalar_type() == at::kFloat && self.is_contiguous() && self.dim() == 2) {
    at::native::mkldnn_matmul(a, b, self, beta.to<float>(), alpha.to<float>());
    return self;
  }
  return at::cpu::addmm_(self, a, b, beta, alpha);
}

at::Tensor addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  // A decode step's output projections add the residual in the product (models/layers.py's
  // row_parallel_step): the few-rows product, then the two scalings; a beta of 0 reads no input.
  if (few_rows_take(a, b) && self.scalar_type() == at::kFloat) {
    at::Tensor out = megacispo::few_rows_product(a.contiguous(), b.t());
    if (alpha.to<double>() != 1.0) out.mul_(alpha);
    if (beta.to<double>() != 0.0) out.add_(self.expand_as(out), beta);
    return out;
  }
  if (onednn_takes(a, b) && self.scalar_type() == at::kFloat) {
    at::Tensor out = self.expand({a.size(0), b.size(1)}).contiguous();
    at::native::mkldnn_matmul(a, b, out, beta.to<float>(), alpha.to<float>());
    return out;
  }
  return at::cpu::addmm(self, a, b, beta, alpha);
}

// oneDNN refuses fp32 products on CPUs without AVX-512 (or AVX-NE-CONVERT): tried once on small
// integers, exact in any order.
bool onednn_takes_fp32() {
  at::Tensor a = at::arange(12, at::kFloat).view({3, 4});
  try {
    at::Tensor product = onednn_product(a, a.t());
    return product.equal(at::cpu::mm(a, a.t()));
  } catch (const c10::Error&) {
    return false;
  }
}

// An op's own torch implementation, registered by models/ as its CompositeExplicitAutograd kernel:
// what its CPU kernel falls back to for the dtypes the C++ kernels do not take.
at::Tensor torch_implementation(const char* name, torch::jit::Stack stack) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, stack);
  return stack.back().toTensor();
}

// fc1_weight [E, 2F, H] and fc2_weight [E, H, F]: the experts' stacked weights.
at::Tensor decode_experts(const at::Tensor& tokens, const at::Tensor& probs, const at::Tensor& top_experts,
                          const at::Tensor& fc1_weight, const at::Tensor& fc2_weight, double residual_scale,
                          double update_scale) {
  if (tokens.scalar_type() == at::kFloat && probs.scalar_type() == at::kFloat) {
    return megacispo::decode_experts_kernel(tokens, probs, top_experts, fc1_weight.unbind(0), fc2_weight.unbind(0),
                                            residual_scale, update_scale);
  }
  return torch_implementation("megacispo::decode_experts",
                              {tokens, probs, top_experts, fc1_weight, fc2_weight, residual_scale, update_scale});
}

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  if (hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && hidden.dim() == 2) {
    return megacispo::rms_norm_kernel(hidden, weight, eps);
  }
  return torch_implementation("megacispo::rms_norm", {hidden, weight, eps});
}

// Overriding aten's CPU kernels is what this is for: torch's one-time warning about it says
// nothing the user can act on.
class QuietWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

// Returns whether the dense products run on oneDNN.
bool enable_cpu_kernels() {
  if (!model_op_kernels) {
    model_op_kernels = std::make_unique<torch::Library>(
        torch::Library::IMPL, "megacispo", std::make_optional(c10::DispatchKey::CPU), __FILE__, __LINE__);
    model_op_kernels->impl("decode_experts", &decode_experts);
    model_op_kernels->impl("rms_norm", &rms_norm);
  }
  if (!product_kernels) {
    onednn_enabled = onednn_takes_fp32();
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    product_kernels = std::make_unique<torch::Library>(
        torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::CPU), __FILE__, __LINE__);
    product_kernels->impl("mm", &mm);
    product_kernels->impl("mm.out", &mm_out);
    product_kernels->impl("bmm", &bmm);
    product_kernels->impl("addmm", &addmm);
    product_kernels->impl("addmm_", &addmm_);
  }
  return onednn_enabled;
}

// torch's own products again (a benchmark's peer runs on them); the model ops keep their kernels.
void disable_cpu_products() { product_kernels.reset(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(megacispo, m) {
  m.def("enable_cpu_kernels() -> bool", &enable_cpu_kernels);
  m.def("disable_cpu_products() -> ()", &disable_cpu_products);
}
