"""Bad input, corruption and verify: clear errors naming what is wrong; nothing committed touched."""

import json
import re
import os

import pytest
import torch

import hsstore
from hsstore.app.cli import main
from hsstore.ops.verify import verify


def add(w, s, **over):
    d = {**s, **over}
    w.add(d["sample_id"], d["input_ids"], d["loss_mask"], d["hidden_states"])


def test_bad_samples_named(tmp_path, new_manifest, new_samples):
    s = new_samples(1)[0]
    T = s["input_ids"].shape[0]
    with hsstore.StoreWriter(str(tmp_path), new_manifest()) as w:
        with pytest.raises(hsstore.SampleError, match=r"sample 's0'.*shape"):
            add(w, s, hidden_states=s["hidden_states"][:, :2])
        with pytest.raises(hsstore.SampleError, match=r"sample 's0'.*dtype float32.*bfloat16"):
            add(w, s, hidden_states=s["hidden_states"].float())
        with pytest.raises(hsstore.SampleError, match=r"loss_mask has"):
            add(w, s, loss_mask=s["loss_mask"][:-1])
        with pytest.raises(hsstore.SampleError, match=r"layers \[1, 2, 3\] do not match"):
            add(w, s, hidden_states={1: s["hidden_states"][:, 0], 2: s["hidden_states"][:, 1],
                                     3: s["hidden_states"][:, 2]})
        bad = s["hidden_states"].clone()
        bad[7, 1, 3] = float("nan")
        with pytest.raises(hsstore.SampleError, match=r"layer 3 has NaN/Inf features \(first at token 7\)"):
            add(w, s, hidden_states=bad)
        bad = s["hidden_states"].clone()
        bad[T - 1, 2, 0] = float("-inf")
        with pytest.raises(hsstore.SampleError, match=rf"layer 5 has NaN/Inf.*token {T - 1}"):
            add(w, s, hidden_states=bad)
        with pytest.raises(hsstore.SampleError, match="empty sample"):
            add(w, s, input_ids=torch.zeros(0, dtype=torch.long), loss_mask=torch.zeros(0),
                hidden_states=s["hidden_states"][:0])
        # more thinking tokens than the sample holds: a record every reader would refuse (rule 'bounds')
        with pytest.raises(hsstore.SampleError, match=rf"sample 's0': {T + 1} thinking tokens in a sample of {T}"):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"], thinking_tokens=T + 1)
        add(w, s)  # the writer is still usable after rejected samples
    store = hsstore.open(str(tmp_path))
    assert store.sample_ids() == ["s0"]


def test_incompatible_second_writer_refused(tmp_path, new_manifest, new_samples, write):
    write(str(tmp_path), new_manifest(), new_samples(3))
    before = sorted(p.name for p in (tmp_path / "commits").iterdir())
    for kw, field in [({"layers": (1, 2, 5)}, "layers"), ({"config_hash": "other"}, "target.config_hash"),
                      ({"vocab_hash": "v2"}, "tokenizer.vocab_hash"), ({"dtype": "float16"}, "dtype")]:
        with pytest.raises(hsstore.ManifestError, match=rf"incompatible.*{field}"):
            hsstore.StoreWriter(str(tmp_path), new_manifest(**kw))
    assert sorted(p.name for p in (tmp_path / "commits").iterdir()) == before
    assert len(hsstore.open(str(tmp_path))) == 3


def test_manifest_errors(tmp_path, new_manifest, new_samples, write):
    with pytest.raises(hsstore.ManifestError, match="does not exist"):
        hsstore.open(str(tmp_path / "nothing-here"))
    write(str(tmp_path), new_manifest(), new_samples(2))
    path = tmp_path / "manifest.json"
    d = json.loads(path.read_text())
    path.write_text(json.dumps({**d, "format_version": 99}))
    with pytest.raises(hsstore.ManifestError, match="format version 99.*upgrade"):
        hsstore.open(str(tmp_path))
    path.write_text(json.dumps({**d, "layers": [1, 3, 9]}))
    with pytest.raises(hsstore.ManifestError, match=r"layer ids \[9\] out of range"):
        hsstore.open(str(tmp_path))
    path.write_text(json.dumps({**d, "dtype": "bf16"}))
    with pytest.raises(hsstore.ManifestError, match="dtype 'bf16' not supported"):
        hsstore.open(str(tmp_path))
    path.write_text("{not json")
    with pytest.raises(hsstore.ManifestError, match="not valid JSON"):
        hsstore.open(str(tmp_path))
    with pytest.raises(hsstore.ManifestError, match=r"layer ids \[8\] out of range"):
        new_manifest(layers=(1, 8))


