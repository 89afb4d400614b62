"""Keyformer's counter-based noise (attnkit.methods.keyformer_noise): the distributions of eq. 5 and 11, and
the decode-step tables equal to the reference draws bit for bit."""

import pytest
import torch

import attnkit
from attnkit.cache import KVCache
from attnkit.methods.keyformer_noise import DecodeNoise, keyformer_noise
from attnkit.session import LayerContext, Session, Step

torch.set_num_threads(1)


def test_keyformer_noise_distributions():
    heads, pos = 2, torch.arange(400)
    gumbel = keyformer_noise("gumbel", 3, 0, heads, 2, pos, pos)
    gauss = keyformer_noise("gaussian", 3, 0, heads, 2, pos, pos)
    for sample in (gumbel, gauss):  # both have the Gumbel's mean and standard deviation (section 4.6.3)
        assert sample.mean().item() == pytest.approx(0.5772, abs=0.01)
        assert sample.std().item() == pytest.approx(1.2825, abs=0.01)
    assert (gumbel - gumbel.mean()).pow(3).mean().item() > 0.5  # skewed (Gumbel) vs symmetric (Gaussian)
    assert abs((gauss - gauss.mean()).pow(3).mean().item()) < 0.1
    assert keyformer_noise("constant", 3, 0, heads, 2, pos, pos) == 0.5772
    # draws of neighbouring heads, queries and keys are uncorrelated (|r| < 0.02 over 80k pairs; 0.014 = 4 sigma)
    for a, b in ((gumbel[0, 0, 0], gumbel[0, 0, 1]), (gumbel[0, 0, 0, :-1], gumbel[0, 0, 0, 1:]),
                 (gumbel[0, 0, 0, :, :-1], gumbel[0, 0, 0, :, 1:]), (gumbel[0, 0, 0], gumbel[0, 1, 0])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.02
    assert not torch.equal(gumbel, keyformer_noise("gumbel", 3, 1, heads, 2, pos, pos))  # per layer


@pytest.mark.parametrize("noise", ["gumbel", "gaussian"])
def test_keyformer_decode_noise_is_bitwise_the_reference_noise(noise):
    kv, g, layers = 2, 3, 3
    tables = DecodeNoise(noise, 5, layers, kv * g, torch.device("cpu"))
    session = Session(attnkit.make_method("keyformer", budget_tokens=8), KVCache(layers), layers, 4, 4)
    gen = torch.Generator().manual_seed(0)
    for q in (3, 17, 100, 5000):  # positions past the key table grow it
        step = Step(session, "decode", torch.tensor([q]))
        for layer in range(layers):
            k_pos = torch.randint(0, q + 1, (1, kv, 9), generator=gen)
            ctx = LayerContext(step, layer, 1.0, None)
            expected = keyformer_noise(noise, 5, layer, kv, g, torch.tensor([q]), k_pos)
            assert torch.equal(tables(ctx, k_pos), expected)
