"""Check ComfyUI workflow files against a server's ``/object_info`` (no comfy import).

Two formats:
* UI (what the frontend saves and the template browser opens): ``nodes`` with ``widgets_values`` in widget order,
  ``links`` as ``[id, origin_id, origin_slot, target_id, target_slot, type]``;
* API (what ``POST /prompt`` takes): ``{node_id: {"class_type", "inputs", "_meta": {"title"}}}``.

``widget_layout(info)`` reproduces the frontend's (1.27) widget list of a node definition: one widget per
INT/FLOAT/STRING/BOOLEAN/COMBO input in ``input_order`` (required, then optional; ``forceInput`` ones excluded), plus
the frontend-only "control_after_generate" combo right after an INT that has ``control_after_generate`` (or, when
that key is absent, is named ``seed``/``noise_seed``) or a COMBO that has it. Its value is saved in
``widgets_values`` but never sent to the server. The reverse also exists: a widget a frontend extension adds to a core
node that is not saved in ``widgets_values`` but is sent with the prompt (``FRONTEND_SENT_WIDGETS``, e.g. the read-only
"preview" text box of PreviewAny; the server ignores inputs a node does not declare). Upload widgets (``image_upload``
& co.) are not modelled and raise.

Newer frontends (1.49, with ComfyUI 0.33) add what newer servers declare: a dynamic combo
(``COMFY_DYNAMICCOMBO_V3``) is a combo widget followed by the widgets of the option it holds, named
``<input>.<sub input>`` (recursively), so the layout depends on the values (``widget_layout(info, values)``); a
workflow saved with fewer values than widgets keeps the defaults of the missing optional ones (an optional input a
newer ComfyUI added), and a node may have outputs a newer ComfyUI added after the saved ones. An API prompt may carry
``<input>.<sub input>`` values an older server does not declare: servers ignore the inputs a node does not declare,
so one prompt can serve both. ``same_prompt`` compares two prompts as one server runs them.

``validate_ui`` / ``validate_api`` return a list of problems (empty = valid); ``ui_to_api`` converts like the
frontend's "Export (API)". ``missing_ok(input_name, value)`` decides which combo values may be absent from the
server's options (model files the test server does not have).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")
FRONTEND_ONLY_NODES = frozenset({"Note", "MarkdownNote"})  # frontend-only: never sent to the server
# node type -> {widget name: the value the frontend (1.27) sends for it}: widgets its extensions add to core nodes
# with ``serialize = false`` (not in widgets_values) that graphToPrompt still puts into the prompt, before the inputs
FRONTEND_SENT_WIDGETS: dict[str, dict[str, Any]] = {"PreviewAny": {"preview": ""}}
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
AUTOGROW = "COMFY_AUTOGROW_V3"  # an input that grows one linked input per name: ``<input>.<name>``
UPLOAD_KEYS = ("image_upload", "video_upload", "audio_upload", "animated_image_upload", "upload")
ACTIVE_MODE = 0  # LiteGraph node modes: 0 always, 2 never (muted), 4 bypassed

MissingOk = Callable[[str, Any], bool]
# an input's option naming the value a workflow saved without it gets in the page (web/saved_workflows.js)
SAVED_WITHOUT = "omnihooks_saved_without"


class UnsupportedWidget(ValueError):
    pass


@dataclass(frozen=True)
class Widget:
    name: str                 # the input name, or "<input>.control_after_generate" for the frontend-only control
    input_name: str | None    # None: a frontend-only widget (not an input of the node)
    kind: str                 # INT, FLOAT, STRING, BOOLEAN, COMBO or CONTROL
    options: Mapping[str, Any] = field(default_factory=dict)
    choices: tuple | None = None
    required: bool = True     # False: an optional input (a missing saved value keeps its default)
    sub_inputs: Mapping[str, Any] | None = None   # a dynamic combo: option key -> its inputs ({"required": ...})

    @property
    def default(self) -> Any:
        """The value a new node shows: the declared default, else a combo's first choice."""
        if "default" in self.options or not self.choices:
            return self.options.get("default")
        return self.choices[0]


