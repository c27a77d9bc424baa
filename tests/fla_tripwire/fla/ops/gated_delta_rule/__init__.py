"""Raises where fla's Triton kernels would fail on CPU tensors."""


def _trip(name, args):
    devices = sorted({str(a.device) for a in args if hasattr(a, "device")})
    raise RuntimeError(f"tripwire: fla {name} called with tensors on {devices}")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    _trip("chunk_gated_delta_rule", (q, k, v))


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    _trip("fused_recurrent_gated_delta_rule", (q, k, v))
