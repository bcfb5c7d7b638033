// The what-if page's wiring: the GPUs and releases from the server, the configs the user
// adds, the matrix, a cell's details and the diff between two releases.

import { api, ApiError, setToken, token } from "./api.js";
import { Configs, nameFor, parseConfig } from "./configs.js";
import { renderDetails } from "./details.js";
import { renderDiff, renderDiffError, renderDiffUnavailable } from "./diff.js";
import { el, replace } from "./dom.js";
import { backendColours, renderMatrix } from "./matrix.js";

// GPUs ticked at first, where the server has them (any others: the first few).
const FIRST_GPUS = ["a100", "h100", "h200", "l40s", "mi300x", "b200"];

const $ = (id) => document.getElementById(id);
const state = { colours: new Map(), examples: [], lastConfigs: new Map() };

function notice(message) {
  const box = $("notice");
  box.textContent = message;
  box.hidden = !message;
}

/** Says what went wrong; a 401 asks for the token and puts the cursor there. */
function report(error) {
  if (error instanceof ApiError && error.status === 401) {
    notice("This server needs its token: type it in \u201cServer token\u201d above and press Use token.");
    $("token").focus();
    return;
  }
  notice(error.message);
}

function checkboxes(fieldset, names, checked, describe) {
  const box = el("div", { class: "choices" });
  for (const name of names) {
    const id = `${fieldset.id}-${name}`;
    box.append(
      el(
        "label",
        { for: id },
        el("input", { type: "checkbox", id, value: name, checked: checked.includes(name) }),
        ` ${name}`,
        describe(name) ? el("span", { class: "hint" }, ` ${describe(name)}`) : null,
      ),
    );
  }
  fieldset.querySelector(".choices")?.remove();
  fieldset.append(box);
}

function ticked(fieldset) {
  return [...fieldset.querySelectorAll("input:checked")].map((input) => input.value);
}

function options(select, names, selected) {
  replace(select, names.map((name) => el("option", { value: name, selected: name === selected }, name)));
}

async function loadTargets() {
  const [platforms, rulesets] = await Promise.all([api.platforms(), api.rulesets()]);
  const byName = new Map(platforms.map((p) => [p.name, p.profile]));
  const gpuNames = platforms.map((p) => p.name);
  const first = FIRST_GPUS.filter((name) => byName.has(name));
  checkboxes($("gpus"), gpuNames, first.length ? first : gpuNames.slice(0, 4), (name) => {
    const p = byName.get(name);
    return p.capability ? `${p.device} ${p.capability}` : p.device;
  });
  const names = rulesets.map((r) => r.name);
  const fallback = rulesets.find((r) => r.default)?.name || names[names.length - 1];
  checkboxes($("rulesets"), names, names, (name) => (name === fallback ? "(default)" : ""));
  options($("diff-gpu"), gpuNames, first[0] || gpuNames[0]);
  options($("diff-from"), names, names[Math.max(0, names.length - 2)]);
  options($("diff-to"), names, names[names.length - 1]);
  state.colours = backendColours(rulesets);
}

async function loadExamples() {
  state.examples = await api.examples();
  options($("example"), state.examples.map((e) => e.name), state.examples[0]?.name);
}

async function start() {
  notice("");
  try {
    await Promise.all([loadTargets(), loadExamples()]);
    $("token-state").textContent = token() ? "token in use" : "";
  } catch (error) {
    report(error);
  }
}

function refreshModels() {
  const names = configs.items.map((item) => item.name);
  options($("diff-model"), names, $("diff-model").value || names[0]);
}

const configs = new Configs($("configs"), $("configs-empty"), refreshModels);