def spec_kind(spec: list) -> tuple[str | None, dict, tuple | None]:
    """(widget kind or None for a socket-only type, options, combo choices) of an /object_info input spec."""
    type_, options = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
    if isinstance(type_, str) and options.get("widgetType") in WIDGET_TYPES:
        type_ = options["widgetType"]  # a MultiType input ("FLOAT,INT"): the frontend shows its widget type
    if isinstance(type_, list):
        return "COMBO", options, tuple(type_)
    if type_ == "COMBO":
        return "COMBO", options, tuple(options.get("options", []))
    if type_ == DYNAMIC_COMBO:
        return "COMBO", options, tuple(o["key"] for o in options.get("options", []))
    if type_ in WIDGET_TYPES:
        return type_, options, None
    return None, options, None


def input_specs(info: Mapping[str, Any]) -> dict[str, tuple[str, list]]:
    """input name -> (category, spec), required before optional, in ``input_order`` (hidden inputs left out)."""
    result = {}
    for category in ("required", "optional"):
        for name in info.get("input_order", {}).get(category, list(info["input"].get(category, {}))):
            result[name] = (category, info["input"][category][name])
    return result


def _widgets(info: Mapping[str, Any], specs: Mapping[str, tuple[str, list]], prefix: str) -> list[Widget]:
    widgets = []
    for name, (category, spec) in specs.items():
        kind, options, choices = spec_kind(spec)
        if kind is None or options.get("forceInput"):
            continue
        if any(options.get(k) for k in UPLOAD_KEYS):
            raise UnsupportedWidget(f"{info.get('name')}.{name}: upload widgets are not modelled")
        sub_inputs = ({o["key"]: o.get("inputs", {}) for o in options.get("options", [])}
                      if spec[0] == DYNAMIC_COMBO else None)
        widgets.append(Widget(prefix + name, prefix + name, kind, options, choices, category == "required",
                              sub_inputs))
        control = options.get("control_after_generate", name in ("seed", "noise_seed") if kind == "INT" else False)
        if control and kind in ("INT", "COMBO"):
            widgets.append(Widget(f"{prefix}{name}.control_after_generate", None, "CONTROL", {}, CONTROL_VALUES))
    return widgets


def _specs(inputs: Mapping[str, Any]) -> dict[str, tuple[str, list]]:
    return {name: (category, spec) for category in ("required", "optional")
            for name, spec in inputs.get(category, {}).items()}


def widget_layout(info: Mapping[str, Any], values: list | None = None) -> list[Widget]:
    """The node's widgets in order; a dynamic combo is followed by the widgets of the option it holds (the value at
    its place in ``values``, else its default), as the frontend inserts them when the value is set."""
    pending = _widgets(info, input_specs(info), "")
    layout: list[Widget] = []
    while pending:
        widget = pending.pop(0)
        layout.append(widget)
        if widget.sub_inputs is not None:
            held = values[len(layout) - 1] if values is not None and len(layout) <= len(values) else widget.default
            inputs = widget.sub_inputs.get(held) if isinstance(held, str) else None
            pending[:0] = _widgets(info, _specs(inputs or {}), widget.name + ".")
    return layout


def check_value(widget: Widget, value: Any, missing_ok: MissingOk | None = None) -> str | None:
    """None if ``value`` is valid for ``widget``, else what is wrong."""
    o = widget.options
    if widget.kind in ("INT", "FLOAT"):
        number_types = (int,) if widget.kind == "INT" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number_types):
            return f"{widget.name}: {value!r} is not {widget.kind}"
        if "min" in o and value < o["min"]:
            return f"{widget.name}: {value} < min {o['min']}"
        if "max" in o and value > o["max"]:
            return f"{widget.name}: {value} > max {o['max']}"
        return None
    if widget.kind == "STRING":
        return None if isinstance(value, str) else f"{widget.name}: {value!r} is not a string"
    if widget.kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{widget.name}: {value!r} is not a boolean"
    if widget.kind in ("COMBO", "CONTROL"):
        if value in widget.choices:
            return None
        if widget.kind == "COMBO" and missing_ok is not None and missing_ok(widget.input_name, value):
            return None
        shown = list(widget.choices) if len(widget.choices) <= 30 else f"{len(widget.choices)} options"
        return f"{widget.name}: {value!r} not in {shown}"
    return f"{widget.name}: unknown widget kind {widget.kind}"


