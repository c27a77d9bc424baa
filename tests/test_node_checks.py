"""tools/node_checks.py, the checks behind tools/gpu_node.sh (issue #41): each one passes on what it should pass
and fails on the defect it is there to catch (a sample twice, a changed order, a loss off)."""

import json

from tools import node_checks

from conftest import make_manifest, make_samples, write_samples


def _check(argv, tmp_path):
    out = tmp_path / "fig.json"
    rc = node_checks.main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_ids_pass_an_equal_store_and_catch_a_sample_written_twice(tmp_path):
    samples = make_samples(5, max_len=40)
    ref, good, bad = (str(tmp_path / n) for n in ("ref", "good", "bad"))
    write_samples(ref, make_manifest(), samples)
    write_samples(good, make_manifest(), samples[::-1])  # another order, the same samples
    rc, fig = _check(["ids", good, "--same-as", ref], tmp_path)
    assert rc == 0 and fig["features_equal"] == 5
    write_samples(bad, make_manifest(), samples[:4], writer_tag="w0")
    write_samples(bad, make_manifest(), samples[3:], writer_tag="w1")  # s3 by both writers
    rc, fig = _check(["ids", bad, "--same-as", ref], tmp_path)
    assert rc == 1 and fig["duplicates"] == ["s3"] and fig["samples"] == 6


def test_ids_against_the_bench_ids_name_what_is_missing(tmp_path):
    url = str(tmp_path / "s")
    write_samples(url, make_manifest(), make_samples(3, max_len=30, prefix="b0000"))  # b00000..b00002
    assert _check(["ids", url, "--bench", "3"], tmp_path)[0] == 0
    rc, fig = _check(["ids", url, "--bench", "4"], tmp_path)
    assert rc == 1 and fig["missing"] == ["b00003"]


def _run(path, steps, losses):
    """A training run's logs as `hsstore train --log-samples` writes them: steps = per rank, [(epoch, ids)]."""
    path.mkdir()
    for r, rows in enumerate(steps):
        (path / f"samples.rank{r:05d}.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "epoch": e, "samples": ids}) + "\n" for i, (e, ids) in enumerate(rows)))
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "epoch": steps[0][i][0], "loss": x, "tokens": 100, "tokens_per_s": 1000.0,
                    "wait_frac": 0.01}) + "\n" for i, x in enumerate(losses)))
    return str(path)


def test_run_report_catches_a_sample_twice_in_an_epoch(tmp_path):
    store = str(tmp_path / "s")
    write_samples(store, make_manifest(), make_samples(4, max_len=30))
    good = [[(0, ["s0"]), (0, ["s1"]), (1, ["s2"]), (1, ["s0"])], [(0, ["s2"]), (0, ["s3"]), (1, ["s1"]), (1, ["s3"])]]
    rc, fig = _check(["run", _run(tmp_path / "a", good, [3, 2, 1, 1]), "--world", "2", "--ids-from", store], tmp_path)
    assert rc == 0 and fig["exactly_once"] and fig["lockstep"] and fig["step_s_median"] == 0.1
    twice = [good[0], [(0, ["s2"]), (0, ["s0"]), (1, ["s1"]), (1, ["s3"])]]  # s0 twice in epoch 0, s3 never
    rc, fig = _check(["run", _run(tmp_path / "b", twice, [3, 2, 1, 1]), "--world", "2", "--ids-from", store],
                     tmp_path)
    assert rc == 1 and not fig["exactly_once"] and fig["epochs"]["0"]["max_uses"] == 2


def test_same_catches_another_order_and_another_loss(tmp_path):
    rows = [[(0, ["a"]), (0, ["b"])], [(0, ["c"]), (0, ["d"])]]
    full = _run(tmp_path / "full", rows, [2.0, 1.0])
    assert _check(["same", full, _run(tmp_path / "eq", rows, [2.0, 1.0]), "--world", "2"], tmp_path)[0] == 0
    swapped = [rows[0][::-1], rows[1]]
    assert _check(["same", full, _run(tmp_path / "sw", swapped, [2.0, 1.0]), "--world", "2"], tmp_path)[0] == 1
    rc, fig = _check(["same", full, _run(tmp_path / "lo", rows, [2.0, 1.01]), "--world", "2"], tmp_path)
    assert rc == 1 and abs(fig["loss_max_rel_diff"] - 0.01) < 1e-9


def test_the_loader_check_in_one_process(tmp_path):
    """The real loader on a real store: every sample once per epoch, and the order after a mid-epoch resume."""
    url = str(tmp_path / "s")
    write_samples(url, make_manifest(), make_samples(24, max_len=60))
    rc, fig = _check(["loader", url, "--workers", "0", "--epochs", "2", "--cut", "2", "--token-budget", "120",
                      "--device", "cpu"], tmp_path)
    assert rc == 0 and fig["exactly_once"] and fig["resumed_same_order"]
    assert [e["distinct"] for e in fig["epochs"]] == [24, 24] and fig["cut_at"] == [2]
