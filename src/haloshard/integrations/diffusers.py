"""Plans and styles for diffusers' video VAEs; diffusers is imported only when used."""

from haloshard.integrations._wan import cached_downsample, wan_encode, wan_encoder_plan

__all__ = ["cached_downsample", "wan_encode", "wan_encoder_plan"]
