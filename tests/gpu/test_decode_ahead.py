"""``rollout.overlap_decode`` on a GPU (skipped without CUDA): ``DecodeAhead`` decodes on a worker
thread and a side stream while the main stream keeps working, and its frames are bitwise those of
the same decode on the main stream after the work.

The latents are produced by the main stream just before the hand-over (a chain of matmuls still
running when ``DecodeAhead`` is called), so a side stream that did not wait for them would decode
unfinished latents; the main stream then queues more matmuls, the work the decode runs beside.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_decode_beside_the_main_stream_is_bitwise_the_decode_after_it():
    from diffusers import AutoencoderKLWan

    from miles.models.tiny_t2v import TINY_VAE
    from miles.train.overlap import DecodeAhead

    device = torch.device("cuda")
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**TINY_VAE).to(device).eval()

    def decode(latents):
        return vae.decode(latents, return_dict=False)[0].float()

    big = torch.randn(4096, 4096, device=device)
    ahead = DecodeAhead(decode, device, mine=lambda index: True)
    try:
        handles, latents = [], []
        for k in range(3):
            g = torch.Generator(device=device).manual_seed(k)
            z = torch.randn(1, TINY_VAE["z_dim"], 3, 16, 16, device=device, generator=g)
            for _ in range(20):  # keep the main stream busy up to the hand-over
                big = torch.tanh(big @ big * 1e-3)
            z = z + big[:1, :1].reshape(1, 1, 1, 1, 1) * 0  # the latents' last op comes after them
            latents.append(z)
            handles.append(ahead(k, z))
            for _ in range(20):  # what the decode runs beside
                big = torch.tanh(big @ big * 1e-3)
        frames = [h.result() for h in handles]
    finally:
        ahead.close()
    assert all(f.device.type == "cpu" and f.is_pinned() for f in frames)
    with torch.no_grad():
        want = [decode(z).cpu() for z in latents]
    for got, ref in zip(frames, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
