"""The trainer: fed by the store it equals training fed by a live target, resumes exactly, never needs the
target, saves without pickle. Tiny Qwen3.5 target, CPU, a float32 (lossless) store."""

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hsstore
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.extract.tiny import build_tiny_target
from hsstore.extract.tokenize import load_samples
from hsstore.app.schema import build
from hsstore.train import checkpoint as ckpt
from hsstore.train.build import drafter_config, load_frozen, pick_mask_token
from hsstore.train.trainer import TrainSettings, train
from train_helpers import FAST, REPO, small_input, store32  # noqa: F401  (fixtures)


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir) -> dict[str, torch.Tensor]:
    """The fp32 trainable weights of the run's last checkpoint (the served drafter/ holds them in bf16)."""
    return load_file(str(ckpt.latest_checkpoint(run_dir) / ckpt.MASTER))


# ---------------------------------------------------------------------------------------------- store == online


class OnlineBatches:
    """The same batches as a store-fed run (its logged sample order), with features from a live target forward
    (plain transformers ``output_hidden_states``, not extraction's hooks; layer l = hidden_states[l + 1])."""

    def __init__(self, model, taps, samples, steps):
        self.model, self.taps, self.samples, self.steps = model, taps, samples, steps
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return None

    def __iter__(self):
        for row in self.steps:
            if row["epoch"] != self.epoch:
                continue
            items = []
            for sid in row["samples"]:
                s = self.samples[sid]
                ids = torch.from_numpy(s.input_ids.astype("int64"))
                with torch.no_grad():
                    hs = self.model(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    output_hidden_states=True, use_cache=False).hidden_states
                feats = torch.stack([hs[l + 1][0] for l in self.taps], dim=1)
                mask = torch.from_numpy(s.loss_mask.astype(bool))
                items.append({"sample_id": sid, "input_ids": ids, "loss_mask": mask, "hidden_states": feats})
            yield hsstore.collate_padded(items)


def test_store_fed_training_equals_online_training(store32, tiny_dir, small_input, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    steps = 5
    train(build(TrainSettings, store=[store32], out=str(tmp_path / "store"), steps=steps, log_samples=True, **FAST))
    order = [json.loads(line) for line in (tmp_path / "store" / "samples.rank00000.jsonl").read_text().splitlines()]
    assert len(order) == steps and {r["epoch"] for r in order} == {0, 1}  # crosses an epoch boundary

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    samples = {s.sample_id: s for s in load_samples(small_input, tok)}
    taps = hsstore.open(store32).layers
    online = OnlineBatches(model, taps, samples, order)
    train(build(TrainSettings, store=[store32], out=str(tmp_path / "online"), steps=steps, **FAST), source=online)

    assert losses(tmp_path / "store") == losses(tmp_path / "online")  # identical, not close
    a, b = weights(tmp_path / "store"), weights(tmp_path / "online")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- resume


def test_resume_reproduces_uninterrupted_run(store32, tmp_path):
    cfg = dict(store=[store32], steps=7, save_every=2, keep=0, **FAST)
    full = tmp_path / "full"
    train(build(TrainSettings, out=str(full), **cfg))
    assert [p.name for p in ckpt.list_checkpoints(full)] == [f"step_{s:08d}" for s in (2, 4, 6, 7)]

    # an interrupted run: only the mid-epoch checkpoint of step 2 survived, metrics went further
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for p in ckpt.list_checkpoints(cut)[1:]:
        shutil.rmtree(p)
    shutil.rmtree(cut / "drafter")
    assert json.loads((ckpt.latest_checkpoint(cut) / "trainer.json").read_text())["epoch"] == 0
    train(build(TrainSettings, out=str(cut), **cfg))

    assert losses(cut) == losses(full) and len(losses(full)) == 7
    a, b = weights(full), weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_other_settings(store32, tmp_path):
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=1, **FAST))
    with pytest.raises(ValueError, match="other settings"):
        train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=2, **{**FAST, "anchors": 16}))


