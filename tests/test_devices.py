"""Devices: every ``--device`` spelling the help offers, unusable ones refused in one line, CPU forwards that never
reach fla's Triton kernels (whatever is installed), and the cost rule that decides ``--compile``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hsstore.app.cli import main as hsstore_cli
from hsstore.app.devices import DeviceError, resolve_device
from hsstore.extract.speed import choose_compile
from hsstore.extract.tiny import demo_conversations_path

TRIPWIRE = Path(__file__).parent / "fla_tripwire"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_spellings_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    if GPUS:
        assert resolve_device(None).type == "cuda"
        assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)  # always with its index
        assert resolve_device(f"cuda:{GPUS - 1}") == torch.device("cuda", GPUS - 1)
    else:
        assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", f"cuda:{max(GPUS, 7)}", "gpu", "mps", "cuda:x", "cuda:-1"])
def test_unusable_spellings_refused(spec):
    if GPUS and spec in ("cuda", "cuda:0"):
        pytest.skip("usable on this machine")
    with pytest.raises(DeviceError) as e:
        resolve_device(spec)
    assert spec in str(e.value) and "\n" not in str(e.value)


@pytest.mark.gpu  # on a CPU machine 'cuda' is refused before the index is looked at
def test_local_rank_past_last_gpu_refused(monkeypatch):
    with pytest.raises(DeviceError, match="LOCAL_RANK"):
        resolve_device("cuda", local_rank=GPUS)


@pytest.mark.parametrize("argv", [
    ["extract", "--model", "m", "--input", "x.jsonl", "--out", "s"],
    ["train", "--store", "s", "--out", "o"],
    ["eval", "--store", "s", "--drafter", "d"],
    ["demo", "--out", "o"],
])
@pytest.mark.parametrize("spec", [f"cuda:{max(GPUS, 7)}", "gpu"])
def test_cli_refuses_unusable_device_in_one_line(argv, spec, capsys, tmp_path, monkeypatch, new_manifest, new_samples,
                                                 write):
    monkeypatch.chdir(tmp_path)
    if argv[0] == "train":  # train refuses a missing store before it loads torch for --device: give it one
        write(str(tmp_path / "s"), new_manifest(), new_samples(1))
    assert hsstore_cli([*argv, "--device", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device" in err[0] and spec in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["s"] if argv[0] == "train" else [])  # nothing written


def test_cli_refuses_cuda_without_gpu(capsys, tmp_path):
    if GPUS:
        pytest.skip("this machine has a GPU")
    assert hsstore_cli(["extract", "--model", "m", "--input", "x", "--out", str(tmp_path / "s"),
                        "--device", "cuda"]) == 2
    assert "no usable CUDA GPU" in capsys.readouterr().err


# -- CPU forwards never reach fla ---------------------------------------------------------------------------
PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from transformers import AutoModelForCausalLM
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    target, out = sys.argv[1], sys.argv[2]
    picked = getattr(modeling.torch_chunk_gated_delta_rule, "__wrapped__", None)
    ids = torch.arange(3, 60).reshape(1, -1)
    plain = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    try:
        with torch.no_grad():
            plain(ids)
        tripped = None
    except RuntimeError as e:
        tripped = str(e)
    try:  # the stand-in itself, called directly: on the path, and raising
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        chunk_gated_delta_rule(ids, ids, ids, ids, ids)
        direct = None
    except RuntimeError as e:
        direct = str(e)
    from hsstore.app.target import load_target
    model = load_target(target, torch.float32, torch.device("cpu"), progress=False)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    np.save(out, torch.stack(hs).numpy())
    print(json.dumps({"tripped": tripped, "direct": direct}))
""")


def _tripwire_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TRIPWIRE), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _transformers_routes_cpu_itself() -> bool:
    """transformers >= 5.25: its kernel wrapper checks the inputs' device against the package's (fla: GPUs)."""
    import transformers.integrations.hub_kernels as hub

    return hasattr(hub, "_PACKAGE_SUPPORTED_DEVICES")