def test_unwritable_and_unreachable(tmp_path, new_manifest):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(hsstore.StoreError, match="cannot write to store"):
        hsstore.StoreWriter(str(blocker / "store"), new_manifest())
    opts = {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
            "key": "AKIDSECRET", "secret": "s3cr3t-value"}
    with pytest.raises(hsstore.StoreError) as e:
        hsstore.StoreWriter("s3://nobucket/x", new_manifest(), storage_options=opts)
    assert "cannot reach store 's3://nobucket/x'" in str(e.value)
    assert "s3cr3t-value" not in str(e.value) and "AKIDSECRET" not in str(e.value)


def _corrupt(path, offset=100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_finds_corrupted_byte(tmp_path, new_manifest, samples, write, capsys):
    write(str(tmp_path), new_manifest(chunk_tokens=50), samples)
    store = hsstore.open(str(tmp_path))
    assert verify(store).ok
    assert main(["verify", str(tmp_path), "-q"]) == 0
    rec = store.commits[0]
    key = f"shards/{rec.shard}/layer_003/c/1/0"  # tokens 50..99 of the first shard
    _corrupt(tmp_path / key)
    report = verify(hsstore.open(str(tmp_path)))
    assert not report.ok
    [p] = report.problems
    assert p.shard == rec.shard and p.file == key and "checksum" in p.message
    off = rec.offsets
    expected = [rec.samples["sample_id"][i] for i in range(rec.n_samples) if off[i] < 100 and off[i + 1] > 50]
    assert p.samples == expected
    assert main(["verify", str(tmp_path), "-q"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL shard {rec.shard}, file {key}: checksum mismatch" in out
    # the reader refuses the corrupted chunk, naming the sample and the file
    victim = store.sample_ids().index(expected[0])
    with pytest.raises(hsstore.CorruptionError, match=rf"sample '{expected[0]}'.*{key}.*checksum"):
        store.read(victim)


def test_verify_truncated_and_missing(tmp_path, new_manifest, samples, write):
    write(str(tmp_path), new_manifest(chunk_tokens=50), samples)
    store = hsstore.open(str(tmp_path))
    rec = store.commits[-1]
    trunc = tmp_path / f"shards/{rec.shard}/layer_001/c/0/0"
    trunc.write_bytes(trunc.read_bytes()[:-10])
    gone = tmp_path / f"shards/{rec.shard}/loss_mask/c/0"
    os.remove(gone)
    msgs = [str(p) for p in verify(hsstore.open(str(tmp_path))).problems]
    assert any("layer_001/c/0/0: size" in m and "truncated" in m for m in msgs)
    assert any("loss_mask/c/0: file missing" in m for m in msgs)
    first_of_shard = len(store) - rec.n_samples
    with pytest.raises(hsstore.CorruptionError, match="truncated|missing"):
        store.read(first_of_shard)


def test_commit_without_data(tmp_path, new_manifest, samples, write):
    write(str(tmp_path), new_manifest(), samples)
    store = hsstore.open(str(tmp_path))
    import shutil

    shutil.rmtree(tmp_path / "shards" / store.commits[0].shard)
    report = verify(hsstore.open(str(tmp_path)))
    assert not report.ok
    assert all(p.shard == store.commits[0].shard for p in report.problems)


def test_malformed_commit_record(tmp_path, new_manifest, samples, write):
    write(str(tmp_path), new_manifest(), samples)
    name = sorted((tmp_path / "commits").iterdir())[0]
    name.write_text('{"shard": "x"}')
    store = hsstore.open(str(tmp_path))  # opened (info describes it), refused by every reader
    with pytest.raises(hsstore.CorruptionError, match=rf"shard '{name.stem}'.*rule 'record'.*malformed.*field"):
        next(iter(store))


def test_missing_commit_record_hides_the_shard_and_verify_names_it(tmp_path, new_manifest, samples, write, capsys):
    """Data present, commit record gone: the shard does not exist for readers (its samples are not read,
    nothing half-visible), and verify names it as uncommitted debris."""
    write(str(tmp_path), new_manifest(), samples, shard_bytes=3 * 48 * 2 * 900)
    store = hsstore.open(str(tmp_path))
    assert len(store.commits) >= 2
    gone = store.commits[0]
    os.remove(tmp_path / "commits" / f"{gone.shard}.json")
    after = hsstore.open(str(tmp_path))
    assert after.sample_ids() == store.sample_ids()[gone.n_samples:]
    report = verify(after)
    assert report.ok and report.uncommitted == [gone.shard]
    assert main(["verify", str(tmp_path), "-q"]) == 0
    assert f"1 uncommitted shard(s) present (ignored by readers): {gone.shard}" in capsys.readouterr().out


@pytest.mark.parametrize("edit, message", [
    ({"layers": [1, 3, 6]}, "array for layer 6 missing"),
    ({"dtype": "float16"}, "dtype uint16/bfloat16 != float16 (manifest dtype float16"),
    ({"target.config_hash": "cfg-edited"}, "written under another manifest"),
    ({"tokenizer.vocab_hash": "v-edited"}, "written under another manifest"),
    ({"codec": "zstd"}, "written under another manifest"),
])
def test_hand_edited_manifest_named_by_verify_and_refused_by_loader(tmp_path, new_manifest, samples, write,
                                                                      edit, message, capsys):
    """A manifest edited by hand after shards were written (valid JSON, valid schema): every shard is named
    by verify (exit 1), and the loader refuses the store instead of misreading its bytes."""
    write(str(tmp_path), new_manifest(), samples)
    path = tmp_path / "manifest.json"
    d = json.loads(path.read_text())
    for k, v in edit.items():
        *parent, leaf = k.split(".")
        (d[parent[0]] if parent else d)[leaf] = v
    path.write_text(json.dumps(d))
    store = hsstore.open(str(tmp_path))  # opening (and info) still works: it is how one finds out
    report = verify(store)
    assert not report.ok
    assert {p.shard for p in report.problems} == {c.shard for c in store.commits}
    assert any(message in str(p) for p in report.problems), [str(p) for p in report.problems]
    assert any("written under another manifest" in str(p) for p in report.problems)
    assert main(["verify", str(tmp_path), "-q"]) == 1
    assert "FAIL shard" in capsys.readouterr().out
    with pytest.raises(hsstore.ManifestError, match="differs from the manifest that shards.*run hsstore verify"):
        hsstore.HiddenStateDataset(str(tmp_path))


@pytest.mark.parametrize("edit, message", [
    ({"surprise": 1}, r"unknown fields \['surprise'\]"),
    ({"layers": "1,3,5"}, "layers must be"),
    ({"target": {"name": "x"}}, "field target.num_layers: missing"),
    ({"target.mndel_type": "x"}, "field target.mndel_type: not a field of the manifest"),
    ({"target.hidden_size": "48"}, "hidden_size must be a positive integer"),
    ({"chunk_tokens": -1}, "chunk_tokens must be a positive integer"),
    ({"format": "other"}, "not an hsstore manifest"),
])
def test_schema_invalid_manifest_one_line_error(tmp_path, new_manifest, samples, write, edit, message, capsys):
    write(str(tmp_path), new_manifest(), samples[:3])
    path = tmp_path / "manifest.json"
    d = json.loads(path.read_text())
    for k, v in edit.items():
        *parent, leaf = k.split(".")
        (d[parent[0]] if parent else d)[leaf] = v
    path.write_text(json.dumps(d))
    with pytest.raises(hsstore.ManifestError, match=message):
        hsstore.open(str(tmp_path))
    assert main(["info", str(tmp_path)]) == 2  # a refusal in one line naming the file and the field
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json" in err[0] and "Traceback" not in err[0], err
    assert re.search(message, err[0]) and "__init__" not in err[0], err
    assert main(["verify", str(tmp_path), "-q"]) == 1  # verify's finding: a FAIL line naming the file and the field
    got = capsys.readouterr()
    fails = [ln for ln in got.out.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and "manifest.json" in fails[0] and re.search(message, fails[0]), got.out
    assert not got.err.strip(), got.err


def test_loader_on_commit_without_data_raises_or_skips_and_counts(tmp_path, new_manifest, samples, write):
    """A committed shard whose data is gone: the loader raises CorruptionError naming it by default; with
    skip_corrupt it delivers every other sample once and counts the skipped ones."""
    import shutil

    write(str(tmp_path), new_manifest(), samples, shard_bytes=3 * 48 * 2 * 900)
    store = hsstore.open(str(tmp_path))
    gone = store.commits[1]
    shutil.rmtree(tmp_path / "shards" / gone.shard)
    with pytest.raises(hsstore.CorruptionError, match=rf"shard '{gone.shard}'.*missing"):
        list(hsstore.HiddenStateDataset(str(tmp_path)))
    ds = hsstore.HiddenStateDataset(str(tmp_path), reading=hsstore.Reading(skip_corrupt=True))
    got = [item["sample_id"] for item in ds]
    assert sorted(got) == sorted(set(store.sample_ids()) - set(gone.samples["sample_id"]))
    assert sum(ds.state_dict()["skipped"].values()) == gone.n_samples > 0
