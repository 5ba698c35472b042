"""The registered model families (``nodes/families/``) against ComfyUI's own model classes.

Registration: every family file is registered, precedence is declared (Chroma before Flux) rather than left to file
order, and every family has a tiny model. Detection: each tiny model matches exactly its own family. Variants: on
models at the sizes of released checkpoints (built on the meta device), each family's decision tree names the variant
and the TeaCache / MagCache auto_choices; the keys a family declares are exactly the ones its tree recommends, and
each exists in its table under that family. Weights: the block stack and the declared resident modules hold every
weight of the model, once. The supported-families text of errors, tooltips and the README names every family.
"""
from __future__ import annotations

import dataclasses

import pytest

from omnitest.comfy_path import PACK_ROOT
from omnitest.tiny_models import CASE_FAMILY, CASES

pytestmark = pytest.mark.host


def _wan(**over) -> dict:
    config = {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "in_dim": 16, "out_dim": 16,
              "dim": 5120, "ffn_dim": 13824, "freq_dim": 256, "text_dim": 4096, "num_heads": 40, "num_layers": 40,
              "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
    return {**config, **over}


_WAN_1_3B = dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)
_OFF_SIZE = dict(dim=2048, num_heads=16, num_layers=2)  # a dim no released Wan has


def _flux(**over) -> dict:
    config = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 768,
              "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
              "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
              "guidance_embed": True}
    return {**config, **over}


def _hunyuan(**over) -> dict:
    config = {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
              "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24,
              "depth": 20, "depth_single_blocks": 40, "axes_dim": [16, 56, 56], "theta": 256, "qkv_bias": True,
              "guidance_embed": True, "byt5": False, "meanflow": False}
    return {**config, **over}


def _ltxv(head_dim: int, layers: int) -> dict:
    return {"image_model": "ltxv", "num_layers": layers, "attention_head_dim": head_dim,
            "cross_attention_dim": 32 * head_dim}


_CHROMA = {"image_model": "chroma", "in_channels": 64, "out_channels": 64, "patch_size": 2, "context_in_dim": 4096,
           "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
           "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "in_dim": 64, "out_dim": 3072,
           "hidden_dim": 5120, "n_layers": 5}

