"""The Sequence Parallel node: the MODEL's token sequence split across several processes (GPUs, or CPU ranks over
gloo), every other node of the workflow unchanged.

Rank 0 is the ComfyUI process. Per run, the session (``SequenceParallelSession``) gets the process's group
(``group``: local workers started once and kept, remote ranks joining with ``worker.py``), sends the weights as
ComfyUI computes with them when the model or its patches changed (after ComfyUI's load, before CPU Offload places
them), applies the family's sequence plan to the diffusion model, and per model call sends the call, with the run's
other features, to every worker (a header they check before any collective; ``protocol``), installs the attention
exchange in ComfyUI's attention-override seam and gives caches the group's ``RankView``. The workers mirror the run
(``rank``, with the same ``shard`` session): the same caches and offload, so every rank decides alike. Every rank runs
the model's own forward on its shard (with ``cfg_parallel``, on its half's part of the batch); the output is gathered,
so rank 0 returns the whole output to the sampler. A call that breaks mid-way closes the group (``explain_failure``);
the next run starts a fresh one.
"""
from __future__ import annotations

import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from comfy_api.latest import io

from ...omni_hooks.sequence_parallel import SequenceParallelConfig
from ...omni_hooks.sequence_parallel.batch import call_batch
from . import group as sp_group
from . import rendezvous
from ..families import FAMILIES, DetectedModel, ModelFamily, detect
from ..features import (CATEGORY, FEATURES_KEY, RUN_KEY, AppliedFeature, Category, ConfigInputs, FeatureSpec,
                        attach_feature, display_name)
from ..stats_store import FeatureReport, StepTotals
from .shard import ATTENTION_OVERRIDE, KIND, ShardSession, attention_taken_error
from .plain import PlainDataError
from .protocol import (OPTIONS_SLOT, CommandRefused, check_sendable, is_collective_failure,
                       tensor_signature)

log = logging.getLogger("OmniHooks")

NODE_ID = "OmniHooks.SequenceParallel"
NODE_TITLE = "Sequence Parallel"
AUTO = "auto"
# options rank 0 keeps to itself: its own wrappers and callbacks (they run around the call on rank 0) and our run
LOCAL_ONLY_OPTIONS = ("wrappers", "callbacks", RUN_KEY, FEATURES_KEY)
#: the node's inputs that set a field of the config's group settings (``group.GroupSettings``) under another name
GROUP_INPUTS = ConfigInputs(sp_group.GroupSettings, {"master_address": "host", "master_port": "port"})


def supported_families() -> str:
    return ", ".join(f.display_name for f in FAMILIES if f.sequence_plan is not None)


def _refusal(family) -> str:
    """``" (why)"`` when the family says why it has no sequence plan, else ""."""
    return f" ({family.sequence_refusal})" if family.sequence_refusal else ""


LOOPBACK_NAMES = ("localhost",)


