"""Sequence-parallel configuration, plan validation, parameter lookup, split/gather shapes and hook registration in
one process (a simulated mesh stands in for the ranks)."""
from __future__ import annotations

import pytest
import torch

from omni_hooks import HookPhase, HookRegistry, ModelHook
from omni_hooks.context import RankView
from omni_hooks.sequence_parallel import (
    ModuleForwardMetadata,
    PaddingRecord,
    SequenceParallelConfig,
    SequenceParallelCrossAttention,
    SequenceParallelInput,
    SequenceParallelMesh,
    SequenceParallelObjectInput,
    SequenceParallelOutput,
    SequenceParallelPartialInput,
    SequenceParallelRefusedInput,
    SequenceParallelRun,
    SequenceParallelSelfAttention,
    apply_sequence_parallel,
    get_sp_plan_from_model,
    group_layout,
    remove_sequence_parallel,
    resolve_submodules,
    unwrap_module,
    validate_sp_plan,
)


def simulated(ulysses=2, ring=1, rank=0) -> tuple[SequenceParallelConfig, SequenceParallelMesh]:
    config = SequenceParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
    return config, SequenceParallelMesh.simulated_for(config, rank)


# -- config -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"ulysses_degree": 0}, "SP degrees must be >= 1"),
    ({"ring_degree": -1}, "SP degrees must be >= 1"),
    ({"ulysses_degree": 1.5}, "SP degrees must be >= 1"),
    ({}, "At least one degree must be > 1"),
    ({"cfg_degree": 0}, "SP degrees must be >= 1"),
    ({"cfg_degree": 2, "process_group": object()}, "leave process_group None"),
])
def test_config_rejects_degrees_that_split_nothing(kwargs, message):
    with pytest.raises(ValueError, match=f"(?i){message}"):
        SequenceParallelConfig(**kwargs)


def test_cfg_parallel_config_counts_both_halves_and_runs_unsplit_calls_over_a_ring_of_all_ranks():
    config = SequenceParallelConfig(ulysses_degree=2, cfg_degree=2)  # cfg alone (sp 1) is a valid config too
    assert (config.sequence_parallel_size, config.world_size) == (2, 4)
    whole = config.whole_config()
    assert (whole.ulysses_degree, whole.ring_degree, whole.cfg_degree) == (2, 2, 1)
    assert SequenceParallelConfig(cfg_degree=2).whole_config().ring_degree == 2


def test_config_size_and_mode():
    assert SequenceParallelConfig(ulysses_degree=4).sequence_parallel_size == 4
    assert SequenceParallelConfig(ulysses_degree=2, ring_degree=3).sequence_parallel_size == 6
    assert [SequenceParallelConfig(ulysses_degree=u, ring_degree=r).mode for u, r in ((2, 1), (1, 2), (2, 2))] == [
        "ulysses", "ring", "hybrid"]


def test_without_torch_distributed_the_mesh_says_how_to_start():
    with pytest.raises(ValueError, match="init_process_group"):
        SequenceParallelMesh.from_config(SequenceParallelConfig(ulysses_degree=2))


def test_usp_layout_puts_ulysses_on_neighbours_and_ring_across():
    ulysses, ring = group_layout(8, 2, 4)
    assert ulysses == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert ring == [(0, 2, 4, 6), (1, 3, 5, 7)]
    with pytest.raises(ValueError):
        group_layout(8, 3, 2)
    mesh = SequenceParallelMesh.simulated_for(SequenceParallelConfig(ulysses_degree=2, ring_degree=2), rank=3)
    assert (mesh.ulysses.ranks, mesh.ulysses.rank, mesh.ring.ranks, mesh.ring.rank) == ((2, 3), 1, (1, 3), 1)


def test_a_rank_view_of_several_ranks_needs_an_agreement():
    with pytest.raises(ValueError, match="agreement"):
        RankView(rank=0, world_size=2)
    with pytest.raises(ValueError, match="outside"):
        RankView(rank=2, world_size=2, agreement=object())
    config, mesh = simulated()
    view = SequenceParallelRun(config, mesh).rank_view()
    assert (view.rank, view.world_size) == (0, 2) and view.agreement is not None


# -- plan types and validation ----------------------------------------------------------------------------------------

