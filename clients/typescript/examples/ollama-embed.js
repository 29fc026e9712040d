// Wrapping provider calls with the ledger: Ollama embeddings through a
// capped lane, and an OpenAI-compatible chat call with a timeout.
//
//   INFLIGHT_URL=http://127.0.0.1:7878 OLLAMA_URL=http://127.0.0.1:11434 \
//     node examples/ollama-embed.js "first text" "second text"
//
// Every call is begun, waits for a slot on `knowledge-base::ollama` (the
// server's config caps it), runs, and is settled by how it ends; an abort or
// a timeout records it `cancelled` and aborts the HTTP call to the provider.
import { InflightClient } from "inflight-ledger";

/** Embeds one text with Ollama's `/api/embed`, as one ledger record. */
export function embed(client, text, { ollamaUrl, model = "nomic-embed-text", signal, timeoutMs = 60_000 }) {
  return client.run(
    { service: "knowledge-base", provider: "ollama", class: "embedding", operationStage: "kb-ingest", model },
    async (callSignal) => {
      const res = await fetch(`${ollamaUrl}/api/embed`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ model, input: text }),
        signal: callSignal, // aborted on the caller's abort or the timeout
      });
      if (!res.ok) throw new Error(`ollama answered ${res.status}`); // recorded `failed` at the provider
      const body = await res.json();
      return body.embeddings[0];
    },
    { signal, timeoutMs },
  );
}

/** One chat completion from an OpenAI-compatible server, as one ledger record. */
export function chat(client, messages, { baseUrl, model = "gpt-4o-mini", apiKey, signal, timeoutMs = 120_000 }) {
  return client.run(
    { service: "assistant", provider: "openai", class: "chat", operationStage: "answer", model, priority: "interactive" },
    async (callSignal) => {
      const res = await fetch(`${baseUrl}/v1/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json", ...(apiKey ? { authorization: `Bearer ${apiKey}` } : {}) },
        body: JSON.stringify({ model, messages }),
        signal: callSignal,
      });
      if (!res.ok) throw new Error(`the provider answered ${res.status}`);
      const body = await res.json();
      return body.choices[0].message.content;
    },
    { signal, timeoutMs },
  );
}

// Run as a script: embed the arguments, concurrently; the lane's cap decides
// how many reach Ollama at once.
if (import.meta.url === `file://${process.argv[1]}`) {
  const client = new InflightClient(); // INFLIGHT_URL, INFLIGHT_TOKEN
  const lease = await client.joinAsOwner("kb-embedder", 30_000, { releaseOnSignals: true });
  const ollamaUrl = process.env.OLLAMA_URL ?? "http://127.0.0.1:11434";
  try {
    const texts = process.argv.slice(2);
    const vectors = await Promise.all(texts.map((t) => embed(client, t, { ollamaUrl })));
    vectors.forEach((v, i) => console.log(`${texts[i]}: ${v.length} dimensions`));
  } finally {
    await lease.release();
  }
}