def test_resume_reads_a_checkpoint_that_names_the_budget_max_tokens(store32, tmp_path):
    """A checkpoint whose trainer.json records the budget under its old name resumes with the same budget, and
    refuses another one, naming it."""
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=1, **FAST))
    state_file = ckpt.latest_checkpoint(tmp_path) / "trainer.json"
    state = json.loads(state_file.read_text())
    state["config"]["max_tokens"] = state["config"].pop("token_budget")
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=f"token_budget: {FAST['token_budget']} -> 512"):
        train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=2, **{**FAST, "token_budget": 512}))
    assert train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=2, **FAST)).start_step == 1


def test_checkpoints_are_pickle_free_and_optimizer_roundtrips(store32, tmp_path):
    train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=2, **FAST))
    last = ckpt.latest_checkpoint(tmp_path)
    names = {p.name for p in last.iterdir()}
    assert names == {"config.json", "model.safetensors", "model.safetensors.index.json", "hsstore_drafter.json",
                     "README.md", "modeling_dflash.py",
                     "master_weights.safetensors", "optimizer.safetensors", "trainer.json",
                     "rank00000.safetensors", "loader.rank00000.json"}
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.bin"))

    p = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(p.parameters(), lr=1e-3)
    p(torch.randn(2, 4)).sum().backward()
    opt.step()
    tensors, meta = ckpt.optimizer_to_safetensors(opt)
    back = ckpt.optimizer_from_safetensors(tensors, json.loads(json.dumps(meta)))
    opt2 = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    opt2.load_state_dict(back)
    for k, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(v, opt2.state_dict()["state"][k][name])


# ---------------------------------------------------------------------------------------------- store only