def types_compatible(output_type: Any, input_type: Any) -> bool:
    if output_type == "*" or input_type == "*":
        return True
    if not isinstance(output_type, str) or not isinstance(input_type, str):
        return output_type == input_type
    return bool(set(output_type.split(",")) & set(input_type.split(",")))


# --------------------------------------------------------------------------------------------------- UI format

def ui_nodes(workflow: Mapping[str, Any]) -> dict[int, dict]:
    return {n["id"]: n for n in workflow["nodes"]}


def ui_links(workflow: Mapping[str, Any]) -> dict[int, list]:
    return {link[0]: link for link in workflow["links"]}


def node_title(node: Mapping[str, Any], object_info: Mapping[str, Any]) -> str:
    info = object_info.get(node["type"], {})
    return node.get("title") or info.get("display_name") or node["type"]


def validate_ui(workflow: Mapping[str, Any], object_info: Mapping[str, Any],
                missing_ok: MissingOk | None = None) -> list[str]:
    problems: list[str] = []
    nodes_list, links_list = workflow.get("nodes", []), workflow.get("links", [])
    ids = [n["id"] for n in nodes_list]
    if len(ids) != len(set(ids)):
        problems.append(f"duplicate node ids {ids}")
    link_ids = [link[0] for link in links_list]
    if len(link_ids) != len(set(link_ids)):
        problems.append(f"duplicate link ids {link_ids}")
    if ids and workflow.get("last_node_id", 0) < max(ids):
        problems.append(f"last_node_id {workflow.get('last_node_id')} < largest node id {max(ids)}")
    if link_ids and workflow.get("last_link_id", 0) < max(link_ids):
        problems.append(f"last_link_id {workflow.get('last_link_id')} < largest link id {max(link_ids)}")
    nodes, links = ui_nodes(workflow), ui_links(workflow)

    for link in links_list:
        if len(link) != 6:
            problems.append(f"link {link}: not [id, origin_id, origin_slot, target_id, target_slot, type]")
            continue
        lid, src, src_slot, dst, dst_slot, ltype = link
        if src not in nodes or dst not in nodes:
            problems.append(f"link {lid}: node {src} or {dst} does not exist")
            continue
        outs, ins = nodes[src].get("outputs", []), nodes[dst].get("inputs", [])
        if src_slot >= len(outs) or lid not in (outs[src_slot].get("links") or []):
            problems.append(f"link {lid}: not listed in output {src_slot} of node {src}")
        elif not types_compatible(outs[src_slot]["type"], ltype):
            problems.append(f"link {lid}: type {ltype} but output {src_slot} of node {src} is {outs[src_slot]['type']}")
        if dst_slot >= len(ins) or ins[dst_slot].get("link") != lid:
            problems.append(f"link {lid}: not the link of input {dst_slot} of node {dst}")
        elif not types_compatible(ltype, ins[dst_slot]["type"]):
            problems.append(f"link {lid}: type {ltype} into input {ins[dst_slot]['name']} ({ins[dst_slot]['type']}) "
                            f"of node {dst}")

    for node in nodes_list:
        where = f"node {node['id']} ({node['type']})"
        for slot, inp in enumerate(node.get("inputs", [])):
            lid = inp.get("link")
            if lid is not None and (lid not in links or links[lid][3] != node["id"] or links[lid][4] != slot):
                problems.append(f"{where}: input {inp['name']} names link {lid}, which does not end there")
        for slot, out in enumerate(node.get("outputs", [])):
            for lid in out.get("links") or []:
                if lid not in links or links[lid][1] != node["id"] or links[lid][2] != slot:
                    problems.append(f"{where}: output {slot} lists link {lid}, which does not start there")
        if node.get("mode", ACTIVE_MODE) != ACTIVE_MODE:
            problems.append(f"{where}: mode {node.get('mode')} (muted/bypassed nodes are not expected in examples)")
        if node["type"] in FRONTEND_ONLY_NODES:
            values = node.get("widgets_values", [])
            if node.get("inputs") or node.get("outputs") or len(values) != 1 or not isinstance(values[0], str):
                problems.append(f"{where}: a note has one text widget and no sockets")
            continue
        info = object_info.get(node["type"])
        if info is None:
            problems.append(f"{where}: node type not on the server")
            continue
        problems.extend(_validate_ui_node(node, info, where, missing_ok))
    return problems


