// The CPU decode step's kernels (fp32, AVX2 + FMA), built by parallel/cpu/kernels.py:
//
//   megacispo::few_rows_product(rows [m, K], weight [N, K]) -> [m, N]   rows @ weight.T, m <= 16
//       (few_rows_product_into: into a given out);
//       cpu_gemm.cpp sends torch's products of so few rows here
//   decode_experts(tokens [b, H], probs [b, k], top_experts [b, k], fc1_weights, fc2_weights,
//                  residual_scale, update_scale) -> [b, H]
//       one MoE layer's routed experts with the residual: the fp32 CPU kernel of models/experts.py's op
//       megacispo::decode_experts
//   rms_norm_rows(rows [m, C], weight [C], eps) -> [m, C]: the fp32 CPU kernel of models/layers.py's
//       op megacispo::rms_norm
//
// cpu_gemm.cpp registers them (megacispo::enable_cpu_kernels); other dtypes run the ops' own torch
// implementations.
//
// A decode step's products have few rows and are bound by reading the weights, which MKL's sgemm
// reads at 5-15 GB/s for 2 to 16 rows on the AMD CPUs we measured (its packing and blocking are
// built for many rows). Here each weight row is read once, 8 floats at a time, each 8 multiplied
// with up to 8 rows while they are in a register (eight AVX2 accumulators), the rows staying in
// L1, the weight prefetched a few rows ahead. The output rows are shared out among torch's OpenMP
// threads.
//
// Each output is the same float sum whatever the number of rows and however the threads split the
// work: eight lanes over k in steps of 8, the lanes added as in hsum, then the k % 8 tail in order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kRowTile = 8;
// Weight rows per thread at least: a smaller weight is not worth waking a second thread.
constexpr int64_t kGrainRows = 32;
// Floats ahead of the current weight row to prefetch (4 KB): the hardware prefetcher alone left
// the step's short weight streams at about half the machine's read bandwidth.
constexpr int64_t kPrefetchFloats = 1024;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r, j] = x[r] . weight[j] for the ROWS rows of x and the weight rows j in [j_begin, j_end).
// One weight row at a time against up to 8 rows: more weight rows per step (2 or 4, fewer rows)
// read the weight 1.3 to 2x slower for 2 to 16 rows, measured. The r loops are unrolled so that
// the accumulators stay in registers (rolled, they spill to the stack at every step).
template <int ROWS>
void dot_tile(const float* x, const float* weight, float* out, int64_t in_features, int64_t out_features,
              int64_t j_begin, int64_t j_end) {
  for (int64_t j = j_begin; j < j_end; ++j) {
    const float* w = weight + j * in_features;
    __m256 acc[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= in_features; k += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetchFloats), _MM_HINT_T0);
      const __m256 wk = _mm256_loadu_ps(w + k);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + r * in_features + k), acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const float* xr = x + r * in_features;
      float sum = hsum(acc[r]);
      for (int64_t t = k; t < in_features; ++t) sum += w[t] * xr[t];
      out[r * out_features + j] = sum;
    }
  }
}

// out [num_rows, out_features] columns [j_begin, j_end) = x [num_rows, in_features] weight[j]^T.
void dot_rows(const float* x, int64_t num_rows, const float* weight, float* out, int64_t in_features,
              int64_t out_features, int64_t j_begin, int64_t j_end) {
  int64_t r = 0;
  for (; r + kRowTile <= num_rows; r += kRowTile) {
    dot_tile<kRowTile>(x + r * in_features, weight, out + r * out_features, in_features, out_features, j_begin, j_end);
  }
  x += r * in_features;
  out += r * out_features;
  switch (num_rows - r) {
    case 7: dot_tile<7>(x, weight, out, in_features, out_features, j_begin, j_end); break;
    case 6: dot_tile<6>(x, weight, out, in_features, out_features, j_begin, j_end); break;
    case 5: dot_tile<5>(x, weight, out, in_features, out_features, j_begin, j_end); break;
    case 4: dot_tile<4>(x, weight, out, in_features, out_features, j_begin, j_end); break;
    case 3: dot_tile<3>(x, weight, out, in_features, out_features, j_begin, j_end); break;
    case 2: dot_tile<2>(x, weight, out, in_features, out_features, j_begin, j_end); break;
    case 1: dot_tile<1>(x, weight, out, in_features, out_features, j_begin, j_end); break;
    default: break;
  }
}

void check_fp32_contiguous(const at::Tensor& tensor, const char* op, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kFloat && tensor.is_contiguous() && tensor.device().is_cpu(), op,
              ": ", name, " must be a contiguous fp32 CPU tensor, got ", tensor.scalar_type(), " ", tensor.sizes(),
              " strides ", tensor.strides());
}

