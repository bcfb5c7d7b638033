// A cell's whole answer (POST /v1/select, what would change included): what vLLM picks
// or why it fails, each backend's verdict with vLLM's reason and our explanation, the
// hazards, and the changes that would make another backend win.

import { el, facts, replace } from "./dom.js";
import { HAZARD_SIGN } from "./matrix.js";

function verdict(value) {
  return String(value || "").replace(/^VERDICT_/, "").toLowerCase().replace(/_/g, " ");
}

function candidatesTable(candidates) {
  return el(
    "table",
    { class: "candidates" },
    el("caption", {}, "Every backend, in vLLM's priority order"),
    el(
      "thead",
      {},
      el(
        "tr",
        {},
        ["Backend", "Verdict", "vLLM's reason", "Our explanation"].map((h) =>
          el("th", { scope: "col" }, h),
        ),
      ),
    ),
    el(
      "tbody",
      {},
      candidates.map((c) =>
        el(
          "tr",
          { class: `verdict-${verdict(c.verdict).replace(/ /g, "-")}` },
          el("th", { scope: "row" }, c.backend),
          el("td", {}, verdict(c.verdict)),
          el("td", {}, c.reason ? [c.reason, c.reason_code ? el("code", {}, ` ${c.reason_code}`) : null] : "—"),
          el("td", {}, c.explanation || "—"),
        ),
      ),
    ),
  );
}

function changesList(hints) {
  if (!hints || hints.length === 0) {
    return el("p", { class: "hint" }, "No change of at most two settings makes another backend win.");
  }
  return el(
    "ul",
    { class: "changes" },
    hints.map((hint) =>
      el(
        "li",
        {},
        el("strong", {}, hint.backend),
        hint.outcome === "selected" ? " would be picked with: " : " would pass its checks (forced) with: ",
        (hint.changes || []).map((change, index) => [
          index > 0 ? " and " : "",
          el("code", {}, change.text || `${change.field} = ${change.value}`),
        ]),
      ),
    ),
  );
}

function hazardsList(hazards) {
  if (!hazards || hazards.length === 0) return null;
  return el(
    "ul",
    { class: "hazards" },
    hazards.map((h) =>
      el("li", {}, el("span", { class: "hazard-mark" }, `${HAZARD_SIGN} hazard`), ` ${h.code}: ${h.message}`),
    ),
  );
}

function chosen(answer) {
  const key = answer.weight_key || {};
  return [
    el(
      "p",
      { class: "outcome", id: "details-outcome" },
      "vLLM picks ",
      el("strong", { id: "details-backend" }, answer.backend || "no WNA16 backend (unquantized)"),
      answer.experts_class ? ` (${answer.experts_class})` : "",
    ),
    answer.explanation ? el("p", { class: "explanation" }, answer.explanation) : null,
    hazardsList(answer.hazards),
    facts([
      ["Quantization", answer.quantization],
      ["MoE method", answer.moe_method],
      ["Weights", key.dtype ? `${key.dtype}, scales ${key.scale_dtype}` : ""],
      ["Platform", answer.platform ? platformText(answer.platform) : ""],
    ]),
    el("h4", {}, "Every backend's verdict"),
    candidatesTable(answer.candidates || []),
    el("h4", {}, "What would change the decision"),
    changesList(answer.what_would_change),
  ];
}

function failed(error) {
  const failure = error.detail("moe_control.v1.SelectionFailure");
  const invalid = error.detail("google.rpc.BadRequest");
  if (failure) {
    return [
      el(
        "p",
        { class: "outcome fails", id: "details-outcome" },
        el("strong", { id: "details-backend" }, "vLLM FAILS this deployment"),
        ` at the ${failure.stage} stage: ${failure.type}: ${failure.message}`,
      ),
      el("h4", {}, "Every backend's verdict"),
      candidatesTable(failure.candidates || []),
      el("h4", {}, "What would change the decision"),
      changesList((failure.what_would_change || {}).hints),
    ];
  }
  if (invalid) {
    return [
      el("p", { class: "outcome fails", id: "details-outcome" }, el("strong", { id: "details-backend" }, "Invalid"), ": this config cannot be decided"),
      el(
        "ul",
        {},
        invalid.field_violations.map((v) => el("li", {}, el("code", {}, v.field), `: ${v.description}`)),
      ),
    ];
  }
  return [el("p", { class: "outcome fails", id: "details-outcome" }, `${error.code || error.status}: ${error.message}`)];
}

export function platformText(platform) {
  const where = platform.capability ? `${platform.device} ${platform.capability}` : platform.device;
  const packages = (platform.packages || []).join(", ") || "no extra packages";
  return `${platform.name || platform.preset || ""} (${where}${platform.arch ? `, ${platform.arch}` : ""}; ${packages})`;
}

/** Renders a cell's answer (or the ApiError deciding it raised) into `target`. */
export function renderDetails(target, cell, outcome, onCompare) {
  const body = outcome instanceof Error ? failed(outcome) : chosen(outcome);
  replace(
    target,
    el("h3", {}, `${cell.model} on ${cell.gpu}, ${cell.ruleset}`),
    body,
    el(
      "p",
      {},
      el("button", { type: "button", id: "compare", onclick: () => onCompare(cell) }, "Compare this across releases"),
    ),
  );
}
