"""One JSON vocabulary across ``check``, ``info``, ``train`` and ``eval``: a figure that two commands report has one
key in both (``tokens``, never ``total_tokens`` in one and ``tokens`` in the other), and the data-set figures
``check`` gives of an input are the ones ``info`` gives of the store extracted from it, under the same keys."""

from __future__ import annotations

import json

from hsstore.app.cli import main

from train_helpers import small_input, store32  # noqa: F401  (fixtures)

# the words for these figures (ops.stats.loss_sum_summary names them): what a command reporting one calls it
DATASET = ("samples", "tokens", "loss_tokens", "response_fraction", "loss_sum_mean", "loss_sum_percentiles",
           "loss_sum_histogram", "top_loss_sum", "length_percentiles", "flags")
QUALITY = ("loss", "acc", "tau")  # of a drafter: train's rows and eval's report
# other spellings of those figures, found in no command's JSON
SYNONYMS = {"total_tokens", "n_tokens", "num_tokens", "token_count", "n_samples", "num_samples", "sample_count",
            "flag_counts", "accuracy", "mean_acceptance_length", "loss_sum", "elapsed", "elapsed_s", "time_s"}


def keys(value, prefix: str = "") -> set[str]:
    """Every key of a JSON document, nested ones too."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(k)
            out |= keys(v)
    elif isinstance(value, list):
        for v in value:
            out |= keys(v)
    return out


def run_json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_check_info_train_and_eval_use_one_vocabulary(tiny_dir, store32, small_input, tmp_path, capsys):  # noqa: F811
    check = run_json(capsys, "check", "--model", str(tiny_dir), "--input", str(small_input))
    info = run_json(capsys, "info", store32)
    run = str(tmp_path / "run")
    train = run_json(capsys, "train", "--store", store32, "--out", run, "--steps", "2", "--draft-layers", "1",
                     "--block-size", "8", "--anchors", "8", "--device", "cpu", "-q")
    evaluated = run_json(capsys, "eval", "--store", store32, "--drafter", run, "--device", "cpu", "-q")
    docs = {"check": check, "info": info, "train": train, "eval": evaluated}
    for name, doc in docs.items():
        assert not keys(doc) & SYNONYMS, (name, sorted(keys(doc) & SYNONYMS))
    for k in DATASET:  # the input and the store extracted from it: the same figures under the same keys
        assert k in check and k in info, k
        assert type(check[k]) is type(info[k]), k
    for k in ("samples", "tokens", "loss_tokens"):
        assert check[k] == info[k], (k, check[k], info[k])
    for k in ("loss_sum_percentiles", "length_percentiles"):  # check lists more of them: those both list agree
        both = set(check[k]) & set(info[k])
        assert both >= {"p0", "p50", "p100"} and {q: check[k][q] for q in both} == {q: info[k][q] for q in both}, k
    for k in QUALITY:
        assert k in train["last"] and k in evaluated, k
    assert {"tokens", "seconds", "tokens_per_s"} <= set(train) and {"samples", "seconds"} <= set(evaluated)