async function showCell(cell, button) {
  for (const picked of document.querySelectorAll("button.cell[aria-current]")) {
    picked.removeAttribute("aria-current");
  }
  button?.setAttribute("aria-current", "true");
  const target = $("details");
  replace(target, el("p", { class: "hint" }, `Asking about ${cell.model} on ${cell.gpu}, ${cell.ruleset}…`));
  const config = state.lastConfigs.get(cell.model);
  let outcome;
  try {
    outcome = await api.select({ config, platform: cell.gpu, ruleset: cell.ruleset });
  } catch (error) {
    if (!(error instanceof ApiError) || error.status === 401 || error.status >= 500) {
      report(error);
      return;
    }
    outcome = error;
  }
  renderDetails(target, cell, outcome, compareCell);
  $("details-title").focus();
}

function compareCell(cell) {
  $("diff-model").value = cell.model;
  $("diff-gpu").value = cell.gpu;
  $("diff-title").focus();
  $("diff-form").requestSubmit();
}

async function runMatrix() {
  notice("");
  const gpus = ticked($("gpus"));
  const rulesets = ticked($("rulesets"));
  const missing = [
    configs.items.length ? "" : "a config",
    gpus.length ? "" : "a GPU",
    rulesets.length ? "" : "a release",
  ].filter(Boolean);
  if (missing.length) {
    notice(`Pick ${missing.join(", ")} first.`);
    return;
  }
  const target = $("matrix");
  replace(target, el("p", { class: "hint" }, "Deciding…"));
  try {
    const matrix = await api.matrix({
      configs: configs.items.map((item) => ({ name: item.name, config: item.config })),
      gpus,
      rulesets,
    });
    state.lastConfigs = new Map(configs.items.map((item) => [item.name, item.config]));
    renderMatrix(target, $("legend"), matrix, state.colours, showCell);
  } catch (error) {
    replace(target);
    report(error);
  }
}

async function runDiff(event) {
  event.preventDefault();
  const target = $("diff");
  const item = configs.find($("diff-model").value);
  if (!item) {
    replace(target, el("p", { class: "notice" }, "Add a config first."));
    return;
  }
  const request = {
    from: $("diff-from").value,
    to: $("diff-to").value,
    deployment: { config: item.config, platform: $("diff-gpu").value },
  };
  replace(target, el("p", { class: "hint" }, "Comparing…"));
  try {
    renderDiff(target, await api.diff(request));
  } catch (error) {
    if (error instanceof ApiError && error.noRoute) renderDiffUnavailable(target);
    else if (error instanceof ApiError && error.status === 401) report(error);
    else renderDiffError(target, error);
  }
}

function addText(text, label, name, fileName) {
  const config = parseConfig(text, label);
  return configs.add(name || nameFor(config, fileName), config);
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setToken($("token").value.trim());
  $("token").value = "";
  start();
});
$("token-clear").addEventListener("click", () => {
  setToken("");
  $("token-state").textContent = "no token";
});
$("example-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const example = state.examples.find((e) => e.name === $("example").value);
  if (!example) return;
  try {
    configs.add(example.name, await api.example(example.path));
  } catch (error) {
    report(error);
  }
});
$("upload").addEventListener("change", async (event) => {
  notice("");
  for (const file of event.target.files) {
    try {
      addText(await file.text(), file.name, "", file.name);
    } catch (error) {
      notice(error.message);
    }
  }
  event.target.value = "";
});
$("paste-form").addEventListener("submit", (event) => {
  event.preventDefault();
  notice("");
  try {
    addText($("paste").value, "the pasted text", $("paste-name").value.trim());
    $("paste").value = "";
    $("paste-name").value = "";
  } catch (error) {
    notice(error.message);
  }
});
for (const button of document.querySelectorAll("[data-toggle]")) {
  button.addEventListener("click", () => {
    const boxes = [...$(button.dataset.toggle).querySelectorAll("input[type=checkbox]")];
    const all = boxes.every((box) => box.checked);
    for (const box of boxes) box.checked = !all;
  });
}
$("run").addEventListener("click", runMatrix);
$("diff-form").addEventListener("submit", runDiff);
configs.render();
start();
