"""kvprobe's grouped eager attention: the in-place path (no autograd) gives the same bits as the
autograd path, both match transformers' own eager attention to float rounding, and a backward
through the autograd path works."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward  # the stock one, with softcap

from kvprobe.models.attention import grouped_eager


class _Module(torch.nn.Module):
    def __init__(self, head_dim: int, n_kv_groups: int):
        super().__init__()
        self.head_dim, self.num_key_value_groups = head_dim, n_kv_groups


def _inputs(seed: int, B=2, H=4, H_kv=2, S=5, N=7, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, d, generator=g) for h, n in ((H, S), (H_kv, N), (H_kv, N)))
    mask = torch.zeros(B, 1, S, N)
    mask[0, :, :, :2] = torch.finfo(torch.float32).min  # the first row's first two positions are padding
    return _Module(d, H // H_kv), q, k, v, mask


@pytest.mark.parametrize("softcap", [None, 50.0, 3.0])
def test_in_place_path_gives_the_autograd_paths_bits_and_stock_eager_to_rounding(softcap):
    module, q, k, v, mask = _inputs(0)
    with torch.no_grad():
        out_fast, w_fast = grouped_eager(module, q, k, v, mask, scaling=0.3, softcap=softcap)
    qg = q.clone().requires_grad_(True)
    out_grad, w_grad = grouped_eager(module, qg, k, v, mask, scaling=0.3, softcap=softcap)
    assert torch.equal(out_fast, out_grad.detach()) and torch.equal(w_fast, w_grad.detach())
    with torch.no_grad():
        out_ref, w_ref = eager_attention_forward(module, q, k, v, mask, scaling=0.3, softcap=softcap)
    torch.testing.assert_close(out_fast, out_ref)
    torch.testing.assert_close(w_fast, w_ref)
    out_grad.sum().backward()  # tanh's saved output was not overwritten
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_in_place_path_leaves_its_inputs_alone():
    module, q, k, v, mask = _inputs(1)
    before = [t.clone() for t in (q, k, v, mask)]
    with torch.no_grad():
        grouped_eager(module, q, k, v, mask, scaling=None, softcap=20.0)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, mask)))
