// The page's calls to the HTTP/JSON API on this same origin (so TLS is whatever the server
// serves). With a token configured on the server, every call carries
// `Authorization: Bearer <token>`: the token the user typed, kept in this tab's
// sessionStorage (gone when the tab closes, never sent anywhere but here).

const TOKEN_KEY = "moe-control.token";

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.status || "";
    this.details = error.details || [];
  }

  /** True when the server has no such route at all (not a domain NOT_FOUND). */
  get noRoute() {
    return this.status === 404 && this.details.some((d) => d.resource_type === "route");
  }

  detail(typeSuffix) {
    return this.details.find((d) => (d["@type"] || "").endsWith(typeSuffix));
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

async function call(method, path, body) {
  const headers = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const bearer = token();
  if (bearer) headers.Authorization = `Bearer ${bearer}`;
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "same-origin",
    cache: "no-store",
  });
  let parsed = null;
  try {
    parsed = await response.json();
  } catch {
    parsed = null;
  }
  if (!response.ok) throw new ApiError(response.status, parsed);
  return parsed;
}

export const api = {
  platforms: () => call("GET", "/v1/platforms"),
  rulesets: () => call("GET", "/v1/rulesets"),
  examples: () => call("GET", "/page/examples.json"),
  example: (path) => call("GET", path),
  select: (deployment) => call("POST", "/v1/select", deployment),
  matrix: (request) => call("POST", "/v1/select:matrix", request),
  diff: (request) => call("POST", "/v1/diff", request),
};
