// The model picker: every model the server knows (/v1/info: local and upstream, with
// the load state and the default), and a load with its progress bar when the
// picked model is a local one not loaded yet (POST /api/v1/models/load, streamed; only
// for an admin key or a server without keys: a user key's first message loads it).
// A model without a chat template (a base model) is marked so: it cannot chat.

import { errorOf, events } from "/ui/api.js";

const KEY = "sluice.model";
const STATES = {
  loaded: "loaded",
  loading: "loading…",
  not_loaded: "not loaded",
  unloading: "unloading…",
  healthy: "upstream",
  degraded: "upstream, degraded",
  down: "upstream, down",
  unknown: "upstream",
};

export class ModelPicker {
  constructor(api, { select, box, bar, label }, showError) {
    this.api = api;
    this.select = select;
    this.box = box;
    this.bar = bar;
    this.label = label;
    this.showError = showError;
    this.models = new Map();
    this.onChange = () => {}; // the pick or its model's state changed
    select.addEventListener("change", () => this.picked());
  }

  /** The picked model's id ("" until the list came). */
  get value() {
    return this.select.value;
  }

  get current() {
    return this.models.get(this.select.value);
  }

  /** Whether the picked model cannot chat: the server says it has no chat template. */
  get cannotChat() {
    return this.current?.capabilities?.chat === false;
  }

  async refresh() {
    const info = await this.api.json("/v1/info");
    // A user key may not load models: its first message loads the picked one instead.
    this.canManage = info.caller?.role !== "user";
    const wanted = this.select.value || localStorage.getItem(KEY) || info.default_model;
    this.models = new Map(info.models.map((m) => [m.id, m]));
    this.select.replaceChildren(
      ...info.models.map((m) => {
        const words = [STATES[m.status] ?? m.status];
        if (m.capabilities?.chat === false) words.push("no chat template");
        if (m.id === info.default_model) words.push("default");
        const option = new Option(`${m.id} (${words.join(", ")})`, m.id);
        option.dataset.status = m.status;
        return option;
      }),
    );
    this.select.value = this.models.has(wanted) ? wanted : info.default_model;
    this.onChange();
  }

  async picked() {
    localStorage.setItem(KEY, this.select.value);
    this.onChange();
    const model = this.current;
    if (model?.backend?.type === "local" && model.status === "not_loaded" && !this.canManage) {
      this.showNote(`${model.id} loads with your first message.`);
    } else if (model?.backend?.type === "local" && model.status === "not_loaded") {
      try {
        await this.load(model.id);
      } catch (error) {
        this.showError(`Loading ${model.id} failed: ${error.message}`);
      }
      await this.refresh().catch((error) => this.showError(error.message));
    }
  }

  /** A passing word in the progress box (no bar). */
  showNote(text) {
    clearTimeout(this.hiding);
    this.box.hidden = false;
    this.bar.hidden = true;
    this.label.textContent = text;
    this.hiding = setTimeout(() => {
      this.box.hidden = true;
      this.bar.hidden = false;
    }, 4000);
  }

  async load(id) {
    clearTimeout(this.hiding);
    this.box.hidden = false;
    this.bar.hidden = false;
    this.bar.value = 0;
    this.label.textContent = `Loading ${id}…`;
    this.select.disabled = true;
    try {
      const response = await this.api.request("/api/v1/models/load", {
        method: "POST",
        body: { model: id },
        accept: "text/event-stream",
      });
      if (!response.ok) throw await errorOf(response);
      for await (const { event, data } of events(response)) {
        const frame = JSON.parse(data);
        if (event === "model_load.progress") {
          this.bar.value = frame.progress;
          this.label.textContent = `Loading ${id}: ${Math.round(frame.progress * 100)}%`;
        } else if (event === "model_load.end") {
          this.label.textContent = `Loaded ${id} in ${frame.load_time_seconds.toFixed(1)} s`;
        } else if (event === "error") {
          throw new Error(frame.error?.message ?? data);
        }
      }
    } finally {
      this.select.disabled = false;
      this.hiding = setTimeout(() => {
        this.box.hidden = true;
      }, 2000);
    }
  }
}
