"""Context-parallel plans for the video VAEs of diffusers 0.42.1, T sharded over a mesh.

`plan_for(module)` returns the `parallelize_module` plan of a VAE, its encoder or its
decoder, dispatching on the class. Supported (exact against one device, forward and
backward, odd and even T, uneven and empty shards; checked with `haloshard.verify_plan` in
tests/test_diffusers.py):

- `AutoencoderKLHunyuanVideo`: encoder and decoder, block-causal mid-block attention;
- `AutoencoderKLCogVideoX`: encoder and decoder; its `encode`/`decode` loop over frame
  batches (GroupNorm statistics per batch), which `cogvideox_encode(vae, x)` and
  `cogvideox_decode(vae, z)` compute exactly with T sharded;
- `AutoencoderKLMochi`: encoder and decoder, causal attention along T per pixel;
  `mochi_decode(vae, z)` is `vae.decode(z).sample` with the video left sharded;
- `AutoencoderKLLTXVideo`: the 0.9.0 configuration, residual upsamplers with any
  `upsample_factor`, timestep conditioning (0.9.1+: per-sample tables on the decoder
  and its resnets, `ReplicatedArgsParallel`), and 0.9.5/0.9.7's encoder downsamplers
  (`LTXDownsamplerParallel`, `haloshard.integrations.diffusers.ltx`); noise injection raises
  `HaloError`.
- `AutoencoderKLWan` (Wan 2.1): on T, `wan_encoder_plan(vae)` with `wan_encode(vae, x)`,
  and `wan_decoder_plan(vae)` with `wan_decode(vae, z)` (`haloshard.integrations.diffusers.wan`,
  re-exported here) give exactly `vae._encode`'s chunk loop (T = 1 + 4k) and `vae._decode`'s
  frame loop; on H, `plan_for(vae, dims=(3,))` runs those loops themselves (the public
  `encode` / `decode`, unchanged) on each rank's rows.

Each plan checks every layer by class, with or without parameters: a class it does not know
raises `HaloError` naming the layer by fqn, rather than being left to DTensor's default
dispatch; so does a VAE switch that changes how `encode` / `decode` walk T (tiling,
slicing, framewise encoding or decoding). The styles that only these models need live here:

- `HunyuanMidBlockParallel`: the mid-block builds a block-causal `(THW)^2` frame mask in its
  own forward and hands it to a diffusers `Attention`. The style runs the block's resnets
  (each with its own plan entries) and replaces the attention by `frame_attention` on this
  rank's queries (K/V gathered along T, the mask built per rank from frame positions, never
  densely); the attention's parameters and GroupNorm are used as its `AttnProcessor2_0`
  would. Empty shards run no diffusers attention code.
- `HunyuanUpsampleParallel`: "keep the first frame, repeat the others `f` times, then a
  causal conv": the module runs on a window that starts early enough for the causal conv
  to see real frames (FirstFrameParallel's window gives it one input frame only).
- `CogSpatialNormParallel`: CogVideoX's decoder norm conditioned on the latent, which it
  resizes by the global T.
- `MochiBlockParallel`, `MochiUpBlockParallel`: Mochi's blocks with causal attention along
  T per pixel, and depth-to-space along T.
- `LTXUpsamplerParallel`: a conv before depth-to-space along T, on windows with its reach.
- `LTXPatchRowsParallel`: with H sharded, LTX-Video's patchify and unpatchify (its own
  reshape and flatten, on each rank's rows) need every rank's rows to be whole patches;
  it checks that before the encoder (and the decoder's `mid_block`) runs.

`plan_for(module, dims=(3,))` shards H instead (every model above), and `dims=(2, 3)` T
and H at once on a `(t, h)` mesh (HunyuanVideo, Mochi, LTX-Video); the styles above then
take `dim=3`, or a stencil along H beside their T one (`RepeatConvStencil`,
`ConvRepeatStencil`). With H sharded, T is whole on every rank, so the models' own frame
loops (CogVideoX's frame batches, Wan's chunks with their feature caches) run unchanged;
Wan's causal convs take their H halo for their cached frames too
(`WanCausalConvParallel`), and its per-frame attention gathers K and V along H
(`WanAttentionParallel`). A layer that cannot be sharded on the dims asked for raises
`HaloError` naming it when the plan is built.

diffusers is imported only when a function here is called.
"""

from __future__ import annotations

from haloshard.integrations.diffusers.cogvideox import (
    CogSpatialNormParallel,
    cogvideox_decode,
    cogvideox_encode,
)
from haloshard.integrations.diffusers.hunyuan import (
    HunyuanMidBlockParallel,
    HunyuanUpsampleParallel,
)
from haloshard.integrations.diffusers.ltx import (
    LTXDownsamplerParallel,
    LTXPatchRowsParallel,
    LTXUpsamplerParallel,
    SpaceToDepthStencil,
)
from haloshard.integrations.diffusers.mochi import (
    MochiBlockParallel,
    MochiUpBlockParallel,
    mochi_decode,
)
from haloshard.integrations.diffusers.plan import plan_for
from haloshard.integrations.diffusers.stencils import (
    ConvDepthToSpaceStencil,
    ConvRepeatStencil,
    RepeatConvStencil,
    RepeatStencil,
    UpCausalStencil,
)
from haloshard.integrations.diffusers.wan import (
    CachedUpStencil,
    WanAttentionParallel,
    WanCausalConvParallel,
    cached_resample,
    wan_decode,
    wan_decoder_plan,
    wan_encode,
    wan_encoder_plan,
)

__all__ = [
    "plan_for",
    "cogvideox_encode",
    "cogvideox_decode",
    "mochi_decode",
    "wan_encoder_plan",
    "wan_encode",
    "wan_decoder_plan",
    "wan_decode",
    "cached_resample",
    "CachedUpStencil",
    "WanCausalConvParallel",
    "WanAttentionParallel",
    "HunyuanMidBlockParallel",
    "HunyuanUpsampleParallel",
    "CogSpatialNormParallel",
    "MochiBlockParallel",
    "MochiUpBlockParallel",
    "LTXUpsamplerParallel",
    "LTXDownsamplerParallel",
    "LTXPatchRowsParallel",
    "UpCausalStencil",
    "RepeatStencil",
    "ConvDepthToSpaceStencil",
    "RepeatConvStencil",
    "ConvRepeatStencil",
    "SpaceToDepthStencil",
]
