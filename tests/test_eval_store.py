"""Teacher-forced evaluation from a store alone (``hsstore eval`` without --model, ``train --val-store``): every
valid anchor, deterministic, acceptance a non-increasing prefix share, tau = 1 + its sum; checked against hand
computations and an independent one-anchor-at-a-time loop."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import hsstore
from hsstore.app.cli import main as hsstore_cli
from hsstore.app.schema import build
from hsstore.train.checkpoint import latest_checkpoint, load_drafter
from hsstore.train.evaluate import eval_source, evaluate
from hsstore.train.model import DFlashDrafter, DrafterConfig
from hsstore.train.build import load_frozen
from hsstore.train.trainer import TrainSettings, train
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

from conftest import make_manifest, write_samples

H, V, MASK, C, S, GAMMA = 48, 32, 31, 5, 8, 4.0  # C: the token the constant drafter always drafts


# ---------------------------------------------------------------------------------------------- hand computation


def constant_drafter() -> tuple[DFlashDrafter, torch.Tensor]:
    """A drafter whose draft layers add nothing (o_proj and down_proj zero): every block position's output is
    the normed embedding of its block token, so every draft (positions 1..S-1: the mask token) is argmax of
    the same logits z. Returns (drafter, z); the head makes C that argmax."""
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, vocab_size=V, target_layers=[1, 3, 5], mask_token_id=MASK,
                        num_heads=4, num_kv_heads=2, head_dim=12, num_layers=2, block_size=S,
                        sliding_window=[10, None], max_position=512)
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    head[C] = embed[MASK] * 0.4
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, embed, head)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    x = embed[MASK].double()
    z = head.double() @ (x / torch.sqrt(x.pow(2).mean() + cfg.rms_norm_eps))  # RMSNorm, weight 1
    assert int(z.argmax()) == C
    return drafter, z


def controlled_samples():
    """Tokens that are C with probability 0.6; a prompt, a response, and in some samples a second prompt
    inside the response (a masked gap); lengths from 9 to 90."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(14):
        T = int(torch.randint(9, 91, (1,), generator=g))
        ids = torch.where(torch.rand(T, generator=g) < 0.6, C, torch.randint(0, V - 1, (T,), generator=g))
        lm = torch.zeros(T, dtype=torch.bool)
        lm[int(torch.randint(1, 6, (1,), generator=g)):] = True
        if i % 3 == 0 and T > 30:
            lm[T // 2:T // 2 + 3] = False
        out.append({"sample_id": f"c{i}", "input_ids": ids, "loss_mask": lm,
                    "hidden_states": torch.randn(T, 3, H, generator=g).to(torch.bfloat16)})
    return out


def hand_eval(samples, z):
    """Acceptance, tau, loss and acc_k of the constant drafter, by the definitions, one anchor at a time."""
    ce = torch.logsumexp(z, 0) - z  # CE of each label under the constant logits
    prefixes, num, den = [], 0.0, 0.0
    hits, labels = [0] * (S - 1), [0] * (S - 1)
    for s in samples:
        ids, lm = s["input_ids"].tolist(), s["loss_mask"].tolist()
        T = len(ids)
        for p in range(T - 1):
            if not (lm[p] and lm[p + 1]):
                continue
            n, open_ = 0, True
            for k in range(1, S):
                labelled = p + k < T and lm[p + k]
                right = labelled and ids[p + k] == C
                open_ = open_ and right
                n += open_
                if labelled:
                    w = math.exp(-(k - 1) / GAMMA)
                    num, den = num + w * float(ce[ids[p + k]]), den + w
                    hits[k - 1] += right
                    labels[k - 1] += 1
            prefixes.append(n)
    N = len(prefixes)
    acceptance = [sum(n >= k for n in prefixes) / N for k in range(1, S)]
    return dict(anchors=N, acceptance=acceptance, tau=sum(1 + n for n in prefixes) / N, loss=num / den,
                acc_k=[h / n for h, n in zip(hits, labels)])


@pytest.fixture(scope="module")
def controlled_store(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("controlled") / "s")
    samples = controlled_samples()
    write_samples(url, make_manifest(), samples)
    return url, samples


def test_store_eval_equals_hand_computation(controlled_store):
    url, samples = controlled_store
    drafter, z = constant_drafter()
    expect = hand_eval(samples, z)
    assert 0.2 < expect["acceptance"][1] < expect["acceptance"][0] < 0.9  # a case where the prefix rule matters
    # small batches and anchor chunks: padding rows, rows that run out of anchors, many chunks
    got = evaluate(drafter, eval_source(url, [1, 3, 5], token_budget=200), torch.device("cpu"), gamma=GAMMA,
                   anchor_chunk=5)
    assert got.samples == len(samples) and got.anchors == expect["anchors"]
    assert got.acceptance == pytest.approx(expect["acceptance"], abs=1e-12)
    assert got.tau == pytest.approx(expect["tau"], abs=1e-12)
    assert got.tau == pytest.approx(1 + sum(got.acceptance), abs=1e-12)
    assert got.loss == pytest.approx(expect["loss"], rel=1e-5)
    assert got.acc_k == pytest.approx(expect["acc_k"], abs=1e-12)
    # per-position accuracy is not acceptance: position 2 is right more often than "1 and 2 both right"
    assert got.acc_k[1] > got.acceptance[1] + 0.1


def test_store_eval_is_deterministic_and_monotone(controlled_store):
    url, _ = controlled_store
    drafter, _ = constant_drafter()
    runs = [evaluate(drafter, eval_source(url, [1, 3, 5], token_budget=m), torch.device("cpu"), gamma=GAMMA,
                     anchor_chunk=c) for m, c in [(200, 5), (200, 5), (4096, 512)]]
    assert runs[0].to_dict() | {"seconds": 0} == runs[1].to_dict() | {"seconds": 0}
    # another batching: the same anchors, counts and (up to float summation order) loss
    for key in ("acceptance", "tau", "anchors", "samples", "labels", "acc_k"):
        assert getattr(runs[2], key) == getattr(runs[0], key), key
    assert runs[2].loss == pytest.approx(runs[0].loss, rel=1e-6)
    a = runs[0].acceptance
    assert all(x >= y for x, y in zip(a, a[1:])) and a[-1] < a[0]


# ---------------------------------------------------------------------------------------------- a real store


def per_anchor_reference(drafter, store, gamma):
    """Each sample alone (unpadded, one forward with all its anchors, full logits), then anchor by anchor:
    loss, acceptance and tau by the definitions."""
    num = den = 0.0
    prefixes = []
    for i in range(len(store)):
        item = store.read(i, layers=drafter.config.target_layers)
        ids, lm = item["input_ids"].long(), item["loss_mask"].bool()
        T = ids.shape[0]
        anchors = [p for p in range(T - 1) if lm[p] and lm[p + 1]]
        with torch.no_grad():
            logits = drafter(item["hidden_states"].float()[None], ids[None], torch.tensor([anchors]))[0].double()
        for a, p in enumerate(anchors):
            n, open_ = 0, True
            for k in range(1, drafter.config.block_size):
                labelled = p + k < T and bool(lm[p + k])
                open_ = open_ and labelled and int(logits[a, k].argmax()) == int(ids[p + k])
                n += open_
                if labelled:
                    w = math.exp(-(k - 1) / gamma)
                    num += w * float(F.cross_entropy(logits[a, k], ids[p + k]))
                    den += w
            prefixes.append(n)
    N = len(prefixes)
    return dict(anchors=N, loss=num / den, tau=sum(1 + n for n in prefixes) / N,
                acceptance=[sum(n >= k for n in prefixes) / N for k in range(1, drafter.config.block_size)])


@pytest.fixture(scope="module")
def trained(store32, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("run")
    train(build(TrainSettings, store=[store32], out=str(out), steps=4, lr=3e-3, warmup=0.0, **FAST))
    store = hsstore.open(store32)
    _, embed, head = load_frozen(store, dtype=torch.float32)
    return out, load_drafter(out, embed, head).eval()


def test_store_eval_equals_one_anchor_at_a_time(store32, trained):  # noqa: F811
    _, drafter = trained
    store = hsstore.open(store32)
    gamma = 4.0  # block 8
    expect = per_anchor_reference(drafter, store, gamma)
    got = evaluate(drafter, eval_source(store32, store.layers, token_budget=700), torch.device("cpu"), anchor_chunk=64)
    assert got.anchors == expect["anchors"] and got.samples == len(store)
    assert got.loss == pytest.approx(expect["loss"], rel=1e-5)
    assert got.acceptance == pytest.approx(expect["acceptance"], abs=1e-12)
    assert got.tau == pytest.approx(expect["tau"], abs=1e-12)
    print(f"every anchor of the tiny store: {got.anchors} anchors, {got.samples} samples, loss {got.loss:.4f}, "
          f"tau {got.tau:.4f}, acceptance {[round(x, 4) for x in got.acceptance]}, {got.seconds:.2f}s")


def test_eval_cli_without_target(store32, trained, capsys):  # noqa: F811
    out, drafter = trained
    rc = hsstore_cli(["eval", "--store", store32, "--drafter", str(out), "--json", "--device", "cpu",
                      "-q"])
    text = capsys.readouterr().out
    assert rc == 0, text
    got = json.loads(text)
    ref = evaluate(drafter, eval_source(store32, hsstore.open(store32).layers, token_budget=16384), torch.device("cpu"))
    assert got["anchors"] == ref.anchors and got["acceptance"] == ref.acceptance and got["tau"] == ref.tau
    assert got["loss"] == pytest.approx(ref.loss, rel=1e-6)
    assert len(got["acceptance"]) == drafter.config.block_size - 1 and got["samples"] == len(hsstore.open(store32))

    rc = hsstore_cli(["eval", "--store", store32, "--drafter", str(out), "--device", "cpu", "-q"])
    text = capsys.readouterr().out
    assert rc == 0 and "tau" in text and "acceptance" in text and f"{ref.anchors:,} anchors" in text
    assert f"the mean over all {ref.anchors:,} anchors" in text  # a teacher-forced tau says how it is averaged
    # prompts without a target to decode them: refused
    assert hsstore_cli(["eval", "--store", store32, "--drafter", str(out), "--input", "x.jsonl"]) == 2


def test_train_logs_validation(store32, tmp_path):  # noqa: F811
    result = train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=3, val_store=[store32], val_every=2,
                         **{**FAST, "log_every": 10}))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3]  # the val steps are logged (and the last)
    assert all(r["loss"] is not None and r["val_tau"] >= 1 and len(r["val_acceptance"]) == 7 for r in rows)
    assert rows[0]["val_loss"] != rows[1]["val_loss"]  # the drafter changed in between
    # the last validation is the final drafter's store-only evaluation
    store = hsstore.open(store32)
    _, embed, head = load_frozen(store, dtype=torch.float32)
    drafter = load_drafter(latest_checkpoint(tmp_path), embed, head)  # its fp32 master weights, as trained
    ref = evaluate(drafter, eval_source(store32, store.layers, FAST["token_budget"]))
    assert rows[-1]["val_tau"] == ref.tau and rows[-1]["val_anchors"] == ref.anchors
    assert rows[-1]["val_loss"] == pytest.approx(ref.loss, rel=1e-6)
    assert result.last["val_tau"] == ref.tau


def test_train_refuses_a_validation_store_of_another_target(store32, controlled_store, tmp_path):  # noqa: F811
    from hsstore.errors import ManifestError

    with pytest.raises(ManifestError, match="validation store"):
        train(build(TrainSettings, store=[store32], out=str(tmp_path), steps=1, val_store=[controlled_store[0]],
                    **FAST))