# unet_config (as comfy.model_detection reads it from the checkpoint; sizes of the released models unless named
# otherwise) -> (family, variant, TeaCache 'auto' key, MagCache 'auto' key). Every branch of every decision tree.
VARIANTS = {
    "wan2.1 t2v 1.3B": (_wan(**_WAN_1_3B), ("wan", "Wan T2V 1.3B", "wan2.1_t2v_1.3B", "wan2.1_t2v_1.3B")),
    "wan2.1 t2v 14B": (_wan(), ("wan", "Wan T2V 14B", "wan2.1_t2v_14B", "wan2.1_t2v_14B")),
    "wan t2v off-size": (_wan(**_OFF_SIZE), ("wan", "Wan T2V dim 2048", None, None)),
    "wan2.1 i2v 14B": (_wan(model_type="i2v", in_dim=36),
                       ("wan", "Wan 2.1 I2V 14B", "wan2.1_i2v_480p_14B", "wan2.1_i2v_480p_14B")),
    "wan i2v 1.3B": (_wan(model_type="i2v", in_dim=36, **_WAN_1_3B), ("wan", "Wan 2.1 I2V 1.3B", None, None)),
    "wan2.1 vace 1.3B": (_wan(model_type="vace", vace_layers=15, vace_in_dim=96, **_WAN_1_3B),
                         ("wan", "Wan 2.1 VACE 1.3B", "wan2.1_t2v_1.3B", "wan2.1_vace_1.3B")),
    "wan2.1 vace 14B": (_wan(model_type="vace", vace_layers=8, vace_in_dim=96),
                        ("wan", "Wan 2.1 VACE 14B", "wan2.1_t2v_14B", "wan2.1_vace_14B")),
    "wan vace off-size": (_wan(model_type="vace", vace_layers=2, vace_in_dim=96, **_OFF_SIZE),
                          ("wan", "Wan 2.1 VACE dim 2048", None, None)),
    "wan2.2 ti2v 5B": (_wan(in_dim=48, out_dim=48, dim=3072, ffn_dim=14336, num_heads=24, num_layers=30),
                       ("wan", "Wan 2.2 TI2V (dim 3072)", None, "wan2.2_ti2v_5B")),
    "wan2.2 ti2v off-size": (_wan(in_dim=48, out_dim=48, **_OFF_SIZE), ("wan", "Wan 2.2 TI2V (dim 2048)", None, None)),
    "wan2.2 i2v A14B expert": (_wan(in_dim=36), ("wan", "Wan T2V 14B", "wan2.1_t2v_14B", None)),
    "flux dev": (_flux(), ("flux", "Flux dev", "flux", "flux")),
    "flux fill": (_flux(in_channels=96), ("flux", "Flux dev (in_channels 96: Fill/Depth/Canny)", "flux", "flux")),
    "flux schnell": (_flux(guidance_embed=False), ("flux", "Flux schnell (no guidance embedding)", None, None)),
    "chroma": (_CHROMA, ("chroma", "Chroma", None, "chroma")),
    "hunyuan video t2v": (_hunyuan(), ("hunyuan_video", "HunyuanVideo T2V", "hunyuan_video", "hunyuan_video")),
    "hunyuan video i2v": (_hunyuan(in_channels=33),
                          ("hunyuan_video", "HunyuanVideo I2V", "hunyuan_video", "hunyuan_video")),
    "hunyuan video skyreels i2v": (_hunyuan(in_channels=32), ("hunyuan_video", "HunyuanVideo SkyReels I2V",
                                                              "hunyuan_video", "hunyuan_video")),
    "hunyuan image 2.1": (_hunyuan(in_channels=64, out_channels=64, patch_size=[1, 1], vec_in_dim=None,
                                   axes_dim=[64, 64], hidden_size=3584, num_heads=28, byt5=True, guidance_embed=False),
                          ("hunyuan_video", "HunyuanImage 2.1", None, None)),
    "hunyuan image 2.1 refiner": (_hunyuan(in_channels=128, out_channels=64, patch_size=[1, 1, 1], vec_in_dim=None),
                                  ("hunyuan_video", "HunyuanImage 2.1 refiner", None, None)),
    "ltxv 2B": (_ltxv(64, 28), ("ltxv", "LTX-Video 2B", "ltxv", None)),
    "ltxv 13B": (_ltxv(128, 48), ("ltxv", "LTX-Video 13B", "ltxv", None)),
    "ltxv off-size": (_ltxv(32, 2), ("ltxv", "LTX-Video inner_dim 1024", "ltxv", None)),
    "qwen image": ({"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16,
                    "num_layers": 60, "attention_head_dim": 128, "num_attention_heads": 24,
                    "joint_attention_dim": 3584, "axes_dims_rope": (16, 56, 56)},
                   ("qwen_image", "Qwen-Image", "qwen_image", "qwen_image")),
    "lumina2": ({"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 2304, "n_layers": 26,
                 "n_refiner_layers": 2, "n_heads": 24, "n_kv_heads": 8, "multiple_of": 256, "qk_norm": True,
                 "cap_feat_dim": 2304, "axes_dims": [32, 32, 32], "axes_lens": [300, 512, 512]},
                ("lumina2", "Lumina Image 2.0 (dim 2304)", "lumina_2", None)),
    "hidream": ({"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16,
                 "num_single_layers": 32, "attention_head_dim": 128, "num_attention_heads": 20,
                 "caption_channels": [4096, 4096], "text_emb_dim": 2048, "num_routed_experts": 4,
                 "num_activated_experts": 2, "axes_dims_rope": [64, 32, 32], "max_resolution": [128, 128],
                 "llama_layers": list(range(48))},
                ("hidream", "HiDream-I1", "hidream_i1_full", None)),
}
# ComfyUI 0.3.75's models (Flux 2, Z-Image, HunyuanVideo 1.5): on an older ComfyUI building them skips the test.
_HUNYUAN_VIDEO15 = _hunyuan(in_channels=65, out_channels=32, patch_size=[1, 1, 1], vec_in_dim=None, context_in_dim=3584,
                            hidden_size=2048, num_heads=16, depth=54, depth_single_blocks=0, guidance_embed=False,
                            byt5=True, use_cond_type_embedding=True, vision_in_dim=1152)
