// The chat page: wires the model picker, the conversation list, the thread, the
// settings and the composer to the server's API. A turn is POST /c1/chat, streamed,
// with the settings' sampling (and their system prompt where a conversation starts);
// Stop aborts the fetch, and the server stops generating and keeps the partial answer.

import { Api, ApiError, errorOf, events } from "/ui/api.js";
import { Attachments, messageContent } from "/ui/attachments.js";
import { Tree, renderList, shortened, titleFrom, titleOf } from "/ui/conversations.js";
import { ModelPicker } from "/ui/models.js";
import { Settings } from "/ui/settings.js";
import {
  StreamingAnswer,
  messageView,
  contentImages,
  contentText,
  systemView,
} from "/ui/thread.js";

const $ = (id) => document.getElementById(id);
const ui = Object.fromEntries(
  [
    "messages", "message", "send", "stop", "composer", "error", "error-text", "error-close",
    "conversations", "conversations-empty", "conversation-bar", "title", "rename",
    "rename-form", "title-input", "rename-cancel", "delete", "new-chat", "forget-key",
    "key-dialog", "key-form", "key-input", "key-note", "branch-note", "branch-cancel",
    "toggle-sidebar", "sidebar", "model", "load", "load-progress", "load-text", "empty-hint",
    "thread", "more-conversations", "branch-text", "settings", "settings-dialog",
    "new-settings", "model-note", "attachments", "attach", "attach-input",
  ].map((id) => [id.replace(/-(\w)/g, (_, c) => c.toUpperCase()), $(id)]),
);

const state = {
  conversations: [], // the side list, newest first
  conversation: null, // the open one, with its messages; null: a new conversation
  tree: null,
  head: null, // the last message shown (a branch's end)
  branchFrom: undefined, // editing: the parent the next message goes under (null: a root)
  controller: null, // the turn streaming now
  metrics: new Map(), // message id -> the figures measured here
};

// Each dialect's base URL, as this page reached the server.
for (const el of document.querySelectorAll("[data-url]")) {
  el.textContent = location.origin + el.dataset.url;
}

// -- errors and the key ----------------------------------------------------------------

function showError(message) {
  ui.errorText.textContent = message;
  ui.error.hidden = false;
}

function hideError() {
  ui.error.hidden = true;
}

ui.errorClose.addEventListener("click", hideError);

function askKey(refused) {
  return new Promise((resolve, reject) => {
    ui.keyNote.textContent = refused
      ? "That key was refused. Try another."
      : "This server needs an API key.";
    ui.keyInput.value = "";
    ui.keyForm.onsubmit = (event) => {
      event.preventDefault();
      const key = ui.keyInput.value.trim();
      if (!key) return;
      ui.keyDialog.close();
      resolve(key);
    };
    ui.keyDialog.oncancel = () => reject(new ApiError("An API key is needed to use this server.", 401));
    ui.keyDialog.showModal();
  });
}

const api = new Api(askKey);
api.onKeyChange = (has) => {
  ui.forgetKey.hidden = !has;
};
ui.forgetKey.hidden = !api.key;
ui.forgetKey.addEventListener("click", () => {
  api.key = null;
  start();
});

const picker = new ModelPicker(
  api,
  { select: ui.model, box: ui.load, bar: ui.loadProgress, label: ui.loadText },
  showError,
);

picker.onChange = renderModelNote;

/** Under the box, while the picked model cannot chat: say so (a send still goes,
 * and shows the server's error). */
function renderModelNote() {
  const model = picker.cannotChat ? picker.value : "";
  ui.modelNote.textContent = model
    ? `${model} has no chat template (a base model): it cannot chat. Pick another model to talk to.`
    : "";
  if (model) ui.message.setAttribute("aria-describedby", "model-note");
  else ui.message.removeAttribute("aria-describedby");
}

const settings = new Settings(ui.settings, ui.settingsDialog);
settings.onChange = renderNewSettings;

