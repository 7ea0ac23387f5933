// Dense fp32 products on a CPU through oneDNN, the build inside libtorch, built by models/cpu_kernels.py:
//
//   megacispo::onednn_mm(a [.., m, k], b [.., k, n]) -> [.., m, n]          a @ b
//   megacispo::onednn_addmm_(out [m, n], a [m, k], b [k, n]) -> ()        out += a @ b
//
// torch sends fp32 products to MKL, which runs no AVX-512 code on AMD CPUs: on the Zen 5 VMs of
// this project oneDNN's AVX-512 kernels take the same products at about twice its rate (models/
// matmul.py has the figures). Operands may be contiguous or transposed views (the last two
// dimensions swapped), as the backward passes make them, without a copy; other layouts are copied.
//
// ATen does not install the header of at::native::mkldnn_matmul, so it is declared here; the pinned
// torch exports it. It refuses CPUs without AVX-512 (or AVX-NE-CONVERT): models/matmul.py tries it
// once and runs torch's products on such CPUs.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

namespace at::native {
// result = beta * result + alpha * (mat1 @ mat2), 2-D or batched 3-D.
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result,
                             float beta, float alpha);
}  // namespace at::native

namespace {

void check_operands(const char* op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, op,
              ": a and b must be float32, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.dim() == b.dim() && (a.dim() == 2 || a.dim() == 3), op,
              ": a and b must be both 2-D or both 3-D (batched), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.size(-1) == b.size(-2) && (a.dim() == 2 || a.size(0) == b.size(0)), op,
              ": shapes ", a.sizes(), " and ", b.sizes(), " cannot be multiplied");
}

at::Tensor onednn_mm(const at::Tensor& a, const at::Tensor& b) {
  check_operands("onednn_mm", a, b);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape.back() = b.size(-1);
  // oneDNN has no empty products: k = 0 is a sum of nothing, and no rows or columns nothing to do.
  if (a.size(-1) == 0) {
    return at::zeros(shape, a.options());
  }
  at::Tensor out = at::empty(shape, a.options());
  if (out.numel() > 0) {
    at::native::mkldnn_matmul(a, b, out, /*beta=*/0.0f, /*alpha=*/1.0f);
  }
  return out;
}

void onednn_addmm_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  check_operands("onednn_addmm_", a, b);
  TORCH_CHECK(a.dim() == 2 && out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() &&
                  out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "onednn_addmm_: out must be a contiguous float32 [", a.size(0), ", ", b.size(1), "], got ",
              out.scalar_type(), " ", out.sizes());
  if (out.numel() > 0 && a.size(1) > 0) {
    at::native::mkldnn_matmul(a, b, out, /*beta=*/1.0f, /*alpha=*/1.0f);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megacispo, m) {
  m.def("onednn_mm(Tensor a, Tensor b) -> Tensor");
  m.def("onednn_addmm_(Tensor(a!) out, Tensor a, Tensor b) -> ()");
}

TORCH_LIBRARY_IMPL(megacispo, CPU, m) {
  m.impl("onednn_mm", &onednn_mm);
  m.impl("onednn_addmm_", &onednn_addmm_);
}