def local_devices() -> list[str]:
    """The devices a rank can use on this machine: cpu, then each visible CUDA device."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + [f"cuda:{i}" for i in range(count)]


def is_loopback(address: str) -> bool:
    """Whether ``address`` is this machine only (127.0.0.0/8, ::1, localhost): no other machine reaches it."""
    import ipaddress

    text = address.strip().strip("[]")
    if text.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def resolve_devices(value: str, world_size: int,
                    master_address: str = GROUP_INPUTS.default("master_address")) -> tuple[str, ...]:
    """The local ranks' devices: "auto" = the visible GPUs (at most ``world_size``), else ``world_size`` CPU ranks;
    or a comma-separated list ("cuda:0,cuda:1"), each entry a device of this machine. Ranks beyond the list are
    remote, which only a ``master_address`` other than loopback allows. ValueError naming the input and the fix."""
    if value.strip() == AUTO:
        if torch.cuda.is_available():
            devices = tuple(f"cuda:{i}" for i in range(min(world_size, torch.cuda.device_count())))
        else:
            devices = ("cpu",) * world_size
    else:
        devices = tuple(d.strip() for d in value.split(",") if d.strip())
        there = local_devices()
        if not devices:
            raise ValueError(f"{NODE_TITLE}: devices {value!r} lists no device; give one per local rank, rank 0 first "
                             f"(this machine has: {', '.join(there)}), or 'auto'")
        for entry in devices:
            if entry not in there:
                raise ValueError(f"{NODE_TITLE}: devices entry {entry!r} is not a device of this machine, which has: "
                                 f"{', '.join(there)}. Set devices to a comma-separated list of those, rank 0 first "
                                 "(e.g. \"cuda:0,cuda:1\" or \"cpu,cpu\"), or 'auto'")
        if len(devices) > world_size:
            raise ValueError(f"{NODE_TITLE}: devices {value!r} lists {len(devices)} devices for world_size "
                             f"{world_size}: give 1 to {world_size} devices (rank 0 first), or raise world_size")
        cuda = [d for d in devices if d != "cpu"]
        if len(set(cuda)) < len(cuda):
            raise ValueError(f"{NODE_TITLE}: devices {value!r} names a GPU twice; give each rank its own GPU, or use "
                             "cpu ranks")
    remote = world_size - len(devices)
    if remote and is_loopback(master_address):
        raise ValueError(f"{NODE_TITLE}: world_size {world_size} with devices {value!r} ({len(devices)} here) leaves "
                         f"{remote} rank(s) to other machines, but master_address {master_address!r} is loopback: no "
                         "other machine can join. Raise the number of devices to world_size (e.g. "
                         f"\"{','.join(['cpu'] * world_size)}\"), lower world_size, or set master_address to this "
                         "machine's network address and start the remote ranks (README)")
    return devices


def resolve_degrees(group: sp_group.GroupSettings, ulysses_degree: int | None, ring_degree: int | None,
                    cfg_parallel: bool, heads: int | None) -> SequenceParallelConfig:
    """The node's one frozen config: the ranks' ``group`` (changing it starts another group) and the degrees each
    call is split by (changing them only builds another mesh in the same group). A degree None is 'auto': Ulysses
    when the head count divides the world size's, else ring attention. With ``cfg_parallel`` the degrees share half
    the world (two cfg halves). ``heads`` None: not known (explicit degrees are not checked against it). ValueError
    naming the input and the fix."""
    world = group.world_size
    cfg = 2 if cfg_parallel else 1
    if world % cfg:
        raise ValueError(f"{NODE_TITLE}: cfg_parallel splits the ranks into two halves, so it needs an even "
                         f"world_size, got {world}; set world_size to {world + 1} or {world - 1}, or turn cfg_parallel "
                         "off")
    world //= cfg
    what = "world_size / 2 (cfg_parallel)" if cfg > 1 else "world_size"
    u, r = ulysses_degree, ring_degree
    for name, degree in (("ulysses_degree", u), ("ring_degree", r)):
        if degree is not None and world % degree:
            raise ValueError(f"{NODE_TITLE}: {name} {degree} does not divide {what} {world}; set it to a divisor of "
                             f"{world} or 'auto'")
    if u is None and r is None:
        if heads is None:
            raise ValueError(f"{NODE_TITLE}: cannot read the model's head count; set ulysses_degree and ring_degree "
                             "instead of 'auto'")
        u, r = (world, 1) if heads % world == 0 else (1, world)
    elif u is None:
        u = world // r
    elif r is None:
        r = world // u
    if u * r != world:
        raise ValueError(f"{NODE_TITLE}: ulysses_degree {u} x ring_degree {r} must equal {what} {world}; set one of "
                         "them to 'auto'")
    config = SequenceParallelConfig(ulysses_degree=u, ring_degree=r, cfg_degree=cfg, group=group)
    if heads is not None:
        check_heads(config, heads)
    return config


def check_heads(config: SequenceParallelConfig, heads: int) -> None:
    """ValueError naming the input when the model's ``heads`` cannot be split ``config.ulysses_degree`` ways (degrees
    chosen when the node could not read the head count)."""
    if heads % config.ulysses_degree:
        raise ValueError(f"{NODE_TITLE}: the model has {heads} attention heads, which ulysses_degree "
                         f"{config.ulysses_degree} does not divide; set ulysses_degree to a divisor or 'auto'")


def config_for(model, group: sp_group.GroupSettings, ulysses_degree: int | None, ring_degree: int | None,
               cfg_parallel: bool = False) -> SequenceParallelConfig:
    """``resolve_degrees`` for ``model`` (its head count resolves 'auto'); ValueError naming the node, and the input
    or the model's family when it has no sequence plan."""
    family = detect(model).family
    if family.sequence_plan is None:
        raise ValueError(f"{NODE_TITLE}: {family.display_name} is not supported yet{_refusal(family)}; "
                         f"supported: {supported_families()}")
    try:
        heads = _heads(model.model.diffusion_model, family)
    except ValueError:
        heads = None  # 'auto' degrees say so; explicit ones are checked against the model at the run
    return resolve_degrees(group, ulysses_degree, ring_degree, cfg_parallel, heads)


