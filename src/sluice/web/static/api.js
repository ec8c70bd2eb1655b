// The server's API as the page uses it: JSON requests, SSE streams, the API key.
//
// A 401 asks for the key once (askKey), keeps it in localStorage and retries;
// several requests refused at once share one question. The key is read from
// localStorage at each request, so one forgotten (or given) in another tab of the
// page holds here at the next; onKeyChange hears of it (the `storage` event).
// Errors come back as ApiError with the server's own message ({"error":
// {"message": ...}}, also when it arrives as an SSE error frame).

const KEY = "sluice.apiKey";

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

export class Api {
  /** askKey(refused: boolean) -> Promise<string>: the key to try (rejects to give up). */
  constructor(askKey) {
    this.askKey = askKey;
    this.asking = null;
    this.onKeyChange = () => {};
    window.addEventListener("storage", (event) => {
      if (event.key === KEY || event.key === null) this.onKeyChange(Boolean(this.key));
    });
  }

  get key() {
    return localStorage.getItem(KEY);
  }

  set key(value) {
    if (value) localStorage.setItem(KEY, value);
    else localStorage.removeItem(KEY);
    this.onKeyChange(Boolean(value));
  }

  /** fetch() with the key; on a 401 asks for one and tries again. Resolves to the
   * Response whatever its status (but 401). */
  async request(path, { method = "GET", body, accept = "application/json", signal } = {}) {
    let refused = false;
    for (;;) {
      const headers = { Accept: accept };
      if (body !== undefined) headers["Content-Type"] = "application/json";
      const key = this.key;
      if (key) headers.Authorization = `Bearer ${key}`;
      const init = { method, headers, signal, cache: "no-store" };
      if (body !== undefined) init.body = JSON.stringify(body);
      const response = await fetch(path, init);
      if (response.status !== 401) return response;
      await response.body?.cancel();
      this.asking ??= this.askKey(refused || Boolean(key)).finally(() => {
        this.asking = null;
      });
      this.key = await this.asking;
      refused = true;
    }
  }

  /** The JSON answer; an ApiError with the server's message when it is an error. */
  async json(path, options) {
    const response = await this.request(path, options);
    if (!response.ok) throw await errorOf(response);
    return response.json();
  }
}

/** The ApiError a failed response carries (JSON body, SSE error frame, or text). */
export async function errorOf(response) {
  const text = await response.text();
  return new ApiError(errorMessage(text) || `${response.status} ${response.statusText}`, response.status);
}

export function errorMessage(text) {
  const data = text.match(/^data: (.*)$/m)?.[1] ?? text;
  try {
    const error = JSON.parse(data).error;
    if (typeof error === "string") return error;
    if (error?.message) return error.message;
  } catch {
    // not JSON: the text itself
  }
  return text.trim().slice(0, 500);
}

/** The events of an SSE response: {event, data} (data as text), in order. */
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const parsed = parseFrame(frame);
        if (parsed) yield parsed;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function parseFrame(frame) {
  let event = "message";
  const data = [];
  for (const line of frame.split("\n")) {
    if (line.startsWith(":")) continue; // a comment (keep-alive ping)
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  return data.length ? { event, data: data.join("\n") } : null;
}