VARIANTS.update({
    "flux2 dev": ({"image_model": "flux2", "in_channels": 128, "out_channels": 128, "patch_size": 1,
                   "vec_in_dim": None, "context_in_dim": 15360, "hidden_size": 6144, "mlp_ratio": 3.0,
                   "num_heads": 48, "depth": 8, "depth_single_blocks": 48, "axes_dim": [32, 32, 32, 32],
                   "theta": 2000, "qkv_bias": False, "guidance_embed": True, "global_modulation": True,
                   "mlp_silu_act": True, "ops_bias": False, "default_ref_method": "index", "ref_index_scale": 10.0},
                  ("flux2", "Flux 2 dev (hidden 6144, 8+48 blocks)", None, "flux2")),
    "z image": ({"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "n_layers": 30,
                 "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "multiple_of": 256,
                 "ffn_dim_multiplier": 8.0 / 3.0, "qk_norm": True, "cap_feat_dim": 2560, "axes_dims": [32, 48, 48],
                 "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "z_image_modulation": True, "time_scale": 1000.0,
                 "pad_tokens_multiple": 32},
                ("z_image", "Z-Image (dim 3840, 30 layers)", None, None)),
    "hunyuan video 1.5": (_HUNYUAN_VIDEO15, ("hunyuan_video15", "HunyuanVideo 1.5", None, "hunyuan_video1.5")),
    "hunyuan video 1.5 sr": ({**_HUNYUAN_VIDEO15, "in_channels": 98, "meanflow": True},
                             ("hunyuan_video15", "HunyuanVideo 1.5 super-resolution (distilled)", None, None)),
})
# ComfyUI 0.33's models (LTX-2; Kandinsky 5 at the sizes of ComfyUI's class defaults, Lite, and of its image config)
_KANDINSKY5 = {"image_model": "kandinsky5", "model_dim": 1792, "ff_dim": 7168, "visual_embed_dim": 132,
               "num_text_blocks": 2, "num_visual_blocks": 32}
VARIANTS.update({
    "ltx-2 19B": ({"image_model": "ltxav", "num_layers": 48, "attention_head_dim": 128, "cross_attention_dim": 4096},
                  ("ltxav", "LTX-2 19B", None, None)),
    "ltx-2 off-size": ({"image_model": "ltxav", "num_layers": 2, "attention_head_dim": 32, "cross_attention_dim": 1024},
                       ("ltxav", "LTX-2 inner_dim 1024", None, None)),
    "kandinsky5 video lite": (_KANDINSKY5, ("kandinsky5", "Kandinsky 5 video Lite", None, None)),
    "kandinsky5 video off-size": ({**_KANDINSKY5, "model_dim": 1024, "num_visual_blocks": 2},
                                  ("kandinsky5", "Kandinsky 5 video (model_dim 1024)", None, None)),
    "kandinsky5 image": ({**_KANDINSKY5, "model_dim": 2560, "visual_embed_dim": 64},
                         ("kandinsky5", "Kandinsky 5 image", None, None)),
})
# MiniMax-H3 (ComfyUI 0.33): the released size is ComfyUI's class defaults; the curve form ships a timestep-curve table
VARIANTS.update({
    "minimax-h3": ({"image_model": "minimax_h3"}, ("minimax_h3", "MiniMax-H3", None, None)),
    "minimax-h3 curve form": ({"image_model": "minimax_h3", "adaln_curve_grid": 1001, "time_embed_dim": 32},
                              ("minimax_h3", "MiniMax-H3, adaLN curve form", None, None)),
    "minimax-h3 off-size": ({"image_model": "minimax_h3", "hidden_size": 1024, "num_layers": 2,
                             "num_attention_heads": 8},
                            ("minimax_h3", "MiniMax-H3 (hidden 1024)", None, None)),
})
REQUIRES = {"flux2 dev": ("comfy.model_base", "Flux2"), "z image": ("comfy.supported_models", "ZImage"),
            "hunyuan video 1.5": ("comfy.model_base", "HunyuanVideo15"),
            "hunyuan video 1.5 sr": ("comfy.model_base", "HunyuanVideo15_SR_Distilled"),
            "ltx-2 19B": ("comfy.model_base", "LTXAV"), "ltx-2 off-size": ("comfy.model_base", "LTXAV"),
            **{name: ("comfy.model_base", "Kandinsky5") for name in ("kandinsky5 video lite",
                                                                     "kandinsky5 video off-size", "kandinsky5 image")},
            **{name: ("comfy.model_base", "MiniMaxH3") for name in ("minimax-h3", "minimax-h3 curve form",
                                                                    "minimax-h3 off-size")}}
