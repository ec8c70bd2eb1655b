// Images attached to the next message: from the Image button's file picker, pasted,
// or dropped on the composer. Each is read here as a data: URI and shown as a
// thumbnail with its own remove button; a send takes them as OpenAI content parts
// (the server reads the bytes, whatever type the file claims). Nothing leaves the
// page until the message is sent.

const MAX_IMAGES = 16; // what the server takes in one request
const MAX_BYTES = 20 * 2 ** 20; // one image (the server's limit too)

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error ?? new Error(`Cannot read ${file.name}.`));
    reader.readAsDataURL(file);
  });
}

/** The text and images of a message as `message` for /c1/chat: the text alone when
 * there is no image, else content parts (the text part first, if any). */
export function messageContent(text, images) {
  if (!images.length) return text;
  const parts = text.trim() ? [{ type: "text", text }] : [];
  return [...parts, ...images.map((url) => ({ type: "image_url", image_url: { url } }))];
}

export class Attachments {
  /** `list`: where the thumbnails go; `input`: the file input the button opens;
   * `dropZone`: what takes dropped files; `textbox`: what takes pasted ones. */
  constructor({ list, button, input, dropZone, textbox }, showError) {
    this.list = list;
    this.showError = showError;
    this.images = []; // {name, url}
    button.addEventListener("click", () => input.click());
    input.addEventListener("change", () => {
      this.add(input.files);
      input.value = ""; // the same file may be picked again
    });
    textbox.addEventListener("paste", (event) => {
      const files = [...(event.clipboardData?.files ?? [])];
      if (files.some((file) => file.type.startsWith("image/"))) this.add(files);
    });
    const dragging = (event) => [...(event.dataTransfer?.types ?? [])].includes("Files");
    dropZone.addEventListener("dragover", (event) => {
      if (!dragging(event)) return;
      event.preventDefault();
      event.dataTransfer.dropEffect = "copy";
      dropZone.classList.add("dropping");
    });
    dropZone.addEventListener("dragleave", (event) => {
      if (!dropZone.contains(event.relatedTarget)) dropZone.classList.remove("dropping");
    });
    dropZone.addEventListener("drop", (event) => {
      dropZone.classList.remove("dropping");
      if (!dragging(event)) return;
      event.preventDefault();
      this.add(event.dataTransfer.files);
    });
    // A file dropped beside the composer must not replace the page with itself.
    window.addEventListener("dragover", (event) => {
      if (!dragging(event) || dropZone.contains(event.target)) return;
      event.preventDefault();
      event.dataTransfer.dropEffect = "none";
    });
    window.addEventListener("drop", (event) => {
      if (dragging(event)) event.preventDefault();
    });
  }

  /** The data: URIs, in the order attached. */
  get urls() {
    return this.images.map((image) => image.url);
  }

  /** Reads `files` (a FileList or an array): images only, within the limits; what
   * is refused is said, the rest attached. */
  async add(files) {
    const refused = [];
    for (const file of files) {
      if (!file.type.startsWith("image/")) {
        refused.push(`${file.name} is not an image.`);
      } else if (file.size > MAX_BYTES) {
        refused.push(`${file.name} is over ${MAX_BYTES / 2 ** 20} MiB.`);
      } else if (this.images.length >= MAX_IMAGES) {
        refused.push(`At most ${MAX_IMAGES} images go with one message.`);
        break;
      } else {
        try {
          this.images.push({ name: file.name || "pasted image", url: await readAsDataUrl(file) });
        } catch (error) {
          refused.push(error.message);
        }
      }
    }
    this.render();
    if (refused.length) this.showError(refused.join(" "));
  }

  /** Replaces the attachments (`urls`: data: URIs, e.g. an edited message's). */
  set(urls) {
    this.restore(urls.map((url, i) => ({ name: `Image ${i + 1}`, url })));
  }

  clear() {
    this.restore([]);
  }

  /** What is attached, taken out of the composer (a send); `restore` puts it back. */
  take() {
    const images = this.images;
    this.clear();
    return images;
  }

  restore(images) {
    this.images = images;
    this.render();
  }

  render() {
    this.list.replaceChildren(
      ...this.images.map((image, i) => {
        const item = document.createElement("li");
        const img = document.createElement("img");
        img.src = image.url;
        img.alt = image.name;
        img.title = image.name;
        const remove = document.createElement("button");
        remove.type = "button";
        remove.className = "remove";
        remove.textContent = "×";
        remove.setAttribute("aria-label", `Remove ${image.name}`);
        remove.addEventListener("click", () => {
          this.images.splice(i, 1);
          this.render();
        });
        item.append(img, remove);
        return item;
      }),
    );
    this.list.hidden = this.images.length === 0;
  }
}