def _heads(dm: torch.nn.Module, family: ModelFamily) -> int:
    """The attention head count a Ulysses degree must divide: ``num_heads`` of the model or of its ``params`` (Wan,
    Flux) or its ``n_heads`` (Z-Image's NextDiT), else the greatest common divisor of its attention sites' counts
    (``num_heads`` or ``heads`` of each, e.g. Qwen-Image's ``attn``; LTX-2's video and audio heads)."""
    heads = (getattr(dm, "num_heads", None) or getattr(getattr(dm, "params", None), "num_heads", None)
             or getattr(dm, "n_heads", None))
    sites = family.attention_sites(dm) if heads is None and family.attention_sites is not None else []
    if sites:
        counts = [getattr(site, "num_heads", None) or getattr(site, "heads", None) for site in sites]
        heads = math.gcd(*counts) if all(isinstance(c, int) for c in counts) else None
    if not isinstance(heads, int):
        raise ValueError(f"{NODE_TITLE}: cannot read the head count of {type(dm).__name__}; set ulysses_degree and "
                         "ring_degree instead of 'auto'")
    return heads


def _comfyui_root() -> Path:
    import comfy.model_management

    return Path(comfy.model_management.__file__).resolve().parents[1]


class SequenceParallelSession(ShardSession):
    """Sequence Parallel's part of one sampling run on rank 0. After ComfyUI's load (before offload places the
    weights: ``LOAD_ORDER``) it gets the group and sends the weights if they changed; per call it sends the call, with
    the run's other features (the workers run the same caches and offload) and the run's id, then installs the
    attention exchange."""

    def __init__(self, patcher, feature: AppliedFeature, detected: DetectedModel):
        super().__init__(patcher, feature, detected)
        self.config: SequenceParallelConfig = feature.config  # the node's own object: the run reads it unchanged
        self.group: sp_group.SequenceParallelGroup | None = None
        self.sharded = False  # the model was split (the run's card then says how)
        self.run_id = uuid.uuid4().hex
        self.calls = 0
        self.steps = StepTotals()  # per sampler step on this rank: calls, seconds, bytes sent, skipped calls
        self.calls_unsplit: list[str] = []  # why a call with cfg_degree > 1 ran its batch whole (one per call)
        self._call_start: tuple[float, int] | None = None
        self.in_call = False  # a call was sent to the workers and has not returned on this rank
        self.interface: str | None = None  # the process group's network interface ("lo (127.0.0.1)")

    def after_load(self, patcher) -> None:
        self._refuse_another_attention_override(patcher.model_options.get("transformer_options", {}))
        self._join(patcher)

    def _refuse_another_attention_override(self, transformer_options: dict) -> None:
        """Before anything reaches another rank (the run's start, each call): no other node's attention override."""
        if ATTENTION_OVERRIDE in transformer_options:
            raise attention_taken_error(self.feature.describe(), transformer_options[ATTENTION_OVERRIDE])

    def _join(self, patcher) -> None:
        """The group of this run's config, holding the model's current weights."""
        if self.detected.family.sequence_plan is None:
            raise ValueError(f"{self.feature.describe()}: {self.detected.family.display_name} has no sequence plan yet"
                             f"{_refusal(self.detected.family)}; supported: {supported_families()}")
        if self.group is None:
            self.group = sp_group.current_group(self.config.group, _comfyui_root())
            self.interface = str(self.group.interface)  # the card names where the ranks exchange
        self.group.sync_weights(patcher, self.detected.family.name)

    def install(self, diffusion_model: torch.nn.Module) -> None:
        self._join(self.patcher)
        config = self.config
        check_heads(config, _heads(diffusion_model, self.detected.family))
        self.install_shard(diffusion_model, self.detected.family, config, self.group.mesh(config))
        self.sharded = True

    def before_call(self, args: tuple, kwargs: dict, transformer_options: dict) -> None:
        self._refuse_another_attention_override(transformer_options)
        sent = {k: v for k, v in transformer_options.items() if k not in LOCAL_ONLY_OPTIONS}
        self.group.sync_weights(self.patcher, self.detected.family.name)
        slot = lambda v: OPTIONS_SLOT if v is transformer_options else v  # noqa: E731
        call_args = tuple(slot(a) for a in args)
        call_kwargs = {k: slot(v) for k, v in kwargs.items()}
        # the run's features open the workers' run at its first call; later calls need not carry them
        features = tuple(transformer_options.get(FEATURES_KEY, ())) if self.calls == 0 else None
        config = self.config
        header = {"signature": tensor_signature((call_args, call_kwargs)),
                  "degrees": (config.ulysses_degree, config.ring_degree, config.cfg_degree),
                  "weights": self.group.serial_of_weights, "run": self.run_id}
        try:
            answers = self.group.send_command("call", header, (call_args, call_kwargs, sent, features))
        except PlainDataError:
            check_sendable(sent, self.feature.describe())  # names the option that cannot be sent
            raise
        self.calls += 1
        self.in_call = True
        super().before_call(args, kwargs, transformer_options)
        self.run.gate.hold(answers)  # the workers check the call while this rank computes up to its first exchange

    def begin_call(self, context) -> None:
        super().begin_call(context)
        cfg = self.config.cfg_degree
        if self.sharded and cfg > 1 and self.run.batch_part()[1] == 1:
            batch = self.run.whole_call and call_batch(*self.run.whole_call)
            self.calls_unsplit.append(f"a batch of {batch} does not split into cfg_degree {cfg} equal "
                                      "parts: the call ran on every rank with the sequence split only")
        self._call_start = (time.perf_counter(), self.run.stats.bytes_sent)

    def end_call(self, context) -> None:
        if self._call_start is None:
            return
        started, sent = self._call_start
        self._call_start = None
        self.steps.add(context.step, seconds=time.perf_counter() - started,
                       bytes_sent=self.run.stats.bytes_sent - sent,
                       decided=int(context.blocks_run is not None), skipped=int(context.blocks_run is False))

    def call_output(self, output: Any) -> Any:
        self.run.gate.release()  # a call whose every exchange was skipped still hears every worker's answer
        output = super().call_output(output)
        self.in_call = False
        return output

    def explain_failure(self, error: Exception) -> Exception | None:
        """A call that stopped mid-way (a rank failed, rank 0 raised or was interrupted) leaves the workers blocked in
        its collectives: the group is closed here, at once (local workers killed), and the next run starts a fresh
        one. A torch.distributed error becomes a ``SequenceParallelError`` naming the ranks that broke the call; any
        other error (an interrupt, the model's own) stays as it is."""
        self.in_call = False  # handled here: the run's close need not
        group = self.group
        if group is None or group is not sp_group.active_group():
            return None
        if isinstance(error, CommandRefused) and error.every_worker:
            return None  # no rank went on to the call: the group is in step, the run's close ends it
        explained = group.explain(error) if is_collective_failure(error) else None
        sp_group.close_group(broken=True)
        self.group = None  # gone: the run's close has no workers to end the run with
        return explained

    def close(self, status: str) -> None:
        self.remove()
        if self.in_call and self.group is not None:  # a call stopped mid-way by what no session was asked to explain
            sp_group.close_group(broken=True)  # (an interrupt that is no Exception): its workers are blocked in it
        elif status == "error":  # the group may be out of step (a rank died or raised): start afresh next run
            sp_group.close_group()
        elif self.calls and self.group is not None:
            try:  # the workers end the run too (their caches' and offload's close)
                self.group.command("end", {"run": self.run_id, "status": status})
            except Exception:
                log.exception("OmniHooks %s: the workers did not end the run; restarting them next run",
                              self.feature.describe())
                sp_group.close_group()

    def summary(self) -> dict[str, Any] | None:
        if not self.sharded:
            return None
        config = self.config
        group = config.group
        return {"world_size": group.world_size, "ulysses_degree": config.ulysses_degree,
                "ring_degree": config.ring_degree, "cfg_degree": config.cfg_degree,
                "backend": group.backend, "local_devices": list(group.devices), "interface": self.interface,
                "calls": self.calls, "bytes_sent": self.run.stats.bytes_sent if self.run else 0,
                **self._activity()}

    def _activity(self) -> dict[str, Any]:
        """What the card shows beyond the setup: per sampler step its calls, seconds on this rank, bytes this rank
        sent, the calls a cache decided for every rank (``decided``, agreed over the group) and of those the skipped
        ones (``StepTotals``); bytes sent per exchange kind; the calls whose batch ran whole and why."""
        by_kind = self.run.stats.snapshot() if self.run else {}
        return {"steps": self.steps.to_list(), "bytes_sent_by_exchange": {k: r.bytes_sent for k, r in by_kind.items()},
                "calls_unsplit": len(self.calls_unsplit),
                "unsplit_reason": self.calls_unsplit[0] if self.calls_unsplit else None}

    def report(self) -> FeatureReport:
        """Its summary as the run's card, headed by the devices and degrees; ``world_size`` also at the top (the
        panel's header shows it on a cache's run)."""
        summary = self.summary()
        if summary is None:  # the run ended before the model was sharded
            return FeatureReport.of(self.feature)
        degrees = f"ulysses {summary['ulysses_degree']} × ring {summary['ring_degree']}"
        if summary["cfg_degree"] > 1:
            degrees += f" × cfg {summary['cfg_degree']}"
        return FeatureReport.of(self.feature, card=summary, headline=f"{summary['world_size']} devices ({degrees})",
                                fields={"world_size": summary["world_size"]})


