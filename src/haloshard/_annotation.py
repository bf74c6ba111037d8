"""A module's halo, validated once: `annotate` marks a module with it, `resolve` derives it.

An `Annotation` is what a halo style installs from: the explicit spec (None: derived), the
sharded dim and the stencil (`_specs`). It is checked against the module when it is made,
not on every forward; `halo_plan(model)` turns every annotated module into a `HaloParallel`
entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from haloshard._errors import HaloError
from haloshard._forward import handle_of
from haloshard._layout import HaloShard
from haloshard._specs import (
    DERIVABLE,
    STENCILS,
    Stencil,
    check_spec,
    check_stencil,
    derive_stencil,
    is_stencil,
    known_forward,
    local_attrs,
    stencil_of_spec,
)

_ANNOTATION = "_haloshard_annotation"


@dataclass(frozen=True)
class Annotation:
    """A module's validated halo: the explicit spec (None: derived), dim and stencil."""

    spec: HaloShard | None
    dim: int
    stencil: Stencil

    def __deepcopy__(self, memo: dict[int, Any]) -> Annotation:
        # Immutable, and HaloShard cannot be pickled (its C-backed Placement base refuses).
        return self


def resolve(module: nn.Module, spec: HaloShard | Stencil | None = None, *, dim: int = 2
            ) -> Annotation:
    """Validate `spec` against `module` and derive its stencil along `dim`.

    A module annotated earlier keeps its annotation when `spec` is None. A stencil spec
    (`ResampleStencil(2, "linear")` for a module that calls `F.interpolate`, say) is taken
    as given: nothing in an arbitrary module can be checked against it.

    Raises:
        HaloError: for a module whose halo cannot be derived, or a spec that does not fit.

    Example::
        >>> resolve(nn.Conv1d(2, 2, 3, padding=1)).stencil.span
        3
    """
    if spec is None and isinstance(getattr(module, _ANNOTATION, None), Annotation):
        return getattr(module, _ANNOTATION)
    if is_stencil(spec):
        if (isinstance(spec, STENCILS) and isinstance(module, DERIVABLE) and known_forward(module)
                and derive_stencil(module, dim) != spec):
            raise HaloError(f"spec {spec} does not match {type(module).__name__}, which needs "
                            f"{derive_stencil(module, dim)}; pass spec=None to derive it")
        check_stencil(spec)
        local_attrs(module, dim)
        return Annotation(None, dim, spec)
    if spec is not None and not isinstance(spec, HaloShard):
        raise HaloError(f"spec must be a HaloShard, a stencil or None, got "
                        f"{type(spec).__name__}")
    if spec is None:
        stencil: Stencil = derive_stencil(module, dim)
    else:
        check_spec(module, spec, dim)
        stencil = stencil_of_spec(spec)
    local_attrs(module, dim)  # raises now, not at the first forward
    return Annotation(spec, dim, stencil)


def annotate(module: nn.Module, spec: HaloShard | Stencil | None = None, *, dim: int = 2
             ) -> nn.Module:
    """Mark `module` (in place) with the halo it needs along `dim`; returns the module.

    `halo_plan(model)` later turns every annotated module into a `HaloParallel` entry.

    Args:
        module: a conv / transposed conv / pooling / upsampling module (spec derived), or
            any module with an explicit spec, e.g. a causal wrapper that pads T itself.
        spec: `HaloShard(dim, left, right, pad)`: the slices a length-preserving module
            reads beyond its input chunk; a stencil from `haloshard._specs` for a module that
            changes the length (e.g. `ResampleStencil(2, "linear")` around `F.interpolate`);
            None derives it from the module.
        dim: the sharded dim of the module's input.

    Raises:
        HaloError: when the spec cannot be derived or does not fit the module, or when a
            halo is attached to it (its padding along `dim` is the halo's while attached).

    Example::
        >>> causal = annotate(CausalConv3d(8, k=3), HaloShard(2, left=2, pad="replicate"))
        >>> halo_plan(nn.Sequential(causal))
        {'0': HaloParallel(spec=HaloShard(dim=2, left=2, right=0, pad='replicate'), dim=2)}
    """
    if handle_of(module) is not None:
        raise HaloError(f"{type(module).__name__} has a halo attached: annotate it before "
                        "parallelize_module, or remove() its handle first")
    setattr(module, _ANNOTATION, resolve(module, spec, dim=dim))
    return module


def annotation_of(module: nn.Module) -> Annotation | None:
    """The module's annotation, or None."""
    found = getattr(module, _ANNOTATION, None)
    return found if isinstance(found, Annotation) else None
