"""The peers' own released code run on what hsstore writes, and hsstore run on what the peers' own writers write.

Installed by ``.ci/run`` from ``tests/peers.txt`` (``--no-deps``: their pins would move torch, transformers or
s3fs): z-lab ``dflash`` 0.1.0, ``speculators`` 0.9.0, ``specforge`` 0.2.0. What the modules used here import comes
with the test extra. SGLang and vLLM (CUDA builds) are read, not run: the facts taken from their code are in
``test_engines_read_at_pinned_commits`` with the commits. Each peer's own code reading a plain ``hsstore export``
of it is the peer contract's (tests/test_peer_contract.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.train import checkpoint as ckpt
from hsstore.train import drafter_format
from test_drafter_export import H, L, V, tiny_drafter
from test_import import IDENTITY, SPEC_IDENTITY, bits

pytestmark = pytest.mark.slow  # the peers' own packages, imported for seconds each

PEERS = "pip install --no-deps -r tests/peers.txt (.ci/run does)"


def peer(module: str):
    return pytest.importorskip(module, reason=f"needs the peer's package: {PEERS}")


def exported_drafter(tmp_path: Path, **kw) -> tuple[Path, torch.nn.Module]:
    """A tiny drafter (a sliding layer whose window the test contexts exceed, then a full one) saved and passed
    through ``hsstore export-drafter``, and the drafter hsstore itself loads from that folder."""
    model = tiny_drafter(**{"sliding_window": [6, None], **kw})
    drafter_format.save_drafter(tmp_path / "run", model, {"taps": [1, 3, 5], "target": {"name": "tiny", "num_layers": 8}})
    assert main(["export-drafter", str(tmp_path / "run"), str(tmp_path / "d")]) == 0
    return tmp_path / "d", ckpt.load_drafter(tmp_path / "d", model.embed_tokens, model.lm_head).eval()


# ---------------------------------------------------------------------------------------------- the drafter


def test_dflash_loads_the_export_and_drafts_what_hsstore_drafts(tmp_path):
    """z-lab's DFlashDraftModel.from_pretrained on an export-drafter folder: every weight matched, and its block
    outputs (the context it is handed, then [anchor, MASK...] at positions p..p+S-1) equal hsstore's drafter's."""
    dflash = peer("dflash.model")
    folder, ours = exported_drafter(tmp_path)
    theirs, info = dflash.DFlashDraftModel.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert {k: sorted(v) for k, v in info.items() if k != "error_msgs"} == \
        {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []} and not info["error_msgs"]
    torch.manual_seed(1)
    T, S = 30, ours.config.block_size
    hs, ids = torch.randn(1, T, L, H), torch.randint(0, V - 1, (1, T))
    anchors = [3, 12, 21]  # the last two see more context than the sliding window of 6
    with torch.no_grad():
        want = ours.draft_hidden(hs, ids, torch.tensor([anchors]))[0]
        for a, p in enumerate(anchors):
            block = torch.full((1, S), ours.config.mask_token_id)
            block[0, 0] = ids[0, p]
            got = theirs.eval()(position_ids=torch.arange(p + S)[None], target_hidden=hs[:, :p].reshape(1, p, -1),
                                noise_embedding=torch.nn.functional.embedding(block, ours.embed_tokens))
            assert (got[0] - want[a]).abs().max().item() < 1e-4, p


def _automodel(folder: Path, tmp_path: Path, block_dflash: bool) -> subprocess.CompletedProcess:
    """``AutoModel.from_pretrained(folder, trust_remote_code=True)`` in a fresh process (its own module cache),
    printing the class built; ``block_dflash`` makes ``import dflash`` fail as where it is not installed."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'dflash':\n"
        "            raise ModuleNotFoundError(f\"No module named {name!r}\")\n"
        f"if {block_dflash}:\n"
        "    sys.modules.pop('dflash', None); sys.meta_path.insert(0, Block())\n"
        "from transformers import AutoModel\n"
        f"m, info = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True, output_loading_info=True)\n"
        "print(type(m).__module__ + '.' + type(m).__name__, sorted(info['missing_keys']), "
        "sorted(info['unexpected_keys']))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})