def test_cpu_forward_never_reaches_fla(tiny_dir, tmp_path):
    """With a kernel package on the path that raises when called (as fla's Triton kernels fail on CPU tensors),
    a plain transformers CPU forward trips it where transformers sends CPU tensors to an installed fla (up to 5.24;
    from 5.25 its kernel wrapper sends them to the torch path itself, and the stand-in is shown to be on the path by
    calling it); the target as hsstore loads it never does, and computes what the torch path computes."""
    out = tmp_path / "hs.npy"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tiny_dir), str(out)], env=_tripwire_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["direct"] and "tripwire" in result["direct"], "the stand-in kernels are not on the path"
    if _transformers_routes_cpu_itself():
        assert result["tripped"] is None, result["tripped"]
    else:
        assert result["tripped"] and "tripwire" in result["tripped"], "the stand-in kernels were not picked up"

    from hsstore.app.target import load_target

    model = load_target(str(tiny_dir), torch.float32, torch.device("cpu"), progress=False)
    with torch.no_grad():
        ref = torch.stack(model(torch.arange(3, 60).reshape(1, -1), output_hidden_states=True).hidden_states)
    np.testing.assert_allclose(np.load(out), ref.numpy(), rtol=0, atol=1e-5)


# what route_cpu_kernels puts a device check in front of in the tiny target's modeling module, on every version
ROUTED = [f"modeling_qwen3_5.{f}" for f in ("causal_conv1d_fn", "causal_conv1d_update",
                                            "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")]

EVAL_PROBE = textwrap.dedent("""
    import importlib.util, json, sys, torch
    from transformers import AutoModelForCausalLM
    from hsstore.app.devices import route_cpu_kernels
    m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    routed = route_cpu_kernels(m)
    with torch.no_grad():  # the cached decode path too
        out = m.generate(torch.arange(3, 20).reshape(1, -1), max_new_tokens=4, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    print(json.dumps({"routed": routed, "fla": getattr(importlib.util.find_spec("fla"), "origin", None) or "",
                      "tokens": out.sequences[0].tolist(), "scores": torch.stack(out.scores).flatten().tolist()}))
""")


def _eval_probe(tiny_dir, env) -> dict:
    """What ``eval --model`` runs on the target (load, route_cpu_kernels, a greedy cached decode), in ``env``."""
    proc = subprocess.run([sys.executable, "-c", EVAL_PROBE, str(tiny_dir)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_extract_and_speculative_eval_on_cpu_with_fla_installed(tiny_dir, tmp_path):
    """The CLI path a user runs on a GPU machine with ``.[gpu]`` installed but ``--device cpu``: extract (whose
    default device is the GPU elsewhere) and ``eval --model`` (the target decoding on CPU), whose greedy tokens and
    scores with the stand-in on the path equal those without it."""
    rows = tmp_path / "in.jsonl"
    rows.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:4]) + "\n")
    store = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-m", "hsstore", "extract", "--model", str(tiny_dir), "--input", str(rows),
                           "--out", str(store), "--device", "cpu", "--force", "-q"], env=_tripwire_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not compiled" in proc.stdout
    import hsstore

    assert len(hsstore.open(str(store))) == 4

    plain = _eval_probe(tiny_dir, dict(os.environ))  # this process's environment: no stand-in
    tripwired = _eval_probe(tiny_dir, _tripwire_env())  # raises wherever CPU tensors reach the stand-in
    assert Path(tripwired["fla"]).is_relative_to(TRIPWIRE), "the stand-in kernels are not on the path"
    assert set(tripwired["routed"]) >= set(ROUTED), tripwired["routed"]
    assert tripwired["tokens"] == plain["tokens"]
    np.testing.assert_allclose(tripwired["scores"], plain["scores"], rtol=0, atol=1e-5)


PROBE_MODULE = "transformers.models.hsstore_probe.modeling_hsstore_probe"
PROBE_SOURCE = textwrap.dedent("""
    import functools
    import torch
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback


    @use_kernel_func_from_hub_with_fallback("tripwire_kernel", "hsstore_tripwire_kernel")
    def torch_kernel(x, scale=2.0, **kwargs):
        return x * scale


    def plus_one(f):
        @functools.wraps(f)
        def inner(*args, **kwargs):
            return f(*args, **kwargs) + 1
        return inner


    @plus_one
    def not_a_kernel(x):  # wrapped, but by no kernel decorator: never routed
        return x


    class Mixer(torch.nn.Module):
        def forward(self, x):
            return not_a_kernel(torch_kernel(x))
""")


