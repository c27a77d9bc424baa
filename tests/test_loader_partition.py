"""Node-affine epochs (``partition="node"``): each node keeps one share of the read units for the whole
run and shuffles inside it; exactly once per epoch over all ranks, resume, a change of rank count within a
node and of the node count; and what it saves: remote bytes per epoch counted by a proxy in front of S3."""

from __future__ import annotations

import dataclasses
import logging
import uuid

import numpy as np
import pytest
import s3fs
from torch.utils.data import DataLoader

from hsstore import merge_states
from hsstore.distributed import node_of
from hsstore.loader.dataset import LoaderStateError
from hsstore.app.schema import build

from test_loader import StatefulDataLoader, dataset, ids_of, samples, store_url, write_store  # noqa: F401
from conftest import make_samples
from train_helpers import FAST, small_input, store32  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

NODES, PER_NODE, WORKERS = 2, 2, 2


def node_ds(url, rank, nodes=NODES, per_node=PER_NODE, **kw):
    return dataset(url, rank=rank, world_size=nodes * per_node, partition="node", ranks_per_node=per_node, **kw)


def run_epoch(url, epoch, nodes=NODES, per_node=PER_NODE, workers=WORKERS, **kw):
    """Sample ids per rank for one epoch, through real forked DataLoader workers."""
    out = []
    for r in range(nodes * per_node):
        ds = node_ds(url, r, nodes, per_node, **kw)
        ds.set_epoch(epoch)
        got = ids_of(DataLoader(ds, batch_size=None, num_workers=workers,
                                multiprocessing_context="fork" if workers else None))
        assert len(got) == len(ds)
        out.append(got)
    return out


def test_node_coordinates_from_torchrun_and_arguments(monkeypatch):
    for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert node_of(3, 4) == (0, 1, 4)  # no node variables: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_of(3, 4) == (1, 2, 2)
    with pytest.raises(ValueError, match="numbered node by node"):
        node_of(0, 4)  # GROUP_RANK 1 but rank 0 of 2 per node is on node 0
    with pytest.raises(ValueError, match="do not divide"):
        node_of(0, 5, ranks_per_node=2)
    assert node_of(5, 8, ranks_per_node=4, node=1) == (1, 2, 4)


@pytest.mark.slow
def test_exactly_once_fixed_node_shares_new_order_each_epoch(store_url, samples):
    everything = sorted(s["sample_id"] for s in samples)
    epochs = [run_epoch(store_url, e) for e in range(3)]
    shares = []
    for per_rank in epochs:
        assert sorted(i for r in per_rank for i in r) == everything  # exactly once over 2 nodes x 2 ranks x 2 workers
        shares.append([set(per_rank[0] + per_rank[1]), set(per_rank[2] + per_rank[3])])
    # each node reads the same samples every epoch, the two shares split the store, of about equal size
    assert shares[0] == shares[1] == shares[2]
    assert not shares[0][0] & shares[0][1] and min(map(len, shares[0])) >= len(samples) // 4
    # in a new order every epoch, and the ranks of a node split its share anew
    assert epochs[0] != epochs[1] and epochs[0][0] + epochs[0][1] != epochs[1][0] + epochs[1][1]
    # deterministic: the same seed gives the same lists; another seed other shares
    assert run_epoch(store_url, 1) == epochs[1]
    other = run_epoch(store_url, 0, seed=7)
    assert set(other[0] + other[1]) != shares[0][0]
    # a global shuffle mixes the nodes' samples across epochs (what the node partition gives up)
    glob = []
    for e in range(2):
        ranks = [dataset(store_url, rank=r, world_size=4) for r in (0, 1)]
        for ds in ranks:
            ds.set_epoch(e)
        glob.append(set(ids_of(ranks[0]) + ids_of(ranks[1])))
    assert glob[0] != glob[1]


def test_plan_api_and_len_agree_with_iteration(store_url):
    for r in range(NODES * PER_NODE):
        ds = node_ds(store_url, r)
        ds.set_epoch(2)
        stream = [ds.planned_ids(2, ds.world.at(r, 0, 1))]
        assert ids_of(ds) == stream[0] and len(ds) == len(stream[0]) == ds.rank_counts()[r]


@pytest.mark.parametrize("even", ["drop", "repeat"])
def test_even_over_nodes(store_url, samples, even):
    per_rank = run_epoch(store_url, 0, workers=0, even=even)
    lengths = {len(r) for r in per_rank}
    assert len(lengths) == 1  # every rank of the world the same count
    flat = [i for r in per_rank for i in r]
    if even == "drop":
        assert len(set(flat)) == len(flat) and len(flat) <= len(samples)
    else:
        assert set(flat) == {s["sample_id"] for s in samples} and len(flat) >= len(samples)