def test_automodel_builds_the_dflash_drafter_or_refuses(tmp_path):
    """#54.5: AutoModel with trust_remote_code (as z-lab's README loads its drafters) built a plain Qwen3Model
    from model_type qwen3, dropping fc and the norms. config.json's auto_map now names modeling_dflash.py, which
    builds dflash's DFlashDraftModel with every weight, or, where dflash is not installed, fails naming it."""
    peer("dflash.model")
    folder, _ = exported_drafter(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]  # what engines read
    built = _automodel(folder, tmp_path, block_dflash=False)
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.split() == ["dflash.model.DFlashDraftModel", "[]", "[]"]
    refused = _automodel(folder, tmp_path, block_dflash=True)
    assert refused.returncode != 0 and "Qwen3Model" not in refused.stdout
    assert "ImportError" in refused.stderr and "dflash" in refused.stderr.strip().splitlines()[-1]


def test_speculators_converter_takes_the_export(tmp_path):
    """speculators' DFlashConverter (its path for z-lab checkpoints) converts an export-drafter folder against a
    verifier: the body unchanged, target layer ids moved to vLLM's convention (hsstore l -> l + 1)."""
    peer("loguru")
    converter = peer("speculators.convert.dflash.converter")
    from safetensors.torch import load_file
    from speculators.models.dflash import DFlashDraftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder, _ = exported_drafter(tmp_path)
    torch.manual_seed(2)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "verifier")
    converter.DFlashConverter().convert(folder, tmp_path / "conv", base_model=str(tmp_path / "verifier"),
                                        validate=True)
    config = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 6] and config["block_size"] == 8
    converted = DFlashDraftModel.from_pretrained(str(tmp_path / "conv")).state_dict()
    for k, v in load_file(str(folder / "model.safetensors")).items():
        assert torch.equal(converted[k].to(torch.bfloat16), v), k


def test_speculators_slides_its_window_from_another_edge_and_the_card_says_so(tmp_path):
    """The one place a peer differs: speculators 0.9.0's DFlash mask lets every row of the block at anchor p see
    context j >= p - W, where SGLang, vLLM, dflash, SpecForge and hsstore use j >= p + i - (W - 1) (row i; the
    dflash test above holds hsstore to the latter). The drafter's model card names it for speculators users."""
    attention = peer("speculators.models.dflash.attention")
    W, S, T, p = 4, 4, 12, 8
    mask_mod, q_len, kv_len = attention.create_anchor_block_mask_mod(
        torch.zeros(T, dtype=torch.long), T, torch.tensor([p]), S, sliding_window=W)
    q, kv = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    zero = torch.tensor(0)
    seen = mask_mod(zero, zero, q.expand(q_len, kv_len), kv.expand(q_len, kv_len))[:, :T]
    for i in range(S):
        assert torch.nonzero(seen[i]).reshape(-1).tolist() == list(range(p - W, p)), i  # p - W, every row
    folder, _ = exported_drafter(tmp_path)
    card = (folder / drafter_format.MODEL_CARD).read_text()
    assert "speculators" in card and "p - W" in card and "p + i - (W - 1)" in card


# ---------------------------------------------------------------------------------------------- serving notes


def test_export_drafter_says_vllm_needs_its_v2_runner_for_mixed_layers(tmp_path, capsys):
    """#54.4: vLLM (qwen3_dflash.py at 036a00d) raises for drafters that mix sliding and full layers unless
    VLLM_USE_V2_MODEL_RUNNER=1; the export-drafter summary and the folder's model card say so, and say nothing
    for a drafter of one kind."""
    folder, _ = exported_drafter(tmp_path)
    out = capsys.readouterr().out
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in out and "V2 model runner" in out
    card = (folder / drafter_format.MODEL_CARD).read_text()
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in card and '"method": "dflash"' in card
    assert "--speculative-algorithm DFLASH" in card  # SGLang
    drafter_format.save_drafter(tmp_path / "full", tiny_drafter(sliding_window=None))
    assert main(["export-drafter", str(tmp_path / "full"), str(tmp_path / "full-out")]) == 0
    assert "VLLM_USE_V2_MODEL_RUNNER" not in capsys.readouterr().out
    assert "VLLM_USE_V2_MODEL_RUNNER" not in (tmp_path / "full-out" / drafter_format.MODEL_CARD).read_text()


