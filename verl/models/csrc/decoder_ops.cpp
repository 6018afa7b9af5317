// The small operations of a Llama-family decoder layer, fused, on CPU, fp32: RMSNorm (with the residual add before
// it), rotary position embedding in place, and SiLU(gate) * up in place (verl/models/fused_decoder.py calls them in
// generation forwards; verl/models/cpu_kernels.py builds them).
//
// Why hand-written: in Hugging Face's layers each of these is 3-8 tensor ops (RMSNorm: pow, mean, add, rsqrt, two
// products; RoPE: four products, two sums, two concatenations of negated halves), each a pass over the activations
// plus a dispatch. At a decode step's 16 rows those are all dispatch: ~5 ms of a 45 ms SmolLM2 step (30 layers,
// one thread, measured). Here each is one pass.
//
// Shapes: x, residual (..., hidden) contiguous; weight (hidden); q (B, T, H, D), k (B, T, Hkv, D) contiguous; cos,
// sin (B or 1, T, D) as the model's rotary embedding returns them; gate, up (..., intermediate) contiguous.
#include <torch/extension.h>
#include <cmath>
#include <cstdint>

#include "vec_math.h"

// y = weight * (x * rsqrt(mean(x^2) + eps)) for one row, the products in Hugging Face's order.
static inline void rms_norm_row(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < H; ++j) ss += x[j] * x[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) y[j] = w[j] * (x[j] * r);
}

static void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, name, ": fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0), name,
              ": x (..., hidden) contiguous, weight (hidden)");
}

// RMSNorm of x (..., hidden): a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto y = torch::empty_like(x);
  const int64_t H = x.size(-1), N = x.numel() / H;
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) rms_norm_row(xp + n * H, wp, yp + n * H, H, static_cast<float>(eps));
  return y;
}

// x += residual (in place: x becomes the layer's new residual stream), then returns RMSNorm(x).
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, weight, "add_rms_norm_");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.sizes() == x.sizes(),
              "add_rms_norm_: residual must be a contiguous fp32 tensor of x's shape");
  auto y = torch::empty_like(x);
  const int64_t H = x.size(-1), N = x.numel() / H;
  float* xp = x.data_ptr<float>();
  const float *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* row = xp + n * H;
    const float* res = rp + n * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) row[j] = res[j] + row[j];  // residual + x, Hugging Face's order
    rms_norm_row(row, wp, yp + n * H, H, static_cast<float>(eps));
  }
  return y;
}

// For each of `heads` heads of x (head h at x + h * x_head_stride), into out (contiguous heads; may be x itself):
// forward, out[i] = x[i] * cos[i] - x[i + D/2] * sin[i] and out[i + D/2] = x[i + D/2] * cos[i + D/2] + x[i] *
// sin[i + D/2] — Hugging Face's q * cos + rotate_half(q) * sin; transpose (the backward of that, for a gradient x),
// out[i] = x[i] * cos[i] + x[i + D/2] * sin[i + D/2] and out[i + D/2] = x[i + D/2] * cos[i + D/2] - x[i] * sin[i].
// Each product is rounded before the sum (no fused multiply-add), so the bits are those of Hugging Face's ops
// (autograd's, for the transpose). Each element reads only its own index pair, so out may alias x.
__attribute__((optimize("fp-contract=off")))
static void rope_rows(const float* x, float* out, int64_t heads, int64_t x_head_stride, int64_t D,
                      const float* __restrict__ c, const float* __restrict__ s, bool transpose) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* a = x + h * x_head_stride;
    const float* b = a + half;
    float* oa = out + h * D;
    float* ob = oa + half;
    if (!transpose) {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = a[i], x2 = b[i];
        const float p = x1 * c[i], q = x2 * s[i];
        const float r = x2 * c[i + half], t = x1 * s[i + half];
        oa[i] = p - q;
        ob[i] = r + t;
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float g1 = a[i], g2 = b[i];
        const float p = g1 * c[i], q = g2 * s[i + half];
        const float r = g2 * c[i + half], t = g1 * s[i];
        oa[i] = p + q;
        ob[i] = r - t;
      }
    }
  }
}

