"""The drafter as SGLang, vLLM and z-lab's ``dflash`` load it: the DFlash Hugging Face format (config.json +
bf16 model.safetensors), the published drafter shape, ``hsstore export-drafter`` and ``hsstore train --init``.

Expected values are written out from the references (SpecForge configs/qwen3.6-27b-dflash.json and
configs/qwen3-8b-dflash.json; the module names of z-lab's dflash/model.py and SGLang's models/dflash.py),
not computed by the code under test."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hsstore
from hsstore import Manifest, TargetIdentity, TokenizerIdentity
from hsstore.app.cli import main as hsstore_cli
from hsstore.app.schema import build
from hsstore.train import checkpoint as ckpt
from hsstore.train import drafter_format
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.build import drafter_config, load_frozen
from hsstore.train.trainer import TrainSettings, train
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

# Qwen/Qwen3.6-27B's text_config (the fields the drafter reads): 64 layers, 24 heads x 256, 4 KV heads,
# partial rotary 0.25 with rope_theta 1e7
QWEN36_27B_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    "tie_word_embeddings": False, "eos_token_id": 248044, "pad_token_id": None,
}
# SpecForge configs/qwen3.6-27b-dflash.json, the fields that describe the network
PUBLISHED_27B = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 17408,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "max_position_embeddings": 262144,
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 64,
    "rms_norm_eps": 1e-6, "sliding_window": 2048, "use_sliding_window": True, "vocab_size": 248320,
    "rope_theta": 10000000, "tie_word_embeddings": False,
}


def manifest_for(text_cfg, layers, vocab_size=None):
    return Manifest(
        target=TargetIdentity(name="t", num_layers=text_cfg["num_hidden_layers"], hidden_size=text_cfg["hidden_size"],
                              config_hash="c"),
        tokenizer=TokenizerIdentity(name="tok", vocab_hash="v", vocab_size=vocab_size), layers=tuple(layers))


# ---------------------------------------------------------------------------------------------- the shape


def test_default_shape_is_the_published_qwen36_27b_drafter():
    cfg = drafter_config(manifest_for(QWEN36_27B_TEXT, [1, 16, 31, 46, 61]), {"text_config": QWEN36_27B_TEXT},
                         248320, build(TrainSettings, store=["x"], out="x", mask_token_id=248070), torch.device("cpu"))
    got = drafter_format.hf_config(cfg)
    for key, want in PUBLISHED_27B.items():
        assert got[key] == want, key
    assert got["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert not any("partial" in k for k in json.dumps(got).split('"'))  # no partial-rotary field anywhere


def test_default_shape_is_the_published_qwen3_8b_drafter():
    qwen3_8b = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                "rms_norm_eps": 1e-6, "rope_theta": 1000000}
    cfg = drafter_config(manifest_for(qwen3_8b, [1, 9, 17, 25, 33]), qwen3_8b, 151936,
                         build(TrainSettings, store=["x"], out="x", mask_token_id=151669, sliding_window=0),
                         torch.device("cpu"))
    got = drafter_format.hf_config(cfg)
    published = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "num_hidden_layers": 5, "layer_types": ["full_attention"] * 5,
                 "use_sliding_window": False, "sliding_window": None, "num_target_layers": 36, "rope_theta": 1000000,
                 "max_position_embeddings": 40960,
                 "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
    for key, want in published.items():
        assert got[key] == want, key


def test_shape_flags_override_the_rule():
    m = manifest_for(QWEN36_27B_TEXT, [1, 16, 31, 46, 61])
    base = dict(store=["x"], out="x", mask_token_id=248070)

    def shape(**kw):
        c = drafter_config(m, QWEN36_27B_TEXT, 248320, build(TrainSettings, **base, **kw), torch.device("cpu"))
        return c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rope_theta, c.num_layers

    assert shape() == (32, 8, 128, 17408, 1e7, 5)
    assert shape(num_heads=16) == (16, 8, 128, 17408, 1e7, 5)
    assert shape(head_dim=64) == (32, 8, 64, 17408, 1e7, 5)  # 24 x 256 = 96 heads of 64, capped at 32
    assert shape(num_heads=12, num_kv_heads=4, intermediate_size=8192, rope_theta=1e6, draft_layers=3) == \
        (12, 4, 128, 8192, 1e6, 3)
    with pytest.raises(ValueError, match="multiple"):
        shape(num_heads=12, num_kv_heads=8)


def test_tiny_target_keeps_its_shape(store32):
    store = hsstore.open(store32)
    target_cfg, embed, _ = load_frozen(store)
    cfg = drafter_config(store.manifest, target_cfg, embed.shape[0], build(TrainSettings, store=[store32], out="x"),
                         torch.device("cpu"))
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 32)
    assert cfg.num_target_layers == store.manifest.target.num_layers


# ---------------------------------------------------------------------------------------------- the format


H, V, L = 64, 120, 3


def tiny_drafter(seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(**{**dict(hidden_size=H, intermediate_size=96, vocab_size=V, target_layers=[1, 3, 5],
                                  mask_token_id=V - 1, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2,
                                  block_size=8, sliding_window=[32, None], num_target_layers=8,
                                  rope_theta=5e5, max_position=1024), **kw})
    model = DFlashDrafter(cfg, torch.randn(V, H), torch.randn(V, H))
    for p in model.parameters():  # norms start at 1: make every tensor distinct
        p.data.add_(torch.randn_like(p) * 0.1)
    return model


def reference_tensors(n_layers=2, H=H, taps=L, heads=4, kv=2, hd=16, ffn=96):
    """Names and shapes of the reference DFlashDraftModel (z-lab dflash/model.py, SGLang models/dflash.py):
    fc, hidden_norm, layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
    post_attention_layernorm, mlp.{gate,up,down}_proj}, norm; no embed_tokens, no lm_head."""
    out = {"fc.weight": (H, taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(n_layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                    p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (ffn, H), p + "mlp.up_proj.weight": (ffn, H),
                    p + "mlp.down_proj.weight": (H, ffn)})
    return out


def test_exported_config_loads_in_transformers(tmp_path):
    from transformers import AutoConfig, Qwen3Config

    drafter_format.save_drafter(tmp_path / "d", tiny_drafter(), {"taps": [1, 3, 5]})
    c = AutoConfig.from_pretrained(tmp_path / "d")
    assert isinstance(c, Qwen3Config) and c.architectures == ["DFlashDraftModel"]
    assert c.sliding_window == 32 and c.use_sliding_window is True  # kept: transformers drops it otherwise
    assert c.layer_types == ["sliding_attention", "full_attention"]
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (H, 4, 2, 16)
    assert (c.intermediate_size, c.num_hidden_layers, c.vocab_size, c.max_position_embeddings) == (96, 2, V, 1024)
    assert c.rope_parameters["rope_theta"] == 5e5 and c.attention_bias is False and c.hidden_act == "silu"
    assert c.block_size == 8 and c.num_target_layers == 8
    assert c.dflash_config == {"target_layer_ids": [1, 3, 5], "mask_token_id": V - 1}
    assert getattr(c, "is_causal", None) is None  # the engines' default: sliding causal, full non-causal
    meta = json.loads((tmp_path / "d" / drafter_format.META).read_text())
    assert meta["taps"] == [1, 3, 5] and meta["attn_impl"] == "sdpa"

    drafter_format.save_drafter(tmp_path / "nc", tiny_drafter(sliding_causal=False))
    assert AutoConfig.from_pretrained(tmp_path / "nc").is_causal is False


def test_exported_weights_have_the_reference_names_in_bf16(tmp_path):
    drafter_format.save_drafter(tmp_path, tiny_drafter())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == reference_tensors()
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: "model.safetensors" for k in reference_tensors()}


def test_export_round_trips_into_load_drafter(tmp_path):
    model = tiny_drafter()
    drafter_format.save_drafter(tmp_path, model)
    back = ckpt.load_drafter(tmp_path, model.embed_tokens, model.lm_head)
    assert dataclasses.asdict(back.config) == dataclasses.asdict(model.config)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16).float()), k
    hs, ids = torch.randn(1, 40, L, H), torch.randint(0, V - 1, (1, 40))
    with torch.no_grad():
        a, b = model(hs, ids, torch.tensor([[5, 20]])), back(hs, ids, torch.tensor([[5, 20]]))
    assert torch.allclose(a, b, atol=0.1, rtol=0.05)  # bf16 weights


def test_reads_the_published_config():
    d = {**PUBLISHED_27B, "rope_scaling": None, "dtype": "bfloat16", "use_cache": True, "max_window_layers": 5}
    cfg = drafter_format.config_from_hf(d)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (32, 8, 128, 5)
    assert cfg.sliding_window == [2048, 2048, 2048, 2048, None] and cfg.sliding_causal
    assert (cfg.target_layers, cfg.mask_token_id, cfg.block_size, cfg.rope_theta) == \
        ([1, 16, 31, 46, 61], 248070, 16, 1e7)
    assert drafter_format.config_from_hf({**d, "is_causal": False}).sliding_causal is False
    for bad, match in (({"attention_bias": True}, "attention_bias"), ({"is_causal": True}, "is_causal"),
                       ({"partial_rotary_factor": 0.25}, "partial rotary"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "RoPE scaling"),
                       ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash drafter"),
                       ({"dflash_config": {"target_layer_ids": [1]}}, "mask_token_id")):
        with pytest.raises(ValueError, match=match):
            drafter_format.config_from_hf({**d, **bad})


def write_legacy(path: Path, model: DFlashDrafter) -> None:
    """A drafter directory as this project wrote it before the DFlash format."""
    path.mkdir(parents=True)
    cfg = {k: v for k, v in dataclasses.asdict(model.config).items() if k not in ("sliding_causal", "num_target_layers")}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architecture": "DFlashDrafter", "drafter": cfg, "taps": [1, 3, 5],
                                                  "target": {"name": "t", "num_layers": 8}}))


def test_legacy_directories_load_and_export(tmp_path, capsys):
    model = tiny_drafter()
    write_legacy(tmp_path / "old", model)
    cfg, meta = ckpt.read_drafter_config(tmp_path / "old")
    assert cfg.sliding_causal is False and cfg.num_target_layers == 8 and meta["taps"] == [1, 3, 5]
    back = ckpt.load_drafter(tmp_path / "old", model.embed_tokens, model.lm_head)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())  # fp32, exact

    assert hsstore_cli(["export-drafter", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    new = json.loads((tmp_path / "new" / "config.json").read_text())
    assert new["architectures"] == ["DFlashDraftModel"] and new["is_causal"] is False
    assert new["num_target_layers"] == 8
    tensors = load_file(str(tmp_path / "new" / "model.safetensors"))
    assert all(torch.equal(tensors[k], v.to(torch.bfloat16)) for k, v in model.state_dict().items())

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    assert hsstore_cli(["export-drafter", str(tmp_path / "old"), str(tmp_path / "busy")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]


def test_export_a_run_and_refuse_mismatched_weights(store32, tmp_path):  # noqa: F811
    train(build(TrainSettings, store=[store32], out=str(tmp_path / "run"), steps=2, save_every=1, keep=0, **FAST))
    first = ckpt.list_checkpoints(tmp_path / "run")[0]
    out = ckpt.export_drafter(first, tmp_path / "step1")
    master = load_file(str(first / ckpt.MASTER))
    served = load_file(str(out / "model.safetensors"))
    assert served.keys() == master.keys() and all(torch.equal(served[k], master[k].bfloat16()) for k in master)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "hsstore_drafter.json",
                                                     "model.safetensors", "model.safetensors.index.json",
                                                     "modeling_dflash.py"]

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    d = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**d, "num_attention_heads": 2 * d["num_attention_heads"]}))
    with pytest.raises(ValueError, match="does not match its config"):
        ckpt.export_drafter(broken, tmp_path / "x")


# ---------------------------------------------------------------------------------------------- --init


@pytest.fixture(scope="module")
def released(store32, tmp_path_factory):  # noqa: F811
    """A drafter directory trained on the store: what a released drafter for this target looks like."""
    run = tmp_path_factory.mktemp("released")
    train(build(TrainSettings, store=[store32], out=str(run), steps=2, **FAST))
    return run / "drafter"


def test_init_starts_from_the_given_weights(store32, released, tmp_path):  # noqa: F811
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=1, lr=0.0, init=str(released), **FAST))
    start = load_file(str(released / "model.safetensors"))
    master = load_file(str(ckpt.latest_checkpoint(tmp_path) / ckpt.MASTER))  # after one step at lr 0
    assert master.keys() == start.keys()
    assert all(torch.equal(master[k], start[k].float()) for k in start)
    # and with a learning rate the run moves away from them
    train(build(TrainSettings, store=[store32], out=str(tmp_path / "lr"), steps=1, init=str(released), **FAST))
    moved = load_file(str(ckpt.latest_checkpoint(tmp_path / "lr") / ckpt.MASTER))
    assert any(not torch.equal(moved[k], start[k].float()) for k in start)


def edited(released, tmp_path, **changes) -> str:
    out = tmp_path / "edited"
    shutil.copytree(released, out)
    d = json.loads((out / "config.json").read_text())
    for k, v in changes.items():
        if k in ("target_layer_ids", "mask_token_id"):
            d["dflash_config"][k] = v
        else:
            d[k] = v
    (out / "config.json").write_text(json.dumps(d))
    return str(out)


@pytest.mark.parametrize("change, flags, match", [
    ({"target_layer_ids": [1, 2, 7]}, {}, r"taps \[1, 2, 7\] need layers \[7\]"),
    ({"hidden_size": 32}, {}, "hidden size 32 != the store's 64"),
    ({"vocab_size": 2048}, {}, "vocabulary 2048 != the store's embedding rows"),  # its mask token inside it
    ({}, {"block_size": 16}, "block size 8 != --block-size 16"),
    ({"num_target_layers": 64}, {}, "64-layer target"),
    ({}, {"num_heads": 8, "num_kv_heads": 2}, "num_heads 4 != --num-heads 8"),
])
def test_init_refuses_a_drafter_that_does_not_fit(store32, released, tmp_path, change, flags, match):  # noqa: F811
    path = edited(released, tmp_path, **change) if change else str(released)
    with pytest.raises(ValueError, match=match):
        train(build(TrainSettings, store=[store32], out=str(tmp_path / "run"), steps=1, init=path, **{**FAST,
                    **flags}))
    assert ckpt.latest_checkpoint(tmp_path / "run") is None


def test_init_refusal_is_one_line_on_the_cli(store32, released, tmp_path, capsys):  # noqa: F811
    path = edited(released, tmp_path, hidden_size=32)
    rc = hsstore_cli(["train", "--store", store32, "--out", str(tmp_path / "run"), "--steps", "1", "--init", path,
                      "--block-size", "8", "--draft-layers", "1", "--device", "cpu", "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "does not fit" in err and "hidden size 32" in err


def test_resume_refuses_another_drafter_shape(store32, tmp_path):  # noqa: F811
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=1, **FAST))
    with pytest.raises(ValueError, match="num_heads: None -> 8"):
        train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=2, num_heads=8, num_kv_heads=2, **FAST))
    with pytest.raises(ValueError, match="sliding_causal: True -> False"):
        train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=2, sliding_causal=False, **FAST))


def test_checkpoints_load_their_exact_weights(store32, tmp_path):  # noqa: F811
    """A checkpoint loads its fp32 master weights (what was trained); OUT/drafter, for serving, its bf16 ones."""
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=1, **FAST))
    _, embed, head = load_frozen(hsstore.open(store32), dtype=torch.float32)
    master = load_file(str(ckpt.latest_checkpoint(tmp_path) / ckpt.MASTER))
    exact = ckpt.load_drafter(ckpt.latest_checkpoint(tmp_path), embed, head).state_dict()
    served = ckpt.load_drafter(tmp_path, embed, head).state_dict()
    assert all(torch.equal(exact[k], master[k]) for k in master)
    assert all(torch.equal(served[k], master[k].bfloat16().float()) for k in master)
    assert any(not torch.equal(served[k], master[k]) for k in master)
