// Talking to the OpenAI-compatible API: streamed chat completions over server-sent events, and the split
// of a reply into its reasoning and its answer.

const THINK_OPEN = "<think>";
const THINK_CLOSE = "</think>";

// {reasoning, answer, thinking}: text between <think> and </think> is reasoning; a reply that closes the tag
// without opening it (the template opened it in the prompt) is reasoning up to the close; `thinking` is true
// while the tag is still open.
export function splitReasoning(text) {
  const open = text.indexOf(THINK_OPEN);
  const close = text.indexOf(THINK_CLOSE);
  if (close >= 0 && (open < 0 || close < open)) {
    return { reasoning: text.slice(0, close), answer: text.slice(close + THINK_CLOSE.length).trimStart(), thinking: false };
  }
  if (open < 0) return { reasoning: "", answer: text, thinking: false };
  const before = text.slice(0, open);
  const rest = text.slice(open + THINK_OPEN.length);
  const end = rest.indexOf(THINK_CLOSE);
  if (end < 0) return { reasoning: rest, answer: before, thinking: true };
  return { reasoning: rest.slice(0, end), answer: (before + rest.slice(end + THINK_CLOSE.length)).trimStart(), thinking: false };
}

// The data payloads of an SSE body, one string per event; comment lines (": ping") are skipped.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

async function errorMessage(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
  } catch { /* not JSON: keep the status line */ }
  if (response.status === 401) message += " (set the API key in Settings)";
  return message;
}

// Streams one chat completion; calls onDelta({content, reasoning, toolCalls, finish}) per chunk (toolCalls:
// the chunk's `delta.tool_calls`, [] when none). Rejects with an
// AbortError when `signal` fires (the server sees the disconnect and aborts the generation).
export async function streamChat({ apiBase, apiKey, body, signal, onDelta }) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const response = await reach(apiBase, `${apiBase}/v1/chat/completions`, {
    method: "POST", headers, body: JSON.stringify({ ...body, stream: true }), signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  for await (const data of sseData(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message ?? "the server reported an error");
    const choice = chunk.choices?.[0];
    if (!choice) continue;
    const delta = choice.delta ?? {};
    onDelta({
      content: delta.content ?? "",
      reasoning: delta.reasoning_content ?? delta.reasoning ?? "",
      toolCalls: delta.tool_calls ?? [],
      finish: choice.finish_reason ?? null,
    });
  }
  // A stream must end with [DONE]: without it the reply was cut (a proxy timeout, a dropped connection).
  throw new Error("the connection closed before the reply finished");
}

// fetch, but a request that never reached the server says where it was going ("Failed to fetch" did not).
async function reach(apiBase, url, init) {
  try {
    return await fetch(url, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new Error(`cannot reach the API at ${apiBase} (${error.message})`);
  }
}

// GET an API path as JSON (model list), with the key when one is set.
export async function getJSON(apiBase, path, apiKey) {
  const response = await reach(apiBase, `${apiBase}${path}`, { headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : {} });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}
