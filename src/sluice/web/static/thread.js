// The messages of a conversation as DOM: stored ones, and the answer streaming in.

import { toHtml } from "/ui/markdown.js";

const STATUS_WORDS = { incomplete: "stopped", failed: "failed" };

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** The text of a message's content: a string or OpenAI content parts (its images
 * are not text: contentImages has them). */
export function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .filter((part) => part.type !== "image_url")
      .map((part) => (part.type === "text" ? part.text : `[${part.type}]`))
      .join("\n");
  }
  return "";
}

/** The image URLs (data: URIs) of a message's content parts. */
export function contentImages(content) {
  if (!Array.isArray(content)) return [];
  return content
    .filter((part) => part.type === "image_url")
    .map((part) => part.image_url?.url ?? part.image_url)
    .filter((url) => typeof url === "string");
}

/** A message's images as thumbnails (only data: URIs: nothing is fetched). */
function imagesView(urls) {
  const box = el("div", "images");
  urls.forEach((url, i) => {
    if (!url.startsWith("data:image/")) return;
    const img = el("img");
    img.src = url;
    img.alt = `Image ${i + 1}`;
    box.append(img);
  });
  return box;
}

export function formatMetrics({ tokens, rate, ttft }) {
  const parts = [];
  if (tokens !== undefined) parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  if (rate !== undefined) parts.push(`${rate.toFixed(1)} tok/s`);
  if (ttft !== undefined) parts.push(`first token ${Math.round(ttft)} ms`);
  return parts.join(" · ");
}

function toolCallView(call) {
  const box = el("div", "tool-call");
  box.append(el("div", "tool-name", `Tool call: ${call.function?.name ?? ""}`));
  box.append(el("pre", "tool-args", call.function?.arguments ?? ""));
  return box;
}

/** A system prompt: one folded line ("System prompt" and its start), opened to read. */
export function systemView(message) {
  const text = contentText(message.content);
  const box = el("details", "system-prompt");
  box.dataset.id = message.id ?? "";
  const summary = el("summary");
  summary.append(el("span", "role", "System prompt"), el("span", "preview", text));
  box.append(summary, el("div", "content plain", text));
  return box;
}

/** One message's <article> (a system prompt's folded line). `options`: {metrics,
 * branches: {index, count, onSwitch}, onEdit}. */
export function messageView(message, options = {}) {
  const role = message.role;
  if (role === "system") return systemView(message);
  const article = el("article", `msg ${role}`);
  article.dataset.id = message.id ?? "";
  const head = el("div", "msg-head");
  const who = { user: "You", assistant: "Assistant", tool: "Tool result" };
  head.append(el("span", "role", who[role] ?? role));
  if (role === "tool" && message.name) head.append(el("span", "muted", message.name));
  if (role === "assistant" && message.model) head.append(el("span", "muted", message.model));
  if (options.branches && options.branches.count > 1) head.append(branchNav(options.branches));
  article.append(head);

  if (message.reasoning_content) {
    const details = el("details", "reasoning");
    details.append(el("summary", "", "Reasoning"), el("div", "reasoning-text", message.reasoning_content));
    article.append(details);
  }
  const text = contentText(message.content);
  const images = contentImages(message.content);
  if (role === "assistant") {
    const body = el("div", "content markdown");
    body.innerHTML = toHtml(text);
    addCopyButtons(body);
    article.append(body);
  } else if (role === "tool") {
    article.append(el("pre", "content tool-output", text));
  } else if (text || !images.length) {
    article.append(el("div", "content plain", text));
  }
  if (images.length) article.append(imagesView(images));
  for (const call of message.tool_calls ?? []) article.append(toolCallView(call));

  const foot = el("div", "msg-foot");
  const status = STATUS_WORDS[message.status];
  if (status) foot.append(el("span", `status ${message.status}`, status));
  if (message.error) foot.append(el("span", "status failed", errorText(message.error)));
  // Measured here (this page sent it), else what the server stored.
  const measured = options.metrics ?? {};
  const tokens = measured.tokens ?? message.usage?.completion_tokens;
  if (tokens !== undefined || measured.ttft !== undefined) {
    foot.append(el("span", "metrics", formatMetrics({ ...measured, tokens })));
  }
  if (role === "user" && options.onEdit) {
    const edit = el("button", "link", "Edit");
    edit.type = "button";
    edit.title = "Edit this message and answer again: a new branch from here";
    edit.addEventListener("click", () => options.onEdit(message));
    foot.append(edit);
  }
  if (foot.childElementCount) article.append(foot);
  return article;
}

