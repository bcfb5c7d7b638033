// The model configs the matrix is asked about: each a name and a parsed config.json, from
// a bundled example, an uploaded file or pasted text. Only JSON objects are taken; whether
// one is a quantized MoE config is the server's to say (its row then says why not).

import { el, replace } from "./dom.js";

export class Configs {
  constructor(list, empty, onChange) {
    this.items = [];
    this.list = list;
    this.empty = empty;
    this.onChange = onChange;
  }

  /** Adds a config (a JSON object) under a name unique among the chosen ones. */
  add(name, config) {
    if (config === null || typeof config !== "object" || Array.isArray(config)) {
      throw new Error(`${name}: a config.json is a JSON object`);
    }
    const base = (name || "config").trim() || "config";
    let unique = base;
    for (let n = 2; this.items.some((item) => item.name === unique); n++) unique = `${base}-${n}`;
    this.items.push({ name: unique, config });
    this.render();
    return unique;
  }

  remove(name) {
    this.items = this.items.filter((item) => item.name !== name);
    this.render();
  }

  find(name) {
    return this.items.find((item) => item.name === name);
  }

  render() {
    replace(
      this.list,
      this.items.map((item) =>
        el(
          "li",
          {},
          el("span", { class: "name" }, item.name),
          " ",
          el("span", { class: "hint" }, summary(item.config)),
          " ",
          el(
            "button",
            {
              type: "button",
              class: "link",
              "aria-label": `Remove ${item.name}`,
              onclick: () => this.remove(item.name),
            },
            "remove",
          ),
        ),
      ),
    );
    this.empty.hidden = this.items.length > 0;
    this.onChange();
  }
}

/** A short line about a config: its architecture and quantization method. */
function summary(config) {
  const quant = config.quantization_config || {};
  const arch = (config.architectures || [])[0] || config.model_type || "?";
  const bits = quant.bits ?? quant.w_bit ?? "";
  return `${arch}, ${quant.quant_method || "not quantized"}${bits ? ` ${bits}-bit` : ""}`;
}

/** A name for a config: the file's name, else its _name_or_path, else its model type. */
export function nameFor(config, fileName) {
  if (fileName && fileName !== "config.json") return fileName.replace(/\.json$/i, "");
  const path = (config && config._name_or_path) || "";
  if (path) return path.split("/").filter(Boolean).pop();
  return (config && config.model_type) || "config";
}

/** The JSON text as an object, or an Error that says where it is wrong. */
export function parseConfig(text, label) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new Error(`${label} is not JSON: ${error.message}`);
  }
}