def test_route_cpu_kernels_on_the_installed_wrappers(monkeypatch):
    """A modeling module built with the installed transformers' kernel decorator (a plain wrapper function; where
    the ``kernels`` package is installed, as 5.25 requires, a ``kernels`` layer around it) for a package that 5.25's
    device table does not list, so its wrapper sends it CPU tensors on every version. Routed, CPU tensors take the
    torch function, others still reach the kernel, and a function wrapped by anything else is left alone."""
    import types

    import transformers.integrations.hub_kernels as hub

    if not hasattr(hub, "use_kernel_func_from_hub_with_fallback"):
        pytest.skip("this transformers has no use_kernel_func_from_hub_with_fallback")
    from hsstore.app.devices import route_cpu_kernels

    def tripwire_kernel(x, scale=2.0, **kwargs):
        raise RuntimeError(f"tripwire: kernel called with tensors on {x.device}")

    package = types.ModuleType("hsstore_tripwire_kernel")
    package.tripwire_kernel = tripwire_kernel
    monkeypatch.setitem(sys.modules, package.__name__, package)
    modeling = types.ModuleType(PROBE_MODULE)
    monkeypatch.setitem(sys.modules, PROBE_MODULE, modeling)
    exec(compile(PROBE_SOURCE, "<hsstore probe modeling module>", "exec"), vars(modeling))
    mixer, x = modeling.Mixer(), torch.arange(6.0)
    with pytest.raises(RuntimeError, match="tripwire"):  # unrouted, CPU tensors reach the kernel
        mixer(x)
    assert route_cpu_kernels(mixer) == ["modeling_hsstore_probe.torch_kernel"]
    torch.testing.assert_close(mixer(x), x * 2 + 1, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="tripwire"):  # other devices still get the kernel
        mixer(x.to("meta"))
    assert route_cpu_kernels(mixer) == []  # once


# -- --compile by cost ------------------------------------------------------------------------------------
def test_compile_chosen_by_cost():
    cuda = torch.device("cuda", 0)
    tiny = choose_compile(None, cuda, decoder_params=2_000_000, tokens=49_623)  # the demo's extraction
    assert not tiny.compile and "warm-up" in tiny.reason
    seeds = choose_compile(None, cuda, decoder_params=int(25e9), tokens=int(1.87e9))  # the seeds' workload
    assert seeds.compile
    short = choose_compile(None, cuda, decoder_params=int(25e9), tokens=50_000)  # a 27B smoke test: 6 s eager
    assert not short.compile
    assert not choose_compile(None, torch.device("cpu"), int(25e9), int(1e9)).compile
    assert choose_compile(True, torch.device("cpu"), 1, 1).compile  # asked for: as asked
    assert not choose_compile(False, cuda, int(25e9), int(1e9)).compile


def test_first_use_kernel_compiles_are_said_on_a_machine_without_compiled_kernels(tiny_dir, tmp_path, monkeypatch,
                                                                                   caplog):
    """A Gated DeltaNet target bound for CUDA on a machine whose Triton cache is empty gets one warning that fla's
    kernels compile on first use (a fresh GPU machine's first extraction waited about a minute); never on the CPU,
    for a cache that holds kernels, or twice in a process."""
    import logging

    from transformers import AutoModelForCausalLM

    import hsstore.app.target as target

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    monkeypatch.setattr(target, "_NOTED", [])
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    cuda = torch.device("cuda", 0)
    assert not target.note_kernel_compiles(model, torch.device("cpu"))
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "kernel").mkdir()
    assert not target.note_kernel_compiles(model, cuda)
    (tmp_path / "triton" / "kernel").rmdir()
    with caplog.at_level(logging.WARNING, logger="hsstore.app.target"):
        assert target.note_kernel_compiles(model, cuda)
    assert "compile and autotune on their first use" in caplog.text and str(tmp_path / "triton") in caplog.text
    assert not target.note_kernel_compiles(model, cuda)  # said once


def test_a_compiled_extract_says_it_compiles_kernels_once_per_machine(tmp_path, monkeypatch, caplog):
    """Before the first batch of a compiled forward on a machine whose torch.compile cache is empty: one line that
    says kernels compile now, once per machine (the first batches otherwise run many times slower without a word);
    nothing when the cache holds kernels already."""
    from hsstore.extract import speed

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with caplog.at_level("WARNING", logger="hsstore.extract.speed"):
        assert speed.note_compile_cache(0)
    assert "compiling kernels, once per machine" in caplog.text and str(tmp_path / "inductor") in caplog.text
    (tmp_path / "inductor" / "fxgraph").mkdir(parents=True)
    caplog.clear()
    assert not speed.note_compile_cache(0) and not caplog.text