def test_reprs_list_every_field():
    assert "split_dim=1" in repr(SequenceParallelInput(split_dim=1, expected_dims=3))
    assert "expected_dims=3" in repr(SequenceParallelInput(split_dim=1, expected_dims=3))
    assert "split_output=True" in repr(SequenceParallelInput(split_dim=0, split_output=True))
    assert "txt_ids" in repr(SequenceParallelPartialInput(split_dim=0, text_len_source="txt_ids"))
    assert "gather_dim=1" in repr(SequenceParallelOutput(gather_dim=1))
    assert "joint_position='front'" in repr(SequenceParallelSelfAttention(joint_tokens=4))


@pytest.mark.parametrize("plan, message", [
    ([], "must be a dict"),
    ({1: SequenceParallelOutput(1)}, "keys must be strings"),
    ({"": {0: SequenceParallelInput(split_dim=1)}}, "split_output=True"),
    ({"": {1.5: SequenceParallelInput(split_dim=1)}}, "input keys must be"),
    ({"": {"x": "split"}}, "expected a SequenceParallelInput"),
    ({"": {"x": SequenceParallelInput(split_dim=1, shard_group="img")}}, "requires auto_pad=True"),
    ({"a": {"x": SequenceParallelInput(1, auto_pad=True, shard_group="img")},
      "b": {"y": SequenceParallelInput(1, auto_pad=True, shard_group="img")}}, "multiple split boundaries"),
    ({"": 3}, "_sp_plan values must be dict"),
    ({"": {"x": SequenceParallelInput(1, outside_caches=True), "y": SequenceParallelInput(1)}},
     "must agree on outside_caches"),
    ({"": [SequenceParallelOutput(1), SequenceParallelInput(1)]}, "_sp_plan values must be dict"),
    ({"": {"pair": [None, None]}}, "expected a SequenceParallelInput"),
    ({"": {"pair": [SequenceParallelInput(1, outside_caches=True), None], "y": SequenceParallelInput(1)}},
     "must agree on outside_caches"),
    ({"": [SequenceParallelOutput(1, outside_caches=True), SequenceParallelOutput(1)]},
     "every output spec of one module must agree on outside_caches"),
    ({"": {0: SequenceParallelObjectInput(tokens=len, narrow=lambda v, s, n: v)}}, "split_output=True"),
])
def test_plan_validation_errors(plan, message):
    with pytest.raises(ValueError, match=message):
        validate_sp_plan(plan)


def test_valid_plans_pass_and_the_model_plan_is_read_validated():
    plan = {"": {"x": SequenceParallelInput(1, auto_pad=True, shard_group="img"),
                 "pair": [SequenceParallelInput(0), SequenceParallelInput(1)],
                 2: SequenceParallelInput(0, split_output=True)},
            "proj": [SequenceParallelOutput(1), None],
            "attn": SequenceParallelSelfAttention(),
            "cross": SequenceParallelCrossAttention(),
            "tail": SequenceParallelOutput(1, outside_caches=True),
            "mid": {"table": SequenceParallelObjectInput(tokens=len, narrow=lambda v, s, n: v, shard_group="t")}}
    assert validate_sp_plan(plan) is plan
    model = torch.nn.Linear(2, 2)
    assert get_sp_plan_from_model(model) is None
    model._sp_plan = {"": 5}
    with pytest.raises(ValueError):
        get_sp_plan_from_model(model)
    model._sp_plan = plan
    assert get_sp_plan_from_model(model) is plan
    with pytest.raises(ValueError, match="joint_position"):
        SequenceParallelSelfAttention(joint_position="middle")


# -- module and parameter lookup --------------------------------------------------------------------------------------

class Fwd(torch.nn.Module):
    def forward(self, a, b=None, c=None, *, d=None):
        return a


def test_parameters_are_found_by_keyword_then_position_and_unknown_names_fail():
    meta = ModuleForwardMetadata(Fwd())
    assert meta.cached_parameter_indices == {"a": 0, "b": 1, "c": 2, "d": None}
    assert meta.lookup("b", (1,), {"b": 7}) == 7
    assert meta.lookup("b", (1, 2), {}) == 2
    assert meta.lookup("c", (1, 2), {}) is None  # not passed
    assert meta.lookup("d", (), {"d": 4}) == 4
    with pytest.raises(ValueError, match="not found in the forward signature"):
        meta.lookup("z", (), {})


