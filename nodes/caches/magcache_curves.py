"""Published MagCache magnitude-ratio curves, each with where it comes from.

Every entry names the project or paper that published it, in a comment and in ``source``. A curve is one ratio per
step (models without CFG, or with embedded guidance) or CFG-interleaved ``[c0, u0, c1, u1, ...]``, which is split
here into a cond and an uncond curve: each branch reads its own curve at its own step
(``omni_hooks.magcache.MagRatioTable``). Tables published without the leading 1.0 pads their scripts prepend get them
back here (``pad``). Every curve is nearest-interpolated to the run's step count.

The FLUX.2 and HunyuanVideo 1.5 curves serve ComfyUI 0.3.75's Flux 2 and HunyuanVideo 1.5 (families ``flux2``,
``hunyuan_video15``; nothing matches them on older ComfyUI). Not offered: FramePack and OmniGen2 (no family in
this pack), and kijai/ComfyUI-WanVideoWrapper's Wan 2.2 A14B entries (they are the TI2V-5B curves, see below).

Wan 2.2 A14B, two experts -- the rule
-------------------------------------
The official curves (``wan2.2_t2v_14B``, ``wan2.2_i2v_14B``) span one 40-step run through both experts; the dip in
each marks the switch (step 26 of 40 for T2V: shift 12, boundary 0.875; step 15 of 40 for I2V: shift 5, boundary
0.900). ComfyUI runs the experts as two MODELs in two sampler nodes (KSamplerAdvanced with start/end steps, or split
sigmas), and a sampler sees only its own segment of the schedule: ``sample_sigmas`` is the slice, so neither the
full schedule nor the switch step is known inside the run. Therefore:
  * each curve is offered in two parts, ``<key> (high noise)`` = steps [0, switch) and ``<key> (low noise)`` =
    steps [switch, 40); the low-noise part's first ratio (measured across the expert switch) becomes 1.0, since
    that step is the expert's first and is always computed;
  * each expert's Apply MagCache treats its own sampler segment as the whole of its phase: its local step t of
    T_local reads its part nearest-interpolated to T_local, and retention and start/end apply to the local steps,
    which is the official per-phase retention (T2V: no skipping for the first ``retention`` fraction of each phase);
  * the user says which expert a MODEL is by the part they choose (the weights cannot tell: both experts, and
    Wan 2.1 14B, have the same shape). The parts assume the switch sits where the calibration had it; a workflow
    that switches much earlier or later stretches the part over its segment.
"Where the calibration had it" is a noise level, not a step fraction: ComfyUI's own Wan 2.2 14B templates (20 steps,
shift 8, switch at step 10, i.e. half the steps) switch at sigma 0.889, next to the official boundaries (T2V 0.875,
reached at step 26 of 40 with shift 12; I2V 0.900, step 15 of 40 with shift 5), so each part covers its expert's
phase there even though the official switch is at 65% (T2V) or 37.5% (I2V) of the steps.
The official I2V script never skips in the high-noise phase; to match it, put Apply MagCache on the low-noise model
only (the high-noise I2V part is offered for experimentation).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...omni_hooks.magcache import split_interleaved

_COMFY = "Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS"
_OFFICIAL = "Zehong-Ma/MagCache @df81cb1"
_VLLM = "vllm-project/vllm-omni PR #1287 (RuixiangMa/vllm-omni @1e222bf) vllm_omni/diffusion/cache/magcache/strategy.py"

HIGH_NOISE = "high noise"
LOW_NOISE = "low noise"


@dataclass(frozen=True)
class _Raw:
    key: str
    family: str
    layout: str              # "per step" / "interleaved"
    pad: int                 # leading 1.0 entries the source omits
    calibrated_steps: int
    source: str
    values: list


@dataclass(frozen=True)
class MagCacheCurve:
    """A published curve for one model family: per branch kind ("default" = every branch) ratios, one per step."""

    key: str
    family: str
    curves: tuple[tuple[str, tuple[float, ...]], ...]
    calibrated_steps: int
    source: str
    note: str = ""             # Wan 2.2 A14B: which expert's part of the curve (a note of the run using it)

    @property
    def ratios(self) -> dict[str, tuple[float, ...]]:
        return {name: values for name, values in self.curves}


_RAW: list[_Raw] = [
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['flux'] (nodes.py lines 18-34)
    # FLUX-dev; = MagCache4FLUX/magcache_flux.py @df81cb1 line 459 = diffusers hooks/mag_cache.py @58eb52c
    # FLUX_MAG_RATIOS.
    # ComfyUI-MagCache never skips step 11 for Flux; that quirk is not reproduced.
    _Raw('flux', 'flux', 'per step', pad=0, calibrated_steps=28,
         source=_COMFY + "['flux']", values=[
        1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344, 0.98047,
        1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484, 0.95703,
        0.93359, 0.89062]),
    # source: RuixiangMa/vllm-omni (vllm-project/vllm-omni PR #1287) vllm_omni/diffusion/cache/magcache/strategy.py
    # @1e222bf FluxMagCacheStrategy.FLUX_MAG_RATIOS
    # Re-calibrated Flux curve; disagrees with 'flux' (the MagCache / ComfyUI-MagCache / diffusers one).
    _Raw('flux_vllm_omni', 'flux', 'per step', pad=0, calibrated_steps=28,
         source=_VLLM + " FluxMagCacheStrategy.FLUX_MAG_RATIOS", values=[
        1.0, 1.07313, 1.21035, 1.04432, 1.06818, 1.05547, 1.0183, 1.03405, 1.02574, 1.03042, 1.02739, 1.01955,
        1.01585, 1.02439, 1.01154, 1.01377, 1.00994, 1.01444, 1.00839, 1.02269, 1.0007, 1.00714, 1.00484, 1.01381,
        1.00426, 0.99764, 1.00778, 1.00233]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['flux_kontext'] (nodes.py lines
    # 18-34)
    # FLUX-Kontext as ComfyUI-MagCache ships it (20 steps); disagrees with the official 28-step table below.
    _Raw('flux_kontext', 'flux', 'per step', pad=0, calibrated_steps=20,
         source=_COMFY + "['flux_kontext']", values=[
        1.0, 1.21875, 1.0625, 1.03125, 1.03125, 1.0, 1.00781, 1.03906, 0.98047, 1.03125, 0.96875, 1.02344, 1.0,
        0.99219, 1.02344, 0.98047, 0.95703, 0.98828, 0.98047, 0.88672]),
    # source: Zehong-Ma/MagCache MagCache4FLUX_Kontext/magcache_flux_kontext.py @df81cb1 line 458
    # Official FLUX-Kontext table (28 steps).
    _Raw('flux_kontext_official', 'flux', 'per step', pad=0, calibrated_steps=28,
         source=_OFFICIAL + " MagCache4FLUX_Kontext/magcache_flux_kontext.py line 458", values=[
        1.0, 1.19531, 1.07812, 1.02344, 1.03125, 1.00781, 1.02344, 1.01562, 1.01562, 1.0, 1.01562, 1.0, 1.00781, 1.0,
        1.00781, 1.0, 1.00781, 0.99609, 1.01562, 0.99219, 1.0, 0.99219, 0.98438, 0.99609, 0.96484, 0.96094, 0.9375,
        0.93359]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['chroma'] (nodes.py lines 18-34)
    # Chroma, 26 steps x cond/uncond.
    _Raw('chroma', 'chroma', 'interleaved', pad=0, calibrated_steps=26,
         source=_COMFY + "['chroma']", values=[
        1.0, 1.0, 1.00781, 1.01562, 1.03906, 1.03906, 1.05469, 1.05469, 1.07031, 1.07031, 1.04688, 1.04688, 1.03906,
        1.03906, 1.03906, 1.03906, 1.01562, 1.01562, 1.05469, 1.05469, 0.99609, 0.99609, 1.02344, 1.02344, 1.01562,
        1.01562, 0.99609, 0.99609, 1.0, 1.0, 0.99219, 0.99219, 1.00781, 1.00781, 1.00781, 1.00781, 0.97656, 0.97656,
        0.98828, 0.98828, 0.97266, 0.97266, 1.0, 1.0, 0.93359, 0.93359, 0.94922, 0.94922, 0.92578, 0.92578, 1.0625,
        1.0625]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['qwen_image'] (nodes.py lines
    # 18-34)
    # Qwen-Image, 40 steps x cond/uncond; disagrees with the official 50-step table below.
    _Raw('qwen_image', 'qwen_image', 'interleaved', pad=0, calibrated_steps=40,
         source=_COMFY + "['qwen_image']", values=[
        1.0, 1.0, 1.6875, 1.6875, 1.25, 1.25, 1.34375, 1.33594, 1.11719, 1.11719, 1.10938, 1.10938, 1.13281, 1.13281,
        1.14062, 1.13281, 1.10156, 1.10156, 1.14844, 1.14844, 1.07812, 1.07812, 1.09375, 1.09375, 1.07812, 1.07812,
        1.07812, 1.07031, 1.10156, 1.10156, 1.07031, 1.07031, 1.07812, 1.07812, 1.03906, 1.03906, 1.08594, 1.08594,
        1.07031, 1.07031, 1.07031, 1.07031, 1.05469, 1.05469, 1.0625, 1.0625, 1.03125, 1.03125, 1.03906, 1.03906,
        1.04688, 1.04688, 1.02344, 1.02344, 1.03906, 1.03906, 1.03125, 1.03125, 1.01562, 1.01562, 1.01562, 1.01562,
        0.98828, 0.98828, 0.99219, 0.99219, 0.94922, 0.94922, 0.98047, 0.98047, 0.88672, 0.89062, 0.89062, 0.89062,
        0.78125, 0.78125, 0.74219, 0.73828, 0.54688, 0.54688]),
    # source: Zehong-Ma/MagCache MagCache4QwenImage/magcache_generate.py @df81cb1 line 275
    # Official Qwen-Image table, 50 steps; published without the two leading 1.0 pads the script prepends.
    _Raw('qwen_image_official', 'qwen_image', 'interleaved', pad=2, calibrated_steps=50,
         source=_OFFICIAL + " MagCache4QwenImage/magcache_generate.py line 275", values=[
        1.64062, 1.64062, 1.45312, 1.45312, 1.1875, 1.1875, 1.17188, 1.17188, 1.05469, 1.05469, 1.21094, 1.21094,
        1.10938, 1.10938, 1.11719, 1.11719, 1.13281, 1.13281, 1.11719, 1.11719, 1.07812, 1.07812, 1.07031, 1.07031,
        1.08594, 1.08594, 1.08594, 1.08594, 1.07812, 1.07812, 1.03906, 1.03906, 1.04688, 1.04688, 1.07812, 1.07812,
        1.07031, 1.07031, 1.03125, 1.03125, 1.07812, 1.07812, 1.04688, 1.04688, 1.04688, 1.04688, 1.04688, 1.04688,
        1.03906, 1.03906, 1.01562, 1.01562, 1.03125, 1.03125, 1.02344, 1.02344, 1.02344, 1.02344, 1.02344, 1.02344,
        1.03906, 1.03906, 1.0, 1.0, 1.01562, 1.01562, 1.0, 1.0, 0.99219, 0.99219, 1.00781, 1.00781, 0.98047, 0.98047,
        0.95703, 0.95703, 0.96875, 0.96875, 0.99219, 0.99219, 0.92578, 0.92578, 0.92578, 0.92578, 0.90625, 0.90625,
        0.85938, 0.85938, 0.80469, 0.80469, 0.87891, 0.87891, 0.75, 0.75, 0.60938, 0.60938, 0.55078, 0.55078]),
    # source: Zehong-Ma/MagCache MagCache4QwenImageEdit/magcache_generate.py @df81cb1 line 271
    # Official Qwen-Image-Edit table, 50 steps; published without the two leading 1.0 pads the script prepends.
    _Raw('qwen_image_edit_official', 'qwen_image', 'interleaved', pad=2, calibrated_steps=50,
         source=_OFFICIAL + " MagCache4QwenImageEdit/magcache_generate.py line 271", values=[
        1.41406, 1.41406, 1.09375, 1.09375, 1.3125, 1.3125, 1.20312, 1.20312, 1.0625, 1.0625, 1.125, 1.125, 1.14062,
        1.14062, 1.17969, 1.17969, 1.09375, 1.09375, 1.10938, 1.10938, 1.10938, 1.10938, 1.07031, 1.07031, 1.04688,
        1.04688, 1.09375, 1.09375, 1.03906, 1.03906, 1.0625, 1.0625, 1.04688, 1.04688, 1.0625, 1.0625, 1.04688,
        1.04688, 1.07031, 1.0625, 1.03125, 1.03125, 1.03906, 1.03906, 1.03906, 1.03906, 1.02344, 1.02344, 1.01562,
        1.01562, 1.03125, 1.03125, 1.00781, 1.00781, 1.01562, 1.01562, 1.00781, 1.00781, 1.01562, 1.01562, 1.0, 1.0,
        1.0, 1.0, 0.98828, 0.98828, 0.98047, 0.98047, 0.98047, 0.98047, 0.97266, 0.97266, 0.92578, 0.92578, 0.94922,
        0.94922, 0.98438, 0.98438, 0.89844, 0.89844, 0.91797, 0.91797, 0.92188, 0.92188, 0.84375, 0.84375, 0.82812,
        0.82812, 0.78516, 0.78516, 0.87891, 0.87891, 0.71094, 0.71094, 0.56641, 0.56641, 0.50781, 0.50781]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['hunyuan_video'] (nodes.py lines
    # 18-34)
    # HunyuanVideo 720p (embedded guidance: one per step); = MagCache4HunyuanVideo/magcache_sample_video.py line 316.
    _Raw('hunyuan_video', 'hunyuan_video', 'per step', pad=0, calibrated_steps=50,
         source=_COMFY + "['hunyuan_video']", values=[
        1.0, 1.0754, 1.27807, 1.11596, 1.09504, 1.05188, 1.00844, 1.05779, 1.00657, 1.04142, 1.03101, 1.00679,
        1.02556, 1.00908, 1.06949, 1.05438, 1.02214, 1.02321, 1.03019, 1.00779, 1.03381, 1.01886, 1.01161, 1.02968,
        1.00544, 1.02822, 1.00689, 1.02119, 1.0105, 1.01044, 1.01572, 1.02972, 1.0094, 1.02368, 1.0226, 0.98965,
        1.01588, 1.02146, 1.0018, 1.01687, 0.99436, 1.00283, 1.01139, 0.97122, 0.98251, 0.94513, 0.97656, 0.90943,
        0.85703, 0.75456]),
    # source: Zehong-Ma/MagCache MagCache4HunyuanVideo/magcache_sample_video.py @df81cb1 line 318
    # HunyuanVideo below 720p (the script's 'else' branch, e.g. 544p/540p).
    _Raw('hunyuan_video_544p_official', 'hunyuan_video', 'per step', pad=0, calibrated_steps=50,
         source=_OFFICIAL + " MagCache4HunyuanVideo/magcache_sample_video.py line 318", values=[
        1.0, 1.06971, 1.29073, 1.11245, 1.09596, 1.05233, 1.01415, 1.05672, 1.00848, 1.03632, 1.02974, 1.00984,
        1.03028, 1.00681, 1.06614, 1.05022, 1.02592, 1.01776, 1.02985, 1.00726, 1.03727, 1.01502, 1.00992, 1.03371,
        0.9976, 1.02742, 1.0093, 1.01869, 1.00815, 1.01461, 1.01152, 1.03082, 1.0061, 1.02162, 1.01999, 0.99063,
        1.01186, 1.0217, 0.99947, 1.01711, 0.9904, 1.00258, 1.00878, 0.97039, 0.97686, 0.94315, 0.97728, 0.91154,
        0.86139, 0.76592]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.1_t2v_1.3B'] (nodes.py
    # lines 18-34)
    # = MagCache4Wan2.1/magcache_generate.py @df81cb1 line 912 = kijai/ComfyUI-WanVideoWrapper '1_3B'.
    _Raw('wan2.1_t2v_1.3B', 'wan', 'interleaved', pad=0, calibrated_steps=50,
         source=_COMFY + "['wan2.1_t2v_1.3B']", values=[
        1.0, 1.0, 1.0124, 1.02213, 1.00166, 1.0041, 0.99791, 1.00061, 0.99682, 0.99762, 0.99634, 0.99685, 0.99567,
        0.99586, 0.99416, 0.99422, 0.99578, 0.99575, 0.9957, 0.99563, 0.99511, 0.99506, 0.99535, 0.99531, 0.99552,
        0.99549, 0.99541, 0.99539, 0.9954, 0.99536, 0.99489, 0.99485, 0.99518, 0.99514, 0.99484, 0.99478, 0.99481,
        0.99479, 0.99415, 0.99413, 0.99419, 0.99416, 0.99396, 0.99393, 0.99388, 0.99386, 0.99349, 0.99349, 0.99309,
        0.99304, 0.9927, 0.9927, 0.99228, 0.99226, 0.99171, 0.9917, 0.99137, 0.99135, 0.99068, 0.99063, 0.99005,
        0.99003, 0.98944, 0.98942, 0.98849, 0.98849, 0.98758, 0.98757, 0.98644, 0.98643, 0.98504, 0.98503, 0.9836,
        0.98359, 0.98202, 0.98201, 0.97977, 0.97978, 0.97717, 0.97718, 0.9741, 0.97411, 0.97003, 0.97002, 0.96538,
        0.96541, 0.9593, 0.95933, 0.95086, 0.95089, 0.94013, 0.94019, 0.92402, 0.92414, 0.90241, 0.9026, 0.86821,
        0.86868, 0.81838, 0.81939]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.1_t2v_14B'] (nodes.py lines
    # 18-34)
    # = MagCache4Wan2.1/magcache_generate.py @df81cb1.
    _Raw('wan2.1_t2v_14B', 'wan', 'interleaved', pad=0, calibrated_steps=50,
         source=_COMFY + "['wan2.1_t2v_14B']", values=[
        1.0, 1.0, 1.02504, 1.03017, 1.00025, 1.00251, 0.9985, 0.99962, 0.99779, 0.99771, 0.9966, 0.99658, 0.99482,
        0.99476, 0.99467, 0.99451, 0.99664, 0.99656, 0.99434, 0.99431, 0.99533, 0.99545, 0.99468, 0.99465, 0.99438,
        0.99434, 0.99516, 0.99517, 0.99384, 0.9938, 0.99404, 0.99401, 0.99517, 0.99516, 0.99409, 0.99408, 0.99428,
        0.99426, 0.99347, 0.99343, 0.99418, 0.99416, 0.99271, 0.99269, 0.99313, 0.99311, 0.99215, 0.99215, 0.99218,
        0.99215, 0.99216, 0.99217, 0.99163, 0.99161, 0.99138, 0.99135, 0.98982, 0.9898, 0.98996, 0.98995, 0.9887,
        0.98866, 0.98772, 0.9877, 0.98767, 0.98765, 0.98573, 0.9857, 0.98501, 0.98498, 0.9838, 0.98376, 0.98177,
        0.98173, 0.98037, 0.98035, 0.97678, 0.97677, 0.97546, 0.97543, 0.97184, 0.97183, 0.96711, 0.96708, 0.96349,
        0.96345, 0.95629, 0.95625, 0.94926, 0.94929, 0.93964, 0.93961, 0.92511, 0.92504, 0.90693, 0.90678, 0.8796,
        0.87945, 0.86111, 0.86189]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.1_i2v_480p_14B'] (nodes.py
    # lines 18-34)
    # = MagCache4Wan2.1/magcache_generate.py @df81cb1 line 1002 = kijai/ComfyUI-WanVideoWrapper 'i2v_480'.
    _Raw('wan2.1_i2v_480p_14B', 'wan', 'interleaved', pad=0, calibrated_steps=40,
         source=_COMFY + "['wan2.1_i2v_480p_14B']", values=[
        1.0, 1.0, 0.98783, 0.98993, 0.97559, 0.97593, 0.98311, 0.98319, 0.98202, 0.98225, 0.9888, 0.98878, 0.98762,
        0.98759, 0.98957, 0.98971, 0.99052, 0.99043, 0.99383, 0.99384, 0.98857, 0.9886, 0.99065, 0.99068, 0.98845,
        0.98847, 0.99057, 0.99057, 0.98957, 0.98961, 0.98601, 0.9861, 0.98823, 0.98823, 0.98756, 0.98759, 0.98808,
        0.98814, 0.98721, 0.98724, 0.98571, 0.98572, 0.98543, 0.98544, 0.98157, 0.98165, 0.98411, 0.98413, 0.97952,
        0.97953, 0.98149, 0.9815, 0.9774, 0.97742, 0.97825, 0.97826, 0.97355, 0.97361, 0.97085, 0.97087, 0.97056,
        0.97055, 0.96588, 0.96587, 0.96113, 0.96124, 0.9567, 0.95681, 0.94961, 0.94969, 0.93973, 0.93988, 0.93217,
        0.93224, 0.91878, 0.91896, 0.90955, 0.90954, 0.92617, 0.92616]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.1_i2v_720p_14B'] (nodes.py
    # lines 18-34)
    # = MagCache4Wan2.1/magcache_generate.py @df81cb1 line 1004 = kijai/ComfyUI-WanVideoWrapper 'i2v_720'.
    _Raw('wan2.1_i2v_720p_14B', 'wan', 'interleaved', pad=0, calibrated_steps=40,
         source=_COMFY + "['wan2.1_i2v_720p_14B']", values=[
        1.0, 1.0, 0.99428, 0.99498, 0.98588, 0.98621, 0.98273, 0.98281, 0.99018, 0.99023, 0.98911, 0.98917, 0.98646,
        0.98652, 0.99454, 0.99456, 0.9891, 0.98909, 0.99124, 0.99127, 0.99102, 0.99103, 0.99215, 0.99212, 0.99515,
        0.99515, 0.99576, 0.99572, 0.99068, 0.99072, 0.99097, 0.99097, 0.99166, 0.99169, 0.99041, 0.99042, 0.99201,
        0.99198, 0.99101, 0.99101, 0.98599, 0.98603, 0.98845, 0.98844, 0.98848, 0.98851, 0.98862, 0.98857, 0.98718,
        0.98719, 0.98497, 0.98497, 0.98264, 0.98263, 0.98389, 0.98393, 0.97938, 0.9794, 0.97535, 0.97536, 0.97498,
        0.97499, 0.973, 0.97301, 0.96827, 0.96828, 0.96261, 0.96263, 0.95335, 0.9534, 0.94649, 0.94655, 0.93397,
        0.93414, 0.91636, 0.9165, 0.89088, 0.89109, 0.8679, 0.86768]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.1_vace_1.3B'] (nodes.py
    # lines 18-34)
    # = MagCache4Wan2.1/magcache_generate.py @df81cb1 line 1142.
    _Raw('wan2.1_vace_1.3B', 'wan', 'interleaved', pad=0, calibrated_steps=50,
         source=_COMFY + "['wan2.1_vace_1.3B']", values=[
        1.0, 1.0, 1.00129, 1.0019, 1.00056, 1.00053, 0.99776, 0.99746, 0.99726, 0.99789, 0.99725, 0.99785, 0.9958,
        0.99625, 0.99703, 0.99728, 0.99863, 0.9988, 0.99735, 0.99731, 0.99714, 0.99707, 0.99697, 0.99687, 0.9969,
        0.99683, 0.99695, 0.99702, 0.99697, 0.99701, 0.99608, 0.99617, 0.99721, 0.9973, 0.99649, 0.99657, 0.99659,
        0.99667, 0.99727, 0.99731, 0.99603, 0.99612, 0.99652, 0.99659, 0.99635, 0.9964, 0.9958, 0.99585, 0.99581,
        0.99585, 0.99573, 0.99579, 0.99531, 0.99534, 0.99505, 0.99508, 0.99481, 0.99484, 0.99426, 0.99433, 0.99403,
        0.99406, 0.99357, 0.9936, 0.99302, 0.99305, 0.99243, 0.99247, 0.9916, 0.99164, 0.99085, 0.99087, 0.98985,
        0.9899, 0.98857, 0.98859, 0.98717, 0.98721, 0.98551, 0.98556, 0.98301, 0.98305, 0.9805, 0.98055, 0.97635,
        0.97641, 0.97183, 0.97187, 0.96496, 0.965, 0.95526, 0.95533, 0.94102, 0.94104, 0.91809, 0.91815, 0.87871,
        0.87879, 0.80141, 0.80164]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.1_vace_14B'] (nodes.py
    # lines 18-34)
    # Same values as wan2.1_t2v_14B; = MagCache4Wan2.1/magcache_generate.py @df81cb1 line 1144.
    _Raw('wan2.1_vace_14B', 'wan', 'interleaved', pad=0, calibrated_steps=50,
         source=_COMFY + "['wan2.1_vace_14B']", values=[
        1.0, 1.0, 1.02504, 1.03017, 1.00025, 1.00251, 0.9985, 0.99962, 0.99779, 0.99771, 0.9966, 0.99658, 0.99482,
        0.99476, 0.99467, 0.99451, 0.99664, 0.99656, 0.99434, 0.99431, 0.99533, 0.99545, 0.99468, 0.99465, 0.99438,
        0.99434, 0.99516, 0.99517, 0.99384, 0.9938, 0.99404, 0.99401, 0.99517, 0.99516, 0.99409, 0.99408, 0.99428,
        0.99426, 0.99347, 0.99343, 0.99418, 0.99416, 0.99271, 0.99269, 0.99313, 0.99311, 0.99215, 0.99215, 0.99218,
        0.99215, 0.99216, 0.99217, 0.99163, 0.99161, 0.99138, 0.99135, 0.98982, 0.9898, 0.98996, 0.98995, 0.9887,
        0.98866, 0.98772, 0.9877, 0.98767, 0.98765, 0.98573, 0.9857, 0.98501, 0.98498, 0.9838, 0.98376, 0.98177,
        0.98173, 0.98037, 0.98035, 0.97678, 0.97677, 0.97546, 0.97543, 0.97184, 0.97183, 0.96711, 0.96708, 0.96349,
        0.96345, 0.95629, 0.95625, 0.94926, 0.94929, 0.93964, 0.93961, 0.92511, 0.92504, 0.90693, 0.90678, 0.8796,
        0.87945, 0.86111, 0.86189]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.2_ti2v_5B'] (nodes.py lines
    # 18-34)
    # Wan 2.2 TI2V-5B text-to-video; = MagCache4Wan2.2/magcache_generate.py @df81cb1 line 736 with the two 1.0 pads.
    # kijai/ComfyUI-WanVideoWrapper uses these values for Wan 2.2 A14B ('14B_2.2'): a mismatch, not offered here.
    _Raw('wan2.2_ti2v_5B', 'wan', 'interleaved', pad=0, calibrated_steps=50,
         source=_COMFY + "['wan2.2_ti2v_5B']", values=[
        1.0, 1.0, 0.99505, 0.99389, 0.99441, 0.9957, 0.99558, 0.99551, 0.99499, 0.9945, 0.99534, 0.99548, 0.99468,
        0.9946, 0.99463, 0.99458, 0.9946, 0.99453, 0.99408, 0.99404, 0.9945, 0.99441, 0.99409, 0.99398, 0.99403,
        0.99397, 0.99382, 0.99377, 0.99349, 0.99343, 0.99377, 0.99378, 0.9933, 0.99328, 0.99303, 0.99301, 0.99217,
        0.99216, 0.992, 0.99201, 0.99201, 0.99202, 0.99133, 0.99132, 0.99112, 0.9911, 0.99155, 0.99155, 0.98958,
        0.98957, 0.98959, 0.98958, 0.98838, 0.98835, 0.98826, 0.98825, 0.9883, 0.98828, 0.98711, 0.98709, 0.98562,
        0.98561, 0.98511, 0.9851, 0.98414, 0.98412, 0.98284, 0.98282, 0.98104, 0.98101, 0.97981, 0.97979, 0.97849,
        0.97849, 0.97557, 0.97554, 0.97398, 0.97395, 0.97171, 0.97166, 0.96917, 0.96913, 0.96511, 0.96507, 0.96263,
        0.96257, 0.95839, 0.95835, 0.95483, 0.95475, 0.94942, 0.94936, 0.9468, 0.94678, 0.94583, 0.94594, 0.94843,
        0.94872, 0.96949, 0.97015]),
    # source: Zehong-Ma/MagCache MagCache4Wan2.2/magcache_generate.py @df81cb1 line 738
    # Wan 2.2 TI2V-5B image-to-video; published without the two leading 1.0 pads the script prepends. kijai's
    # 'i2v_14B_2.2' uses these values for Wan 2.2 I2V-A14B: a mismatch, not offered here.
    _Raw('wan2.2_ti2v_5B_i2v', 'wan', 'interleaved', pad=2, calibrated_steps=50,
         source=_OFFICIAL + " MagCache4Wan2.2/magcache_generate.py line 738", values=[
        0.99512, 0.99559, 0.99559, 0.99561, 0.99595, 0.99577, 0.99512, 0.99512, 0.99546, 0.99534, 0.99543, 0.99531,
        0.99496, 0.99491, 0.99504, 0.99499, 0.99444, 0.99449, 0.99481, 0.99481, 0.99435, 0.99435, 0.9943, 0.99431,
        0.99411, 0.99406, 0.99373, 0.99376, 0.99413, 0.99405, 0.99363, 0.99359, 0.99335, 0.99331, 0.99244, 0.99243,
        0.99229, 0.99229, 0.99239, 0.99236, 0.99163, 0.9916, 0.99149, 0.99151, 0.99191, 0.99192, 0.9898, 0.98981,
        0.9899, 0.98987, 0.98849, 0.98849, 0.98846, 0.98846, 0.98861, 0.98861, 0.9874, 0.98738, 0.98588, 0.98589,
        0.98539, 0.98534, 0.98444, 0.98439, 0.9831, 0.98309, 0.98119, 0.98118, 0.98001, 0.98, 0.97862, 0.97859,
        0.97555, 0.97558, 0.97392, 0.97388, 0.97152, 0.97145, 0.96871, 0.9687, 0.96435, 0.96434, 0.96129, 0.96127,
        0.95639, 0.95638, 0.95176, 0.95175, 0.94446, 0.94452, 0.93972, 0.93974, 0.93575, 0.9359, 0.93537, 0.93552,
        0.96655, 0.96616]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.2_t2v_14B'] (nodes.py lines
    # 18-34)
    # Wan 2.2 T2V-A14B: ONE curve over both experts (= MagCache4Wan2.2/magcache_generate.py @df81cb1 line 695 with the
    # two 1.0 pads); the dip 0.65523/0.65252 at step 26 of 40 is the expert switch. Offered split per expert below.
    _Raw('wan2.2_t2v_14B', 'wan', 'interleaved', pad=0, calibrated_steps=40,
         source=_COMFY + "['wan2.2_t2v_14B']", values=[
        1.0, 1.0, 1.00124, 1.00155, 0.99822, 0.99851, 0.99696, 0.99687, 0.99703, 0.99732, 0.9966, 0.99679, 0.99602,
        0.99658, 0.99578, 0.99664, 0.99484, 0.9949, 0.99633, 0.996, 0.99659, 0.99683, 0.99534, 0.99549, 0.99584,
        0.99577, 0.99681, 0.99694, 0.99563, 0.99554, 0.9944, 0.99473, 0.99594, 0.9964, 0.99466, 0.99461, 0.99453,
        0.99481, 0.99389, 0.99365, 0.99391, 0.99406, 0.99354, 0.99361, 0.99283, 0.99278, 0.99268, 0.99263, 0.99057,
        0.99091, 0.99125, 0.99126, 0.65523, 0.65252, 0.98808, 0.98852, 0.98765, 0.98736, 0.9851, 0.98535, 0.98311,
        0.98339, 0.9805, 0.9806, 0.97776, 0.97771, 0.97278, 0.97286, 0.96731, 0.96728, 0.95857, 0.95855, 0.94385,
        0.94385, 0.92118, 0.921, 0.88108, 0.88076, 0.80263, 0.80181]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['wan2.2_i2v_14B'] (nodes.py lines
    # 18-34)
    # Wan 2.2 I2V-A14B: one curve over both experts (= MagCache4Wan2.2/magcache_generate.py @df81cb1 line 771 with the
    # two 1.0 pads); the dip 0.91076/0.91046 at step 15 of 40 is the expert switch. Offered split per expert below.
    _Raw('wan2.2_i2v_14B', 'wan', 'interleaved', pad=0, calibrated_steps=40,
         source=_COMFY + "['wan2.2_i2v_14B']", values=[
        1.0, 1.0, 0.99191, 0.99144, 0.99356, 0.99337, 0.99326, 0.99285, 0.99251, 0.99264, 0.99393, 0.99366, 0.9943,
        0.9943, 0.99276, 0.99288, 0.99389, 0.99393, 0.99274, 0.99289, 0.99316, 0.9931, 0.99379, 0.99377, 0.99268,
        0.99271, 0.99222, 0.99227, 0.99175, 0.9916, 0.91076, 0.91046, 0.98931, 0.98933, 0.99087, 0.99088, 0.98852,
        0.98855, 0.98895, 0.98896, 0.98806, 0.98808, 0.9871, 0.98711, 0.98613, 0.98618, 0.98434, 0.98435, 0.983,
        0.98307, 0.98185, 0.98187, 0.98131, 0.98131, 0.9783, 0.97835, 0.97619, 0.9762, 0.97264, 0.9727, 0.97088,
        0.97098, 0.96568, 0.9658, 0.96045, 0.96055, 0.95322, 0.95335, 0.94579, 0.94594, 0.93297, 0.93311, 0.91699,
        0.9172, 0.89174, 0.89202, 0.8541, 0.85446, 0.79823, 0.79902]),
    # source: RuixiangMa/vllm-omni (vllm-project/vllm-omni PR #1287) vllm_omni/diffusion/cache/magcache/strategy.py
    # @1e222bf Flux2MagCacheStrategy.FLUX2_MAG_RATIOS
    # FLUX.2 (dev, embedded guidance: one per step), 28 steps; no other source.
    _Raw('flux2', 'flux2', 'per step', pad=0, calibrated_steps=28,
         source=_VLLM + " Flux2MagCacheStrategy.FLUX2_MAG_RATIOS", values=[
        1.0, 0.96528, 1.11559, 1.0565, 1.00425, 1.0805, 0.98616, 1.09289, 1.03196, 1.06679, 1.03941, 1.05375, 1.03128,
        1.05349, 1.01983, 1.05535, 1.0662, 1.05748, 1.00318, 1.05222, 1.04556, 1.0506, 1.05058, 1.05219, 1.02025,
        1.05052, 1.04143, 1.0498]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['hunyuan_video1.5'] (nodes.py
    # lines 18-34)
    # HunyuanVideo 1.5, 20 steps x cond/uncond (ComfyUI-MagCache: 'only support cfg>1').
    _Raw('hunyuan_video1.5', 'hunyuan_video15', 'interleaved', pad=0, calibrated_steps=20,
         source=_COMFY + "['hunyuan_video1.5']", values=[
        1.0, 1.0, 1.01172, 1.00293, 0.9873, 1.0127, 1.01465, 0.98926, 0.99805, 1.00098, 0.99512, 0.99365, 0.99512,
        0.99561, 0.99316, 0.99365, 0.99365, 0.99365, 0.99316, 0.99316, 0.99268, 0.99268, 0.9917, 0.9917, 0.99023,
        0.99023, 0.98828, 0.98877, 0.98633, 0.98633, 0.9834, 0.9834, 0.97949, 0.97998, 0.97363, 0.97363, 0.96436,
        0.96436, 0.94824, 0.94873]),
    # source: Zehong-Ma/ComfyUI-MagCache nodes.py @47bdd2a SUPPORTED_MODELS_MAG_RATIOS['hunyuan_video1.5_40steps']
    # (nodes.py lines 18-34)
    # HunyuanVideo 1.5, 40 steps x cond/uncond; ComfyUI-MagCache uses it when the schedule has more than 20 steps.
    _Raw('hunyuan_video1.5_40steps', 'hunyuan_video15', 'interleaved', pad=0, calibrated_steps=40,
         source=_COMFY + "['hunyuan_video1.5_40steps']", values=[
        1.0, 1.0, 1.04199, 1.01953, 1.01172, 1.01855, 1.00293, 1.00586, 1.00098, 1.00195, 1.0, 1.00098, 0.99805,
        0.99902, 0.99854, 0.99805, 0.99658, 0.99756, 0.99707, 0.99512, 0.99609, 0.99609, 0.99658, 0.99658, 0.99658,
        0.99805, 0.99658, 0.99707, 0.99561, 0.99561, 0.99561, 0.99658, 0.99658, 0.99658, 0.99609, 0.99658, 0.99512,
        0.99561, 0.99463, 0.99512, 0.99463, 0.99512, 0.99463, 0.99512, 0.99365, 0.99414, 0.99365, 0.99365, 0.99219,
        0.99219, 0.99219, 0.99268, 0.99072, 0.99121, 0.99072, 0.99072, 0.98926, 0.98975, 0.9873, 0.98779, 0.98535,
        0.98584, 0.9834, 0.9834, 0.97998, 0.97998, 0.97607, 0.97607, 0.96973, 0.96973, 0.96338, 0.96338, 0.9502,
        0.9502, 0.93066, 0.93066, 0.896, 0.896, 0.81787, 0.81836]),
]

# Wan 2.2 A14B: the first step of the low-noise expert in the official 40-step calibration (the dip in each curve).
A14B_SWITCH_STEP = {"wan2.2_t2v_14B": 26, "wan2.2_i2v_14B": 15}
_A14B_NOTES = {
    ("wan2.2_t2v_14B", HIGH_NOISE): "Wan 2.2 T2V-A14B high-noise expert: official curve steps 0-25 of 40",
    ("wan2.2_t2v_14B", LOW_NOISE): "Wan 2.2 T2V-A14B low-noise expert: official curve steps 26-39 of 40",
    ("wan2.2_i2v_14B", HIGH_NOISE): "Wan 2.2 I2V-A14B high-noise expert: official curve steps 0-14 of 40 (the "
                                    "official script never skips in this phase)",
    ("wan2.2_i2v_14B", LOW_NOISE): "Wan 2.2 I2V-A14B low-noise expert: official curve steps 15-39 of 40",
}


def _branches(raw: _Raw) -> dict[str, list[float]]:
    values = [1.0] * raw.pad + [float(v) for v in raw.values]
    if raw.layout == "interleaved":
        return split_interleaved(values)
    return {"default": values}


def _freeze(curves: dict[str, list[float]]) -> tuple[tuple[str, tuple[float, ...]], ...]:
    return tuple((name, tuple(values)) for name, values in curves.items())


def _build() -> dict[str, MagCacheCurve]:
    published: dict[str, MagCacheCurve] = {}
    for raw in _RAW:
        curves = _branches(raw)
        assert all(len(v) == raw.calibrated_steps for v in curves.values()), raw.key
        switch = A14B_SWITCH_STEP.get(raw.key)
        if switch is None:
            published[raw.key] = MagCacheCurve(raw.key, raw.family, _freeze(curves), raw.calibrated_steps, raw.source)
            continue
        for phase, part in ((HIGH_NOISE, slice(0, switch)), (LOW_NOISE, slice(switch, None))):
            parts = {name: [1.0] + values[part][1:] for name, values in curves.items()}
            key = f"{raw.key} ({phase})"
            published[key] = MagCacheCurve(key, raw.family, _freeze(parts), len(next(iter(parts.values()))),
                                           raw.source, note=_A14B_NOTES[(raw.key, phase)])
    return published


PUBLISHED: dict[str, MagCacheCurve] = _build()


def for_family(family: str) -> list[MagCacheCurve]:
    return [c for c in PUBLISHED.values() if c.family == family]
