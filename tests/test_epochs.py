"""The epoch source (hsstore/loader/epochs.py): the dataset plans, counts, starts and reads every epoch through it,
whatever implements it: the stores as they stand (``StoreEpoch``), a follower's journal (``follow.JournalEpoch``) or
a source of the test's own, plugged in as the ``follow`` option is. The names follow mode's move left behind keep
working, with a deprecation warning."""

from __future__ import annotations

import collections

import pytest
from torch.utils.data import DataLoader

from hsstore import HiddenStateDataset
from hsstore import open as open_store
from hsstore.distributed import World
from hsstore.loader.epochs import EpochPart, PlanInputs, StoreEpoch
from hsstore.loader.follow import Follow, Journal, JournalEpoch, Leader, epoch0_lengths, final_stores
from hsstore.loader.options import Planning
from hsstore.loader.resume import LoaderState, SlotProgress
from hsstore.store.writer import StoreWriter
from hsstore.testing.loading import ids_of
from hsstore.testing.stores import TOKEN_BYTES, make_manifest, make_samples, write_store

from test_follow import add, until_end
from test_follow import grown, quick_beats  # noqa: F401  (autouse: writers beat every 0.2 s, so a store ends soon)

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class Parts:
    """A slot's parts handed out as a list is, with the ``close`` the dataset calls."""

    def __init__(self, parts: list[EpochPart]) -> None:
        self.rest, self.closed = iter(parts), False

    def __iter__(self) -> "Parts":
        return self

    def __next__(self) -> EpochPart:
        return next(self.rest)

    def close(self) -> None:
        self.closed = True


class TwoPasses:
    """A first epoch of the test's own: the stores read twice, each pass in its own seeded order (two parts)."""

    def __init__(self, inputs: PlanInputs, stores) -> None:
        self.stores, self.catalog = list(stores), inputs.catalog(stores)
        self.planners = [inputs.planner(self.catalog, seed=s) for s in (11, 12)]
        self.started: list[Parts] = []

    def config(self):
        return {"two_passes": [p.config["seed"] for p in self.planners]}

    def initial_state(self) -> LoaderState:
        return LoaderState(self.config(), 0)

    def planned(self, world: World):
        return iter([EpochPart(self.stores, self.catalog, p.slot_plan(0, None, 0, world)) for p in self.planners])

    def rank_counts(self, resume, world: World) -> list[int]:
        return [sum(p.rank_counts(0, None, 0, world)[r] for p in self.planners) for r in range(world.world)]

    def start(self, resume, world: World):
        parts = Parts(list(self.planned(world)))
        self.started.append(parts)
        return SlotProgress(0, None, 0, world), parts

    def final_stores(self):
        return self.stores


class Twice:
    """The ``follow`` option's role (``epochs.LiveStores``), played by a source of the test's own."""

    def __init__(self) -> None:
        self.made: list[TwoPasses] = []

    def first_epoch(self, inputs: PlanInputs, stores, world: World) -> TwoPasses:
        self.made.append(TwoPasses(inputs, stores))
        return self.made[-1]


def test_a_source_of_ones_own_is_planned_counted_and_read_as_the_dataset_reads_any(tmp_path):
    """The dataset asks its epoch's source alone: a source that is no follower's plans, counts and reads epoch 0
    part by part (every sample twice here, pass after pass), and later epochs are the stores it hands over."""
    samples = make_samples(24, max_len=60)
    url = write_store(str(tmp_path / "s"), samples)
    option = Twice()
    ds = HiddenStateDataset(url, planning=Planning(seed=3), follow=option)
    (source,) = option.made
    assert ds.epoch_source(0) is source and ds.state_dict()["config"] == source.config()
    got = ids_of(ds)
    assert got == ds.planned_ids(0) and len(ds) == 48 == len(got)
    assert collections.Counter(got) == collections.Counter({s["sample_id"]: 2 for s in samples})
    first, second = got[:24], got[24:]
    assert first != second and sorted(first) == sorted(second)  # two passes, each in its own order
    assert source.started[-1].closed  # the parts were closed once read
    ds.set_epoch(1)
    assert isinstance(ds.epoch_source(), StoreEpoch) and sorted(ids_of(ds)) == sorted(s["sample_id"] for s in samples)