def test_the_signature_is_read_through_a_hook_registry_and_compile_wrappers():
    module = Fwd()
    HookRegistry.get_or_create(module)  # forward replaced by the registry's wrapper
    assert "a" in ModuleForwardMetadata(module).cached_parameter_indices

    class Compiled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    class OneChild(torch.nn.Module):  # a real block with one child is not a wrapper
        def __init__(self):
            super().__init__()
            self.inner = Fwd()

    assert unwrap_module(Compiled(module)) is module
    single = OneChild()
    assert unwrap_module(single) is single


class Tree(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.ModuleList([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)])
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(1, 1)) for _ in range(3))
        self.heads = torch.nn.ModuleDict({"img": torch.nn.Linear(1, 1)})


def test_submodule_lookup():
    tree = Tree()
    assert resolve_submodules(tree, "") == [tree]
    assert resolve_submodules(tree, "encoder.0") == [tree.encoder[0]]
    assert resolve_submodules(tree, "blocks.2") == [tree.blocks[2]]
    assert resolve_submodules(tree, "blocks.*") == list(tree.blocks)
    assert resolve_submodules(tree, "blocks.*.0") == [b[0] for b in tree.blocks]
    assert resolve_submodules(tree, "heads.img") == [tree.heads["img"]]
    with pytest.raises(ValueError, match="not a submodule of Tree"):
        resolve_submodules(tree, "decoder")
    with pytest.raises(ValueError, match="only be used once"):
        resolve_submodules(tree, "blocks.*.*")
    with pytest.raises(ValueError, match="only be used with ModuleList"):
        resolve_submodules(tree, "heads.*")


# -- split and gather shapes on a simulated mesh ----------------------------------------------------------------------

class Seq(torch.nn.Module):
    def forward(self, x, txt=None, ids=None):
        return x


def split_once(spec_for_x, x, world=2, rank=0, extra=None, **call):
    config, mesh = simulated(ulysses=world, rank=rank)
    module = Seq()
    plan = {"": {"x": spec_for_x, **(extra or {})}}
    runtime = apply_sequence_parallel(module, config, plan, mesh=mesh)
    return module(x, **call), runtime


def test_even_split_takes_this_ranks_chunk_in_rank_order():
    x = torch.arange(16.).reshape(1, 16, 1)
    for rank in range(4):
        out, runtime = split_once(SequenceParallelInput(split_dim=1, expected_dims=3), x, world=4, rank=rank)
        assert out.flatten().tolist() == list(range(rank * 4, rank * 4 + 4))
        assert runtime.padding == {}


def test_partial_input_keeps_text_whole_and_splits_the_image():
    x = torch.arange(24.)  # 8 text + 16 image
    spec = SequenceParallelPartialInput(split_dim=0, text_len_source="txt", text_len_dim=1)
    out, _ = split_once(spec, x, world=4, rank=1, txt=torch.zeros(1, 8, 3))
    assert out.tolist() == list(range(8)) + [12.0, 13.0, 14.0, 15.0]
    out, _ = split_once(SequenceParallelPartialInput(split_dim=0, text_len_source=8), x, world=4, rank=3)
    assert out.shape == (12,)
    with pytest.raises(ValueError, match="Failed to resolve text_len_source 'txt'"):
        split_once(spec, x, world=4)  # txt not passed


def test_partial_input_with_text_at_the_rear_keeps_the_image_text_layout():
    x = torch.arange(21.)  # 13 image (padded to 14) + 8 text
    spec = SequenceParallelPartialInput(split_dim=0, text_len_source="txt", text_len_dim=1, text_position="rear",
                                        auto_pad=True)
    first, runtime = split_once(spec, x, world=2, rank=0, txt=torch.zeros(1, 8, 3))
    last, _ = split_once(spec, x, world=2, rank=1, txt=torch.zeros(1, 8, 3))
    assert first.tolist() == list(range(7)) + list(range(13, 21))
    assert last.tolist() == list(range(7, 13)) + [0.0] + list(range(13, 21))
    assert runtime.padding[None] == PaddingRecord(13, 14)
    with pytest.raises(ValueError, match="text_position"):
        SequenceParallelPartialInput(split_dim=0, text_len_source=1, text_position="middle")


def test_broadcast_length_one_passes_a_per_sample_value_and_splits_a_per_token_one():
    spec = SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True, broadcast_length_one=True)
    one = torch.ones(2, 1, 4)
    out, runtime = split_once(spec, one, rank=1)
    assert out is one and runtime.padding == {}
    out, runtime = split_once(spec, torch.arange(5.).reshape(1, 5, 1), rank=1)
    assert out.flatten().tolist() == [3.0, 4.0, 0.0] and runtime.padding[None] == PaddingRecord(5, 6)


