"""A short fixed-seed run of the store fuzzer (``tools/fuzz_store.py``; issue #36): forged stores of every kind of
mutation, every reading command on each, no traceback, hang, memory blow-up, escape or other bits; and of the
boundaries beyond a store's files (``tools/fuzz_boundaries.py``; issue #52): hostile HTTP and S3 endpoints, engine
answers, drafter, run and peer folders, config files, nothing read outside what a command was given."""

from __future__ import annotations

import pytest

from tools import fuzz_store


def test_every_mutator_forges_something(tmp_path):
    """Each mutator changes the store it is given (a mutator that silently did nothing would fuzz nothing)."""
    import random

    base = fuzz_store.make_base(tmp_path)
    for name, mutate in sorted(fuzz_store.MUTATORS.items()):
        for layout in ("zarr", "wds"):
            store, sentinel = tmp_path / f"{name}-{layout}", tmp_path / f"sentinel-{name}-{layout}"
            import shutil

            shutil.copytree(base[layout], store, symlinks=True)
            sentinel.mkdir()
            (sentinel / "secret").write_bytes(b"s")
            before = fuzz_store.tree_digest(store)
            said = mutate(random.Random(7), store, sentinel)
            assert fuzz_store.tree_digest(store) != before, (name, layout, said)


@pytest.mark.slow
def test_a_short_fuzz_run_finds_nothing(tmp_path):
    result = fuzz_store.run(cases=40, seed=36, work=str(tmp_path / "fuzz"))
    t = result["totals"]
    assert t["cases"] == 40 and t["commands"] == 40 * 9
    assert t["refused"] > 0  # the forgeries were refused, not silently read
    assert not result["failures"], result["failures"][:10]


def test_a_short_fuzz_run_of_every_boundary_finds_nothing(tmp_path):
    from tools import fuzz_boundaries

    result = fuzz_store.run(cases=28, seed=52, work=str(tmp_path / "fuzz"), families=fuzz_boundaries.FAMILIES, jobs=2)
    t = result["totals"]
    assert t["cases"] == 28 and set(t["by_family"]) == set(fuzz_boundaries.FAMILIES), t["by_family"]
    assert t["refused"] > 0
    assert not result["failures"], result["failures"][:10]