/** On an empty thread: what a new conversation will be sent with, if anything is set. */
function renderNewSettings() {
  const parts = settings.describe((prompt) => `system prompt: “${shortened(prompt, 60)}”`);
  ui.newSettings.textContent = parts.length ? ["New conversation", ...parts].join(" · ") : "";
  ui.newSettings.hidden = parts.length === 0;
}

const attachments = new Attachments(
  {
    list: ui.attachments,
    button: ui.attach,
    input: ui.attachInput,
    dropZone: ui.composer,
    textbox: ui.message,
  },
  showError,
);

// -- the conversations -----------------------------------------------------------------

const PAGE = 100; // the most /c1/conversations gives at once

/** The list from the top (`more`: the next page after what is shown). */
async function refreshList(more = false) {
  const offset = more ? state.conversations.length : 0;
  const page = await api.json(`/c1/conversations?limit=${PAGE}&offset=${offset}`);
  state.conversations = more ? [...state.conversations, ...page.data] : page.data;
  renderList(ui.conversations, state.conversations, state.conversation?.id, openFromList);
  ui.conversationsEmpty.hidden = state.conversations.length > 0;
  ui.moreConversations.hidden = !page.has_more;
}

ui.moreConversations.addEventListener("click", () =>
  refreshList(true).catch((error) => showError(error.message)),
);

/** The head the server continues from (the newest message where it does not say). */
const serverHead = (conversation, tree) => conversation.head_id ?? tree.newest() ?? null;

function install(conversation, head) {
  state.conversation = conversation;
  state.tree = new Tree(conversation.messages);
  state.head = head ?? serverHead(conversation, state.tree);
  history.replaceState(null, "", `#${conversation.id}`);
  renderTitle();
  renderThread();
  renderList(ui.conversations, state.conversations, conversation.id, openFromList);
}

async function openConversation(id) {
  if (state.controller) throw new Error("An answer is still coming: Stop it first.");
  const conversation = await api.json(`/c1/conversations/${encodeURIComponent(id)}`);
  endEdit();
  install(conversation);
  ui.sidebar.classList.remove("open");
  ui.toggleSidebar.setAttribute("aria-expanded", "false");
}

function openFromList(id) {
  hideError();
  openConversation(id).catch((error) => showError(error.message));
}

function newChat() {
  if (state.controller) {
    showError("An answer is still coming: Stop it first.");
    return;
  }
  state.conversation = null;
  state.tree = null;
  state.head = null;
  endEdit();
  history.replaceState(null, "", location.pathname);
  renderTitle();
  renderThread();
  renderList(ui.conversations, state.conversations, null, openFromList);
  ui.message.focus();
}

function renderTitle() {
  const c = state.conversation;
  ui.conversationBar.hidden = !c;
  ui.renameForm.hidden = true;
  if (!c) return;
  ui.title.textContent = titleOf(c);
  ui.title.hidden = false;
  ui.rename.hidden = !("title" in c); // a server without PATCH /c1/conversations/{id}
}

function renderThread() {
  const tree = state.tree;
  const path = tree && state.head ? tree.path(state.head) : [];
  const branching = Boolean(state.conversation && "head_id" in state.conversation);
  ui.messages.replaceChildren(
    ...path.map((message) => {
      const siblings = tree.alternatives(message);
      const index = siblings.indexOf(message);
      return messageView(message, {
        metrics: state.metrics.get(message.id),
        branches: {
          index,
          count: siblings.length,
          onSwitch: (i) => {
            state.head = tree.leaf(siblings[i].id);
            renderThread();
          },
        },
        onEdit: branching && !state.controller ? startEdit : undefined,
      });
    }),
  );
  ui.emptyHint.hidden = path.length > 0;
  renderNewSettings();
  scrollDown(true);
}

function scrollDown(always) {
  const box = ui.thread;
  if (always || box.scrollHeight - box.scrollTop - box.clientHeight < 120) {
    box.scrollTop = box.scrollHeight;
  }
}

