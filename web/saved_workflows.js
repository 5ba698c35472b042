// OmniHooks: a workflow saved before an input existed keeps doing what it did when it is opened in the page.
// An input whose definition carries "omnihooks_saved_without" (nodes/caches/inputs.py: the caches' speed-up, the
// Calibrate nodes' trial of it) shows its default on a node the user adds, but takes that value on a node loaded
// without it: a saved workflow whose widget values end before it (or whose named values lack it), and an API-format
// workflow whose inputs lack it.
// A prompt queued from the API without it gets the same value from the node itself, so all three agree.
import { app } from "../../scripts/app.js";

const SAVED_WITHOUT = "omnihooks_saved_without";
const savedWithout = new Map(); // node type -> {input name: value}

function inputsWithout(nodeData) {
  const found = {};
  for (const group of ["required", "optional"]) {
    for (const [name, spec] of Object.entries(nodeData?.input?.[group] ?? {})) {
      const options = Array.isArray(spec) ? spec[1] : null;
      if (options && Object.prototype.hasOwnProperty.call(options, SAVED_WITHOUT)) found[name] = options[SAVED_WITHOUT];
    }
  }
  return found;
}

function setWidget(node, name, value) {
  const widget = node.widgets?.find((w) => w.name === name);
  if (widget) widget.value = value;
}

function savedLacks(node, info, name) {
  const named = info?.widgets_values_named;
  if (named && typeof named === "object" && Object.prototype.hasOwnProperty.call(named, name)) return false;
  const values = info?.widgets_values;
  if (values && !Array.isArray(values)) return !Object.prototype.hasOwnProperty.call(values, name);
  if (!Array.isArray(values)) return false; // nothing saved: a node the user adds keeps its default
  const serialized = (node.widgets ?? []).filter((w) => w.serialize !== false);
  const index = serialized.findIndex((w) => w.name === name);
  return index >= values.length;
}

app.registerExtension({
  name: "OmniHooks.SavedWorkflows",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const found = inputsWithout(nodeData);
    if (!Object.keys(found).length) return;
    savedWithout.set(nodeData.name, found);
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (info) {
      const result = onConfigure?.apply(this, arguments);
      for (const [name, value] of Object.entries(found)) {
        if (savedLacks(this, info, name)) setWidget(this, name, value);
      }
      return result;
    };
  },
  async setup() {
    const loadApiJson = app.loadApiJson;
    if (typeof loadApiJson !== "function") return;
    app.loadApiJson = async function (apiData, ...rest) {
      const result = await loadApiJson.call(this, apiData, ...rest);
      for (const [id, entry] of Object.entries(apiData ?? {})) {
        const found = savedWithout.get(entry?.class_type);
        if (!found) continue;
        const node = app.graph?.getNodeById?.(isNaN(+id) ? id : +id);
        for (const [name, value] of Object.entries(found)) {
          if (node && !Object.prototype.hasOwnProperty.call(entry.inputs ?? {}, name)) setWidget(node, name, value);
        }
      }
      return result;
    };
  },
});
