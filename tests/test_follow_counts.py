"""What a follower says it waits for counts from the listing of ``commits/`` (the authority), not from a writer's
heartbeat, which lags by the shards committed since its last beat."""

from __future__ import annotations

import fsspec

from hsstore.format import commit, sessions
from hsstore.store.writer import StoreWriter

from conftest import make_manifest, make_samples


def test_the_wait_line_counts_the_shards_listed_not_the_last_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setenv("HSSTORE_WRITER_HEARTBEAT_S", "3600")  # no beat while the shards commit
    url = str(tmp_path / "s")
    fs = fsspec.filesystem("file")
    with StoreWriter(url, make_manifest(hidden=16), shard_bytes=1, writer_tag="w") as w:
        for s in make_samples(5, hidden=16, max_len=20):
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        w.flush()
        listed = set(commit.list_records(fs, url))
        writers = sessions.read_writers(fs, url)
        (state,) = [s for s in writers.states() if s.state == "open"]
        assert len(listed) == 5 and state.record.committed < 5  # the session record said fewer
        (line,) = writers.waiting_for(listed)
        assert "writing, 5 shard(s) committed" in line, line