// The products of the experts that have rows, in one parallel region: expert e multiplies its
// rows (from rows + offset[e] * in_features) with weights[e] [out_features, in_features] into
// out + offset[e] * out_features. The threads share out the weight rows of all these experts.
void expert_products(const std::vector<int64_t>& experts, const std::vector<int64_t>& offsets,
                     const std::vector<int64_t>& counts, at::TensorList weights, const float* rows, float* out,
                     int64_t in_features, int64_t out_features) {
  const int64_t total = static_cast<int64_t>(experts.size()) * out_features;
  at::parallel_for(0, total, kGrainRows, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t slot = begin / out_features, j_begin = begin - slot * out_features;
      const int64_t j_end = std::min(end - slot * out_features, out_features);
      const int64_t e = experts[slot];
      dot_rows(rows + offsets[e] * in_features, counts[e], weights[e].data_ptr<float>(),
               out + offsets[e] * out_features, in_features, out_features, j_begin, j_end);
      begin = slot * out_features + j_end;
    }
  });
}

// What models/experts.py's decode_experts computes: each token's k experts
//   out_e = (silu(x W_gate^T) * (x W_up^T) * p_e) W_2^T,   fc1_weights[e] = [W_gate; W_up] [2F, H],
// fc2_weights[e] = W_2 [H, F], summed per token in ascending expert order onto zero (Megatron's
// expert-major rows, token order within an expert, then index_add_); then
// update_scale * that + residual_scale * x, the residual around the MoE.
at::Tensor decode_experts(const at::Tensor& tokens, const at::Tensor& probs, const at::Tensor& top_experts,
                          at::TensorList fc1_weights, at::TensorList fc2_weights, double residual_scale,
                          double update_scale) {
  const char* op = "decode_experts";
  check_fp32_contiguous(tokens, op, "tokens");
  check_fp32_contiguous(probs, op, "probs");
  TORCH_CHECK(top_experts.scalar_type() == at::kLong && top_experts.is_contiguous() && top_experts.dim() == 2 &&
                  tokens.dim() == 2 && probs.sizes() == top_experts.sizes() && probs.size(0) == tokens.size(0),
              op, ": tokens [b, H], probs and top_experts [b, k] (int64), got ", tokens.sizes(), ", ", probs.sizes(),
              ", ", top_experts.sizes(), " ", top_experts.scalar_type());
  const int64_t num_experts = static_cast<int64_t>(fc1_weights.size());
  TORCH_CHECK(num_experts > 0 && static_cast<int64_t>(fc2_weights.size()) == num_experts, op,
              ": as many fc2 as fc1 weights, got ", fc1_weights.size(), " and ", fc2_weights.size());
  const int64_t batch = tokens.size(0), hidden = tokens.size(1), topk = top_experts.size(1);
  const int64_t ffn = fc2_weights[0].size(1);
  for (int64_t e = 0; e < num_experts; ++e) {
    check_fp32_contiguous(fc1_weights[e], op, "fc1 weight");
    check_fp32_contiguous(fc2_weights[e], op, "fc2 weight");
    TORCH_CHECK(fc1_weights[e].sizes() == at::IntArrayRef({2 * ffn, hidden}) &&
                    fc2_weights[e].sizes() == at::IntArrayRef({hidden, ffn}),
                op, ": expert ", e, " weights ", fc1_weights[e].sizes(), " and ", fc2_weights[e].sizes(),
                ", expected [", 2 * ffn, ", ", hidden, "] and [", hidden, ", ", ffn, "]");
  }

  // Rows in Megatron's order: by expert, then by token (a token's k experts are distinct).
  const int64_t* chosen = top_experts.data_ptr<int64_t>();
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t i = 0; i < batch * topk; ++i) {
    TORCH_CHECK(chosen[i] >= 0 && chosen[i] < num_experts, op, ": expert id ", chosen[i], " outside [0, ",
                num_experts, ")");
    ++counts[chosen[i]];
  }
  std::vector<int64_t> offsets(num_experts, 0), experts;
  for (int64_t e = 0, offset = 0; e < num_experts; offset += counts[e], ++e) {
    offsets[e] = offset;
    if (counts[e] > 0) experts.push_back(e);
  }
  const int64_t num_rows = batch * topk;
  std::vector<int64_t> row_token(num_rows);
  std::vector<float> row_prob(num_rows);
  std::vector<int64_t> filled(offsets);
  at::Tensor rows = at::empty({num_rows, hidden}, tokens.options());
  const float* x = tokens.data_ptr<float>();
  const float* p = probs.data_ptr<float>();
  float* gathered = rows.data_ptr<float>();
  for (int64_t t = 0; t < batch; ++t) {
    for (int64_t s = 0; s < topk; ++s) {
      const int64_t row = filled[chosen[t * topk + s]]++;
      row_token[row] = t;
      row_prob[row] = p[t * topk + s];
      std::copy(x + t * hidden, x + (t + 1) * hidden, gathered + row * hidden);
    }
  }

  at::Tensor fc1_out = at::empty({num_rows, 2 * ffn}, tokens.options());
  expert_products(experts, offsets, counts, fc1_weights, gathered, fc1_out.data_ptr<float>(), hidden, 2 * ffn);
  at::Tensor intermediate = at::empty({num_rows, ffn}, tokens.options());
  const float* gate_up = fc1_out.data_ptr<float>();
  float* act = intermediate.data_ptr<float>();
  for (int64_t row = 0; row < num_rows; ++row) {
    const float* gate = gate_up + row * 2 * ffn;
    const float* up = gate + ffn;
    for (int64_t f = 0; f < ffn; ++f) {
      const float silu = gate[f] / (1.0f + std::exp(-gate[f]));
      act[row * ffn + f] = silu * up[f] * row_prob[row];
    }
  }
  at::Tensor expert_out = at::empty({num_rows, hidden}, tokens.options());
  expert_products(experts, offsets, counts, fc2_weights, act, expert_out.data_ptr<float>(), ffn, hidden);

  at::Tensor out = at::zeros({batch, hidden}, tokens.options());
  float* o = out.data_ptr<float>();
  const float* y = expert_out.data_ptr<float>();
  for (int64_t row = 0; row < num_rows; ++row) {
    float* target = o + row_token[row] * hidden;
    for (int64_t h = 0; h < hidden; ++h) target[h] += y[row * hidden + h];
  }
  const float residual = static_cast<float>(residual_scale), update = static_cast<float>(update_scale);
  for (int64_t i = 0; i < batch * hidden; ++i) {
    // A residual factor of 0 reads no token, as torch's baddbmm with beta 0.
    o[i] = residual == 0.0f ? update * o[i] : update * o[i] + residual * x[i];
  }
  return out;
}

