"""The passes over the gradients: unscale / check / clip through a backend (Triton kernels or torch
ops), the cross-rank combine and its checks, and the fold into a fused optimizer's step."""
