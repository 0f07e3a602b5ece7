"""The pixel-space VAEs: exact space-to-depth, the AutoencoderKLQwenImage and AutoencoderKLWan interfaces, save/load."""

import pytest
import torch

from serve_app.models.pixel_vae import PixelPatchVAE, PixelPatchVideoVAE


@pytest.mark.parametrize("patch_size", [1, 2, 4])
def test_encode_decode_are_exact_inverses(patch_size):
    vae = PixelPatchVAE(patch_size=patch_size)
    x = torch.rand(3, 3, 1, 16, 16) * 2 - 1
    z = vae.encode(x).latent_dist.mode()
    assert z.shape == (3, 3 * patch_size**2, 1, 16 // patch_size, 16 // patch_size)
    assert torch.equal(vae.decode(z, return_dict=False)[0], x)
    # A channel of z is one pixel position of one colour within each patch.
    assert torch.equal(z[:, 0, 0], x[:, 0, 0, ::patch_size, ::patch_size])
    assert vae.config.z_dim == 3 * patch_size**2 and len(vae.temperal_downsample) == {1: 0, 2: 1, 4: 2}[patch_size]
    assert vae.config.latents_mean == [0.0] * vae.config.z_dim and vae.config.latents_std == [1.0] * vae.config.z_dim


def test_save_and_load_round_trip(tmp_path):
    PixelPatchVAE(patch_size=2).save_pretrained(tmp_path)
    loaded = PixelPatchVAE.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert loaded.config.patch_size == 2 and loaded.dtype == torch.bfloat16 and loaded.config.z_dim == 12


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        PixelPatchVAE(patch_size=3)
    with pytest.raises(ValueError, match="z_dim"):
        PixelPatchVAE(patch_size=2, z_dim=16)
    with pytest.raises(ValueError, match="identity"):
        PixelPatchVAE(patch_size=1, latents_std=[2.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"\[B, C, 1, H, W\]"):
        PixelPatchVAE().encode(torch.zeros(1, 3, 8, 8))


def test_video_vae_folds_every_frame_alike_and_keeps_the_frame_count(tmp_path):
    vae = PixelPatchVideoVAE(patch_size=2)
    x = torch.rand(2, 3, 5, 8, 8) * 2 - 1
    z = vae.encode(x).latent_dist.mode()
    assert z.shape == (2, 12, 5, 4, 4)
    for frame in range(5):  # frame by frame, the image VAE's folding
        torch.testing.assert_close(z[:, :, frame : frame + 1], PixelPatchVAE(patch_size=2).encode(x[:, :, frame : frame + 1]).latent_dist.mode(), atol=0, rtol=0)
    assert torch.equal(vae.decode(z, return_dict=False)[0], x)
    # What WanPipeline reads from its VAE's config.
    assert (vae.config.scale_factor_temporal, vae.config.scale_factor_spatial, vae.config.z_dim) == (1, 2, 12)
    vae.save_pretrained(tmp_path)
    assert PixelPatchVideoVAE.from_pretrained(tmp_path).config.scale_factor_spatial == 2
    with pytest.raises(ValueError, match="temporal factor 1"):
        PixelPatchVideoVAE(patch_size=2, scale_factor_temporal=4)
