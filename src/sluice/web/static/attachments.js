// Images attached to the next message: from the Image button's file picker, pasted,
// or dropped on the composer. Each is read here as a data: URI (a large one scaled
// down first) and shown as a thumbnail with its own remove button; a send takes them as OpenAI content parts
// (the server reads the bytes, whatever type the file claims). Nothing leaves the
// page until the message is sent.

const MAX_IMAGES = 16; // what the server takes in one request
const MAX_BYTES = 20 * 2 ** 20; // one image (the server's limit too)
// A larger image is scaled down to this many pixels on its longer side (vision
// projectors scale every image down to far less) and sent as JPEG, as is a file over
// SHRINK_BYTES: a phone's photo would otherwise fill most of a request's body limit.
const MAX_SIDE = 2048;
const SHRINK_BYTES = 2 * 2 ** 20;
const JPEG_QUALITY = 0.9;

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error ?? new Error(`Cannot read ${file.name}.`));
    reader.readAsDataURL(file);
  });
}

function decoded(url) {
  const image = new Image();
  image.src = url;
  return image.decode().then(() => image);
}

/** `url` (the data: URI of `file`) as it goes with the message: scaled down and
 * re-encoded when it is large (see MAX_SIDE), else as it is; `scaled` says to what
 * size, if it was. An image the browser cannot decode goes as it is (the server
 * says what it makes of it). */
async function fitted(file, url) {
  let image;
  try {
    image = await decoded(url);
  } catch {
    return { url, scaled: "" };
  }
  const [width, height] = [image.naturalWidth, image.naturalHeight];
  const scale = Math.min(1, MAX_SIDE / Math.max(width, height));
  if (scale === 1 && file.size <= SHRINK_BYTES) return { url, scaled: "" };
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(width * scale));
  canvas.height = Math.max(1, Math.round(height * scale));
  const context = canvas.getContext("2d");
  context.fillStyle = "#fff"; // JPEG has no transparency: what was clear shows white
  context.fillRect(0, 0, canvas.width, canvas.height);
  context.drawImage(image, 0, 0, canvas.width, canvas.height);
  const jpeg = canvas.toDataURL("image/jpeg", JPEG_QUALITY);
  if (scale === 1 && jpeg.length >= url.length) return { url, scaled: "" }; // no smaller
  return { url: jpeg, scaled: `${canvas.width}×${canvas.height}` };
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
          const { url, scaled } = await fitted(file, await readAsDataUrl(file));
          this.images.push({ name: file.name || "pasted image", url, scaled });
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
        img.title = image.scaled ? `${image.name} (sent at ${image.scaled})` : image.name;
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
