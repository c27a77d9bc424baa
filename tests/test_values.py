"""The value check (hsstore/format/values.py) through the real commands: every tensor that enters training or leaves
as a drafter, and every number a store's or drafter's config gives, is held to what a model of its kind can have
before anything is built from it; an allocation the machine cannot hold is refused, not attempted.

The stores and drafters are real (extracted from the tiny target, trained by ``train``) and then forged as a
sender would: assets rewritten through ``write_assets`` (their checksums valid), a drafter's files saved again with
safetensors. Each refusal is one line naming the input and the rule, exit 2, and writes nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hsstore.app.cli import main
from hsstore.format import assets
from hsstore.io import storage
from hsstore.train import checkpoint as ckpt
from hsstore.train.trainer import TrainSettings, train
from hsstore.app.schema import build

from test_hostile_files import cli, one_line
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

TRAIN = ["--device", "cpu", "--draft-layers", "1", "--block-size", "8", "--token-budget", "1024",
         "--anchors", "32", "-q"]


def refused(capsys, argv: list[str], *words: str) -> str:
    """``hsstore ARGV`` in process: exit 2 and one line on stderr holding ``words``."""
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("INFO", "WARNING"))]
    assert len(err) == 1 and all(w in err[0] for w in words), err
    return err[0]


# -- a store's assets ----------------------------------------------------------------------------------------------
def forged_store(src: str, dst: Path, change) -> str:
    """A copy of store ``src`` whose assets ``change(config dict, {name: tensor})`` rewrote, listed with valid
    checksums (as a sender would)."""
    shutil.copytree(src, dst)
    fs, root = storage.resolve(str(dst))
    cfg = json.loads((dst / "assets" / assets.CONFIG).read_text())
    tensors = {n: load_file(str(dst / "assets" / n))["weight"] for n in (assets.EMBED, assets.LM_HEAD)}
    change(cfg, tensors)  # a tensor, or the file's bytes
    assets.write_assets(fs, root, {assets.CONFIG: json.dumps(cfg).encode(), **{
        n: t if isinstance(t, bytes) else assets.tensors_bytes({"weight": t}) for n, t in tensors.items()}})
    return str(dst)


def _set(key, value):
    return lambda cfg, tensors: cfg.__setitem__(key, value)


def _tensor(name, make):
    return lambda cfg, tensors: tensors.__setitem__(name, make(tensors[name]))


ASSETS = {  # case: (forgery, words of the refusal)
    "embedding NaN": (_tensor(assets.EMBED, lambda t: torch.full_like(t, float("nan"))),
                      [assets.EMBED, "non-finite values"]),
    "lm_head all zero": (_tensor(assets.LM_HEAD, torch.zeros_like), [assets.LM_HEAD, "all zero"]),
    "lm_head of int32": (_tensor(assets.LM_HEAD, lambda t: (t * 100).to(torch.int32)),
                         [assets.LM_HEAD, "dtype int32"]),
    "lm_head of another shape": (_tensor(assets.LM_HEAD, lambda t: t[:, :32].contiguous()),
                                 [assets.LM_HEAD, "shape [1033, 32], expected [1033, 64]"]),
    "embedding not safetensors": (_tensor(assets.EMBED, lambda t: b"\x08" + bytes(15)),
                                  [assets.EMBED, "not a readable safetensors file"]),
    "embedding under another name": (_tensor(assets.EMBED, lambda t: assets.tensors_bytes({"w": t})),
                                     [assets.EMBED, "not one 2-D tensor 'weight'"]),
    "rms_norm_eps -1": (_set("rms_norm_eps", -1), [assets.CONFIG, "rms_norm_eps -1", "(0, 1)"]),
    "eos id past the vocabulary": (_set("eos_token_id", 10 ** 6), [assets.CONFIG, "eos_token_id", "vocabulary"]),
    "pad id past the vocabulary": (_set("pad_token_id", 10 ** 6), [assets.CONFIG, "pad_token_id", "vocabulary"]),
    "vocab_size not the embedding's": (_set("vocab_size", 2048), [assets.CONFIG, "vocab_size 2048", "1033"]),
}


@pytest.mark.slow  # trains or evaluates a drafter
@pytest.mark.parametrize("case", sorted(ASSETS))
def test_store_assets_that_train_nothing_are_refused_before_training(store32, tmp_path, capsys, case):  # noqa: F811
    forge, words = ASSETS[case]
    url = forged_store(store32, tmp_path / "s", forge)
    out = tmp_path / "run"
    refused(capsys, ["train", "--store", url, "--out", str(out), *TRAIN, "--steps", "2"], f"store {url!r}", *words)
    assert not out.exists()  # refused before the first step: the OUT it made is removed


@pytest.mark.parametrize("size, words", [
    (2 ** 40, ["assets/config.json: intermediate_size 1099511627776", "at most 2,147,483,648"]),
    (2 ** 31 - 1, ["the drafter's config", "parameters: needs", "more than this machine"])])
def test_a_config_asking_for_terabytes_is_refused_not_attempted(store32, tmp_path, size, words):  # noqa: F811
    """intermediate_size 2^40 is past what any model has; 2^31 - 1 is within the sizes' bound, and 8 draft layers of
    it a drafter of 13 TB no machine holds: both one line before the drafter is built (a child process with a 4 GiB
    address space: an attempt shows)."""
    url = forged_store(store32, tmp_path / "s", _set("intermediate_size", size))
    one_line(cli("train", "--store", url, "--out", tmp_path / "run", *TRAIN, "--draft-layers", "8", "--steps", "2",
                 timeout=300), *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # trains or evaluates a drafter
def test_eval_refuses_a_store_whose_embedding_is_nan(store32, drafter, tmp_path, capsys):  # noqa: F811
    url = forged_store(store32, tmp_path / "s", ASSETS["embedding NaN"][0])
    refused(capsys, ["eval", "--store", url, "--drafter", str(drafter), "--device", "cpu", "-q"], assets.EMBED,
            "non-finite values")


# -- a drafter's weights and config ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter(store32, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("run")
    train(build(TrainSettings, store=[store32], out=str(run), steps=2, **FAST))
    return run / "drafter"


def _weights(change):
    def forge(d: Path) -> None:
        t = load_file(str(d / "model.safetensors"))
        save_file(change(t), str(d / "model.safetensors"), metadata={"format": "pt"})
    return forge


def _inf_once(t):
    k = sorted(t)[0]
    t[k] = t[k].clone()
    t[k].view(-1)[3] = float("inf")
    return t


def _config(key, value):
    def forge(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        (c["dflash_config"] if key in ("mask_token_id", "target_layer_ids") else c)[key] = value
        (d / "config.json").write_text(json.dumps(c))
    return forge


DRAFTERS = {  # case: (forgery, words of the refusal)
    "all NaN": (_weights(lambda t: {k: torch.full_like(v, float("nan")) for k, v in t.items()}),
                ["model.safetensors", "non-finite values"]),
    "one Inf": (_weights(_inf_once), ["model.safetensors", "non-finite values (1 of"]),
    "int32 weights": (_weights(lambda t: {k: (v * 100).to(torch.int32) for k, v in t.items()}),
                      ["model.safetensors", "dtype int32, expected bfloat16"]),
    "bool weights": (_weights(lambda t: {k: v > 0 for k, v in t.items()}), ["model.safetensors", "dtype bool"]),
    "float64 weights, config says bf16": (_weights(lambda t: {k: v.double() for k, v in t.items()}),
                                          ["model.safetensors", "dtype float64, expected bfloat16"]),
    "rms_norm_eps -1": (_config("rms_norm_eps", -1), ["config.json", "rms_norm_eps -1.0", "(0, 1)"]),
    "mask token past the vocabulary": (_config("mask_token_id", 10 ** 6),
                                       ["config.json", "mask_token_id 1000000", "vocabulary"]),
    "a tap past the target's layers": (_config("target_layer_ids", [1, 2, 3, 4, 99]),
                                       ["config.json", "target layers [99] outside the target's 8 layers"]),
    "heads not a multiple of KV heads": (_config("num_key_value_heads", 3),
                                         ["config.json", "must be a multiple of num_kv_heads (3)"]),
}


@pytest.mark.slow  # trains or evaluates a drafter
@pytest.mark.parametrize("case", sorted(DRAFTERS))
def test_drafters_whose_weights_or_config_lie_are_refused_by_eval_and_export(store32, drafter, tmp_path, capsys,
                                                                           case):  # noqa: F811
    forge, words = DRAFTERS[case]
    forged = tmp_path / "d"
    shutil.copytree(drafter, forged)
    forge(forged)
    refused(capsys, ["export-drafter", str(forged), str(tmp_path / "out")], str(forged), *words)
    assert not (tmp_path / "out").exists()
    refused(capsys, ["eval", "--store", store32, "--drafter", str(forged), "--device", "cpu", "-q"], str(forged),
            *words)


@pytest.mark.slow  # trains or evaluates a drafter
def test_a_resume_from_nan_master_weights_is_refused(store32, tmp_path, capsys):  # noqa: F811
    """A run whose last checkpoint holds NaN master weights (a diverged or a forged one) is not resumed into."""
    flags = ["train", "--store", store32, "--out", str(tmp_path / "run"), *TRAIN]
    assert main([*flags, "--steps", "2"]) == 0
    master = ckpt.latest_checkpoint(tmp_path / "run") / ckpt.MASTER
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(str(master)).items()}, str(master))
    refused(capsys, [*flags, "--steps", "3"], str(master), "non-finite values")


# -- merge ----------------------------------------------------------------------------------------------------------
def _with_assets(url: str, embed: torch.Tensor, config: dict) -> None:
    assets.write_assets(*storage.resolve(url), {assets.EMBED: assets.tensors_bytes({"weight": embed}),
                                                assets.CONFIG: json.dumps(config).encode()})


@pytest.mark.parametrize("differs", [assets.EMBED, assets.CONFIG])
def test_merge_refuses_sources_whose_assets_differ(tmp_path, new_manifest, new_samples, write, capsys, differs):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write(a, new_manifest(), new_samples(3, prefix="a"))
    write(b, new_manifest(), new_samples(3, prefix="b", seed=1))
    embed, config = torch.randn(16, 48), {"hidden_size": 48, "rms_norm_eps": 1e-6, "transformers_version": "5.0"}
    _with_assets(a, embed, config)
    _with_assets(b, embed + (differs == assets.EMBED), {**config, "rms_norm_eps": 1e-5 if differs == assets.CONFIG
                                                       else 1e-6, "transformers_version": "5.1"})
    for by in ("copy", "reference"):
        refused(capsys, ["merge", str(tmp_path / "dst"), a, b, "--by", by, "-q"], f"store {b!r}: asset {differs!r}",
                f"differs from {a!r}'s")
        assert not (tmp_path / "dst").exists()


def test_merge_takes_assets_that_differ_only_in_the_writers_version(tmp_path, new_manifest, new_samples, write):
    """A config that differs in ``transformers_version`` alone is the same model's; the destination takes the first
    source's assets that has any."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    for seed, url in enumerate((a, b, c)):
        write(url, new_manifest(), new_samples(3, prefix=url[-1], seed=seed))
    embed = torch.randn(16, 48)
    _with_assets(b, embed, {"hidden_size": 48, "transformers_version": "5.0"})
    _with_assets(c, embed, {"hidden_size": 48, "transformers_version": "5.1"})
    dst = str(tmp_path / "dst")
    assert main(["merge", dst, a, b, c, "-q"]) == 0
    assert assets.read_asset(*storage.resolve(dst), assets.CONFIG) == assets.read_asset(*storage.resolve(b),
                                                                                        assets.CONFIG)