# HiDream-O1 (ComfyUI 0.33): the released checkpoint is the class's default config (Qwen3-VL-8B's decoder)
VARIANTS.update({
    "hidream-o1 8B": ({"image_model": "hidream_o1"}, ("hidream_o1", "HiDream-O1 8B", None, None)),
    "hidream-o1 off-size": ({"image_model": "hidream_o1", "text_config_overrides": {"hidden_size": 1024,
                                                                                   "num_hidden_layers": 2}},
                            ("hidream_o1", "HiDream-O1 hidden size 1024", None, None)),
})
REQUIRES.update({name: ("comfy.model_base", "HiDreamO1") for name in ("hidream-o1 8B", "hidream-o1 off-size")})
# Models of a family whose variants need no other recommendation, but whose weights live in other modules.
OTHER_LAYOUTS = {
    "wan2.1 camera": _wan(model_type="camera", in_dim=32),
    "wan2.2 camera": _wan(model_type="camera_2.2", in_dim=36),
    "wan2.1 fun control": _wan(model_type="i2v", in_dim=48),
    "wan humo": _wan(model_type="humo"),
    "wan2.2 animate": _wan(model_type="animate", in_dim=36),
    "hunyuan video meanflow": _hunyuan(meanflow=True),
    # ComfyUI 0.33's Wan variants the Wan family handles (skipped on older ComfyUI, see REQUIRES)
    "wan scail": _wan(model_type="scail", in_dim=20),
    "wan scail 2": _wan(model_type="scail2", in_dim=20),
    "wan flow rvs": _wan(model_type="flow_rvs"),
}
REQUIRES.update({"wan scail": ("comfy.model_base", "WAN21_SCAIL"), "wan scail 2": ("comfy.model_base", "WAN21_SCAIL2"),
                 "wan flow rvs": ("comfy.model_base", "WAN21_FlowRVS")})
UNSUPPORTED = {
    "chroma radiance": {**_CHROMA, "image_model": "chroma_radiance", "in_channels": 3, "out_channels": 3,
                        "patch_size": 16, "nerf_hidden_size": 64, "nerf_mlp_ratio": 4, "nerf_depth": 4,
                        "nerf_max_freqs": 8, "nerf_tile_size": 32, "nerf_final_head_type": "linear",
                        "nerf_embedder_dtype": None},
    # ComfyUI 0.33's Wan variants whose blocks or head the Wan family does not describe
    "wan animate 2": _wan(model_type="animate2"),
    "wan causal ar": _wan(causal_ar=True),
    "wan dancer": _wan(model_type="wandancer", in_dim=36),
}
REQUIRES.update({"wan animate 2": ("comfy.model_base", "WAN_Animate2"),
                 "wan causal ar": ("comfy.model_base", "WAN21_CausalAR"),
                 "wan dancer": ("comfy.model_base", "WAN22_WanDancer")})


def _teacache():
    from omnitest.pack import pack_module

    return pack_module("nodes.caches.teacache").TEACACHE


