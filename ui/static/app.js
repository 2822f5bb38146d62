// The chat page: conversations kept in this browser (localStorage), settings, streaming replies with a
// collapsible reasoning view and the answer's tool calls, stop and regenerate, model info.

import { MarkdownView, copyText } from "./markdown.js";
import { getJSON, splitReasoning, streamChat } from "./stream.js";
import { ToolCallsView, addToolCallDeltas } from "./tool_calls.js";

const KEYS = { conversations: "candle-vllm.conversations", current: "candle-vllm.current", settings: "candle-vllm.settings" };
const DEFAULT_SETTINGS = { system: "", temperature: 0.7, top_p: 1, max_tokens: null, thinking: true, api_key: "" };
const $ = (id) => document.getElementById(id);

function load(key, fallback) {
  try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
}

const state = {
  conversations: load(KEYS.conversations, []), // [{id, title, messages: [{role, content, reasoning, tool_calls, finish, error}]}]
  currentId: localStorage.getItem(KEYS.current),
  settings: { ...DEFAULT_SETTINGS, ...load(KEYS.settings, {}) },
  apiBase: "",
  model: null,
  connection: Promise.resolve(), // the last connect(): a reply waits for it, to know where the API is
  running: null, // {controller, conversation}
};

// A reply still streaming when the page went away (it was saved at pagehide) shows as stopped after a reload.
const interrupted = state.conversations.flatMap((c) => c.messages)
  .filter((m) => m.role === "assistant" && m.finish === null && !m.error);
for (const m of interrupted) m.finish = "stopped";
if (interrupted.length) save();

function save() {
  localStorage.setItem(KEYS.conversations, JSON.stringify(state.conversations));
  localStorage.setItem(KEYS.current, state.currentId ?? "");
}

let leaving = false; // the page is being closed or reloaded

const current = () => state.conversations.find((c) => c.id === state.currentId) ?? null;

function notice(text) {
  $("notice").textContent = text ?? "";
  $("notice").hidden = !text;
}

// ---- rendering messages ----

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// One message's DOM and an update() that re-renders it from the stored message.
function messageView(message, isLast) {
  const root = element("article", `message ${message.role}`);
  if (message.role === "user") {
    root.append(element("div", "bubble", message.content));
    return { root, update() {} };
  }
  const details = element("details", "reasoning");
  const summary = element("summary", null, "Reasoning");
  const reasoningBody = element("div", "markdown");
  details.append(summary, reasoningBody);
  const content = element("div", "content markdown");
  const toolCalls = element("div", "tool-calls");
  const status = element("div", "status");
  const actions = element("div", "actions");
  const copyButton = element("button", "copy-message", "Copy");
  copyButton.type = "button";
  copyButton.addEventListener("click", () => copyText(splitReasoning(message.content).answer));
  actions.append(copyButton);
  if (isLast) {
    const regenerate = element("button", "regenerate", "Regenerate");
    regenerate.type = "button";
    regenerate.addEventListener("click", () => regenerateLast());
    actions.append(regenerate);
  }
  root.append(details, content, toolCalls, status, actions);
  const answerView = new MarkdownView(content);
  const reasoningView = new MarkdownView(reasoningBody);
  const toolCallsView = new ToolCallsView(toolCalls);
  return {
    root,
    update(now = false) {
      const split = splitReasoning(message.content);
      const reasoning = [message.reasoning, split.reasoning].filter(Boolean).join("\n\n");
      const live = state.running?.message === message;
      // Still reasoning: an open <think> in the text, or server-split reasoning with no answer yet.
      const thinking = split.thinking || (live && Boolean(message.reasoning) && !split.answer.trim());
      details.hidden = !reasoning;
      summary.textContent = thinking ? "Reasoning…" : "Reasoning";
      reasoningView.set(reasoning, now);
      answerView.set(split.answer, now);
      toolCallsView.update(message.tool_calls);
      status.textContent = message.error ? `Error: ${message.error}`
        : message.finish === "abort" || message.finish === "stopped" ? "Stopped."
        : message.finish === "length" ? "Stopped at the token limit." : "";
      status.className = message.error ? "status error" : "status";
      actions.hidden = live;
    },
  };
}