// weight * (x * (1 / sqrt(sum(x^2) / C + eps))) per row, as models/layers.py's rms_norm computes it,
// in one call where torch runs eight ops (about 9 us a norm, 24 norms a decode step of the small
// model); the sum of squares in the order of the dot products above.
at::Tensor rms_norm_rows(const at::Tensor& rows, const at::Tensor& weight, double eps) {
  check_fp32_contiguous(rows, "rms_norm_rows", "rows");
  check_fp32_contiguous(weight, "rms_norm_rows", "weight");
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 1 && rows.size(1) == weight.size(0),
              "rms_norm_rows: rows [m, C] and weight [C], got ", rows.sizes(), " and ", weight.sizes());
  const int64_t num_rows = rows.size(0), channels = rows.size(1);
  at::Tensor out = at::empty_like(rows);
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* x = rows.data_ptr<float>() + r * channels;
    float* o = out.data_ptr<float>() + r * channels;
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= channels; c += 8) {
      const __m256 xc = _mm256_loadu_ps(x + c);
      acc = _mm256_fmadd_ps(xc, xc, acc);
    }
    float sum_squares = hsum(acc);
    for (int64_t t = c; t < channels; ++t) sum_squares += x[t] * x[t];
    const float inverse_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(channels) + static_cast<float>(eps));
    for (int64_t t = 0; t < channels; ++t) o[t] = w[t] * (x[t] * inverse_rms);
  }
  return out;
}

}  // namespace

namespace megacispo {

// The most rows few_rows_product takes; cpu_gemm.cpp sends it products of this many rows or fewer.
extern const int64_t kFewRows = 16;

// Into out, a contiguous fp32 [m, N] (torch.compile's graphs hand over their own buffer).
void few_rows_product_into(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& out) {
  check_fp32_contiguous(rows, "few_rows_product", "rows");
  check_fp32_contiguous(weight, "few_rows_product", "weight");
  check_fp32_contiguous(out, "few_rows_product", "out");
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 2 && rows.size(1) == weight.size(1),
              "few_rows_product: rows [m, K] and weight [N, K], got ", rows.sizes(), " and ", weight.sizes());
  const int64_t num_rows = rows.size(0), in_features = rows.size(1), out_features = weight.size(0);
  TORCH_CHECK(num_rows >= 1 && num_rows <= kFewRows, "few_rows_product: 1 to ", kFewRows, " rows, got ", num_rows);
  TORCH_CHECK(out.sizes() == at::IntArrayRef({num_rows, out_features}), "few_rows_product: out must be [",
              num_rows, ", ", out_features, "], got ", out.sizes());
  const float* x = rows.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out_features, kGrainRows, [&](int64_t j_begin, int64_t j_end) {
    dot_rows(x, num_rows, w, o, in_features, out_features, j_begin, j_end);
  });
}

at::Tensor few_rows_product(const at::Tensor& rows, const at::Tensor& weight) {
  at::Tensor out = at::empty({rows.size(0), weight.size(0)}, rows.options());
  few_rows_product_into(rows, weight, out);
  return out;
}

at::Tensor decode_experts_kernel(const at::Tensor& tokens, const at::Tensor& probs, const at::Tensor& top_experts,
                                 at::TensorList fc1_weights, at::TensorList fc2_weights, double residual_scale,
                                 double update_scale) {
  return decode_experts(tokens.contiguous(), probs, top_experts, fc1_weights, fc2_weights, residual_scale,
                        update_scale);
}

at::Tensor rms_norm_kernel(const at::Tensor& rows, const at::Tensor& weight, double eps) {
  return rms_norm_rows(rows.contiguous(), weight, eps);
}

}  // namespace megacispo

