"""The benchmarks' profile helpers (tools/measure.py): the tables #40's profiles are read from."""

import torch

from tools.measure import gemm_profile, ops_by_shape


def test_gemm_profile_groups_a_forwards_matrix_products_by_shape():
    """Two layers of a [3, 50, 64] input: a bias-free 64 -> 96 (aten::mm) and a biased 96 -> 32 (aten::addmm),
    the second called twice; each shape once in the table with its calls and 2*m*k*n per call."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32)
    x = torch.randn(3, 50, 64)

    def forward():
        h = first(x)
        return second(h) + second(h)

    forward()
    rows = {(r["m"], r["k"], r["n"]): r for r in gemm_profile(forward)}
    assert set(rows) == {(150, 64, 96), (150, 96, 32)}
    assert rows[(150, 64, 96)]["calls"] == 1 and rows[(150, 96, 32)]["calls"] == 2
    assert rows[(150, 96, 32)]["flop"] == 2 * 2 * 150 * 96 * 32
    assert all(r["ms"] > 0 for r in rows.values())


def test_ops_by_shape_tells_the_calls_of_one_operator_apart():
    """Two casts of different shapes: two rows of aten::copy_, the bigger one with both of its calls."""
    big, small = torch.randn(256, 512), torch.randn(8, 16)

    def casts():
        big.to(torch.float64), big.to(torch.float64), small.to(torch.float64)

    casts()
    rows = ops_by_shape(casts, {"aten::copy_"})
    by_shape = {tuple(map(tuple, r["shapes"][:1])): r for r in rows}
    assert by_shape[((256, 512),)]["calls"] == 2 and by_shape[((8, 16),)]["calls"] == 1
    assert all(r["op"] == "aten::copy_" for r in rows)