def _validate_ui_node(node, info, where, missing_ok) -> list[str]:
    problems = []
    specs = input_specs(info)
    try:
        layout = widget_layout(info)
    except UnsupportedWidget as e:
        return [f"{where}: {e}"]
    widget_inputs = {w.input_name for w in layout if w.input_name}
    linked = set()
    for inp in node.get("inputs", []):
        name = inp["name"]
        if name not in specs:
            problems.append(f"{where}: input {name!r} is not an input of {node['type']} ({list(specs)})")
            continue
        kind, _, _ = spec_kind(specs[name][1])
        declared = specs[name][1][0] if kind != "COMBO" else "COMBO"
        if kind is None and inp.get("type") != declared:
            problems.append(f"{where}: input {name} has type {inp.get('type')}, the server says {declared}")
        if inp.get("link") is not None:
            linked.add(name)
    for name, (category, spec) in specs.items():
        if category == "required" and name not in widget_inputs and name not in linked:
            problems.append(f"{where}: required input {name} is not connected")
    saved_outputs = [o.get("type") for o in node.get("outputs", [])]
    if saved_outputs != list(info["output"])[:len(saved_outputs)]:  # a newer ComfyUI may add outputs after them
        problems.append(f"{where}: outputs {saved_outputs} != server's {info['output']}")
    values = node.get("widgets_values", [])
    if not isinstance(values, list):
        return problems + [f"{where}: widgets_values is not a list: {values!r}"]
    layout = widget_layout(info, values)
    optional_missing = [w.name for w in layout[len(values):] if not w.required]
    required_missing = [w.name for w in layout[len(values):] if w.required
                        and not any(w.name.startswith(name + ".") for name in optional_missing)]
    if len(values) > len(layout) or required_missing:
        problems.append(f"{where}: {len(values)} widgets_values {values} for widgets {[w.name for w in layout]}")
        return problems
    for widget, value in zip(layout, values):
        bad = check_value(widget, value, missing_ok)
        if bad:
            problems.append(f"{where}: {bad}")
    model_names = {m.get("name") for m in node.get("properties", {}).get("models", [])}
    if model_names - set(v for v in values if isinstance(v, str)):
        problems.append(f"{where}: properties.models {sorted(model_names)} not among the widget values {values}")
    return problems


SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20  # a subgraph's input and output nodes, as its links name them
_LINK_KEYS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")  # a subgraph's link, as a dict


def flatten_subgraphs(workflow: Mapping[str, Any]) -> dict:
    """The workflow as the frontend (1.24 and later) queues it when some of its nodes are subgraphs (a node whose type
    is the id of an entry of ``definitions.subgraphs``, as ComfyUI's own templates ship since
    comfyui-workflow-templates 0.11): each such node replaced by the subgraph's nodes, recursively, their ids prefixed
    with the path of subgraph nodes (``"128:71"``, the ids the frontend sends), the links through the subgraph's
    inputs and outputs joined to the links outside. An inner widget fed by a subgraph input that nothing outside
    links keeps its own value (the subgraph node shows the inner widget, promoted). Inner nodes of a muted or bypassed
    subgraph node take its mode. A workflow without subgraph nodes is returned as it is."""
    definitions = {sg["id"]: sg for sg in workflow.get("definitions", {}).get("subgraphs", [])}
    if not any(n["type"] in definitions for n in workflow["nodes"]):
        return dict(workflow)
    link_ids = iter(range(1, 1 << 62))
    nodes, links, _, _ = _flatten_graph(workflow["nodes"], [list(link) for link in workflow["links"]], definitions,
                                        "", link_ids)
    into = {(t, ts): lid for lid, _, _, t, ts, _ in links}
    out_of: dict[tuple, list[int]] = {}
    for lid, o, os, *_ in links:
        out_of.setdefault((o, os), []).append(lid)
    for node in nodes:
        node["inputs"] = [{**inp, "link": into.get((node["id"], i))} for i, inp in enumerate(node.get("inputs", []))]
        node["outputs"] = [{**out, "links": out_of.get((node["id"], i), [])}
                           for i, out in enumerate(node.get("outputs", []))]
    flat = {k: v for k, v in workflow.items() if k != "definitions"}
    return {**flat, "nodes": nodes, "links": links}


