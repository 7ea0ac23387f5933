"""few_rows_linear, the decode step's product, against an fp64 reference on random inputs: one row
(blocks of output rows in one batched product, or F.linear where the rows do not split evenly),
2 to FEW_ROWS rows ((W x^T)^T), more rows, non-contiguous rows, odd sizes; under autograd it is
F.linear to the bit."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.layers import FEW_ROWS, ROW_BLOCKS, few_rows_linear


@pytest.mark.parametrize("num_rows", [1, 2, 5, FEW_ROWS, FEW_ROWS + 3])
@pytest.mark.parametrize("out_features", [ROW_BLOCKS * 7, 50, 1])
@pytest.mark.parametrize("in_features", [37, 256])
def test_equals_the_fp64_product(num_rows, out_features, in_features):
    generator = torch.Generator().manual_seed(num_rows * 1000 + out_features + in_features)
    rows = torch.randn(num_rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    expected = rows.double() @ weight.double().T
    with torch.no_grad():
        actual = few_rows_linear(rows, weight)
    assert actual.shape == (num_rows, out_features) and actual.dtype == torch.float32 and actual.is_contiguous()
    # fp32 sums of in_features products: well within 1e-5 of the rows' scale.
    scale = (rows.double().abs() @ weight.double().abs().T).max()
    assert (actual.double() - expected).abs().max() <= 1e-5 * scale


def test_rows_laid_out_otherwise_give_the_same_bits():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(ROW_BLOCKS * 4, 64, generator=generator)
    wide = torch.randn(4, 128, generator=generator)
    with torch.no_grad():
        for num_rows in (1, 3):
            strided = wide[:num_rows, ::2]  # non-contiguous rows
            assert torch.equal(few_rows_linear(strided, weight), few_rows_linear(strided.contiguous(), weight))


def test_under_autograd_it_is_f_linear():
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(1, 64, generator=generator, requires_grad=True)
    weight = torch.randn(ROW_BLOCKS * 2, 64, generator=generator)
    assert torch.equal(few_rows_linear(rows, weight), torch.nn.functional.linear(rows, weight))
