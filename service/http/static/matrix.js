// The matrix: one row per model and release, one column per GPU, each cell a button that
// names what the cell says (the backend, FAILS, invalid, unquantized) in text, coloured by
// backend, with a hazard marked by a sign and said in words. Colour is never the only
// carrier: the text says it all.

import { el, replace } from "./dom.js";

export const HAZARD_SIGN = "⚠";
const PALETTE_SIZE = 12;
const OUTCOME_TEXT = {
  unquantized: "unquantized",
  fails: "FAILS",
  invalid: "invalid",
  error: "error",
};

/** Each backend's colour class, by its place in the rulesets' own backend lists. */
export function backendColours(rulesets) {
  const order = [];
  for (const ruleset of rulesets) {
    for (const backend of ruleset.backends || []) if (!order.includes(backend)) order.push(backend);
  }
  return new Map(order.map((backend, index) => [backend, `bk-${index % PALETTE_SIZE}`]));
}

export function cellText(cell) {
  return cell.outcome === "chosen" ? cell.backend : OUTCOME_TEXT[cell.outcome] || cell.outcome;
}

function cellClass(cell, colours) {
  if (cell.outcome === "chosen") return colours.get(cell.backend) || "bk-other";
  return `out-${cell.outcome}`;
}

function describe(cell) {
  const parts = [`${cell.model}, ${cell.ruleset}, ${cell.gpu}: ${cellText(cell)}`];
  for (const hazard of cell.hazards) parts.push(`hazard ${hazard.code}: ${hazard.message}`);
  if (cell.problem) parts.push(cell.problem);
  return parts.join(". ");
}

function cellButton(cell, colours, onPick) {
  const hazard = cell.hazards.length > 0;
  return el(
    "button",
    {
      type: "button",
      class: `cell ${cellClass(cell, colours)}${hazard ? " hazard" : ""}`,
      title: describe(cell),
      "aria-label": describe(cell),
      dataset: { model: cell.model, ruleset: cell.ruleset, gpu: cell.gpu, outcome: cell.outcome },
      onclick: (event) => onPick(cell, event.currentTarget),
    },
    el("span", { class: "label" }, cellText(cell)),
    hazard ? el("span", { class: "hazard-mark", "aria-hidden": "true" }, ` ${HAZARD_SIGN}`) : null,
  );
}

/** Renders `matrix` (POST /v1/select:matrix's answer) into `target`, a legend into `legend`. */
export function renderMatrix(target, legend, matrix, colours, onPick) {
  const byKey = new Map(matrix.cells.map((c) => [`${c.model}\u0000${c.ruleset}\u0000${c.gpu}`, c]));
  const head = el(
    "tr",
    {},
    el("th", { scope: "col" }, "Model"),
    el("th", { scope: "col" }, "Release"),
    matrix.gpus.map((gpu) => el("th", { scope: "col" }, gpu)),
  );
  const rows = [];
  for (const model of matrix.models) {
    matrix.rulesets.forEach((ruleset, index) => {
      rows.push(
        el(
          "tr",
          { class: index === 0 ? "first" : undefined },
          index === 0
            ? el("th", { scope: "rowgroup", rowspan: matrix.rulesets.length }, model.label)
            : null,
          el("th", { scope: "row" }, ruleset),
          matrix.gpus.map((gpu) => {
            const cell = byKey.get(`${model.label}\u0000${ruleset}\u0000${gpu}`);
            return el("td", {}, cell ? cellButton(cell, colours, onPick) : "");
          }),
        ),
      );
    });
  }
  replace(
    target,
    el(
      "table",
      { class: "matrix", id: "matrix-table" },
      el("caption", {}, `${matrix.models.length} configs × ${matrix.gpus.length} GPUs × ${matrix.rulesets.length} releases`),
      el("thead", {}, head),
      el("tbody", {}, rows),
    ),
  );
  renderLegend(legend, matrix, colours);
}

function renderLegend(legend, matrix, colours) {
  const seen = new Map();
  for (const cell of matrix.cells) {
    const text = cellText(cell);
    if (!seen.has(text)) seen.set(text, cellClass(cell, colours));
  }
  const hazards = new Map();
  for (const cell of matrix.cells) for (const h of cell.hazards) hazards.set(h.code, h.message);
  replace(
    legend,
    el(
      "ul",
      {},
      [...seen].map(([text, cls]) => el("li", {}, el("span", { class: `swatch ${cls}` }, text))),
      [...hazards].map(([code, message]) =>
        el("li", { class: "hazard-note" }, el("span", { class: "hazard-mark" }, HAZARD_SIGN), ` ${code}: ${message}`),
      ),
    ),
  );
}