FEATURE = FeatureSpec(KIND, Category.SEQUENCE_PARALLEL, SequenceParallelSession)  # in features.FEATURE_MODULES


def _degree_input(name: str, tooltip: str) -> io.Combo.Input:
    return io.Combo.Input(name, options=[AUTO, "1", "2", "4", "8"], default=AUTO, tooltip=tooltip)


class SequenceParallel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID, display_name=display_name(NODE_TITLE), category=CATEGORY,
            description=("Samples this MODEL across several GPUs (or CPU processes): each rank computes its share of "
                         "the image or video tokens (the text, and LTX-2's audio, stay whole on every rank), "
                         "attention is exchanged exactly. Place between the loader (and LoRAs) and the sampler. "
                         f"Supported: {supported_families()}."),
            inputs=[
                io.Model.Input("model"),
                io.Int.Input("world_size", default=2, min=2, max=64,
                             tooltip="How many ranks share each model call (this ComfyUI process is rank 0)."),
                _degree_input("ulysses_degree", "Ranks exchanging attention heads (all-to-all); must divide the "
                              "head count. 'auto': all ranks when the heads allow, else ring."),
                _degree_input("ring_degree", "Ranks passing keys/values around a ring (any head count). "
                              "ulysses x ring = world_size."),
                io.String.Input("devices", default=AUTO,
                                tooltip="Devices of the ranks on this machine, rank 0 first (\"cuda:0,cuda:1\"). "
                                "'auto': the visible GPUs, or CPU ranks without one. Ranks beyond them are remote "
                                "and join with the worker command (README)."),
                io.Combo.Input("backend", options=[AUTO, "nccl", "gloo"], default=AUTO,
                               tooltip="torch.distributed backend. 'auto': NCCL on CUDA, gloo on CPU."),
                io.String.Input("master_address", default=GROUP_INPUTS.default("master_address"),
                                tooltip="Where rank 0 listens. Keep 127.0.0.1 unless remote ranks join; only this "
                                "address is used."),
                io.Int.Input("master_port", default=GROUP_INPUTS.default("master_port"), min=0, max=65535,
                             tooltip="Rank 0's port; 0 picks a free one (local ranks only)."),
                io.Boolean.Input("cfg_parallel", default=False,
                                 tooltip="With cfg > 1: half the ranks compute the cond batch, the other half the "
                                 "uncond, each half splitting the tokens (ulysses x ring = world_size / 2). Calls "
                                 "that do not split in two (cfg 1, one cond) run on all ranks. Needs an even "
                                 "world_size."),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, world_size, ulysses_degree, ring_degree, devices, backend, master_address,
                master_port, cfg_parallel=False) -> io.NodeOutput:
        local = resolve_devices(devices, world_size, master_address)
        if backend == AUTO:
            backend = "nccl" if local[0].startswith("cuda") else "gloo"
        if backend == "nccl" and any(not d.startswith("cuda") for d in local):
            cpus = ", ".join(d for d in local if not d.startswith("cuda"))
            raise ValueError(f"{NODE_TITLE}: backend nccl needs a GPU for every rank, but devices {devices!r} has "
                             f"{cpus}; set backend to gloo or 'auto', or list GPUs only")
        if world_size > len(local) and master_port == 0:
            raise ValueError(f"{NODE_TITLE}: {world_size - len(local)} rank(s) are remote: set master_port so they "
                             "know where to join")
        rendezvous.check_platform(backend)
        config = config_for(  # every degree the model or the world cannot take, before any rank starts
            model, sp_group.GroupSettings(world_size, backend, local, master_address, master_port),
            ulysses_degree=None if ulysses_degree == AUTO else int(ulysses_degree),
            ring_degree=None if ring_degree == AUTO else int(ring_degree), cfg_parallel=bool(cfg_parallel))
        feature = AppliedFeature(KIND, Category.SEQUENCE_PARALLEL, NODE_TITLE, cls.hidden.unique_id, config)
        return io.NodeOutput(attach_feature(model, feature))


__all__ = ["SequenceParallel", "SequenceParallelSession", "config_for"]
