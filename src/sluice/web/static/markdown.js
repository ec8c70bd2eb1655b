// Markdown to safe HTML. A model's output is untrusted: raw HTML in it is shown
// as text (not parsed), images become links (no request leaves for another
// origin), and DOMPurify cleans what marked made before it reaches the page.

import { Marked } from "/ui/vendor/marked-18.2.1.esm.js";

const DOMPurify = globalThis.DOMPurify; // vendor/purify-*.min.js, a classic script

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escape = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    html({ text }) {
      return escape(text);
    },
    image({ href, text }) {
      return `<a href="${escape(href)}">${escape(text || href)}</a>`;
    },
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

const PURIFY = {
  FORBID_TAGS: ["style", "img", "svg", "math", "form", "input", "button", "textarea", "select"],
  FORBID_ATTR: ["style", "class", "id"],
};

/** Sanitised HTML for `text` (markdown). */
export function toHtml(text) {
  return DOMPurify.sanitize(marked.parse(text), PURIFY);
}
