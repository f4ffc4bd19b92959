"""The CPU kernels: oneDNN linear layers agree with F.linear and follow weight updates."""

import pytest
import torch

from rag_spec_kernels import use_onednn_linear
from rag_spec_kernels.onednn_linear import onednn_available


class Tiny(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.proj = torch.nn.Linear(24, 40, bias=bias)
        self.weight = self.proj.weight  # onednn_available reads model.device / model.dtype

    @property
    def device(self):
        return self.weight.device

    @property
    def dtype(self):
        return self.weight.dtype

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 5, 24), (16, 24)])
def test_onednn_linear_matches_f_linear_and_restores_the_layer(bias, shape):
    torch.manual_seed(0)
    model = Tiny(bias).eval()
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    x = torch.randn(shape)
    with torch.inference_mode():
        expected = model(x)
        with use_onednn_linear(model):
            assert "forward" in vars(model.proj)  # the fast path is in place
            got = model(x)
        assert "forward" not in vars(model.proj)  # and gone afterwards
        assert torch.equal(model(x), expected)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_onednn_linear_follows_weight_updates():
    model = Tiny(True).eval()
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    x = torch.randn(2, 24)
    with torch.inference_mode():
        with use_onednn_linear(model):
            model(x)
        model.proj.weight.mul_(2)  # an in-place change must invalidate the reordered copy
        with use_onednn_linear(model):
            got = model(x)
        torch.testing.assert_close(got, torch.nn.functional.linear(
            x, model.proj.weight, model.proj.bias), rtol=1e-5, atol=1e-5)
