"""The trainer's one settings schema (train/settings.py): the flags, run.yaml sections, RESUME_KEYS and the flat
TrainSettings it generates mean what the hand-written ones did; train/'s old names still import; the metrics
meter's named sums."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from hsstore.app import config
from hsstore.app.cli import build_parser
from hsstore.app.schema import build
from hsstore.io.storage import parse_storage_options
from hsstore.app.commands import command_settings
from hsstore.train.settings import RESUME_KEYS, TrainSettings, recordable_config, saved_config
from hsstore.train.metrics import Meter
from hsstore.app.schema import settings_of


def parse(argv):
    p = build_parser()
    config.apply(p, argv)
    return p.parse_args(argv)


def train_config(args) -> TrainSettings:
    return command_settings(TrainSettings, args)


def old_cli_config(args) -> TrainSettings:
    """What train/cli.py built before the schema, field by field (copied from its last hand-written version)."""
    return build(TrainSettings, 
        store=args.store, out=args.out, steps=args.steps, epochs=args.epochs, device=args.device,
        token_budget=args.token_budget, anchors=args.anchors, block_size=args.block_size,
        draft_layers=args.draft_layers,
        sliding_window=args.sliding_window or None, sliding_causal=args.sliding_causal,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
        intermediate_size=args.intermediate_size, rope_theta=args.rope_theta, init=args.init,
        mask_token_id=args.mask_token_id, gamma=args.gamma, lr=args.lr,
        warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, clip=args.clip, seed=args.seed, attn=args.attn,
        log_every=args.log_every, save_every=args.save_every, keep=args.keep, workers=args.workers,
        prefetch=args.prefetch, resume=args.resume, progress=not args.quiet,
        log_samples=args.log_samples, weight=args.weight, cache_dir=args.cache_dir, cpu_threads=args.cpu_threads,
        partition=args.partition, checkpoint_layers=args.checkpoint_layers, gpu_memory_gib=args.gpu_memory_gib,
        cache_bytes=None if args.cache_bytes is None else int(args.cache_bytes),
        val_store=args.val_store, val_every=args.val_every, storage_options=parse_storage_options(args.storage_option),
        report_to=args.report_to)


EVERY_FLAG = ["train", "--store", "/s/a", "--store", "/s/b", "--out", "/o", "--steps", "7", "--device", "cpu",
              "--token-budget", "999", "--anchors", "33", "--block-size", "8", "--draft-layers", "3",
              "--sliding-window", "0", "--no-sliding-causal", "--num-heads", "4", "--num-kv-heads", "2",
              "--head-dim", "16", "--intermediate-size", "96", "--rope-theta", "5e5", "--init", "/d",
              "--mask-token-id", "3", "--gamma", "4.5", "--lr", "1e-3", "--warmup", "0.1", "--min-lr-ratio", "0.2",
              "--clip", "0.5", "--seed", "9", "--attn", "sdpa", "--weight", "2", "--weight", "0.5", "--workers", "2",
              "--prefetch", "3", "--cpu-threads", "2", "--cache-dir", "/c", "--cache-bytes", "4096",
              "--partition", "node", "--checkpoint-layers", "--gpu-memory-gib", "80", "--log-every", "5",
              "--save-every", "50", "--keep", "0", "--no-resume", "--log-samples", "-q", "--report-to",
              "tensorboard", "--val-store", "/v", "--val-every", "20", "-S", "anon=true"]


@pytest.mark.parametrize("argv", [["train", "--store", "/s", "--out", "/o"], EVERY_FLAG],
                         ids=["defaults", "every-flag"])
def test_flags_build_the_config_the_hand_written_cli_built(argv):
    args = parse(argv)
    assert train_config(args) == old_cli_config(args)


def test_old_run_yaml_keys_keep_their_meaning(tmp_path):
    """A run.yaml written before the schema: its keys are the flags' (no_resume, non_causal_sliding,
    token_budget, store, weight), and a true there still means the flag was given."""
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({
        "run": {"store": ["/s/a"], "out": "/o", "epochs": 2}, "batch": {"token_budget": 123},
        "drafter": {"sliding_window": 0, "non_causal_sliding": True},
        "output": {"no_resume": True, "quiet": True, "report_to": "none"},
        "data": {"weight": [2.0]}, "storage": {"storage_option": ["anon=true"]}}))
    cfg = train_config(parse(["train", "--config", str(f)]))
    assert cfg == build(TrainSettings, store=["/s/a"], out="/o", epochs=2, token_budget=123, sliding_window=None,
                        sliding_causal=False, resume=False, progress=False, weight=[2.0],
                        storage_options={"anon": True})
    f.write_text(yaml.safe_dump({"run": {"store": ["/s/a"], "out": "/o"},
                                 "drafter": {"non_causal_sliding": False}, "output": {"no_resume": False}}))
    cfg = train_config(parse(["train", "--config", str(f)]))
    assert cfg.drafter.sliding_causal is True and cfg.output.resume is True and cfg.run.epochs == 6


def test_old_and_flat_config_keys_load(tmp_path, caplog):
    """A --config file with the old flag's key (max_tokens, under its section or under the flat ``options`` of
    older releases) sets today's token_budget, with a warning; a key no flag ever had is still refused."""
    f = tmp_path / "old.yaml"
    f.write_text(yaml.safe_dump({"run": {"store": ["/s"], "out": "/o"}, "batch": {"max_tokens": 321}}))
    with caplog.at_level("WARNING", logger="hsstore"):
        assert train_config(parse(["train", "--config", str(f)])).batch.token_budget == 321
    assert "max_tokens is the old name of token_budget" in caplog.text
    f.write_text(yaml.safe_dump({"options": {"store": ["/s"], "out": "/o", "max_tokens": 5, "lr": 0.5}}))
    settings = train_config(parse(["train", "--config", str(f)]))
    assert settings.batch.token_budget == 5 and settings.schedule.lr == 0.5 and settings.run.store == ["/s"]
    f.write_text(yaml.safe_dump({"batch": {"max_tokenz": 5}}))
    with pytest.raises(SystemExit):
        parse(["train", "--config", str(f)])


