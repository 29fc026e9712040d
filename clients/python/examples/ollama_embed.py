"""Wrapping provider calls with the ledger: Ollama embeddings through a
capped lane (asyncio), and an OpenAI-compatible chat call (sync).

    INFLIGHT_URL=http://127.0.0.1:7878 OLLAMA_URL=http://127.0.0.1:11434 \\
        python examples/ollama_embed.py "first text" "second text"

Every call is begun, waits for a slot on ``knowledge-base::ollama`` (the
server's config caps it), runs, and is settled by how its block exits; a
cancelled task or a timeout records it ``cancelled``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Dict, List, Optional

import httpx

from inflight_ledger import AsyncLedger, Ledger


async def embed(
    ledger: AsyncLedger,
    http: httpx.AsyncClient,
    text: str,
    *,
    ollama_url: str,
    model: str = "nomic-embed-text",
    timeout: Optional[float] = 60.0,
) -> List[float]:
    """Embeds one text with Ollama's ``/api/embed``, as one ledger record."""
    async with ledger.activity(
        service="knowledge-base",
        provider="ollama",
        class_="embedding",
        operation_stage="kb-ingest",
        model=model,
        timeout=timeout,
    ):
        response = await http.post(f"{ollama_url}/api/embed", json={"model": model, "input": text})
        response.raise_for_status()  # an error leaves the block: recorded `failed` at the provider
        return response.json()["embeddings"][0]


def chat(
    ledger: Ledger,
    messages: List[Dict[str, str]],
    *,
    base_url: str,
    model: str = "gpt-4o-mini",
    api_key: Optional[str] = None,
) -> str:
    """One chat completion from an OpenAI-compatible server, as one ledger record."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with ledger.activity(
        service="assistant", provider="openai", class_="chat", operation_stage="answer",
        model=model, priority="interactive",
    ):
        response = httpx.post(
            f"{base_url}/v1/chat/completions", json={"model": model, "messages": messages},
            headers=headers, timeout=120,
        )
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"]


async def main(texts: List[str]) -> None:
    ollama_url = os.environ.get("OLLAMA_URL", "http://127.0.0.1:11434")
    async with AsyncLedger() as ledger, httpx.AsyncClient(timeout=60) as http:  # INFLIGHT_URL, INFLIGHT_TOKEN
        async with await ledger.join_as_owner("kb-embedder", ttl=30, release_on_signals=True):
            vectors = await asyncio.gather(*(embed(ledger, http, t, ollama_url=ollama_url) for t in texts))
            for text, vector in zip(texts, vectors):
                print(f"{text}: {len(vector)} dimensions")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
