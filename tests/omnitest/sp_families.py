"""A family's sequence plan on one of ComfyUI's real tiny models (tests/omnitest/tiny_models.py), run on every rank of
a rank pool (tests/omnitest/rank_pool.py) by the host tests of the families' plans.

Every rank builds the same tiny model (weights and inputs are functions of the seed), samples it once in one process
(the reference) and once with the family's plan applied and the runtime's attention entry installed in
``transformer_options["optimized_attention_override"]``, ComfyUI's own attention seam; both go through ComfyUI's
KSampler (CFG batches cond and uncond).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch

if TYPE_CHECKING:
    from omnitest.tiny_models import TinyCase


def _text_mask(case: TinyCase) -> None:
    """The text encoder padded the last 3 tokens (HunyuanVideo's ``attention_mask``: a key mask in attention)."""
    for cond in (case.positive, case.negative):
        mask = torch.ones(1, cond[0][0].shape[1], dtype=torch.long)
        mask[:, -3:] = 0
        cond[0][1]["attention_mask"] = mask


def _denoise_mask(case: TinyCase) -> None:
    """Image-to-video (LTXVImgToVideo): the first latent frame is kept, so the model gets one timestep per token."""
    case.noise_mask = torch.ones(1, 1, *case.latent.shape[2:])
    case.noise_mask[:, :, 0] = 0


def _keyframes(case: TinyCase) -> None:
    """LTXVAddGuide at strength 1: the last latent frame is a guide placed at pixel frame 0, its ``keyframe_idxs`` (RoPE
    positions) made by the host's own node, and kept by the noise mask (``1 - strength`` there)."""
    from comfy_extras.nodes_lt import LTXVAddGuide

    batch, channels, _, height, width = case.latent.shape
    guide = torch.zeros(batch, channels, 1, height, width)
    scale_factors = case.diffusion_model.vae_scale_factors
    case.positive, case.negative = (LTXVAddGuide.add_keyframe_index(cond, 0, guide, scale_factors)
                                    for cond in (case.positive, case.negative))
    case.noise_mask = torch.ones(1, 1, *case.latent.shape[2:])
    case.noise_mask[:, :, -1] = 0


def _ltx2_latent(case: TinyCase, video_frames: int, size: int, audio_frames: int | None) -> None:
    """LTX-2's latent: a video of ``video_frames`` x ``size`` x ``size`` tokens and, unless ``audio_frames`` is None
    (a video-only call: the video latent alone), an audio stream of ``audio_frames`` tokens (LTXVConcatAVLatent)."""
    import comfy.nested_tensor

    video = torch.zeros(1, 128, video_frames, size, size)
    case.latent = video if audio_frames is None else comfy.nested_tensor.NestedTensor(
        [video, torch.zeros(1, 8, audio_frames, 16)])


def _ltx2_image_to_video(case: TinyCase) -> None:
    """LTX-2 image-to-video (27 video tokens, 5 audio): the first video frame kept, so the video timesteps are one
    row per latent frame (the host's CompressedTimestep) and the audio's one per sample."""
    import comfy.nested_tensor

    _ltx2_latent(case, 3, 3, 5)
    video_mask = torch.ones(1, 1, 3, 3, 3)
    video_mask[:, :, 0] = 0
    case.noise_mask = comfy.nested_tensor.NestedTensor([video_mask, torch.ones(1, 1, 5, 16)])


def _ltx2_guide(strength: float) -> Callable[[TinyCase], None]:
    """LTX-2 video only (27 tokens) with an LTXVAddGuide guide frame at ``strength`` made by the host's own node
    helpers (below 1 the model builds a self-attention mask over the whole sequence)."""
    def change(case: TinyCase) -> None:
        from comfy_extras.nodes_lt import LTXVAddGuide, _append_guide_attention_entry

        _ltx2_latent(case, 3, 3, None)
        guide = torch.zeros(1, 128, 1, 3, 3)
        positive, negative, case.latent, case.noise_mask = LTXVAddGuide.append_keyframe(
            case.positive, case.negative, 0, case.latent, torch.ones(1, 1, 3, 3, 3), guide, strength,
            case.diffusion_model.vae_scale_factors)
        case.positive, case.negative = _append_guide_attention_entry(positive, negative, 9, [1, 3, 3],
                                                                     strength=strength)
    return change


def _guiding_frame_index(case: TinyCase) -> None:
    """HunyuanVideo I2V "v2 (replace)": the first latent frame guides (``guiding_frame_index``)."""
    case.positive[0][1]["guiding_frame_index"] = 0


#: Named changes to a case's inputs (names, not functions, cross to the ranks).
INPUT_VARIANTS: dict[str, Callable[[TinyCase], None]] = {
    "text_mask": _text_mask, "denoise_mask": _denoise_mask, "keyframes": _keyframes,
    "guiding_frame_index": _guiding_frame_index,
    # LTX-2: 32 video tokens and 5 audio (the case's own), 27 and 5 (the last shard padded), 27 and 1 (fewer audio
    # tokens than ranks), 27 video tokens alone (a video-only call), 2 x 4 x 4 video tokens alone
    "ltx2_odd": lambda case: _ltx2_latent(case, 3, 3, 5),
    "ltx2_short_audio": lambda case: _ltx2_latent(case, 3, 3, 1),
    "ltx2_video_only": lambda case: _ltx2_latent(case, 3, 3, None),
    "ltx2_video_only_even": lambda case: _ltx2_latent(case, 2, 4, None),
    "ltx2_image_to_video": _ltx2_image_to_video,
    "ltx2_guide": _ltx2_guide(1.0),
    "ltx2_guide_half": _ltx2_guide(0.5),
    # Kandinsky 5: 3 x 3 x 3 tokens (the last shard padded); one latent frame of 5 x 5 (the forward's image path)
    "kandinsky5_odd": lambda case: setattr(case, "latent", torch.zeros(1, 16, 3, 6, 6)),
    "kandinsky5_one_frame": lambda case: setattr(case, "latent", torch.zeros(1, 16, 10, 10)),
}


@contextlib.contextmanager
def family_plan_applied(case: TinyCase, ulysses: int, ring: int) -> Iterator[tuple]:
    """Within: the detected family's plan applied to ``case``'s diffusion model on the default process group, and a
    clone of its patcher whose attention goes through the runtime; yields ``(clone, runtime, family)``. The plan is
    removed on exit."""
    from omnitest.pack import pack_module

    sp = pack_module("omni_hooks.sequence_parallel")
    family = pack_module("nodes.families").detect(case.patcher).family
    dm = case.diffusion_model
    plan = family.sequence_plan(dm)
    runtime = sp.apply_sequence_parallel(dm, sp.SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring),
                                         plan)
    clone = case.patcher.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = runtime.attention
    try:
        yield clone, runtime, family
    finally:
        sp.remove_sequence_parallel(dm, plan)