@pytest.fixture(scope="module")
def families():
    from omnitest.pack import pack_module

    return pack_module("nodes.families")


def real_size(name: str):
    from omnitest.comfy_path import skip_without_comfy_class
    from omnitest.meta_models import build_on_meta

    if name in REQUIRES:
        skip_without_comfy_class(*REQUIRES[name])

    config = VARIANTS[name][0] if name in VARIANTS else OTHER_LAYOUTS.get(name) or UNSUPPORTED[name]
    return build_on_meta(config)


# -- registration ------------------------------------------------------------------------------------------------------

def test_every_family_file_is_registered(families):
    folder = PACK_ROOT / "nodes" / "families"
    files = sorted(p.stem for p in folder.glob("*.py")
                   if p.stem not in families.NOT_FAMILIES and not p.stem.startswith("_"))
    registered = sorted(f.resolve_variant.__module__.rsplit(".", 1)[1] for f in families.FAMILIES)
    assert registered == files
    names = [f.name for f in families.FAMILIES]
    assert len(set(names)) == len(names)
    assert all(f.display_name and f.resident for f in families.FAMILIES)


def test_precedence_is_declared_not_file_order(families):
    ordered = families.FAMILIES
    names = [f.name for f in ordered]
    assert names.index("chroma") < names.index("flux")
    for family in ordered:
        for later in family.detect_before:
            assert names.index(family.name) < names.index(later), (family.name, later)
    # module-name order already respects every detect_before, so it is kept as it is
    modules = [f.resolve_variant.__module__.rsplit(".", 1)[1] for f in ordered]
    assert modules == sorted(modules)
    assert families.detection_order(ordered) == ordered
    # whatever order the files come in, the declared precedence holds, and the rest keeps its given order: reversed,
    # each family that must come first moves to just before the one it names, nothing else moves
    reversed_names = names[::-1]
    expected = list(reversed_names)
    for family in reversed(ordered):
        for later in family.detect_before:
            expected.remove(family.name)
            expected.insert(expected.index(later), family.name)
    assert [f.name for f in families.detection_order(reversed(ordered))] == expected
    assert expected.index("chroma") == expected.index("flux") - 1
    chroma = families.family_named("chroma")
    with pytest.raises(ValueError, match="'nope', which is not a registered family"):
        families.detection_order([dataclasses.replace(chroma, detect_before=("nope",))])
    flux = dataclasses.replace(families.family_named("flux"), detect_before=("chroma",))
    with pytest.raises(ValueError, match=r"^model families (chroma -> flux -> chroma|flux -> chroma -> flux) have a "
                                         r"detect_before cycle$"):
        families.detection_order([chroma, flux])
    with pytest.raises(ValueError, match="two model families are named 'chroma'"):
        families.detection_order([chroma, chroma])


def test_detection_order_is_the_earliest_given_family_that_may_go_next(families):
    base = families.family_named("wan")
    a, b, c = (dataclasses.replace(base, name=n, detect_before=()) for n in "abc")
    d = dataclasses.replace(base, name="d", detect_before=("b",))
    e = dataclasses.replace(base, name="e", detect_before=("a", "d"))
    assert [f.name for f in families.detection_order([a, b, c, d])] == ["a", "c", "d", "b"]
    assert [f.name for f in families.detection_order([a, b, c, d, e])] == ["c", "e", "a", "d", "b"]
    assert families.detection_order([]) == ()


def test_every_registered_family_has_a_tiny_model(families):
    assert set(CASE_FAMILY.values()) == {f.name for f in families.FAMILIES}


# -- detection on the tiny models ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_a_tiny_model_matches_exactly_its_family(families, name):
    from omnitest import tiny_models

    case = tiny_models.build_case(name)
    base_model = case.patcher.model
    assert [f.name for f in families.FAMILIES if f.matches(base_model, base_model.diffusion_model)] == [case.family]
    detected = families.detect(case.patcher)
    assert detected.family is families.family_named(case.family)
    for kind in ("teacache", "magcache"):
        key = detected.auto_choice(kind).key
        assert key is None or key in detected.family.auto_keys[kind]
    if detected.auto_choice("teacache").key is None:
        assert _teacache().auto_notes(detected), "a model without TeaCache coefficients must say what to do"