def test_resume_mid_epoch_rank_count_and_node_count_changes(store_url, samples, caplog):
    """2 nodes x 2 ranks x 2 workers stop mid-epoch. Same world: every worker continues its own stream. 2 nodes
    x 1 rank: exactly once, and each node still reads only its own share. 1 node x 3 ranks: exactly once,
    re-partitioned, logged."""
    everything = sorted(s["sample_id"] for s in samples)
    shares = run_epoch(store_url, 1, workers=0)
    node_share = [set(shares[0] + shares[1]), set(shares[2] + shares[3])]
    before, states = [], []
    for r, steps in enumerate([5, 9, 3, 7]):
        ds = node_ds(store_url, r)
        ds.set_epoch(1)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=WORKERS, multiprocessing_context="fork")
        it = iter(dl)
        before.append([next(it)["sample_id"] for _ in range(steps)])
        states.append(dl.state_dict())
        del it
    merged = merge_states(states)
    assert merged["nodes"] == NODES and merged["config"]["partition"] == "node"
    # the same world, each rank from its own state: the uninterrupted stream's tail
    for r in range(NODES * PER_NODE):
        ds = node_ds(store_url, r)
        ds.set_epoch(1)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=WORKERS, multiprocessing_context="fork")
        dl.load_state_dict(states[r])
        assert before[r] + ids_of(dl) == ids_of(_full(store_url, r))
    consumed = [i for r in before for i in r]
    # fewer ranks per node: exactly once, and a node's ranks stay inside the node's share
    after = []
    for r in range(NODES):
        ds = node_ds(store_url, r, per_node=1)
        ds.load_state_dict(merged)
        got = ids_of(ds)
        assert set(got) <= node_share[r]
        after += got
    assert sorted(consumed + after) == everything
    # another node count: exactly once over the new nodes, and the log says the shares moved
    caplog.set_level(logging.INFO, logger="hsstore.loader")
    after = []
    for r in range(3):
        ds = node_ds(store_url, r, nodes=1, per_node=3)
        ds.load_state_dict(merged)
        after += ids_of(ds)
    assert sorted(consumed + after) == everything
    assert "re-partitioning" in caplog.text
    # a node-partitioned state does not load into a globally shuffled dataset (nor the other way)
    with pytest.raises(LoaderStateError, match="partition"):
        dataset(store_url, rank=0, world_size=4).load_state_dict(merged)
    with pytest.raises(LoaderStateError, match="partition"):
        node_ds(store_url, 0).load_state_dict(dataset(store_url).state_dict())


def _full(url, rank):
    """Rank ``rank``'s whole epoch-1 stream through 2 forked workers (the uninterrupted reference)."""
    ds = node_ds(url, rank)
    ds.set_epoch(1)
    return DataLoader(ds, batch_size=None, num_workers=WORKERS, multiprocessing_context="fork")


# ---------------------------------------------------------------------------------------------- remote bytes
@pytest.fixture(scope="module")
def s3_small(s3_endpoint):
    s3fs.S3FileSystem.clear_instance_cache()
    opts = {"endpoint_url": s3_endpoint}
    bucket = f"hs-part-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    url = f"s3://{bucket}/stores/a"
    smp = make_samples(40, max_len=120)
    write_store(url, smp, shard_tokens=1000, storage_options=opts)
    return url, smp


def remote_bytes_per_epoch(url, endpoint, tmp_path, partition, epochs=2):
    """Chunk bytes 2 nodes (1 rank each, own cache_dir sized to hold 1.5 x a node's share) fetch per epoch."""
    from hsstore.testing.faultproxy import FaultProxy

    with FaultProxy(endpoint, faults=[], limit=0) as proxy:
        s3fs.S3FileSystem.clear_instance_cache()
        opts = {"endpoint_url": proxy.url}
        kw = {"partition": partition, "ranks_per_node": 1} if partition == "node" else {}
        sets = [dataset(url, rank=r, world_size=2, storage_options=opts, **kw) for r in range(2)]
        share = max(node_ds(url, r, per_node=1, storage_options=opts).planner.node_share(2, r)[1] for r in range(2))
        chunks = sum(v["size"] for c in sets[0].stores[0].commits for k, v in c.files.items() if "/c/" in k)
        per_epoch, seen = [], 0
        for r, ds in enumerate(sets):
            ds.reading = dataclasses.replace(ds.reading, cache_dir=str(tmp_path / partition / f"node{r}"),
                                             cache_bytes=int(1.5 * share))
        for e in range(epochs):
            proxy.reset_counts()
            for ds in sets:
                ds.set_epoch(e)
                seen += len(ids_of(ds))
            per_epoch.append(sum(n for p, n in proxy.sent.items() if "/shards/" in p and "/c/" in p))
    s3fs.S3FileSystem.clear_instance_cache()
    assert seen == epochs * len(sets[0].catalog)
    return per_epoch, chunks, share


