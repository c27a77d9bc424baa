"""The device a command runs on, chosen one way by every command that has ``--device``, and CPU forwards kept off
GPU-only kernels.

``--device`` takes ``cpu``, ``cuda`` (this process's GPU: ``cuda:LOCAL_RANK`` under torchrun) or ``cuda:N``;
left out, the GPU when there is one. An unusable spelling (``cuda`` without a GPU, an index past the last GPU,
``gpu``) is refused with one line (``hsstore CMD: error: --device ...``, exit 2) before any work starts: the CLI
resolves every command's ``--device`` before running it.

transformers picks a Gated DeltaNet's kernels when its modeling module is imported: with flash-linear-attention
installed, fla's Triton kernels, whatever device the model is later moved to; a CPU forward then fails inside
Triton. :func:`route_cpu_kernels` puts a device check in front of each such kernel, so CPU tensors take
transformers' own torch path (the kernel wrapper's ``__wrapped__`` reference) and CUDA tensors the kernel as before.
From 5.25 transformers' wrapper sends CPU tensors to that path itself, but only for the packages it lists
(``hub_kernels._PACKAGE_SUPPORTED_DEVICES``: fla, causal-conv1d, mamba-ssm), and its modeling globals are
``kernels`` layers around the wrapper (so are 5.24's where ``kernels`` is installed): both shapes are routed, on
every version. It works on the modules' names only, so this package still never imports transformers.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from dataclasses import dataclass

# torch is imported where it is used: `hsstore --help` must not load it

SPELLINGS = "cpu, cuda (this process's GPU: cuda:LOCAL_RANK under torchrun) or cuda:N"


def device_option(used_for: str = "", default: str = "the GPU when there is one"):
    """Every command's ``--device`` setting: the spellings said once, here (``used_for``: what runs on it)."""
    from .schema import option

    return option(None, help=f"{SPELLINGS}{' ' + used_for if used_for else ''} (default: {default})")


@dataclass(frozen=True)
class DeviceDefaults:
    """What an unset batch setting becomes on a kind of device (train, extract and eval read this one table)."""

    token_budget: int  # padded tokens per batch (sequences x longest)
    anchors: int  # training anchors per sequence, at most


# the published recipe on a GPU; a quarter of its tokens and anchors on a CPU, whose step would otherwise grow
# until the kernel kills the process
DEVICE_DEFAULTS = {"cuda": DeviceDefaults(token_budget=16384, anchors=512),
                   "cpu": DeviceDefaults(token_budget=4096, anchors=128)}


def defaults_for(device) -> DeviceDefaults:
    """The table's row for ``device`` (a ``torch.device`` or its spelling): CUDA, else the CPU's."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return DEVICE_DEFAULTS["cuda" if kind == "cuda" else "cpu"]


class DeviceError(ValueError):
    """A ``--device`` value this machine cannot run (exit 2 in the CLI)."""


def resolve_device(spec: str | None = None, local_rank: int | None = None):
    """The ``torch.device`` for ``spec`` on this machine; ``cuda`` always comes back with its index."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else int(local_rank)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec is None or spec == "":
        if not gpus:
            return torch.device("cpu")
        spec = "cuda"
    text = str(spec).strip().lower()
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {spec!r} is not a device: use {SPELLINGS}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DeviceError(f"--device {spec!r}: only {SPELLINGS} are supported")
    if not gpus:
        raise DeviceError(f"--device {spec!r}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
                          f"cuda {torch.version.cuda or 'not built in'}); use --device cpu")
    index = local if dev.index is None else dev.index
    if index >= gpus:
        why = "LOCAL_RANK " if dev.index is None else ""
        raise DeviceError(f"--device {spec!r}: {why}index {index} is past the last GPU (this machine has {gpus}: "
                          f"cuda:0..cuda:{gpus - 1})")
    return torch.device("cuda", index)


def describe(dev) -> str:
    """``cuda:0 (<the GPU's name>)`` / ``cpu``: what a command says it runs on."""
    import torch

    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return "cpu"


# -- CPU forwards around GPU-only kernels -------------------------------------------------------------------
def _closure(fn) -> dict:
    """``fn``'s closure variables by name (empty cells left out)."""
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    found = {}
    for name, cell in zip(names, getattr(fn, "__closure__", None) or ()):
        try:
            found[name] = cell.cell_contents
        except ValueError:
            pass
    return found


def _is_wrapper(fn) -> bool:
    """Whether ``fn`` is transformers' kernel wrapper (``use_kernel_func_from_hub_with_fallback``'s function, in 5.24
    and 5.25 alike): its ``__wrapped__`` is the modeling file's torch function, which it also holds as its
    ``torch_function``, and its code lives in transformers' hub_kernels module (either sign is enough)."""
    if not inspect.isfunction(fn) or getattr(fn, "_hsstore_cpu_safe", False):
        return False
    ref = getattr(fn, "__wrapped__", None)
    if not callable(ref):
        return False
    return (_closure(fn).get("torch_function") is ref
            or fn.__code__.co_filename.replace("\\", "/").endswith("integrations/hub_kernels.py"))


def _kernel_wrapper(fn):
    """The transformers kernel wrapper that the modeling module's global ``fn`` is or calls, else None. With the
    ``kernels`` package installed (a dependency of transformers from 5.25, optional before) the global is a
    ``kernels`` layer instead: an ``nn.Module`` instance whose class has ``kernel_layer_name`` and whose ``forward``
    calls the wrapper, which it holds in its closure."""
    if getattr(type(fn), "kernel_layer_name", None) is None:
        return fn if _is_wrapper(fn) else None
    held = _closure(getattr(type(fn), "forward", None)).values()
    return next((f for f in held if _is_wrapper(f)), None)


def _first_tensor(args, kwargs):
    import torch

    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _cpu_safe(kernel, wrapper):
    """``kernel`` (the global as found) for tensors off the CPU, ``wrapper``'s torch reference for CPU tensors."""
    reference = wrapper.__wrapped__
    params = inspect.signature(reference).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(wrapper)  # not the kernels layer itself: an nn.Module's __dict__ is no function's
    def dispatch(*args, **kwargs):
        t = _first_tensor(args, kwargs)
        if t is not None and t.device.type == "cpu":
            if not takes_any:
                kwargs = {k: v for k, v in kwargs.items() if k in params}
            return reference(*args, **kwargs)
        return kernel(*args, **kwargs)

    dispatch._hsstore_cpu_safe = True
    dispatch._hsstore_kernel = kernel
    return dispatch


def route_cpu_kernels(model) -> list[str]:
    """Make every forward of ``model`` on CPU tensors use transformers' torch paths instead of GPU-only kernels
    (fla's Triton Gated DeltaNet, causal-conv1d), whatever is installed; CUDA forwards are unchanged. Patches the
    modeling modules of ``model``'s submodules once per process. Returns the names routed (for the log)."""
    routed = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if module is None or not name.startswith("transformers."):
            continue
        scope = vars(module)
        for attr, fn in list(scope.items()):
            wrapper = _kernel_wrapper(fn) if callable(fn) else None
            if wrapper is not None:
                scope[attr] = _cpu_safe(fn, wrapper)
                routed.append(f"{name.rsplit('.', 1)[-1]}.{attr}")
    return routed