def test_resume_keys_are_the_hand_written_ones():
    """The settings a resumed run may not change, as the tuple was written before the schema, plus follow (#57:
    epoch 0's order is the arrivals' order, so a resumed run may not switch it)."""
    before = ("store", "weight", "seed", "token_budget", "anchors", "block_size", "draft_layers",
              "sliding_window", "sliding_causal", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "rope_theta", "mask_token_id", "gamma", "workers", "follow")
    assert sorted(RESUME_KEYS) == sorted(before) and len(RESUME_KEYS) == len(before)


def test_old_recorded_keys_are_read_by_todays_names():
    """A train_config.json / trainer.json written when the budget was named max_tokens, and the stores stores,
    means the same settings."""
    now = recordable_config(build(TrainSettings, store=["/s"], out="/o", token_budget=512, weight=[1.0]))
    renamed = {"token_budget": "max_tokens", "store": "stores", "weight": "weights", "val_store": "val_stores"}
    old = {renamed.get(k, k): v for k, v in now.items()}
    assert "token_budget" not in old and "store" not in old and saved_config(old) == now


def test_settings_by_name_are_the_schema():
    """``build`` puts each setting named in its section, with the schema's defaults for the rest; the ones
    without a flag are said so in the schema (cli=False) and come from elsewhere in the CLI (-q, -S) or the API
    only; the sections' checks run."""
    settings = build(TrainSettings, store=["/s"], out="/o", lr=1e-3, token_budget=77)
    assert settings.schedule.lr == 1e-3 and settings.batch.token_budget == 77 and settings.run.epochs == 6
    assert settings.drafter == type(settings.drafter)()  # untouched sections: their defaults
    with pytest.raises(TypeError, match="no settings named"):
        build(TrainSettings, store=["/s"], out="/o", max_tokens=1)  # the old name is the loader's, not the API's
    assert {s.name for s in settings_of(TrainSettings) if not s.how.cli} == {"ce_chunk", "ce_impl", "progress",
                                                                             "storage_options"}
    with pytest.raises(ValueError, match="--steps or --epochs"):
        build(TrainSettings, store=["/s"], out="/o", steps=1, epochs=1)
    with pytest.raises(TypeError):
        build(TrainSettings, out="/o")  # stores has no default


def test_meter_sums_by_name():
    """Two steps of block 4 (3 draft positions), one empty: loss = sum(w * CE) / sum(w), tau weighted by
    anchors, acc_k = right drafts / labels per position, acc over all positions."""
    m = Meter(4)
    t = torch.tensor
    m.add({"ce_sum": t(6.0), "weight_sum": t(3.0), "tau": t(2.0), "hits_k": t([2, 1, 0])}, [2, 2, 1], tokens=40,
          samples=2, anchors=2)
    m.add({}, None, tokens=0, samples=0, anchors=0)  # an empty step (this rank had no batch)
    m.add({"ce_sum": t(2.0), "weight_sum": t(1.0), "tau": t(3.0), "hits_k": t([1, 0, 0])}, [1, 0, 1], tokens=20,
          samples=1, anchors=1)
    s = m.summary(1, None)
    assert s["loss"] == 8.0 / 4.0 and s["tau"] == (2.0 * 2 + 3.0) / 3
    assert s["acc_k"][0] == 1.0 and s["acc_k"][1] == 0.5 and s["acc_k"][2] == 0.0
    assert s["acc"] == 4 / 7 and s["tokens"] == 60 and s["samples"] == 3 and m.sums["steps"] == 3
    m.reset()
    assert math.isnan(m.summary(1, None)["loss"])


@pytest.mark.parametrize("given, want", [([], "auto"), (["--checkpoint-layers"], "mlp"),
                                         (["--checkpoint-layers", "full"], "full"),
                                         (["--checkpoint-layers", "mlp"], "mlp")])
def test_checkpoint_layers_flag(given, want):
    """The bare flag (all that existed before the policies) is the MLP-half recompute; ``full`` the whole layer."""
    assert train_config(parse(["train", "--store", "/s", "--out", "/o", *given])).memory.checkpoint_layers == want


@pytest.mark.parametrize("value, want", [(True, "mlp"), (False, "auto"), ("full", "full"), ("off", "off")])
def test_checkpoint_layers_in_a_config_file(tmp_path, value, want):
    """A file written when the setting was a bool keeps its meaning: true is the bare flag, false its absence."""
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"run": {"store": ["/s"], "out": "/o"}, "data": {"checkpoint_layers": value}}))
    assert train_config(parse(["train", "--config", str(f)])).memory.checkpoint_layers == want


def test_checkpoint_layers_refuses_an_unknown_policy(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse(["train", "--store", "/s", "--out", "/o", "--checkpoint-layers", "attention"])
    assert "invalid choice: 'attention'" in capsys.readouterr().err
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"run": {"store": ["/s"], "out": "/o"}, "data": {"checkpoint_layers": "some"}}))
    with pytest.raises((SystemExit, ValueError)):
        train_config(parse(["train", "--config", str(f)]))
