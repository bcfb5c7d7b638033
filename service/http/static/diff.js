// One deployment under two releases (POST /v1/diff): whether the decision changed, what
// each release picks, and each difference with its cause. A server without the route says
// so instead of failing.

import { el, replace } from "./dom.js";

function shown(value) {
  if (value === undefined || value === null || value === "") return "—";
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

function picked(answer) {
  if (!answer) return "—";
  if (answer.error) return `FAILS (${answer.error.type || "error"})`;
  return answer.backend || "unquantized";
}

function differenceTable(answer, id, caption, differences) {
  return el(
    "table",
    { class: "differences", id },
    el("caption", {}, caption),
    el(
      "thead",
      {},
      el("tr", {}, ["Field", answer.from, answer.to, "Cause"].map((h) => el("th", { scope: "col" }, h))),
    ),
    el(
      "tbody",
      {},
      differences.map((d) =>
        el(
          "tr",
          {},
          el("th", { scope: "row" }, el("code", {}, d.field)),
          el("td", {}, shown(d.before)),
          el("td", {}, shown(d.after)),
          el("td", {}, shown(d.cause)),
        ),
      ),
    ),
  );
}

/** Renders POST /v1/diff's answer into `target`: the differences of the gated fields
 * (`fail_on`: what changes what runs), then, apart, the others (a verdict, an error's
 * wording), which do not make the answer "Changed". */
export function renderDiff(target, answer) {
  const differences = answer.differences || [];
  const others = answer.other_differences || [];
  const gated = (answer.fail_on || []).join(", ");
  replace(
    target,
    el(
      "p",
      { class: `outcome ${answer.changed ? "changed" : "same"}`, id: "diff-outcome" },
      el("strong", {}, answer.changed ? "Changed" : "Unchanged"),
      ` from ${answer.from} to ${answer.to}: `,
      el("span", { id: "diff-before" }, picked(answer.before)),
      " → ",
      el("span", { id: "diff-after" }, picked(answer.after)),
    ),
    differences.length === 0 && others.length === 0
      ? el("p", { class: "hint" }, "No field of the answer differs.")
      : [
          differences.length === 0
            ? el("p", { class: "hint" }, `None of ${gated} differs.`)
            : differenceTable(answer, "diff-table", `${differences.length} differences (${gated})`, differences),
          others.length === 0
            ? []
            : differenceTable(answer, "diff-other-table", `${others.length} other differences (not gated)`, others),
        ],
  );
}

export function renderDiffUnavailable(target) {
  replace(
    target,
    el(
      "p",
      { class: "notice", id: "diff-outcome", role: "status" },
      "Diff unavailable: this server has no POST /v1/diff route (it predates the diff view). ",
      "Compare two releases in the matrix instead: tick both and read the two rows.",
    ),
  );
}

export function renderDiffError(target, error) {
  replace(target, el("p", { class: "notice", id: "diff-outcome", role: "alert" }, error.message));
}