def _flatten_graph(graph_nodes: list, graph_links: list, definitions: Mapping[str, Any], prefix: str, link_ids):
    """One graph level of ``flatten_subgraphs``: (its nodes with subgraph nodes replaced, copies with full ids; its
    links between them as ``[id, origin, slot, target, slot, type]``; per subgraph input slot the inner
    ``(node, input slot)`` pairs it feeds; per subgraph output slot the inner ``(node, output slot)`` feeding it)."""
    def full(nid):
        return f"{prefix}{nid}" if prefix else nid

    expanded = {}
    nodes = []
    for node in graph_nodes:
        if node["type"] not in definitions:
            nodes.append({**node, "id": full(node["id"])})
            continue
        sg = definitions[node["type"]]
        inner_links = [[lk.get(key) for key in _LINK_KEYS] for lk in sg["links"]]
        inner = _flatten_graph(sg["nodes"], inner_links, definitions, f"{full(node['id'])}:", link_ids)
        if node.get("mode", ACTIVE_MODE) != ACTIVE_MODE:
            for n in inner[0]:
                n["mode"] = node["mode"]
        expanded[node["id"]] = inner
        nodes.extend(inner[0])
        links_inside = inner[1]
        graph_links = graph_links + [["inner", *link] for link in links_inside]

    def sources(o, os) -> list:
        if o in expanded:
            return [expanded[o][3][os]] if os in expanded[o][3] else []
        return [("input", os)] if o == SUBGRAPH_INPUT else [(full(o), os)]

    def targets(t, ts) -> list:
        if t in expanded:
            return expanded[t][2].get(ts, [])
        return [("output", ts)] if t == SUBGRAPH_OUTPUT else [(full(t), ts)]

    links, feeds, fed_by = [], {}, {}
    for link in graph_links:
        if link[0] == "inner":  # already flattened inside a subgraph node
            links.append(link[1:])
            continue
        _, o, os, t, ts, kind = link
        for source in sources(o, os):
            for target in targets(t, ts):
                if source[0] == "input" and target[0] == "output":
                    raise ValueError(f"subgraph {prefix!r}: input {source[1]} goes straight to output {target[1]}")
                if source[0] == "input":
                    feeds.setdefault(source[1], []).append(target)
                elif target[0] == "output":
                    fed_by[target[1]] = source
                else:
                    links.append([next(link_ids), *source, *target, kind])
    return nodes, links, feeds, fed_by