def rank_family_plan(case_name: str, unet_overrides: Optional[dict], ulysses: int, ring: int,
                     latent_shape: Optional[Sequence[int]], variant: Optional[str] = None):
    """On every rank: (PSNR of the SP latent against the one-process latent in dB, whether the model gives the
    reference again after the plan is removed, how many attention sites the family declares, the exchange calls by
    kind). ``variant``: a key of ``INPUT_VARIANTS`` applied to the case's inputs first."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from omnitest.quality import psnr_db
    from omnitest.tiny_models import build_case, sample

    case = build_case(case_name, unet_overrides=unet_overrides,
                      latent_shape=tuple(latent_shape) if latent_shape else None)
    if variant is not None:
        INPUT_VARIANTS[variant](case)
    reference = sample(case)
    with family_plan_applied(case, ulysses, ring) as (clone, runtime, family):
        got = sample(case, clone)
    restored = sample(case)
    exchanged = {kind: record.calls for kind, record in runtime.stats.snapshot().items()}
    sites = len(family.attention_sites(case.diffusion_model))
    return psnr_db(got, reference), bool((restored == reference).all()), sites, exchanged


#: how close a 2-rank latent must be to the one-process latent
MIN_PSNR_DB = 60.0


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest magnitude."""
    return ((got - reference).abs().max() / reference.abs().max()).item()


#: How far (``relative_error``) a Ulysses latent may be from the one-process latent. A rank runs the same arithmetic
#: on its shard as one process on the whole sequence, but not the same kernels: the CPU BLAS picks a linear layer's
#: kernel by its row count and by the CPU (MKL's dispatch, pinned by ``MKL_CBWR``), and the kernels round float32
#: differently. Measured on these tiny models at 3-8 steps: 0 with ``MKL_CBWR=AVX512``, up to 6.2e-7 with
#: ``COMPATIBLE`` or ``AVX2`` (float32's epsilon is 1.2e-7). A wrong split (a shard attending to the wrong tokens,
#: a missed exchange, RoPE positions off by a shard) errs by 1e-2 or more.
SPLIT_RELATIVE = 1e-5
#: Ring attention merges the shards' partial softmaxes in another order than one attention over the whole sequence.
RING_RELATIVE = 1e-3