def test_a_none_spec_leaves_its_element_of_an_input_alone():
    table, flag = torch.arange(4.).reshape(1, 4, 1), True
    spec = [SequenceParallelInput(split_dim=1, expected_dims=3, auto_pad=True), None]
    assert validate_sp_plan({"": {"x": spec}})
    (shard, passed), runtime = split_once(spec, (table, flag), rank=1)
    assert shard.flatten().tolist() == [2.0, 3.0] and passed is flag
    (first, untouched), _ = split_once(spec, [table, table], rank=0)
    assert first.flatten().tolist() == [0.0, 1.0] and untouched is table


def test_a_refused_input_fails_the_call_only_when_passed():
    refused = SequenceParallelRefusedInput("Sequence Parallel: txt is not supported here; fix: leave it out")
    spec = SequenceParallelInput(split_dim=1, expected_dims=3, outside_caches=True)
    out, runtime = split_once(spec, torch.arange(4.).reshape(1, 4, 1), extra={"txt": refused})
    assert out.flatten().tolist() == [0.0, 1.0]  # not passed: the other inputs split as planned
    with pytest.raises(ValueError, match=r"^Sequence Parallel: txt is not supported here; fix: leave it out$"):
        split_once(spec, torch.zeros(1, 4, 1), extra={"txt": refused}, txt={"any": "type"})
    assert runtime.stats.bytes_sent == 0
    with pytest.raises(ValueError, match="an int key names an output element"):  # a refused input is a parameter
        validate_sp_plan({"": {0: refused}})


def test_strict_mode_names_the_fix():
    with pytest.raises(ValueError, match=r"strict mode.*sequence_parallel_size|sequence_parallel_size.*strict mode"):
        split_once(SequenceParallelInput(split_dim=1), torch.zeros(1, 5, 1))
    with pytest.raises(ValueError, match="auto_pad=True"):
        split_once(SequenceParallelInput(split_dim=1), torch.zeros(1, 5, 1))


def test_auto_pad_pads_at_the_end_and_records_the_length():
    x = torch.arange(1., 6.).reshape(1, 5, 1)
    first, runtime = split_once(SequenceParallelInput(split_dim=1, auto_pad=True), x, rank=0)
    last, _ = split_once(SequenceParallelInput(split_dim=1, auto_pad=True), x, rank=1)
    assert first.shape == (1, 3, 1) and last.flatten().tolist() == [4.0, 5.0, 0.0]
    record = runtime.padding[None]
    assert (record.original_len, record.pad) == (5, 1)
    out, runtime = split_once(SequenceParallelInput(split_dim=1, auto_pad=True), torch.zeros(1, 17, 2), world=4)
    assert out.shape == (1, 5, 2) and runtime.padding[None].padded_len == 20
    _, runtime = split_once(SequenceParallelInput(split_dim=1, auto_pad=True), torch.zeros(1, 16, 2), world=4)
    assert runtime.padding[None].pad == 0


def test_a_shard_is_a_view_unless_clone_shard_asks_for_its_own_storage():
    x = torch.zeros(1, 8, 2)
    view, _ = split_once(SequenceParallelInput(split_dim=1), x, rank=1)
    own, _ = split_once(SequenceParallelInput(split_dim=1, clone_shard=True), x, rank=1)
    assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert own.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() and own.is_contiguous()


def test_tensors_of_one_shard_group_must_agree():
    spec = SequenceParallelInput(split_dim=1, auto_pad=True)
    with pytest.raises(ValueError, match="same sequence"):
        split_once(spec, torch.zeros(1, 5, 1), extra={"txt": SequenceParallelInput(split_dim=1, auto_pad=True)},
                   txt=torch.zeros(1, 7, 1))


class Frames:
    """A host's own per-token table: one row per frame of ``per_frame`` tokens."""

    def __init__(self, rows: list, per_frame: int, start: int = 0, length: int | None = None):
        self.rows, self.per_frame, self.start = rows, per_frame, start
        self.length = len(rows) * per_frame if length is None else length

    def tokens(self) -> list:
        every = [row for row in self.rows for _ in range(self.per_frame)] + [0] * self.length
        return every[self.start:self.start + self.length]


FRAMES = SequenceParallelObjectInput(
    tokens=lambda t: None if t.length == 1 else t.length,
    narrow=lambda t, start, length: Frames(t.rows, t.per_frame, start, length), shard_group="frames")


