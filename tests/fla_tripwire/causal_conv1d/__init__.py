"""Raises where causal-conv1d's CUDA kernels would fail on CPU tensors."""


def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
    raise RuntimeError(f"tripwire: causal_conv1d_fn called with tensors on {x.device}")


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **kwargs):
    raise RuntimeError(f"tripwire: causal_conv1d_update called with tensors on {x.device}")
