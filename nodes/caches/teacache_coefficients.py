"""Published TeaCache polynomials, each with where it comes from.

Every entry names the project or paper that published it (``source``). Coefficients are highest degree first
(numpy.poly1d order). ``signal`` says which tensor the polynomial was fitted on: a signal its family offers by that
name (``ModelFamily.signals``). ``threshold`` and the ``start_percent`` / ``end_percent`` window are the published
entry's (its source in ``source``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TeaCacheCoefficients:
    key: str
    family: str
    coefficients: tuple[float, float, float, float, float]
    threshold: float
    # Wan: "default" = time embedding e, "ret" = 6-way projection e0; Lumina2: "default" = time embedding t,
    # "modulated" = layers[0] modulated input; HiDream: "default" = timestep embedding, "hidden" = head image tokens
    signal: str = "default"
    ret_steps: int = 1           # steps always computed at the start
    start_percent: float = 0.0   # the published caching window: applied where the node's inputs keep their defaults
    end_percent: float = 1.0
    source: str = ""             # where the numbers come from


_WELLTOP = "welltop-cn/ComfyUI-TeaCache nodes.py @91dff8e SUPPORTED_MODELS_COEFFICIENTS"
_WAN_README = "ali-vilab/TeaCache TeaCache4Wan2.1/README.md"

PUBLISHED: dict[str, TeaCacheCoefficients] = {c.key: c for c in [
    # source: welltop flux (= ali-vilab TeaCache4FLUX/teacache_flux.py @7c10efc line 113); README: 0.4 ~2x
    TeaCacheCoefficients("flux", "flux", (498.651651, -283.781631, 55.8554382, -3.82021401, 0.264230861), 0.4,
                         source=f"{_WELLTOP}['flux']; threshold: welltop README"),
    # source: welltop flux-kontext; README: 0.22, start 0.2, end 0.9 (~2x)
    TeaCacheCoefficients("flux-kontext", "flux", (-1046.55119, 312.563399, -16.9500694, 0.410995971, 0.0374537863),
                         0.22, start_percent=0.2, end_percent=0.9,
                         source=f"{_WELLTOP}['flux-kontext']; welltop README"),
    # source: welltop ltxv (= ali-vilab TeaCache4LTX-Video/teacache_ltx.py line 72); welltop README 0.06
    TeaCacheCoefficients("ltxv", "ltxv", (21.4700694, -12.8016453, 2.31279151, 0.792487521, 0.00969274326), 0.06,
                         source=f"{_WELLTOP}['ltxv']; welltop README"),
    # source: welltop lumina_2; README 0.38, start 0.2, end 1. Disagrees with the official fits below.
    TeaCacheCoefficients("lumina_2", "lumina2", (-874.643948, 466.059906, -75.1559762, 5.32836175, -0.0327258296),
                         0.38, start_percent=0.2, source=f"{_WELLTOP}['lumina_2']; welltop README"),
    # source: ali-vilab TeaCache4Lumina2/teacache_lumina2.py @7c10efc line 72; script threshold 0.3
    TeaCacheCoefficients("lumina2_official_v1", "lumina2",
                         (393.76566581, -603.50993606, 209.10239044, -23.00726601, 0.86377344), 0.3,
                         signal="modulated",  # fitted on layers[0].norm1(x, temb)[0], not on t like lumina_2
                         source="ali-vilab/TeaCache TeaCache4Lumina2/teacache_lumina2.py @7c10efc line 72"),
    # source: welltop hunyuan_video (= ali-vilab TeaCache4HunyuanVideo line 102); README 0.15
    TeaCacheCoefficients("hunyuan_video", "hunyuan_video",
                         (733.226126, -401.131952, 67.5869174, -3.149878, 0.0961237896), 0.15,
                         source=f"{_WELLTOP}['hunyuan_video']; welltop README"),
    # source: welltop hidream_i1_full (= ali-vilab TeaCache4HiDream-I1 line 298); README 0.35, start 0.1
    TeaCacheCoefficients("hidream_i1_full", "hidream", (-31360.5009, -712.425503, 49.1363285, 8.2651549, 0.108053901),
                         0.35, start_percent=0.1, source=f"{_WELLTOP}['hidream_i1_full']; welltop README"),
    # source: welltop hidream_i1_dev; README 1.0
    TeaCacheCoefficients("hidream_i1_dev", "hidream", (1.39997273, -4.30130469, 5.01534416, -2.20504164, 0.93942874),
                         1.0, signal="hidden", source=f"{_WELLTOP}['hidream_i1_dev']; welltop README"),
    # source: welltop hidream_i1_fast; README 1.5, end 0.9
    TeaCacheCoefficients("hidream_i1_fast", "hidream", (2.26509623, -6.88864563, 7.61123826, -3.10849353, 0.99927602),
                         1.5, end_percent=0.9, signal="hidden",
                         source=f"{_WELLTOP}['hidream_i1_fast']; welltop README"),
    # source: welltop wan2.1_t2v_1.3B (= ali-vilab TeaCache4Wan2.1/teacache_generate.py line 890); README 0.08
    TeaCacheCoefficients("wan2.1_t2v_1.3B", "wan", (2396.76752, -1311.10545, 201.331979, -8.29855975, 0.137887774),
                         0.08, source=f"{_WELLTOP}['wan2.1_t2v_1.3B']; welltop README"),
    TeaCacheCoefficients("wan2.1_t2v_14B", "wan",
                         (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404), 0.2,
                         source=f"{_WELLTOP}['wan2.1_t2v_14B']; welltop README"),
    TeaCacheCoefficients("wan2.1_i2v_480p_14B", "wan", (-302.33167, 223.948934, -52.546397, 5.8734844, -0.201973289),
                         0.26, source=f"{_WELLTOP}['wan2.1_i2v_480p_14B']; welltop README"),
    TeaCacheCoefficients("wan2.1_i2v_720p_14B", "wan",
                         (-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683), 0.25,
                         source=f"{_WELLTOP}['wan2.1_i2v_720p_14B']; welltop README"),
    # retention mode: fitted on e0, first 5 steps forced (ali-vilab use_ret_steps); thresholds from _WAN_README
    TeaCacheCoefficients("wan2.1_t2v_1.3B_ret_mode", "wan",
                         (-52186.2437, 9230.41404, -528.275948, 13.6987616, -0.0499875664), 0.05, signal="ret",
                         ret_steps=5, source=f"{_WELLTOP}['wan2.1_t2v_1.3B_ret_mode']; {_WAN_README}"),
    TeaCacheCoefficients("wan2.1_t2v_14B_ret_mode", "wan",
                         (-303318.725, 49053.7029, -2655.30556, 58.7365115, -0.315583525), 0.1, signal="ret",
                         ret_steps=5, source=f"{_WELLTOP}['wan2.1_t2v_14B_ret_mode']; {_WAN_README}"),
    TeaCacheCoefficients("wan2.1_i2v_480p_14B_ret_mode", "wan",
                         (257151.496, -35422.9917, 1402.86849, -13.5890334, 0.132517977), 0.2, signal="ret",
                         ret_steps=5, source=f"{_WELLTOP}['wan2.1_i2v_480p_14B_ret_mode']; {_WAN_README}"),
    TeaCacheCoefficients("wan2.1_i2v_720p_14B_ret_mode", "wan",
                         (8107.0546, 2133.93892, -372.934672, 16.6203073, -0.0417769401), 0.2, signal="ret",
                         ret_steps=5, source=f"{_WELLTOP}['wan2.1_i2v_720p_14B_ret_mode']; {_WAN_README}"),
    # source: vllm-omni teacache/config.py @011a7ac _MODEL_COEFFICIENTS['QwenImageTransformer2DModel'];
    # documented 0.2 ~1.5x, "values in [0.1, 0.3] work best"
    TeaCacheCoefficients("qwen_image", "qwen_image", (-450.0, 280.0, -45.0, 3.2, -0.02), 0.2,
                         source="vllm-project/vllm-omni teacache/config.py @011a7ac QwenImageTransformer2DModel"),
]}


def for_family(family: str) -> list[TeaCacheCoefficients]:
    return [c for c in PUBLISHED.values() if c.family == family]