def ui_to_api(workflow: Mapping[str, Any], object_info: Mapping[str, Any]) -> dict[str, dict]:
    """The API prompt the frontend would queue for this UI workflow (active nodes only, frontend-only ones left out,
    subgraphs flattened: ``flatten_subgraphs``); a widget the saved values end before takes its default, or the value
    its ``SAVED_WITHOUT`` option names, as this pack's page extension sets it."""
    workflow = flatten_subgraphs(workflow)
    nodes, links = ui_nodes(workflow), ui_links(workflow)
    prompt: dict[str, dict] = {}
    for node in sorted(workflow["nodes"], key=lambda n: [int(part) for part in str(n["id"]).split(":")]):
        if node["type"] in FRONTEND_ONLY_NODES or node.get("mode", ACTIVE_MODE) != ACTIVE_MODE:
            continue
        info = object_info[node["type"]]
        values = node.get("widgets_values", [])
        layout = widget_layout(info, values)
        inputs: dict[str, Any] = {}
        for widget, value in zip(layout, [*values, *(w.options.get(SAVED_WITHOUT, w.default)
                                                     for w in layout[len(values):])]):
            if widget.input_name is not None:
                inputs[widget.input_name] = value
        for inp in node.get("inputs", []):
            lid = inp.get("link")
            if lid is not None:
                src = links[lid][1]
                if nodes[src].get("mode", ACTIVE_MODE) != ACTIVE_MODE:
                    raise ValueError(f"node {node['id']}: input {inp['name']} comes from an inactive node {src}")
                inputs[inp["name"]] = [str(src), links[lid][2]]
        specs = input_specs(info)
        grown = [name for name in inputs if name.split(".", 1)[0] in specs and "." in name
                 and specs[name.split(".", 1)[0]][1][0] == AUTOGROW]  # ``values.a`` of an autogrow input ``values``
        names = dict.fromkeys([*specs, *grown, *(w.input_name for w in layout if w.input_name)])
        ordered = {**FRONTEND_SENT_WIDGETS.get(node["type"], {}),
                   **{name: inputs[name] for name in names if name in inputs}}
        prompt[str(node["id"])] = {"inputs": ordered, "class_type": node["type"],
                                   "_meta": {"title": node_title(node, object_info)}}
    return prompt


# --------------------------------------------------------------------------------------------------- API format

VALUE_NODES = frozenset({"PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean", "PrimitiveString",
                         "PrimitiveStringMultiline"})  # ComfyUI's primitives: their ``value`` input is their output


def fold_values(prompt: Mapping[str, Any],
                evaluate: Callable[[str, Mapping[str, Any]], tuple | None] | None = None) -> dict[str, dict]:
    """``prompt`` with what ComfyUI's value nodes pass on written into the inputs they feed, and those nodes left
    out, repeated until nothing more folds: a primitive (``VALUE_NODES``: its ``value``), a ``ComfySwitchNode`` whose
    ``switch`` is a value (the input it picks, a value or a link), and a node whose inputs are all values and for
    which ``evaluate(class_type, inputs)`` returns its outputs (None: not folded). Compares a template that computes
    its settings (ComfyUI's templates since comfyui-workflow-templates 0.11) with one that writes them out."""
    prompt = {nid: {**node, "inputs": dict(node["inputs"])} for nid, node in prompt.items()}
    while True:
        outputs: dict[str, tuple] = {}
        for nid, node in prompt.items():
            kind, inputs = node["class_type"], node["inputs"]
            if kind in VALUE_NODES and not isinstance(inputs.get("value"), list):
                outputs[nid] = (inputs["value"],)
            elif kind == "ComfySwitchNode" and not isinstance(inputs.get("switch"), list):
                outputs[nid] = (inputs.get("on_true" if inputs["switch"] else "on_false"),)
            elif evaluate is not None and not any(isinstance(v, list) for v in inputs.values()):
                result = evaluate(kind, inputs)
                if result is not None:
                    outputs[nid] = tuple(result)
        if not outputs:
            return prompt
        for nid in outputs:
            del prompt[nid]
        for node in prompt.values():
            for name, value in node["inputs"].items():
                if isinstance(value, list) and value[0] in outputs:
                    node["inputs"][name] = outputs[value[0]][value[1]]