# -- variants on models of the released sizes ------------------------------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_the_decision_tree_names_the_variant_and_both_recommendations(families, name):
    family, variant, teacache_key, magcache_key = VARIANTS[name][1]
    detected = families.detect(real_size(name))
    assert (detected.family.name, detected.variant, detected.auto_choice("teacache").key,
            detected.auto_choice("magcache").key) == (family, variant, teacache_key, magcache_key)
    if teacache_key is None:
        assert _teacache().auto_notes(detected)
    assert detected.describe() == f"{family} ({variant})"


def test_declared_keys_are_the_keys_the_variants_recommend(families):
    for family in families.FAMILIES:
        outcomes = [expected for _, expected in VARIANTS.values() if expected[0] == family.name]
        assert outcomes, f"no real-size model of {family.name} in VARIANTS"
        declared = family.auto_keys
        assert {o[2] for o in outcomes} - {None} == declared.get("teacache", frozenset()), family.name
        assert {o[3] for o in outcomes} - {None} == declared.get("magcache", frozenset()), family.name
        assert set(declared) <= {"teacache", "magcache"}, family.name


def test_auto_keys_exist_in_the_tables_under_their_family(families):
    from omnitest.pack import pack_module

    coefficients = pack_module("nodes.caches.teacache_coefficients").PUBLISHED
    curves = pack_module("nodes.caches.magcache_curves").PUBLISHED
    registered = {f.name for f in families.FAMILIES}
    for family in families.FAMILIES:
        for key in family.auto_keys.get("teacache", ()):
            assert coefficients[key].family == family.name, (family.name, key)
        for key in family.auto_keys.get("magcache", ()):
            assert curves[key].family == family.name, (family.name, key)
    assert {c.family for c in coefficients.values()} <= registered
    assert {c.family for c in curves.values()} <= registered


def test_a_key_the_family_does_not_declare_is_refused(families):
    from omnitest import tiny_models

    flux = families.family_named("flux")
    stale = dataclasses.replace(flux, auto_keys={"magcache": frozenset({"flux"})})
    base_model = tiny_models.build_case("flux").patcher.model
    with pytest.raises(RuntimeError, match=r"recommends the teacache key 'flux', which the family's "
                                           r"auto_keys\['teacache'\]"):
        families._detected(stale, flux.resolve_variant(base_model, base_model.diffusion_model))


# -- signals, and what a family says when nothing is published -----------------------------------------------------

def test_every_family_offers_its_signals_by_name_each_built_on_its_tiny_model(families):
    from omnitest import tiny_models
    from omnitest.pack import pack_module

    stack_signal = pack_module("omni_hooks.blockstack").StackSignal
    case_of = {family: name for name, family in reversed(list(CASE_FAMILY.items()))}  # the first case of each
    for family in families.FAMILIES:
        assert families.DEFAULT_SIGNAL in family.signals, family.name
        dm = tiny_models.build_case(case_of[family.name]).patcher.model.diffusion_model
        for signal, build in family.signals.items():
            assert isinstance(build(dm), stack_signal), (family.name, signal)


def test_every_published_teacache_entry_names_a_signal_its_family_offers(families):
    from omnitest.pack import pack_module

    for entry in pack_module("nodes.caches.teacache_coefficients").PUBLISHED.values():
        assert entry.signal in families.family_named(entry.family).signals, entry.key


def test_a_family_without_the_default_signal_is_refused(families):
    flux = families.family_named("flux")
    with pytest.raises(ValueError, match="model family 'flux' offers no 'default' signal"):
        dataclasses.replace(flux, signals={"img": flux.signals[families.DEFAULT_SIGNAL]})