function renderConversation() {
  const box = $("messages");
  box.replaceChildren();
  const conversation = current();
  if (!conversation || conversation.messages.length === 0) {
    box.append(element("p", "empty", "Start a conversation: type a message below."));
    return;
  }
  const last = conversation.messages.length - 1;
  conversation.messages.forEach((message, i) => {
    const view = messageView(message, i === last && message.role === "assistant");
    box.append(view.root);
    view.update(true);
    if (state.running?.message === message) state.running.view = view;
  });
  box.scrollTop = box.scrollHeight;
}

function renderSidebar() {
  const nav = $("conversations");
  nav.replaceChildren();
  for (const conversation of [...state.conversations].reverse()) {
    const item = element("div", conversation.id === state.currentId ? "conversation active" : "conversation");
    const open = element("button", "open", conversation.title || "New chat");
    open.type = "button";
    open.addEventListener("click", () => { state.currentId = conversation.id; save(); renderAll(); });
    const remove = element("button", "delete", "×");
    remove.type = "button";
    remove.title = "Delete this conversation";
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    item.append(open, remove);
    nav.append(item);
  }
}

function renderAll() {
  renderSidebar();
  renderConversation();
}

function setRunning(running) {
  $("send").hidden = running;
  $("stop").hidden = !running;
  document.body.dataset.state = running ? "running" : "idle";
}

// ---- conversations ----

function newConversation() {
  const empty = state.conversations.find((c) => c.messages.length === 0);
  if (empty) { // "New chat" again reuses the empty one instead of piling them up
    state.currentId = empty.id;
    return empty;
  }
  const conversation = { id: crypto.randomUUID?.() ?? String(Date.now()), title: "", messages: [] };
  state.conversations.push(conversation);
  state.currentId = conversation.id;
  save();
  return conversation;
}

function deleteConversation(id) {
  if (state.running?.conversation.id === id) state.running.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations.at(-1)?.id ?? null;
  save();
  renderAll();
}

// The messages the API sees: the system prompt, then each turn's answer (reasoning is not sent back).
// The turns sent to the API: a failed reply is left out with the user turn it answered (two user turns in a row
// break templates that require alternation), and so is a reply that never got any text (a reload mid-stream).
function apiMessages(messages) {
  const out = state.settings.system ? [{ role: "system", content: state.settings.system }] : [];
  messages.forEach((m, i) => {
    const reply = messages[i + 1];
    if (m.role === "user") {
      if (!(reply?.role === "assistant" && reply.error)) out.push({ role: "user", content: m.content });
    } else if (!m.error && m.content) {
      out.push({ role: "assistant", content: splitReasoning(m.content).answer });
    }
  });
  return out;
}

function requestBody(messages) {
  const s = state.settings;
  const body = { messages: apiMessages(messages), temperature: s.temperature, top_p: s.top_p,
    chat_template_kwargs: { enable_thinking: s.thinking } };
  if (state.model) body.model = state.model;
  if (s.max_tokens) body.max_tokens = s.max_tokens;
  return body;
}

// Rejects with an AbortError when the signal aborts, as fetch does.
function aborted(signal) {
  return new Promise((_, reject) => {
    signal.addEventListener("abort", () => reject(new DOMException("stopped", "AbortError")));
  });
}

async function generate(conversation) {
  const message = { role: "assistant", content: "", reasoning: "", tool_calls: [], finish: null, error: null };
  const history = conversation.messages.slice();
  conversation.messages.push(message);
  save();
  const controller = new AbortController();
  state.running = { controller, conversation, message, view: null };
  setRunning(true);
  renderAll();
  const box = $("messages");
  try {
    await Promise.race([state.connection, aborted(controller.signal)]); // Stop works while the page connects
    if (!state.apiBase) throw new Error("the UI server did not say where the API is");
    await streamChat({
      apiBase: state.apiBase, apiKey: state.settings.api_key, body: requestBody(history), signal: controller.signal,
      onDelta({ content, reasoning, toolCalls, finish }) {
        message.content += content;
        message.reasoning += reasoning;
        addToolCallDeltas(message.tool_calls, toolCalls);
        if (finish) message.finish = finish;
        const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
        state.running.view?.update();
        if (atBottom) box.scrollTop = box.scrollHeight;
      },
    });
  } catch (error) {
    if (error.name === "AbortError" || leaving) message.finish = "stopped"; // leaving: the page closed the stream
    else message.error = error.message;
  } finally {
    state.running = null;
    setRunning(false);
    save();
    renderConversation(); // shows the final text, its status and the message's actions
  }
}

