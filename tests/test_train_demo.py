"""``hsstore demo`` runs end to end: extraction, then training from the store alone, then eval."""

from hsstore.cli import main as hsstore_cli


def test_demo_end_to_end(tmp_path, capsys):
    assert hsstore_cli(["demo", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "=== 7/7" in out and "trained 40 steps" in out
    assert "speculative output == target greedy output: 4/4" in out
    assert (tmp_path / "demo" / "target" / "model.safetensors").exists()  # put back after training
