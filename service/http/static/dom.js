// Building DOM nodes from data: text always goes in as text (never as HTML), so nothing a
// config or an answer holds can inject markup.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function replace(node, ...children) {
  node.replaceChildren();
  append(node, children);
}

/** A definition list from [term, description] pairs (descriptions left out when empty). */
export function facts(pairs) {
  return el(
    "dl",
    { class: "facts" },
    pairs
      .filter(([, value]) => value !== undefined && value !== null && value !== "")
      .map(([term, value]) => [el("dt", {}, term), el("dd", {}, value)]),
  );
}
