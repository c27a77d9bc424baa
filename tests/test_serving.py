"""One meaning for every tap id, and who serves which taps (hsstore/format/serving.py), end to end.

Expected facts come from the engines' and peers' own code, as read (commits in serving.py's docstring), emulated
here independently of hsstore's capture:

* SGLang: ``set_dflash_layers_to_capture`` sets ``layers_to_capture = [l + 1 for l in ids]`` and Qwen3.5's model
  marks ``self.layers[i]`` for each (a capture before layer i): index ``N`` is past the list.
* vLLM: ``aux = maybe_add([], 0, h, r)`` then after layer ``idx`` ``maybe_add(aux, idx + 1, h, r)`` with
  ``hidden + residual``, so ids ``1..N`` are the layer outputs before the norm; DFlash ``target_layer_ids`` are
  re-based by one (``[i + 1 for i in target_layer_ids]``).
* z-lab dflash: ``extract_context_feature`` reads ``output.hidden_states[l + 1]``.
* speculators: ``hidden_states[:, :-1]`` are the drafter's input, ``hidden_states[:, -1]`` the verifier's last
  hidden state (vLLM id ``N``).

The tensor vLLM's id ``N`` carries, the last layer's output before the norm, is computed here by running the tiny
target with its final norm replaced by the identity: HF's last ``hidden_states`` entry then is that tensor.
"""

import json

import pytest
import torch

import hsstore
from hsstore.app.cli import main as hsstore_cli
from hsstore.extract.job import ExtractSettings, run_extract
from hsstore.format import serving
from hsstore.app.schema import build
from train_helpers import FAST, small_input  # noqa: F401  (fixtures)

N = 8  # the tiny target's decoder layers


def sglang_captures(ids: list[int], n: int) -> bool:
    """Whether SGLang's Qwen3.5 capture hook accepts DFlash ids ``ids`` (it marks ``layers[l + 1]``)."""
    layers = list(range(n))
    try:
        for l in (i + 1 for i in ids):
            layers[l]  # noqa: B018  (what setattr(self.layers[layer_id], ...) indexes)
    except IndexError:
        return False
    return True


def vllm_ids_captured(n: int) -> set[int]:
    """The aux ids vLLM's forward collects: 0 before the loop, idx + 1 after each layer."""
    return {0} | {idx + 1 for idx in range(n)}


@pytest.mark.parametrize("n", [8, 36, 64])
def test_registry_agrees_with_the_engines_capture_rules(n):
    for l in range(n):
        s = serving.serving([l], n)
        assert s.serves("sglang") == sglang_captures([l], n), l
        assert s.serves("vllm") == ((l + 1) in vllm_ids_captured(n)), l
        assert s.serves("dflash") == (l != n - 1), l  # hidden_states[l + 1] is the norm's output only for N - 1
        assert s.serves("train") and s.serves("specforge-dflash")
    assert not serving.serving([1, 16, 31, 46, 61], 64).serves("speculators")
    assert serving.serving([1, 16, 31, 46, 61, 63], 64).serves("speculators")
    assert serving.specforge_eagle3_ids(64) == [1, 31, 60]


def test_serve_picks_taps_for_all_or_refuses_with_one_line():
    p = serving.plan(64, None, ["speculators", "specforge-eagle3"])
    assert p.layers == [1, 16, 31, 46, 60, 61, 63] and p.final_hidden
    assert p.serving.served == ["train", "specforge-dflash", "specforge-eagle3", "speculators", "vllm"]
    assert "tap 63" in p.lines()[1] and "served by vllm" in p.lines()[1]
    with pytest.raises(ValueError, match=r"tap 63 \(needed by speculators\): SGLang captures the input of layer 64"):
        serving.plan(64, None, ["speculators", "sglang"])
    with pytest.raises(ValueError, match="z-lab dflash feeds HF hidden_states\\[64\\]"):
        serving.plan(64, [1, 63], ["dflash"])
    with pytest.raises(ValueError, match=r"layer ids \[64\] out of range"):
        serving.plan(64, [1, 64])
    with pytest.raises(ValueError, match="unknown 'sglng'"):
        serving.parse_serve("vllm,sglng")


def prenorm_last(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, H]: the last decoder layer's output before the final norm, as vLLM's aux id N carries it, computed
    without hooks: HF's last hidden_states entry with the norm replaced by the identity."""
    inner = model.model
    norm = inner.norm
    inner.norm = torch.nn.Identity()
    try:
        with torch.no_grad():
            return model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]
    finally:
        inner.norm = norm