def test_remote_bytes_per_epoch_node_vs_global(s3_small, s3_endpoint, tmp_path):
    url, smp = s3_small
    node, chunks, share = remote_bytes_per_epoch(url, s3_endpoint, tmp_path, "node")
    glob, _, _ = remote_bytes_per_epoch(url, s3_endpoint, tmp_path, "global")
    assert 1.5 * share < chunks  # each node's cache is smaller than the store
    assert node[0] >= chunks * 0.9 and glob[0] >= chunks * 0.9  # epoch 1: (about) every chunk, by one node or two
    assert node[1] == 0  # epoch 2: each node's share is in its own cache
    assert glob[1] > chunks * 0.2  # a global shuffle sends a node to units its cache never saw
    print(f"remote chunk bytes per epoch: node {node}, global {glob}, store {chunks}")


def _cached(folder) -> dict[str, int]:
    """The copies in a chunk cache folder: relative path -> bytes on disk."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


def test_node_cache_too_small_keeps_its_first_fill_and_names_the_size(s3_small, s3_endpoint, tmp_path, caplog):
    """A node cache smaller than the node's part keeps what the first epoch put in it: the second epoch fetches only
    what it could not hold (least-recently-used would evict each copy before the next epoch came back to it). The
    dataset names the cache the part needs, which is what a cache that held everything took on disk, and a cache of
    that size fetches nothing in the second epoch."""
    from hsstore.testing.faultproxy import FaultProxy

    url, _ = s3_small
    with FaultProxy(s3_endpoint, faults=[], limit=0) as proxy:
        s3fs.S3FileSystem.clear_instance_cache()
        opts = {"endpoint_url": proxy.url}

        def built(cache, cap):  # one dataset for the run, as a trainer has
            return node_ds(url, 0, per_node=1, storage_options=opts, cache_dir=str(cache), cache_bytes=cap)

        def epoch(ds, e):
            ds.set_epoch(e)
            proxy.reset_counts()
            assert len(ids_of(ds)) == len(ds)
            return sum(n for p, n in proxy.sent.items() if "/shards/" in p and "/c/" in p)

        ds = built(tmp_path / "all", 1 << 30)
        epoch(ds, 0)
        need = sum(_cached(tmp_path / "all").values())  # every copy the node's reads left, with its digest
        assert ds.node_cache_bytes() == need

        caplog.set_level(logging.WARNING, logger="hsstore.loader")
        small = tmp_path / "small"
        ds = built(small, need // 2)
        warned = [r.getMessage() for r in caplog.records if "cache_bytes" in r.getMessage()]
        assert len(warned) == 1 and f"cache_bytes {need} " in warned[0], warned
        first = epoch(ds, 0)
        kept = _cached(small)
        assert 0 < sum(kept.values()) <= need // 2
        second = epoch(ds, 1)
        assert _cached(small).items() >= kept.items()  # nothing the first epoch kept was evicted
        held = sum(n - 32 for n in kept.values())  # the chunk bytes of the copies (each with a 32-byte digest)
        assert 0 < second <= first - held

        caplog.clear()
        ds = built(tmp_path / "enough", need)
        epoch(ds, 0)
        assert epoch(ds, 1) == 0 and not [r for r in caplog.records if "cache_bytes" in r.getMessage()]
    s3fs.S3FileSystem.clear_instance_cache()


def test_train_partition_node_saves_and_resumes_node_states(store32, tmp_path):  # noqa: F811
    """``hsstore train --partition node``: the loader positions in checkpoints carry the node count, and a
    resumed run continues (the same loss as the uninterrupted run)."""
    import json
    import shutil

    from hsstore.train import checkpoint as ckpt
    from hsstore.train.trainer import TrainSettings, train

    cfg = dict(store=[store32], steps=4, save_every=2, keep=0, partition="node", **FAST)
    full = tmp_path / "full"
    train(build(TrainSettings, out=str(full), **cfg))
    first = ckpt.list_checkpoints(full)[0]
    state = json.loads((first / "loader.rank00000.json").read_text())
    found = [s for s in _states(state)]
    assert found and all(s["nodes"] == 1 and s["config"]["partition"] == "node" for s in found)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    for p in ckpt.list_checkpoints(cut)[1:]:
        shutil.rmtree(p)
    shutil.rmtree(cut / "drafter")
    train(build(TrainSettings, out=str(cut), **cfg))
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and [r["loss"] for r in rows] == [r["loss"] for r in again]


def _states(obj):
    if isinstance(obj, dict):
        if "hsstore_loader" in obj:
            yield obj
        else:
            for v in obj.values():
                yield from _states(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _states(v)
