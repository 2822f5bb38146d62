// Tool calls of an assistant answer: accumulated from streamed `delta.tool_calls` as OpenAI clients do, and
// shown under the answer as compact blocks (function name, arguments pretty-printed) that grow as the
// argument fragments arrive. Everything goes in as text, never as markup.

// Adds one chunk's tool-call deltas to `calls` (OpenAI message shape): by index, the id when given, name and
// argument fragments appended.
export function addToolCallDeltas(calls, deltas) {
  for (const d of deltas ?? []) {
    const call = (calls[d.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (d.id) call.id = d.id;
    if (d.function?.name) call.function.name += d.function.name;
    if (d.function?.arguments) call.function.arguments += d.function.arguments;
  }
}

// JSON text, complete or cut anywhere, indented by two spaces per level. What is written out is never taken
// back as more text arrives (a line break after an opener waits for the next token, so `{}` stays one
// piece), so a streaming block only grows; complete JSON comes out as JSON.stringify(value, null, 2) lays it
// out, with the model's own number and string spellings kept.
export function prettyJSON(text) {
  let out = "";
  let depth = 0;
  let inString = false;
  let escaped = false;
  let opened = false; // the last token was { or [: its line break waits
  const newline = (level) => `\n${"  ".repeat(level)}`;
  for (const ch of text) {
    if (inString) {
      out += ch;
      if (escaped) escaped = false;
      else if (ch === "\\") escaped = true;
      else if (ch === '"') inString = false;
      continue;
    }
    if (ch === " " || ch === "\t" || ch === "\n" || ch === "\r") continue;
    const closing = ch === "}" || ch === "]";
    if (opened) {
      opened = false;
      if (!closing) out += newline(depth);
    } else if (closing) {
      out += newline(depth - 1);
    }
    if (closing) depth = Math.max(0, depth - 1);
    out += ch === ":" ? ": " : ch;
    if (ch === '"') inString = true;
    else if (ch === "{" || ch === "[") { depth += 1; opened = true; }
    else if (ch === ",") out += newline(depth);
  }
  return out;
}

function block() {
  const root = document.createElement("div");
  root.className = "tool-call";
  const name = document.createElement("div");
  name.className = "tool-name";
  const args = document.createElement("pre");
  args.className = "tool-args";
  root.append(name, args);
  return { root, name, args };
}

// The blocks of one message's calls; update() brings them up to date with `calls` (only changed text is set).
export class ToolCallsView {
  constructor(container) {
    this.container = container;
    this.blocks = [];
  }

  update(calls) {
    const present = (calls ?? []).filter(Boolean);
    this.container.hidden = present.length === 0;
    present.forEach((call, i) => {
      if (!this.blocks[i]) {
        this.blocks[i] = block();
        this.container.append(this.blocks[i].root);
      }
      const { name, args } = this.blocks[i];
      const shownName = call.function?.name || "(unnamed call)";
      const shownArgs = prettyJSON(call.function?.arguments ?? "");
      if (name.textContent !== shownName) name.textContent = shownName;
      if (args.textContent !== shownArgs) args.textContent = shownArgs;
    });
  }
}