def test_training_needs_only_the_store(small_input, tmp_path):
    """Extract, delete the target directory, train in a fresh process that never imports extract or transformers."""
    target = build_tiny_target(tmp_path / "target")
    store = tmp_path / "store"
    run_extract(build(ExtractSettings, model=str(target), input=[str(small_input)], out=str(store), device="cpu",
                      progress=False))
    shutil.rmtree(target)
    code = textwrap.dedent(f"""
        import sys
        from hsstore.app.schema import build
        from hsstore.train.trainer import TrainSettings, train
        r = train(build(TrainSettings, store=[{str(store)!r}], out={str(tmp_path / 'run')!r}, steps=2, **{FAST!r}))
        assert r.steps == 2 and r.drafter_dir is not None
        bad = sorted(m for m in sys.modules if m.split('.')[0] in ('extract', 'transformers'))
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
    assert len(losses(tmp_path / "run")) == 2


def test_train_package_never_imports_extract():
    for path in (REPO / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "extract" for n in names), f"{path.name} imports extract"


# ---------------------------------------------------------------------------------------------- config from the store


def test_drafter_config_from_store_assets(store32):
    store = hsstore.open(store32)
    target_cfg, embed, head = load_frozen(store)
    cfg = drafter_config(store.manifest, target_cfg, embed.shape[0], build(TrainSettings, store=[store32], out="x",
                         draft_layers=3), torch.device("cpu"))
    assert cfg.target_layers == store.layers and cfg.hidden_size == store.manifest.hidden_size
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 32, embed.shape[0])
    assert cfg.sliding_window == [2048, 2048, None] and cfg.attn_impl == "blocks"  # --attn auto
    # the tiny tokenizer fills the embedding: the mask token is the pad token
    assert cfg.mask_token_id == target_cfg["pad_token_id"]


def test_mask_token_rule(manifest):
    cfg = {"pad_token_id": 7}
    m = manifest  # tokenizer.vocab_size None
    assert pick_mask_token(cfg, m, 100) == 7
    from dataclasses import replace

    padded = replace(m, tokenizer=replace(m.tokenizer, vocab_size=90))
    assert pick_mask_token(cfg, padded, 100) == 90  # first unused embedding row
    assert pick_mask_token(cfg, padded, 100, requested=3) == 3
    with pytest.raises(ValueError):
        pick_mask_token({}, m, 100)


@pytest.mark.slow
def test_resume_exact_with_loader_workers(store32, tmp_path):
    """With worker processes (torchdata's StatefulDataLoader, spawned) the saved state is the loader's own."""
    cfg = dict(store=[store32], steps=4, save_every=2, keep=0, workers=1, **FAST)
    train(build(TrainSettings, out=str(tmp_path / "full"), **cfg))
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(ckpt.checkpoint_dir(tmp_path / "cut", 4))
    train(build(TrainSettings, out=str(tmp_path / "cut"), **cfg))
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")


def test_ctrl_c_checkpoints_at_a_step_boundary_and_resumes(store32, tmp_path):
    """Ctrl-C during `hsstore train`: a checkpoint of the last finished step, exit 130 with a line saying
    so, and the same command resumes from it (nothing since the last --save-every is lost)."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hsstore", "train", "--store", store32, "--out", str(out), "--steps", "400",
           "--save-every", "1000", "--log-every", "1", "--draft-layers", "1", "--block-size", "8", "--anchors", "8",
           "--token-budget", "1024", "--device", "cpu", "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "stopped at step" in err and "hsstore train: interrupted" in err
    assert "training on cpu x 1: drafter 1 layers (full)" in err  # the effective settings, at the start
    step = int(err.split("stopped at step ")[1].split(":")[0])
    assert 3 <= step < 400 and (out / "checkpoints" / f"step_{step:08d}").is_dir()
    assert len(metrics.read_text().splitlines()) == step  # every finished step was logged and kept
    rc = subprocess.run(cmd[:cmd.index("--steps") + 1] + [str(step + 2)] + cmd[cmd.index("--steps") + 2:],
                        capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0 and f"resumed from" in rc.stdout and f"step_{step:08d}" in rc.stdout


def test_metrics_lines_cover_every_step_across_a_ctrl_c_and_the_summary_adds_them_up(store32, tmp_path):
    """Ctrl-C between two metrics lines: the steps since the last line are logged before the checkpoint (they
    were logged nowhere), so the lines of the two runs cover every step once, each saying how many steps and
    seconds it covers; each run's summary is its lines' tokens over their seconds, not the last line's rate."""
    import signal
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hsstore", "train", "--store", store32, "--out", str(out), "--steps", "400",
           "--save-every", "1000", "--log-every", "1000", "--log-samples", "--draft-layers", "1", "--block-size", "8",
           "--anchors", "8", "--token-budget", "1024", "--device", "cpu", "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps_log = out / "samples.rank00000.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not steps_log.exists() or len(steps_log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    step = int(err.split("stopped at step ")[1].split(":")[0])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["interval_steps"]) for r in lines] == [(step, step)]  # no line was due before the stop
    more = cmd[:cmd.index("--steps") + 1] + [str(step + 3)] + cmd[cmd.index("--steps") + 2:] + ["--json"]
    done = subprocess.run(more, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["interval_steps"]) for r in lines] == [(step, step), (step + 3, 3)]
    store = hsstore.open(store32)
    length = dict(zip(store.table.sample_id.tolist(), store.table.samples["length"].tolist()))
    stepped = [json.loads(x) for x in steps_log.read_text().splitlines()]
    assert [r["step"] for r in stepped] == list(range(1, step + 4))  # every step once
    assert sum(r["tokens"] for r in lines) == sum(length[i] for r in stepped for i in r["samples"])
    this_run = lines[-1]
    assert summary["tokens"] == this_run["tokens"] > 0 and summary["step_seconds"] == this_run["interval_seconds"]
    assert summary["tokens_per_s"] == pytest.approx(this_run["tokens"] / this_run["interval_seconds"])
    assert summary["step_seconds"] <= summary["seconds"]


def test_train_help_shows_the_defaults(capsys):
    from hsstore.app.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--token-budget", "16384"), ("--anchors", "512"), ("--draft-layers", "5"),
                          ("--sliding-window", "2048"), ("--lr", "0.0006"), ("--save-every", "1000")]:
        assert f"(default: {default}" in out.split(flag, 2)[2].split(" --", 1)[0], flag


