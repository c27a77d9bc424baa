"""One DFlash tap rule for extraction and training (hsstore/format/taps.py).

Expected ids come from DFlash's ``build_target_layer_ids`` as z-lab's dflash, SpecForge and SGLang
(``sglang/srt/speculative/dflash_utils.py``) publish it: one draft tap -> ``num_target_layers // 2``;
several -> ``int(round(1 + i * (n - 4) / (k - 1)))``, i.e. evenly spaced from 1 to n - 3. The published
drafters' configs: Qwen3.6-27B (64 layers) [1, 16, 31, 46, 61], Qwen3-8B (36 layers) [1, 9, 17, 25, 33].
"""

import pytest

from hsstore.format.taps import check_taps, default_taps
from hsstore.app.target import text_config


@pytest.mark.parametrize("layers, taps, want", [
    (64, 5, [1, 16, 31, 46, 61]),   # Qwen3.6-27B, the published drafter
    (36, 5, [1, 9, 17, 25, 33]),    # Qwen3-8B / Qwen3-4B
    (40, 5, [1, 10, 19, 28, 37]),   # span 36, step 9
    (64, 3, [1, 31, 61]),
    (64, 1, [32]),                  # one tap: the middle layer (extract said [61], train [1])
    (36, 1, [18]),
    (7, 3, [1, 2, 4]),              # 2.5 rounds to even, as Python's round does
    (8, 5, [1, 2, 3, 4, 5]),        # the tiny test target
])
def test_default_taps_are_dflash_build_target_layer_ids(layers, taps, want):
    assert default_taps(layers, taps) == want


def test_extract_and_train_use_the_one_rule():
    """The two copies had drifted; both sides now call this one function, and extraction plans its taps one way
    whether it reads the folder's config.json (before loading) or the loaded model's config."""
    from transformers import AutoConfig

    from hsstore.extract import job, target
    from hsstore.extract.tiny import tiny_target_dir
    from hsstore.train import model

    from hsstore.format import serving

    assert serving.default_taps is default_taps and target.plan is serving.plan
    assert model.default_target_layers is default_taps and not hasattr(job, "target_taps")
    folder = str(tiny_target_dir())
    for layers, serve in ((None, None), ([1, 4], ["speculators"])):
        from_file = target.planned_taps(folder, layers, serve)
        loaded = target.planned_taps(AutoConfig.from_pretrained(folder), layers, serve)
        assert (from_file.layers, from_file.final_hidden) == (loaded.layers, loaded.final_hidden)
    assert from_file.layers == [1, 4, 7]  # speculators' trainer needs the last layer (8 layers: 7)
    from transformers import Qwen3Config

    tc = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=64, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=300)
    cfg = model.DrafterConfig.from_target_config(tc, mask_token_id=299, num_layers=1, block_size=8)
    assert cfg.target_layers == [1, 16, 31, 46, 61]


def test_too_shallow_target_is_refused_not_given_fewer_taps():
    # 6 layers, 5 taps: the rule gives [1, 2, 2, 2, 3]; a store needs distinct, increasing ids
    with pytest.raises(ValueError, match="too few layers for 5 DFlash taps"):
        default_taps(6, 5)
    with pytest.raises(ValueError, match="too few layers"):
        default_taps(3, 2)  # nothing between 1 and n - 3
    assert default_taps(3, 1) == [1]


def test_check_taps_and_text_config():
    assert check_taps([1, 3], 4) == [1, 3]
    with pytest.raises(ValueError, match=r"layer ids \[4\] out of range"):
        check_taps([1, 4], 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_taps([3, 1], 4)
    nested = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 64}}
    assert text_config(nested) == {"num_hidden_layers": 64} and text_config({"a": 1}) == {"a": 1}
    from transformers import Qwen3Config

    flat = Qwen3Config(num_hidden_layers=3)
    assert text_config(flat) is flat