// -- rename, delete, branch ------------------------------------------------------------

ui.rename.addEventListener("click", () => {
  ui.titleInput.value = state.conversation?.title ?? "";
  ui.renameForm.hidden = false;
  ui.title.hidden = true;
  ui.titleInput.focus();
  ui.titleInput.select();
});

ui.renameCancel.addEventListener("click", renderTitle);

ui.renameForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const title = ui.titleInput.value.trim();
  if (!title || !state.conversation) return;
  try {
    state.conversation.title = await patchTitle(state.conversation.id, title);
    renderTitle();
    await refreshList();
  } catch (error) {
    showError(error.message);
  }
});

/** Renames a conversation (PATCH); the title the server keeps. */
async function patchTitle(id, title) {
  const updated = await api.json(`/c1/conversations/${encodeURIComponent(id)}`, {
    method: "PATCH",
    body: { title },
  });
  return updated.title;
}

ui.delete.addEventListener("click", async () => {
  const c = state.conversation;
  if (!c || !confirm(`Delete "${titleOf(c)}"? This cannot be undone.`)) return;
  try {
    await api.json(`/c1/conversations/${encodeURIComponent(c.id)}`, { method: "DELETE" });
    newChat();
    await refreshList();
  } catch (error) {
    showError(error.message);
  }
});

function startEdit(message) {
  const opening = state.tree.isOpening(message);
  // The first message: a new root, with the system prompt of the settings now.
  state.branchFrom = opening ? null : (message.parent_id ?? null);
  const system = settings.systemPrompt ? "the system prompt in Settings" : "no system prompt";
  ui.branchText.textContent = opening
    ? `Editing the first message: the answer starts a new branch, with ${system}.`
    : "Editing an earlier message: the answer starts a new branch.";
  ui.message.value = contentText(message.content);
  attachments.set(contentImages(message.content));
  ui.branchNote.hidden = false;
  ui.message.focus();
}

function endEdit() {
  state.branchFrom = undefined;
  ui.branchNote.hidden = true;
}

ui.branchCancel.addEventListener("click", () => {
  endEdit();
  ui.message.value = "";
  attachments.clear();
});

// -- a turn ----------------------------------------------------------------------------

/** parent_id for the next message: the edited message's parent, or the end of the
 * branch on screen when it is not the server's head; undefined: the head. */
function nextParent() {
  if (state.branchFrom !== undefined) return state.branchFrom;
  const c = state.conversation;
  if (c && "head_id" in c && state.head && state.head !== serverHead(c, state.tree)) {
    return state.head;
  }
  return undefined;
}

function setBusy(controller) {
  state.controller = controller;
  ui.send.disabled = Boolean(controller);
  ui.stop.disabled = !controller;
}