/** A Copy button on each code block (where the page may use the clipboard: not on
 * plain http to another host than localhost). */
function addCopyButtons(container) {
  if (!navigator.clipboard) return;
  for (const pre of container.querySelectorAll("pre")) {
    const button = el("button", "copy", "Copy");
    button.type = "button";
    button.setAttribute("aria-label", "Copy the code");
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(pre.textContent);
        button.textContent = "Copied";
      } catch (error) {
        button.textContent = "Not copied";
        button.title = error.message;
      }
      setTimeout(() => {
        button.textContent = "Copy";
      }, 1500);
    });
    const box = el("div", "code");
    pre.replaceWith(box);
    box.append(pre, button);
  }
}

function errorText(error) {
  return typeof error === "string" ? error : (error?.message ?? JSON.stringify(error));
}

function branchNav({ index, count, onSwitch }) {
  const nav = el("span", "branches");
  const prev = el("button", "link", "‹");
  prev.type = "button";
  prev.setAttribute("aria-label", "Previous branch");
  prev.disabled = index === 0;
  prev.addEventListener("click", () => onSwitch(index - 1));
  const next = el("button", "link", "›");
  next.type = "button";
  next.setAttribute("aria-label", "Next branch");
  next.disabled = index === count - 1;
  next.addEventListener("click", () => onSwitch(index + 1));
  nav.append(prev, el("span", "muted", `${index + 1}/${count}`), next);
  return nav;
}

/** The answer as it streams: text rendered as markdown (once per frame), reasoning
 * folded, tool calls as their arguments arrive. */
export class StreamingAnswer {
  constructor(model) {
    this.article = messageView({ role: "assistant", content: "", model });
    this.article.setAttribute("aria-busy", "true");
    this.body = this.article.querySelector(".content");
    this.text = "";
    this.reasoning = "";
    this.calls = [];
    this.pending = false;
  }

  addText(text) {
    this.text += text;
    this.schedule();
  }

  addReasoning(text) {
    if (!this.reasoningText) {
      const details = el("details", "reasoning");
      const summary = el("summary", "", "Reasoning…");
      this.reasoningText = el("div", "reasoning-text");
      details.append(summary, this.reasoningText);
      this.body.before(details);
      this.reasoningSummary = summary;
    }
    this.reasoning += text;
    this.schedule();
  }

  /** An OpenAI tool_calls delta entry: {index, id?, function: {name?, arguments}}. */
  addToolCall(delta) {
    let call = this.calls[delta.index ?? 0];
    if (!call) {
      call = { name: "", arguments: "" };
      call.view = toolCallView({ function: {} });
      this.calls[delta.index ?? 0] = call;
      this.article.append(call.view);
    }
    call.name += delta.function?.name ?? "";
    call.arguments += delta.function?.arguments ?? "";
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => this.render());
  }

  render() {
    this.pending = false;
    this.body.innerHTML = toHtml(this.text);
    if (this.reasoningText) this.reasoningText.textContent = this.reasoning;
    for (const call of this.calls) {
      if (!call) continue;
      call.view.querySelector(".tool-name").textContent = `Tool call: ${call.name}`;
      call.view.querySelector(".tool-args").textContent = call.arguments;
    }
  }

  /** The end: `status` ("complete", "incomplete", "failed"), figures, an error. */
  finish(status, metrics, error) {
    this.render();
    addCopyButtons(this.body);
    this.article.removeAttribute("aria-busy");
    if (this.reasoningSummary) this.reasoningSummary.textContent = "Reasoning";
    const foot = el("div", "msg-foot");
    if (STATUS_WORDS[status]) foot.append(el("span", `status ${status}`, STATUS_WORDS[status]));
    if (error) foot.append(el("span", "status failed", error));
    if (metrics) foot.append(el("span", "metrics", formatMetrics(metrics)));
    if (foot.childElementCount) this.article.append(foot);
  }
}
