// The Python module of verl's CPU kernels (built by verl/models/cpu_kernels.py).
#include <torch/extension.h>

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask_opt, double scale,
                               const c10::optional<torch::Tensor>& rows_opt);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
void silu_mul_(torch::Tensor gate, torch::Tensor up);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, bool transpose);
std::vector<torch::Tensor> silu_mul_backward(torch::Tensor grad, torch::Tensor gate, torch::Tensor up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "softmax attention of one or a few query positions per row, over a masked KV cache (rows: each query row's "
        "cache row)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"), py::arg("rows") = py::none());
  m.def("rms_norm", &rms_norm, "weight * x * rsqrt(mean(x^2) + eps) over the last dimension");
  m.def("add_rms_norm_", &add_rms_norm_, "x += residual in place; returns rms_norm(x)");
  m.def("rope_", &rope_, "rotary position embedding applied to q and k in place");
  m.def("silu_mul_", &silu_mul_, "gate = silu(gate) * up in place");
  m.def("rope", &rope, "rotary position embedding of x (B, T, H, D) into a new tensor (transpose: its backward)");
  m.def("silu_mul_backward", &silu_mul_backward, "the gradients of silu(gate) * up for gate and up");
}
