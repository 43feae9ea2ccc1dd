"""Packed oneDNN products: every row count gives `x @ weight.T + bias`, run at one of a few padded shapes."""

from __future__ import annotations

import pytest
import torch

from lightning_grpo.models.packed_matmul import pack_weight, packed_linear, packing_available, padded_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_gives_the_linear_product(dtype):
    if not packing_available(dtype):
        pytest.skip(f"this CPU or torch build has no oneDNN kernels packing {dtype}")
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32).to(dtype), torch.randn(48).to(dtype)
    packed = pack_weight(weight)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in [1, 2, 7, 8, 9, 33, 64, 65, 100, 128, 130]:
        x = torch.randn(rows, 32).to(dtype)
        out = packed_linear(x, packed, bias)
        assert out.shape == (rows, 48)
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(out.float(), expected, atol=tolerance * 4, rtol=tolerance)


def test_row_counts_share_a_few_kernel_shapes():
    shapes = {padded_rows(rows) for rows in range(1, 1025)}
    assert shapes == {*range(8, 65, 8), *range(128, 1025, 64)}
    assert all(padded_rows(rows) >= rows for rows in range(1, 1025))