def assert_split_close(got: torch.Tensor, reference: torch.Tensor, ring: bool = False) -> None:
    """A latent of a split run against the one-process latent: within ``RING_RELATIVE`` with ring attention, else
    within ``SPLIT_RELATIVE`` (bit-equality holds only where every rank runs the same kernels on the same shapes)."""
    error = relative_error(got, reference)
    assert error < (RING_RELATIVE if ring else SPLIT_RELATIVE), error


CallInputs = Sequence[tuple[Optional[str], Optional[Sequence[int]]]]


def rank_calls_against_one_process(case_name: str, unet_overrides: Optional[dict], ulysses: int, ring: int,
                                   cfg: Optional[float], inputs: CallInputs):
    """On every rank: one sampling run per entry of ``inputs`` (``(variant, latent shape)``, either None: the case's
    own), all with the same plan applied (the sequence changes between calls when the inputs do), each against the
    same inputs sampled in one process first. Returns, per run, its ``relative_error``, and the exchange calls by kind
    over every run."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from omnitest.tiny_models import build_case, sample

    built = build_case(case_name, unet_overrides=unet_overrides)
    cases = []
    for variant, latent_shape in inputs:  # the built model with each entry's inputs (a fresh copy of the case's own)
        case = dataclasses.replace(built, positive=copy.deepcopy(built.positive),
                                   negative=copy.deepcopy(built.negative),
                                   latent=torch.zeros(latent_shape) if latent_shape else built.latent)
        if variant is not None:
            INPUT_VARIANTS[variant](case)
        cases.append((case, sample(case, cfg=cfg)))
    results = []
    with family_plan_applied(built, ulysses, ring) as (clone, runtime, _family):
        for case, reference in cases:
            got = sample(case, clone, cfg=cfg)
            results.append(relative_error(got, reference))
    return results, {kind: record.calls for kind, record in runtime.stats.snapshot().items()}


def assert_plan_equals_one_process(rank_pool, case_name: str, unet_overrides: Optional[dict], ulysses: int,
                                   ring: int, latent_shape: Optional[Sequence[int]], sites: int, timeout: float,
                                   variant: Optional[str] = None) -> list[dict[str, int]]:
    """``rank_family_plan`` on 2 ranks of ``rank_pool``, asserting on every rank: the latent within ``MIN_PSNR_DB``
    of one process, the model restored after the plan is removed, ``sites`` attention sites, and the exchanges of its
    degrees (the Ulysses all-to-all or the ring hop) and the output gather. Returns each rank's exchange calls by kind,
    for a test's further checks."""
    exchange = "ulysses_all_to_all" if ulysses > 1 else "ring_hop"
    results = rank_pool(2).run(rank_family_plan, case_name, unet_overrides, ulysses, ring, latent_shape, variant,
                               timeout=timeout)
    for quality, restored, found, exchanged in results:
        assert quality >= MIN_PSNR_DB
        assert restored
        assert found == sites
        assert exchanged.get(exchange, 0) > 0 and exchanged.get("output_all_gather", 0) > 0
    return [exchanged for *_, exchanged in results]


def rank_refused_then_in_step(case_name: str, refused: str, then: Optional[str] = None):
    """On every rank: the error of a run with the inputs of variant ``refused`` under the family's plan (Ulysses over
    2 ranks), the bytes this rank had sent when it was raised, and a run with variant ``then`` (None: the case's own
    inputs) afterwards under the same plan and in one process (the group is still in step when they agree)."""
    from omnitest.comfy_path import use_comfyui_in_process

    use_comfyui_in_process()
    from omnitest.tiny_models import build_case, sample

    case = build_case(case_name)
    after = dataclasses.replace(case, positive=copy.deepcopy(case.positive), negative=copy.deepcopy(case.negative))
    INPUT_VARIANTS[refused](case)
    if then is not None:
        INPUT_VARIANTS[then](after)
    reference = sample(after)
    message = ""
    with family_plan_applied(case, 2, 1) as (clone, runtime, _family):
        try:
            sample(case, clone)
        except ValueError as exc:
            message = str(exc)
        sent = runtime.stats.bytes_sent
        runtime.reset()
        got = sample(after, clone)
    return message, sent, got, reference
