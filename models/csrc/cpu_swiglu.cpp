// The experts' SwiGLU for training on a CPU (fp32, AVX2 + FMA), built by models/cpu_kernels.py:
//
//   megacispo::swiglu_forward(projected [m, 2F], probs [m]) -> weighted [m, F]
//       weighted = silu(gate) * up * p, with projected = [gate | up] (fc1's output, Megatron's layout)
//   megacispo::swiglu_backward(grad_weighted [m, F], projected [m, 2F], probs [m])
//       -> (grad_projected [m, 2F], grad_probs [m])
//
// One pass over the rows each way, where autograd runs silu, two products and the split of fc1's
// output, then their backward passes and a cat. The forward computes each element as torch's
// silu and products do, in their order (silu = x / (1 + exp(-x)), with SLEEF's exp where ATen's
// loops use SIMD and std::exp where they don't), then times up, then times p.

// ATen's SIMD vectors for AVX2 in this translation unit (the flags in cpu_kernels.py allow them).
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;

// Rows per task: a row is 2F floats, a few microseconds of work.
constexpr int64_t kGrainRows = 16;

// Floats in two of the SIMD vectors that torch's own elementwise kernels use on this CPU.
const int64_t kTorchSimdPair = at::get_cpu_capability() == "AVX512" ? 32 : 16;

void check_inputs(const char* op, const at::Tensor& projected, const at::Tensor& probs) {
  TORCH_CHECK(projected.scalar_type() == at::kFloat && probs.scalar_type() == at::kFloat, op,
              ": projected and probs must be float32, got ", projected.scalar_type(), " and ", probs.scalar_type());
  TORCH_CHECK(projected.dim() == 2 && projected.size(1) % 2 == 0 && projected.is_contiguous(), op,
              ": projected must be a contiguous [m, 2F] ([gate | up]), got ", projected.sizes());
  TORCH_CHECK(probs.dim() == 1 && probs.size(0) == projected.size(0) && probs.is_contiguous(), op,
              ": probs must be a contiguous [m] for projected ", projected.sizes(), ", got ", probs.sizes());
}

at::Tensor swiglu_forward(const at::Tensor& projected, const at::Tensor& probs) {
  check_inputs("swiglu_forward", projected, probs);
  const int64_t rows = projected.size(0), ffn = projected.size(1) / 2;
  at::Tensor weighted = at::empty({rows, ffn}, projected.options());
  const float* x = projected.data_ptr<float>();
  const float* p = probs.data_ptr<float>();
  float* out = weighted.data_ptr<float>();
  // torch's silu runs SIMD over whole pairs of its vectors and the rest of a row without (ATen's
  // vectorized_loop); SLEEF's exp gives the same bits at either vector width.
  const int64_t vectorized = ffn - ffn % kTorchSimdPair;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = x + row * 2 * ffn;
      const float* up = gate + ffn;
      float* o = out + row * ffn;
      const Vec prob(p[row]);
      int64_t f = 0;
      for (; f < vectorized; f += Vec::size()) {
        const Vec g = Vec::loadu(gate + f);
        ((g / (one + g.neg().exp())) * Vec::loadu(up + f) * prob).store(o + f);
      }
      for (; f < ffn; ++f) o[f] = gate[f] / (1.0f + std::exp(-gate[f])) * up[f] * p[row];
    }
  });
  return weighted;
}

// With s = sigmoid(gate), silu = gate * s, t = silu * up and weighted = t * p:
//   grad_t = g p,  grad_p = sum_f g t,  grad_up = grad_t silu,  grad_gate = grad_t up s (1 + gate (1 - s)).
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_weighted, const at::Tensor& projected,
                                                    const at::Tensor& probs) {
  check_inputs("swiglu_backward", projected, probs);
  const int64_t rows = projected.size(0), ffn = projected.size(1) / 2;
  TORCH_CHECK(grad_weighted.scalar_type() == at::kFloat && grad_weighted.is_contiguous() &&
                  grad_weighted.dim() == 2 && grad_weighted.size(0) == rows && grad_weighted.size(1) == ffn,
              "swiglu_backward: grad_weighted must be a contiguous float32 [", rows, ", ", ffn, "], got ",
              grad_weighted.scalar_type(), " ", grad_weighted.sizes());
  at::Tensor grad_projected = at::empty({rows, 2 * ffn}, projected.options());
  at::Tensor grad_probs = at::empty({rows}, probs.options());
  const float* x = projected.data_ptr<float>();
  const float* p = probs.data_ptr<float>();
  const float* g = grad_weighted.data_ptr<float>();
  float* gx = grad_projected.data_ptr<float>();
  float* gp = grad_probs.data_ptr<float>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = x + row * 2 * ffn;
      const float* up = gate + ffn;
      const float* grad = g + row * ffn;
      float* grad_gate = gx + row * 2 * ffn;
      float* grad_up = grad_gate + ffn;
      const Vec prob(p[row]);
      Vec grad_prob_lanes(0.0f);
      int64_t f = 0;
      for (; f + Vec::size() <= ffn; f += Vec::size()) {
        const Vec x_vec = Vec::loadu(gate + f), up_vec = Vec::loadu(up + f), grad_vec = Vec::loadu(grad + f);
        const Vec denominator = one + x_vec.neg().exp();
        const Vec sigmoid = one / denominator, silu = x_vec / denominator;
        const Vec grad_t = grad_vec * prob;
        grad_prob_lanes = at::vec::fmadd(grad_vec, silu * up_vec, grad_prob_lanes);
        (grad_t * silu).store(grad_up + f);
        (grad_t * up_vec * sigmoid * (one + x_vec * (one - sigmoid))).store(grad_gate + f);
      }
      float grad_prob = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, grad_prob_lanes);
      for (; f < ffn; ++f) {
        const float denominator = 1.0f + std::exp(-gate[f]);
        const float sigmoid = 1.0f / denominator, silu = gate[f] / denominator;
        const float grad_t = grad[f] * p[row];
        grad_prob += grad[f] * (silu * up[f]);
        grad_up[f] = grad_t * silu;
        grad_gate[f] = grad_t * up[f] * sigmoid * (1.0f + gate[f] * (1.0f - sigmoid));
      }
      gp[row] = grad_prob;
    }
  });
  return {grad_projected, grad_probs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megacispo, m) {
  m.def("swiglu_forward(Tensor projected, Tensor probs) -> Tensor");
  m.def("swiglu_backward(Tensor grad_weighted, Tensor projected, Tensor probs) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megacispo, CPU, m) {
  m.impl("swiglu_forward", &swiglu_forward);
  m.impl("swiglu_backward", &swiglu_backward);
}