def test_an_object_input_is_narrowed_by_the_familys_function_to_this_ranks_padded_range():
    table = Frames([10, 20, 30], per_frame=3)  # 9 tokens: 3 ranks of 3, or 2 ranks of 5 (one padding token)
    for rank, expected in enumerate([[10, 10, 10, 20, 20], [20, 30, 30, 30, 0]]):
        out, runtime = split_once(FRAMES, table, rank=rank)
        assert out.tokens() == expected and runtime.padding["frames"] == PaddingRecord(9, 10)
    one = Frames([5], per_frame=1)
    out, runtime = split_once(FRAMES, one)
    assert out is one and runtime.padding == {}  # one value for every token: passed as it is
    with pytest.raises(ValueError, match="same sequence"):  # a shard group holds one sequence
        split_once(FRAMES, table, extra={"txt": SequenceParallelInput(split_dim=1, auto_pad=True,
                                                                      shard_group="frames")},
                   txt=torch.zeros(1, 7, 1))


def test_a_gather_declared_outside_caches_runs_after_the_cache_on_its_module_has_seen_the_shard():
    seen = []

    class Cache(ModelHook):
        phase = HookPhase.CACHING

        def post_forward(self, module, output):
            seen.append(output.shape[1])
            return output + 1

    config, mesh = simulated()
    for outside, expected in ((True, 4), (False, 8)):
        seen.clear()
        proj = torch.nn.Linear(2, 2)
        apply_sequence_parallel(proj, config, {"": SequenceParallelOutput(gather_dim=1, outside_caches=outside)},
                                mesh=mesh)
        HookRegistry.get_or_create(proj).register_hook("a_cache", Cache())
        assert proj(torch.zeros(1, 4, 2)).shape == (1, 8, 2) and seen == [expected]
        phase = HookRegistry.get_or_create(proj).get_hook("sp_output---").phase
        assert phase is (HookPhase.OBSERVATION if outside else HookPhase.SHARDING)


def test_wrong_dims_are_left_alone_with_a_warning(caplog):
    x = torch.zeros(4, 6)
    out, _ = split_once(SequenceParallelInput(split_dim=1, expected_dims=3), x)
    assert out is x and "expects 3" in caplog.text


def test_split_output_and_gather_shapes():
    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x + 1

    config, mesh = simulated(ulysses=4)
    pair = Pair()
    apply_sequence_parallel(pair, config, {"": {1: SequenceParallelInput(split_dim=0, split_output=True)}}, mesh=mesh)
    a, b = pair(torch.zeros(16, 2))
    assert a.shape == (16, 2) and b.shape == (4, 2)

    proj = torch.nn.Linear(2, 2)
    runtime = apply_sequence_parallel(proj, config, {"": SequenceParallelOutput(gather_dim=1, expected_dims=3)},
                                      mesh=mesh)
    assert proj(torch.zeros(1, 4, 2)).shape == (1, 16, 2)
    assert runtime.stats.by_kind["output_all_gather"].bytes_sent == 4 * 2 * 4 * 3  # its shard to 3 peers
    runtime.padding[None] = PaddingRecord(original_len=13, padded_len=16)
    assert proj(torch.zeros(1, 4, 2)).shape == (1, 13, 2)  # padding dropped


# -- registration -----------------------------------------------------------------------------------------------------

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(2, 2)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
        self.proj_out = torch.nn.Linear(2, 2)

    def forward(self, x):
        x = self.proj_in(x)
        for b in self.blocks:
            x = b(x)
        return self.proj_out(x)


PLAN = {"proj_in": {"input": SequenceParallelInput(split_dim=1, expected_dims=3)},
        "blocks.*": SequenceParallelSelfAttention(),
        "proj_out": SequenceParallelOutput(gather_dim=1, expected_dims=3)}


def test_apply_registers_named_sharding_hooks_and_remove_restores_every_module():
    model = Model()
    config, mesh = simulated()
    apply_sequence_parallel(model, config, PLAN, mesh=mesh)
    assert HookRegistry.get_or_create(model.proj_in).ordered_names() == ["sp_input---proj_in"]
    assert HookRegistry.get_or_create(model.proj_out).ordered_names() == ["sp_output---proj_out"]
    for block in model.blocks:
        hook = HookRegistry.get_or_create(block).get_hook("sp_attention---blocks.*")
        assert hook is not None and hook.phase is HookPhase.SHARDING
    assert model(torch.zeros(1, 8, 2)).shape == (1, 8, 2)
    remove_sequence_parallel(model, PLAN)
    for m in [model.proj_in, model.proj_out, *model.blocks]:
        assert "forward" not in m.__dict__ and "_hook_registry" not in m.__dict__


