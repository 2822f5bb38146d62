// Markdown views: the UI server renders markdown to sanitized, highlighted HTML (POST /render); a view
// re-renders at most once per RENDER_DEBOUNCE_MS while text streams in, one request in flight at a time.

const RENDER_DEBOUNCE_MS = 80;
const CACHE_ENTRIES = 256; // rendered texts kept, so re-drawing a conversation costs no requests
const cache = new Map();

// `keep`: remember the result (finished texts; the prefixes of a stream are not worth a cache slot).
async function renderRemote(text, keep) {
  if (cache.has(text)) return cache.get(text);
  const response = await fetch("/render", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ texts: [text] }),
  });
  if (!response.ok) throw new Error(`render failed: ${response.status}`);
  const [html] = (await response.json()).html;
  if (keep) {
    cache.set(text, html);
    if (cache.size > CACHE_ENTRIES) cache.delete(cache.keys().next().value);
  }
  return html;
}

export class MarkdownView {
  constructor(element) {
    this.element = element;
    this.wanted = "";
    this.shown = null;
    this.timer = null;
    this.busy = false;
    this.final = false;
  }

  // Show `text`; `now` skips the debounce (a finished reply, a stored conversation).
  set(text, now = false) {
    this.wanted = text;
    this.final = now;
    if (this.busy) return;
    if (now) {
      clearTimeout(this.timer);
      this.timer = null;
      this.flush();
    } else if (this.timer === null) {
      this.timer = setTimeout(() => { this.timer = null; this.flush(); }, RENDER_DEBOUNCE_MS);
    }
  }

  async flush() {
    const text = this.wanted;
    if (text === this.shown) return;
    this.busy = true;
    try {
      this.element.innerHTML = await renderRemote(text, this.final);
    } catch {
      this.element.textContent = text; // the UI server went away: plain text still reads fine
    } finally {
      this.shown = text;
      this.busy = false;
    }
    if (this.wanted !== this.shown) this.set(this.wanted, this.final);
  }
}

export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea"); // plain-HTTP pages have no clipboard API
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}