def test_cpu_defaults_and_a_step_too_big_for_this_machine_is_refused(store32, tmp_path, caplog, capsys):  # noqa: F811
    """On a CPU, unset batch settings are a quarter of the GPU recipe's, said in the settings line; a step whose
    estimate exceeds the memory available is refused in one line before training (the kernel would kill it)."""
    from hsstore.app.cli import main
    from hsstore.app.devices import DEVICE_DEFAULTS
    from hsstore.train.budget import available_bytes

    with caplog.at_level("INFO", logger="hsstore.train"):
        assert main(["train", "--store", store32, "--out", str(tmp_path / "a"), "--steps", "1", "--draft-layers", "1",
                     "--block-size", "8", "--device", "cpu", "-q"]) == 0
    cpu = DEVICE_DEFAULTS["cpu"]
    assert f"{cpu.token_budget:,} tokens per batch and rank, {cpu.anchors} anchors per sequence" in caplog.text
    assert cpu != DEVICE_DEFAULTS["cuda"]
    have = available_bytes()
    assert have is not None
    rc = main(["train", "--store", store32, "--out", str(tmp_path / "b"), "--steps", "1", "--device", "cpu",
               "--token-budget", "4000000", "--anchors", "100000", "--draft-layers", "5", "-q"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB available: lower --token-budget and --anchors" in err[0], err
    assert not (tmp_path / "b" / "checkpoints").exists()  # refused before any step


def test_train_says_what_it_starts_before_the_heavy_imports(store32, tmp_path):  # noqa: F811
    """#38.5: `train` printed nothing for ~25 s (torch, the trainer, the stores): its first line now comes before
    torch is imported, naming the stores and the output."""
    code = textwrap.dedent("""
        import logging, sys
        first = []
        class First(logging.Handler):
            def emit(self, record):
                if record.name.startswith("hsstore") and not first:
                    first.append((record.getMessage(), "torch" in sys.modules))
        logging.getLogger().addHandler(First())
        from hsstore.app.cli import main
        rc = main(sys.argv[1:])
        print(rc, repr(first[0]))
    """)
    out = subprocess.run([sys.executable, "-c", code, "train", "--store", store32, "--out", str(tmp_path / "run"),
                          "--steps", "1", "--draft-layers", "1", "--token-budget", "1024", "--anchors", "8", "-q",
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    rc, first = out.stdout.strip().splitlines()[-1].split(" ", 1)
    message, torch_loaded = ast.literal_eval(first)
    assert rc == "0", out.stderr[-2000:]
    assert message.startswith("train: loading torch") and store32 in message and str(tmp_path / "run") in message
    assert torch_loaded is False


def test_a_resume_with_another_length_says_so_and_counts_this_runs_steps(store32, tmp_path, capsys, caplog):  # noqa: F811
    """#38.11: resuming with a different --steps was silent, and the summary counted every step of the run
    ('trained 8 steps ... in 24.4s' for a run that did 3)."""
    from hsstore.app.cli import main

    flags = ["train", "--store", store32, "--out", str(tmp_path / "run"), "--token-budget", "1024", "--draft-layers", "1",
             "--block-size", "8", "--anchors", "32", "--device", "cpu", "-q"]
    assert main([*flags, "--steps", "3"]) == 0
    assert "trained 3 steps (" in capsys.readouterr().out
    with caplog.at_level("WARNING", logger="hsstore.train"):
        assert main([*flags, "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "with another length: --steps 3 before, --steps 5 now" in caplog.text
    assert "trained 2 steps in this run, resumed from " in out and "at step 3 (5 in all)" in out
    assert main([*flags, "--steps", "5", "--json"]) == 0  # nothing left to do: 0 this run
    summary = json.loads(capsys.readouterr().out)
    assert (summary["steps"], summary["steps_this_run"], summary["start_step"]) == (5, 0, 5)


def test_refusals_that_need_nothing_loaded_come_first_and_leave_no_folder(store32, tmp_path):  # noqa: F811
    """#53.12: a missing store, a user's folder as --out or a missing --val-store is one line before the first
    (torch, the trainer); a refusal after it (an --init that is no drafter) leaves no OUT behind either."""
    def train_cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hsstore", "train", *argv, "--steps", "1", "--device", "cpu",
                               "-q"], capture_output=True, text=True, timeout=300)

    out = tmp_path / "new" / "run"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for argv, said in ((["--store", str(tmp_path / "nope"), "--out", str(out)], "does not exist"),
                       (["--store", store32, "--out", str(mine)], "not empty (notes.txt)"),
                       (["--store", store32, "--out", str(out), "--val-store", str(tmp_path / "noval")],
                        "does not exist")):
        done = train_cli(*argv)
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(err) == 1 and err[0].startswith("hsstore train: error: "), done.stderr
        assert said in err[0]
        assert not (tmp_path / "new").exists() and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    done = train_cli("--store", store32, "--out", str(out), "--init", str(tmp_path / "mine"))
    assert done.returncode == 2 and "loading torch" in done.stderr  # refused by the trainer, after the first line
    assert not (tmp_path / "new").exists()


def test_a_cpu_run_says_what_it_will_cost_after_its_first_step(store32, tmp_path, caplog):  # noqa: F811
    """#53.7: on a CPU the recipe's drafter takes seconds a step; after the first step a line says the run's cost at
    that pace and the flags that cut it (with -q nothing else would)."""
    import re
    from datetime import timedelta

    from hsstore.app.cli import main

    with caplog.at_level("INFO", logger="hsstore.train"):
        assert main(["train", "--store", store32, "--out", str(tmp_path / "a"), "--steps", "3", "--draft-layers", "2",
                     "--block-size", "8", "--anchors", "24", "--token-budget", "1024", "--device", "cpu", "-q"]) == 0
    [line] = [r.getMessage() for r in caplog.records if "on the CPU: the" in r.getMessage()]
    m = re.match(r"step 1 took ([0-9.]+)s on the CPU: the 2 step\(s\) left take about (\d+):(\d\d):(\d\d) \(h:mm:ss\)",
                 line)
    assert m, line
    took, (h, mi, s) = float(m.group(1)), map(int, m.groups()[1:])
    assert abs(timedelta(hours=h, minutes=mi, seconds=s).total_seconds() - 2 * took) <= 1.1  # 2 steps at that pace
    assert "--anchors, now 24" in line and "--draft-layers, now 2" in line and "--steps N" in line


def test_loader_workers_on_a_cpu_say_they_slow_it(store32, tmp_path, caplog):  # noqa: F811
    """#53.12: --workers 2 on a CPU made training 2.4x slower, silently: the run now says why it may."""
    pytest.importorskip("torchdata")
    from hsstore.app.cli import main

    with caplog.at_level("WARNING", logger="hsstore.train"):
        assert main(["train", "--store", store32, "--out", str(tmp_path / "a"), "--steps", "1", "--draft-layers", "1",
                     "--block-size", "8", "--anchors", "8", "--token-budget", "1024", "--device", "cpu", "-q",
                     "--workers", "1"]) == 0
    assert "--workers 1 on a CPU: the loader's worker processes take the cores the step computes on" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hsstore.train"):
        assert main(["train", "--store", store32, "--out", str(tmp_path / "b"), "--steps", "1", "--draft-layers", "1",
                     "--block-size", "8", "--anchors", "8", "--token-budget", "1024", "--device", "cpu", "-q"]) == 0
    assert "on a CPU" not in caplog.text