async function send() {
  const text = ui.message.value;
  const images = attachments.urls;
  if ((!text.trim() && !images.length) || state.controller) return;
  hideError();
  const content = messageContent(text, images);
  const body = {
    message: content,
    stream: true,
    stream_options: { include_usage: true },
    ...settings.sampling(),
  };
  if (picker.value) body.model = picker.value;
  const c = state.conversation;
  if (c) body.conversation_id = c.id;
  const before = { head: state.head, branchFrom: state.branchFrom };
  const parent = nextParent();
  if (parent !== undefined) {
    body.parent_id = parent;
    state.head = parent; // the thread up to where the new branch starts
    renderThread();
  }
  // A system prompt only where a conversation starts (the server refuses it elsewhere).
  const system = !c || parent === null ? settings.systemPrompt : "";
  if (system) body.system = system;
  endEdit();
  const mine = messageView({ role: "user", content });
  const answer = new StreamingAnswer(picker.value);
  if (system) ui.messages.append(systemView({ content: system }));
  ui.messages.append(mine, answer.article);
  ui.emptyHint.hidden = true;
  ui.message.value = "";
  const attached = attachments.take();
  scrollDown(true);

  const controller = new AbortController();
  setBusy(controller);
  const sent = performance.now();
  let first, last, usage, id, started = false, status = "complete", error;
  try {
    const response = await api.request("/c1/chat", {
      method: "POST",
      body,
      accept: "text/event-stream",
      signal: controller.signal,
    });
    if (!response.ok) throw await errorOf(response);
    started = true;
    id = response.headers.get("x-conversation-id");
    for await (const { event, data } of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (event === "error" || chunk.error) {
        throw new ApiError(chunk.error?.message ?? chunk.error ?? data);
      }
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices ?? []) {
        const delta = choice.delta ?? {};
        if (delta.content || delta.reasoning_content || delta.tool_calls) {
          last = performance.now();
          first ??= last;
        }
        if (delta.reasoning_content) answer.addReasoning(delta.reasoning_content);
        if (delta.content) answer.addText(delta.content);
        for (const call of delta.tool_calls ?? []) answer.addToolCall(call);
      }
      scrollDown(false);
    }
  } catch (caught) {
    status = caught.name === "AbortError" ? "incomplete" : "failed";
    if (status === "failed") {
      error = caught.message;
      showError(caught.message);
    }
  } finally {
    setBusy(null);
  }
  const metrics = figures(sent, first, last, usage);
  answer.finish(status, metrics, error);
  if (!started) {
    // Nothing was stored: the thread (and an edit) are as they were, and the message
    // goes back to the box, to send again.
    Object.assign(state, before);
    ui.branchNote.hidden = state.branchFrom === undefined;
    renderThread();
    ui.message.value = text;
    attachments.restore(attached);
    return;
  }
  try {
    await afterTurn(id ?? c?.id, text.trim() ? text : "Image", metrics, !c);
  } catch (caught) {
    showError(caught.message);
  }
}

/** The answer's figures, measured here: time to first token, tokens per second. */
function figures(sent, first, last, usage) {
  if (first === undefined) return undefined;
  const tokens = usage?.completion_tokens;
  const seconds = (last - first) / 1000;
  return {
    tokens,
    rate: tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : undefined,
    ttft: first - sent,
  };
}

/** The turn as the server stored it (ids for branching, its status): reloaded. A
 * stopped answer is stored when the server notices, so it is waited for a moment. */
async function afterTurn(id, text, metrics, isNew) {
  let conversation;
  for (let tries = 0; tries < 20; tries++) {
    conversation = await api.json(`/c1/conversations/${encodeURIComponent(id)}`);
    const tree = new Tree(conversation.messages);
    if (tree.byId.get(serverHead(conversation, tree))?.role !== "user") break;
    await new Promise((resolve) => setTimeout(resolve, 150));
  }
  const tree = new Tree(conversation.messages);
  const head = serverHead(conversation, tree);
  if (metrics) state.metrics.set(head, metrics);
  if (isNew && "title" in conversation && !conversation.title) {
    conversation.title = await patchTitle(conversation.id, titleFrom(text));
  }
  await refreshList();
  install(conversation, head);
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});

ui.message.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});

ui.stop.addEventListener("click", () => state.controller?.abort());
ui.newChat.addEventListener("click", newChat);
ui.toggleSidebar.addEventListener("click", (event) => {
  event.stopPropagation();
  const open = ui.sidebar.classList.toggle("open");
  ui.toggleSidebar.setAttribute("aria-expanded", String(open));
});
document.querySelector(".main").addEventListener("click", () => {
  ui.sidebar.classList.remove("open"); // a narrow window: the list slides away
  ui.toggleSidebar.setAttribute("aria-expanded", "false");
});

// -- start -----------------------------------------------------------------------------

async function start() {
  try {
    await picker.refresh();
    await refreshList();
    const id = decodeURIComponent(location.hash.slice(1));
    if (id) {
      history.replaceState(null, "", location.pathname); // kept only if it opens
      await openConversation(id);
    } else {
      renderThread();
    }
  } catch (error) {
    showError(error.message);
  }
}

start();
