"""A family's sequence plan on one of ComfyUI's real tiny models (tests/omnitest/tiny_models.py), run on every rank of
a rank pool (tests/omnitest/rank_pool.py) by the host tests of the families' plans.

Every rank builds the same tiny model (weights and inputs are functions of the seed), samples it once in one process
(the reference) and once with the family's plan applied and the runtime's attention entry installed in
``transformer_options["optimized_attention_override"]``, ComfyUI's own attention seam; both go through ComfyUI's
KSampler (CFG batches cond and uncond).
"""
from __future__ import annotations

from typing import Optional, Sequence


def rank_family_plan(case_name: str, unet_overrides: Optional[dict], ulysses: int, ring: int,
                     latent_shape: Optional[Sequence[int]]):
    """On every rank: (PSNR of the SP latent against the one-process latent in dB, whether the model gives the
    reference again after the plan is removed, how many attention sites the family declares, the exchange calls by
    kind)."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from omnitest.pack import pack_module
    from omnitest.quality import psnr_db
    from omnitest.tiny_models import build_case, sample

    sp = pack_module("omni_hooks.sequence_parallel")
    families = pack_module("nodes.families")
    case = build_case(case_name, unet_overrides=unet_overrides,
                      latent_shape=tuple(latent_shape) if latent_shape else None)
    reference = sample(case)
    dm = case.diffusion_model
    family = families.detect(case.patcher).model_family
    plan = family.sequence_plan(dm)
    runtime = sp.apply_sequence_parallel(dm, sp.SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring),
                                         plan)
    clone = case.patcher.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    options["optimized_attention_override"] = runtime.attention
    try:
        got = sample(case, clone)
    finally:
        sp.remove_sequence_parallel(dm, plan)
    restored = sample(case)
    exchanged = {kind: record.calls for kind, record in runtime.stats.snapshot().items()}
    return psnr_db(got, reference), bool((restored == reference).all()), len(family.attention_sites(dm)), exchanged