@pytest.fixture(scope="module")
def last_tap_store(tiny_dir, small_input, tmp_path_factory):  # noqa: F811
    """A float32 store of taps 1 and N - 1 (what --serve speculators adds), each sample alone."""
    out = tmp_path_factory.mktemp("serving") / "s"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=str(out), dtype="float32",
                      device="cpu", token_budget=1, progress=False, layers=[1], serve=["speculators"]))
    return str(out)


def test_the_store_train_and_eval_hold_the_tensor_vllm_serves_for_the_last_layer(tiny_dir, last_tap_store, tok,
                                                                                   small_input):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from hsstore.train.speculative import TargetCache, load_prompts

    store = hsstore.open(last_tap_store)
    assert list(store.layers) == [1, N - 1]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    item = store.read(0)
    want = prenorm_last(model, item["input_ids"].long())
    assert torch.allclose(item["hidden_states"][:, 1], want, atol=1e-5)
    with torch.no_grad():
        post = model(input_ids=item["input_ids"].long()[None], output_hidden_states=True).hidden_states[N][0]
    assert (post - want).abs().max() > 0.1  # what z-lab dflash would feed is another tensor

    # eval --model feeds the drafter the same tensor: the cache's prefill features of a prompt
    prompt = load_prompts([str(small_input)], tok, limit=1)[0][1]
    _, feats = TargetCache(model).forward(prompt, keep=1, taps=[1, N - 1])
    assert torch.allclose(feats[:, 1], prenorm_last(model, torch.tensor(prompt)), atol=1e-5)


def test_check_and_extract_name_who_the_taps_serve(tiny_dir, small_input, tmp_path, capsys):  # noqa: F811
    assert hsstore_cli(["check", "--model", str(tiny_dir), "--input", str(small_input)]) == 0
    out = capsys.readouterr().out
    assert "taps 1,2,3,4,5 (each its decoder layer's output, before the final norm) serve train" in out
    assert f"speculators (needs layer {N - 1} (the last layer's output before the final norm" in out
    assert hsstore_cli(["check", "--model", str(tiny_dir), "--input", str(small_input), "--serve", "speculators",
                        "--json"]) == 0
    taps = json.loads(capsys.readouterr().out)["taps"]
    assert taps["layers"] == [1, 2, 3, 4, 5, N - 1] and "speculators" in taps["serves"]
    assert taps["warnings"][0].startswith(f"tap {N - 1} (") and "served by vllm" in taps["warnings"][0]

    # a set nothing serves: one line, before the tokenizer or the model is loaded, nothing written
    out_dir = tmp_path / "never"
    rc = hsstore_cli(["extract", "--model", str(tiny_dir), "--input", str(small_input), "--out", str(out_dir),
                      "--serve", "speculators,sglang", "--device", "cpu", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out_dir.exists()
    assert len(err) == 1 and f"tap {N - 1} (needed by speculators): SGLang captures" in err[0]


def test_info_export_train_and_export_drafter_say_it(last_tap_store, tmp_path, capsys, caplog):
    from hsstore.train.trainer import TrainSettings, train

    assert hsstore_cli(["info", last_tap_store]) == 0
    out = capsys.readouterr().out
    assert "before the final norm" in out and "serving    taps 1,7" in out and "sglang (tap 7: SGLang" in out
    assert "specforge-eagle3 (needs at least 3 taps" in out

    assert hsstore_cli(["export", "speculators", last_tap_store, str(tmp_path / "spec"), "-q"]) == 0
    side = json.loads((tmp_path / "spec" / "hsstore_export.json").read_text())
    assert side["tap_tensor"] == serving.TAP_TENSOR
    capsys.readouterr()

    with caplog.at_level("WARNING"):
        train(build(TrainSettings, store=[last_tap_store], out=str(tmp_path / "run"), steps=1, **FAST))
    assert any(r.getMessage().startswith("drafter tap 7 (") and "sglang cannot serve it" in r.getMessage()
               for r in caplog.records)
    assert hsstore_cli(["export-drafter", str(tmp_path / "run"), str(tmp_path / "drafter")]) == 0
    cap = capsys.readouterr()
    assert "each its target layer's output, before the final norm" in cap.out
    assert "warning: drafter tap 7" in cap.err and "served by vllm" in cap.err


def test_export_speculators_refusal_names_the_fix(tiny_dir, small_input, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "s"
    run_extract(build(ExtractSettings, model=str(tiny_dir), input=[str(small_input)], out=str(out), device="cpu",
                      progress=False, layers=[1, 2]))
    assert hsstore_cli(["export", "speculators", str(out), str(tmp_path / "x"), "-q"]) == 2
    assert "--serve speculators" in capsys.readouterr().err