def validate_api(prompt: Mapping[str, Any], object_info: Mapping[str, Any],
                 missing_ok: MissingOk | None = None) -> list[str]:
    problems = []
    for nid, node in prompt.items():
        where = f"node {nid} ({node.get('class_type')})"
        info = object_info.get(node.get("class_type"))
        if info is None:
            problems.append(f"{where}: node type not on the server")
            continue
        inputs = node.get("inputs", {})
        specs = expanded_specs(info, inputs)
        widgets = {w.input_name: w for w in _widgets(info, specs, "") if w.input_name}
        sent_by_frontend = FRONTEND_SENT_WIDGETS.get(node.get("class_type"), {})
        for name in inputs:
            if name in sent_by_frontend and name not in specs:
                if not isinstance(inputs[name], type(sent_by_frontend[name])):
                    problems.append(f"{where}: frontend widget {name}: {inputs[name]!r} is not "
                                    f"{type(sent_by_frontend[name]).__name__}")
            elif name not in specs and not _newer_sub_input(name, specs):
                problems.append(f"{where}: unknown input {name!r}")
        for name, (category, spec) in specs.items():
            if name not in inputs:
                if category == "required":
                    problems.append(f"{where}: required input {name} missing")
                continue
            value = inputs[name]
            if isinstance(value, list):
                if len(value) != 2 or not isinstance(value[0], str) or value[0] not in prompt:
                    problems.append(f"{where}: input {name}: bad link {value}")
                    continue
                source = object_info.get(prompt[value[0]].get("class_type"), {})
                outputs = list(source.get("output", []))
                if not isinstance(value[1], int) or not 0 <= value[1] < len(outputs):
                    problems.append(f"{where}: input {name}: node {value[0]} has no output {value[1]}")
                    continue
                kind, _, _ = spec_kind(spec)
                declared = spec[0] if kind is None else (kind if kind != "COMBO" else "COMBO")
                if kind is None and not types_compatible(outputs[value[1]], declared):
                    problems.append(f"{where}: input {name} ({declared}) linked to a {outputs[value[1]]} output")
            elif name in widgets:
                bad = check_value(widgets[name], value, missing_ok)
                if bad:
                    problems.append(f"{where}: {bad}")
            else:
                problems.append(f"{where}: input {name} ({spec[0]}) needs a link, got {value!r}")
    return problems


def expanded_specs(info: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, tuple[str, list]]:
    """input name -> (category, spec) as the server reads a prompt with these values: a dynamic combo's inputs are
    followed by those of the option it holds (``<input>.<sub input>``, recursively)."""
    result: dict[str, tuple[str, list]] = {}

    def add(specs: Mapping[str, tuple[str, list]], prefix: str) -> None:
        for name, (category, spec) in specs.items():
            result[prefix + name] = (category, spec)
            if spec[0] == DYNAMIC_COMBO:
                widget = _widgets(info, {name: (category, spec)}, prefix)[0]
                held = values.get(prefix + name, widget.default)
                add(_specs(widget.sub_inputs.get(held) or {}) if isinstance(held, str) else {}, prefix + name + ".")

    add(input_specs(info), "")
    return result


def _newer_sub_input(name: str, specs: Mapping[str, tuple[str, list]]) -> bool:
    """``<input>.<sub input>`` of an input this (older) server declares as a plain one: what a newer ComfyUI makes a
    dynamic combo. The server ignores it (servers ignore the inputs a node does not declare)."""
    head = name.split(".", 1)[0]
    return "." in name and head in specs and specs[head][1][0] != DYNAMIC_COMBO


def as_run(prompt: Mapping[str, Any], object_info: Mapping[str, Any]) -> dict[str, dict]:
    """A prompt as this server runs it: per node its class and the inputs it declares, an optional input left at the
    value a prompt without it runs with dropped (its default, or the value its ``SAVED_WITHOUT`` option names), titles
    left out."""
    result = {}
    for nid, node in prompt.items():
        info = object_info[node["class_type"]]
        specs = expanded_specs(info, node["inputs"])
        defaults = {w.input_name: w.options.get(SAVED_WITHOUT, w.default) for w in _widgets(info, specs, "")
                    if w.input_name and not w.required}
        result[nid] = {"class_type": node["class_type"],
                       "inputs": {name: value for name, value in node["inputs"].items()
                                  if name in specs and not (name in defaults and value == defaults[name])}}
    return result


def upstream(prompt: Mapping[str, Any], node_id: str, input_name: str) -> list[str]:
    """The chain of node ids feeding ``input_name`` of ``node_id`` through each node's first link input of the same
    name (e.g. the MODEL chain of a sampler): [direct source, its source, ..., the loader]."""
    chain = []
    value = prompt[node_id]["inputs"].get(input_name)
    while isinstance(value, list):
        chain.append(value[0])
        value = prompt[value[0]]["inputs"].get(input_name)
    return chain
