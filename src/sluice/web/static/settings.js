// The settings sent with every turn: a system prompt (only where a conversation
// starts: /c1/chat refuses `system` elsewhere) and sampling (temperature,
// max_tokens, top_p; unset: the server's default). Kept in localStorage, edited in
// the Settings dialog, which checks the numbers before it saves them; a change saved
// in another tab of the page comes as a `storage` event and is shown here too.

const KEY = "sluice.settings";

/** The number fields: the input's id, the body's field, what a valid value is. */
const NUMBERS = [
  {
    id: "temperature",
    field: "temperature",
    label: "temperature",
    valid: (v) => v >= 0 && v <= 2,
    rule: "Temperature is a number from 0 to 2.",
  },
  {
    id: "max-tokens",
    field: "max_tokens",
    label: "max tokens",
    valid: (v) => Number.isInteger(v) && v >= 1,
    rule: "Max tokens is a whole number, 1 or more.",
  },
  {
    id: "top-p",
    field: "top_p",
    label: "top P",
    valid: (v) => v > 0 && v <= 1,
    rule: "Top P is a number above 0, up to 1.",
  },
];

function stored() {
  try {
    const value = JSON.parse(localStorage.getItem(KEY) ?? "{}");
    return value && typeof value === "object" ? value : {};
  } catch {
    return {};
  }
}

export class Settings {
  /** `button` opens `dialog`, the Settings form (index.html). */
  constructor(button, dialog) {
    this.button = button;
    this.dialog = dialog;
    this.onChange = () => {}; // after a save, here or in another tab
    const $ = (id) => dialog.querySelector(`#${id}`);
    this.form = $("settings-form");
    this.system = $("system-prompt");
    this.numbers = NUMBERS.map((n) => ({ ...n, input: $(n.id), error: $(`${n.id}-error`) }));
    button.addEventListener("click", () => this.open());
    $("settings-cancel").addEventListener("click", () => dialog.close());
    $("settings-reset").addEventListener("click", () => {
      this.system.value = "";
      for (const n of this.numbers) n.input.value = "";
      this.clearErrors();
    });
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.save();
    });
    // Saved in another tab (null: localStorage cleared there).
    window.addEventListener("storage", (event) => {
      if (event.key !== KEY && event.key !== null) return;
      this.showSummary();
      this.onChange();
    });
    this.showSummary();
  }

  /** The system prompt for a conversation's start ("" for none). */
  get systemPrompt() {
    const value = stored().system;
    return typeof value === "string" ? value.trim() : "";
  }

  /** The sampling fields to add to a turn's body (only those set). */
  sampling() {
    const values = stored();
    const out = {};
    for (const { field } of NUMBERS) {
      if (typeof values[field] === "number") out[field] = values[field];
    }
    return out;
  }

  open() {
    const values = stored();
    this.system.value = typeof values.system === "string" ? values.system : "";
    for (const n of this.numbers) n.input.value = values[n.field] ?? "";
    this.clearErrors();
    this.dialog.showModal();
    this.system.focus();
  }

  clearErrors() {
    for (const n of this.numbers) {
      n.input.removeAttribute("aria-invalid");
      n.error.hidden = true;
    }
  }

  /** Saves the form if every number is valid; else says what is wrong, where. */
  save() {
    const values = {};
    if (this.system.value.trim()) values.system = this.system.value;
    let firstBad;
    for (const n of this.numbers) {
      const text = n.input.value.trim();
      // A number input answers "" for text that is not a number: badInput says so.
      const value = text === "" ? undefined : Number(text);
      const bad = n.input.validity.badInput || (value !== undefined && !n.valid(value));
      if (bad) n.input.setAttribute("aria-invalid", "true");
      else n.input.removeAttribute("aria-invalid");
      n.error.textContent = bad ? n.rule : "";
      n.error.hidden = !bad;
      if (bad) firstBad ??= n.input;
      else if (value !== undefined) values[n.field] = value;
    }
    if (firstBad) {
      firstBad.focus();
      return;
    }
    localStorage.setItem(KEY, JSON.stringify(values));
    this.showSummary();
    this.onChange();
    this.dialog.close();
  }

  /** What is set, a phrase each ("temperature 0.3"), the system prompt first as
   * `system(prompt)` words it; [] when nothing is. */
  describe(system = () => "a system prompt") {
    const values = stored();
    const parts = this.systemPrompt ? [system(this.systemPrompt)] : [];
    for (const { field, label } of NUMBERS) {
      if (typeof values[field] === "number") parts.push(`${label} ${values[field]}`);
    }
    return parts;
  }

  /** What is set, as the button's tooltip (and a mark on it). */
  showSummary() {
    const parts = this.describe();
    this.button.classList.toggle("active", parts.length > 0);
    // The system prompt goes where a conversation starts; the sampling with every turn.
    this.button.title = parts.length ? `Settings in use: ${parts.join(", ")}` : "";
  }
}