def test_where_nothing_is_published_each_cache_says_itself_to_calibrate(families):
    """The family says only that nothing is published for the model (``nothing_published``, with neutral notes);
    each cache's 'auto' writes its own line (its entries, its Calibrate node) before those notes."""
    from omnitest.pack import pack_module

    base = pack_module("nodes.families.base")
    variant = base.nothing_published("Kandinsky 5 image", "Kandinsky 5", "a neutral note")
    assert dict(variant.auto_choices) == {}
    detected = families._detected(families.family_named("kandinsky5"), variant)
    teacache, magcache = _teacache(), pack_module("nodes.caches.magcache").MAGCACHE
    assert teacache.auto_notes(detected) == (
        "no TeaCache coefficients are published for Kandinsky 5: run TeaCache Calibrate once on this model, then "
        "choose the calibration", "a neutral note")
    assert magcache.auto_notes(detected) == (
        "no MagCache curves are published for Kandinsky 5: run MagCache Calibrate once on this model, then choose "
        "the calibration", "a neutral note")
    with pytest.raises(ValueError, match=r"^Apply TeaCache: no published TeaCache coefficients fit kandinsky5 "
                                         r"\(Kandinsky 5 image\)\. No TeaCache coefficients are published for "
                                         r"Kandinsky 5: run TeaCache Calibrate once on this model, then choose the "
                                         r"calibration\. A neutral note\. Choose a model_variant"):
        teacache.resolve(detected, "auto")
    keyed = base.Variant("Kandinsky 5 image", otherwise=base.AutoChoice("k5"))
    with pytest.raises(RuntimeError, match="recommends the key 'k5' for every cache"):
        families._detected(families.family_named("kandinsky5"), keyed)


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_an_unsupported_model_names_every_registered_family(families, name):
    with pytest.raises(families.UnsupportedModelError, match="is not a diffusion transformer") as error:
        families.detect(real_size(name))
    assert all(f.display_name in str(error.value) for f in families.FAMILIES)


# -- weights: block stack + resident modules --------------------------------------------------------------------------

def _weights(module):
    return {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()]}


@pytest.mark.parametrize("source", [*(f"tiny {n}" for n in CASES), *(f"real {n}" for n in VARIANTS),
                                    *(f"real {n}" for n in OTHER_LAYOUTS)])
def test_the_stack_and_the_resident_modules_hold_every_weight_once(families, source):
    import torch

    from omnitest import tiny_models

    kind, name = source.split(" ", 1)
    patcher = tiny_models.build_case(name).patcher if kind == "tiny" else real_size(name)
    detected = families.detect(patcher)
    dm = patcher.model.diffusion_model
    in_stack = {}
    for block in detected.build_stack(dm).blocks:
        in_stack.update(_weights(block))
    resident = {}
    for attribute, value in detected.resident_modules(dm).items():
        resident.update({id(value): attribute} if isinstance(value, torch.Tensor) else _weights(value))
    everything = _weights(dm)
    assert not in_stack.keys() & resident.keys(), sorted(everything[i] for i in in_stack.keys() & resident.keys())
    missing = sorted(everything[i] for i in everything.keys() - in_stack.keys() - resident.keys())
    assert not missing, f"{detected.family.name}: weights neither in the block stack nor resident: {missing[:8]}"


# -- the supported-families text -------------------------------------------------------------------------------------

def test_tooltips_errors_and_the_readme_name_every_family(families):
    from omnitest.pack import pack_module

    text = families.supported_families()
    assert text == ", ".join(f.display_name for f in families.FAMILIES)
    for node in (pack_module("nodes.caches.teacache").ApplyTeaCache,
                 pack_module("nodes.caches.magcache").ApplyMagCache):
        model_input = next(i for i in node.define_schema().inputs if i.id == "model")
        assert text in model_input.tooltip
    readme = (PACK_ROOT / "README.md").read_text(encoding="utf-8")
    assert [f.display_name for f in families.FAMILIES if f.display_name not in readme] == []
    assert (PACK_ROOT / "docs" / "adding-a-model-family.md").is_file()
    assert "docs/adding-a-model-family.md" in readme