function send(text) {
  if (state.running || !text.trim()) return;
  const conversation = current() ?? newConversation();
  if (!conversation.title) conversation.title = text.trim().slice(0, 60);
  conversation.messages.push({ role: "user", content: text });
  generate(conversation);
}

function regenerateLast() {
  const conversation = current();
  if (state.running || !conversation || conversation.messages.at(-1)?.role !== "assistant") return;
  conversation.messages.pop();
  generate(conversation);
}

// ---- settings and model info ----

function number(input, fallback) {
  const value = input.value.trim() === "" ? NaN : Number(input.value);
  return Number.isFinite(value) && input.checkValidity() ? value : fallback;
}

function openSettings() {
  const s = state.settings;
  $("set-system").value = s.system;
  $("set-temperature").value = s.temperature;
  $("set-top-p").value = s.top_p;
  $("set-max-tokens").value = s.max_tokens ?? "";
  $("set-thinking").checked = s.thinking;
  $("set-api-key").value = s.api_key;
  $("settings").showModal();
}

function saveSettings() {
  state.settings = {
    system: $("set-system").value,
    temperature: number($("set-temperature"), DEFAULT_SETTINGS.temperature),
    top_p: number($("set-top-p"), DEFAULT_SETTINGS.top_p),
    max_tokens: number($("set-max-tokens"), null),
    thinking: $("set-thinking").checked,
    api_key: $("set-api-key").value.trim(),
  };
  localStorage.setItem(KEYS.settings, JSON.stringify(state.settings));
  state.connection = connect();
}

function showInfo(facts) {
  const list = $("info-list");
  list.replaceChildren();
  const labels = { model: "Model", max_model_len: "Context length", device: "Device", dtype: "Dtype",
    quantization: "Quantization", kv_cache_tokens: "KV cache (tokens)", api: "API" };
  for (const [key, label] of Object.entries(labels)) {
    if (facts[key] === undefined) continue;
    list.append(element("dt", null, label), element("dd", null, String(facts[key])));
  }
}

// Read the UI server's config, then ask the API for its model (which also checks the key).
async function connect() {
  try {
    const config = await (await fetch("/config.json")).json();
    const api = new URL(location.origin); // an IPv6 host keeps its brackets (location.hostname has them already)
    api.port = String(config.api_port);
    state.apiBase = api.origin;
    showInfo({ ...config.engine, api: `${state.apiBase}/v1` });
    $("model-name").textContent = config.engine.model;
    const models = await getJSON(state.apiBase, "/v1/models", state.settings.api_key);
    state.model = models.data?.[0]?.id ?? null;
    if (state.model) $("model-name").textContent = state.model;
    notice(null);
  } catch (error) {
    notice(`The API did not answer: ${error.message}`);
  }
}

function wire() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.running || !prompt.value.trim()) return;
    send(prompt.value);
    prompt.value = "";
    prompt.style.height = "";
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  prompt.addEventListener("input", () => {
    prompt.style.height = "";
    prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`;
  });
  $("stop").addEventListener("click", () => state.running?.controller.abort());
  $("new-chat").addEventListener("click", () => { if (!state.running) { newConversation(); renderAll(); } });
  // Closing or reloading the tab mid-reply: the reply keeps its text and shows as stopped, not as an error.
  window.addEventListener("beforeunload", () => { leaving = true; });
  window.addEventListener("pagehide", () => { leaving = true; save(); });
  $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("no-sidebar"));
  $("settings-button").addEventListener("click", openSettings);
  // Saved as the form submits (Save, or Enter in a field: Save is the form's one submit button): the dialog's close
  // event comes a task later, and a prompt sent in between went out with the old settings.
  $("settings").querySelector("form").addEventListener("submit", saveSettings);
  $("cancel-settings").addEventListener("click", () => $("settings").close());
  $("info-button").addEventListener("click", () => $("info").showModal());
  $("messages").addEventListener("click", async (event) => {
    const button = event.target.closest("button.copy");
    if (!button) return;
    await copyText(button.closest(".codeblock").querySelector("code").textContent);
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
}

wire();
setRunning(false);
renderAll();
state.connection = connect();