def test_the_sources_plan_what_the_dataset_says_it_plans(tmp_path):
    """``planned_lengths``/``planned_ids``/``rank_counts`` are the epoch source's answers: the stores' own for an
    ordinary dataset, the journal's joins for a follower (one part per join)."""
    url, follow, ids = grown(tmp_path)
    plain = HiddenStateDataset(url, world=World(0, 2), planning=Planning(seed=5))
    source = plain.epoch_source(2)
    assert isinstance(source, StoreEpoch) and source.epoch == 2
    (part,) = source.planned(plain.world)
    assert list(part.lengths()) == list(plain.planned_lengths(2)) and part.sample_ids() == plain.planned_ids(2)
    follower = HiddenStateDataset(url, world=World(0, 2), planning=Planning(seed=5), follow=follow)
    journal = follower.epoch_source(0)
    assert isinstance(journal, JournalEpoch)
    parts = list(journal.planned(follower.world))
    assert len(parts) == 3  # the journal's three joins
    assert [i for p in parts for i in p.sample_ids()] == follower.planned_ids(0)
    assert sum(journal.rank_counts(None, follower.world)) == len(ids) == sum(follower.rank_counts())
    with pytest.raises(ValueError, match="is not a reader of this dataset's world"):
        next(source.planned(World(0, 3)))


def test_names_follow_mode_moved_from_keep_working_with_a_warning(tmp_path):
    url, follow, ids = grown(tmp_path)
    ds = HiddenStateDataset(url, planning=Planning(seed=5), follow=follow)
    with pytest.warns(DeprecationWarning, match="follow_plan"):
        plan = ds.follow_plan()
    assert plan is ds.epoch_source(0).plan()
    with pytest.warns(DeprecationWarning, match="JoinPart.view"):
        assert plan.part(0).view.catalog is plan.part(0).catalog
    with pytest.warns(DeprecationWarning, match="epoch0_lengths"):
        lengths = epoch0_lengths(plan, ds.world)
    assert [list(x) for x in lengths] == [list(p.lengths()) for p in ds.epoch_source(0).planned(ds.world)]
    with pytest.warns(DeprecationWarning, match="final_stores"):
        stores = final_stores(ds, plan.journal)
    assert sum(len(s) for s in stores) == len(ids)


def test_a_followers_persistent_workers_read_epoch1_from_what_epoch0_took(tmp_path):
    """Persistent DataLoader workers keep the dataset as it was when they started (epoch 0, the stores as opened);
    the epoch reaches them through shared memory, and epoch 1 is planned there from what epoch 0 took: every sample,
    not the few the stores held when the dataset was built."""
    url, journal = str(tmp_path / "s"), str(tmp_path / "journal")
    samples = make_samples(30, max_len=50)
    w = StoreWriter(url, make_manifest(), shard_bytes=TOKEN_BYTES * 100)
    add(w, samples[:5])
    follow = Follow(journal, lead=False)
    leader = Leader(Journal.create(journal, [url]), [open_store(url)], follow)
    leader.poll()
    ds = HiddenStateDataset(url, planning=Planning(seed=1), follow=follow)  # built on the first 5 samples
    add(w, samples[5:])
    w.close()
    leader.poll()
    until_end(leader)
    loader = DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True, multiprocessing_context="fork")
    assert sorted(ids_of(loader)) == sorted(s["sample_id"] for s in samples)
    ds.set_epoch(1)
    assert len(ds) == 30 and sorted(ids_of(loader)) == sorted(s["sample_id"] for s in samples)