// Rotary embedding applied in place to q (B, T, H, D) and k (B, T, Hkv, D) with cos, sin (B or 1, T, D).
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (const auto* t : {&q, &k, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "rope_: contiguous fp32 tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes(), "rope_: shapes");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == T && k.size(3) == D && D % 2 == 0 && cos.size(1) == T &&
                  cos.size(2) == D && (cos.size(0) == B || cos.size(0) == 1),
              "rope_: q (B, T, H, D), k (B, T, Hkv, D), cos/sin (B, T, D)");
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t cos_batch_stride = cos.size(0) == 1 ? 0 : T * D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cp + b * cos_batch_stride + t * D;
      const float* s = sp + b * cos_batch_stride + t * D;
      float* qrow = qp + (b * T + t) * H * D;
      float* krow = kp + (b * T + t) * Hkv * D;
      rope_rows(qrow, qrow, H, D, D, c, s, false);
      rope_rows(krow, krow, Hkv, D, D, c, s, false);
    }
}

static void silu_mul_span(float* __restrict__ g, const float* __restrict__ u, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    g[i] = x / (1.f + exp_clamped(-x)) * u[i];
  }
}

// gate = silu(gate) * up, in place (the MLP's input to its down projection).
void silu_mul_(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.is_contiguous() &&
                  up.is_contiguous() && gate.sizes() == up.sizes(),
              "silu_mul_: gate and up must be contiguous fp32 tensors of one shape");
  silu_mul_span(gate.data_ptr<float>(), up.data_ptr<float>(), gate.numel());
}

// --- training forwards (verl/models/rotary.py, verl/models/swiglu.py): autograd nodes around these kernels.

// Rotary embedding of x (B, T, H, D) (any strides, the last dimension contiguous) into a new contiguous tensor,
// or with transpose=true its transpose, the backward (rope_rows).
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, bool transpose) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rope: fp32 tensors, cos and sin contiguous");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && cos.dim() == 3 && sin.sizes() == cos.sizes(),
              "rope: x (B, T, H, D) with its last dimension contiguous, cos/sin (B or 1, T, D)");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0 && cos.size(1) == T && cos.size(2) == D && (cos.size(0) == B || cos.size(0) == 1),
              "rope: cos/sin must be (B or 1, T, D) for x (B, T, H, D), D even");
  auto out = torch::empty({B, T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t cos_batch_stride = cos.size(0) == 1 ? 0 : T * D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      rope_rows(xp + b * x.stride(0) + t * x.stride(1), op + (b * T + t) * H * D, H, x.stride(2), D,
                cp + b * cos_batch_stride + t * D, sp + b * cos_batch_stride + t * D, transpose);
  return out;
}

// The gradients of h = silu(gate) * up given dh (all contiguous, one shape): with sig = 1 / (1 + exp(-gate)),
// d gate = dh * up * sig * (1 + gate * (1 - sig)) and d up = dh * gate * sig. One pass instead of autograd's
// three (two products and silu's backward) and their temporaries.
std::vector<torch::Tensor> silu_mul_backward(torch::Tensor grad, torch::Tensor gate, torch::Tensor up) {
  for (const auto* t : {&grad, &gate, &up})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == gate.sizes(),
                "silu_mul_backward: contiguous fp32 tensors of one shape");
  auto grad_gate = torch::empty_like(gate), grad_up = torch::empty_like(up);
  const float *dp = grad.data_ptr<float>(), *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  float *ggp = grad_gate.data_ptr<float>(), *gup = grad_up.data_ptr<float>();
  const int64_t n = gate.numel();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = gp[i], sig = 1.f / (1.f + exp_clamped(-x));
    const float silu = x * sig;
    gup[i] = dp[i] * silu;
    ggp[i] = dp[i] * up_[i] * (sig * (1.f + x * (1.f - sig)));
  }
  return {grad_gate, grad_up};
}
