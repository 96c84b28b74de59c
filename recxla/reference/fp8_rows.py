"""Reference row codec in plain PyTorch (see recxla.formats and csrc/include/recxla/fp8.h)."""

import torch

from recxla.formats import FP8_SCALE_BYTES, get_format


def quantize_rows_ref(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """x: [N, D] float -> uint8 [N, row_bytes(D, fmt)]."""
    f = get_format(fmt, "quantize_rows_ref")
    if not f.is_fp8:
        out = torch.empty((x.shape[0], f.row_bytes(x.shape[1])), dtype=torch.uint8, device=x.device)
        if out.numel():  # a dtype view of a tensor without elements may fail on its strides
            out.view(f.wire_dtype).copy_(x)
        return out
    xf = x.float()
    # amax over finite values only: a NaN or Inf must not ruin the rest of its row.
    finite_abs = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    amax = finite_abs.amax(dim=1, keepdim=True) if xf.shape[1] else xf.new_zeros(xf.shape[0], 1)
    # Each step is one correctly rounded fp32 operation, as in the kernels. It is computed in
    # float64 and rounded once to float32, which gives the same bits (double has more than twice
    # float's precision), because torch's vectorized fp32 division may differ by one ulp.
    inv_scale = torch.where(
        amax > 0,
        (f.fp8_max / amax.double()).float().clamp(max=torch.finfo(torch.float32).max),
        torch.ones_like(amax),
    )
    scale = (1.0 / inv_scale.double()).float()
    scaled = (xf.double() * inv_scale.double()).float()
    # Finite values saturate, then torch's cast rounds them to nearest even.
    finite = torch.isfinite(scaled)
    codes = torch.where(finite, scaled, 0.0).clamp(-f.fp8_max, f.fp8_max)
    codes = codes.to(f.wire_dtype).view(torch.uint8)
    # Spelled out rather than left to torch's cast, whose scalar and vectorized paths disagree on
    # Inf: NaN -> 0x7F; Inf -> 0x7C in e5m2 and NaN (0x7F) in e4m3, which has no infinity.
    sign = torch.signbit(scaled).to(torch.uint8) << 7
    inf_code = 0x7C if f.name == "e5m2" else 0x7F
    special = torch.where(torch.isinf(scaled), inf_code, 0x7F).to(torch.uint8) | sign
    codes = torch.where(finite, codes, special)
    # Flattened first: an empty [0, 1] result may carry a stride of 0, which a dtype view rejects.
    scale_bytes = scale.reshape(-1).contiguous().view(torch.uint8).reshape(x.shape[0], FP8_SCALE_BYTES)
    return torch.cat([codes, scale_bytes], dim=1)


def dequantize_rows_ref(
    packed: torch.Tensor, dim: int, fmt: str = "e4m3", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed: uint8 [N, row_bytes(dim, fmt)] -> [N, dim] of `dtype`."""
    f = get_format(fmt, "dequantize_rows_ref")
    if not f.is_fp8:
        y = torch.empty((packed.shape[0], dim), dtype=dtype, device=packed.device)
        if y.numel():
            y.copy_(packed.contiguous().view(f.wire_dtype))
        return y
    codes = packed[:, :dim].contiguous().view(f.wire_dtype).float()
    # A copy: a slice of an empty tensor keeps a storage offset that a dtype view rejects.
    scale = packed[:, dim:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return (codes.double() * scale.double()).float().to(dtype)