def test_an_unknown_parameter_fails_at_apply_and_leaves_the_model_untouched():
    model = Model()
    config, mesh = simulated()
    plan = dict(PLAN, proj_out={"hidden": SequenceParallelInput(split_dim=1)})
    with pytest.raises(ValueError, match="'hidden' not found"):
        apply_sequence_parallel(model, config, plan, mesh=mesh)
    for m in model.modules():
        assert "_hook_registry" not in m.__dict__ and "forward" not in m.__dict__


def test_sharding_hooks_run_inside_caches_and_outside_placement_whatever_their_names():
    order = []

    def tagged(phase, tag):
        class Tag(ModelHook):
            def pre_forward(self, module, *args, **kwargs):
                order.append((tag, args[0].shape[1]))
                return args, kwargs
        Tag.phase = phase
        return Tag()

    model = Model()
    config, mesh = simulated()
    apply_sequence_parallel(model, config, {"proj_in": {"input": SequenceParallelInput(split_dim=1)}}, mesh=mesh)
    hooked = model.proj_in
    original = hooked.__dict__["forward"]
    HookRegistry.get_or_create(hooked).register_hook("a_offload", tagged(HookPhase.PLACEMENT, "placement"))
    HookRegistry.get_or_create(hooked).register_hook("z_cache", tagged(HookPhase.CACHING, "cache"))
    model(torch.zeros(1, 8, 2))
    # the cache sees the call as made, the placement hook the shard the forward really gets
    assert order == [("cache", 8), ("placement", 4)]
    assert HookRegistry.get_or_create(hooked).ordered_names() == ["z_cache", "sp_input---proj_in", "a_offload"]
    assert hooked.__dict__["forward"] is original


def test_a_split_declared_outside_caches_runs_before_the_cache_on_its_module():
    order = []

    class Cache(ModelHook):
        phase = HookPhase.CACHING

        def pre_forward(self, module, *args, **kwargs):
            order.append(args[0].shape[1])
            return args, kwargs

    model = Model()
    config, mesh = simulated()
    plan = {"proj_in": {"input": SequenceParallelInput(split_dim=1, outside_caches=True)}}
    apply_sequence_parallel(model, config, plan, mesh=mesh)
    HookRegistry.get_or_create(model.proj_in).register_hook("a_cache", Cache())
    model(torch.zeros(1, 8, 2))
    assert order == [4]  # the cache saw this rank's shard
    assert HookRegistry.get_or_create(model.proj_in).ordered_names() == ["sp_input---proj_in", "a_cache"]


def test_outside_a_site_the_attention_entry_calls_the_host_function_unchanged():
    config, mesh = simulated()
    runtime = SequenceParallelRun(config, mesh)
    calls = []

    def host(q, k, v, heads, **kwargs):
        calls.append((q.shape, heads, kwargs))
        return q

    q = torch.zeros(1, 3, 8)
    assert runtime.attention(host, q, q, q, 4, skip_reshape=False, transformer_options={"a": 1}) is q
    assert calls == [((1, 3, 8), 4, {"mask": None, "skip_reshape": False, "transformer_options": {"a": 1}})]
    assert runtime.stats.bytes_sent == 0


def test_a_site_is_active_only_during_its_modules_forward_and_reset_forgets_a_stale_one():
    model = Model()
    config, mesh = simulated()
    runtime = apply_sequence_parallel(model, config, {"blocks.1": SequenceParallelSelfAttention()}, mesh=mesh)
    seen = []
    for block in model.blocks:  # what each block's own forward sees
        original = block.__dict__.get("_omni_original_forward", block.forward)
        run = (lambda original: lambda x: seen.append(runtime.active_site) or original(x))(original)
        if "_omni_original_forward" in block.__dict__:
            block.__dict__["_omni_original_forward"] = run
        else:
            block.forward = run
    model(torch.zeros(1, 4, 2))
    assert seen[0] is None and seen[2] is None and runtime.active_site is None
    assert seen[1] is not None and seen[1].module is model.blocks[1] and seen[1].joint_tokens == 0
    runtime.enter_site(seen[1])  # as if a forward had raised inside the site
    runtime.reset()
    assert runtime.active_site is None and runtime.padding == {}
