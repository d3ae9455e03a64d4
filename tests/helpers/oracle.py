"""The reference outputs tests compare with: transformers' own greedy continuation."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int,
              guess: list[int] | None = None) -> tuple[list[int], list[float]]:
    """The oracle: transformers' greedy continuation, end-of-sequence ignored; the chosen
    tokens and their raw logprobs. Runs on the model's device.

    guess: tokens believed to be that continuation (an engine's output). One forward over
    prompt + guess scores them all, and one token at a time resumes only from the first
    token transformers would not choose: the result is transformers' own either way, in a
    fraction of the time when the guess is right (~150 ms a token on two CPU cores)."""
    device = next(model.parameters()).device
    tokens, logprobs = [], []
    with torch.no_grad():
        if guess:
            guess = list(guess[:max_new_tokens])
            logits = model(torch.tensor([prompt_ids + guess], device=device)).logits[0]
            lp = torch.log_softmax(logits[len(prompt_ids) - 1:].float(), -1)
            for i in range(len(guess) + 1):
                tok = int(lp[i].argmax())
                tokens.append(tok)
                logprobs.append(lp[i, tok].item())
                if len(tokens) == max_new_tokens or i == len(guess) or tok != guess[i]:
                    break
        ids, past = torch.tensor([prompt_ids + tokens], device=device), None
        for _ in range(max_new_tokens - len(tokens)):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(lp[tok].item())
            ids = torch.tensor([[tok]], device=device)
    return tokens, logprobs


def greedy_reference(model, llm, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of `prompts`, with the offline engine's outputs
    as hf_greedy's guesses (the oracle stays transformers; the engine only saves it time)."""
    from rlserve import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True))
    return [hf_greedy(model, o.prompt_token_ids, max_new_tokens, guess=o.outputs[0].token_ids)[0]
            for o in outs]
