// Conversations kept on the server (/c1): the side list, and a conversation's
// messages as a tree (each names its parent) shown as one path, root to head. A
// root may be a system prompt, with the first user message under it.

/** The messages of one conversation as a tree. */
export class Tree {
  constructor(messages) {
    this.byId = new Map(messages.map((m) => [m.id, m]));
    this.children = new Map(); // parent id ("" for a root) -> its children, oldest first
    for (const m of messages) {
      const key = m.parent_id ?? "";
      if (!this.children.has(key)) this.children.set(key, []);
      this.children.get(key).push(m);
    }
  }

  /** The messages from the root to `headId`. */
  path(headId) {
    const out = [];
    for (let m = this.byId.get(headId); m; m = this.byId.get(m.parent_id)) out.push(m);
    return out.reverse();
  }

  /** `message` and its siblings (the other answers to its parent), oldest first. */
  siblings(message) {
    return this.children.get(message.parent_id ?? "") ?? [message];
  }

  /** Whether `message` is a conversation's first user message: a root, or under a
   * root system prompt. Editing it starts a new root (a new system + user pair). */
  isOpening(message) {
    if (message.role !== "user") return false;
    const parent = this.byId.get(message.parent_id);
    return !parent || (parent.role === "system" && !parent.parent_id);
  }

  /** The versions of a message to switch between, oldest first: its siblings, or,
   * for a first user message, every first user message (each root's, whether the
   * root is that message or a system prompt above it). */
  alternatives(message) {
    if (!this.isOpening(message)) return this.siblings(message);
    return (this.children.get("") ?? []).flatMap((root) =>
      root.role === "system"
        ? (this.children.get(root.id) ?? []).filter((m) => m.role === "user")
        : [root],
    );
  }

  /** The newest leaf under `id`: where a branch picked by its first message leads. */
  leaf(id) {
    let last = this.byId.get(id);
    for (let kids = this.children.get(id); kids?.length; kids = this.children.get(last.id)) {
      last = kids[kids.length - 1];
    }
    return last?.id;
  }

  /** The newest message: the head, when the server does not say. */
  newest() {
    let newest;
    for (const m of this.byId.values()) newest = m;
    return newest?.id;
  }
}

/** A conversation's name in the list and the title bar. */
export function titleOf(conversation) {
  if (conversation.title) return conversation.title;
  const when = new Date(conversation.created_at * 1000);
  return `Conversation of ${when.toLocaleString()}`;
}

/** A title from the first message: its first line, cut at a word near 60 characters. */
export function titleFrom(text) {
  return shortened(text.trim().split("\n")[0], 60);
}

/** `text` on one line, cut at a word near `most` characters (… where it is cut). */
export function shortened(text, most) {
  const line = text.replace(/\s+/g, " ").trim();
  if (line.length <= most) return line;
  const cut = line.slice(0, most);
  const space = cut.lastIndexOf(" ");
  return `${space > most / 2 ? cut.slice(0, space) : cut}…`;
}

/** The side list: one button per conversation, the open one marked. */
export function renderList(list, conversations, currentId, open) {
  list.replaceChildren(
    ...conversations.map((c) => {
      const item = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      button.className = "conv";
      button.textContent = titleOf(c);
      button.title = `${c.message_count} messages${c.model ? `, ${c.model}` : ""}`;
      if (c.id === currentId) button.setAttribute("aria-current", "true");
      button.addEventListener("click", () => open(c.id));
      item.append(button);
      return item;
    }),
  );
}