def test_engines_read_at_pinned_commits(tmp_path):
    """Facts read from the engines that cannot be installed here (CUDA builds), checked on an exported config
    and weights file. vLLM 036a00d1f5d00d449d02dce9babdd15a5b4d06c9 (model_executor/models/qwen3_dflash.py and the
    registry): architecture DFlashDraftModel -> DFlashQwen3ForCausalLM (a dflash draft's architecture must start
    with DFlash), a Qwen3Config (model_type qwen3), per-layer causality from is_causal, else dflash_config.causal,
    else layer_types (sliding -> causal), the window from dflash_config.swa_window_size or sliding_window,
    q/k/v and gate/up stacked by name, no mask_hidden weight. SGLang 7f151c5ebdb3af4467c2a5d3ccc5f54e71d2ba35
    (srt/models/dflash.py): fc in_features = len(target_layer_ids) x hidden, block_size from dflash_config or the
    top level, weights fc / hidden_norm / norm / layers.N.* with the same stacked names, silu only."""
    folder, ours = exported_drafter(tmp_path)
    c = json.loads((folder / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["layer_types"] == ["sliding_attention", "full_attention"] and c["sliding_window"] == 6
    assert "is_causal" not in c and "causal" not in c["dflash_config"]  # sliding causal, full non-causal
    assert c["dflash_config"]["target_layer_ids"] == [1, 3, 5] and c["block_size"] == 8
    assert c["hidden_act"] == "silu" and c["attention_bias"] is False
    names = set(drafter_format.file_shapes(folder / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names and not any("mask_hidden" in n for n in names)
    stacked = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.", ".o_proj.", ".down_proj.", "_norm.",
               "layernorm.")
    assert all(n in ("fc.weight", "hidden_norm.weight", "norm.weight") or
               (n.startswith("layers.") and any(s in n for s in stacked)) for n in names), sorted(names)
    assert drafter_format.file_shapes(folder / "model.safetensors")["fc.weight"] == (H, 3 * H)


# ---------------------------------------------------------------------------------------------- file modes


def test_safetensors_files_follow_the_umask(tmp_path, new_manifest, new_samples, write):
    """#54.3: safetensors' save_file creates 0600 files: an engine or trainer running as another user could
    read the JSON beside a drafter but not its weights. Every safetensors file hsstore writes now gets the
    umask's mode, like the rest: the drafter, a checkpoint's, speculators' hs_{i} files."""
    old = os.umask(0o027)
    try:
        folder, model = exported_drafter(tmp_path)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        (tmp_path / "ckpt").mkdir()
        ckpt.write_main_files(tmp_path / "ckpt", model, opt, sched, step=1, epoch=0, config={}, world=[1, 1],
                              extra={})
        ckpt.write_rank_files(tmp_path / "ckpt", 0, None, torch.device("cpu"))
        write(str(tmp_path / "src"), new_manifest(layers=(1, 3, 7)), new_samples(2))
        assert main(["export", "speculators", str(tmp_path / "src"), str(tmp_path / "spec"), "-q"]) == 0
    finally:
        os.umask(old)
    files = [*folder.glob("*.safetensors"), *(tmp_path / "ckpt").glob("*.safetensors"),
             *(tmp_path / "spec" / "hidden_states").glob("*.safetensors")]
    assert len(files) == 1 + 4 + 2
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: "0o640" for f in files}
    assert oct((folder / "config.json").stat().st_mode & 0o777) == "0o640"


# ---------------------------------------------------------------------------------------------- the exports


def _store(tmp_path, new_manifest, new_samples, layers=(1, 3, 5), final=False, n=6, masks=()):
    """A store of ``n`` samples; ``masks`` replaces the first samples' loss masks."""
    m = new_manifest(layers=layers)
    if final:
        m = hsstore.Manifest(**{**m.__dict__, "features": ("final_hidden",)})
    samples = new_samples(n, n_layers=len(layers) + final, min_len=12, max_len=60)
    for s, mask in zip(samples, masks):
        s["loss_mask"] = torch.tensor(mask + [False] * (len(s["input_ids"]) - len(mask)))
    src = str(tmp_path / "src")
    with hsstore.StoreWriter(src, m) as w:
        for s in samples:
            kw = {"final_hidden": s["hidden_states"][:, -1]} if final else {}
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"][:, :len(layers)], **kw)
    return src, samples


def test_specforge_dflash_export_holds_only_samples_its_reader_takes(tmp_path, new_manifest, new_samples, capsys):
    """#54.2: SpecForge's offline DFlash reader refuses a sample without two consecutive supervised tokens;
    the export wrote such samples. Now they are left out, counted in the summary and listed in the sidecar, and
    every file passes SpecForge's own loading and normalisation (and holds the store's values)."""
    peer("specforge.runtime.data_plane.offline_reader")
    from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    src, samples = _store(tmp_path, new_manifest, new_samples,
                          masks=([True, False, True, False, True], [False] * 5))
    out = tmp_path / "sf"
    assert main(["export", "specforge", src, str(out)]) == 0
    summary = capsys.readouterr().out
    assert "(dflash)" in summary and "2 left out" in summary and "s0, s1" in summary
    sidecar = json.loads((out / "hsstore_export.json").read_text())
    assert sidecar["skipped"] == {"no_consecutive_loss": ["s0", "s1"]} and sidecar["sample_ids"] == \
        [s["sample_id"] for s in samples[2:]]
    files = list_feature_files(str(out))
    assert len(files) == len(samples) - 2
    store = hsstore.open(src)
    by_id = {store.read(i)["sample_id"]: store.read(i) for i in range(len(store))}
    for path, sid in zip(sorted(files, key=lambda f: int(Path(f).stem.split("_")[1])), sidecar["sample_ids"]):
        got = normalize_offline_sample(load_feature_file(path), max_len=4096)
        T = len(by_id[sid]["input_ids"])
        assert got["hidden_states"].shape == (1, T, 3 * 48)
        assert torch.equal(bits(got["hidden_states"][0].reshape(T, 3, 48)), bits(by_id[sid]["hidden_states"]))
    assert main(["import", "specforge", str(out), "--out", str(tmp_path / "back"), "-q"]) == 0
    back = hsstore.open(str(tmp_path / "back"))
    assert sorted(back.read(i)["sample_id"] for i in range(len(back))) == sidecar["sample_ids"]


def test_specforge_eagle3_export_gives_its_model_three_taps(tmp_path, new_manifest, new_samples, capsys):
    """#54.1: a final_hidden store always exported as EAGLE-3 with every tap (SpecForge's EAGLE-3 model asserts
    3 x hidden) and no flag gave its DFlash layout. --layout eagle3 takes three taps (named when the store has
    more, chosen with --layers), --layout dflash every tap; SpecForge's readers and its EAGLE-3 model take both."""
    peer("specforge.modeling.draft.llama3_eagle")
    from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    src, _ = _store(tmp_path, new_manifest, new_samples, layers=(1, 2, 3, 5, 7), final=True, n=3)
    assert main(["export", "specforge", src, str(tmp_path / "e3"), "--layout", "eagle3"]) == 0
    out = capsys.readouterr().out
    assert "(eagle3)" in out and "[1, 3, 5]" in out and "--layers" in out  # SpecForge's [1, 3, 4] for 8 layers
    eagle = LlamaForCausalLMEagle3(LlamaConfig(vocab_size=5000, draft_vocab_size=5000, hidden_size=48,
                                               intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               num_hidden_layers=1, max_position_embeddings=256))
    store = hsstore.open(src)
    data = OfflineEagle3Dataset(list_local_files(str(tmp_path / "e3")), max_len=4096)
    for i in range(len(store)):
        item, got = store.read(i), data[i]
        T = len(item["input_ids"])
        assert torch.equal(bits(got["hidden_state"][0].reshape(T, 3, 48)), bits(item["hidden_states"][:, [0, 2, 3]]))
        assert torch.equal(bits(got["target"][0]), bits(item["final_hidden"]))
        assert eagle.project_hidden_states(got["hidden_state"].float()).shape == (1, T, 48)
    assert json.loads((tmp_path / "e3" / "hsstore_export.json").read_text())["layers"] == [1, 3, 5]
    assert main(["export", "specforge", src, str(tmp_path / "e3b"), "--layout", "eagle3", "--layers", "2,5,7"]) == 0
    assert torch.equal(bits(torch.load(tmp_path / "e3b" / "rows_0-2000" / "data_0.ckpt")["aux_hidden_state"][0]
                            .reshape(-1, 3, 48)), bits(store.read(0)["hidden_states"][:, [1, 3, 4]]))
    assert main(["export", "specforge", src, str(tmp_path / "bad"), "--layout", "eagle3", "--layers", "1,2"]) == 2
    assert "exactly 3" in capsys.readouterr().err and not (tmp_path / "bad").exists()

    assert main(["export", "specforge", src, str(tmp_path / "df"), "--layout", "dflash", "-q"]) == 0
    raw = torch.load(tmp_path / "df" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    assert set(raw) == {"input_ids", "loss_mask", "hidden_states"}
    assert normalize_offline_sample(raw, 4096)["hidden_states"].shape[-1] == 5 * 48
    plain, _ = _store(tmp_path / "p", new_manifest, new_samples, n=1)
    assert main(["export", "specforge", plain, str(tmp_path / "no"), "--layout", "eagle3"]) == 2
    assert "final_hidden" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the imports


def test_import_reads_what_the_peers_writers_wrote(tmp_path, new_samples):
    """SpecForge's own feature-file writer (LocalFeatureStore's dump: torch.save per sample) and speculators'
    own dataset builder (build_speculator_training_dataset + save_to_disk; the hs_{i} files as vLLM's
    hidden-states connector writes them) through `hsstore import`: the values come back bit-exact."""
    peer("specforge.runtime.data_plane.feature_store")
    preprocessing = peer("speculators.data_generation.preprocessing")
    from datasets import Dataset
    from safetensors.torch import save_file
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    samples = new_samples(3, min_len=8, max_len=40)
    for s in samples:
        s["loss_mask"][-1] = True  # the row ends in its answer: no trailing padding to guess
    fs = LocalFeatureStore(dump_dir=str(tmp_path / "sf"))
    for i, s in enumerate(samples):
        T = len(s["input_ids"])
        fs.put({"input_ids": s["input_ids"], "loss_mask": s["loss_mask"].long(),
                "hidden_states": s["hidden_states"].reshape(1, T, -1)}, sample_id=f"data_{i}", metadata={})
    assert main(["import", "specforge", str(tmp_path / "sf"), "--out", str(tmp_path / "a"), *IDENTITY]) == 0
    a = hsstore.open(str(tmp_path / "a"))
    got = {a.read(i)["sample_id"]: a.read(i) for i in range(len(a))}
    for i, s in enumerate(samples):
        assert torch.equal(got[f"data_{i}"]["input_ids"], s["input_ids"])
        assert torch.equal(bits(got[f"data_{i}"]["hidden_states"]), bits(s["hidden_states"]))

    rows = Dataset.from_dict({"input_ids": [s["input_ids"].tolist() for s in samples],
                              "loss_mask": [s["loss_mask"].long().tolist() for s in samples]})
    built = preprocessing.build_speculator_training_dataset(rows, None, max_length=4096, num_proc=1)
    built.save_to_disk(str(tmp_path / "spec"))
    (tmp_path / "spec" / "hidden_states").mkdir()
    for i, s in enumerate(samples):
        save_file({"hidden_states": s["hidden_states"], "token_ids": s["input_ids"]},
                  str(tmp_path / "spec" / "hidden_states" / f"hs_{i}.safetensors"))
    assert main(["import", "speculators", str(tmp_path / "spec"), "--out", str(tmp_path / "b"),
                 "--peer-layers", "2,4,6", *SPEC_IDENTITY]) == 0
    b = hsstore.open(str(tmp_path / "b"))
    got = {b.read(i)["sample_id"]: b.read(i) for i in range(len(b))}
    for i, s in enumerate(samples):
        assert got[f"hs_{i}"]["loss_mask"].tolist() == s["loss_mask"].tolist()
        assert torch.equal(bits(got[f"hs_{i}"]["hidden_states"]), bits(s["hidden_states"]))
    assert b.manifest.layers == (1, 3, 5)
