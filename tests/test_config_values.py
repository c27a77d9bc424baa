"""A ``--config`` file's values as a person writes them: one value for a flag that takes several (``input: a.jsonl``,
``store: s``) is a list of one, as the flag given once is; a mapping there is still refused, naming the key."""

from __future__ import annotations

import pytest
import yaml

import hsstore
from hsstore.app import config
from hsstore.app.cli import build_parser, main


def _parse(argv):
    p = build_parser()
    config.apply(p, argv)
    return p.parse_args(argv)


def test_a_scalar_input_extracts_as_a_list_of_one(tiny_dir, tmp_path):
    from hsstore.extract.tiny import demo_conversations_path

    rows = tmp_path / "in.jsonl"
    rows.write_text("\n".join(demo_conversations_path().read_text().splitlines()[:2]) + "\n")
    cfg = tmp_path / "extract.yaml"
    cfg.write_text(yaml.safe_dump({"input": {"model": str(tiny_dir), "input": "in.jsonl"},
                                   "store": {"out": "store"}, "forward": {"device": "cpu"}}))
    assert main(["extract", "--config", str(cfg), "-q"]) == 0  # relative paths: from the file's folder
    assert len(hsstore.open(str(tmp_path / "store"))) == 2


def test_a_scalar_store_is_a_list_of_one_and_a_mapping_is_refused(tmp_path, capsys):
    f = tmp_path / "train.yaml"
    f.write_text(yaml.safe_dump({"run": {"store": "/s/a", "out": "/o"}}))
    assert _parse(["train", "--config", str(f)]).store == ["/s/a"]
    f.write_text(yaml.safe_dump({"run": {"store": {"url": "/s/a"}, "out": "/o"}}))
    with pytest.raises(SystemExit):
        _parse(["train", "--config", str(f)])
    assert "run.store: expected a list or one value" in capsys.readouterr().err
