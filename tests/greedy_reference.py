"""transformers' greedy continuation of a prompt, checked in one forward pass where a guess is right.

Greedy decoding is a chain of argmaxes: a guess of the continuation is transformers' own greedy
continuation exactly when, at each of its positions, transformers' argmax over everything before
it is the guessed token (and the guess stops where greedy stops: at the first EOS or at the
token limit). One forward pass over prompt + guess reads every one of those argmaxes, where
`generate` runs a pass per new token (each reading the whole LM head: most of a small model's
decode time). Where transformers chooses otherwise, its token is taken and `generate` continues
from there, so the result is transformers' greedy continuation whatever the guess was."""

from __future__ import annotations

import torch


def transformers_greedy(model, prompt: list[int], max_new: int, eos: list[int] | set[int],
                        guess: list[int] = (), cache=None) -> list[int]:
    """The greedy continuation (new tokens, cut after the first EOS) of `prompt` under `model`.

    `cache`: transformers' cache of a prefix of the prompt (consumed: pass a copy); the check's
    pass then runs over the rest only."""
    guess = list(guess)[:max_new]
    tokens = _agreeing_prefix(model, prompt, guess, eos, cache) if guess else []
    if (tokens and tokens[-1] in eos) or len(tokens) == max_new:
        return tokens
    return tokens + _generate(model, prompt + tokens, max_new - len(tokens), eos)


def _agreeing_prefix(model, prompt: list[int], guess: list[int], eos, cache) -> list[int]:
    """transformers' argmax at each guessed position, up to and including the first that differs
    from the guess or is an EOS."""
    known = cache.get_seq_length() if cache is not None else 0
    ids = torch.tensor([(prompt + guess)[known:]])
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=cache is not None,
                       logits_to_keep=len(guess) + 1).logits[0, :-1]
    tokens = []
    for chosen, guessed in zip(logits.argmax(dim=-1).tolist(), guess):
        tokens.append(chosen)
        if chosen != guessed or chosen in eos:
            break
    return tokens


def _generate(model, ids: list[int], max_new: int, eos) -> list[int]:
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new, do_sample=False)
    tokens = out[0, len(ids):].tolist()
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
